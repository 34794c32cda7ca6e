// gact/allocator/error.cpp — out-of-line pieces of error.hpp.
#include "error.hpp"

#include <cstdio>
#include <cstdlib>

namespace gact::detail {

void assert_fail(char const* expr, char const* file, int line) noexcept {
  std::fprintf(stderr, "gact: internal assertion failed: %s (%s:%d)\n", expr, file, line);
  std::abort();
}

}  // namespace gact::detail
