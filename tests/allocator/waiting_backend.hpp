// gact/tests/allocator/waiting_backend.hpp
//
// A device::backend standing in for another allocator with locks of its own (torch's CUDA allocator, which may
// run Python and wait for the GIL): while armed, its next reserve (armed = 1) or release (armed = 2) waits until
// another thread has finished a call into gact (other_thread_done()), up to `patience`. Held under one of gact's
// locks, that call cannot finish: the wait times out and served_meanwhile stays false. Memory is host memory.
// Header-only, for the allocator's and the store's tests.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string_view>

#include "allocator/device/backend.hpp"

namespace gact::test {

class waiting_backend final : public gact::device::backend {
 public:
  std::atomic<int> armed{0};  ///< 1: the next reserve waits; 2: the next release waits
  std::chrono::milliseconds patience{10'000};
  gact::device::memory_kind kind = gact::device::memory_kind::device;  ///< (host for a store's host arena)
  std::atomic<bool> waiting{false}, served_meanwhile{false};

  void other_thread_done() {
    std::lock_guard lock(mu_);
    done_ = true;
    cv_.notify_all();
  }

 private:
  void wait_for_other(int which) {
    int expected = which;
    if (!armed.compare_exchange_strong(expected, 0)) return;
    std::unique_lock lock(mu_);
    waiting = true;
    served_meanwhile = cv_.wait_for(lock, patience, [this] { return done_; });
  }
  void* do_reserve(std::size_t bytes) override {
    wait_for_other(1);
    return std::aligned_alloc(512, bytes);
  }
  void do_release(void* p, std::size_t /*bytes*/) noexcept override {
    try {
      wait_for_other(2);
    } catch (...) {
    }
    std::free(p);
  }
  gact::device::stream_t do_create_stream() override { return 0; }
  void do_destroy_stream(gact::device::stream_t) noexcept override {}
  gact::device::event_t do_create_event() override { return 1; }
  void do_destroy_event(gact::device::event_t) noexcept override {}
  void do_record(gact::device::event_t, gact::device::stream_t) override {}
  bool do_query(gact::device::event_t) override { return true; }
  void do_wait(gact::device::stream_t, gact::device::event_t) override {}
  void do_synchronize(gact::device::event_t) override {}
  void do_synchronize_stream(gact::device::stream_t) override {}
  void do_copy_async(void* d, void const* s, std::size_t n, gact::device::stream_t) override { std::memcpy(d, s, n); }
  gact::device::mem_info do_memory_info() override { return {}; }
  gact::device::memory_kind do_kind() const noexcept override { return kind; }
  std::string_view do_name() const noexcept override { return "waiting"; }

  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

}  // namespace gact::test
