// gact/policy/records.hpp
//
// What the policy remembers about each saved tensor, keyed by a stable tensor
// key: the identity of the module or op that saved it plus its order within the
// step (e.g. "layer1.0.conv1#0"). GACT indexed its bits by save order and raised
// KeyError when a dynamic graph saved a new tensor; here an unknown key simply
// gets the default bits, and a key that stops appearing is left out of the
// solve once it has not been seen for `stale_after` steps.
//
// Sensitivities are smoothed across estimates by an exponential moving average
// with weight `ema_weight` on the new estimate:
//   C ← C_new                              on the first estimate
//   C ← (1 − w)·C + w·C_new                afterwards
// The default w = 0.5 halves the weight of an estimate at each re-estimation:
// it damps the noise of a single probe (the reference estimator's relative
// standard deviation is O(1/√dims) per probe, the online one's follows the
// batch) while following a change of regime within about three adaptations.
//
// `record_table` is not thread-safe; `controller` wraps it in a mutex.
#pragma once

#include "policy/storage_model.hpp"

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace gact::policy {

/// Settings of the record table.
struct table_options {
  int default_bits = 4;            ///< bits for unknown or not-yet-decided keys (1,2,4,8 or 32)
  double ema_weight = 0.5;         ///< weight of a new sensitivity estimate, in (0, 1]
  std::int64_t stale_after = 2;    ///< a key unseen for more than this many steps is inactive (>= 0)
  storage_model storage{};         ///< for the group count

  /// @throws gact::invalid_argument naming the bad field.
  void validate() const;
};

/// Everything the policy knows about one saved tensor.
///
/// Invariants: numel > 0; groups == storage.groups(numel);
/// estimates == 0 ⇔ sensitivity is meaningless (0); bits is a code width or full_bits.
struct record {
  std::uint64_t numel = 0;          ///< elements at the last observation
  std::uint64_t groups = 0;         ///< quantization groups at the last observation
  int full_bits = 32;               ///< the tensor's own precision (16 or 32)
  double sensitivity = 0.0;         ///< smoothed C_l (gradient variance at 1 bit)
  /// smoothed gradient variance at 1, 2, 4, 8 bits when estimated width by width (per_width)
  std::array<double, 4> variance{};
  bool per_width = false;           ///< the latest estimate came width by width
  int min_bits = 1;                 ///< the narrowest width the store uses for the tensor (latest observation)
  std::uint64_t estimates = 0;      ///< number of estimates folded into `sensitivity`
  int bits = 0;                     ///< the current decision (default_bits until decided)
  bool decided = false;             ///< bits set by a solve
  std::int64_t first_seen = 0;      ///< step of the first observation
  std::int64_t last_seen = 0;       ///< step of the latest observation
};

/// The map from tensor key to record.
class record_table {
 public:
  /// @throws gact::invalid_argument if the options are invalid.
  explicit record_table(table_options opts = {});

  /// Note that `key` was saved at `step` with `numel` elements of precision `full_bits`.
  /// Creates the record on first sight. A changed numel updates numel and groups and keeps
  /// the sensitivity (shapes change with the last, smaller batch; C is re-estimated anyway).
  /// @throws gact::invalid_argument if key is empty, numel is 0 or full_bits is not 16/32.
  /// `min_bits`: the narrowest code width the store uses for it (1, 2, 4 or 8; see solver_item).
  record const& observe(std::string_view key, std::uint64_t numel, std::int64_t step, int full_bits = 32,
                        int min_bits = 1);

  /// The bits to encode `key` with: the decided bits, or default_bits for an unknown or
  /// undecided key. Never throws.
  int bits_for(std::string_view key) const noexcept;

  /// Fold a sensitivity estimate into the key's EMA.
  /// @throws gact::invalid_argument if the key was never observed or c is negative or not finite.
  void add_estimate(std::string_view key, double c);

  /// Fold an estimate made width by width (the variance at 1, 2, 4, 8 bits) into the key's EMA.
  /// A key whose previous estimates were scalar starts its width-by-width EMA from C·v(b).
  /// @throws gact::invalid_argument if the key was never observed or a value is negative or not finite.
  void add_estimate_widths(std::string_view key, std::array<double, 4> const& v);

  /// Raise the key's variance at `bits` to at least `v` (a direct measurement found the estimate
  /// too low); the record keeps its other widths. @throws gact::invalid_argument for an unknown or
  /// unestimated key, a width that is not 1, 2, 4 or 8, or v negative or not finite.
  void raise_variance(std::string_view key, int bits, double v);

  /// Set the decided bits of a key. @throws gact::invalid_argument on an unknown key or bad width.
  void set_bits(std::string_view key, int bits);

  /// True if the key was seen at a step >= step − stale_after.
  bool is_active(record const& r, std::int64_t step) const noexcept {
    return r.last_seen >= step - opts_.stale_after;
  }

  /// Remove records not seen since `step − older_than`; returns how many were removed.
  std::size_t evict(std::int64_t step, std::int64_t older_than);

  /// The record of `key`, or nullptr.
  record const* find(std::string_view key) const noexcept;

  /// All records, in key order.
  std::map<std::string, record, std::less<>> const& all() const noexcept { return records_; }
  table_options const& options() const noexcept { return opts_; }

 private:
  table_options opts_;
  std::map<std::string, record, std::less<>> records_;
};

}  // namespace gact::policy
