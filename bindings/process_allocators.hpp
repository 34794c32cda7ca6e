// gact/bindings/process_allocators.hpp
//
// The CUDA device allocators of a binary that links the C ABI (c_abi.cpp): one
// caching allocator per device ("cuda:<device>" in the stats), created on first
// use, never destroyed (see device_allocators.hpp).
//
// One device allocator per process: the Python module links the C ABI too and
// gives the activation store these same allocators as its device arenas, and
// gact.use_allocator() hands torch the module's own gact_torch_alloc /
// gact_free (the module file is a shared object that exports them). With
// use_allocator() and a Compressor, torch's tensors and the compressed blobs
// therefore share one cache per device. A C or C++ program uses libgact.so,
// which holds its own instance: a process should use one of the two.
#pragma once

#include "bindings/device_allocators.hpp"

namespace gact::bindings {

/// The device allocators behind gact_alloc / gact_torch_alloc / gact_free of this binary.
device_allocators& process_device_allocators();

}  // namespace gact::bindings
