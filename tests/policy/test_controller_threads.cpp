// gact/tests/policy/test_controller_threads.cpp
//
// The controller under concurrency: pack-hook threads call on_save/bits_for
// while another thread feeds estimates, decides and reads the stats. Runs under
// ThreadSanitizer in the 'threads' suite; the assertions check that every
// returned width is valid and every decision fits its budget.
#include "policy/controller.hpp"

#if GACT_HAVE_STATS_REGISTRY
#include "allocator/stats_registry.hpp"
#endif

#include <doctest/doctest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

using namespace gact::policy;

TEST_CASE("concurrent saves, estimates, decisions and stats") {
  controller_options o;
  o.budget_avg_bits = 2.5;
  controller c(o);
  std::atomic<bool> stop{false};
  std::atomic<bool> go{false};  // the savers start with the driver: on a loaded machine they once
                                // finished before it ran, and it stopped with no decision at all
  std::atomic<int> bad_bits{0};
  std::vector<std::thread> savers;
  for (int t = 0; t < 3; ++t) {
    savers.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < 3000; ++i) {
        std::string const key = "t" + std::to_string(t) + ".layer" + std::to_string(i % 20) + "#0";
        int const b = c.on_save(key, 256u * static_cast<unsigned>(1 + i % 7));
        if (!(is_code_bits(b) || b == 32)) bad_bits.fetch_add(1);
        int const q = c.bits_for("t" + std::to_string((t + 1) % 3) + ".layer3#0");
        if (!(is_code_bits(q) || q == 32)) bad_bits.fetch_add(1);
      }
    });
  }
  int decisions = 0, over_budget = 0;
  std::thread driver([&] {
    go = true;
    for (int round = 0; round < 200 && (round == 0 || !stop.load()); ++round) {  // at least one decision
      c.set_step(round);
      for (int t = 0; t < 3; ++t) {
        for (int l = 0; l < 20; ++l) {
          std::string const key = "t" + std::to_string(t) + ".layer" + std::to_string(l) + "#0";
          if (c.find(key)) c.add_estimate(key, 1.0 + l);
        }
      }
      auto const d = c.decide();
      ++decisions;
      if (d.status == solve_status::ok && d.stored_bytes > d.budget_bytes) ++over_budget;
      (void)c.stats();
    }
  });
  for (auto& th : savers) th.join();
  stop = true;
  driver.join();
  CHECK(bad_bits.load() == 0);
  CHECK(decisions > 0);
  CHECK(over_budget == 0);
#if GACT_HAVE_STATS_REGISTRY
  REQUIRE(c.register_stats("policy_test"));
  auto const doc = gact::stats::document();
  REQUIRE(doc.contains("policy_test"));
  CHECK(doc["policy_test"]["budget_avg_bits"] == 2.5);
  CHECK(doc["policy_test"]["tensors"].size() == 60);
#else
  CHECK_FALSE(c.register_stats("policy_test"));
#endif
}
