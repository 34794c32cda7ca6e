// gact/policy/estimator.cpp
//
// The reference (perturbation) and online sensitivity estimators. See
// estimator.hpp for the formulas and policy/README.md for the derivations.
#include "policy/estimator.hpp"

#include <algorithm>
#include <cmath>

namespace gact::policy {

namespace {

void expect_nonneg_finite(double x, char const* what) {
  GACT_EXPECTS(std::isfinite(x) && x >= 0.0,
               std::string(what) + " must be finite and >= 0, got " + std::to_string(x));
}

}  // namespace

double squared_distance(std::span<float const> a, std::span<float const> b) {
  GACT_EXPECTS(a.size() == b.size(), "squared_distance: gradient sizes differ (" +
                                         std::to_string(a.size()) + " vs " + std::to_string(b.size()) + ")");
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double const d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    s += d * d;
  }
  return s;
}

double perturbation_sensitivity(std::span<probe_pair const> pairs) {
  GACT_EXPECTS(!pairs.empty(), "perturbation_sensitivity: no probe pairs");
  double num = 0.0, den = 0.0;
  for (auto const& p : pairs) {
    expect_nonneg_finite(p.sq_distance, "perturbation_sensitivity: squared distance");
    num += p.sq_distance;
    den += variance_factor(p.bits_a) + variance_factor(p.bits_b);
  }
  GACT_EXPECTS(den > 0.0, "perturbation_sensitivity: every pair is full precision on both sides; "
                          "the differences carry no information about C");
  return num / den;
}

double perturbation_sensitivity(std::span<float const> g0, std::span<float const> g1,
                                std::span<float const> g2) {
  GACT_EXPECTS(!g0.empty(), "perturbation_sensitivity: empty gradients");
  probe_pair const pairs[] = {
      {1, 1, squared_distance(g0, g1)},
      {1, 8, squared_distance(g0, g2)},
      {1, 8, squared_distance(g1, g2)},
  };
  return perturbation_sensitivity(pairs);
}

double gact_sensitivity(std::span<float const> g0, std::span<float const> g1, std::span<float const> g2) {
  GACT_EXPECTS(!g0.empty(), "gact_sensitivity: empty gradients");
  double const d01 = squared_distance(g0, g1);
  double const d02 = squared_distance(g0, g2);
  double const d12 = squared_distance(g1, g2);
  return std::max(d01, 2.0 * std::max(d02, d12));
}

double online_sensitivity(online_sample const& s) {
  GACT_EXPECTS(s.numel > 0, "online_sensitivity: numel must be > 0");
  GACT_EXPECTS(s.group_size > 0, "online_sensitivity: group_size must be > 0");
  expect_nonneg_finite(s.sum_sq_ranges, "online_sensitivity: sum_sq_ranges");
  expect_nonneg_finite(s.grad_sq_norm, "online_sensitivity: grad_sq_norm");
  expect_nonneg_finite(s.fan_in, "online_sensitivity: fan_in");
  double const mean_sq_step = static_cast<double>(s.group_size) * s.sum_sq_ranges /
                              static_cast<double>(s.numel);  // ≈ mean over elements of R_g²
  double const c = s.fan_in * s.grad_sq_norm * mean_sq_step / 6.0;
  GACT_EXPECTS(std::isfinite(c), "online_sensitivity: the product overflows");
  return c;
}

void online_accumulator::add(std::string_view key, online_sample const& s) {
  GACT_EXPECTS(!key.empty(), "online_accumulator: empty tensor key");
  double const c = online_sensitivity(s);
  auto it = sums_.find(key);
  if (it == sums_.end()) it = sums_.emplace(std::string(key), acc{}).first;
  it->second.sum += c;
  ++it->second.count;
}

std::map<std::string, double> online_accumulator::take() {
  std::map<std::string, double> out;
  for (auto const& [k, a] : sums_) out.emplace(k, a.sum / static_cast<double>(a.count));
  sums_.clear();
  return out;
}

}  // namespace gact::policy
