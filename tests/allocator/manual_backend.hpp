// gact/tests/allocator/manual_backend.hpp
//
// A device::backend for tests whose streams never finish on their own: an event
// recorded on a stream completes only when the test says so (complete_stream,
// complete_event, complete_all) or when the host waits for it (synchronize*). It
// also counts every call and can refuse reserves, so tests can check that the
// allocator polls events without blocking on the fast path, releases and retries
// on out-of-memory, and stays consistent when the backend fails.
//
// Memory is ordinary host memory (aligned_alloc, 512-byte aligned). Thread-safe.
// Header-only so that other test executables (CUDA, swap) can reuse it.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "allocator/device/backend.hpp"
#include "allocator/error.hpp"

namespace gact::test {

class manual_backend final : public device::backend {
 public:
  /// @param capacity bytes that may be reserved at once (0 = unlimited); more throws out_of_memory.
  explicit manual_backend(std::size_t capacity = 0) : capacity_(capacity) {}
  ~manual_backend() override = default;

  // ---- test controls ----
  /// Complete every event recorded on `s` so far (the stream has caught up).
  void complete_stream(device::stream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, ev] : events_) {
      if (ev.recorded && ev.stream == s) ev.complete = true;
    }
  }
  /// Complete one event.
  void complete_event(device::event_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    events_[e].complete = true;
  }
  /// Complete every recorded event.
  void complete_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, ev] : events_) ev.complete = true;
  }
  /// The next `n` reserves throw gact::out_of_memory regardless of capacity.
  void fail_next_reserves(int n) { fail_oom_.store(n); }
  /// The next reserve throws gact::cuda_error (a device failure other than OOM).
  void fail_next_reserve_with_device_error() { fail_device_.store(true); }

  // ---- counters ----
  int reserves() const { return reserves_.load(); }
  int releases() const { return releases_.load(); }
  int queries() const { return queries_.load(); }
  int records() const { return records_.load(); }
  /// synchronize(event) + synchronize_stream(stream) calls: the host blocked.
  int host_syncs() const { return syncs_.load(); }
  int events_created() const { return events_created_.load(); }
  std::size_t reserved_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reserved_;
  }
  /// Recorded events that have not completed.
  int incomplete_events() const {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (auto const& [id, ev] : events_) n += (ev.recorded && !ev.complete) ? 1 : 0;
    return n;
  }

 private:
  struct event_state {
    device::stream_t stream = 0;
    bool recorded = false;
    bool complete = true;
  };

  void* do_reserve(std::size_t bytes) override {
    if (fail_device_.exchange(false)) throw cuda_error("manual_backend: injected device error");
    if (fail_oom_.load() > 0) {
      fail_oom_.fetch_sub(1);
      throw out_of_memory("manual_backend: injected out of memory");
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (capacity_ != 0 && reserved_ + bytes > capacity_) {
      throw out_of_memory("manual_backend: capacity " + std::to_string(capacity_) + " reached");
    }
    void* p = std::aligned_alloc(512, (bytes + 511) / 512 * 512);
    if (p == nullptr) throw out_of_memory("manual_backend: host allocation failed");
    reserved_ += bytes;
    ++reserves_;
    return p;
  }
  void do_release(void* p, std::size_t bytes) noexcept override {
    std::free(p);
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= bytes;
    ++releases_;
  }
  device::stream_t do_create_stream() override { return next_.fetch_add(1); }
  void do_destroy_stream(device::stream_t) noexcept override {}
  device::event_t do_create_event() override {
    device::event_t const e = next_.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu_);
    events_[e] = event_state{};
    ++events_created_;
    return e;
  }
  void do_destroy_event(device::event_t e) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.erase(e);
  }
  void do_record(device::event_t e, device::stream_t s) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_[e] = event_state{s, true, false};
    ++records_;
  }
  bool do_query(device::event_t e) override {
    ++queries_;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = events_.find(e);
    return it == events_.end() || it->second.complete;
  }
  void do_wait(device::stream_t, device::event_t) override {}
  void do_synchronize(device::event_t e) override {
    ++syncs_;
    std::lock_guard<std::mutex> lock(mu_);
    events_[e].complete = true;
  }
  void do_synchronize_stream(device::stream_t s) override {
    ++syncs_;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, ev] : events_) {
      if (ev.stream == s) ev.complete = true;
    }
  }
  void do_copy_async(void* dst, void const* src, std::size_t bytes, device::stream_t) override {
    if (bytes != 0) std::memmove(dst, src, bytes);
  }
  device::mem_info do_memory_info() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::size_t const total = capacity_ != 0 ? capacity_ : (std::size_t{1} << 40);
    return {total - reserved_, total};
  }
  device::memory_kind do_kind() const noexcept override { return device::memory_kind::host; }
  std::string_view do_name() const noexcept override { return "manual"; }

  std::size_t const capacity_;
  mutable std::mutex mu_;
  std::map<device::event_t, event_state> events_;  // guarded by mu_
  std::size_t reserved_ = 0;                       // guarded by mu_
  std::atomic<device::stream_t> next_{1};
  std::atomic<int> fail_oom_{0};
  std::atomic<bool> fail_device_{false};
  std::atomic<int> reserves_{0}, releases_{0}, queries_{0}, records_{0}, syncs_{0}, events_created_{0};
};

}  // namespace gact::test
