// gact/tests/cuda/cuda_fixtures.hpp
//
// Contract fixtures (see tests/allocator/contract.hpp) for the CUDA backends over
// the fake runtime, and small helpers shared by the CUDA tests. The fake's
// "device" memory is host memory, so the contract's host-side writes are valid.
#pragma once

#include <array>
#include <cstddef>
#include <memory>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/cuda_backend.hpp"
#include "allocator/device/pinned_host_backend.hpp"
#include "fake_cudart.h"

namespace gact::test {

template <class Backend>
struct cuda_fixture_base {
  static constexpr bool host_accessible = true;  // only true over the fake runtime
  Backend be{0, device::direct_cuda_api()};
  std::array<device::stream_t, 4> streams{};

  cuda_fixture_base() = default;
  cuda_fixture_base(cuda_fixture_base const&) = delete;
  cuda_fixture_base& operator=(cuda_fixture_base const&) = delete;
  ~cuda_fixture_base() {
    for (device::stream_t s : streams) {
      be.destroy_stream(s);
    }
  }

  device::backend& backend() { return be; }
  std::unique_ptr<alloc::caching_allocator> make(alloc::allocator_options o) {
    return std::make_unique<alloc::caching_allocator>(be, std::move(o));
  }
  device::stream_t stream(int i) {
    auto& s = streams.at(static_cast<std::size_t>(i));
    if (s == 0) {
      s = be.create_stream();
    }
    return s;
  }
};

using cuda_fixture = cuda_fixture_base<device::cuda_backend>;
using pinned_fixture = cuda_fixture_base<device::pinned_host_backend>;

/// Sets the fake's capacity for a scope and restores the default (8 GiB) after.
class capacity_scope {
 public:
  explicit capacity_scope(std::size_t bytes) { fake_cudart_set_capacity(bytes); }
  ~capacity_scope() { fake_cudart_set_capacity(std::size_t{8} << 30); }
  capacity_scope(capacity_scope const&) = delete;
  capacity_scope& operator=(capacity_scope const&) = delete;
};

}  // namespace gact::test
