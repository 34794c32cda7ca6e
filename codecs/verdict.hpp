// gact/codecs/verdict.hpp
//
// The host side of the device encoders' verdicts (codec.hpp: device_verdict). A quant encode on the GPU
// cannot return "this tensor holds NaN/±Inf" without a host synchronization, so it writes the answer into
// mapped page-locked memory once it has run; the host reads it later, when it next looks, with no CUDA
// call. A verdict_ring owns a fixed number of such slots:
//
//   ticket t = ring.acquire(&dv);          // before the launch: slot reset, dv filled in
//   encode_cuda(..., stream, &dv);
//   ...
//   switch (ring.poll(t)) { pending | clean | bad }   // any time later, a few loads
//   ring.release(t);                       // the caller no longer wants the answer (verdict_claim does it)
//
// The answer of a slot is kept until its ticket is polled as done or released, also when the ring has to
// reuse the slot (it is then moved to a small map), so no answer is ever lost. When every slot is busy with
// a launch that has not run yet, acquire() waits for the oldest (the only wait; the Compressor bounds how
// many verdicts it leaves open, so a ring of k_default_slots does not fill in practice).
//
// The memory is given to the ring (words: 2 per slot, host-readable and device-writable; counters: 1 per
// slot, device memory, zero), so the logic is tested on the host with a thread playing the device;
// create_device() makes it with the CUDA runtime.
#pragma once

#include "codecs/codec.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gact::codec {

/// `released`: the ticket was released meanwhile (by another caller who read the answer); ask them.
enum class verdict_state : int { pending = -1, clean = 0, bad = 1, released = 2 };

class verdict_ring {
 public:
  static constexpr std::uint32_t k_default_slots = 4096;

  struct ticket {
    std::uint32_t index = 0;
    std::uint32_t seq = 0;  ///< 0: no ticket
    bool valid() const noexcept { return seq != 0; }
  };

  /// `words`: 2·n words the device writes ([done seq, bad] per slot) and the host reads; `counters`: n device
  /// words, zero; `device_words`: the device's address of `words` (== words under unified addressing);
  /// `free_memory` runs at destruction.
  verdict_ring(std::uint32_t* words, std::uint32_t* device_words, std::uint32_t* counters, std::uint32_t n,
               std::function<void()> free_memory = {});
  ~verdict_ring();
  verdict_ring(verdict_ring const&) = delete;
  verdict_ring& operator=(verdict_ring const&) = delete;

#if defined(GACT_HAVE_KERNELS) && GACT_HAVE_KERNELS
  /// A ring in memory of the current CUDA device: the words page-locked and mapped (cudaHostAlloc), the
  /// counters cudaMalloc'ed and zeroed (one synchronization, at creation).
  /// @throws gact::cuda_error if the runtime cannot give the memory
  static std::unique_ptr<verdict_ring> create_device(std::uint32_t n = k_default_slots);
#endif

  /// A slot for one launch, reset, with `out` filled in for encode_cuda. Waits (spins, then sleeps, holding
  /// the ring) for the oldest launch when every slot is in flight; `stall` (if set) is called once the wait
  /// has lasted `stall_after`, for the caller to synchronize the device. A slot whose launch still has not
  /// reported then is retired for good (its launch may yet write it: never reused; its answer is `bad`, so
  /// the caller keeps the tensor exact) and the next one tried. With every slot retired: no ticket (invalid:
  /// the caller must treat the encode as unverified and keep its tensor exact).
  ticket acquire(device_verdict* out);
  /// The answer, without waiting. A done answer stays readable until release().
  verdict_state poll(ticket t);
  /// The answer, waiting for it up to `timeout` (then pending).
  verdict_state wait(ticket t, std::chrono::microseconds timeout);
  /// The caller wants no answer any more (its entry is gone, or its launch threw: it may have been queued
  /// all the same); the slot is reused once its launch has run.
  void release(ticket t) noexcept;

  std::uint32_t slots() const noexcept { return n_; }
  /// Slots whose launch has not been seen to run (for tests and stats).
  std::uint32_t in_flight() const;
  /// Times acquire() had to wait for a launch.
  std::uint64_t waits() const;

  /// acquire()'s patience before it calls `stall` (tests shorten it).
  std::function<void()> stall;
  std::chrono::microseconds stall_after{std::chrono::seconds(2)};

 private:
  enum class use : std::uint8_t { free, wanted, released, retired };
  struct slot {
    std::uint32_t seq = 0;
    use state = use::free;
  };
  bool done_locked(std::uint32_t i) const noexcept;
  bool bad_locked(std::uint32_t i) const noexcept;
  verdict_state poll_locked(ticket t);

  std::uint32_t* words_;
  std::uint32_t* device_words_;
  std::uint32_t* counters_;
  std::uint32_t n_;
  std::function<void()> free_memory_;
  mutable std::mutex mu_;
  std::vector<slot> slots_;
  std::uint32_t next_ = 0;
  std::uint32_t seq_ = 0;
  std::unordered_map<std::uint32_t, bool> answered_;  // seq -> bad, for tickets whose slot was reused
  std::uint64_t waits_ = 0;
  std::uint32_t retired_ = 0;
};

/// A ticket and its ring, released when dropped (move-only): what an encode holds until its entry takes it.
class verdict_claim {
 public:
  verdict_claim() = default;
  verdict_claim(verdict_ring* r, verdict_ring::ticket t) noexcept : ring_(r), t_(t) {}
  verdict_claim(verdict_claim&& o) noexcept : ring_(std::exchange(o.ring_, nullptr)), t_(o.t_) {}
  verdict_claim& operator=(verdict_claim&& o) noexcept {
    if (this != &o) {
      reset();
      ring_ = std::exchange(o.ring_, nullptr);
      t_ = o.t_;
    }
    return *this;
  }
  verdict_claim(verdict_claim const&) = delete;
  verdict_claim& operator=(verdict_claim const&) = delete;
  ~verdict_claim() { reset(); }
  void reset() noexcept {
    if (ring_ != nullptr) ring_->release(t_);
    ring_ = nullptr;
  }
  verdict_ring* ring() const noexcept { return ring_; }
  verdict_ring::ticket ticket() const noexcept { return t_; }
  /// Hand the ticket over (the claim no longer releases it).
  verdict_ring::ticket take(verdict_ring** ring) noexcept {
    *ring = std::exchange(ring_, nullptr);
    return t_;
  }

 private:
  verdict_ring* ring_ = nullptr;
  verdict_ring::ticket t_;
};

}  // namespace gact::codec
