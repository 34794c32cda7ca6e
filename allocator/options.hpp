// gact/allocator/options.hpp
//
// gact's settings as one typed struct generated from options.def. Each setting
// has a default, an environment variable (GACT_*) and a Python keyword; every
// value is parsed and range-checked here, and a bad value is rejected with a
// message naming the setting, the value and what is accepted, e.g.
//   GACT_MEMORY_LIMIT: '12Q' is not a size; use e.g. 8G
//
// Option types (the `type` column of options.def) and their accepted text:
//   bytes          unsigned size with an optional K, M, G, T suffix (powers of 1024; KB/KiB
//                  and a trailing B accepted; decimals like 1.5G allowed)
//   count          unsigned integer
//   positive       integer >= 1
//   real           finite floating-point number
//   fraction_bits  real number in [1, 8] (average bits)
//   flag           1|0|true|false|yes|no|on|off (case-insensitive)
//   level          trace|debug|info|warn|error|off
//   text           any string
//   bits           1|2|4|8|auto (auto is stored as 0)
//   group          power of two in [64, 1024]
//   threads        unsigned integer in [0, k_max_threads] (0 = all hardware threads)
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

namespace gact {

/// Log levels, as GACT_LOG_LEVEL names them.
enum class option_level : std::uint8_t { trace, debug, info, warn, error, off };

namespace option_types {
using bytes = std::uint64_t;
using count = std::uint64_t;
using positive = std::uint64_t;
using real = double;
using fraction_bits = double;
using flag = bool;
using level = option_level;
using text = std::string;
using bits = int;  ///< 1, 2, 4, 8; 0 = auto
using group = std::uint32_t;
using threads = std::uint32_t;
}  // namespace option_types

/// Value of bits meaning "chosen per tensor by the adaptive policy".
inline constexpr int k_bits_auto = 0;

/// Most CPU threads a setting may ask for (GACT_THREADS): more than any machine gact runs on,
/// few enough that a mistyped value is an error instead of a wrapped-around count.
inline constexpr std::uint32_t k_max_threads = 1024;

/// All settings; one member per row of options.def, initialized to its default.
struct options {
#define GACT_OPTION(name, type, def, env, kw, help) option_types::type name = def;
#include "allocator/options.def"

  /// Defaults overridden by every GACT_* variable that is set and not empty.
  /// @param lookup returns the value of an environment variable or nullptr (default: std::getenv).
  /// @throws gact::invalid_argument naming the variable, the value and the accepted values.
  static options from_env(std::function<char const*(char const*)> const& lookup = {});

  /// Set one setting by its Python keyword (or member name) from text.
  /// @throws gact::invalid_argument for an unknown keyword (listing the known ones) or a bad value.
  void set(std::string_view keyword, std::string_view value);

  /// {member name: value}; bytes as integers, level and bits as their names ("auto" for 0).
  nlohmann::json to_json() const;
};

/// One row of options.def, for Python, the README and --help.
struct option_info {
  std::string_view name;
  std::string_view type;
  std::string_view env;
  std::string_view keyword;
  std::string default_text;  ///< the default as the parser would accept it
  std::string_view help;
};

/// Every row of options.def, in table order.
std::span<option_info const> option_table();

/// Parsers of the option types, exposed for reuse and tests. `label` (an env var or a
/// keyword) starts the error message. Each @throws gact::invalid_argument on a bad value.
namespace option_parse {
std::uint64_t bytes(std::string_view label, std::string_view value);
std::uint64_t count(std::string_view label, std::string_view value);
std::uint64_t positive(std::string_view label, std::string_view value);
double real(std::string_view label, std::string_view value);
double fraction_bits(std::string_view label, std::string_view value);
bool flag(std::string_view label, std::string_view value);
option_level level(std::string_view label, std::string_view value);
std::string text(std::string_view label, std::string_view value);
int bits(std::string_view label, std::string_view value);
std::uint32_t group(std::string_view label, std::string_view value);
std::uint32_t threads(std::string_view label, std::string_view value);
}  // namespace option_parse

/// The name of a level ("warn").
std::string_view level_name(option_level l) noexcept;

}  // namespace gact
