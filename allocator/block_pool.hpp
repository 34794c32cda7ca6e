// gact/allocator/block_pool.hpp
//
// The allocation-free building blocks of the caching allocator's fast path:
//
//   object_pool<T>      slab-allocated records recycled through a free list, so a
//                       split or a new block costs no heap allocation
//   node_pool / pool_allocator<T>
//                       a fixed-slot free list behind std::set's nodes, so inserting
//                       into and erasing from the free-block sets allocates nothing
//                       once the pool is warm
//   ptr_map<V>          a flat open-addressing map from block address to record
//                       (linear probing, backward-shift deletion, no tombstones)
//
// None of these is thread-safe; the allocator uses them under its mutex. Memory
// taken from the heap is kept until the owner is destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "allocator/error.hpp"

namespace gact::alloc::detail {

/// Recycles records of type T. Invariant: every T handed out by make() and not yet given
/// to destroy() lives in one of slabs_; free_ holds only destroyed slots.
template <class T>
class object_pool {
 public:
  object_pool() = default;
  object_pool(object_pool const&) = delete;
  object_pool& operator=(object_pool const&) = delete;
  ~object_pool() = default;  // records are trivially destructible or destroyed by their owner

  template <class... Args>
  T* make(Args&&... args) {
    if (free_ == nullptr) grow();
    slot* s = free_;
    free_ = s->next;
    return ::new (static_cast<void*>(s->storage)) T(std::forward<Args>(args)...);
  }

  void destroy(T* p) noexcept {
    p->~T();
    auto* s = reinterpret_cast<slot*>(p);  // storage is the first member of slot
    s->next = free_;
    free_ = s;
  }

 private:
  union slot {
    slot* next;
    alignas(T) unsigned char storage[sizeof(T)];
  };
  static constexpr std::size_t k_slab = 256;

  void grow() {
    slabs_.push_back(std::make_unique<slot[]>(k_slab));  // (first: a failure leaves the free list as it was)
    slot* slab = slabs_.back().get();
    for (std::size_t i = 0; i < k_slab; ++i) {
      slab[i].next = free_;
      free_ = &slab[i];
    }
  }

  std::vector<std::unique_ptr<slot[]>> slabs_;
  slot* free_ = nullptr;
};

/// Fixed-size slots for node-based containers. Requests that do not fit a slot (or ask for
/// more than one object) go to the global heap.
class node_pool {
 public:
  static constexpr std::size_t k_slot = 64;
  static constexpr std::size_t k_align = alignof(std::max_align_t);

  node_pool() = default;
  node_pool(node_pool const&) = delete;
  node_pool& operator=(node_pool const&) = delete;

  void* allocate(std::size_t bytes, std::size_t align) {
    if (bytes > k_slot || align > k_align) return ::operator new(bytes, std::align_val_t{align});
    if (free_ == nullptr) grow();
    slot* s = free_;
    free_ = s->next;
    --free_count_;
    return s;
  }
  void deallocate(void* p, std::size_t bytes, std::size_t align) noexcept {
    if (bytes > k_slot || align > k_align) {
      ::operator delete(p, std::align_val_t{align});
      return;
    }
    auto* s = static_cast<slot*>(p);
    s->next = free_;
    free_ = s;
    ++free_count_;
  }
  /// Make sure the next `n` single-slot allocations take no memory from the heap (so cannot throw).
  void reserve(std::size_t n) {
    while (free_count_ < n) grow();
  }

 private:
  union slot {
    slot* next;
    alignas(k_align) unsigned char storage[k_slot];
  };
  static constexpr std::size_t k_slab = 256;

  void grow() {
    slabs_.push_back(std::make_unique<slot[]>(k_slab));  // (first: a failure leaves the free list as it was)
    slot* slab = slabs_.back().get();
    for (std::size_t i = 0; i < k_slab; ++i) {
      slab[i].next = free_;
      free_ = &slab[i];
    }
    free_count_ += k_slab;
  }

  std::vector<std::unique_ptr<slot[]>> slabs_;
  slot* free_ = nullptr;
  std::size_t free_count_ = 0;
};

/// A std allocator over a node_pool (which must outlive every container using it).
template <class T>
class pool_allocator {
 public:
  using value_type = T;

  explicit pool_allocator(node_pool& pool) noexcept : pool_(&pool) {}
  template <class U>
  pool_allocator(pool_allocator<U> const& other) noexcept : pool_(other.pool()) {}  // NOLINT: rebind

  T* allocate(std::size_t n) {
    return static_cast<T*>(n == 1 ? pool_->allocate(sizeof(T), alignof(T))
                                  : ::operator new(n * sizeof(T), std::align_val_t{alignof(T)}));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n == 1) {
      pool_->deallocate(p, sizeof(T), alignof(T));
    } else {
      ::operator delete(p, std::align_val_t{alignof(T)});
    }
  }
  node_pool* pool() const noexcept { return pool_; }

  template <class U>
  bool operator==(pool_allocator<U> const& o) const noexcept {
    return pool_ == o.pool();
  }

 private:
  node_pool* pool_;
};

/// Flat map from a non-zero address to a V (a pointer-sized record handle).
/// Invariant: capacity is a power of two; size_ <= capacity / 2; every key sits in the
/// probe run that starts at its home slot, with no empty slot (key 0) in between.
template <class V>
class ptr_map {
 public:
  ptr_map() { rehash(64); }

  /// The value for `key`, or nullptr-like V{} when absent.
  V find(std::uintptr_t key) const noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return slots_[i].value;
      if (slots_[i].key == 0) return V{};
    }
  }

  /// Insert a key that is not present.
  void insert(std::uintptr_t key, V value) {
    GACT_ASSERT_INTERNAL(key != 0);
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
    std::size_t i = home(key);
    while (slots_[i].key != 0) {
      GACT_ASSERT_EXPENSIVE(slots_[i].key != key);
      i = (i + 1) & mask_;
    }
    slots_[i] = {key, value};
    ++size_;
  }

  /// Remove `key`; returns false when it was absent.
  bool erase(std::uintptr_t key) noexcept {
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == 0) return false;
    }
    // Backward-shift: pull later members of the run into the hole when their home allows it.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      std::size_t const h = home(slots_[j].key);
      // j may move to hole iff h is not in the cyclic interval (hole, j].
      bool const stays = (hole <= j) ? (hole < h && h <= j) : (hole < h || h <= j);
      if (!stays) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = {};
    --size_;
    return true;
  }

  std::size_t size() const noexcept { return size_; }

  /// Make sure the next insert cannot throw (no rehash in it): a rehash now where it would need one.
  void reserve_one() {
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
  }

  template <class F>
  void for_each(F&& f) const {
    for (auto const& s : slots_) {
      if (s.key != 0) f(s.key, s.value);
    }
  }

 private:
  struct slot {
    std::uintptr_t key = 0;
    V value{};
  };

  std::size_t home(std::uintptr_t key) const noexcept {
    // Blocks are 512-byte aligned: drop those bits, then a Fibonacci hash.
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void rehash(std::size_t capacity) {
    std::vector<slot> fresh(capacity);  // (first: a failure leaves the map as it was)
    std::vector<slot> old = std::exchange(slots_, std::move(fresh));
    mask_ = capacity - 1;
    shift_ = 64;
    for (std::size_t c = capacity; c > 1; c >>= 1) --shift_;
    size_ = 0;
    for (auto const& s : old) {
      if (s.key != 0) insert(s.key, s.value);
    }
  }

  std::vector<slot> slots_;
  std::size_t mask_ = 0;
  unsigned shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace gact::alloc::detail
