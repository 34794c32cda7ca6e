// gact/policy/estimator.hpp
//
// Sensitivity estimators: C_l, the gradient variance that saved tensor l's
// quantization noise adds at 1 bit, so that Var_l(b) ≈ C_l·v(b) with
// v(b) = 1/(2^b − 1)² (v(full) = 0). Derivations in policy/README.md.
//
// Reference (GACT's perturbation method, constants fixed). The driver computes
// parameter gradients g(b, s) with tensor l at bit width b and noise seed s,
// every other tensor keeping its bits and seeds (common random numbers). To
// first order g(b, s) = g* + J_l ε_l(b, s) + (terms common to all runs), so for
// two runs with independent noise in l,
//     E‖g(b_a, s_a) − g(b_b, s_b)‖² = Var_l(b_a) + Var_l(b_b) = C_l·(v(b_a) + v(b_b)).
// Given pairs (b_a, b_b, d² = ‖g_a − g_b‖²), the estimate
//     Ĉ_l = Σ d² / Σ (v(b_a) + v(b_b))
// is unbiased. For GACT's three runs (1 bit seed s, 1 bit seed s+1, 8 bits with a
// third, independent seed) this is (d01² + d02² + d12²) / (2 + 2·(1 + 1/255²)).
// GACT itself takes max(d01², 2·max(d02², d12²)), which estimates 2·C_l and the
// max biases it further upward by a tensor-dependent amount; `gact_sensitivity`
// reproduces it for comparison only.
//
// Online (ours, from the normal training step). For a saved tensor h that its
// consumer uses to form a weight gradient (linear: ∇W = Σ_rows δ hᵀ; conv: the
// same over im2col rows), quantization noise ε gives ∇W an error Σ_rows δ εᵀ with
//     E‖Σ δ εᵀ‖² = Σ_rows ‖δ_row‖²·E‖ε_row‖² ≈ fan_in·‖δ‖²_F·σ̄²(b),
// where δ = ∂L/∂y is the consumer's output gradient, fan_in the saved elements
// each output row reads, and σ̄²(b) the mean per-element noise variance. With a
// group range R_g and fractional positions uniform on [0, 1) stochastic rounding
// has variance (R_g/(2^b−1))²/6 per element, so
//     C_l = fan_in · ‖δ‖²_F · group_size · Σ_g R_g² / (6 · numel).
#pragma once

#include "policy/solver.hpp"

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gact::policy {

/// ‖a − b‖² accumulated in double. @throws gact::invalid_argument if sizes differ.
double squared_distance(std::span<float const> a, std::span<float const> b);

/// One pair of perturbed gradients: bit widths of tensor l in the two runs (code widths or
/// 16/32 for full precision) and ‖g_a − g_b‖². The two runs' noise in l must be independent
/// (different seeds, or one run at full precision).
struct probe_pair {
  int bits_a = 1;
  int bits_b = 1;
  double sq_distance = 0.0;
};

/// Unbiased Ĉ_l = Σ d² / Σ (v(b_a) + v(b_b)).
/// @throws gact::invalid_argument if there are no pairs, a d² is negative or not finite,
///         a width is invalid, or every pair is full precision on both sides (no information).
double perturbation_sensitivity(std::span<probe_pair const> pairs);

/// The reference estimate from GACT's three runs: g0 (1 bit, seed s), g1 (1 bit, seed s+1),
/// g2 (8 bits, an independent seed). @throws gact::invalid_argument if sizes differ or empty.
double perturbation_sensitivity(std::span<float const> g0, std::span<float const> g1,
                                std::span<float const> g2);

/// GACT's formula max(‖g0−g1‖², 2·max(‖g0−g2‖², ‖g1−g2‖²)), an upward-biased estimate of
/// 2·C_l. For comparison in tests and benchmarks only. @throws as above.
double gact_sensitivity(std::span<float const> g0, std::span<float const> g1, std::span<float const> g2);

/// What the online estimator needs from one training step for one saved tensor.
struct online_sample {
  double sum_sq_ranges = 0.0;   ///< Σ_g R_g² over the tensor's groups (from the encoder)
  std::uint64_t numel = 0;      ///< elements of the saved tensor
  std::uint32_t group_size = 256;  ///< elements per group
  double grad_sq_norm = 0.0;    ///< ‖∂L/∂y‖²_F of the consumer's output in this step
  double fan_in = 1.0;          ///< saved elements each output row reads (in_features; C_in/groups·kh·kw)
};

/// C_l = fan_in · grad_sq_norm · group_size · sum_sq_ranges / (6 · numel) for one sample.
/// @throws gact::invalid_argument on numel 0, group_size 0, or a negative/non-finite field.
double online_sensitivity(online_sample const& s);

/// Accumulates online samples per key between adaptations and returns their means.
/// Not thread-safe (the controller serialises access).
class online_accumulator {
 public:
  /// Add one step's sample for `key`. @throws as online_sensitivity, or on an empty key.
  void add(std::string_view key, online_sample const& s);
  /// Mean C per key since the last take(), in key order; clears the accumulator.
  std::map<std::string, double> take();
  /// Number of keys with pending samples.
  std::size_t size() const noexcept { return sums_.size(); }

 private:
  struct acc {
    double sum = 0.0;
    std::uint64_t count = 0;
  };
  std::map<std::string, acc, std::less<>> sums_;
};

}  // namespace gact::policy
