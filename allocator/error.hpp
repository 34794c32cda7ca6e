// gact/allocator/error.hpp
//
// The error types of gact and the macros that raise them. Every failure that
// crosses a module boundary is one of these types, so that callers can react to
// exactly the condition they care about (the caching allocator retries on
// `out_of_memory` and on nothing else). Messages always carry `file:line` and,
// for CUDA calls, the call text with the CUDA error name and string.
//
// Free paths never throw: they count and log instead (see caching_allocator).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace gact {

/// Base of every exception gact throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A device runtime call failed (the message names the call and the runtime's error).
class cuda_error : public error {
 public:
  using error::error;
};

/// Memory could not be obtained even after releasing cached blocks.
class out_of_memory : public error {
 public:
  using error::error;
};

/// A caller passed a bad value (size, pointer, setting, dtype, ...).
class invalid_argument : public error {
 public:
  using error::error;
};

/// A compressed blob failed validation (truncated, bit-flipped, wrong version).
class corrupt_blob : public error {
 public:
  using error::error;
};

/// A worker thread could not be created (process or container thread limit, address space).
class thread_error : public error {
 public:
  using error::error;
};

}  // namespace gact

#define GACT_STRINGIFY_DETAIL(x) #x
#define GACT_STRINGIFY(x) GACT_STRINGIFY_DETAIL(x)

/// Throw an error of the given type (`gact::invalid_argument` by default) with `file:line`.
/// Usage: GACT_FAIL("bad size " + std::to_string(n)); GACT_FAIL(msg, gact::corrupt_blob);
#define GACT_FAIL_2(msg, type) \
  throw type(std::string(msg) + " (" __FILE__ ":" GACT_STRINGIFY(__LINE__) ")")
#define GACT_FAIL_1(msg) GACT_FAIL_2(msg, ::gact::invalid_argument)
#define GACT_GET_MACRO_(_1, _2, NAME, ...) NAME
#define GACT_FAIL(...) GACT_GET_MACRO_(__VA_ARGS__, GACT_FAIL_2, GACT_FAIL_1, unused)(__VA_ARGS__)

/// Check a precondition; on failure throw (default `gact::invalid_argument`) with the message.
/// Usage: GACT_EXPECTS(n > 0, "size must be positive"); GACT_EXPECTS(ok, "truncated", gact::corrupt_blob);
#define GACT_EXPECTS_3(cond, msg, type) \
  do {                                  \
    if (!(cond)) [[unlikely]] {         \
      GACT_FAIL_2(msg, type);           \
    }                                   \
  } while (0)
#define GACT_EXPECTS_2(cond, msg) GACT_EXPECTS_3(cond, msg, ::gact::invalid_argument)
#define GACT_GET_MACRO3_(_1, _2, _3, NAME, ...) NAME
#define GACT_EXPECTS(...) GACT_GET_MACRO3_(__VA_ARGS__, GACT_EXPECTS_3, GACT_EXPECTS_2, unused)(__VA_ARGS__)

/// Internal invariant: always checked, aborts with a message (a bug in gact, not in the caller).
#define GACT_ASSERT_INTERNAL(cond)                                                            \
  do {                                                                                        \
    if (!(cond)) [[unlikely]] {                                                               \
      ::gact::detail::assert_fail(#cond, __FILE__, __LINE__);                                 \
    }                                                                                         \
  } while (0)

/// Expensive invariant: checked only in debug builds (compiled out under NDEBUG).
#ifdef NDEBUG
#define GACT_ASSERT_EXPENSIVE(cond) ((void)0)
#else
#define GACT_ASSERT_EXPENSIVE(cond) GACT_ASSERT_INTERNAL(cond)
#endif

namespace gact::detail {
[[noreturn]] void assert_fail(char const* expr, char const* file, int line) noexcept;
}  // namespace gact::detail
