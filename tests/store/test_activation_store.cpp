// gact/tests/store/test_activation_store.cpp
//
// The activation store's contract on the host backend: round trips per codec,
// dedup with reference counts, strided views, NaN fallback, leak accounting,
// out-of-memory without leaks, bad input, and (suite "threads") concurrent
// put/get/release/stats with steps, which also runs under ThreadSanitizer.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.hpp"
#include "allocator/device/host_backend.hpp"
#include "allocator/error.hpp"
#include "allocator/store/activation_store.hpp"
#include "../allocator/waiting_backend.hpp"

namespace {

using gact::codec::codec_id;
using gact::codec::dtype;
using gact::store::activation_store;
using gact::store::put_params;
using gact::store::tensor_view;

struct fixture {
  gact::device::host_backend be;
  gact::alloc::caching_allocator arena{be};
  activation_store store{arena, gact::store::store_options{1, ""}};
};

std::vector<float> randn(std::size_t n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

tensor_view view(void const* p, dtype t, std::vector<std::int64_t> shape, std::vector<std::int64_t> strides = {}) {
  tensor_view v;
  v.data = p;
  v.dtype = t;
  v.shape = std::move(shape);
  v.strides = std::move(strides);
  return v;
}

put_params bits(int b, std::uint64_t key = 1) {
  put_params p;
  p.bits = b;
  p.key = key;
  return p;
}

}  // namespace

TEST_CASE("float32 round trip stays within one quantization step per group") {
  fixture f;
  for (int b : {1, 2, 4, 8}) {
    auto x = randn(3000, 7);
    auto h = f.store.put(view(x.data(), dtype::float32, {3, 1000}), bits(b)).h;
    auto info = f.store.info(h);
    CHECK(info.codec == codec_id::quant);
    CHECK(info.bits == b);
    CHECK(info.bytes_stored < info.bytes_in);
    std::vector<float> y(x.size());
    f.store.get(h, y.data(), y.size() * 4);
    for (std::size_t g0 = 0; g0 < x.size(); g0 += 256) {
      std::size_t const g1 = std::min(x.size(), g0 + 256);
      float lo = x[g0], hi = x[g0];
      for (std::size_t i = g0; i < g1; ++i) {
        lo = std::min(lo, x[i]);
        hi = std::max(hi, x[i]);
      }
      float const step = (hi - lo) / float((1 << b) - 1);
      for (std::size_t i = g0; i < g1; ++i) REQUIRE(std::fabs(y[i] - x[i]) <= step * 1.0001f);
    }
    CHECK(f.store.release(h) == 0);
  }
  CHECK(f.store.live_handles() == 0);
  CHECK(f.store.stored_bytes() == 0);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("dedup: same view and version share one entry; a new version does not") {
  fixture f;
  auto x = randn(4096, 1);
  auto v = view(x.data(), dtype::float32, {64, 64});
  auto h1 = f.store.put(v, bits(4)).h;
  auto h2 = f.store.put(v, bits(4)).h;
  CHECK(h1 == h2);
  CHECK(f.store.info(h1).refcount == 2);
  v.version = 1;
  auto h3 = f.store.put(v, bits(4)).h;
  CHECK(h3 != h1);
  // another view of the same storage and version: served by the same blob
  auto other_shape = view(x.data(), dtype::float32, {4096});
  auto h4 = f.store.put(other_shape, bits(4)).h;
  CHECK(h4 == h1);
  auto s = f.store.stats_json();
  CHECK(s["dedup_hits"] == 2);
  CHECK(s["view_hits"] == 1);
  CHECK(s["tensors_in"] == 2);
  CHECK(f.store.release(h1) == 2);
  CHECK(f.store.release(h1) == 1);
  CHECK(f.store.release(h1) == 0);
  CHECK(f.store.release(h1) == -1);
  CHECK(f.store.stats_json()["bad_releases"] == 1);
  f.store.release(h3);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("dedup: a group's saves share their own blobs, with their own rounding, and serve no other save") {
  fixture f;
  auto x = randn(4096, 5);
  auto v = view(x.data(), dtype::float32, {64, 64});
  auto const first = f.store.put(v, bits(2)).h;  // a softmax's save of its result
  put_params own = bits(2, 7);                   // (its own key, as each save has: the noise follows the key)
  own.group = 1;  // a mul's save of it whose other operand is log(p)
  auto const mine = f.store.put(v, own).h;
  CHECK(mine != first);
  CHECK(f.store.info(first).refcount == 1);
  CHECK(f.store.stats_json()["dedup_hits"] == 0);
  // the same values, rounded apart: the two decoded images differ somewhere (2 bits over 4096 normal values)
  std::vector<float> a(x.size()), b(x.size());
  f.store.get(first, a.data(), a.size() * 4);
  f.store.get(mine, b.data(), b.size() * 4);
  CHECK(a != b);
  // the group's second save of the memory (p * p) is served by its blob; another group's is not
  CHECK(f.store.put(v, own).h == mine);
  put_params other = bits(2, 8);
  other.group = 2;
  auto const theirs = f.store.put(v, other).h;
  CHECK(theirs != mine);
  CHECK(theirs != first);
  // a later plain save is served by the common blob, never by a group's
  CHECK(f.store.put(v, bits(2)).h == first);
  CHECK(f.store.info(first).refcount == 2);
  CHECK(f.store.info(mine).refcount == 2);
  for (auto h : {first, mine, theirs}) {
    while (f.store.release(h) > 0) {
    }
  }
  CHECK(f.store.live_handles() == 0);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("dedup: a blob serves a save whose reader tolerates its bits, and only its owner's") {
  fixture f;
  auto x = randn(4096, 3);
  auto v = view(x.data(), dtype::float32, {64, 64});
  auto const narrow = f.store.put(v, bits(2)).h;  // a mul's operand, say, at the run's 2 bits
  put_params logspace = bits(4);
  logspace.min_bits = 4;  // a log-space save: its reader needs at least 4 bits
  auto const wide = f.store.put(v, logspace).h;
  CHECK(wide != narrow);
  CHECK(f.store.info(wide).bits == 4);
  auto const chosen = f.store.put(v, bits(8)).h;  // a wider width with no floor (a policy's choice): an earlier blob
  CHECK((chosen == narrow || chosen == wide));
  auto const again = f.store.put(v, logspace).h;  // a 4-bit blob exists: it serves
  CHECK(again == wide);
  put_params exact = bits(32);
  exact.min_bits = 32;
  auto const raw = f.store.put(v, exact).h;  // exact: no quantized blob serves it
  CHECK(f.store.info(raw).codec == codec_id::raw);
  auto const served = f.store.put(v, logspace).h;  // raw bytes serve any reader
  CHECK((served == wide || served == raw));
  // another owner's blob serves nothing of this owner's, even at the same width
  auto const a = f.store.new_owner(), b = f.store.new_owner();
  put_params pa = bits(4), pb = bits(4);
  pa.owner = a;
  pb.owner = b;
  auto y = randn(4096, 4);
  auto w = view(y.data(), dtype::float32, {4096});
  auto const ha = f.store.put(w, pa).h;
  auto const hb = f.store.put(w, pb).h;
  CHECK(ha != hb);
  CHECK(f.store.put(w, pa).h == ha);
  CHECK(f.store.stats_json(b)["dedup_hits"] == 0);
  for (auto h : {narrow, wide, raw, ha, hb}) {
    while (f.store.release(h) > 0) {
    }
  }
  CHECK(f.store.live_handles() == 0);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("forget and begin_step end dedup against an entry") {
  fixture f;
  auto x = randn(1024, 2);
  auto v = view(x.data(), dtype::float32, {1024});
  auto h1 = f.store.put(v, bits(4)).h;
  f.store.forget(h1);
  auto h2 = f.store.put(v, bits(4)).h;
  CHECK(h2 != h1);
  f.store.begin_step(5);
  auto h3 = f.store.put(v, bits(4)).h;
  CHECK(h3 != h2);
  for (auto h : {h1, h2, h3}) CHECK(f.store.release(h) == 0);
}

TEST_CASE("forget_storage: saves of the storage get blobs of their own until the owner's next step") {
  fixture f;
  auto x = randn(1024, 2);
  auto v = view(x.data(), dtype::float32, {1024});
  auto half = view(x.data() + 512, dtype::float32, {512});
  half.storage = reinterpret_cast<std::uintptr_t>(x.data());
  auto const a = f.store.new_owner(), b = f.store.new_owner();
  put_params p = bits(4);
  p.owner = a;
  auto h1 = f.store.put(v, p).h;
  CHECK(f.store.put(half, p).h == h1);  // served by the dense entry
  f.store.forget_storage(reinterpret_cast<std::uintptr_t>(x.data()), a);
  auto h2 = f.store.put(half, p).h;  // the storage may have changed: a blob of its own
  CHECK(h2 != h1);
  auto h3 = f.store.put(v, p).h;  // and it serves no later put either
  CHECK(h3 != h1);
  CHECK(h3 != h2);
  auto h4 = f.store.put(half, p).h;
  CHECK(h4 != h3);
  CHECK(f.store.info(h4).bytes_in == 512 * 4);
  f.store.begin_step(1, b);  // another owner's step: still unversioned
  auto h5 = f.store.put(v, p).h;
  auto h5b = f.store.put(v, p).h;
  CHECK(h5b != h5);
  f.store.begin_step(1, a);  // this owner's step: served again
  auto h6 = f.store.put(v, p).h;
  CHECK(f.store.put(half, p).h == h6);
  CHECK(f.store.release(h6) == 1);
  for (auto h : {h1, h1, h2, h3, h4, h5, h5b, h6}) CHECK(f.store.release(h) >= 0);
  CHECK(f.store.live_handles() == 0);
  // the note is b's alone (a's puts dedup), and an owner that goes away takes its note with it
  put_params pb = bits(4);
  pb.owner = b;
  f.store.forget_storage(reinterpret_cast<std::uintptr_t>(x.data()), b);
  auto h7 = f.store.put(v, pb).h;
  auto h7b = f.store.put(v, pb).h;
  CHECK(h7b != h7);
  auto ha = f.store.put(v, p).h;
  CHECK(f.store.put(half, p).h == ha);
  for (auto h : {ha, ha}) CHECK(f.store.release(h) >= 0);
  f.store.drop_owner(b);
  auto h8 = f.store.put(v, bits(4)).h;
  CHECK(f.store.put(half, bits(4)).h == h8);
  for (auto h : {h7, h7b, h8, h8}) CHECK(f.store.release(h) >= 0);
  CHECK(f.store.live_handles() == 0);
}

TEST_CASE("dense views keep their layout without a gather; other views are gathered in dense order") {
  fixture f;
  // a 40x30 row-major matrix viewed transposed (30x40, strides {1, 30}): dense, stored as its memory image
  auto x = randn(1200, 3);
  auto t = view(x.data(), dtype::float32, {30, 40}, {1, 30});
  auto h = f.store.put(t, bits(32)).h;  // raw: exact
  CHECK(f.store.info(h).strides == std::vector<std::int64_t>{1, 30});
  std::vector<float> y(1200);
  f.store.get(h, y.data(), y.size() * 4);
  CHECK(y == x);  // the image: element (i, j) at offset i + 30 j, as in the view
  f.store.release(h);
  // channels-last (N, C, H, W) = (2, 3, 4, 5) with strides (60, 1, 15, 3): dense too
  auto cl = view(x.data(), dtype::float32, {2, 3, 4, 5}, {60, 1, 15, 3});
  h = f.store.put(cl, bits(32)).h;
  CHECK(f.store.info(h).strides == std::vector<std::int64_t>{60, 1, 15, 3});
  f.store.release(h);
  // every other row of the matrix, last column dropped: shape {20, 29}, strides {60, 1}: gathered row-major
  auto s = view(x.data() + 1, dtype::float32, {20, 29}, {60, 1});
  h = f.store.put(s, bits(32)).h;
  CHECK(f.store.info(h).strides == std::vector<std::int64_t>{29, 1});
  std::vector<float> z(20 * 29);
  f.store.get(h, z.data(), z.size() * 4);
  for (int i = 0; i < 20; ++i)
    for (int j = 0; j < 29; ++j) REQUIRE(z[std::size_t(i * 29 + j)] == x[std::size_t(1 + i * 60 + j)]);
  f.store.release(h);
  // a non-dense transposed slice is gathered in the order of its strides: shape {29, 20}, strides {1, 60}
  auto ts = view(x.data() + 1, dtype::float32, {29, 20}, {1, 60});
  h = f.store.put(ts, bits(32)).h;
  CHECK(f.store.info(h).strides == std::vector<std::int64_t>{1, 29});
  f.store.get(h, z.data(), z.size() * 4);
  for (int i = 0; i < 29; ++i)
    for (int j = 0; j < 20; ++j) REQUIRE(z[std::size_t(i + j * 29)] == x[std::size_t(1 + i + j * 60)]);
  f.store.release(h);
  CHECK(f.store.stats_json()["gathers"] == 2);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("one blob per storage: a view inside a stored dense span is served from it, at its offset") {
  fixture f;
  auto x = randn(64 * 64, 8);
  auto base = f.store.put(view(x.data(), dtype::float32, {64, 64}), bits(32));
  CHECK_FALSE(base.shared);
  tensor_view rows = view(x.data() + 8 * 64, dtype::float32, {8, 64});
  rows.storage = reinterpret_cast<std::uintptr_t>(x.data());
  auto r = f.store.put(rows, bits(32));
  CHECK(r.shared);
  CHECK(r.h == base.h);
  CHECK(r.offset == 8 * 64);
  tensor_view tr = view(x.data(), dtype::float32, {64, 64}, {1, 64});  // transposed: same span
  auto t = f.store.put(tr, bits(32));
  CHECK(t.h == base.h);
  CHECK(t.offset == 0);
  // the decoded image is the storage's span: the view's elements are at their offsets in it
  auto img = f.store.get_shared(base.h);
  auto const* d = static_cast<float const*>(img->data());
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 64; ++j) REQUIRE(d[r.offset + i * 64 + j] == x[std::size_t((8 + i) * 64 + j)]);
  // a view whose start is not an element of its storage is an error
  tensor_view odd = view(reinterpret_cast<char const*>(x.data()) + 2, dtype::float32, {8});
  odd.storage = reinterpret_cast<std::uintptr_t>(x.data());
  CHECK_THROWS_AS(f.store.put(odd, bits(32)), gact::invalid_argument);
  // another version is not served
  tensor_view v1 = view(x.data(), dtype::float32, {64, 64});
  v1.version = 1;
  auto other = f.store.put(v1, bits(32));
  CHECK(other.h != base.h);
  for (int k = 0; k < 3; ++k) f.store.release(base.h);
  f.store.release(other.h);
  img.reset();
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("decode once: readers share a live image; a released image is decoded again") {
  fixture f;
  auto x = randn(5000, 9);
  auto h = f.store.put(view(x.data(), dtype::float32, {5000}), bits(4)).h;
  auto a = f.store.get_shared(h);
  auto b = f.store.get_shared(h);
  CHECK(a.get() == b.get());
  CHECK(f.store.stats_json()["decodes"] == 1);
  CHECK(f.store.stats_json()["gets"] == 2);
  a.reset();
  b.reset();
  auto c = f.store.get_shared(h);
  CHECK(f.store.stats_json()["decodes"] == 2);
  c.reset();
  f.store.release(h);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("decode once: an image decoded while other readers hold the handle is kept for the last of them") {
  fixture f;
  auto x = randn(5000, 13);
  tensor_view const v = view(x.data(), dtype::float32, {5000});
  auto h = f.store.put(v, bits(4)).h;
  CHECK(f.store.put(v, bits(4)).h == h);  // a second reader of the same tensor (refcount 2)
  CHECK(f.store.put(v, bits(4)).h == h);  // and a third
  std::size_t const blob_only = f.arena.allocated_bytes();
  auto a = f.store.get_shared(h);  // the first reader's backward: decoded, and kept
  auto const* first = a.get();
  a.reset();
  CHECK(f.arena.allocated_bytes() > blob_only);
  f.store.release(h);              // that reader is done
  auto b = f.store.get_shared(h);  // the second: the kept image, not decoded again
  CHECK(b.get() == first);
  b.reset();
  f.store.release(h);
  auto c = f.store.get_shared(h);  // the last reader takes it, and the entry lets it go
  CHECK(c.get() == first);
  CHECK(f.store.stats_json()["decodes"] == 1);
  c.reset();
  CHECK(f.arena.allocated_bytes() == blob_only);
  // a single reader's image is not kept
  auto d = f.store.get_shared(h);
  d.reset();
  CHECK(f.arena.allocated_bytes() == blob_only);
  CHECK(f.store.stats_json()["decodes"] == 2);
  f.store.release(h);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("decode once: a kept image goes with its entry when the readers are released unread") {
  fixture f;
  auto x = randn(4096, 14);
  tensor_view const v = view(x.data(), dtype::float32, {4096});
  auto h = f.store.put(v, bits(2)).h;
  CHECK(f.store.put(v, bits(2)).h == h);
  std::size_t const blob_only = f.arena.allocated_bytes();
  f.store.get_shared(h).reset();  // kept for the other reader
  CHECK(f.arena.allocated_bytes() > blob_only);
  f.store.release(h);
  f.store.release(h);  // which never reads it (its graph was dropped)
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("roles: a ReLU's mask is upgraded to one boundary blob when the next layer reads the values") {
  fixture f;
  auto x = randn(4096, 10);
  for (auto& v : x) v = std::max(v, 0.f);  // a ReLU's output
  put_params mask = bits(4);
  mask.what = gact::store::role::predicate;
  mask.pred = {std::uint32_t(gact::codec::predicate::gt), 0.f, 0.f, 0.f};
  auto m = f.store.put(view(x.data(), dtype::float32, {64, 64}), mask);
  auto info = f.store.info(m.h);
  CHECK(info.codec == codec_id::mask);
  CHECK(info.predicate);
  CHECK_FALSE(info.values);
  CHECK(info.bytes_stored < 4096 / 8 + 256);
  gact::store::get_params pg;
  pg.predicate = true;
  auto old_mask = f.store.get_shared(m.h, pg);  // a reader holding the mask's image across the upgrade
  // the next layer saves the same tensor for its values: the same handle, now a boundary quant blob
  auto v = f.store.put(view(x.data(), dtype::float32, {64, 64}), bits(2, 7));
  CHECK(v.h == m.h);
  info = f.store.info(m.h);
  CHECK(info.codec == codec_id::quant);
  CHECK(info.variant == std::uint8_t(gact::codec::quant_mode::boundary));
  CHECK(info.values);
  CHECK(info.predicate);
  CHECK(f.store.stats_json()["upgrades"] == 1);
  auto pm = f.store.get_shared(m.h, pg);
  auto vals = f.store.get_shared(m.h);
  auto const* pd = static_cast<float const*>(pm->data());
  auto const* vd = static_cast<float const*>(vals->data());
  auto const* od = static_cast<float const*>(old_mask->data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    REQUIRE(pd[i] == (x[i] > 0.f ? 1.f : 0.f));
    REQUIRE(od[i] == pd[i]);
    REQUIRE((vd[i] > 0.f) == (x[i] > 0.f));  // zeros exact, positives never rounded to 0
  }
  f.store.release(m.h);
  f.store.release(m.h);
  old_mask.reset();
  pm.reset();
  vals.reset();
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("roles: values stored as a boundary blob serve the ReLU's predicate save that follows (encoded once)") {
  fixture f;
  auto x = randn(4096, 10);
  for (auto& v : x) v = std::max(v, 0.f);  // a ReLU's output
  gact::codec::predicate_params const gt{std::uint32_t(gact::codec::predicate::gt), 0.f, 0.f, 0.f};
  // the next layer's values save comes first, told the predicate the ReLU's own save reads
  put_params vals = bits(2, 7);
  vals.boundary = true;
  vals.pred = gt;
  auto v = f.store.put(view(x.data(), dtype::float32, {64, 64}), vals);
  CHECK_FALSE(v.shared);
  CHECK(v.upgraded);  // (the policy is told so, as for an upgrade)
  auto info = f.store.info(v.h);
  CHECK(info.codec == codec_id::quant);
  CHECK(info.variant == std::uint8_t(gact::codec::quant_mode::boundary));
  CHECK(info.values);
  CHECK(info.predicate);
  // the ReLU's predicate save: the same handle, no second encode
  put_params mask = bits(4);
  mask.what = gact::store::role::predicate;
  mask.pred = gt;
  auto m = f.store.put(view(x.data(), dtype::float32, {64, 64}), mask);
  CHECK(m.shared);
  CHECK(m.h == v.h);
  auto st = f.store.stats_json();
  CHECK(st["bytes_in"] == 4096 * 4);
  CHECK(st["bytes_encoded"] == 4096 * 4);
  CHECK(st["upgrades"] == 0);
  CHECK(st["boundary_blobs"] == 1);
  // the same blob as a mask upgraded by the same values save (same key, bits and step)
  fixture g;
  auto gm = g.store.put(view(x.data(), dtype::float32, {64, 64}), mask);
  auto gv = g.store.put(view(x.data(), dtype::float32, {64, 64}), bits(2, 7));
  CHECK(gv.h == gm.h);
  CHECK(g.store.stats_json()["bytes_encoded"] == 2 * 4096 * 4);  // the mask, then the values again
  CHECK(g.store.stats_json()["boundary_blobs"] == 1);
  gact::store::get_params pg;
  pg.predicate = true;
  auto a = f.store.get_shared(v.h);
  auto b = g.store.get_shared(gv.h);
  auto pa = f.store.get_shared(m.h, pg);
  auto const* ad = static_cast<float const*>(a->data());
  auto const* bd = static_cast<float const*>(b->data());
  auto const* pd = static_cast<float const*>(pa->data());
  for (std::size_t i = 0; i < x.size(); ++i) {
    REQUIRE(ad[i] == bd[i]);
    REQUIRE(pd[i] == (x[i] > 0.f ? 1.f : 0.f));
  }
  a.reset();
  b.reset();
  pa.reset();
  f.store.release(v.h);
  f.store.release(m.h);
  g.store.release(gv.h);
  g.store.release(gm.h);
  CHECK(f.arena.allocated_bytes() == 0);
  CHECK(g.arena.allocated_bytes() == 0);
}

/// A values save of `x` (4096 floats) asked to be a boundary blob for the predicate `pred`, at 4 bits.
gact::store::put_result put_boundary_values(fixture& f, std::vector<float> const& x, gact::codec::predicate pred) {
  put_params vals = bits(4);
  vals.boundary = true;
  vals.pred = {std::uint32_t(pred), 0.f, 0.f, 0.f};
  return f.store.put(view(x.data(), dtype::float32, {4096}), vals);
}

TEST_CASE("roles: a boundary values save of data outside the range stores plain values; its mask is its own") {
  fixture f;
  auto x = randn(4096, 11);  // negative values too: not a clamp's output
  gact::codec::predicate_params const gt{std::uint32_t(gact::codec::predicate::gt), 0.f, 0.f, 0.f};
  auto v = put_boundary_values(f, x, gact::codec::predicate::gt);
  CHECK_FALSE(v.upgraded);
  auto info = f.store.info(v.h);
  CHECK(info.codec == codec_id::quant);
  CHECK(info.variant == 0);
  CHECK_FALSE(info.predicate);
  put_params mask = bits(4);
  mask.what = gact::store::role::predicate;
  mask.pred = gt;
  auto m = f.store.put(view(x.data(), dtype::float32, {4096}), mask);
  CHECK(m.h != v.h);
  CHECK(f.store.info(m.h).codec == codec_id::mask);
  // the refused boundary pass counts as encoded bytes
  CHECK(f.store.stats_json()["bytes_encoded"] == 3 * 4096 * 4);
  f.store.release(v.h);
  f.store.release(m.h);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("roles: a boundary values save refused by the codec is raw values, and serves no predicate") {
  // (NaN in a clamp's output: the boundary encode is refused, the values kept raw; a raw entry told it held the
  // predicate handed a later predicate save a blob no predicate decodes from)
  fixture f;
  auto x = randn(4096, 13);
  for (auto& v : x) v = std::max(v, 0.f);
  x[100] = std::numeric_limits<float>::quiet_NaN();
  gact::codec::predicate_params const gt{std::uint32_t(gact::codec::predicate::gt_or_nan), 0.f, 0.f, 0.f};
  auto v = put_boundary_values(f, x, gact::codec::predicate::gt_or_nan);
  CHECK_FALSE(v.upgraded);
  auto info = f.store.info(v.h);
  CHECK(info.codec == codec_id::raw);
  CHECK_FALSE(info.predicate);
  CHECK(f.store.stats_json()["boundary_blobs"] == 0);
  put_params mask = bits(4);
  mask.what = gact::store::role::predicate;
  mask.pred = gt;
  auto m = f.store.put(view(x.data(), dtype::float32, {4096}), mask);
  gact::store::get_params pg;
  pg.predicate = true;
  auto pa = f.store.get_shared(m.h, pg);  // (threw "a predicate was asked of a raw blob" when served by v)
  auto const* pd = static_cast<float const*>(pa->data());
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(pd[i] == (x[i] > 0.f || std::isnan(x[i]) ? 1.f : 0.f));
  pa.reset();
  f.store.release(v.h);
  f.store.release(m.h);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("stats: the last step's bytes stored, encoded and decoded") {
  fixture f;
  auto x = randn(2048, 12);
  f.store.begin_step(0);
  auto h = f.store.put(view(x.data(), dtype::float32, {2048}), bits(4)).h;
  auto img = f.store.get_shared(h);
  img.reset();
  img = f.store.get_shared(h);  // decoded again: its image was released
  img.reset();
  f.store.release(h);
  f.store.end_step();
  auto last = f.store.stats_json()["last_step"];
  CHECK(last["bytes_in"] == 2048 * 4);
  CHECK(last["bytes_encoded"] == 2048 * 4);
  CHECK(last["bytes_decoded"] == 2 * 2048 * 4);
  f.store.begin_step(1);
  f.store.end_step();  // a step that stores nothing
  last = f.store.stats_json()["last_step"];
  CHECK(last["bytes_in"] == 0);
  CHECK(last["bytes_encoded"] == 0);
  CHECK(last["bytes_decoded"] == 0);
}

TEST_CASE("roles: a mask of data that is not a clamp's output stays a mask; the values get their own blob") {
  fixture f;
  auto x = randn(4096, 11);  // an input to leaky_relu: negative values too
  put_params mask = bits(4);
  mask.what = gact::store::role::predicate;
  mask.pred = {std::uint32_t(gact::codec::predicate::gt), 0.f, 0.f, 0.f};
  auto m = f.store.put(view(x.data(), dtype::float32, {4096}), mask);
  auto v = f.store.put(view(x.data(), dtype::float32, {4096}), bits(4));
  CHECK(v.h != m.h);
  CHECK(f.store.info(m.h).codec == codec_id::mask);
  CHECK(f.store.info(v.h).codec == codec_id::quant);
  // asking the values of a mask-only entry, or the predicate of a values-only one, is an error
  CHECK_THROWS_AS(f.store.get_shared(m.h), gact::invalid_argument);
  gact::store::get_params pg;
  pg.predicate = true;
  CHECK_THROWS_AS(f.store.get_shared(v.h, pg), gact::invalid_argument);
  // a second reader of the same predicate shares the mask
  auto m2 = f.store.put(view(x.data(), dtype::float32, {4096}), mask);
  CHECK(m2.h == m.h);
  // a different predicate does not
  put_params ge = mask;
  ge.pred.pred = std::uint32_t(gact::codec::predicate::ge);
  auto m3 = f.store.put(view(x.data(), dtype::float32, {4096}), ge);
  CHECK(m3.h != m.h);
  for (auto h : {m.h, m.h, v.h, m3.h}) f.store.release(h);
  CHECK(f.arena.allocated_bytes() == 0);
}

TEST_CASE("roles: a two-level tensor is a mask of its level; another tensor falls back to values") {
  fixture f;
  std::vector<float> drop(3000);
  for (std::size_t i = 0; i < drop.size(); ++i) drop[i] = i % 3 == 0 ? 0.f : 2.f;
  put_params ne = bits(4);
  ne.what = gact::store::role::predicate;
  ne.pred = {std::uint32_t(gact::codec::predicate::ne), 0.f, 0.f, 0.f};
  auto h = f.store.put(view(drop.data(), dtype::float32, {3000}), ne).h;
  CHECK(f.store.info(h).codec == codec_id::mask);
  gact::store::get_params pg;
  pg.predicate = true;
  pg.true_value = 2.f;
  std::vector<float> y(3000);
  f.store.get(h, y.data(), y.size() * 4, pg);
  CHECK(y == drop);
  auto x = randn(3000, 12);
  auto h2 = f.store.put(view(x.data(), dtype::float32, {3000}), ne).h;
  auto info = f.store.info(h2);
  CHECK(info.codec == codec_id::quant);
  CHECK(info.values);
  CHECK_FALSE(info.predicate);
  CHECK(f.store.stats_json()["refusal_fallbacks"] == 1);
  f.store.release(h);
  f.store.release(h2);
}

TEST_CASE("roles: max-pool indices go to the window codec; indices outside their window are stored raw") {
  fixture f;
  gact::codec::window_params w{};
  w.nd = 1;
  w.inner = 1;
  w.in[0] = 16;
  w.out[0] = 8;
  w.kernel[0] = 2;
  w.stride[0] = 2;
  w.dilation[0] = 1;
  std::vector<std::int64_t> idx(3 * 8);
  for (std::size_t e = 0; e < idx.size(); ++e) idx[e] = std::int64_t((e % 8) * 2 + (e * 7 % 3 == 0 ? 1 : 0));
  put_params pi = bits(4);
  pi.what = gact::store::role::indices;
  pi.window = w;
  auto h = f.store.put(view(idx.data(), dtype::int64, {3, 8}), pi).h;
  CHECK(f.store.info(h).codec == codec_id::window);
  CHECK(f.store.info(h).bits == 1);  // a window of 2
  std::vector<std::int64_t> out(idx.size());
  f.store.get(h, out.data(), out.size() * 8);
  CHECK(out == idx);
  f.store.release(h);
  std::vector<std::int64_t> bad = idx;
  bad[5] = 15;  // output 5's window is {10, 11}
  auto h3 = f.store.put(view(bad.data(), dtype::int64, {3, 8}), pi).h;
  CHECK(f.store.info(h3).codec == codec_id::raw);
  f.store.get(h3, out.data(), out.size() * 8);
  CHECK(out == bad);
  f.store.release(h3);
}

TEST_CASE("normalized values: per-channel statistics given with the put") {
  fixture f;
  // (N, C, HW) = (4, 3, 10) with channel scales 1000, 1, 0.001
  std::vector<float> x(120);
  float const scale[3] = {1000.f, 1.f, 0.001f};
  auto z = randn(120, 13);
  for (std::size_t e = 0; e < x.size(); ++e) x[e] = scale[(e / 10) % 3] * z[e];
  std::vector<float> shift{0.f, 0.f, 0.f}, inv{1e-3f, 1.f, 1e3f};
  put_params p = bits(4);
  p.norm_count = 3;
  p.norm_inner = 10;
  p.norm_shift = shift.data();
  p.norm_scale = inv.data();
  auto h = f.store.put(view(x.data(), dtype::float32, {4, 3, 10}), p).h;
  CHECK(f.store.info(h).variant == std::uint8_t(gact::codec::quant_mode::normalized));
  std::vector<float> y(120);
  f.store.get(h, y.data(), y.size() * 4);
  for (std::size_t e = 0; e < x.size(); ++e) REQUIRE(std::fabs(y[e] - x[e]) <= 1.5f * scale[(e / 10) % 3]);
  f.store.release(h);
}

TEST_CASE("dedup: a put normalized per block is not served by plain groups of its storage; a plain put is by it") {
  // (F.normalize's rows, a layer norm's input: plain groups span the blocks whose scales it is normalized against, so a
  // normalized reader served by them read a small row at a large one's step)
  fixture f;
  std::vector<float> x(256 * 16);
  auto z = randn(x.size(), 21);
  for (std::size_t e = 0; e < x.size(); ++e) x[e] = z[e] * std::pow(10.0f, float((e / 16) % 4));
  std::vector<float> shift(256, 0.0f), inv(256);
  for (std::size_t r = 0; r < 256; ++r) inv[r] = std::pow(10.0f, -float(r % 4));
  put_params normed = bits(8);
  normed.norm_count = 256;
  normed.norm_inner = 16;
  normed.norm_shift = shift.data();
  normed.norm_scale = inv.data();
  auto const v = view(x.data(), dtype::float32, {256, 16});
  auto plain = f.store.put(v, bits(8));
  auto after = f.store.put(v, normed);  // (a blob of its own)
  CHECK_FALSE(after.shared);
  CHECK(after.h != plain.h);
  CHECK(f.store.info(after.h).variant == std::uint8_t(gact::codec::quant_mode::normalized));
  std::vector<float> y(x.size());
  f.store.get(after.h, y.data(), y.size() * 4);
  // (one step of the group's z range, within about ±6 for these normal values, in the row's own units)
  for (std::size_t e = 0; e < x.size(); ++e) REQUIRE(std::fabs(y[e] - x[e]) <= 12.0f / 255.0f / inv[e / 16]);
  auto served = f.store.put(v, bits(8));  // (a plain reader: either blob serves it)
  CHECK(served.shared);
  for (auto h : {plain.h, after.h, served.h}) f.store.release(h);
}

TEST_CASE("NaN and Inf are stored raw and counted") {
  fixture f;
  auto x = randn(2000, 4);
  x[10] = std::numeric_limits<float>::quiet_NaN();
  x[11] = -std::numeric_limits<float>::infinity();
  auto h = f.store.put(view(x.data(), dtype::float32, {2000}), bits(4)).h;
  CHECK(f.store.info(h).codec == codec_id::raw);
  std::vector<float> y(2000);
  f.store.get(h, y.data(), y.size() * 4);
  CHECK(std::isnan(y[10]));
  CHECK(y[11] == x[11]);
  CHECK(std::memcmp(y.data(), x.data(), 10 * 4) == 0);
  CHECK(f.store.stats_json()["nonfinite_fallbacks"] == 1);
  // the host encoder answers at once: no verdict is left to read (the device's comes later, codecs/verdict.hpp)
  CHECK(f.store.verdict(h) == 0);
  CHECK(f.store.verdict(h, true) == 0);
  CHECK(f.store.stats_json()["device_nonfinite"] == 0);
  CHECK(f.store.stats_json()["verdict_waits"] == 0);
  f.store.release(h);
  CHECK_THROWS_WITH_AS((void)f.store.verdict(h), doctest::Contains("activation_store::verdict: unknown handle"),
                       gact::invalid_argument);
}

TEST_CASE("a mask's fill (a magnitude of 2^15 or more) is kept exact; a value just inside is quantized") {
  // At 8 bits a value of 1 in a group with torch.finfo(float32).min decoded to 0 (its step swamps it): such tensors are
  // refused by the codec (refusal::wide) and stored raw, in every float dtype; a boundary or predicate save is not
  // concerned (its range is the predicate's).
  fixture f;
  for (float fill : {std::numeric_limits<float>::lowest(), -1e9f, -65504.0f, 32768.0f}) {
    CAPTURE(fill);
    auto x = randn(2000, 4);
    for (std::size_t i = 300; i < 400; ++i) x[i] = fill;
    auto h = f.store.put(view(x.data(), dtype::float32, {2000}), bits(8)).h;
    CHECK(f.store.info(h).codec == codec_id::raw);
    std::vector<float> y(2000);
    f.store.get(h, y.data(), y.size() * 4);
    CHECK(y == x);
    f.store.release(h);
  }
  CHECK(f.store.stats_json()["refusal_fallbacks"] == 4);
  CHECK(f.store.stats_json()["nonfinite_fallbacks"] == 0);
  auto x = randn(2000, 4);
  x[300] = 32767.0f;  // (inside: quantized, within one step of its group)
  auto h = f.store.put(view(x.data(), dtype::float32, {2000}), bits(8)).h;
  CHECK(f.store.info(h).codec == codec_id::quant);
  f.store.release(h);
}

TEST_CASE("bool and 0/1 uint8 go to the mask codec; other integers raw") {
  fixture f;
  std::vector<std::uint8_t> m(5000), u(5000);
  std::vector<std::int32_t> k(5000);
  for (std::size_t i = 0; i < m.size(); ++i) {
    m[i] = std::uint8_t((i * 7919) % 3 == 0);
    u[i] = std::uint8_t(i % 5);
    k[i] = std::int32_t(i) - 77;
  }
  auto hb = f.store.put(view(m.data(), dtype::boolean, {5000}), bits(4)).h;
  auto hm = f.store.put(view(m.data(), dtype::uint8, {50, 100}), bits(4)).h;
  auto hu = f.store.put(view(u.data(), dtype::uint8, {5000}), bits(4)).h;
  auto hk = f.store.put(view(k.data(), dtype::int32, {5000}), bits(4)).h;
  CHECK(f.store.info(hb).codec == codec_id::mask);
  CHECK(f.store.info(hb).bytes_stored < 5000 / 8 + 256);
  CHECK(f.store.info(hm).codec == codec_id::mask);
  CHECK(f.store.info(hu).codec == codec_id::raw);
  CHECK(f.store.info(hk).codec == codec_id::raw);
  std::vector<std::uint8_t> out(5000);
  f.store.get(hm, out.data(), out.size());
  CHECK(out == m);
  f.store.get(hu, out.data(), out.size());
  CHECK(out == u);
  std::vector<std::int32_t> ko(5000);
  f.store.get(hk, ko.data(), ko.size() * 4);
  CHECK(ko == k);
  for (auto h : {hb, hm, hu, hk}) f.store.release(h);
}

TEST_CASE("handles alive at end_step are leaks; they stay valid") {
  fixture f;
  auto x = randn(4096, 5);
  f.store.begin_step(0);
  auto h = f.store.put(view(x.data(), dtype::float32, {4096}), bits(4)).h;
  CHECK(f.store.end_step() == 1);
  auto s = f.store.stats_json();
  CHECK(s["leaks"] == 1);
  CHECK(s["leaks_last_step"] == 1);
  std::vector<float> y(4096);
  f.store.get(h, y.data(), y.size() * 4);
  f.store.release(h);
  f.store.begin_step(1);
  CHECK(f.store.end_step() == 0);
  CHECK(f.store.stats_json()["leaks_last_step"] == 0);
}

TEST_CASE("owners: each counts its own puts, skips and leaks; the process totals count all") {
  fixture f;
  auto const a = f.store.new_owner(), b = f.store.new_owner();
  REQUIRE(a != b);
  REQUIRE(a != 0);
  auto x = randn(4096, 7), y = randn(4096, 8);
  f.store.begin_step(0, a);
  f.store.begin_step(0, b);
  put_params pa = bits(4, 1), pb = bits(4, 2);
  pa.owner = a;
  pb.owner = b;
  auto const ha = f.store.put(view(x.data(), dtype::float32, {4096}), pa).h;
  auto const hb = f.store.put(view(y.data(), dtype::float32, {4096}), pb).h;
  f.store.note_skip(gact::store::skip_reason::memory, 100, b);
  f.store.release(ha);
  CHECK(f.store.end_step(a) == 0);  // b's live handle is not a's leak
  CHECK(f.store.end_step(b, false) == 1);  // not a step: the leak counts, the step does not
  CHECK(f.store.stats_json(b)["steps"] == 0);
  CHECK(f.store.stats_json(b)["leaks"] == 1);
  CHECK(f.store.end_step(b) == 1);
  auto const sa = f.store.stats_json(a), sb = f.store.stats_json(b), all = f.store.stats_json();
  CHECK(sa["owner"] == a);
  CHECK(sa["tensors_in"] == 1);
  CHECK(sb["tensors_in"] == 1);
  CHECK(all["tensors_in"] == 2);
  CHECK(sa["leaks"] == 0);
  CHECK(sb["leaks"] == 2);  // at both ends
  CHECK(sb["steps"] == 1);
  CHECK(sb["leaks_last_step"] == 1);
  CHECK(sb["skipped"]["memory"]["bytes"] == 100);
  CHECK(sa["skipped"]["memory"]["bytes"] == 0);
  f.store.release(hb);
  f.store.drop_owner(a);
  CHECK_THROWS_AS(f.store.stats_json(a), gact::invalid_argument);  // a dropped owner is unknown
}

TEST_CASE("out of memory propagates and leaves nothing behind") {
  gact::device::host_backend be(std::size_t{4} << 20);  // 4 MiB cap
  gact::alloc::caching_allocator arena(be);
  activation_store store(arena, gact::store::store_options{1, ""});
  std::vector<float> big(std::size_t{3} << 20);  // 12 MiB: its raw blob cannot fit
  CHECK_THROWS_AS(store.put(view(big.data(), dtype::float32, {std::int64_t(big.size())}), bits(32)),
                  gact::out_of_memory);
  CHECK(store.live_handles() == 0);
  CHECK(arena.allocated_bytes() == 0);
}

TEST_CASE("bad input is rejected with the reason") {
  fixture f;
  float x[16] = {};
  CHECK_THROWS_AS(f.store.put(view(x, dtype::float32, {4, 4}), bits(3)), gact::invalid_argument);
  CHECK_THROWS_AS(f.store.put(view(x, dtype::float32, {4, 4}, {1}), bits(4)), gact::invalid_argument);
  CHECK_THROWS_AS(f.store.put(view(x, dtype::float32, {4, -4}), bits(4)), gact::invalid_argument);
  CHECK_THROWS_AS(f.store.put(view(nullptr, dtype::float32, {4, 4}), bits(4)), gact::invalid_argument);
  auto cuda = view(x, dtype::float32, {16});
  cuda.device = 0;
  CHECK_THROWS_AS(f.store.put(cuda, bits(4)), gact::invalid_argument);
  CHECK_THROWS_AS(f.store.get(12345, x, sizeof x), gact::invalid_argument);
  auto h = f.store.put(view(x, dtype::float32, {16}), bits(4)).h;
  CHECK_THROWS_AS(f.store.get(h, x, 4), gact::invalid_argument);
  f.store.release(h);
  CHECK_THROWS_AS(gact::store::parse_dtype("complex64"), gact::invalid_argument);
  CHECK(gact::store::parse_dtype("torch.bfloat16") == dtype::bfloat16);
  CHECK_THROWS_AS(gact::store::parse_skip_reason("tired"), gact::invalid_argument);
  auto empty = f.store.put(view(nullptr, dtype::float32, {0, 5}), bits(4)).h;
  f.store.get(empty, nullptr, 0);
  CHECK(f.store.release(empty) == 0);
}

TEST_CASE("a store destroyed with live handles frees their blobs") {
  gact::device::host_backend be;
  gact::alloc::caching_allocator arena(be);
  {
    activation_store store(arena, gact::store::store_options{1, ""});
    auto x = randn(4096, 6);
    (void)store.put(view(x.data(), dtype::float32, {4096}), bits(4));
  }
  CHECK(arena.allocated_bytes() == 0);
}

TEST_SUITE("threads") {
  TEST_CASE("a decode asks for its image outside the entry's lock: another reader of the entry gets through") {
    // (the arena as over torch's CUDA pool: each request a segment of its own from a backend called without the
    // arena's lock, which may wait for Python; meanwhile a thread holding the GIL reads the same entry)
    gact::test::waiting_backend be;
    be.kind = gact::device::memory_kind::host;
    gact::alloc::allocator_options o;
    o.small_size = o.small_segment_size = 512;
    o.min_large_alloc = o.large_segment_size = 1024;
    o.round_large = 512;
    o.release_free_above = 1;
    o.backend_unlocked = true;
    gact::alloc::caching_allocator arena(be, o);
    activation_store store(arena, gact::store::store_options{1, ""});
    auto x = randn(4096, 5);
    auto const h = store.put(view(x.data(), dtype::float32, {4096}), bits(8)).h;
    be.armed = 1;  // the image's segment waits
    std::thread reader([&] { CHECK(store.get_shared(h) != nullptr); });
    while (!be.waiting) std::this_thread::yield();
    CHECK(store.info(h).bytes_in == 4096 * 4);  // the entry's lock
    be.other_thread_done();
    reader.join();
    CHECK(be.served_meanwhile);
    CHECK(store.release(h) == 0);
    CHECK(arena.allocated_bytes() == 0);
  }

  TEST_CASE("concurrent put/get/release with steps and stats") {
    fixture f;
    constexpr int k_threads = 4;
    constexpr int k_iters = 150;
    auto shared = randn(2048, 99);  // every thread also saves this one: dedup under contention
    std::atomic<bool> stop{false};
    std::atomic<int> failures{0};
    std::thread observer([&] {
      std::uint64_t step = 0;
      while (!stop.load()) {
        auto s = f.store.stats_json();
        if (s["bytes_stored_current"].get<std::uint64_t>() > s["bytes_stored_peak"].get<std::uint64_t>())
          failures.fetch_add(1);
        f.store.begin_step(++step);
        f.store.end_step();
      }
    });
    std::vector<std::thread> workers;
    for (int t = 0; t < k_threads; ++t) {
      workers.emplace_back([&, t] {
        auto x = randn(3000, std::uint32_t(t));
        std::vector<float> y(x.size()), z(shared.size());
        auto const [mn, mx] = std::minmax_element(x.begin(), x.end());
        float const step = (*mx - *mn) / 255.f * 1.0001f;  // bounds every group's step
        for (int i = 0; i < k_iters; ++i) {
          auto h = f.store.put(view(x.data(), dtype::float32, {3000}), bits(8, std::uint64_t(t))).h;
          auto hs = f.store.put(view(shared.data(), dtype::float32, {2048}), bits(8)).h;
          f.store.get(h, y.data(), y.size() * 4);
          f.store.get(hs, z.data(), z.size() * 4);
          for (std::size_t j = 0; j < x.size(); j += 97)
            if (std::fabs(y[j] - x[j]) > step) failures.fetch_add(1);
          if (f.store.release(h) < 0) failures.fetch_add(1);
          if (f.store.release(hs) < 0) failures.fetch_add(1);
        }
      });
    }
    for (auto& w : workers) w.join();
    stop = true;
    observer.join();
    CHECK(failures.load() == 0);
    CHECK(f.store.live_handles() == 0);
    CHECK(f.store.stored_bytes() == 0);
    CHECK(f.arena.allocated_bytes() == 0);
    auto s = f.store.stats_json();
    CHECK(s["gets"] == 2 * k_threads * k_iters);
    CHECK(s["releases"] == 2 * k_threads * k_iters);
  }
}
