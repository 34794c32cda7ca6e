// gact/bindings/python/host_allocator_fns.h
//
// The entry points of gact's host arena that `_gact._host_allocator()` hands to `_gact_torch`
// (torch_cpu.cpp) as the capsule "gact.host_allocator": one definition for both modules, which
// share nothing else (_gact never links torch, _gact_torch links nothing of gact's).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gact::bindings {

struct host_allocator_fns {
  std::uint32_t version;  ///< 1
  /// `bytes` from the host arena; nullptr on failure, with the reason written to `why`.
  void* (*alloc)(std::size_t bytes, char* why, std::size_t why_len) noexcept;
  void (*free)(void* p) noexcept;  ///< a pointer alloc returned
};

}  // namespace gact::bindings
