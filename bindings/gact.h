/* gact/bindings/gact.h
 *
 * The C ABI of libgact.so (and of the Python module _gact, which exports the same
 * functions over the allocators its activation store uses): gact's caching
 * allocator as PyTorch's pluggable CUDA allocator, plus allocation tags and
 * statistics. Every function except gact_torch_alloc catches every failure: an
 * allocation that cannot be served returns NULL after one (rate-limited) log line;
 * nothing throws or aborts across this boundary.
 *
 * With PyTorch (before any CUDA tensor exists; gact.use_allocator() does this):
 *   a = torch.cuda.memory.CUDAPluggableAllocator(path, "gact_torch_alloc", "gact_free")
 *   a.allocator().set_record_stream_fn(<address of gact_record_stream>)
 *   a.allocator().set_reset_fn(<gact_empty_cache>)                   # torch.cuda.empty_cache()
 *   a.allocator().set_memory_fraction_fn(<gact_set_memory_fraction>) # set_per_process_memory_fraction
 *   torch.cuda.memory.change_current_allocator(a)
 * torch calls its init hook with the device count, not a device: gact_init is not one.
 */
#ifndef GACT_BINDINGS_GACT_H
#define GACT_BINDINGS_GACT_H

#include <cuda_runtime_api.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Allocate `size` bytes on `device` for use on `stream` (PyTorch's alloc signature).
 *  Returns NULL for size <= 0, a bad device, or when memory is exhausted (after the
 *  cache was released and the request retried). The calling thread's current tag is recorded. */
void* gact_alloc(ssize_t size, int device, cudaStream_t stream);
/** PyTorch's alloc function: as gact_alloc, but a request that cannot be served throws a C++
 *  exception (derived from std::exception) instead of returning NULL, because torch's pluggable
 *  allocator does not check the pointer. Its text starts "CUDA out of memory. Tried to allocate"
 *  when memory is exhausted: torch raises it as a RuntimeError, or as torch.OutOfMemoryError once
 *  a thrower of torch's own error is set (gact_set_oom_thrower). Returns NULL only for size <= 0.
 *  For C++ callers that catch exceptions; C code uses gact_alloc. */
void* gact_torch_alloc(ssize_t size, int device, cudaStream_t stream);
/** What gact_torch_alloc calls when memory is exhausted, with its message, the request's size and
 *  the device: a function that throws (never returns normally), such as one raising c10's
 *  OutOfMemoryError, which torch turns into torch.OutOfMemoryError and which cuDNN's workspace
 *  fallback and users' retry loops catch. */
typedef void (*gact_oom_thrower)(char const* message, size_t bytes, int device);
/** Set (NULL: clear) the thrower of gact_torch_alloc; returns the one it replaces. gact.use_allocator()
 *  sets the one of the `_gact_torch` module, built against the c10 of the torch it runs with. */
gact_oom_thrower gact_set_oom_thrower(gact_oom_thrower thrower);
/** Free a pointer from gact_alloc (PyTorch's free signature; `size` and `stream` are those
 *  of the allocation and are not needed). NULL is ignored; a foreign pointer is logged and counted. */
void gact_free(void* ptr, ssize_t size, int device, cudaStream_t stream);
/** Mark `ptr` as used on `stream` too: its memory is not reused before the work queued on
 *  `stream` at free time has completed. Unknown pointers are logged. */
void gact_record_stream(void* ptr, cudaStream_t stream);
/** Release every cached free segment of every device to the runtime. */
void gact_empty_cache(void);
/** Peaks := current values in every device allocator's statistics (torch's
 *  reset_peak_memory_stats, which a pluggable allocator does not serve). */
void gact_reset_peak_stats(void);
/** Create the allocator of `device` now (otherwise done on its first allocation) and arm the
 *  stats dump triggers (GACT_STATS_PATH). */
void gact_init(int device);
/** Cap `device` at `fraction` (0 < fraction <= 1) of its memory, from its next segment on (a
 *  lower GACT_MEMORY_LIMIT still applies); a bad fraction or device is logged and ignored. */
void gact_set_memory_fraction(double fraction, int device);
/** Push the tag `name` on the calling thread's stack; returns its id, or -1 on a bad name. */
int gact_push_tag(char const* name);
/** Pop the calling thread's top tag (an empty stack is counted, never an error). */
void gact_pop_tag(void);
/** The stats document as JSON text (free it with gact_free_string), or NULL on failure. */
char* gact_stats_json(void);
/** Free a string returned by gact_stats_json. */
void gact_free_string(char* s);
/** Write the stats document to `path` (NULL or "": GACT_STATS_PATH). Returns 0, or -1 on failure. */
int gact_dump_stats(char const* path);

#ifdef __cplusplus
}
#endif

#endif /* GACT_BINDINGS_GACT_H */
