// gact/codecs/verdict.cpp — see verdict.hpp.
#include "codecs/verdict.hpp"

#include "allocator/error.hpp"

#include <atomic>
#include <string>
#include <thread>

#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
#include <cuda_runtime.h>
#endif

namespace gact::codec {

namespace {
std::uint32_t load_acquire(std::uint32_t* w) noexcept {
  return std::atomic_ref<std::uint32_t>(*w).load(std::memory_order_acquire);
}
void store_relaxed(std::uint32_t* w, std::uint32_t v) noexcept {
  std::atomic_ref<std::uint32_t>(*w).store(v, std::memory_order_relaxed);
}
}  // namespace

verdict_ring::verdict_ring(std::uint32_t* words, std::uint32_t* device_words, std::uint32_t* counters, std::uint32_t n,
                           std::function<void()> free_memory)
    : words_(words), device_words_(device_words), counters_(counters), n_(n), free_memory_(std::move(free_memory)),
      slots_(n) {
  GACT_EXPECTS(words != nullptr && device_words != nullptr && counters != nullptr,
               "verdict_ring: words and counters are required");
  GACT_EXPECTS(n > 0, "verdict_ring: needs at least one slot");
  for (std::uint32_t i = 0; i < 2 * n; ++i) store_relaxed(words_ + i, 0);
}

verdict_ring::~verdict_ring() {
  if (free_memory_) free_memory_();
}

bool verdict_ring::done_locked(std::uint32_t i) const noexcept {
  return load_acquire(words_ + 2 * std::size_t(i)) == slots_[i].seq;
}

bool verdict_ring::bad_locked(std::uint32_t i) const noexcept {
  return load_acquire(words_ + 2 * std::size_t(i) + 1) != 0;
}

verdict_ring::ticket verdict_ring::acquire(device_verdict* out) {
  GACT_EXPECTS(out != nullptr, "verdict_ring::acquire: out is null");
  std::unique_lock lock(mu_);
  for (std::uint32_t tries = 0; tries < n_; ++tries) {
    std::uint32_t const i = next_;
    next_ = next_ + 1 == n_ ? 0 : next_ + 1;
    slot& s = slots_[i];
    if (s.state == use::retired) continue;
    if (s.state != use::free) {
      // the oldest slot (round robin): wait for its launch if it has not run (the ring held: no other acquire
      // can take the slot meanwhile), keep its answer if still wanted
      if (!done_locked(i)) {
        ++waits_;
        auto const start = std::chrono::steady_clock::now();
        bool stalled = false;
        int spins = 0;
        while (!done_locked(i)) {
          if (++spins < 64) std::this_thread::yield();
          else std::this_thread::sleep_for(std::chrono::microseconds(20));
          if (std::chrono::steady_clock::now() - start <= stall_after) continue;
          if (stalled) break;
          stalled = true;
          if (stall) stall();
        }
      }
      if (!done_locked(i)) {
        // it never reported: retired for good (its launch may still write the slot), answered bad if wanted
        if (s.state == use::wanted) answered_[s.seq] = true;
        s.state = use::retired;
        ++retired_;
        continue;
      }
      if (s.state == use::wanted) answered_[s.seq] = bad_locked(i);
    }
    if (++seq_ == 0) seq_ = 1;  // 0 means "no ticket"
    s.seq = seq_;
    s.state = use::wanted;
    // (sequentially consistent stores: the reset is in memory before the launch is made)
    std::atomic_ref<std::uint32_t>(words_[2 * std::size_t(i)]).store(0, std::memory_order_seq_cst);
    std::atomic_ref<std::uint32_t>(words_[2 * std::size_t(i) + 1]).store(0, std::memory_order_seq_cst);
    out->word = device_words_ + 2 * std::size_t(i);
    out->counter = counters_ + i;
    out->seq = s.seq;
    return ticket{i, s.seq};
  }
  return ticket{};  // every slot retired
}

verdict_state verdict_ring::poll_locked(ticket t) {
  if (!t.valid()) return verdict_state::clean;
  GACT_EXPECTS(t.index < n_, "verdict_ring: ticket index " + std::to_string(t.index) + " out of range");
  slot const& s = slots_[t.index];
  if (s.seq == t.seq && s.state == use::wanted) {
    if (!done_locked(t.index)) return verdict_state::pending;
    return bad_locked(t.index) ? verdict_state::bad : verdict_state::clean;
  }
  auto const it = answered_.find(t.seq);
  if (it == answered_.end()) return verdict_state::released;
  return it->second ? verdict_state::bad : verdict_state::clean;
}

verdict_state verdict_ring::poll(ticket t) {
  std::lock_guard lock(mu_);
  return poll_locked(t);
}

verdict_state verdict_ring::wait(ticket t, std::chrono::microseconds timeout) {
  auto const start = std::chrono::steady_clock::now();
  int spins = 0;
  for (;;) {
    {
      std::lock_guard lock(mu_);
      verdict_state const v = poll_locked(t);
      if (v != verdict_state::pending) return v;
    }
    if (std::chrono::steady_clock::now() - start >= timeout) return verdict_state::pending;
    if (++spins < 64) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void verdict_ring::release(ticket t) noexcept {
  if (!t.valid() || t.index >= n_) return;
  std::lock_guard lock(mu_);
  slot& s = slots_[t.index];
  if (s.seq == t.seq && s.state == use::wanted) {
    // free now when the launch has run; otherwise once acquire() comes round to it
    s.state = done_locked(t.index) ? use::free : use::released;
  } else {
    answered_.erase(t.seq);
  }
}

std::uint32_t verdict_ring::in_flight() const {
  std::lock_guard lock(mu_);
  std::uint32_t k = 0;
  for (std::uint32_t i = 0; i < n_; ++i)
    if (slots_[i].state != use::free && slots_[i].state != use::retired && !done_locked(i)) ++k;
  return k;
}

std::uint64_t verdict_ring::waits() const {
  std::lock_guard lock(mu_);
  return waits_;
}

#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
std::unique_ptr<verdict_ring> verdict_ring::create_device(std::uint32_t n) {
  GACT_EXPECTS(n > 0, "verdict_ring::create_device: needs at least one slot");
  auto fail = [](char const* what, cudaError_t e) {
    GACT_FAIL(std::string("verdict_ring: ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")",
              ::gact::cuda_error);
  };
  void* words = nullptr;
  cudaError_t e = cudaHostAlloc(&words, 2 * sizeof(std::uint32_t) * n, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) fail("cudaHostAlloc of the verdict words", e);
  void* counters = nullptr;
  e = cudaMalloc(&counters, sizeof(std::uint32_t) * n);
  if (e == cudaSuccess) e = cudaMemsetAsync(counters, 0, sizeof(std::uint32_t) * n, nullptr);
  if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
  if (e != cudaSuccess) {
    if (counters != nullptr) (void)cudaFree(counters);
    (void)cudaFreeHost(words);
    fail("the verdict counters", e);
  }
  // (unified addressing, which every device gact builds for has: the host address is the device's)
  auto* w = static_cast<std::uint32_t*>(words);
  return std::make_unique<verdict_ring>(w, w, static_cast<std::uint32_t*>(counters), n, [words, counters] {
    (void)cudaFree(counters);
    (void)cudaFreeHost(words);
  });
}
#endif

}  // namespace gact::codec
