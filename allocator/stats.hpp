// gact/allocator/stats.hpp
//
// The statistics of one caching allocator, generated from stats_fields.def:
// the struct (one stat_array or integer per row), the peak/accumulated resets,
// the flattened JSON in torch.cuda.memory_stats() key names, and a field table
// for tools that render dumps. The allocator updates these under its mutex; a
// copy is a consistent snapshot.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string_view>

namespace gact::alloc {

/// Index of a stat_array: the sum over both pools, then each pool.
enum stat_pool : int { pool_all = 0, pool_small = 1, pool_large = 2 };
inline constexpr std::array<std::string_view, 3> k_stat_pool_names{"all", "small_pool", "large_pool"};

/// One counter. Invariants: current == allocated - freed (until reset_accumulated);
/// peak >= current; peak is the largest value current has had since the last reset_peak.
struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  ///< sum of increases
  std::int64_t freed = 0;      ///< sum of decreases

  void increase(std::int64_t n) noexcept {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t n) noexcept {
    current -= n;
    freed += n;
  }
};

/// all, small_pool, large_pool. Invariant: [pool_all] == [pool_small] + [pool_large] field by field.
using stat_array = std::array<stat, 3>;

#if defined(__GNUC__)
#define GACT_STATS_INLINE [[gnu::always_inline]] inline
#else
#define GACT_STATS_INLINE inline
#endif

/// Add `n` to the "all" entry and to the entry of one pool (fast path: always inlined).
GACT_STATS_INLINE void stat_add(stat_array& a, bool small, std::int64_t n) noexcept {
  a[pool_all].increase(n);
  a[small ? pool_small : pool_large].increase(n);
}

/// Subtract `n` from the "all" entry and from the entry of one pool.
GACT_STATS_INLINE void stat_sub(stat_array& a, bool small, std::int64_t n) noexcept {
  a[pool_all].decrease(n);
  a[small ? pool_small : pool_large].decrease(n);
}

/// Apply a signed change to the "all" entry and to the entry of one pool.
GACT_STATS_INLINE void update_stat(stat_array& a, bool small, std::int64_t delta) noexcept {
  if (delta >= 0) {
    stat_add(a, small, delta);
  } else {
    stat_sub(a, small, -delta);
  }
}

struct allocator_stats {
#define GACT_STAT_ARRAY(name, help) stat_array name{};
#define GACT_STAT_COUNTER(name, help) std::int64_t name = 0;
#define GACT_STAT_ERROR(name, help) std::int64_t name = 0;
#include "allocator/stats_fields.def"

  /// peak := current for every array.
  void reset_peak() noexcept {
#define GACT_STAT_ARRAY(name, help) \
  for (stat & s : name) s.peak = s.current;
#include "allocator/stats_fields.def"
  }

  /// allocated, freed and the counters := 0 (errors are kept).
  void reset_accumulated() noexcept {
#define GACT_STAT_ARRAY(name, help) \
  for (stat & s : name) s.allocated = s.freed = 0;
#define GACT_STAT_COUNTER(name, help) name = 0;
#include "allocator/stats_fields.def"
  }

  /// Adds the flattened torch keys ("allocated_bytes.all.current", ..., "num_ooms") to `out`
  /// and the error counters to out["errors"].
  void to_json(nlohmann::json& out) const {
#define GACT_STAT_ARRAY(name, help)                                                     \
  for (int p = 0; p < 3; ++p) {                                                         \
    std::string const prefix = std::string(#name ".") + std::string(k_stat_pool_names[p]); \
    out[prefix + ".current"] = name[p].current;                                         \
    out[prefix + ".peak"] = name[p].peak;                                               \
    out[prefix + ".allocated"] = name[p].allocated;                                     \
    out[prefix + ".freed"] = name[p].freed;                                             \
  }
#define GACT_STAT_COUNTER(name, help) out[#name] = name;
#define GACT_STAT_ERROR(name, help) out["errors"][#name] = name;
#include "allocator/stats_fields.def"
  }
};

/// Kind of a row of stats_fields.def.
enum class stat_kind : std::uint8_t { array, counter, error };

/// One row of stats_fields.def, for tools that render or diff dumps.
struct stat_field_info {
  std::string_view name;
  stat_kind kind;
  std::string_view help;
};

/// Every row of stats_fields.def, in table order.
inline std::span<stat_field_info const> stat_fields() noexcept {
  static constexpr stat_field_info k_fields[] = {
#define GACT_STAT_ARRAY(name, help) {#name, stat_kind::array, help},
#define GACT_STAT_COUNTER(name, help) {#name, stat_kind::counter, help},
#define GACT_STAT_ERROR(name, help) {#name, stat_kind::error, help},
#include "allocator/stats_fields.def"
  };
  return k_fields;
}

}  // namespace gact::alloc
