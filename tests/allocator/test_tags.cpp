// gact/tests/allocator/test_tags.cpp — tag interning and the per-thread tag stack.
#include <doctest/doctest.h>

#include <string>
#include <thread>

#include "allocator/error.hpp"
#include "allocator/tags.hpp"

using namespace gact::alloc;

TEST_SUITE("unit") {

TEST_CASE("built-in tags have fixed ids and names") {
  CHECK(intern_tag("other") == tag_other);
  CHECK(intern_tag("activation") == tag_activation);
  CHECK(intern_tag("weight") == tag_weight);
  CHECK(intern_tag("gradient") == tag_gradient);
  CHECK(intern_tag("optimizer") == tag_optimizer);
  CHECK(intern_tag("workspace") == tag_workspace);
  CHECK(tag_name(tag_workspace) == "workspace");
  CHECK(tag_name(k_max_tags - 1) == "other");  // not interned (yet): "other"
  auto const names = tag_names();
  REQUIRE(names.size() >= k_first_user_tag);
  CHECK(names[tag_activation] == "activation");
}

TEST_CASE("user tags are interned once") {
  tag_id const a = intern_tag("test.user.a");
  CHECK(a >= k_first_user_tag);
  CHECK(intern_tag("test.user.a") == a);
  CHECK(intern_tag("test.user.b") != a);
  CHECK(tag_name(a) == "test.user.a");
  CHECK_THROWS_AS(intern_tag(""), gact::invalid_argument);
  CHECK_THROWS_AS(intern_tag(std::string(65, 'x')), gact::invalid_argument);
  CHECK_NOTHROW(intern_tag(std::string(64, 'x')));
}

TEST_CASE("the stack: push, pop, scopes, and pop on empty is counted") {
  CHECK(tag_depth() == 0);
  CHECK(current_tag() == tag_other);
  push_tag(tag_weight);
  {
    tag_scope s(tag_gradient);
    CHECK(current_tag() == tag_gradient);
    CHECK(tag_depth() == 2);
  }
  CHECK(current_tag() == tag_weight);
  pop_tag();
  CHECK(tag_depth() == 0);
  auto const before = tag_underflows();
  pop_tag();  // tag-underflow
  pop_tag();
  CHECK(tag_underflows() == before + 2);
  CHECK(tag_depth() == 0);
  CHECK(current_tag() == tag_other);
}

TEST_CASE("pushes beyond the kept depth are counted and balance with their pops") {
  auto const before = tag_overflows();
  for (std::size_t i = 0; i < k_max_tag_depth; ++i) push_tag(tag_activation);
  push_tag(tag_weight);  // beyond: not recorded
  CHECK(tag_overflows() == before + 1);
  CHECK(current_tag() == tag_activation);
  CHECK(tag_depth() == k_max_tag_depth + 1);
  for (std::size_t i = 0; i <= k_max_tag_depth; ++i) pop_tag();
  CHECK(tag_depth() == 0);
}

}  // TEST_SUITE

TEST_SUITE("threads") {

TEST_CASE("each thread has its own stack; interning is shared") {
  push_tag(tag_weight);
  tag_id seen = tag_other;
  std::size_t depth = 99;
  tag_id interned = 0;
  std::thread t([&] {
    depth = tag_depth();
    tag_scope s("test.thread.tag");
    interned = intern_tag("test.thread.tag");
    seen = current_tag();
  });
  t.join();
  CHECK(depth == 0);
  CHECK(seen == interned);
  CHECK(current_tag() == tag_weight);
  CHECK(intern_tag("test.thread.tag") == interned);
  pop_tag();
}

}  // TEST_SUITE
