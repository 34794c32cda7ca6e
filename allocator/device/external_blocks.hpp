// gact/allocator/device/external_blocks.hpp
//
// Another allocator's entry points, as external_backend (external_backend.hpp) takes them: a plain
// table with no dependency, so that `_gact_torch` (bindings/python/torch_cpu.cpp), which links torch's
// c10 and nothing of gact's, can hand torch's CUDA caching allocator to `_gact` as a capsule
// ("gact.device_blocks") of this table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gact::device {

struct external_blocks {
  std::uint32_t version = 1;  ///< 1
  /// `bytes` (> 0) on `device`, which is current for the call; nullptr on failure, with the reason in `why`.
  void* (*alloc)(std::size_t bytes, int device, char* why, std::size_t why_len) noexcept = nullptr;
  /// A pointer alloc returned; never fails.
  void (*free)(void* p, int device) noexcept = nullptr;
};

}  // namespace gact::device
