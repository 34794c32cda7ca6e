// gact/policy/solver.cpp
//
// Greedy (convex-hull steps in a priority queue, then a refill of the slack)
// and exact (Pareto-frontier dynamic program) bit allocation. See solver.hpp
// for the problem and the optimality certificate.
#include "policy/solver.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <tuple>

namespace gact::policy {

namespace {

/// One choice for one tensor.
struct option {
  int bits;
  std::uint64_t bytes;
  double var;  // C · v(bits)
};

/// Check the options; @throws gact::invalid_argument.
void validate_options(solver_options const& opts) {
  opts.storage.validate();
  GACT_EXPECTS(std::isfinite(opts.target_rel_gap) && opts.target_rel_gap >= 0.0,
               "solver_options.target_rel_gap must be finite and >= 0");
  std::vector<int> seen;
  for (int b : opts.code_bits) {
    GACT_EXPECTS(is_code_bits(b), "solver_options.code_bits: " + std::to_string(b) +
                                      " is not one of 1, 2, 4, 8");
    GACT_EXPECTS(std::find(seen.begin(), seen.end(), b) == seen.end(),
                 "solver_options.code_bits: " + std::to_string(b) + " listed twice");
    seen.push_back(b);
  }
  GACT_EXPECTS(!opts.code_bits.empty() || opts.allow_full_precision,
               "solver_options: no code widths and full precision not allowed: nothing to choose");
}

/// Check the items; returns each item's rank in key order (the tie-breaker).
std::vector<std::size_t> validate_items(std::vector<solver_item> const& items) {
  for (auto const& it : items) {
    GACT_EXPECTS(it.numel > 0, "solver item '" + it.key + "': numel must be > 0");
    GACT_EXPECTS(is_code_bits(it.min_bits), "solver item '" + it.key + "': min_bits must be 1, 2, 4 or 8, got " +
                                                std::to_string(it.min_bits));
    if (it.variance) {
      for (double v : *it.variance) {
        GACT_EXPECTS(std::isfinite(v) && v >= 0.0, "solver item '" + it.key +
                                                       "': variance at each width must be finite and >= 0, got " +
                                                       std::to_string(v));
      }
    }
    GACT_EXPECTS(std::isfinite(it.sensitivity) && it.sensitivity >= 0.0,
                 "solver item '" + it.key + "': sensitivity must be finite and >= 0, got " +
                     std::to_string(it.sensitivity));
    GACT_EXPECTS(is_full_bits(it.full_bits), "solver item '" + it.key +
                                                 "': full_bits must be 16 or 32, got " +
                                                 std::to_string(it.full_bits));
  }
  std::vector<std::size_t> order(items.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return items[a].key < items[b].key; });
  for (std::size_t i = 1; i < order.size(); ++i) {
    GACT_EXPECTS(items[order[i - 1]].key != items[order[i]].key,
                 "solver items: duplicate key '" + items[order[i]].key + "'");
  }
  std::vector<std::size_t> rank(items.size());
  for (std::size_t r = 0; r < order.size(); ++r) rank[order[r]] = r;
  return rank;
}

/// The Pareto-optimal options of one item: bytes strictly ascending, var strictly descending.
std::vector<option> pareto_options(solver_item const& it, solver_options const& opts) {
  std::vector<option> all;
  for (int b : opts.code_bits) {
    if (b < it.min_bits) continue;
    all.push_back({b, opts.storage.compressed_bytes(it.numel, b, it.full_bits), item_variance(it, b)});
  }
  if (all.empty() && !opts.allow_full_precision) {
    // every allowed width is below the tensor's narrowest: the widest allowed one is what the store
    // is asked for (and raises); it is the item's only option
    int const b = *std::max_element(opts.code_bits.begin(), opts.code_bits.end());
    all.push_back({b, opts.storage.compressed_bytes(it.numel, it.min_bits, it.full_bits), item_variance(it, it.min_bits)});
  }
  if (opts.allow_full_precision) {
    all.push_back({it.full_bits, opts.storage.full_bytes(it.numel, it.full_bits), 0.0});
  }
  std::sort(all.begin(), all.end(), [](option const& a, option const& b) {
    return std::tie(a.bytes, a.var, b.bits) < std::tie(b.bytes, b.var, a.bits);
  });
  std::vector<option> front;
  for (auto const& o : all) {
    if (front.empty() || o.var < front.back().var) front.push_back(o);
  }
  return front;
}

/// Vertices of the lower convex hull of a Pareto front (same order).
std::vector<std::size_t> hull_of(std::vector<option> const& f) {
  std::vector<std::size_t> h;
  for (std::size_t i = 0; i < f.size(); ++i) {
    while (h.size() >= 2) {
      option const& a = f[h[h.size() - 2]];
      option const& b = f[h.back()];
      option const& c = f[i];
      // b is a strict vertex iff slope(a,b) < slope(b,c) (both negative).
      double const lhs = (b.var - a.var) * static_cast<double>(c.bytes - b.bytes);
      double const rhs = (c.var - b.var) * static_cast<double>(b.bytes - a.bytes);
      if (lhs < rhs) break;
      h.pop_back();
    }
    h.push_back(i);
  }
  return h;
}

std::uint64_t checked_add(std::uint64_t a, std::uint64_t b) {
  GACT_EXPECTS(a <= UINT64_MAX - b, "solver: total stored bytes overflow 64 bits");
  return a + b;
}

/// The all-smallest assignment, returned when the budget cannot be met.
solution infeasible_solution(std::vector<std::vector<option>> const& fronts, std::uint64_t budget) {
  solution s;
  s.status = solve_status::infeasible;
  s.budget_bytes = budget;
  for (auto const& f : fronts) {
    s.bits.push_back(f.front().bits);
    s.stored_bytes = checked_add(s.stored_bytes, f.front().bytes);
    s.objective += f.front().var;
  }
  s.lower_bound = s.objective;
  return s;
}

/// The greedy's working data for one instance.
struct greedy_problem {
  std::vector<solver_item> const& items;
  std::vector<std::size_t> const& rank;
  std::vector<std::vector<option>> fronts;        // Pareto options per item
  std::vector<std::vector<std::size_t>> hulls;    // hull vertices (indices into fronts)
  std::uint64_t budget_bytes;
};

/// A candidate assignment: option index (into the Pareto front) per item.
struct greedy_state {
  std::vector<std::size_t> cur;
  std::uint64_t total = 0;
  double lower_bound = 0.0;
  std::uint64_t steps = 0;
  std::uint64_t refills = 0;
  std::uint64_t exchanges = 0;

  double objective(greedy_problem const& P) const {
    double o = 0.0;
    for (std::size_t i = 0; i < cur.size(); ++i) o += P.fronts[i][cur[i]].var;
    return o;
  }
};

constexpr std::size_t k_no_pin = SIZE_MAX;

/// Hull steps from the most precise options until the budget holds. Item `pin` (if any) is
/// held at front option `pin_opt`. Returns false if the budget cannot be met that way.
bool greedy_core(greedy_problem const& P, greedy_state& st, std::size_t pin = k_no_pin, std::size_t pin_opt = 0) {
  auto const& fronts = P.fronts;
  auto const& hulls = P.hulls;
  std::size_t const n = fronts.size();
  std::uint64_t const budget_bytes = P.budget_bytes;
  std::vector<std::size_t> pos(n);  // index into hulls[i]
  std::uint64_t total = 0, min_total = 0;
  double obj = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i == pin) {
      total += fronts[i][pin_opt].bytes;
      min_total += fronts[i][pin_opt].bytes;
      obj += fronts[i][pin_opt].var;
      continue;
    }
    pos[i] = hulls[i].size() - 1;
    option const& o = fronts[i][hulls[i][pos[i]]];
    total = checked_add(total, o.bytes);
    min_total += fronts[i].front().bytes;
    obj += o.var;
  }
  if (min_total > budget_bytes) return false;
  st.lower_bound = obj;  // if nothing has to move, every tensor is at its minimum variance

  // Down-steps along the hulls, least variance increase per byte saved first; ties by key.
  using entry = std::tuple<double, std::size_t, std::size_t>;  // slope, key rank, item
  std::priority_queue<entry, std::vector<entry>, std::greater<>> heap;
  auto push_step = [&](std::size_t i) {
    if (i == pin || pos[i] == 0) return;
    option const& cur = fronts[i][hulls[i][pos[i]]];
    option const& nxt = fronts[i][hulls[i][pos[i] - 1]];
    double const slope = (nxt.var - cur.var) / static_cast<double>(cur.bytes - nxt.bytes);
    heap.emplace(slope, P.rank[i], i);
  };
  for (std::size_t i = 0; i < n; ++i) push_step(i);

  while (total > budget_bytes) {
    // min_total <= budget guarantees a step remains while total > budget.
    GACT_ASSERT_INTERNAL(!heap.empty());
    auto const [slope, r, i] = heap.top();
    (void)r;
    heap.pop();
    option const& cur = fronts[i][hulls[i][pos[i]]];
    option const& nxt = fronts[i][hulls[i][pos[i] - 1]];
    double const obj_before = obj;
    std::uint64_t const total_before = total;
    total -= cur.bytes - nxt.bytes;
    obj += nxt.var - cur.var;
    --pos[i];
    ++st.steps;
    push_step(i);
    if (total <= budget_bytes) {
      // Lagrangian certificate at λ = slope: any feasible x has
      // obj(x) >= obj_before + λ·(total_before − budget). (Valid only without a pin.)
      st.lower_bound = obj_before + slope * static_cast<double>(total_before - budget_bytes);
    }
  }
  st.cur.assign(n, 0);
  for (std::size_t i = 0; i < n; ++i) st.cur[i] = (i == pin) ? pin_opt : hulls[i][pos[i]];
  st.total = total;
  return true;
}

/// Local improvement. The last greedy step can free far more bytes than needed (a big
/// tensor's step), and the greedy never revisits earlier steps. Two moves repair this:
///  refill:   the upgrade (any Pareto option, hull vertex or not) with the largest variance
///            reduction that fits in the slack; ties by fewer bytes, then key;
///  exchange: an upgrade of one tensor paid for by a downgrade of another, the pair with the
///            largest net reduction, when no refill fits (skipped if `exchanges` is false).
/// Each applied move lowers the objective by more than a relative 1e-12, so this terminates;
/// the count is capped as well. The budget holds after every move.
void local_search(greedy_problem const& P, greedy_state& st, bool exchanges) {
  auto const& fronts = P.fronts;
  auto const& rank = P.rank;
  std::size_t const n = fronts.size();
  std::uint64_t const budget_bytes = P.budget_bytes;
  std::vector<std::size_t>& cur = st.cur;
  std::uint64_t& total = st.total;
  auto refill_once = [&]() -> bool {
    std::uint64_t const slack = budget_bytes - total;
    bool found = false;
    std::size_t best_i = 0, best_k = 0;
    double best_gain = 0.0;
    std::uint64_t best_extra = 0;
    for (std::size_t i = 0; i < n; ++i) {
      option const& c = fronts[i][cur[i]];
      for (std::size_t k = cur[i] + 1; k < fronts[i].size(); ++k) {
        std::uint64_t const extra = fronts[i][k].bytes - c.bytes;
        if (extra > slack) break;  // bytes ascend along the front
        double const gain = c.var - fronts[i][k].var;
        bool const better = !found || gain > best_gain ||
                            (gain == best_gain && (extra < best_extra ||
                                                   (extra == best_extra && rank[i] < rank[best_i])));
        if (better) {
          found = true;
          best_i = i;
          best_k = k;
          best_gain = gain;
          best_extra = extra;
        }
      }
    }
    if (!found) return false;
    total += best_extra;
    cur[best_i] = best_k;
    return true;
  };

  struct down_move {
    std::uint64_t freed;
    double loss;
    std::size_t item;
    std::size_t option;
  };
  auto exchange_once = [&](double min_gain) -> bool {
    std::uint64_t const slack = budget_bytes - total;
    std::vector<down_move> downs;
    for (std::size_t j = 0; j < n; ++j) {
      for (std::size_t k = 0; k < cur[j]; ++k) {
        downs.push_back({fronts[j][cur[j]].bytes - fronts[j][k].bytes, fronts[j][k].var - fronts[j][cur[j]].var, j, k});
      }
    }
    if (downs.empty()) return false;
    std::sort(downs.begin(), downs.end(), [&](down_move const& a, down_move const& b) {
      return std::tie(a.freed, a.loss, rank[a.item], a.option) < std::tie(b.freed, b.loss, rank[b.item], b.option);
    });
    // Suffix minima of loss: the best move freeing at least downs[p].freed, and the best
    // among those of a different item (so that an upgrade can exclude its own item).
    auto const less = [&](down_move const& a, down_move const& b) {
      return std::tie(a.loss, rank[a.item], a.freed) < std::tie(b.loss, rank[b.item], b.freed);
    };
    std::size_t const m = downs.size();
    constexpr std::size_t none = SIZE_MAX;
    std::vector<std::size_t> best1(m + 1, none), best2(m + 1, none);
    for (std::size_t p = m; p-- > 0;) {
      std::size_t b1 = best1[p + 1], b2 = best2[p + 1];
      if (b1 == none || less(downs[p], downs[b1])) {
        if (b1 != none && downs[b1].item != downs[p].item) b2 = b1;
        else if (b1 != none && b2 != none && downs[b2].item == downs[p].item) b2 = none;
        b1 = p;
      } else if (downs[p].item != downs[b1].item && (b2 == none || less(downs[p], downs[b2]))) {
        b2 = p;
      }
      best1[p] = b1;
      best2[p] = b2;
    }
    bool found = false;
    double best_net = min_gain;
    std::size_t up_i = 0, up_k = 0, dn = 0;
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t k = cur[i] + 1; k < fronts[i].size(); ++k) {
        std::uint64_t const extra = fronts[i][k].bytes - fronts[i][cur[i]].bytes;
        if (extra <= slack) continue;  // a plain refill; handled by refill_once
        std::uint64_t const need = extra - slack;
        auto const it = std::lower_bound(downs.begin(), downs.end(), need,
                                         [](down_move const& d, std::uint64_t v) { return d.freed < v; });
        std::size_t const p = static_cast<std::size_t>(it - downs.begin());
        std::size_t q = best1[p];
        if (q != none && downs[q].item == i) q = best2[p];
        if (q == none) continue;
        double const net = (fronts[i][cur[i]].var - fronts[i][k].var) - downs[q].loss;
        if (net > best_net) {
          found = true;
          best_net = net;
          up_i = i;
          up_k = k;
          dn = q;
        }
      }
    }
    if (!found) return false;
    total = total + (fronts[up_i][up_k].bytes - fronts[up_i][cur[up_i]].bytes) - downs[dn].freed;
    GACT_ASSERT_INTERNAL(total <= budget_bytes);
    cur[up_i] = up_k;
    cur[downs[dn].item] = downs[dn].option;
    return true;
  };

  std::uint64_t const max_moves = 16 + 8 * static_cast<std::uint64_t>(n) * 5;
  for (std::uint64_t moves = 0; moves < max_moves; ++moves) {
    if (refill_once()) {
      ++st.refills;
      continue;
    }
    if (!exchanges || !exchange_once(1e-12 * st.objective(P))) break;
    ++st.exchanges;
  }
}

}  // namespace

double item_variance(solver_item const& it, int bits) {
  if (is_full_bits(bits)) return 0.0;
  if (is_code_bits(bits)) bits = std::max(bits, it.min_bits);  // the store raises a narrower width
  if (it.variance) {
    GACT_EXPECTS(is_code_bits(bits), "item_variance: bits must be 1, 2, 4, 8, 16 or 32, got " + std::to_string(bits));
    return (*it.variance)[width_index(bits)];
  }
  return it.sensitivity * variance_factor(bits);
}

double variance_factor(int bits) {
  if (is_full_bits(bits)) return 0.0;
  GACT_EXPECTS(is_code_bits(bits), "variance_factor: bits must be 1, 2, 4, 8, 16 or 32, got " +
                                       std::to_string(bits));
  double const levels = static_cast<double>((1u << bits) - 1u);
  return 1.0 / (levels * levels);
}

std::uint64_t budget_bytes_for(double avg_bits, std::uint64_t total_numel) {
  GACT_EXPECTS(std::isfinite(avg_bits) && avg_bits > 0.0,
               "budget: average bits per element must be finite and > 0, got " + std::to_string(avg_bits));
  long double const bytes = static_cast<long double>(avg_bits) * static_cast<long double>(total_numel) / 8.0L;
  GACT_EXPECTS(bytes < 1.8e19L, "budget: byte budget overflows 64 bits");
  return static_cast<std::uint64_t>(std::floor(bytes));
}

solution solve_greedy(std::vector<solver_item> const& items, std::uint64_t budget_bytes,
                      solver_options const& opts) {
  validate_options(opts);
  std::vector<std::size_t> const rank = validate_items(items);
  std::size_t const n = items.size();

  greedy_problem P{items, rank, std::vector<std::vector<option>>(n), std::vector<std::vector<std::size_t>>(n),
                   budget_bytes};
  std::uint64_t min_total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    P.fronts[i] = pareto_options(items[i], opts);
    P.hulls[i] = hull_of(P.fronts[i]);
    min_total = checked_add(min_total, P.fronts[i].front().bytes);
  }
  if (min_total > budget_bytes) return infeasible_solution(P.fronts, budget_bytes);
  auto const& fronts = P.fronts;

  greedy_state best;
  bool const ok = greedy_core(P, best);
  GACT_ASSERT_INTERNAL(ok);
  double const lower_bound = best.lower_bound;
  std::uint64_t const greedy_steps = best.steps;
  if (opts.improve) local_search(P, best, true);
  double best_obj = best.objective(P);

  // Pinned re-solves: the greedy commits to cheap steps early and a single exchange cannot
  // undo several of them. For instances up to `pinned_trials_limit` options in all, try each
  // item at each of its other options, re-run the greedy and local search for the rest, and
  // keep the best; stop once the certificate shows a relative gap within target_rel_gap.
  // Deterministic: trials in item order, strict improvement only.
  std::size_t options_total = 0;
  for (auto const& f : fronts) options_total += f.size();
  std::uint64_t pinned_improvements = 0;
  auto const certified = [&] { return best_obj - lower_bound <= opts.target_rel_gap * best_obj; };
  if (opts.improve && options_total <= opts.pinned_trials_limit && !certified()) {
    greedy_state const base = best;
    for (std::size_t i = 0; i < n && !certified(); ++i) {
      for (std::size_t k = 0; k < fronts[i].size(); ++k) {
        if (k == base.cur[i]) continue;
        greedy_state trial;
        if (!greedy_core(P, trial, i, k)) continue;
        local_search(P, trial, true);
        double const o = trial.objective(P);
        if (o < best_obj - 1e-12 * best_obj) {
          best = std::move(trial);
          best_obj = o;
          ++pinned_improvements;
        }
      }
    }
    if (pinned_improvements > 0) local_search(P, best, true);
  }

  solution s;
  s.budget_bytes = budget_bytes;
  s.greedy_steps = greedy_steps;
  s.refill_steps = best.refills;
  s.exchange_steps = best.exchanges;
  s.pinned_improvements = pinned_improvements;
  std::vector<std::size_t>& cur = best.cur;
  std::uint64_t const total = best.total;

  // Rearrangement: items with the same (numel, full_bits) have identical option sets, so
  // handing their chosen options out in order of C (least C gets the least precise)
  // keeps the bytes and cannot raise the objective (the rearrangement inequality). It makes
  // bits monotone in C among equal-sized tensors, which the local moves may break.
  {
    std::vector<std::size_t> idx(n);
    std::iota(idx.begin(), idx.end(), std::size_t{0});
    auto const by_class_then_c = [&](std::size_t a, std::size_t b) {
      return std::tie(items[a].numel, items[a].full_bits, items[a].min_bits, items[a].sensitivity, rank[a]) <
             std::tie(items[b].numel, items[b].full_bits, items[b].min_bits, items[b].sensitivity, rank[b]);
    };
    std::sort(idx.begin(), idx.end(), by_class_then_c);
    for (std::size_t lo = 0; lo < n;) {
      std::size_t hi = lo + 1;
      while (hi < n && items[idx[hi]].numel == items[idx[lo]].numel &&
             items[idx[hi]].full_bits == items[idx[lo]].full_bits &&
             items[idx[hi]].min_bits == items[idx[lo]].min_bits) {
        ++hi;
      }
      // Options are identical across the class up to the factor C only when every member has C > 0
      // or every member has C == 0 (a zero-C front collapses to one point), and none has variances
      // of its own width by width (their fronts differ in shape); restrict to the others.
      std::vector<std::size_t> members;
      for (std::size_t j = lo; j < hi; ++j) {
        if (items[idx[j]].sensitivity > 0.0 && !items[idx[j]].variance) members.push_back(idx[j]);
      }
      std::vector<std::uint64_t> chosen;  // bytes of the chosen options, ascending
      for (std::size_t m : members) chosen.push_back(fronts[m][cur[m]].bytes);
      std::sort(chosen.begin(), chosen.end());
      for (std::size_t j = 0; j < members.size(); ++j) {
        std::size_t const m = members[j];
        auto const& f = fronts[m];
        auto const it = std::find_if(f.begin(), f.end(), [&](option const& o) { return o.bytes == chosen[j]; });
        GACT_ASSERT_INTERNAL(it != f.end());
        cur[m] = static_cast<std::size_t>(it - f.begin());
      }
      lo = hi;
    }
  }

  s.status = solve_status::ok;
  s.stored_bytes = total;
  s.bits.resize(n);
  for (std::size_t i = 0; i < n; ++i) s.bits[i] = fronts[i][cur[i]].bits;
  s.objective = best.objective(P);
  s.lower_bound = std::min(lower_bound, s.objective);
  GACT_ASSERT_INTERNAL(s.stored_bytes <= s.budget_bytes);
  return s;
}

solution solve_exact(std::vector<solver_item> const& items, std::uint64_t budget_bytes,
                     solver_options const& opts, std::size_t max_frontier) {
  validate_options(opts);
  (void)validate_items(items);
  std::size_t const n = items.size();
  std::vector<std::vector<option>> fronts(n);
  std::uint64_t min_total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    fronts[i] = pareto_options(items[i], opts);
    min_total = checked_add(min_total, fronts[i].front().bytes);
  }
  if (min_total > budget_bytes) return infeasible_solution(fronts, budget_bytes);

  struct state {
    std::uint64_t bytes;
    double var;
    std::uint32_t parent;  // index in the previous stage
    std::uint32_t choice;  // index into fronts[stage]
  };
  std::vector<std::vector<state>> stages(n + 1);
  stages[0].push_back({0, 0.0, 0, 0});
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<state> cand;
    for (std::size_t p = 0; p < stages[i].size(); ++p) {
      for (std::size_t k = 0; k < fronts[i].size(); ++k) {
        std::uint64_t const b = stages[i][p].bytes + fronts[i][k].bytes;
        if (b > budget_bytes) break;
        cand.push_back({b, stages[i][p].var + fronts[i][k].var, static_cast<std::uint32_t>(p),
                        static_cast<std::uint32_t>(k)});
      }
    }
    std::sort(cand.begin(), cand.end(), [](state const& a, state const& b) {
      return std::tie(a.bytes, a.var, a.parent, a.choice) < std::tie(b.bytes, b.var, b.parent, b.choice);
    });
    for (auto const& c : cand) {
      if (stages[i + 1].empty() || c.var < stages[i + 1].back().var) stages[i + 1].push_back(c);
    }
    GACT_EXPECTS(stages[i + 1].size() <= max_frontier,
                 "solve_exact: Pareto frontier exceeds " + std::to_string(max_frontier) +
                     " states; the instance is too large for the exact solver");
  }
  // min_total <= budget, so the last stage is non-empty; its last state has the least variance.
  GACT_ASSERT_INTERNAL(!stages[n].empty());
  solution s;
  s.status = solve_status::ok;
  s.budget_bytes = budget_bytes;
  s.bits.resize(n);
  std::size_t idx = stages[n].size() - 1;
  s.stored_bytes = stages[n][idx].bytes;
  for (std::size_t i = n; i-- > 0;) {
    state const& st = stages[i + 1][idx];
    s.bits[i] = fronts[i][st.choice].bits;
    idx = st.parent;
  }
  s.objective = objective_of(items, s.bits);
  s.lower_bound = s.objective;
  return s;
}

double objective_of(std::vector<solver_item> const& items, std::vector<int> const& bits) {
  GACT_EXPECTS(items.size() == bits.size(), "objective_of: items and bits differ in length");
  double obj = 0.0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    GACT_EXPECTS(is_code_bits(bits[i]) || bits[i] == items[i].full_bits,
                 "objective_of: item '" + items[i].key + "' has invalid bits " + std::to_string(bits[i]));
    obj += item_variance(items[i], bits[i]);
  }
  return obj;
}

std::uint64_t stored_bytes_of(std::vector<solver_item> const& items, std::vector<int> const& bits,
                              storage_model const& storage) {
  GACT_EXPECTS(items.size() == bits.size(), "stored_bytes_of: items and bits differ in length");
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    // a code width below the item's narrowest is stored at the narrowest
    int const b = is_code_bits(bits[i]) ? std::max(bits[i], items[i].min_bits) : bits[i];
    total = checked_add(total, storage.stored_bytes(items[i].numel, b, items[i].full_bits));
  }
  return total;
}

}  // namespace gact::policy
