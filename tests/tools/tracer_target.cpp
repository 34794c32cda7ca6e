// gact/tests/tools/tracer_target.cpp
//
// Test of the LD_PRELOAD malloc tracer (tools/bench/malloc_tracer.cpp), run by
// meson test with LD_PRELOAD=libgact_malloc_tracer.so. The program makes a
// known sequence of allocations through every interposed entry point,
// records it, and checks the written trace line by line: sizes, id order,
// frees paired by address, the minimum size, the choice of entry points, that
// blocks made before the start are ignored, and that a multi-threaded
// recording stays consistent (every free names a live id). Exit status 0 when
// every check holds; each failed check prints one line.
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using start_fn = int (*)(std::size_t, unsigned);
using stop_fn = long (*)(char const*, char const*);

int g_failures = 0;

void check(bool ok, std::string const& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++g_failures;
  }
}

/// Keep the compiler from eliding an allocation whose result is otherwise unused.
void* keep(void* p) {
  asm volatile("" : : "r"(p) : "memory");
  return p;
}

std::vector<std::string> read_events(std::string const& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] != '#') out.push_back(line);
  return out;
}

std::string join(std::vector<std::string> const& v) {
  std::string s;
  for (auto const& x : v) s += x + "; ";
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: tracer_target OUTPUT_PREFIX\n");
    return 2;
  }
  std::string const prefix = argv[1];
  auto start = reinterpret_cast<start_fn>(dlsym(RTLD_DEFAULT, "gact_tracer_start"));
  auto stop = reinterpret_cast<stop_fn>(dlsym(RTLD_DEFAULT, "gact_tracer_stop"));
  if (start == nullptr || stop == nullptr) {
    std::fprintf(stderr, "FAILED: gact_tracer_start/stop not found: run with LD_PRELOAD=libgact_malloc_tracer.so\n");
    return 1;
  }

  // 1. Every entry point, the minimum size, a block from before the start.
  void* before = keep(std::malloc(4096));
  check(start(512, 3) == 0, "start");
  void* small = keep(std::malloc(100));  // below the minimum: not recorded
  void* a = keep(std::malloc(1000));     // id 1
  void* b = nullptr;
  check(posix_memalign(&b, 64, 4096) == 0, "posix_memalign");  // id 2
  void* c = keep(std::calloc(10, 100));                          // id 3
  a = keep(std::realloc(a, 50000));                              // f 1, id 4
  void* d = keep(aligned_alloc(64, 2048));                       // id 5
  std::free(before);                                             // made before start: ignored
  std::free(small);
  std::free(b);  // f 2
  std::free(c);  // f 3
  std::free(d);  // f 5
  std::string const path1 = prefix + ".all.trace";
  long const n1 = stop(path1.c_str(), "# test header\n");
  std::free(a);  // after the stop: not recorded
  std::vector<std::string> const want1{"a 1 1000", "a 2 4096", "a 3 1000", "f 1", "a 4 50000",
                                       "a 5 2048", "f 2",      "f 3",      "f 5"};
  std::vector<std::string> const got1 = read_events(path1);
  check(n1 == static_cast<long>(want1.size()), "stop returns the event count: " + std::to_string(n1));
  check(got1 == want1, "all entry points: got " + join(got1));
  {
    std::ifstream in(path1);
    std::string first;
    std::getline(in, first);
    check(first == "# test header", "header line first: " + first);
  }

  // 2. Only the aligned entry points; a new recording starts its ids from 1 again.
  check(start(512, 2) == 0, "start aligned");
  void* p = keep(std::malloc(8192));  // plain: not recorded
  void* q = nullptr;
  check(posix_memalign(&q, 64, 8192) == 0, "posix_memalign 2");  // id 1
  std::free(p);
  std::free(q);  // f 1
  std::string const path2 = prefix + ".aligned.trace";
  stop(path2.c_str(), nullptr);
  std::vector<std::string> const got2 = read_events(path2);
  check(got2 == (std::vector<std::string>{"a 1 8192", "f 1"}), "aligned only: got " + join(got2));
  check(start(512, 0) == -2, "sources 0 is rejected");

  // 3. Threads: addresses are reused across threads; every free must name a live id.
  check(start(512, 3) == 0, "start threads");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      std::vector<void*> held;
      for (int i = 0; i < 5000; ++i) {
        held.push_back(keep(std::malloc(512 + static_cast<std::size_t>((i * 37 + t) % 4000))));
        if (held.size() > 8) {
          std::free(held.front());
          held.erase(held.begin());
        }
      }
      for (void* x : held) std::free(x);
    });
  }
  for (auto& th : threads) th.join();
  std::string const path3 = prefix + ".threads.trace";
  stop(path3.c_str(), nullptr);
  std::map<unsigned long, bool> live;
  std::size_t allocs = 0, frees = 0, bad = 0;
  for (std::string const& line : read_events(path3)) {
    std::istringstream ls(line);
    char kind = 0;
    unsigned long id = 0;
    ls >> kind >> id;
    if (kind == 'a') {
      bad += live.count(id) != 0 ? 1 : 0;
      live[id] = true;
      ++allocs;
    } else {
      bad += live.erase(id) != 1 ? 1 : 0;
      ++frees;
    }
  }
  // The 4 x 5000 allocations are recorded, plus whatever std::thread itself allocated.
  check(allocs >= 20000, "threads: allocations recorded " + std::to_string(allocs));
  check(frees >= 20000, "threads: frees recorded " + std::to_string(frees));
  check(bad == 0, "threads: inconsistent events " + std::to_string(bad));

  if (g_failures == 0) std::printf("tracer: all checks passed\n");
  return g_failures == 0 ? 0 : 1;
}
