// gact/tests/policy/test_records.cpp
//
// Records and the controller: unknown keys get the default bits and never
// fail, the EMA of sensitivities, keys that vanish (stale → excluded from the
// solve) and come back, a dynamic graph with a branch taken on some steps,
// unestimated tensors reserved out of the budget, and the stats section.
#include "policy/controller.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <limits>

namespace {
constexpr double k_nan = std::numeric_limits<double>::quiet_NaN();  // (NAN is a float)
constexpr double k_inf = std::numeric_limits<double>::infinity();
}  // namespace

using namespace gact::policy;

TEST_CASE("unknown keys get the default bits and never fail") {
  record_table t;
  CHECK(t.bits_for("never.seen#0") == 4);
  CHECK(t.bits_for("") == 4);
  CHECK(t.find("never.seen#0") == nullptr);
  table_options o;
  o.default_bits = 8;
  record_table t8(o);
  CHECK(t8.bits_for("x") == 8);
  t8.observe("x", 100, 0);
  CHECK(t8.bits_for("x") == 8);
  controller c;
  CHECK(c.bits_for("anything") == 4);
  CHECK(c.on_save("new.key#3", 4096) == 4);
}

TEST_CASE("default full precision follows the tensor's dtype") {
  table_options o;
  o.default_bits = 32;
  record_table t(o);
  CHECK(t.observe("half", 100, 0, 16).bits == 16);
  CHECK(t.observe("float", 100, 0, 32).bits == 32);
}

TEST_CASE("sensitivity EMA: first estimate as is, then weighted") {
  table_options o;
  o.ema_weight = 0.25;
  record_table t(o);
  t.observe("a", 1000, 0);
  t.add_estimate("a", 8.0);
  CHECK(t.find("a")->sensitivity == 8.0);
  t.add_estimate("a", 4.0);
  CHECK(t.find("a")->sensitivity == doctest::Approx(0.75 * 8.0 + 0.25 * 4.0));
  t.add_estimate("a", 0.0);
  CHECK(t.find("a")->sensitivity == doctest::Approx(0.75 * 7.0));
  CHECK(t.find("a")->estimates == 3);
  CHECK_THROWS_AS(t.add_estimate("unknown", 1.0), gact::invalid_argument);
  CHECK_THROWS_AS(t.add_estimate("a", -1.0), gact::invalid_argument);
  CHECK_THROWS_AS(t.add_estimate("a", k_nan), gact::invalid_argument);
  CHECK_THROWS_AS(t.observe("", 10, 0), gact::invalid_argument);
  CHECK_THROWS_AS(t.observe("z", 0, 0), gact::invalid_argument);
  CHECK_THROWS_AS(t.observe("z", 10, 0, 8), gact::invalid_argument);
  table_options bad;
  bad.ema_weight = 0.0;
  CHECK_THROWS_AS(record_table{bad}, gact::invalid_argument);
  bad.ema_weight = 0.5;
  bad.default_bits = 3;
  CHECK_THROWS_AS(record_table{bad}, gact::invalid_argument);
}

TEST_CASE("estimates width by width: EMA per width, continuing from a scalar estimate") {
  table_options o;
  o.ema_weight = 0.5;
  record_table t(o);
  t.observe("a", 1000, 0);
  t.add_estimate_widths("a", {8.0, 2.0, 0.5, 0.0});
  CHECK(t.find("a")->per_width);
  CHECK(t.find("a")->sensitivity == 8.0);
  t.add_estimate_widths("a", {4.0, 4.0, 0.5, 1.0});
  CHECK(t.find("a")->variance == std::array<double, 4>{6.0, 3.0, 0.5, 0.5});
  CHECK(t.find("a")->sensitivity == 6.0);
  t.observe("b", 1000, 0);
  t.add_estimate("b", 9.0);  // a scalar C: the widths follow C·v(b)
  CHECK_FALSE(t.find("b")->per_width);
  CHECK(t.find("b")->variance[1] == doctest::Approx(1.0));
  t.add_estimate_widths("b", {9.0, 3.0, 0.0, 0.0});
  CHECK(t.find("b")->variance[1] == doctest::Approx(2.0));
  CHECK(t.find("b")->estimates == 2);
  CHECK_THROWS_AS(t.add_estimate_widths("unknown", {1.0, 1.0, 1.0, 1.0}), gact::invalid_argument);
  CHECK_THROWS_AS(t.add_estimate_widths("a", {1.0, -1.0, 1.0, 1.0}), gact::invalid_argument);
  CHECK_THROWS_AS(t.add_estimate_widths("a", {1.0, 1.0, k_inf, 1.0}), gact::invalid_argument);
  CHECK_THROWS_AS(t.observe("c", 10, 0, 32, 3), gact::invalid_argument);
  t.raise_variance("a", 1, 100.0);
  CHECK(t.find("a")->variance[0] == 100.0);
  CHECK(t.find("a")->sensitivity == 100.0);
  t.raise_variance("a", 2, 1.0);  // below the estimate: kept
  CHECK(t.find("a")->variance[1] == 3.0);
  t.observe("d", 10, 0);
  CHECK_THROWS_AS(t.raise_variance("d", 1, 1.0), gact::invalid_argument);  // no estimate yet
  CHECK_THROWS_AS(t.raise_variance("a", 3, 1.0), gact::invalid_argument);
  CHECK_THROWS_AS(t.raise_variance("a", 1, k_nan), gact::invalid_argument);
}

TEST_CASE("narrowest widths: the budget counts them as uniform stores them, the solver never goes below") {
  controller_options o;
  o.budget_avg_bits = 2.0;
  controller c(o);
  storage_model const m;
  std::uint64_t const n = 256 * 64;
  c.on_save("small_block#0", n, 32, 8);     // stored at >= 8 bits whatever it is asked
  c.on_save("boundary#0", n, 32, 2);        // a boundary blob: >= 2 bits
  c.on_save("plain#0", n, 32);
  c.on_save("other#0", n, 32);
  for (char const* k : {"small_block#0", "boundary#0", "plain#0", "other#0"}) c.add_estimate(k, 1.0);
  auto const d = c.decide();
  // uniform 2 bits stores the small block at 8: the budget is what uniform stores
  CHECK(d.budget_bytes == std::uint64_t(m.uniform_bytes(n, 8.0) + 3 * m.uniform_bytes(n, 2.0)));
  CHECK(d.status == solve_status::ok);
  CHECK(c.bits_for("small_block#0") >= 8);
  CHECK(c.bits_for("boundary#0") >= 2);
  CHECK(d.stored_bytes <= d.budget_bytes);
  // every tensor at its narrowest: 8 + 2 + 1 + 1 bits of codes; uniform b stores 8 + max(b, 2) + b + b,
  // which reaches 12 at b = 1 (and not below: the boundary blob's 2 bits)
  CHECK(d.min_feasible_budget == doctest::Approx(1.0).epsilon(1e-3));
  auto const st = c.stats();
  CHECK(st["tensors"]["boundary#0"]["min_bits"] == 2);
  CHECK(st["tensors"]["plain#0"]["min_bits"] == 1);
  c.add_estimate_widths("plain#0", {4.0, 1.0, 0.1, 0.0});
  CHECK(c.stats()["tensors"]["plain#0"]["variance"][1] == doctest::Approx(0.5 * (1.0 / 9.0) + 0.5 * 1.0));
}

TEST_CASE("numel changes update the record and keep the estimate") {
  record_table t;
  t.observe("fc#0", 1000, 0);
  t.add_estimate("fc#0", 2.0);
  auto const& r = t.observe("fc#0", 600, 1);  // last, smaller batch
  CHECK(r.numel == 600);
  CHECK(r.groups == 3);
  CHECK(r.sensitivity == 2.0);
}

TEST_CASE("vanishing keys leave the solve after stale_after steps and return later") {
  controller_options o;
  o.stale_after = 2;
  o.budget_avg_bits = 3.0;
  controller c(o);
  std::uint64_t const n = 256 * 100;
  for (std::int64_t step = 0; step < 3; ++step) {
    c.set_step(step);
    c.on_save("a#0", n);
    c.on_save("b#0", n);
    c.on_save("gone#0", n);
  }
  c.add_estimate("a#0", 1.0);
  c.add_estimate("b#0", 100.0);
  c.add_estimate("gone#0", 1e6);
  auto d = c.decide();
  CHECK(d.solved == 3);
  CHECK(d.total_numel == 3 * n);
  // "gone" is no longer saved; after stale_after steps it is excluded and the budget shrinks.
  for (std::int64_t step = 3; step < 6; ++step) {
    c.set_step(step);
    c.on_save("a#0", n);
    c.on_save("b#0", n);
  }
  d = c.decide();
  CHECK(d.solved == 2);
  CHECK(d.total_numel == 2 * n);
  CHECK(d.stored_bytes <= d.budget_bytes);
  // the budget is what uniform 3 bits would store for the two active tensors, metadata included
  gact::policy::storage_model const sm;
  CHECK(d.budget_bytes == std::uint64_t(std::floor(2 * sm.uniform_bytes(n, 3.0))));
  CHECK(c.bits_for("gone#0") >= 1);  // its old bits stay; looking it up never fails
  c.set_step(6);
  c.on_save("gone#0", n);
  d = c.decide();
  CHECK(d.solved == 3);
}

TEST_CASE("a dynamic graph (branch on some steps) keeps working") {
  controller_options o;
  o.stale_after = 3;
  controller c(o);
  std::uint64_t const n = 256 * 8;
  for (std::int64_t step = 0; step < 20; ++step) {
    c.set_step(step);
    c.on_save("stem#0", n);
    if (step % 3 == 0) {
      int const bits = c.on_save("branch.conv#0", n);
      CHECK((is_code_bits(bits) || bits == 32));
    }
    c.on_save("head#0", n);
    if (step % 5 == 4) {
      for (char const* k : {"stem#0", "head#0", "branch.conv#0"}) {
        if (c.find(k)) c.add_estimate(k, 1.0);
      }
      auto const d = c.decide();
      CHECK(d.status == solve_status::ok);
      CHECK(d.stored_bytes <= d.budget_bytes);
    }
  }
}

TEST_CASE("unestimated tensors keep default bits and their bytes are reserved") {
  controller_options o;
  o.budget_avg_bits = 3.0;
  o.default_bits = 4;
  controller c(o);
  std::uint64_t const n = 256 * 64;
  c.on_save("est#0", n);
  c.on_save("noest#0", n);
  c.add_estimate("est#0", 5.0);
  auto const d = c.decide();
  storage_model const m;
  CHECK(d.unestimated == 1);
  CHECK(d.reserved_bytes == m.compressed_bytes(n, 4));
  CHECK(c.bits_for("noest#0") == 4);
  CHECK(d.stored_bytes <= d.budget_bytes);
  // Uniform 3 bits for both, metadata included, with one tensor at 4 bits → the other gets what uniform
  // 2 bits would store for it: 2 bits.
  CHECK(d.budget_bytes == std::uint64_t(2 * m.uniform_bytes(n, 3.0)));
  CHECK(c.bits_for("est#0") == 2);
  CHECK(d.stored_bytes == m.compressed_bytes(n, 4) + m.compressed_bytes(n, 2));
  // A budget below the reservation is infeasible and says which budget would do: the reserved tensor's
  // 4 bits and the other's narrowest 1 bit average 2.5 bits of codes.
  c.set_budget(1.0);
  auto const bad = c.decide();
  CHECK(bad.status == solve_status::infeasible);
  CHECK(bad.min_feasible_budget == doctest::Approx(2.5));
  c.set_budget(2.5);
  CHECK(c.decide().status == solve_status::ok);
  CHECK_THROWS_AS(c.set_budget(0.0), gact::invalid_argument);
}

TEST_CASE("online samples are folded into the estimates") {
  controller c;
  c.on_save("fc#0", 1024);
  online_sample s;
  s.sum_sq_ranges = 4.0;
  s.numel = 1024;
  s.grad_sq_norm = 3.0;
  s.fan_in = 256;
  c.add_online_sample("fc#0", s);
  s.grad_sq_norm = 9.0;
  c.add_online_sample("fc#0", s);
  c.add_online_sample("never.saved#0", s);
  auto const [folded, skipped] = c.apply_online_estimates();
  CHECK(folded == 1);
  CHECK(skipped == 1);
  double const expect = 256.0 * 6.0 * 256.0 * 4.0 / (6.0 * 1024.0);  // mean grad² = 6
  CHECK(c.find("fc#0")->sensitivity == doctest::Approx(expect));
}

TEST_CASE("stats section carries budget, achieved bits, objective and per-key decisions") {
  controller_options o;
  o.budget_avg_bits = 2.0;
  controller c(o);
  c.set_step(7);
  c.on_save("l1#0", 256 * 32);
  c.on_save("l2#0", 256 * 32);
  c.add_estimate("l1#0", 10.0);
  c.add_estimate("l2#0", 0.1);
  auto j = c.stats();
  CHECK(j["last_decision"].is_null());
  CHECK(j["tensors"]["l1#0"]["bits"] == 4);
  auto const d = c.decide();
  j = c.stats();
  CHECK(j["step"] == 7);
  CHECK(j["budget_avg_bits"] == 2.0);
  CHECK(j["last_decision"]["status"] == "ok");
  CHECK(j["last_decision"]["stored_bytes"] == d.stored_bytes);
  // what uniform 2 bits would store, metadata (8 B per 256 fp32 elements: 0.25 bit) and headers included
  CHECK(d.stored_bytes <= d.budget_bytes);
  CHECK(d.budget_bytes == std::uint64_t(2 * storage_model{}.uniform_bytes(256 * 32, 2.0)));
  CHECK(j["last_decision"]["achieved_avg_bits"].get<double>() <= 2.0 + 0.25 + 8.0 * 2 * 96 / (2 * 256 * 32));
  CHECK(j["last_decision"]["objective"].get<double>() == doctest::Approx(d.objective));
  CHECK(j["tensors"]["l1#0"]["numel"] == 256 * 32);
  CHECK(j["tensors"]["l1#0"]["C"].get<double>() == 10.0);
  CHECK(j["tensors"]["l1#0"]["bits"].get<int>() >= j["tensors"]["l2#0"]["bits"].get<int>());
  CHECK(j["tensors"]["l1#0"]["decided"] == true);
  controller_options bad;
  bad.code_bits = {5};
  CHECK_THROWS_AS(controller{bad}, gact::invalid_argument);
}
