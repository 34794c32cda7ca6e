// gact/allocator/stats_registry.cpp — the stats document, atomic dumps, and the
// dump triggers (at exit and on SIGUSR1 when GACT_STATS_PATH is set).
//
// Providers live in a map guarded by a shared_mutex: document() holds it shared
// while it calls them, unregister_provider() takes it exclusively, so a provider
// is never called after its owner unregistered it.
//
// SIGUSR1: the handler writes one byte to a self-pipe (async-signal-safe) and
// chains to a handler installed before ours; a service thread blocked on the
// pipe builds and writes the document. No JSON and no allocation in the handler.
#include "allocator/stats_registry.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "allocator/error.hpp"
#include "allocator/log.hpp"
#include "allocator/tags.hpp"

#ifndef GACT_VERSION
#define GACT_VERSION "unknown"
#endif

namespace gact::stats {
namespace {

struct entry {
  std::string name;
  provider fn;
};

/// Invariant: names are unique among entries (register_provider replaces a same-name entry).
struct registry {
  std::shared_mutex mu;
  std::map<std::uint64_t, entry> entries;  // by token, i.e. registration order
  std::uint64_t next_token = 1;

  bool taken(std::string const& name) const {
    for (auto const& [tok, e] : entries) {
      if (e.name == name) return true;
    }
    return false;
  }
  void erase_name(std::string const& name) {
    for (auto it = entries.begin(); it != entries.end(); ++it) {
      if (it->second.name == name) {
        entries.erase(it);
        return;
      }
    }
  }
};

registry& reg() {
  static registry* const r = new registry();  // leaked: the exit dump runs after static destructors may
  return *r;
}

constexpr std::string_view k_allocators_prefix = "allocators/";

// ---- dump triggers ----------------------------------------------------------
std::mutex g_trigger_mu;
bool g_triggers_installed = false;  // guarded by g_trigger_mu
std::string* g_trigger_path = nullptr;  // set once under g_trigger_mu, then read-only
int g_pipe_write = -1;                  // written once before the handler is installed
struct sigaction g_previous_action {};
std::atomic<std::uint64_t> g_tmp_counter{0};

void dump_noexcept(std::string const& path, char const* why) noexcept {
  try {
    dump(path);
  } catch (std::exception const& e) {
    GACT_LOG_ERROR("stats dump ({}) failed: {}", why, e.what());
  }
}

void on_exit_dump() {
  // Only when the variable is still set: a process (or a test) that unset it opted out.
  if (std::getenv("GACT_STATS_PATH") == nullptr || g_trigger_path == nullptr) return;
  dump_noexcept(*g_trigger_path, "exit");
}

extern "C" void gact_sigusr1_handler(int sig, siginfo_t* info, void* ctx) {
  int const saved = errno;
  char const byte = 1;
  if (g_pipe_write >= 0) {
    [[maybe_unused]] ssize_t const n = ::write(g_pipe_write, &byte, 1);  // full pipe: a dump is pending anyway
  }
  errno = saved;
  if ((g_previous_action.sa_flags & SA_SIGINFO) != 0) {
    if (g_previous_action.sa_sigaction != nullptr) g_previous_action.sa_sigaction(sig, info, ctx);
  } else if (g_previous_action.sa_handler != SIG_DFL && g_previous_action.sa_handler != SIG_IGN &&
             g_previous_action.sa_handler != nullptr) {
    g_previous_action.sa_handler(sig);
  }
}

void service_loop(int read_fd, std::string path) {
  char buf[64];
  for (;;) {
    ssize_t const n = ::read(read_fd, buf, sizeof buf);
    if (n > 0) {
      dump_noexcept(path, "SIGUSR1");
    } else if (n == 0 || (n < 0 && errno != EINTR)) {
      return;
    }
  }
}

}  // namespace

std::uint64_t register_provider(std::string const& name, provider fn) {
  GACT_EXPECTS(!name.empty(), "stats::register_provider: empty name");
  GACT_EXPECTS(static_cast<bool>(fn), "stats::register_provider: empty provider for '" + name + "'");
  registry& r = reg();
  std::unique_lock lock(r.mu);
  r.erase_name(name);
  std::uint64_t const tok = r.next_token++;
  r.entries.emplace(tok, entry{name, std::move(fn)});
  return tok;
}

std::pair<std::uint64_t, std::string> register_unique_provider(std::string const& name, provider fn) {
  GACT_EXPECTS(!name.empty(), "stats::register_unique_provider: empty name");
  GACT_EXPECTS(static_cast<bool>(fn), "stats::register_unique_provider: empty provider for '" + name + "'");
  registry& r = reg();
  std::unique_lock lock(r.mu);
  std::string used = name;
  for (int i = 2; r.taken(used); ++i) used = name + "#" + std::to_string(i);
  std::uint64_t const tok = r.next_token++;
  r.entries.emplace(tok, entry{used, std::move(fn)});
  return {tok, used};
}

void unregister_provider(std::uint64_t token) noexcept {
  registry& r = reg();
  std::unique_lock lock(r.mu);
  r.entries.erase(token);
}

nlohmann::json document() {
  nlohmann::json doc = nlohmann::json::object();
  doc["schema_version"] = k_schema_version;
  doc["gact_version"] = GACT_VERSION;
  doc["pid"] = static_cast<std::int64_t>(::getpid());
  doc["time_unix_ms"] = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
  doc["allocators"] = nlohmann::json::object();
  doc["tags"] = {{"names", alloc::tag_names()},
                 {"underflows", alloc::tag_underflows()},
                 {"overflows", alloc::tag_overflows()}};
  registry& r = reg();
  std::shared_lock lock(r.mu);
  for (auto const& [tok, e] : r.entries) {
    nlohmann::json section;
    try {
      section = e.fn();
    } catch (std::exception const& ex) {
      section = {{"error", ex.what()}};
    }
    if (e.name.starts_with(k_allocators_prefix)) {
      doc["allocators"][e.name.substr(k_allocators_prefix.size())] = std::move(section);
    } else {
      doc[e.name] = std::move(section);
    }
  }
  return doc;
}

void dump(std::string const& path) {
  GACT_EXPECTS(!path.empty(), "stats::dump: empty path");
  std::string const text = document().dump(2) + "\n";
  std::string const tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(g_tmp_counter.fetch_add(1, std::memory_order_relaxed));
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) {
      GACT_FAIL("stats::dump: cannot create '" + tmp + "': " + std::strerror(errno), ::gact::error);
    }
    bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    ok = (std::fflush(f) == 0) && ok;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
      int const err = errno;
      std::remove(tmp.c_str());
      GACT_FAIL("stats::dump: cannot write '" + tmp + "': " + std::strerror(err), ::gact::error);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int const err = errno;
    std::remove(tmp.c_str());
    GACT_FAIL("stats::dump: cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(err),
              ::gact::error);
  }
}

void install_dump_triggers() {
  std::lock_guard<std::mutex> lock(g_trigger_mu);
  if (g_triggers_installed) return;
  char const* env = std::getenv("GACT_STATS_PATH");
  if (env == nullptr || *env == '\0') return;  // not now; a later call may find it set
  g_trigger_path = new std::string(env);       // leaked: read by the exit handler
  g_triggers_installed = true;
  if (std::atexit(on_exit_dump) != 0) GACT_LOG_WARN("stats: cannot register the exit dump");

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    GACT_LOG_WARN("stats: no SIGUSR1 dump (pipe: {})", std::strerror(errno));
    return;
  }
  // The write end must never block inside the handler.
  ::fcntl(fds[1], F_SETFL, ::fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  g_pipe_write = fds[1];
  std::thread(service_loop, fds[0], *g_trigger_path).detach();

  struct sigaction sa {};
  sa.sa_sigaction = gact_sigusr1_handler;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  if (::sigaction(SIGUSR1, &sa, &g_previous_action) != 0) {
    GACT_LOG_WARN("stats: no SIGUSR1 dump (sigaction: {})", std::strerror(errno));
    return;
  }
  GACT_LOG_INFO("stats: dumping to {} at exit and on SIGUSR1 (pid {})", *g_trigger_path, ::getpid());
}

}  // namespace gact::stats
