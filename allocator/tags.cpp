// gact/allocator/tags.cpp — tag interning and the per-thread tag stack (see tags.hpp).
//
// Interning is rare (once per tag name) and takes a mutex; the per-thread stack is
// a fixed array in trivially constructed thread-local storage, so current_tag()
// on the allocation path is a plain thread-local read with no initialization guard.
#include "allocator/tags.hpp"

#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

#include "allocator/error.hpp"
#include "allocator/log.hpp"

namespace gact::alloc {
namespace {

constexpr std::size_t k_max_tag_name = 64;

/// The interned names. Invariant: names[id] is the name of id; index[names[id]] == id;
/// names[0..k_first_user_tag) are the built-ins in enum order.
struct tag_registry {
  std::mutex mu;
  std::vector<std::string> names{"other", "activation", "weight", "gradient", "optimizer", "workspace"};
  std::unordered_map<std::string, tag_id> index;

  tag_registry() {
    for (std::size_t i = 0; i < names.size(); ++i) index.emplace(names[i], static_cast<tag_id>(i));
  }
};

tag_registry& registry() {
  static tag_registry* const r = new tag_registry();  // leaked: used by static destructors that log stats
  return *r;
}

/// One thread's stack. Invariant: stored entries are stack[0 .. min(depth, k_max_tag_depth)).
struct tag_stack {
  std::array<tag_id, k_max_tag_depth> stack;
  std::uint32_t depth;
};
thread_local tag_stack t_stack{};

std::atomic<std::uint64_t> g_underflows{0};
std::atomic<std::uint64_t> g_overflows{0};

}  // namespace

tag_id intern_tag(std::string_view name) {
  GACT_EXPECTS(!name.empty(), "intern_tag: a tag name must not be empty");
  GACT_EXPECTS(name.size() <= k_max_tag_name,
               "intern_tag: tag name '" + std::string(name.substr(0, 32)) + "...' is longer than " +
                   std::to_string(k_max_tag_name) + " bytes");
  tag_registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::string key(name);
  if (auto it = r.index.find(key); it != r.index.end()) return it->second;
  GACT_EXPECTS(r.names.size() < k_max_tags,
               "intern_tag: cannot add tag '" + key + "': the limit of " + std::to_string(k_max_tags) +
                   " tags is reached");
  auto const id = static_cast<tag_id>(r.names.size());
  r.names.push_back(key);
  r.index.emplace(std::move(key), id);
  return id;
}

std::string tag_name(tag_id id) {
  tag_registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return id < r.names.size() ? r.names[id] : r.names[tag_other];
}

std::vector<std::string> tag_names() {
  tag_registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.names;
}

void push_tag(tag_id id) noexcept {
  tag_stack& s = t_stack;
  if (s.depth < k_max_tag_depth) {
    s.stack[s.depth] = id;
  } else {
    g_overflows.fetch_add(1, std::memory_order_relaxed);
    GACT_WARN_CAPPED(8, "push_tag: tag stack deeper than {}; tag {} not recorded", k_max_tag_depth, id);
  }
  ++s.depth;
}

void pop_tag() noexcept {
  tag_stack& s = t_stack;
  if (s.depth == 0) {
    g_underflows.fetch_add(1, std::memory_order_relaxed);
    GACT_WARN_CAPPED(8, "pop_tag: the tag stack of this thread is empty (unbalanced push/pop)");
    return;
  }
  --s.depth;
}

tag_id current_tag() noexcept {
  tag_stack const& s = t_stack;
  if (s.depth == 0) return tag_other;
  std::uint32_t const top = s.depth < k_max_tag_depth ? s.depth : std::uint32_t{k_max_tag_depth};
  return s.stack[top - 1];
}

std::size_t tag_depth() noexcept { return t_stack.depth; }

std::uint64_t tag_underflows() noexcept { return g_underflows.load(std::memory_order_relaxed); }

std::uint64_t tag_overflows() noexcept { return g_overflows.load(std::memory_order_relaxed); }

}  // namespace gact::alloc
