// gact/allocator/device/external_backend.hpp
//
// A device backend whose memory comes from another allocator: torch's own CUDA caching allocator,
// when gact is not torch's CUDA allocator (bindings/python/device_block_fns.h hands its entry
// points over). Two caching pools side by side cannot reuse each other's free memory: blob bytes
// freed in backward sat idle in gact's pool while torch's pool grew for the gradients, and
// torch.cuda.max_memory_allocated() never saw the blobs. Over this backend the store's device
// arena is a thin layer (pass_through_options(): each blob and decoded image its own segment,
// released to the other allocator when freed), so there is one pool, torch's, and its counters
// tell the truth.
//
// Streams, events, copies and memory information are the CUDA backend's (`delegate`); reserve()
// makes the delegate's device current for the call, since torch's allocator allocates on the
// calling thread's current device and current stream. A failed allocation (out of memory, or no
// allocator registered) throws gact::out_of_memory with the other allocator's reason, which the
// store answers by keeping the tensor as it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/cuda_backend.hpp"
#include "allocator/device/external_blocks.hpp"

namespace gact::device {

class external_backend final : public backend {
 public:
  /// Memory from `blocks`, everything else from `delegate` (its device is this backend's).
  /// @param delegate must outlive the backend.
  /// @throws gact::invalid_argument for a table of another version or without entry points.
  external_backend(external_blocks blocks, cuda_backend& delegate, std::string name);

  int device() const noexcept { return delegate_.device(); }

 private:
  void* do_reserve(std::size_t bytes) override;
  void do_release(void* p, std::size_t bytes) noexcept override;
  stream_t do_create_stream() override;
  void do_destroy_stream(stream_t s) noexcept override;
  event_t do_create_event() override;
  void do_destroy_event(event_t e) noexcept override;
  void do_record(event_t e, stream_t s) override;
  bool do_query(event_t e) override;
  void do_wait(stream_t s, event_t e) override;
  void do_synchronize(event_t e) override;
  void do_synchronize_stream(stream_t s) override;
  void do_copy_async(void* dst, void const* src, std::size_t bytes, stream_t s) override;
  mem_info do_memory_info() override;
  memory_kind do_kind() const noexcept override { return memory_kind::device; }
  std::string_view do_name() const noexcept override { return name_; }

  external_blocks blocks_;
  cuda_backend& delegate_;
  std::string name_;
};

/// Options that make a caching allocator over an external_backend a thin layer: every request its own
/// segment of the request rounded to 512 bytes, released to the backend as soon as it is free; the backend
/// called with the caching allocator's lock released (backend_unlocked).
alloc::allocator_options pass_through_options(std::string name);

}  // namespace gact::device
