// gact/tests/allocator/fixtures.hpp — contract fixtures for the host backend and
// the manual-event backend (see contract.hpp for the fixture interface).
#pragma once

#include <array>
#include <memory>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "manual_backend.hpp"

namespace gact::test {

template <class Backend>
struct backend_fixture {
  static constexpr bool host_accessible = true;
  Backend be;
  std::array<device::stream_t, 4> streams{};

  device::backend& backend() { return be; }
  std::unique_ptr<alloc::caching_allocator> make(alloc::allocator_options o) {
    return std::make_unique<alloc::caching_allocator>(be, std::move(o));
  }
  device::stream_t stream(int i) {
    auto& s = streams.at(static_cast<std::size_t>(i));
    if (s == 0) s = be.create_stream();
    return s;
  }
};

using host_fixture = backend_fixture<device::host_backend>;
using manual_fixture = backend_fixture<manual_backend>;

/// The manual-event backend called with the allocator's lock released (backend_unlocked, as over torch's pool):
/// the same contract.
struct unlocked_fixture : backend_fixture<manual_backend> {
  std::unique_ptr<alloc::caching_allocator> make(alloc::allocator_options o) {
    o.backend_unlocked = true;
    return std::make_unique<alloc::caching_allocator>(be, std::move(o));
  }
};

}  // namespace gact::test
