// gact/allocator/tags.hpp
//
// Allocation tags: a thread-local stack of named tags that the framework sets
// (activation, weight, gradient, optimizer, workspace, other, or any name a
// user defines). Every block the caching allocator hands out records the tag
// on top of the calling thread's stack at allocation time, and the statistics
// are kept per tag.
//
// Tag names are interned into small integer ids once; the per-allocation cost
// is reading one thread-local integer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gact::alloc {

using tag_id = std::uint16_t;

/// Built-in tags; their ids are fixed. User tags get ids from k_first_user_tag on.
enum builtin_tag : tag_id {
  tag_other = 0,
  tag_activation = 1,
  tag_weight = 2,
  tag_gradient = 3,
  tag_optimizer = 4,
  tag_workspace = 5,
  k_first_user_tag = 6,
};

/// At most this many distinct tags (built-in plus user) may exist in a process.
inline constexpr tag_id k_max_tags = 256;

/// Intern `name` and return its id (the same name always gives the same id).
/// @throws gact::invalid_argument for an empty name, one longer than 64 bytes, or when k_max_tags is reached.
tag_id intern_tag(std::string_view name);
/// The name of a tag id ("other" for an unknown id).
std::string tag_name(tag_id id);
/// Names of all tags interned so far, indexed by id.
std::vector<std::string> tag_names();

/// Push a tag on the calling thread's stack.
void push_tag(tag_id id) noexcept;
/// Pop the calling thread's top tag; popping an empty stack is counted and logged, never UB.
void pop_tag() noexcept;
/// The calling thread's current tag (tag_other when the stack is empty).
tag_id current_tag() noexcept;
/// Depth of the calling thread's stack.
std::size_t tag_depth() noexcept;
/// Number of pop_tag() calls on an empty stack, over all threads, since the process started.
std::uint64_t tag_underflows() noexcept;
/// Number of push_tag() calls beyond k_max_tag_depth (the tag pushed is not recorded; the
/// previous top stays current until the matching pop).
std::uint64_t tag_overflows() noexcept;

/// The deepest per-thread stack kept; pushes beyond it are counted (tag_overflows()).
inline constexpr std::size_t k_max_tag_depth = 64;

/// RAII: push on construction, pop on destruction.
class tag_scope {
 public:
  explicit tag_scope(tag_id id) noexcept { push_tag(id); }
  explicit tag_scope(std::string_view name) : tag_scope(intern_tag(name)) {}
  ~tag_scope() { pop_tag(); }
  tag_scope(tag_scope const&) = delete;
  tag_scope& operator=(tag_scope const&) = delete;
};

}  // namespace gact::alloc
