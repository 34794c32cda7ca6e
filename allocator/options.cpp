// gact/allocator/options.cpp — parsing, range checks and listing of the settings
// table (options.def). Every message for a bad value has the form
//   <label>: '<value>' is not <what>; use <accepted>
// where label is the environment variable or the Python keyword that was used.
#include "allocator/options.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "allocator/error.hpp"

namespace gact {
namespace {

constexpr std::array<std::string_view, 6> k_level_names{"trace", "debug", "info", "warn", "error", "off"};

[[noreturn]] void reject(std::string_view label, std::string_view value, std::string_view what,
                         std::string_view accepted) {
  throw invalid_argument(std::string(label) + ": '" + std::string(value) + "' is not " + std::string(what) +
                         "; use " + std::string(accepted));
}

std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return out;
}

/// A whole unsigned decimal integer, or nullopt-like false.
bool parse_u64(std::string_view s, std::uint64_t& out) noexcept {
  if (s.empty()) return false;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out, 10);
  return ec == std::errc{} && end == s.data() + s.size();
}

// ---- per-type formatting of values (for the defaults column and to_json) ----
std::string format(std::uint64_t v) { return std::to_string(v); }
std::string format(std::uint32_t v) { return std::to_string(v); }
std::string format(double v) {
  char buf[64];
  auto const [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc{} ? std::string(buf, end) : std::string("nan");
}
std::string format(bool v) { return v ? "true" : "false"; }
std::string format(option_level v) { return std::string(level_name(v)); }
std::string format(std::string const& v) { return v; }
std::string format_bits(int v) { return v == k_bits_auto ? std::string("auto") : std::to_string(v); }

template <class T>
std::string format_typed(T const& v) {
  if constexpr (std::is_same_v<T, int>) {
    return format_bits(v);  // the only int-valued type is bits
  } else {
    return format(v);
  }
}

template <class T>
nlohmann::json json_typed(T const& v) {
  if constexpr (std::is_same_v<T, int>) {
    return v == k_bits_auto ? nlohmann::json("auto") : nlohmann::json(v);
  } else if constexpr (std::is_same_v<T, option_level>) {
    return std::string(level_name(v));
  } else {
    return v;
  }
}

}  // namespace

std::string_view level_name(option_level l) noexcept {
  auto const i = static_cast<std::size_t>(l);
  return i < k_level_names.size() ? k_level_names[i] : std::string_view("warn");
}

namespace option_parse {

std::uint64_t bytes(std::string_view label, std::string_view value) {
  constexpr std::string_view accepted = "e.g. 8G (suffixes K, M, G, T are powers of 1024; 1.5G and 4096 work too)";
  std::string_view const s = trim(value);
  std::size_t n = 0;  // the number is digits with at most one '.'
  while (n < s.size() && (std::isdigit(static_cast<unsigned char>(s[n])) || s[n] == '.')) ++n;
  std::string_view const number = s.substr(0, n);
  std::string const unit = lower(trim(s.substr(n)));
  std::size_t const dot = number.find('.');
  std::string_view const whole_text = number.substr(0, dot);
  std::string_view const frac_text = dot == std::string_view::npos ? std::string_view{} : number.substr(dot + 1);
  bool const well_formed = !number.empty() && std::count(number.begin(), number.end(), '.') <= 1 &&
                           (!whole_text.empty() || !frac_text.empty());
  if (!well_formed) reject(label, value, "a size", accepted);

  std::uint64_t mult = 0;
  if (unit.empty() || unit == "b") {
    mult = 1;
  } else if (unit == "k" || unit == "kb" || unit == "kib") {
    mult = std::uint64_t{1} << 10;
  } else if (unit == "m" || unit == "mb" || unit == "mib") {
    mult = std::uint64_t{1} << 20;
  } else if (unit == "g" || unit == "gb" || unit == "gib") {
    mult = std::uint64_t{1} << 30;
  } else if (unit == "t" || unit == "tb" || unit == "tib") {
    mult = std::uint64_t{1} << 40;
  } else {
    reject(label, value, "a size", accepted);
  }

  std::uint64_t whole = 0;
  if (!whole_text.empty() && !parse_u64(whole_text, whole)) reject(label, value, "a size below 2^64 bytes", accepted);
  if (whole > std::numeric_limits<std::uint64_t>::max() / mult) {
    reject(label, value, "a size below 2^64 bytes", accepted);
  }
  std::uint64_t result = whole * mult;
  if (!frac_text.empty()) {
    // Up to 9 fractional digits, rounded up to a whole byte. f < 2^30 and mult is a power of
    // two, so f * mult is exact in a long double (64-bit mantissa) and an exact integer
    // quotient stays exact.
    std::string_view const digits = frac_text.substr(0, 9);
    std::uint64_t f = 0;
    parse_u64(digits, f);  // digits only, at most 9: cannot fail
    std::uint64_t scale = 1;
    for (std::size_t i = 0; i < digits.size(); ++i) scale *= 10;
    long double const q = static_cast<long double>(f) * static_cast<long double>(mult) / static_cast<long double>(scale);
    auto const extra = static_cast<std::uint64_t>(std::ceil(q));  // < mult: fits
    if (extra > std::numeric_limits<std::uint64_t>::max() - result) {
      reject(label, value, "a size below 2^64 bytes", accepted);
    }
    result += extra;
  }
  return result;
}

std::uint64_t count(std::string_view label, std::string_view value) {
  std::uint64_t v = 0;
  if (!parse_u64(trim(value), v)) reject(label, value, "a non-negative integer", "e.g. 0, 2 or 100");
  return v;
}

std::uint64_t positive(std::string_view label, std::string_view value) {
  std::uint64_t v = 0;
  if (!parse_u64(trim(value), v) || v == 0) reject(label, value, "a positive integer", "e.g. 1 or 100");
  return v;
}

double real(std::string_view label, std::string_view value) {
  std::string const s(trim(value));
  if (s.empty()) reject(label, value, "a number", "e.g. 2.5");
  char* end = nullptr;
  double const v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) reject(label, value, "a number", "e.g. 2.5");
  return v;
}

double fraction_bits(std::string_view label, std::string_view value) {
  std::string const s(trim(value));
  char* end = nullptr;
  double const v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v < 1.0 || v > 8.0) {
    reject(label, value, "an average bit width in [1, 8]", "e.g. 2 or 3.5");
  }
  return v;
}

bool flag(std::string_view label, std::string_view value) {
  std::string const s = lower(trim(value));
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  reject(label, value, "a boolean", "1|0|true|false|yes|no|on|off");
}

option_level level(std::string_view label, std::string_view value) {
  std::string const s = lower(trim(value));
  for (std::size_t i = 0; i < k_level_names.size(); ++i) {
    if (s == k_level_names[i]) return static_cast<option_level>(i);
  }
  if (s == "warning") return option_level::warn;
  reject(label, value, "a log level", "trace|debug|info|warn|error|off");
}

std::string text(std::string_view, std::string_view value) { return std::string(value); }

int bits(std::string_view label, std::string_view value) {
  std::string const s = lower(trim(value));
  if (s == "auto") return k_bits_auto;
  if (s == "1" || s == "2" || s == "4" || s == "8") return s[0] - '0';
  reject(label, value, "a bit width", "1|2|4|8|auto");
}

std::uint32_t group(std::string_view label, std::string_view value) {
  std::uint64_t v = 0;
  if (!parse_u64(trim(value), v) || v < 64 || v > 1024 || (v & (v - 1)) != 0) {
    reject(label, value, "a group size", "a power of two in [64, 1024]: 64|128|256|512|1024");
  }
  return static_cast<std::uint32_t>(v);
}

std::uint32_t threads(std::string_view label, std::string_view value) {
  std::uint64_t v = 0;
  if (!parse_u64(trim(value), v) || v > k_max_threads) {
    reject(label, value, "a thread count in [0, " + std::to_string(k_max_threads) + "]",
           "0 (all hardware threads) or e.g. 4");
  }
  return static_cast<std::uint32_t>(v);
}

}  // namespace option_parse

options options::from_env(std::function<char const*(char const*)> const& lookup) {
  auto const get = [&](char const* name) -> char const* {
    return lookup ? lookup(name) : std::getenv(name);
  };
  options o;
#define GACT_OPTION(name, type, def, env, kw, help)                   \
  if (char const* v = get(env); v != nullptr && *v != '\0') {         \
    o.name = option_parse::type(env, v);                              \
  }
#include "allocator/options.def"
  return o;
}

void options::set(std::string_view keyword, std::string_view value) {
#define GACT_OPTION(name, type, def, env, kw, help)        \
  if (keyword == kw || keyword == #name) {                 \
    name = option_parse::type(kw, value);                  \
    return;                                                \
  }
#include "allocator/options.def"
  std::string known;
#define GACT_OPTION(name, type, def, env, kw, help) known += (known.empty() ? "" : ", ") + std::string(kw);
#include "allocator/options.def"
  throw invalid_argument("'" + std::string(keyword) + "' is not a gact setting; known: " + known);
}

nlohmann::json options::to_json() const {
  nlohmann::json j = nlohmann::json::object();
#define GACT_OPTION(name, type, def, env, kw, help) j[#name] = json_typed(name);
#include "allocator/options.def"
  return j;
}

std::span<option_info const> option_table() {
  static std::vector<option_info> const table = [] {
    std::vector<option_info> t;
    options const defaults;
#define GACT_OPTION(name, type, def, env, kw, help) \
  t.push_back(option_info{#name, #type, env, kw, format_typed(defaults.name), help});
#include "allocator/options.def"
    return t;
  }();
  return table;
}

}  // namespace gact
