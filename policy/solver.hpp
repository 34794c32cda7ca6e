// gact/policy/solver.hpp
//
// The bit-allocation problem and its two solvers. Given saved tensors l with
// sensitivity C_l ≥ 0 (gradient variance at 1 bit), choose b_l from the ladder
// {full precision, 8, 4, 2, 1} to
//
//     minimize   Σ_l C_l · v(b_l),     v(b) = 1/(2^b − 1)²,   v(full) = 0
//     subject to Σ_l stored_bytes_l(b_l) ≤ budget_bytes
//
// (or Σ_l V_l(b_l) for tensors whose variance was estimated width by width, and
// b_l ≥ the tensor's min_bits: the widths the store really uses for it)
//
// where stored_bytes counts the blob header and per-group metadata
// (storage_model). This is a multiple-choice knapsack.
//
// `solve_greedy` is GACT's greedy with its flaws fixed: each tensor's options
// are reduced to the lower convex hull of (bytes, variance); a priority queue
// applies the step with the least variance increase per byte saved (ties broken
// by key, so the result is deterministic) until the budget holds; then a local
// search spends the slack the last step left: upgrades that fit, and exchanges
// (one tensor up, another down) that lower the objective while fitting.
// The budget is never exceeded. Because hull steps are taken in non-decreasing
// slope order, the state before the last step minimizes the Lagrangian
// Σ C·v + λ·bytes at the last slope λ while using more than the budget, so its
// objective is a certified lower bound on the optimum (`lower_bound`); the
// greedy's gap is at most objective − lower_bound ≤ the last step's increase.
//
// `solve_exact` is a dynamic program over Pareto frontiers of (bytes, variance)
// for small instances; tests use it to measure greedy's optimality gap.
#pragma once

#include "policy/storage_model.hpp"

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace gact::policy {

/// One saved tensor as the solver sees it.
struct solver_item {
  std::string key;           ///< stable tensor key; breaks ties (unique within one solve)
  std::uint64_t numel = 0;   ///< elements (> 0)
  double sensitivity = 0.0;  ///< C_l ≥ 0, finite: gradient variance at 1 bit
  int full_bits = 32;        ///< the tensor's own precision (32 fp32, 16 fp16/bf16)
  /// The narrowest code width the store uses for this tensor whatever it is asked: 2 for a
  /// boundary blob (a ReLU output also read as values), 8 for a normalization input with small
  /// statistics blocks. Narrower widths are not options (their bytes would not be what the store
  /// pays). One of 1, 2, 4, 8.
  int min_bits = 1;
  /// The gradient variance at 1, 2, 4 and 8 bits, when estimated width by width (the stored
  /// form's exact rounding variance); absent: sensitivity · v(b).
  std::optional<std::array<double, 4>> variance{};
};

/// The variance an item adds at `bits` (a code width, raised to the item's min_bits as the store
/// raises it, or full precision: 0). @throws gact::invalid_argument for another width.
double item_variance(solver_item const& it, int bits);

/// Which widths the solver may choose and how blobs are sized.
struct solver_options {
  storage_model storage{};          ///< blob size model (metadata counted)
  bool allow_full_precision = true; ///< may keep a tensor uncompressed (variance 0)
  std::vector<int> code_bits{8, 4, 2, 1};  ///< subset of {1,2,4,8}, non-empty
  /// The greedy re-solves with one tensor pinned at each of its other options when the
  /// instance has at most this many options in all (cost O(options² log)); 0 disables.
  std::size_t pinned_trials_limit = 512;
  /// Run the local search and pinned re-solves after the greedy (false: the plain hull greedy,
  /// for comparisons; the budget still holds).
  bool improve = true;
  /// Pinned re-solves are skipped (or stopped) once objective − lower_bound ≤ this · objective.
  double target_rel_gap = 1e-3;
};

/// Outcome of a solve.
enum class solve_status {
  ok,          ///< stored_bytes ≤ budget_bytes
  infeasible,  ///< even the smallest option of every tensor exceeds the budget; bits are those smallest options
};

/// A bit assignment and its certificate.
///
/// Invariants: bits.size() == number of items; status == ok ⇒ stored_bytes ≤ budget_bytes;
/// lower_bound ≤ optimum ≤ objective (when ok).
struct solution {
  solve_status status = solve_status::ok;
  std::vector<int> bits;            ///< per item, in input order; full precision is the item's full_bits
  std::uint64_t stored_bytes = 0;   ///< Σ stored bytes at `bits`
  std::uint64_t budget_bytes = 0;   ///< the budget solved for
  double objective = 0.0;           ///< Σ C·v(b)
  double lower_bound = 0.0;         ///< certified lower bound on the optimal objective
  std::uint64_t greedy_steps = 0;   ///< down-steps applied (greedy only)
  std::uint64_t refill_steps = 0;   ///< upgrades into the slack after the greedy (greedy only)
  std::uint64_t exchange_steps = 0; ///< upgrade+downgrade pairs applied after the greedy (greedy only)
  std::uint64_t pinned_improvements = 0;  ///< pinned re-solves that improved the result (greedy only)
};

/// v(b) = 1/(2^b−1)² for a code width, 0 for full precision (16/32).
/// @throws gact::invalid_argument for any other width.
double variance_factor(int bits);

/// The budget in bytes for an average of `avg_bits` bits per element over `total_numel`
/// elements: floor(avg_bits · total_numel / 8). Metadata must fit inside it.
/// @throws gact::invalid_argument if avg_bits is not finite and positive.
std::uint64_t budget_bytes_for(double avg_bits, std::uint64_t total_numel);

/// Greedy allocation (see the file comment). Deterministic for a given input.
/// @throws gact::invalid_argument on a bad item (numel 0, C negative or not finite, bad
///         full_bits, duplicate key) or bad options.
solution solve_greedy(std::vector<solver_item> const& items, std::uint64_t budget_bytes,
                      solver_options const& opts = {});

/// Exact optimum by a Pareto-frontier dynamic program. Meant for small instances.
/// @throws gact::invalid_argument as solve_greedy, and if the frontier would exceed
///         `max_frontier` states.
solution solve_exact(std::vector<solver_item> const& items, std::uint64_t budget_bytes,
                     solver_options const& opts = {}, std::size_t max_frontier = 1u << 20);

/// Objective and bytes of a given assignment (for tests and the stats).
/// @throws gact::invalid_argument if a width is not allowed for its item.
double objective_of(std::vector<solver_item> const& items, std::vector<int> const& bits);
/// @copydoc objective_of
std::uint64_t stored_bytes_of(std::vector<solver_item> const& items, std::vector<int> const& bits,
                              storage_model const& storage);

}  // namespace gact::policy
