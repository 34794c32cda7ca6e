// gact/policy/controller.hpp
//
// The policy as the rest of gact uses it: a thread-safe object that the pack
// hook asks for bits (`on_save`), that estimators feed (`add_estimate`,
// `add_online_sample`), and that re-solves the allocation on demand
// (`decide`, called by the driver every adapt_interval steps). Its decisions
// and the last solve's figures are the "policy" section of the stats document.
//
// Which tensors a solve covers: the active ones (seen within `stale_after`
// steps). Those with a sensitivity estimate are allocated by the greedy
// solver; active tensors without one keep their current (default) bits and
// their bytes are reserved out of the budget first. The budget is the bytes
// uniform budget_avg_bits would store for the active tensors, header and
// metadata included (storage_model::uniform_bytes): at budget 2 the policy
// stores what uniform 2 bits stores, spent differently.
// With torch.distributed the driver all-reduces the estimates before
// add_estimate, so that every rank solves the same deterministic problem.
#pragma once

#include "policy/estimator.hpp"
#include "policy/records.hpp"
#include "policy/solver.hpp"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace gact::policy {

/// Settings of a controller. `storage` is used by both the records and the solver.
struct controller_options {
  double budget_avg_bits = 2.0;        ///< the uniform width (bits per element) whose bytes are the budget
  int default_bits = 4;                ///< bits before the first decision and for unknown keys
  double ema_weight = 0.5;             ///< see table_options
  std::int64_t stale_after = 2;        ///< see table_options
  storage_model storage{};             ///< blob size model
  bool allow_full_precision = true;    ///< the solver may keep tensors uncompressed
  std::vector<int> code_bits{8, 4, 2, 1};

  /// @throws gact::invalid_argument naming the bad field.
  void validate() const;
};

/// Figures of the last solve.
struct decision_summary {
  std::int64_t step = 0;
  solve_status status = solve_status::ok;
  std::uint64_t total_numel = 0;     ///< Σ numel of the active tensors
  std::uint64_t budget_bytes = 0;    ///< for all active tensors
  std::uint64_t stored_bytes = 0;    ///< solved + reserved
  std::uint64_t reserved_bytes = 0;  ///< active tensors without an estimate, at their bits
  std::size_t solved = 0;            ///< tensors given to the solver
  std::size_t unestimated = 0;       ///< active tensors without an estimate
  double objective = 0.0;            ///< Σ C·v(b) over the solved tensors
  double lower_bound = 0.0;          ///< certified lower bound on the optimum
  double achieved_avg_bits = 0.0;    ///< 8 · stored_bytes / total_numel
  double min_feasible_budget = 0.0;  ///< the smallest budget (uniform width) every tensor's narrowest option fits
};

/// Thread-safe per-tensor bit policy.
class controller {
 public:
  /// @throws gact::invalid_argument if the options are invalid.
  explicit controller(controller_options opts = {});
  ~controller();
  controller(controller const&) = delete;
  controller& operator=(controller const&) = delete;

  /// Set the current training step (monotone by convention; used for staleness).
  void set_step(std::int64_t step);
  std::int64_t step() const;

  /// Record that `key` is saved now and return the bits to encode it with. `min_bits`: the
  /// narrowest width the store uses for it (solver_item::min_bits); the budget counts the tensor
  /// at no fewer bits, as uniform storage stores it.
  /// @throws gact::invalid_argument on an empty key, numel 0, full_bits not 16/32 or min_bits
  ///         not a code width.
  int on_save(std::string_view key, std::uint64_t numel, int full_bits = 32, int min_bits = 1);

  /// The bits for `key` without recording anything (default bits if unknown). Never throws.
  int bits_for(std::string_view key) const noexcept;

  /// Fold a sensitivity estimate into the key's EMA.
  /// @throws gact::invalid_argument if the key was never saved or c is negative/not finite.
  void add_estimate(std::string_view key, double c);

  /// Fold an estimate made width by width (variance at 1, 2, 4, 8 bits) into the key's EMA.
  /// @throws gact::invalid_argument if the key was never saved or a value is negative/not finite.
  void add_estimate_widths(std::string_view key, std::array<double, 4> const& v);

  /// Raise the key's variance at `bits` to at least `v` (record_table::raise_variance).
  void raise_variance(std::string_view key, int bits, double v);

  /// Add one step's online statistics for `key`. @throws as online_sensitivity.
  void add_online_sample(std::string_view key, online_sample const& s);

  /// Fold the means of the pending online samples into the estimates (keys never saved are
  /// skipped and counted in the return's second element). Returns {folded, skipped}.
  std::pair<std::size_t, std::size_t> apply_online_estimates();

  /// Re-solve the allocation over the active tensors and apply it. Never exceeds the budget
  /// when feasible; when infeasible, applies the smallest option of every solved tensor and
  /// reports status infeasible (and logs a warning).
  decision_summary decide();

  /// Change the budget (average bits per element). @throws gact::invalid_argument if not > 0.
  void set_budget(double avg_bits);

  /// The last decision, if any.
  std::optional<decision_summary> last_decision() const;

  /// Copy of a record (nullopt for unknown keys).
  std::optional<record> find(std::string_view key) const;

  /// The "policy" stats section: budget, achieved bits, objective, and per key numel, C, bits.
  nlohmann::json stats() const;

  /// Register stats() with the stats registry under `name` (replacing an earlier registration
  /// of this controller). Returns false if gact was built without the registry.
  bool register_stats(std::string const& name = "policy");

 private:
  mutable std::mutex mu_;
  controller_options opts_;
  record_table table_;
  online_accumulator online_;
  std::int64_t step_ = 0;
  std::optional<decision_summary> last_;
  std::uint64_t stats_token_ = 0;
  bool registered_ = false;
};

/// "ok" or "infeasible".
char const* to_string(solve_status s) noexcept;

}  // namespace gact::policy
