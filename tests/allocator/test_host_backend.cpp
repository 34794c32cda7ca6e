// gact/tests/allocator/test_host_backend.cpp — the host backend: alignment,
// capacity, inline streams and events, copies and memory info.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"

using gact::device::host_backend;

TEST_SUITE("unit") {

TEST_CASE("reserve: aligned, writable, both the heap and the mmap paths") {
  host_backend be;
  for (std::size_t n : {std::size_t{1}, std::size_t{512}, std::size_t{4097}, host_backend::k_mmap_threshold - 1,
                        host_backend::k_mmap_threshold, std::size_t{64} << 20}) {
    void* p = be.reserve(n);
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % host_backend::k_alignment == 0);
    auto* c = static_cast<unsigned char*>(p);
    c[0] = 1;
    c[n - 1] = 2;
    CHECK(be.reserved_bytes() == n);
    be.release(p, n);
    CHECK(be.reserved_bytes() == 0);
  }
  CHECK_THROWS_AS(be.reserve(0), gact::invalid_argument);
  be.release(nullptr, 100);  // no-op
}

TEST_CASE("capacity: a reserve past it throws out_of_memory and reserves nothing") {
  host_backend be(1 << 20);
  void* a = be.reserve(768 << 10);
  CHECK_THROWS_AS(be.reserve(257 << 10), gact::out_of_memory);
  CHECK(be.reserved_bytes() == 768u << 10);
  void* b = be.reserve(256 << 10);  // exactly fills it
  CHECK(be.memory_info().free_bytes == 0);
  CHECK(be.memory_info().total_bytes == 1u << 20);
  be.release(a, 768 << 10);
  be.release(b, 256 << 10);
  CHECK(be.memory_info().free_bytes == 1u << 20);
}

TEST_CASE("streams run inline: events are complete, copies are done on return") {
  host_backend be;
  auto const s = be.create_stream();
  auto const e = be.create_event();
  CHECK(s != 0);
  CHECK(e != s);
  std::vector<char> src(1000, 'x'), dst(1000, 0);
  be.copy_async(dst.data(), src.data(), src.size(), s);
  be.record(e, s);
  CHECK(be.query(e));
  be.synchronize(e);
  be.synchronize_stream(s);
  CHECK(std::memcmp(src.data(), dst.data(), src.size()) == 0);
  be.destroy_event(e);
  be.destroy_stream(s);
  CHECK(be.kind() == gact::device::memory_kind::host);
  CHECK(be.name() == "host");
  auto const info = be.memory_info();
  CHECK(info.total_bytes > 0);
  CHECK(info.free_bytes <= info.total_bytes);
}

}  // TEST_SUITE
