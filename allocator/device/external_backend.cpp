// gact/allocator/device/external_backend.cpp — see external_backend.hpp.
#include "allocator/device/external_backend.hpp"

#include <utility>

#include "allocator/device/device_guard.hpp"
#include "allocator/error.hpp"

namespace gact::device {

external_backend::external_backend(external_blocks blocks, cuda_backend& delegate, std::string name)
    : blocks_(blocks), delegate_(delegate), name_(std::move(name)) {
  GACT_EXPECTS(blocks_.version == 1 && blocks_.alloc != nullptr && blocks_.free != nullptr,
               "external_backend: the block table is of another version or lacks its entry points");
}

void* external_backend::do_reserve(std::size_t bytes) {
  GACT_EXPECTS(bytes > 0, "external_backend::reserve: size must be positive");
  device_guard const guard(delegate_.api(), delegate_.device());
  char why[512] = {0};
  void* p = blocks_.alloc(bytes, delegate_.device(), why, sizeof why);
  if (p == nullptr) {
    why[sizeof why - 1] = '\0';
    GACT_FAIL(name_ + ": cannot allocate " + std::to_string(bytes) + " bytes on device " +
                  std::to_string(delegate_.device()) + ": " + (why[0] != '\0' ? why : "no reason given"),
              gact::out_of_memory);
  }
  return p;
}

void external_backend::do_release(void* p, std::size_t /*bytes*/) noexcept {
  if (p != nullptr) blocks_.free(p, delegate_.device());
}

stream_t external_backend::do_create_stream() { return delegate_.create_stream(); }
void external_backend::do_destroy_stream(stream_t s) noexcept { delegate_.destroy_stream(s); }
event_t external_backend::do_create_event() { return delegate_.create_event(); }
void external_backend::do_destroy_event(event_t e) noexcept { delegate_.destroy_event(e); }
void external_backend::do_record(event_t e, stream_t s) { delegate_.record(e, s); }
bool external_backend::do_query(event_t e) { return delegate_.query(e); }
void external_backend::do_wait(stream_t s, event_t e) { delegate_.wait(s, e); }
void external_backend::do_synchronize(event_t e) { delegate_.synchronize(e); }
void external_backend::do_synchronize_stream(stream_t s) { delegate_.synchronize_stream(s); }
void external_backend::do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) {
  delegate_.copy_async(dst, src, bytes, s);
}
mem_info external_backend::do_memory_info() { return delegate_.memory_info(); }

alloc::allocator_options pass_through_options(std::string name) {
  alloc::allocator_options o;
  o.small_size = 512;           // (the smallest the options allow: a 512-byte segment of its own)
  o.small_segment_size = 512;
  o.min_large_alloc = 1024;     // from here on every request is a segment of its own
  o.large_segment_size = 1024;  // (requests in (512, 1024) get a 1024-byte one)
  o.round_large = 512;
  o.release_free_above = 1;     // any segment wholly free goes back at once: the other allocator caches
  o.retry_when_empty = false;   // (and it retries after freeing its cache before it fails)
  o.backend_unlocked = true;    // it takes locks of its own and may run Python: never called under gact's lock
  o.name = std::move(name);
  return o;
}

}  // namespace gact::device
