// tests/codecs/fuzz_decode.cpp — libFuzzer target for the blob decoder.
//
// Feeds arbitrary bytes to parse() and decode_cpu() with an output buffer of
// bounded size. Every input must either decode or be rejected with
// gact::corrupt_blob (or invalid_argument when the blob is valid but describes
// more output than the bound); anything else (a crash, an out-of-bounds read
// under ASan, another exception) is a finding. The input is copied into an
// exactly sized heap buffer so that ASan sees a read one byte past its end.
//
// The first bytes of most inputs will fail the magic/checksum checks; to reach
// deeper, a fraction of inputs is turned into a blob whose header is a valid
// prefix: when the input starts with the byte 'G', a valid header for a small
// tensor is written in front of the remaining bytes with a correct checksum
// (fields, the variant and its parameter block still come from the fuzzer's bytes).
// The last byte chooses between a values decode and a predicate decode.
#include "codecs/codec.hpp"

#include "allocator/error.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {
constexpr std::size_t k_max_out = std::size_t{1} << 20;  // decode at most 1 MiB of output
}

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  using namespace gact::codec;
  std::vector<std::uint8_t> in(data, data + size);
  if (size >= 64 && data[0] == 'G') {
    // Keep the fuzzer's field bytes, but make magic, version and checksum right.
    blob_header h;
    std::memcpy(&h, in.data(), sizeof h);
    h.magic = k_magic;
    h.version = k_format_version;
    std::memcpy(in.data(), &h, sizeof h);
    int const ndim = in[8] <= k_max_ndim ? in[8] : 0;
    std::uint32_t const extra = 8u * std::uint32_t(ndim) + hd::params_bytes(in[6], in[12]);
    if (in.size() >= std::size_t(64 + extra)) {
      std::uint32_t const c = hd::header_checksum(in.data(), extra);
      std::memcpy(in.data() + 60, &c, 4);
    }
  }
  // The last byte picks the decode mode: values, or a predicate with fuzzed true/false values.
  decode_params dp;
  if (size >= 9 && (data[size - 1] & 1u) != 0) {
    dp.predicate = true;
    std::memcpy(&dp.true_value, data + size - 9, 4);
    std::memcpy(&dp.false_value, data + size - 5, 4);
  }
  std::unique_ptr<std::uint8_t[]> buf(new std::uint8_t[in.size() == 0 ? 1 : in.size()]);
  if (!in.empty()) std::memcpy(buf.get(), in.data(), in.size());
  try {
    blob_info const info = parse(buf.get(), in.size());
    std::size_t const need = std::size_t(info.numel) * dtype_size(info.dt);
    if (need > k_max_out) return 0;
    std::unique_ptr<std::uint8_t[]> out(new std::uint8_t[need == 0 ? 1 : need]);
    decode_cpu(buf.get(), in.size(), out.get(), need, 1, dp);
  } catch (gact::corrupt_blob const&) {
  } catch (gact::invalid_argument const&) {
    // a valid blob asked for a predicate it does not hold
  }
  return 0;
}
