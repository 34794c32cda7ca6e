// gact/policy/records.cpp
//
// The record table: observation, lookup with a default, EMA of sensitivities,
// staleness and eviction. See records.hpp.
#include "policy/records.hpp"

#include "policy/solver.hpp"

#include <algorithm>
#include <cmath>

namespace gact::policy {

void table_options::validate() const {
  GACT_EXPECTS(is_code_bits(default_bits) || is_full_bits(default_bits),
               "policy default_bits must be 1, 2, 4, 8, 16 or 32, got " + std::to_string(default_bits));
  GACT_EXPECTS(std::isfinite(ema_weight) && ema_weight > 0.0 && ema_weight <= 1.0,
               "policy ema_weight must be in (0, 1], got " + std::to_string(ema_weight));
  GACT_EXPECTS(stale_after >= 0, "policy stale_after must be >= 0, got " + std::to_string(stale_after));
  storage.validate();
}

record_table::record_table(table_options opts) : opts_(std::move(opts)) { opts_.validate(); }

record const& record_table::observe(std::string_view key, std::uint64_t numel, std::int64_t step,
                                    int full_bits, int min_bits) {
  GACT_EXPECTS(!key.empty(), "policy observe: empty tensor key");
  GACT_EXPECTS(numel > 0, "policy observe: tensor '" + std::string(key) + "' has numel 0");
  GACT_EXPECTS(is_full_bits(full_bits), "policy observe: tensor '" + std::string(key) +
                                            "' full_bits must be 16 or 32, got " + std::to_string(full_bits));
  GACT_EXPECTS(is_code_bits(min_bits), "policy observe: tensor '" + std::string(key) +
                                           "' min_bits must be 1, 2, 4 or 8, got " + std::to_string(min_bits));
  auto it = records_.find(key);
  if (it == records_.end()) {
    record r;
    r.bits = opts_.default_bits;
    r.first_seen = step;
    r.last_seen = step;
    it = records_.emplace(std::string(key), r).first;
  }
  record& r = it->second;
  r.numel = numel;
  r.groups = opts_.storage.groups(numel);
  r.full_bits = full_bits;
  r.min_bits = min_bits;
  if (is_full_bits(r.bits) && r.bits != full_bits) r.bits = full_bits;  // full precision follows dtype
  r.last_seen = std::max(r.last_seen, step);
  return r;
}

int record_table::bits_for(std::string_view key) const noexcept {
  auto it = records_.find(key);
  if (it == records_.end()) return opts_.default_bits;
  return it->second.bits;
}

void record_table::add_estimate(std::string_view key, double c) {
  auto it = records_.find(key);
  GACT_EXPECTS(it != records_.end(), "policy add_estimate: unknown tensor key '" + std::string(key) +
                                         "' (observe it first)");
  GACT_EXPECTS(std::isfinite(c) && c >= 0.0, "policy add_estimate: sensitivity of '" + std::string(key) +
                                                 "' must be finite and >= 0, got " + std::to_string(c));
  record& r = it->second;
  r.sensitivity = (r.estimates == 0) ? c : (1.0 - opts_.ema_weight) * r.sensitivity + opts_.ema_weight * c;
  for (std::size_t i = 0; i < 4; ++i) r.variance[i] = r.sensitivity * variance_factor(k_code_bits[i]);
  r.per_width = false;
  ++r.estimates;
}

void record_table::add_estimate_widths(std::string_view key, std::array<double, 4> const& v) {
  auto it = records_.find(key);
  GACT_EXPECTS(it != records_.end(), "policy add_estimate_widths: unknown tensor key '" + std::string(key) +
                                         "' (observe it first)");
  for (double x : v) {
    GACT_EXPECTS(std::isfinite(x) && x >= 0.0, "policy add_estimate_widths: a variance of '" + std::string(key) +
                                                   "' is negative or not finite: " + std::to_string(x));
  }
  record& r = it->second;
  double const w = r.estimates == 0 ? 1.0 : opts_.ema_weight;
  for (std::size_t i = 0; i < 4; ++i) r.variance[i] = (1.0 - w) * r.variance[i] + w * v[i];
  r.sensitivity = r.variance[0];
  r.per_width = true;
  ++r.estimates;
}

void record_table::raise_variance(std::string_view key, int bits, double v) {
  auto it = records_.find(key);
  GACT_EXPECTS(it != records_.end() && it->second.estimates > 0,
               "policy raise_variance: tensor key '" + std::string(key) + "' is unknown or has no estimate");
  GACT_EXPECTS(is_code_bits(bits), "policy raise_variance: bits must be 1, 2, 4 or 8, got " + std::to_string(bits));
  GACT_EXPECTS(std::isfinite(v) && v >= 0.0, "policy raise_variance: the variance of '" + std::string(key) +
                                                 "' must be finite and >= 0, got " + std::to_string(v));
  record& r = it->second;
  std::size_t const i = width_index(bits);
  r.variance[i] = std::max(r.variance[i], v);
  r.per_width = true;
  r.sensitivity = r.variance[0];
}

void record_table::set_bits(std::string_view key, int bits) {
  auto it = records_.find(key);
  GACT_EXPECTS(it != records_.end(), "policy set_bits: unknown tensor key '" + std::string(key) + "'");
  GACT_EXPECTS(is_code_bits(bits) || bits == it->second.full_bits,
               "policy set_bits: '" + std::string(key) + "' cannot take " + std::to_string(bits) + " bits");
  it->second.bits = bits;
  it->second.decided = true;
}

std::size_t record_table::evict(std::int64_t step, std::int64_t older_than) {
  GACT_EXPECTS(older_than >= 0, "policy evict: older_than must be >= 0");
  return std::erase_if(records_, [&](auto const& kv) { return kv.second.last_seen < step - older_than; });
}

record const* record_table::find(std::string_view key) const noexcept {
  auto it = records_.find(key);
  return it == records_.end() ? nullptr : &it->second;
}

}  // namespace gact::policy
