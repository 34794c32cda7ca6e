// gact/tools/bench/malloc_tracer.cpp
//
// libgact_malloc_tracer.so: an LD_PRELOAD library that records the heap
// allocations of a process between two calls, to turn a real workload (a
// PyTorch CPU training step) into an allocation trace that gact-bench-alloc
// replays. PyTorch 1.13's profiler reports CPU allocation sizes but not
// addresses, so frees cannot be paired with allocations from it; interposing
// malloc pairs them exactly by address.
//
// Interposed: malloc, calloc, realloc, free, posix_memalign, aligned_alloc,
// memalign, valloc. Each forwards to glibc's own entry points (__libc_malloc,
// ...), so no dlsym bootstrap is needed. While recording is on (between
// gact_tracer_start and gact_tracer_stop), every block of at least `min_bytes`
// made through the selected entry points (plain malloc/calloc/realloc, the
// aligned ones, or both: PyTorch's CPU tensor storage comes from
// posix_memalign) gets a sequential id and an "a <id> <bytes>" event; freeing a recorded block
// gives "f <id>". Blocks made before start, or smaller than min_bytes, are not
// recorded and their frees are ignored. realloc of a recorded block is a free
// of the old id and an allocation of a new one (a failed realloc, which leaves
// the old block live, is still recorded as its free: the one inexact case).
//
// Nothing here calls malloc while recording: the address table and the event
// log live in anonymous mmap memory, and one spin lock guards both (the real
// allocator runs outside it). A free is recorded before the memory goes back
// to glibc, and an allocation after glibc returned it, so an address reused by
// another thread is never seen live twice.
//
// Invariants: table_ holds exactly the recorded blocks not yet freed
// (address -> id); ids are 1, 2, 3, ... in allocation order; the log is in the
// order the lock was taken.
#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>

extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void __libc_free(void*);
void* __libc_memalign(std::size_t, std::size_t);
}

namespace {

constexpr std::size_t k_table_slots = std::size_t{1} << 22;   // power of two; live recorded blocks << this
constexpr std::size_t k_max_events = std::size_t{1} << 23;

struct slot {
  std::uintptr_t key;  // 0 = empty
  std::uint64_t id;
};

struct event {
  std::uint64_t id;     // high bit set = free
  std::uint64_t bytes;  // 0 for a free
};
constexpr std::uint64_t k_free_bit = std::uint64_t{1} << 63;

std::atomic<bool> g_on{false};
std::atomic_flag g_lock = ATOMIC_FLAG_INIT;
slot* g_table = nullptr;
event* g_log = nullptr;
std::size_t g_events = 0;
std::uint64_t g_next_id = 1;
std::size_t g_min_bytes = 512;
unsigned g_sources = 3;  // gact_tracer_source_* bits recorded
bool g_overflow = false;

struct lock_guard {
  lock_guard() noexcept {
    while (g_lock.test_and_set(std::memory_order_acquire)) {
    }
  }
  ~lock_guard() { g_lock.clear(std::memory_order_release); }
  lock_guard(lock_guard const&) = delete;
  lock_guard& operator=(lock_guard const&) = delete;
};

std::size_t hash_of(std::uintptr_t k) noexcept {
  std::uint64_t x = k;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return static_cast<std::size_t>(x) & (k_table_slots - 1);
}

void* map_zeroed(std::size_t bytes) noexcept {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void append(std::uint64_t id, std::uint64_t bytes) noexcept {
  if (g_events == k_max_events) {
    g_overflow = true;
    g_on.store(false, std::memory_order_relaxed);
    return;
  }
  g_log[g_events++] = event{id, bytes};
}

// Caller holds the lock.
void record_alloc(void* p, std::size_t bytes) noexcept {
  auto const k = reinterpret_cast<std::uintptr_t>(p);
  std::size_t i = hash_of(k);
  while (g_table[i].key != 0 && g_table[i].key != k) i = (i + 1) & (k_table_slots - 1);
  std::uint64_t const id = g_next_id++;
  g_table[i] = slot{k, id};
  append(id, bytes);
}

// Caller holds the lock. Linear probing with backward-shift deletion (no tombstones).
void record_free(void* p) noexcept {
  auto const k = reinterpret_cast<std::uintptr_t>(p);
  std::size_t i = hash_of(k);
  while (g_table[i].key != k) {
    if (g_table[i].key == 0) return;  // not recorded
    i = (i + 1) & (k_table_slots - 1);
  }
  append(g_table[i].id | k_free_bit, 0);
  std::size_t hole = i;
  for (std::size_t j = (i + 1) & (k_table_slots - 1); g_table[j].key != 0; j = (j + 1) & (k_table_slots - 1)) {
    std::size_t const home = hash_of(g_table[j].key);
    // move j into the hole when its home is not cyclically within (hole, j]
    bool const stays = (hole <= j) ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!stays) {
      g_table[hole] = g_table[j];
      hole = j;
    }
  }
  g_table[hole] = slot{0, 0};
}

/// Which entry point made a block (bits of gact_tracer_start's `sources`).
enum source : unsigned { source_plain = 1, source_aligned = 2 };

void on_alloc(void* p, std::size_t bytes, source src) noexcept {
  if (p == nullptr || bytes < g_min_bytes || (g_sources & src) == 0 || !g_on.load(std::memory_order_relaxed)) return;
  lock_guard g;
  if (g_on.load(std::memory_order_relaxed)) record_alloc(p, bytes);
}

void on_free(void* p) noexcept {
  if (p == nullptr || !g_on.load(std::memory_order_relaxed)) return;
  lock_guard g;
  if (g_on.load(std::memory_order_relaxed)) record_free(p);
}

}  // namespace

extern "C" {

/// Begin recording blocks of at least `min_bytes` (earlier recordings are discarded) made
/// through the entry points in `sources`: bit 0 malloc/calloc/realloc, bit 1
/// posix_memalign/memalign/aligned_alloc/valloc (PyTorch's CPU tensor storage comes from
/// posix_memalign). Frees are recorded for every recorded block.
/// @returns 0; -1 when the tracer's memory could not be mapped; -2 for sources == 0.
__attribute__((visibility("default"))) int gact_tracer_start(std::size_t min_bytes, unsigned sources) {
  if ((sources & 3u) == 0) return -2;
  lock_guard g;
  if (g_table == nullptr) {
    g_table = static_cast<slot*>(map_zeroed(k_table_slots * sizeof(slot)));
    g_log = static_cast<event*>(map_zeroed(k_max_events * sizeof(event)));
    if (g_table == nullptr || g_log == nullptr) return -1;
  } else {
    std::memset(g_table, 0, k_table_slots * sizeof(slot));
  }
  g_events = 0;
  g_next_id = 1;
  g_overflow = false;
  g_min_bytes = min_bytes;
  g_sources = sources & 3u;
  g_on.store(true, std::memory_order_release);
  return 0;
}

/// Stop recording and write the events to `path`, after the '#'-prefixed `header` lines
/// (may be null). Line format: "a <id> <bytes>" and "f <id>".
/// @returns the number of events written; -1 on an I/O error (errno set); -2 when the
///          event log overflowed (the recording is incomplete and nothing is written).
__attribute__((visibility("default"))) long gact_tracer_stop(char const* path, char const* header) {
  {
    lock_guard g;
    g_on.store(false, std::memory_order_release);
  }
  if (g_overflow) return -2;
  std::FILE* f = std::fopen(path, "w");
  if (f == nullptr) return -1;
  if (header != nullptr) std::fputs(header, f);
  for (std::size_t i = 0; i < g_events; ++i) {
    event const& e = g_log[i];
    if ((e.id & k_free_bit) != 0) {
      std::fprintf(f, "f %llu\n", static_cast<unsigned long long>(e.id & ~k_free_bit));
    } else {
      std::fprintf(f, "a %llu %llu\n", static_cast<unsigned long long>(e.id),
                   static_cast<unsigned long long>(e.bytes));
    }
  }
  bool const ok = std::ferror(f) == 0;
  if (std::fclose(f) != 0 || !ok) return -1;
  return static_cast<long>(g_events);
}

/// Number of recorded blocks still live (allocated during the recording, not freed).
__attribute__((visibility("default"))) std::size_t gact_tracer_live() {
  lock_guard g;
  if (g_table == nullptr) return 0;
  std::size_t n = 0;
  for (std::size_t i = 0; i < k_table_slots; ++i) n += g_table[i].key != 0 ? 1 : 0;
  return n;
}

void* malloc(std::size_t bytes) {
  void* p = __libc_malloc(bytes);
  on_alloc(p, bytes, source_plain);
  return p;
}

void* calloc(std::size_t n, std::size_t size) {
  void* p = __libc_calloc(n, size);
  on_alloc(p, n * size, source_plain);  // no overflow: calloc returned non-null only when n*size fits
  return p;
}

void free(void* p) {
  on_free(p);
  __libc_free(p);
}

void* realloc(void* p, std::size_t bytes) {
  if (p == nullptr) return malloc(bytes);
  if (bytes == 0) {
    free(p);
    return nullptr;
  }
  on_free(p);
  void* q = __libc_realloc(p, bytes);
  on_alloc(q, bytes, source_plain);
  return q;
}

void* memalign(std::size_t align, std::size_t bytes) {
  void* p = __libc_memalign(align, bytes);
  on_alloc(p, bytes, source_aligned);
  return p;
}

void* aligned_alloc(std::size_t align, std::size_t bytes) { return memalign(align, bytes); }

void* valloc(std::size_t bytes) { return memalign(static_cast<std::size_t>(sysconf(_SC_PAGESIZE)), bytes); }

int posix_memalign(void** out, std::size_t align, std::size_t bytes) {
  if (align < sizeof(void*) || (align & (align - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(align, bytes);
  if (p == nullptr && bytes != 0) return ENOMEM;
  *out = p;
  on_alloc(p, bytes, source_aligned);
  return 0;
}

}  // extern "C"
