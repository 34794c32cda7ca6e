// gact/policy/controller.cpp
//
// The thread-safe policy object: records, estimates, the solve over active
// tensors with reserved bytes for unestimated ones, and the stats section.
#include "policy/controller.hpp"

#include "allocator/log.hpp"

#if GACT_HAVE_STATS_REGISTRY
#include "allocator/stats_registry.hpp"
#endif

#include <algorithm>
#include <cmath>

namespace gact::policy {

namespace {

table_options table_opts(controller_options const& o) {
  table_options t;
  t.default_bits = o.default_bits;
  t.ema_weight = o.ema_weight;
  t.stale_after = o.stale_after;
  t.storage = o.storage;
  return t;
}

}  // namespace

char const* to_string(solve_status s) noexcept {
  return s == solve_status::ok ? "ok" : "infeasible";
}

void controller_options::validate() const {
  GACT_EXPECTS(std::isfinite(budget_avg_bits) && budget_avg_bits > 0.0,
               "policy budget_avg_bits must be finite and > 0, got " + std::to_string(budget_avg_bits));
  table_opts(*this).validate();
  solver_options so{storage, allow_full_precision, code_bits};
  (void)solve_greedy({}, 0, so);  // validates the solver options
}

controller::controller(controller_options opts) : opts_(std::move(opts)), table_(table_opts(opts_)) {
  opts_.validate();
}

controller::~controller() {
#if GACT_HAVE_STATS_REGISTRY
  if (registered_) stats::unregister_provider(stats_token_);
#endif
}

void controller::set_step(std::int64_t step) {
  std::lock_guard lk(mu_);
  step_ = step;
}

std::int64_t controller::step() const {
  std::lock_guard lk(mu_);
  return step_;
}

int controller::on_save(std::string_view key, std::uint64_t numel, int full_bits, int min_bits) {
  std::lock_guard lk(mu_);
  return table_.observe(key, numel, step_, full_bits, min_bits).bits;
}

int controller::bits_for(std::string_view key) const noexcept {
  std::lock_guard lk(mu_);
  return table_.bits_for(key);
}

void controller::add_estimate(std::string_view key, double c) {
  std::lock_guard lk(mu_);
  table_.add_estimate(key, c);
}

void controller::add_estimate_widths(std::string_view key, std::array<double, 4> const& v) {
  std::lock_guard lk(mu_);
  table_.add_estimate_widths(key, v);
}

void controller::raise_variance(std::string_view key, int bits, double v) {
  std::lock_guard lk(mu_);
  table_.raise_variance(key, bits, v);
}

void controller::add_online_sample(std::string_view key, online_sample const& s) {
  std::lock_guard lk(mu_);
  online_.add(key, s);
}

std::pair<std::size_t, std::size_t> controller::apply_online_estimates() {
  std::lock_guard lk(mu_);
  std::size_t folded = 0, skipped = 0;
  for (auto const& [k, c] : online_.take()) {
    if (table_.find(k) == nullptr) {
      ++skipped;
      continue;
    }
    table_.add_estimate(k, c);
    ++folded;
  }
  return {folded, skipped};
}

decision_summary controller::decide() {
  std::lock_guard lk(mu_);
  decision_summary d;
  d.step = step_;
  std::vector<solver_item> items;
  std::vector<record const*> active;
  int const narrowest = *std::min_element(opts_.code_bits.begin(), opts_.code_bits.end());
  double needed = 0.0;
  for (auto const& [key, r] : table_.all()) {
    if (!table_.is_active(r, step_)) continue;
    active.push_back(&r);
    d.total_numel += r.numel;
    if (r.estimates > 0) {
      solver_item it{key, r.numel, r.sensitivity, r.full_bits, r.min_bits, std::nullopt};
      if (r.per_width) it.variance = r.variance;
      items.push_back(std::move(it));
      needed += static_cast<double>(opts_.storage.compressed_bytes(r.numel, std::max(narrowest, r.min_bits), r.full_bits));
    } else {
      int const b = is_code_bits(r.bits) ? std::max(r.bits, r.min_bits) : r.bits;
      std::uint64_t const bytes = opts_.storage.stored_bytes(r.numel, b, r.full_bits);
      d.reserved_bytes += bytes;
      needed += static_cast<double>(bytes);
      ++d.unestimated;
    }
  }
  // Uniform `avg` bits stores a tensor at no fewer than its min_bits (the store raises it): the
  // budget is what uniform stores, and the smallest feasible budget the least average whose
  // uniform bytes cover what the tensors need at their narrowest (by bisection: monotone in avg).
  auto const uniform_at = [&](double avg) {
    double total = 0.0;
    for (record const* r : active) {
      double const b = r->min_bits > 1 ? std::max(avg, static_cast<double>(r->min_bits)) : avg;
      total += opts_.storage.uniform_bytes(r->numel, b, r->full_bits);
    }
    return total;
  };
  double const budget = uniform_at(opts_.budget_avg_bits);
  if (!active.empty()) {
    double lo = 0.0, hi = 8.0;
    while (uniform_at(hi) < needed && hi < 1e5) hi *= 2.0;
    for (int i = 0; i < 64; ++i) {
      double const mid = 0.5 * (lo + hi);
      (uniform_at(mid) >= needed ? hi : lo) = mid;
    }
    d.min_feasible_budget = hi < 1e-9 ? 0.0 : hi;  // the metadata alone already fits
  }
  d.solved = items.size();
  d.budget_bytes = static_cast<std::uint64_t>(std::floor(budget));
  std::uint64_t const left = d.budget_bytes >= d.reserved_bytes ? d.budget_bytes - d.reserved_bytes : 0;
  solver_options const so{opts_.storage, opts_.allow_full_precision, opts_.code_bits};
  solution const s = solve_greedy(items, left, so);
  for (std::size_t i = 0; i < items.size(); ++i) table_.set_bits(items[i].key, s.bits[i]);
  d.status = (s.status == solve_status::ok && d.reserved_bytes <= d.budget_bytes) ? solve_status::ok
                                                                                    : solve_status::infeasible;
  d.stored_bytes = s.stored_bytes + d.reserved_bytes;
  d.objective = s.objective;
  d.lower_bound = s.lower_bound;
  d.achieved_avg_bits =
      d.total_numel == 0 ? 0.0 : 8.0 * static_cast<double>(d.stored_bytes) / static_cast<double>(d.total_numel);
  if (d.status == solve_status::infeasible) {
    GACT_WARN_CAPPED(1, "gact policy: a budget of {} bits/element is infeasible at step {}: its tensors need "
                        "{} bytes at their narrowest widths, the budget is {} bytes; the smallest feasible "
                        "budget is {:.3f}. Using the narrowest widths",
                     opts_.budget_avg_bits, d.step, d.stored_bytes, d.budget_bytes, d.min_feasible_budget);
  } else {
    GACT_LOG_DEBUG("gact policy: step {}: {} tensors solved, {} reserved, {:.3f} bits/element, objective {:.4g}",
                   d.step, d.solved, d.unestimated, d.achieved_avg_bits, d.objective);
  }
  last_ = d;
  return d;
}

void controller::set_budget(double avg_bits) {
  GACT_EXPECTS(std::isfinite(avg_bits) && avg_bits > 0.0,
               "policy budget must be finite and > 0 bits per element, got " + std::to_string(avg_bits));
  std::lock_guard lk(mu_);
  opts_.budget_avg_bits = avg_bits;
}

std::optional<decision_summary> controller::last_decision() const {
  std::lock_guard lk(mu_);
  return last_;
}

std::optional<record> controller::find(std::string_view key) const {
  std::lock_guard lk(mu_);
  record const* r = table_.find(key);
  return r ? std::optional<record>(*r) : std::nullopt;
}

nlohmann::json controller::stats() const {
  std::lock_guard lk(mu_);
  nlohmann::json j;
  j["step"] = step_;
  j["budget_avg_bits"] = opts_.budget_avg_bits;
  j["default_bits"] = opts_.default_bits;
  j["group_size"] = opts_.storage.group_size;
  j["meta_bytes_per_group"] = opts_.storage.meta_bytes_per_group;
  if (last_) {
    j["last_decision"] = {
        {"step", last_->step},
        {"status", to_string(last_->status)},
        {"total_numel", last_->total_numel},
        {"budget_bytes", last_->budget_bytes},
        {"stored_bytes", last_->stored_bytes},
        {"reserved_bytes", last_->reserved_bytes},
        {"solved", last_->solved},
        {"unestimated", last_->unestimated},
        {"achieved_avg_bits", last_->achieved_avg_bits},
        {"min_feasible_budget", last_->min_feasible_budget},
        {"objective", last_->objective},
        {"lower_bound", last_->lower_bound},
    };
  } else {
    j["last_decision"] = nullptr;
  }
  nlohmann::json tensors = nlohmann::json::object();
  for (auto const& [key, r] : table_.all()) {
    tensors[key] = {
        {"numel", r.numel},
        {"groups", r.groups},
        {"C", r.estimates > 0 ? nlohmann::json(r.sensitivity) : nlohmann::json(nullptr)},
        {"variance", r.estimates > 0 && r.per_width ? nlohmann::json(r.variance) : nlohmann::json(nullptr)},
        {"min_bits", r.min_bits},
        {"estimates", r.estimates},
        {"bits", r.bits},
        {"decided", r.decided},
        {"active", table_.is_active(r, step_)},
        {"last_seen", r.last_seen},
    };
  }
  j["tensors"] = std::move(tensors);
  return j;
}

bool controller::register_stats(std::string const& name) {
#if GACT_HAVE_STATS_REGISTRY
  std::uint64_t const token = stats::register_provider(name, [this] { return stats(); });
  std::uint64_t old = 0;
  bool had = false;
  {
    std::lock_guard lk(mu_);
    old = stats_token_;
    had = registered_;
    stats_token_ = token;
    registered_ = true;
  }
  if (had && old != token) stats::unregister_provider(old);
  return true;
#else
  (void)name;
  return false;
#endif
}

}  // namespace gact::policy
