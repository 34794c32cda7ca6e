// gact/tests/swap/test_mover_async.cpp
//
// The swap mover against asynchronous streams: cuda_backend and
// pinned_host_backend over the fake CUDA runtime (one worker thread per stream,
// each operation delayed by a random 0..FAKE_CUDART_DELAY_US µs, set by the test
// registration). A training-like loop "encodes" each blob with a copy on the
// compute stream (so the D2H copy must wait for it), hands it to the mover, and
// in backward "decodes" it with a copy on the compute stream (so the consumer
// must wait for the H2D copy), then compares every byte with what was saved.
//
// Instrumentation: the device backend is wrapped in a checking_backend that
// tracks every copy; the mover's before_free hook asserts that no copy touching
// the bytes is still running, then poisons them, so an early free also shows up
// as corrupted data. Budget, pinned slab reuse and the fake's illegal-address
// detection are checked too. A missing stream wait in the mover (D2H not waiting
// for the encode, consumer not waiting for the H2D copy, pinned bytes freed
// before their H2D copy) makes these tests fail.
#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/cuda_backend.hpp"
#include "allocator/device/pinned_host_backend.hpp"
#include "fake_cudart.h"
#include "swap/mover.hpp"
#include "swap/pinned_pool.hpp"
#include "tests/swap/checking_backend.hpp"

namespace {

using gact::swap::blob_id;
using gact::swap::mover;
using gact::swap::mover_options;

struct async_rig {
  gact::device::cuda_backend dev_raw{0};
  gact::test::checking_backend dev{dev_raw, gact::device::memory_kind::device};
  gact::device::pinned_host_backend pin{0};
  gact::alloc::caching_allocator arena{dev, arena_opts()};
  gact::swap::pinned_pool pool{pin, pool_opts()};
  std::atomic<int> early_frees{0};
  std::atomic<int> frees{0};
  std::unique_ptr<mover> m;

  static gact::alloc::allocator_options arena_opts() {
    gact::alloc::allocator_options o;
    o.name = "fake-device";
    return o;
  }
  static gact::swap::pinned_pool_options pool_opts() {
    gact::swap::pinned_pool_options o;
    o.slab_bytes = std::size_t{8} << 20;
    return o;
  }
  explicit async_rig(mover_options o) {
    o.stats_name = "";
    o.before_free = [this](void const* p, std::size_t n, bool) {
      if (dev.busy(p, n)) early_frees.fetch_add(1);
      std::memset(const_cast<void*>(p), 0xDB, n);  // fake device memory is host memory
      frees.fetch_add(1);
    };
    m = std::make_unique<mover>(arena, pool, std::move(o));
  }
  ~async_rig() { m.reset(); }
};

struct workload {
  int steps = 100;
  int blobs = 16;
  std::size_t max_bytes = 48 << 10;
  unsigned seed = 1;
};

struct saved_blob {
  blob_id id = 0;
  std::vector<unsigned char> want;
  std::vector<unsigned char> got;
};

// One thread's training loop on its own compute stream. Returns the number of blobs checked.
std::size_t run(async_rig& r, workload const& w, std::size_t budget, bool alone = true) {
  gact::device::stream_t const compute = r.dev.create_stream();
  std::mt19937 rng(w.seed);
  std::size_t checked = 0;
  for (int step = 0; step < w.steps; ++step) {
    // forward
    std::vector<std::unique_ptr<saved_blob>> saved;
    for (int i = 0; i < w.blobs; ++i) {
      auto b = std::make_unique<saved_blob>();
      std::size_t n = 1 + rng() % w.max_bytes;
      if (rng() % 16 == 0) n = (w.max_bytes * 4) + rng() % w.max_bytes;  // a few large ones
      b->want.resize(n);
      for (auto& c : b->want) c = static_cast<unsigned char>(rng());
      void* p = r.arena.allocate(n, compute);
      r.dev.copy_async(p, b->want.data(), n, compute);  // the "encode" writes the blob on compute
      b->id = r.m->put(p, n, compute);
      CHECK(r.m->stats().pending_bytes <= budget);
      if (rng() % 16 == 0) {
        // Dropped without backward. The hook poisons freed bytes at once, so let the encode
        // finish first (a real release may free it earlier: the arena's reuse is stream-ordered).
        r.dev.synchronize_stream(compute);
        r.m->release(b->id);
        b->id = 0;
      }
      saved.push_back(std::move(b));
    }
    if (step % 4 == 3) {
      r.m->synchronize();
      auto const s = r.m->stats();
      if (alone) {  // another thread's copies and gets would count
        CHECK(s.copies_in_flight == 0);
        if (budget > 0) CHECK(s.device_bytes <= budget);
      }
    }
    if (rng() % 2 == 0) r.m->begin_backward();
    // backward: reverse order of saving, with some neighbours swapped
    std::vector<std::size_t> order;
    for (std::size_t i = saved.size(); i-- > 0;) order.push_back(i);
    for (std::size_t i = 0; i + 1 < order.size(); ++i) {
      if (rng() % 8 == 0) std::swap(order[i], order[i + 1]);
    }
    std::vector<saved_blob*> pending;
    auto drain = [&] {
      r.dev.synchronize_stream(compute);
      for (saved_blob* b : pending) {
        bool const same = b->got == b->want;
        CHECK(same);
        r.m->release(b->id);
        ++checked;
      }
      pending.clear();
    };
    for (std::size_t i : order) {
      saved_blob& b = *saved[i];
      if (b.id == 0) continue;
      void const* q = r.m->acquire(b.id, compute);
      b.got.assign(b.want.size(), 0);
      r.dev.copy_async(b.got.data(), q, b.want.size(), compute);  // the "decode" reads it on compute
      pending.push_back(&b);
      if (rng() % 3 == 0) drain();
    }
    drain();
    r.dev.synchronize_stream(compute);  // the encodes of dropped blobs read `want`
  }
  r.dev.destroy_stream(compute);
  return checked;
}

void check_quiet(async_rig& r) {
  r.m->synchronize();
  auto const s = r.m->stats();
  CHECK(s.live_blobs == 0);
  CHECK(s.device_bytes == 0);
  CHECK(s.host_bytes == 0);
  CHECK(s.copies_in_flight == 0);
  CHECK(r.early_frees.load() == 0);
  CHECK(fake_cudart_take_async_error() == cudaSuccess);  // no copy touched a freed device range
}

}  // namespace

TEST_SUITE("threads") {
  TEST_CASE("async-offload-everything-prefetch-two") {
    mover_options o;
    o.device_budget = 0;
    o.lookahead_blobs = 2;
    async_rig r(o);
    workload w;
    w.steps = 120;
    std::size_t const checked = run(r, w, 0);
    check_quiet(r);
    auto const s = r.m->stats();
    MESSAGE("checked ", checked, " blobs; offloads ", s.offloads, ", hits ", s.prefetch_hits, " (late ",
            s.prefetch_late, "), misses ", s.prefetch_misses, ", kept ", s.offloads_kept);
    CHECK(checked > 1700);
    CHECK(s.offloads == s.puts);  // budget 0: every blob goes out
    CHECK(s.prefetch_hits > s.prefetch_misses);
    CHECK(s.bytes_in <= s.bytes_out);
    CHECK(r.frees.load() > 0);
    // pinned slabs are reused across steps: a handful of reserves for thousands of offloads
    CHECK(r.pool.allocator().stats().num_device_alloc <= 8);
  }

  TEST_CASE("async-budget-respected-prefetch-by-bytes") {
    mover_options o;
    o.device_budget = std::size_t{160} << 10;
    o.lookahead_blobs = 0;
    o.lookahead_bytes = std::size_t{128} << 10;
    async_rig r(o);
    workload w;
    w.steps = 80;
    w.seed = 2;
    std::size_t const checked = run(r, w, o.device_budget);
    check_quiet(r);
    auto const s = r.m->stats();
    CHECK(checked > 1000);
    CHECK(s.offloads > 0);
    CHECK(s.offloads < s.puts);  // the newest blobs stay under the budget
    CHECK(s.resident_gets > 0);
  }

  TEST_CASE("async-no-prefetch-every-get-fetches-on-demand") {
    mover_options o;
    o.device_budget = 0;
    o.lookahead_blobs = 0;
    async_rig r(o);
    workload w;
    w.steps = 50;
    w.seed = 3;
    std::size_t const checked = run(r, w, 0);
    check_quiet(r);
    auto const s = r.m->stats();
    CHECK(checked > 600);
    CHECK(s.prefetch_hits == 0);
    CHECK(s.prefetch_misses + s.resident_gets == checked);
  }

  TEST_CASE("async-two-training-threads-share-a-mover") {
    mover_options o;
    o.device_budget = std::size_t{64} << 10;
    o.lookahead_blobs = 3;
    async_rig r(o);
    std::size_t checked[2] = {0, 0};
    std::thread t0([&] {
      workload w;
      w.steps = 50;
      w.blobs = 12;
      w.seed = 11;
      checked[0] = run(r, w, std::size_t{64} << 10, false);
    });
    std::thread t1([&] {
      workload w;
      w.steps = 50;
      w.blobs = 12;
      w.seed = 12;
      checked[1] = run(r, w, std::size_t{64} << 10, false);
    });
    t0.join();
    t1.join();
    check_quiet(r);
    CHECK(checked[0] + checked[1] > 900);
  }
}
