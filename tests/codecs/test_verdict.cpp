// tests/codecs/test_verdict.cpp — the host side of the device encoders' verdicts (codecs/verdict.hpp), with
// threads playing the GPU: `launch` does what quant_encode_kernel's report_verdict does, block by block.
#include "codecs/verdict.hpp"

#include "allocator/error.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

using namespace gact::codec;
using namespace std::chrono_literals;

namespace {

struct ring_memory {
  std::vector<std::uint32_t> words, counters;
  explicit ring_memory(std::uint32_t n) : words(2 * n, 0xDEADu), counters(n, 0) {}
  verdict_ring make() { return verdict_ring(words.data(), words.data(), counters.data(), words.size() / 2); }
};

/// What report_verdict does on the device: each block flags a bad group, counts itself, and the last one
/// resets the counter and publishes the sequence number.
void launch(device_verdict const& v, unsigned blocks, std::vector<unsigned> const& bad_blocks) {
  for (unsigned b = 0; b < blocks; ++b) {
    for (unsigned x : bad_blocks)
      if (x == b) std::atomic_ref<std::uint32_t>(v.word[1]).store(1, std::memory_order_seq_cst);
    unsigned const before = std::atomic_ref<std::uint32_t>(*v.counter).fetch_add(1);
    if (before == blocks - 1) {
      *v.counter = 0;
      std::atomic_ref<std::uint32_t>(v.word[0]).store(v.seq, std::memory_order_release);
    }
  }
}

}  // namespace

TEST_SUITE("unit") {
  TEST_CASE("verdict ring: pending until the launch has run, then its answer; the counter is ready again") {
    ring_memory m(8);
    verdict_ring r = m.make();
    for (bool bad : {false, true}) {
      device_verdict dv;
      auto const t = r.acquire(&dv);
      REQUIRE(t.valid());
      CHECK(dv.word == m.words.data() + 2 * t.index);
      CHECK(dv.counter == m.counters.data() + t.index);
      CHECK(dv.seq == t.seq);
      CHECK(dv.word[0] != dv.seq);  // reset for the launch
      CHECK(dv.word[1] == 0);
      CHECK(r.poll(t) == verdict_state::pending);
      CHECK(r.in_flight() == 1);
      // 5 blocks; only block 3 (say) met a NaN
      launch(dv, 5, bad ? std::vector<unsigned>{3} : std::vector<unsigned>{});
      CHECK(*dv.counter == 0);
      CHECK(r.poll(t) == (bad ? verdict_state::bad : verdict_state::clean));
      CHECK(r.poll(t) == (bad ? verdict_state::bad : verdict_state::clean));  // stays readable
      CHECK(r.in_flight() == 0);
      r.release(t);
    }
    CHECK(r.waits() == 0);
  }

  TEST_CASE("verdict ring: a reused slot keeps the answer of a ticket not read yet") {
    ring_memory m(2);
    verdict_ring r = m.make();
    device_verdict a, b, c;
    auto const ta = r.acquire(&a);
    auto const tb = r.acquire(&b);
    launch(a, 1, {0});
    launch(b, 3, {});
    auto const tc = r.acquire(&c);  // round robin: ta's slot
    CHECK(tc.index == ta.index);
    CHECK(r.poll(tc) == verdict_state::pending);
    CHECK(r.poll(ta) == verdict_state::bad);  // from the side map
    CHECK(r.poll(tb) == verdict_state::clean);
    r.release(ta);
    CHECK(r.poll(ta) == verdict_state::released);  // no answer any more: whoever released it read it
    CHECK(r.wait(ta, 1s) == verdict_state::released);
    launch(c, 2, {1});
    CHECK(r.poll(tc) == verdict_state::bad);
    r.release(tb);
    r.release(tc);
  }

  TEST_CASE("verdict ring: acquire waits for the oldest launch when every slot is in flight") {
    ring_memory m(1);
    verdict_ring r = m.make();
    device_verdict a, b;
    auto const ta = r.acquire(&a);
    std::thread gpu([&] {
      std::this_thread::sleep_for(30ms);
      launch(a, 4, {});
    });
    auto const tb = r.acquire(&b);  // blocks until the launch of `a` has run
    gpu.join();
    CHECK(r.waits() == 1);
    CHECK(r.poll(ta) == verdict_state::clean);
    CHECK(tb.index == ta.index);
    CHECK(r.poll(tb) == verdict_state::pending);
    launch(b, 1, {});
    CHECK(r.wait(tb, 1s) == verdict_state::clean);
  }

  TEST_CASE("verdict ring: a launch that never reports retires its slot, answered bad (the tensor kept exact)") {
    ring_memory m(2);
    verdict_ring r = m.make();
    int stalls = 0;
    r.stall_after = 1ms;
    r.stall = [&] { ++stalls; };
    device_verdict a, b, c, d;
    auto const ta = r.acquire(&a);
    auto const tb = r.acquire(&b);
    auto const tc = r.acquire(&c);  // both slots wait for launches that never report: both retired
    CHECK(stalls == 2);
    CHECK_FALSE(tc.valid());  // no slot left: the caller keeps its tensor exact
    CHECK(r.poll(ta) == verdict_state::bad);
    CHECK(r.poll(tb) == verdict_state::bad);
    CHECK(r.in_flight() == 0);
    // a late report of a retired slot's launch changes nothing
    launch(a, 1, {});
    CHECK(r.poll(ta) == verdict_state::bad);
    r.release(ta);
    r.release(tb);
    CHECK_FALSE(r.acquire(&d).valid());  // (retired for good: at once, no wait)
    CHECK(stalls == 2);
  }

  TEST_CASE("verdict ring: the stall hook's synchronization lets the oldest launch report") {
    ring_memory m(1);
    verdict_ring r = m.make();
    r.stall_after = 1ms;
    device_verdict a, b;
    auto const ta = r.acquire(&a);
    r.stall = [&] { launch(a, 3, {1}); };  // as cudaDeviceSynchronize: the queued launch runs
    auto const tb = r.acquire(&b);
    REQUIRE(tb.valid());
    CHECK(tb.index == ta.index);
    CHECK(r.poll(ta) == verdict_state::bad);  // its own answer, kept across the reuse
    CHECK(r.poll(tb) == verdict_state::pending);
    CHECK(r.wait(tb, 2ms) == verdict_state::pending);  // wait gives up after its timeout
  }

  TEST_CASE("verdict ring: a released slot is reused once its launch has run") {
    ring_memory m(1);
    verdict_ring r = m.make();
    device_verdict b, c;
    auto const tb = r.acquire(&b);
    r.release(tb);  // not run yet (or a launch that threw and may be queued): reused after it reports
    std::thread gpu([&] {
      std::this_thread::sleep_for(10ms);
      launch(b, 2, {0});
    });
    auto const tc = r.acquire(&c);
    gpu.join();
    CHECK(r.waits() == 1);
    CHECK(r.poll(tc) == verdict_state::pending);
    CHECK(r.poll(verdict_ring::ticket{}) == verdict_state::clean);  // no ticket: nothing to report
  }

  TEST_CASE("verdict ring: a claim releases its ticket unless handed over") {
    ring_memory m(1);
    verdict_ring r = m.make();
    device_verdict a, b;
    {
      verdict_claim c(&r, r.acquire(&a));
      launch(a, 1, {});
    }
    auto const tb = r.acquire(&b);  // (released by the claim, and run: no wait)
    CHECK(r.waits() == 0);
    verdict_claim moved;
    {
      verdict_claim c(&r, tb);
      moved = std::move(c);
    }
    CHECK(r.poll(tb) == verdict_state::pending);  // still held by `moved`
    verdict_ring* owner = nullptr;
    auto const t = moved.take(&owner);
    CHECK(owner == &r);
    CHECK(t.seq == tb.seq);
    CHECK(moved.ring() == nullptr);
    launch(b, 1, {0});
    CHECK(r.poll(tb) == verdict_state::bad);
    r.release(tb);
  }

  TEST_CASE("verdict ring: bad arguments are named") {
    std::uint32_t w[2] = {}, c[1] = {};
    CHECK_THROWS_WITH_AS(verdict_ring(nullptr, w, c, 1), doctest::Contains("words and counters"), gact::invalid_argument);
    CHECK_THROWS_WITH_AS(verdict_ring(w, w, c, 0), doctest::Contains("at least one slot"), gact::invalid_argument);
    verdict_ring r(w, w, c, 1);
    CHECK_THROWS_WITH_AS((void)r.acquire(nullptr), doctest::Contains("out is null"), gact::invalid_argument);
    CHECK_THROWS_WITH_AS((void)r.poll(verdict_ring::ticket{5, 1}), doctest::Contains("out of range"),
                         gact::invalid_argument);
  }

  TEST_CASE("verdict ring: threads acquiring and polling while the device reports") {
    ring_memory m(16);
    verdict_ring r = m.make();
    std::atomic<int> bad_seen{0}, clean_seen{0};
    auto worker = [&](int id) {
      for (int i = 0; i < 200; ++i) {
        device_verdict dv;
        auto const t = r.acquire(&dv);
        bool const bad = (i + id) % 7 == 0;
        launch(dv, 3, bad ? std::vector<unsigned>{2} : std::vector<unsigned>{});
        auto const v = r.wait(t, 1s);
        (v == verdict_state::bad ? bad_seen : clean_seen).fetch_add(v == (bad ? verdict_state::bad : verdict_state::clean));
        r.release(t);
      }
    };
    std::thread a(worker, 0), b(worker, 1), c(worker, 2);
    a.join();
    b.join();
    c.join();
    CHECK(bad_seen + clean_seen == 600);
    CHECK(r.in_flight() == 0);
  }
}
