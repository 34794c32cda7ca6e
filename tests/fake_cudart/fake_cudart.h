/* gact/tests/fake_cudart/fake_cudart.h
 *
 * Test controls of the fake CUDA runtime (libcudart.so.13 in the build folder
 * of tests/fake_cudart). The fake implements the runtime calls gact uses with
 * host memory and one worker thread per stream; these extra functions let a
 * test observe and steer it. They are plain C so that a C program (or dlsym)
 * can use them too.
 *
 * Environment, read at first use:
 *   FAKE_CUDART_CAPACITY   bytes of "device memory" per device (K/M/G suffixes; default 8G)
 *   FAKE_CUDART_DEVICES    number of devices (default 2)
 *   FAKE_CUDART_DELAY_US   each queued stream operation first sleeps a random 0..N µs (default 0)
 */
#ifndef GACT_TESTS_FAKE_CUDART_H
#define GACT_TESTS_FAKE_CUDART_H

#include <cuda_runtime_api.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/** How many times the runtime function `name` ("cudaMalloc", ...) was called. */
size_t fake_cudart_count(char const* name);
/** Zero every call counter. */
void fake_cudart_reset_counts(void);

/** Put `stream` in (global-mode) capture: cudaStreamIsCapturing reports it, and
 *  synchronizing calls (cudaMalloc, cudaFree, cudaEventQuery, *Synchronize)
 *  fail with cudaErrorStreamCaptureUnsupported while any stream captures. */
cudaError_t fake_cudart_begin_capture(cudaStream_t stream);
/** End the capture started by fake_cudart_begin_capture. */
cudaError_t fake_cudart_end_capture(cudaStream_t stream);

/** Hold `stream`: work queued on it after this call does not start until
 *  fake_cudart_release(stream) (a deterministic "kernel still running"). */
cudaError_t fake_cudart_hold(cudaStream_t stream);
/** Let a held stream go on (one release per hold). */
cudaError_t fake_cudart_release(cudaStream_t stream);

/** Change the device-memory capacity of every device (bytes). */
void fake_cudart_set_capacity(size_t bytes);
/** Bytes currently allocated on `device` by cudaMalloc/cudaMallocAsync (not yet freed). */
size_t fake_cudart_used_bytes(int device);
/** Number of live device allocations on all devices. */
size_t fake_cudart_live_allocations(void);
/** 1 when `p` is the start of a live device allocation, else 0. */
int fake_cudart_is_live(void const* p);

/** Allocate device memory under a symbol the LD_PRELOAD shim does not interpose
 *  (a pointer "from somewhere else" for tests of foreign-pointer handling). */
cudaError_t fake_cudart_malloc_direct(void** p, size_t bytes);

/** The first asynchronous error a stream operation hit (an out-of-bounds or
 *  freed device range: cudaErrorIllegalAddress), and reset it to cudaSuccess. */
cudaError_t fake_cudart_take_async_error(void);

/** 0: cudaGetDriverEntryPointByVersion finds no driver call (a runtime or driver without the virtual memory
 *  calls); 1 (the default): it finds the fake's cuMem* calls. */
void fake_cudart_set_vmm(int on);
/** Bytes of device memory mapped through cuMemMap and not yet unmapped, on all devices. */
size_t fake_cudart_mapped_bytes(void);

#ifdef __cplusplus
}
#endif

#endif /* GACT_TESTS_FAKE_CUDART_H */
