// gact/codecs/mask_math.hpp
//
// The arithmetic of predicate masks and of the window codec, written once for
// the CPU executor (codec.cpp) and the CUDA kernels (codec_cuda.cu).
//
// Predicate masks: bit e of the code section is pred(x_e) (format.hpp lists the
// predicates). What a backward pass reads from a ReLU's output is `x > 0`, from
// hardtanh's input `lo < x < hi`, from clamp's `lo <= x <= hi`: storing that one
// bit is lossless for the reader, where quantized values could flip the test for
// elements near the bounds. NaN satisfies every predicate as the comparison
// operators say (false, except `ne`), which is what the backward kernels compute.
//
// Window codec: a max-pool index is a flat index into its input plane; the
// element it was taken from lies in the pooling window of its output position,
// so the index is stored as the window offset (kernel-sized, a few bits). The
// encoder checks that every index is a window position and refuses the tensor
// otherwise; the decoder checks every decoded coordinate against the input plane.
#pragma once

#include "codecs/format.hpp"

namespace gact::codec::hd {

/// pred(x) for a predicate mask's parameters.
GACT_HD bool eval_predicate(std::uint32_t pred, float a, float b, float x) {
  switch (predicate(pred)) {
    case predicate::gt: return x > a;
    case predicate::ge: return x >= a;
    case predicate::lt: return x < a;
    case predicate::le: return x <= a;
    case predicate::open: return x > a && x < b;
    case predicate::closed: return x >= a && x <= b;
    case predicate::ne: return x != 0.0f;
    case predicate::gt_or_nan: return !(x <= a);
  }
  return false;
}

/// Spatial decomposition of an output position and the window origin of each dim.
struct window_geometry {
  std::uint32_t nd;
  std::uint64_t inner;
  std::uint64_t out_plane;  ///< prod(out)
  std::int64_t in[k_window_max_nd], out[k_window_max_nd], kernel[k_window_max_nd];
  std::int64_t stride[k_window_max_nd], pad[k_window_max_nd], dilation[k_window_max_nd];
};

GACT_HD window_geometry make_window_geometry(window_params const& w) {
  window_geometry g{};
  g.nd = w.nd;
  g.inner = w.inner;
  g.out_plane = 1;
  for (std::uint32_t d = 0; d < w.nd; ++d) {
    g.in[d] = w.in[d];
    g.out[d] = w.out[d];
    g.kernel[d] = w.kernel[d];
    g.stride[d] = w.stride[d];
    g.pad[d] = w.pad[d];
    g.dilation[d] = w.dilation[d];
    g.out_plane *= std::uint64_t(w.out[d]);
  }
  return g;
}

/// Output coordinates of memory element e.
GACT_HD void window_out_coords(window_geometry const& g, std::uint64_t e, std::int64_t* o) {
  std::uint64_t s = (e / g.inner) % g.out_plane;
  for (int d = int(g.nd) - 1; d >= 0; --d) {
    o[d] = std::int64_t(s % std::uint64_t(g.out[d]));
    s /= std::uint64_t(g.out[d]);
  }
}

/// Code of index `idx` at output coordinates o, or -1 when idx is not a position of o's window.
GACT_HD std::int64_t window_encode(window_geometry const& g, std::int64_t const* o, std::int64_t idx) {
  if (idx < 0) return -1;
  std::int64_t rest = idx;
  std::int64_t i[k_window_max_nd];
  for (int d = int(g.nd) - 1; d >= 0; --d) {
    i[d] = rest % g.in[d];
    rest /= g.in[d];
  }
  if (rest != 0) return -1;  // beyond the input plane
  std::int64_t code = 0;
  for (std::uint32_t d = 0; d < g.nd; ++d) {
    std::int64_t const off = i[d] - (o[d] * g.stride[d] - g.pad[d]);
    if (off < 0 || off % g.dilation[d] != 0) return -1;
    std::int64_t const k = off / g.dilation[d];
    if (k >= g.kernel[d]) return -1;
    code = code * g.kernel[d] + k;
  }
  return code;
}

/// Index of code `code` at output coordinates o, or -1 when the position lies outside the input plane
/// (or the code outside the window): only a corrupt code section gives -1.
GACT_HD std::int64_t window_decode(window_geometry const& g, std::int64_t const* o, std::int64_t code) {
  std::int64_t k[k_window_max_nd];
  std::int64_t rest = code;
  for (int d = int(g.nd) - 1; d >= 0; --d) {
    k[d] = rest % g.kernel[d];
    rest /= g.kernel[d];
  }
  if (rest != 0) return -1;
  std::int64_t idx = 0;
  for (std::uint32_t d = 0; d < g.nd; ++d) {
    std::int64_t const i = o[d] * g.stride[d] - g.pad[d] + k[d] * g.dilation[d];
    if (i < 0 || i >= g.in[d]) return -1;
    idx = idx * g.in[d] + i;
  }
  return idx;
}

}  // namespace gact::codec::hd
