// gact/allocator/device/backend.cpp — the defaults of backend's optional virtual-memory calls
// (see backend.hpp): a backend without them reports vm_page() == 0, and the caching allocator
// never calls the others on it; a call anyway is a programming error, said as such.
#include "allocator/device/backend.hpp"

#include <string>

#include "allocator/error.hpp"
#include "allocator/log.hpp"

namespace gact::device {
namespace {

[[noreturn]] void no_vm(backend const& b, char const* call) {
  GACT_FAIL(std::string("backend '") + std::string(b.name()) + "' has no virtual memory calls (" + call +
            "): expandable segments need a backend with vm_page() > 0");
}

}  // namespace

void* backend::do_vm_reserve(std::size_t) { no_vm(*this, "vm_reserve"); }
void backend::do_vm_free(void* p, std::size_t) noexcept {
  GACT_LOG_ERROR("backend '{}': vm_free({}) on a backend without virtual memory calls", name(), p);
}
void backend::do_vm_map(void*, std::size_t) { no_vm(*this, "vm_map"); }
bool backend::do_vm_unmap(void* p, std::size_t) noexcept {
  GACT_LOG_ERROR("backend '{}': vm_unmap({}) on a backend without virtual memory calls", name(), p);
  return false;
}

}  // namespace gact::device
