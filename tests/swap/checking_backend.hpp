// gact/tests/swap/checking_backend.hpp
//
// A device::backend adaptor for the swap tests. It forwards everything to an
// inner backend and adds:
//   * copy tracking: after each copy_async it records an event of its own on the
//     copy's stream, so `busy(p, n)` can tell whether any copy that reads or
//     writes [p, p+n) may still be running (the instrumented check that the mover
//     frees no device or pinned byte under a copy);
//   * wait tracking: the (stream, event) pairs of every wait(), so a test can see
//     that a consumer stream was told to wait for a copy;
//   * fault injection: the next n reserves throw gact::out_of_memory;
//   * a kind override, so that a manual_backend (host memory, events completed on
//     command) can play a device.
// Thread-safe (one mutex; the inner backend is called outside it except for the
// tracking events).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "allocator/device/backend.hpp"
#include "allocator/error.hpp"

namespace gact::test {

class checking_backend final : public device::backend {
 public:
  explicit checking_backend(device::backend& inner, device::memory_kind kind)
      : inner_(inner), kind_(kind) {}
  ~checking_backend() override {
    std::lock_guard lock(mu_);
    for (auto const& c : copies_) inner_.destroy_event(c.done);
    for (auto e : spare_) inner_.destroy_event(e);
  }

  /// The next `n` reserves throw gact::out_of_memory.
  void fail_next_reserves(int n) { fail_.store(n); }
  /// Reserves refused so far.
  int refused() const { return refused_.load(); }

  /// True when a copy that touches [p, p+n) (as source or destination) may still be running.
  bool busy(void const* p, std::size_t n) {
    auto const lo = reinterpret_cast<std::uintptr_t>(p);
    auto const hi = lo + n;
    std::lock_guard lock(mu_);
    bool any = false;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      copy_rec& c = copies_[i];
      if (inner_.query(c.done)) {
        spare_.push_back(c.done);  // finished: forget it
        continue;
      }
      bool const hit = (c.dst < hi && lo < c.dst + c.bytes) || (c.src < hi && lo < c.src + c.bytes);
      any = any || hit;
      copies_[kept++] = c;
    }
    copies_.resize(kept);
    return any;
  }
  /// True when some wait(s, e) call was made with this stream and event.
  bool waited(device::stream_t s, device::event_t e) const {
    std::lock_guard lock(mu_);
    for (auto const& w : waits_) {
      if (w.first == s && w.second == e) return true;
    }
    return false;
  }
  /// Number of wait() calls made on stream `s`.
  std::size_t waits_on(device::stream_t s) const {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (auto const& w : waits_) n += w.first == s ? 1 : 0;
    return n;
  }
  std::size_t copies() const { return copy_count_.load(); }

 private:
  struct copy_rec {
    std::uintptr_t dst, src;
    std::size_t bytes;
    device::event_t done;
  };

  void* do_reserve(std::size_t bytes) override {
    if (fail_.load() > 0) {
      fail_.fetch_sub(1);
      refused_.fetch_add(1);
      throw out_of_memory("checking_backend: injected out of memory");
    }
    return inner_.reserve(bytes);
  }
  void do_release(void* p, std::size_t bytes) noexcept override { inner_.release(p, bytes); }
  device::stream_t do_create_stream() override { return inner_.create_stream(); }
  void do_destroy_stream(device::stream_t s) noexcept override { inner_.destroy_stream(s); }
  device::event_t do_create_event() override { return inner_.create_event(); }
  void do_destroy_event(device::event_t e) noexcept override { inner_.destroy_event(e); }
  void do_record(device::event_t e, device::stream_t s) override { inner_.record(e, s); }
  bool do_query(device::event_t e) override { return inner_.query(e); }
  void do_wait(device::stream_t s, device::event_t e) override {
    {
      std::lock_guard lock(mu_);
      waits_.emplace_back(s, e);
    }
    inner_.wait(s, e);
  }
  void do_synchronize(device::event_t e) override { inner_.synchronize(e); }
  void do_synchronize_stream(device::stream_t s) override { inner_.synchronize_stream(s); }
  void do_copy_async(void* dst, void const* src, std::size_t bytes, device::stream_t s) override {
    std::lock_guard lock(mu_);  // held so that busy() never sees the copy without its event
    inner_.copy_async(dst, src, bytes, s);
    device::event_t e = 0;
    if (!spare_.empty()) {
      e = spare_.back();
      spare_.pop_back();
    } else {
      e = inner_.create_event();
    }
    inner_.record(e, s);
    copies_.push_back({reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(src), bytes, e});
    copy_count_.fetch_add(1);
  }
  device::mem_info do_memory_info() override { return inner_.memory_info(); }
  device::memory_kind do_kind() const noexcept override { return kind_; }
  std::string_view do_name() const noexcept override { return inner_.name(); }

  device::backend& inner_;
  device::memory_kind const kind_;
  mutable std::mutex mu_;
  std::vector<copy_rec> copies_;   // copies not yet seen complete
  std::vector<device::event_t> spare_;
  std::vector<std::pair<device::stream_t, device::event_t>> waits_;
  std::atomic<int> fail_{0};
  std::atomic<int> refused_{0};
  std::atomic<std::size_t> copy_count_{0};
};

}  // namespace gact::test
