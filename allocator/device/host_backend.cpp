// gact/allocator/device/host_backend.cpp — host memory behind device::backend
// (see host_backend.hpp). All system calls of the host backend live here.
#include "allocator/device/host_backend.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "allocator/error.hpp"
#include "allocator/log.hpp"

namespace gact::device {
namespace {

std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

[[noreturn]] void throw_oom(std::size_t bytes, std::size_t reserved, std::size_t capacity,
                            char const* why) {
  throw out_of_memory("host backend: cannot reserve " + std::to_string(bytes) +
                      " bytes (reserved " + std::to_string(reserved) + ", capacity " +
                      (capacity == 0 ? std::string("none") : std::to_string(capacity)) +
                      "): " + why);
}

}  // namespace

host_backend::host_backend(std::size_t capacity, std::size_t vm_page) : capacity_(capacity), vm_page_(vm_page) {
  GACT_EXPECTS(vm_page >= 4096 && (vm_page & (vm_page - 1)) == 0,
               "host_backend: vm_page must be a power of two of at least 4096, not " + std::to_string(vm_page));
}

std::size_t host_backend::claim(std::size_t bytes, char const* what) {
  if (fault_count_.load(std::memory_order_relaxed) > 0 && fault_after_.fetch_sub(1, std::memory_order_relaxed) <= 0 &&
      fault_count_.fetch_sub(1, std::memory_order_relaxed) > 0) {
    throw_oom(bytes, reserved_.load(std::memory_order_relaxed), capacity_, "injected failure (fail_reserves)");
  }
  // Claim the bytes against the capacity first, so that concurrent reserves never overshoot it.
  std::size_t const before = reserved_.fetch_add(bytes, std::memory_order_relaxed);
  if (capacity_ != 0 && (before + bytes > capacity_ || before + bytes < before)) {
    reserved_.fetch_sub(bytes, std::memory_order_relaxed);
    throw_oom(bytes, before, capacity_, what);
  }
  return before;
}

void* host_backend::do_reserve(std::size_t bytes) {
  GACT_EXPECTS(bytes > 0, "host_backend::reserve: size must be positive");
  std::size_t const before = claim(bytes, "capacity reached");
  void* p = nullptr;
  if (bytes >= k_mmap_threshold) {
    // No MAP_NORESERVE: the kernel's overcommit check then refuses what the machine cannot back (a
    // 40 GiB tensor on a 23 GiB machine fails here, with torch's error, not later in the OOM killer).
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) p = nullptr;
  } else {
    p = std::aligned_alloc(k_alignment, round_up(bytes, k_alignment));
  }
  if (p == nullptr) {
    int const err = errno;
    reserved_.fetch_sub(bytes, std::memory_order_relaxed);
    throw_oom(bytes, before, capacity_, std::strerror(err));
  }
  return p;
}

void host_backend::do_release(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes >= k_mmap_threshold) {
    if (::munmap(p, bytes) != 0) {
      GACT_WARN_CAPPED(8, "host_backend: munmap({}, {}) failed: {}", p, bytes, std::strerror(errno));
      return;
    }
  } else {
    std::free(p);
  }
  reserved_.fetch_sub(bytes, std::memory_order_relaxed);
}

void* host_backend::do_vm_reserve(std::size_t bytes) {
  GACT_EXPECTS(bytes > 0 && bytes % vm_page_ == 0, "host_backend::vm_reserve: size must be a positive multiple of "
                                                    "the page (" + std::to_string(vm_page_) + ")");
  // Address space only: no access, so no commit charge until vm_map makes pages writable (without MAP_NORESERVE,
  // so that the kernel's overcommit check applies then). One page more than asked, so that the range can start on
  // a page; the slack on either side goes back at once.
  std::size_t const span = bytes + vm_page_;
  void* raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    throw out_of_memory("host backend: cannot reserve " + std::to_string(bytes) + " bytes of address space: " +
                        std::strerror(errno));
  }
  auto const a = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t const base = round_up(a, vm_page_);
  if (base > a) ::munmap(raw, base - a);
  if (std::uintptr_t const end = base + bytes; end < a + span) ::munmap(reinterpret_cast<void*>(end), a + span - end);
  return reinterpret_cast<void*>(base);
}

std::size_t host_backend::do_vm_reserve_hint() noexcept {
  // Under a limit on the address space (RLIMIT_AS, `ulimit -v`) PROT_NONE reservations count against it: a range
  // of the machine's memory size, halved until the limit gives it, took half or more of what the process had left,
  // and numpy, Python and a later range of the other pool failed. A range takes an eighth of the headroom at most
  // (at least a page): the others, and the rest of the process, keep theirs; a request larger than that still gets
  // a range of its own size.
  rlimit lim{};
  if (::getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return 0;
  std::size_t used = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    unsigned long pages = 0;
    if (std::fscanf(f, "%lu", &pages) == 1) used = std::size_t(pages) * std::size_t(::sysconf(_SC_PAGESIZE));
    std::fclose(f);
  }
  return reserve_hint_for(static_cast<std::size_t>(lim.rlim_cur), used, vm_page_);
}

std::size_t host_backend::reserve_hint_for(std::size_t limit, std::size_t used, std::size_t page) noexcept {
  std::size_t const headroom = used < limit ? limit - used : 0;
  return std::max(headroom / 8 / page * page, page);
}

void host_backend::do_vm_free(void* p, std::size_t bytes) noexcept {
  if (p != nullptr && ::munmap(p, bytes) != 0) {
    GACT_WARN_CAPPED(8, "host_backend: munmap({}, {}) of a range failed: {}", p, bytes, std::strerror(errno));
  }
}

void host_backend::do_vm_map(void* p, std::size_t bytes) {
  GACT_EXPECTS(p != nullptr && bytes > 0 && bytes % vm_page_ == 0 && reinterpret_cast<std::uintptr_t>(p) % vm_page_ == 0,
               "host_backend::vm_map: a page-aligned range of whole pages is required");
  std::size_t const before = claim(bytes, "capacity reached");
  // Writable: the kernel charges the pages against its overcommit limit now (a refusal changes nothing); pages
  // unmapped before are writable already and read as zeros (vm_unmap dropped them).
  if (::mprotect(p, bytes, PROT_READ | PROT_WRITE) != 0) {
    int const err = errno;
    reserved_.fetch_sub(bytes, std::memory_order_relaxed);
    throw_oom(bytes, before, capacity_, std::strerror(err));
  }
}

bool host_backend::do_vm_unmap(void* p, std::size_t bytes) noexcept {
  if (p == nullptr || bytes == 0) return false;
  // The memory goes back to the system at once (the pages read as zeros when touched again); the protection is
  // left as it is, so that unmapped holes between mapped pages never split the kernel's mapping into more pieces
  // (a process has at most vm.max_map_count of them).
  if (::madvise(p, bytes, MADV_DONTNEED) != 0) {
    GACT_WARN_CAPPED(8, "host_backend: releasing {} bytes at {} failed: {} (kept mapped)", bytes, p,
                     std::strerror(errno));
    return false;
  }
  reserved_.fetch_sub(bytes, std::memory_order_relaxed);
  return true;
}

stream_t host_backend::do_create_stream() { return next_handle_.fetch_add(1, std::memory_order_relaxed); }

event_t host_backend::do_create_event() { return next_handle_.fetch_add(1, std::memory_order_relaxed); }

void host_backend::do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t) {
  if (bytes == 0) return;
  GACT_EXPECTS(dst != nullptr && src != nullptr, "host_backend::copy_async: null pointer");
  std::memmove(dst, src, bytes);
}

mem_info host_backend::do_memory_info() {
  long const page = ::sysconf(_SC_PAGESIZE);
  long const phys = ::sysconf(_SC_PHYS_PAGES);
  long const avail = ::sysconf(_SC_AVPHYS_PAGES);
  mem_info info;
  if (page > 0 && phys > 0) info.total_bytes = std::size_t(phys) * std::size_t(page);
  if (page > 0 && avail > 0) info.free_bytes = std::size_t(avail) * std::size_t(page);
  if (capacity_ != 0) {
    std::size_t const used = reserved_.load(std::memory_order_relaxed);
    info.total_bytes = capacity_;
    info.free_bytes = used >= capacity_ ? 0 : capacity_ - used;
  }
  return info;
}

}  // namespace gact::device
