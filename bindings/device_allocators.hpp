// gact/bindings/device_allocators.hpp
//
// One caching allocator per CUDA device, over a cuda_backend, created on first
// use: the state shared by the C ABI (c_abi.cpp, over the runtime gact links)
// and the LD_PRELOAD shim (preload.cpp, over the runtime found with RTLD_NEXT).
//
// Lifetime: a device_allocators and everything it creates are never destroyed.
// PyTorch and other libraries free memory from their own exit handlers, after
// our static destructors would have run; leaking the allocators (and their
// cached segments, which the process exit returns anyway) keeps such late
// calls safe.
//
// Concurrency: the per-device pointer is published with release/acquire, so
// the fast path (get() of a device already created) takes no lock.
// Invariant: slots_[d] != nullptr  =>  it points to the allocator of device d,
// and it never changes again.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/cuda_backend.hpp"
#include "allocator/error.hpp"
#include "allocator/log.hpp"
#include "allocator/options.hpp"

namespace gact::bindings {

class device_allocators {
 public:
  /// Devices beyond this index are rejected (more than any machine has).
  static constexpr int k_max_devices = 64;

  /// @param api runtime calls of the backends (a static table).
  /// @param name_prefix the allocators are named "<prefix>:<device>" in the stats.
  device_allocators(device::cuda_api const& api, std::string name_prefix)
      : api_(api), prefix_(std::move(name_prefix)) {}
  device_allocators(device_allocators const&) = delete;
  device_allocators& operator=(device_allocators const&) = delete;

  /// The allocator of `device`, created on first use with the options of the
  /// environment (GACT_MEMORY_LIMIT, ...) and any memory fraction set before.
  /// @throws gact::invalid_argument for a device that does not exist or a bad GACT_* value;
  ///         gact::cuda_error when the runtime cannot be queried.
  alloc::caching_allocator& get(int device) {
    GACT_EXPECTS(device >= 0 && device < k_max_devices,
                 "CUDA device " + std::to_string(device) + " is out of range");
    auto const d = static_cast<std::size_t>(device);
    if (alloc::caching_allocator* a = slots_[d].load(std::memory_order_acquire)) [[likely]] {
      return *a;
    }
    std::lock_guard lk(mu_);
    if (alloc::caching_allocator* a = slots_[d].load(std::memory_order_acquire)) {
      return *a;
    }
    auto* be = new device::cuda_backend(device, api_);  // leaked, see the file comment
    std::unique_ptr<device::cuda_backend> be_guard(be);
    alloc::allocator_options opts;
    opts.name = prefix_ + ":" + std::to_string(device);
    opts.memory_limit = limit_for(*be, fractions_[d]);
    if (options::from_env().expandable_segments) {
      if (be->vm_page() != 0) {
        opts.expandable_segments = true;
      } else {
        GACT_LOG_WARN("GACT_EXPANDABLE_SEGMENTS: the CUDA runtime has no driver virtual memory calls "
                      "(cudaGetDriverEntryPointByVersion, CUDA 12.5+); device {} keeps fixed segments", device);
      }
    }
    auto* a = new alloc::caching_allocator(*be, opts);
    be_guard.release();
    slots_[d].store(a, std::memory_order_release);
    return *a;
  }

  /// The allocator of `device` if it exists already, else nullptr. Never throws.
  alloc::caching_allocator* peek(int device) const noexcept {
    if (device < 0 || device >= k_max_devices) {
      return nullptr;
    }
    return slots_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
  }

  /// The allocator that handed out `p`, or nullptr when none did.
  alloc::caching_allocator* owner(void const* p) const noexcept {
    for (auto const& slot : slots_) {
      alloc::caching_allocator* a = slot.load(std::memory_order_acquire);
      if (a != nullptr && a->owns(p)) {
        return a;
      }
    }
    return nullptr;
  }

  /// Call f(device, allocator) for every allocator created so far.
  template <class F>
  void for_each(F&& f) const {
    for (int d = 0; d < k_max_devices; ++d) {
      if (alloc::caching_allocator* a = peek(d)) {
        f(d, *a);
      }
    }
  }

  /// Cap the allocator of `device` at `fraction` of the device's memory, like PyTorch's
  /// set_per_process_memory_fraction: from the next segment on when the allocator exists,
  /// else from its creation. GACT_MEMORY_LIMIT, when set and lower, still applies. Bytes
  /// reserved beyond a lowered cap stay until freed (new segments are refused meanwhile).
  /// @throws gact::invalid_argument for a fraction outside (0, 1] or a bad device;
  ///         gact::cuda_error when the device's memory size cannot be read.
  void set_memory_fraction(double fraction, int device) {
    GACT_EXPECTS(fraction > 0.0 && fraction <= 1.0,
                 "memory fraction " + std::to_string(fraction) + " is not in (0, 1]");
    GACT_EXPECTS(device >= 0 && device < k_max_devices,
                 "CUDA device " + std::to_string(device) + " is out of range");
    std::lock_guard lk(mu_);
    fractions_[static_cast<std::size_t>(device)] = fraction;
    if (alloc::caching_allocator* a = peek(device)) {
      a->set_memory_limit(limit_for(a->backend(), fraction));
    }
  }

 private:
  /// The cap for a device: GACT_MEMORY_LIMIT and `fraction` of its memory (0 = not set), the lower.
  static std::size_t limit_for(device::backend& be, double fraction) {
    auto limit = static_cast<std::size_t>(options::from_env().memory_limit);
    if (fraction > 0.0) {
      auto const cap = static_cast<std::size_t>(fraction * static_cast<double>(be.memory_info().total_bytes));
      limit = limit == 0 ? cap : std::min(limit, cap);
    }
    return limit;
  }

  device::cuda_api const& api_;
  std::string const prefix_;
  std::mutex mu_;  ///< serializes creation and fractions_
  std::array<std::atomic<alloc::caching_allocator*>, k_max_devices> slots_{};
  std::array<double, k_max_devices> fractions_{};  ///< 0 = no fraction set
};

}  // namespace gact::bindings
