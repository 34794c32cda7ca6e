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
// After fork() the child has no service thread and shares the parent's pipe, so a
// fork handler gives the child a pipe and a service thread of its own: a signal
// to a child (Pool.terminate(), Process.terminate()) acts in that child only.
#include "allocator/stats_registry.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

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
// g_trigger_mu guards the path and the installation flags; the signal handlers read only
// g_pipe_write and the previous actions (atomic pointers to leaked copies).
std::mutex g_trigger_mu;
bool g_triggers_installed = false;      // atexit, pipe and service thread set up
std::string* g_path = nullptr;          // the configured path (a template); leaked
bool g_path_from_env = false;           // g_path came from GACT_STATS_PATH
int g_pipe_write = -1;                  // written before the handlers are installed (and in a forked child)
int g_pipe_read = -1;                   // the service thread's end
bool g_forked_child = false;            // this process is a fork of the one that installed the triggers
std::atomic<struct sigaction*> g_previous_usr1{nullptr};
std::atomic<struct sigaction*> g_previous_term{nullptr};
std::atomic<std::uint64_t> g_tmp_counter{0};

constexpr char k_byte_usr1 = 1;
constexpr char k_byte_term = 2;

void dump_noexcept(std::string const& path, char const* why) noexcept {
  try {
    dump(path);
  } catch (std::exception const& e) {
    GACT_LOG_ERROR("stats dump ({}) to '{}' failed: {}", why, path, e.what());
  }
}

/// The path the triggers dump to now (placeholders expanded), or "" when dumps are off.
std::string trigger_path() {
  std::lock_guard lock(g_trigger_mu);
  if (g_path == nullptr || g_path->empty()) return {};
  // A process (or a test) that unset the variable it was configured from opted out.
  if (g_path_from_env && std::getenv("GACT_STATS_PATH") == nullptr) return {};
  // A forked child dumps only to a path of its own ({pid} or {proc}), never over its parent's file.
  if (g_forked_child && g_path->find("{pid}") == std::string::npos && g_path->find("{proc}") == std::string::npos)
    return {};
  return expand_path(*g_path);
}

void on_exit_dump() {
  std::string const path = trigger_path();
  if (!path.empty()) dump_noexcept(path, "exit");
}

void chain(struct sigaction const* prev, int sig, siginfo_t* info, void* ctx) {
  if (prev == nullptr) return;
  if ((prev->sa_flags & SA_SIGINFO) != 0) {
    if (prev->sa_sigaction != nullptr) prev->sa_sigaction(sig, info, ctx);
  } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN && prev->sa_handler != nullptr) {
    prev->sa_handler(sig);
  }
}

extern "C" void gact_sigusr1_handler(int sig, siginfo_t* info, void* ctx) {
  int const saved = errno;
  if (g_pipe_write >= 0) {
    [[maybe_unused]] ssize_t const n = ::write(g_pipe_write, &k_byte_usr1, 1);  // full pipe: a dump is pending anyway
  }
  errno = saved;
  chain(g_previous_usr1.load(std::memory_order_acquire), sig, info, ctx);
}

[[noreturn]] void die_of_sigterm() noexcept;

extern "C" void gact_sigterm_handler(int, siginfo_t*, void*) {
  int const saved = errno;
  if (g_pipe_write < 0) die_of_sigterm();  // no service thread to dump (a child that could not start one)
  [[maybe_unused]] ssize_t const n = ::write(g_pipe_write, &k_byte_term, 1);
  errno = saved;
}

/// After the SIGTERM dump: end the process the way SIGTERM would have.
[[noreturn]] void die_of_sigterm() noexcept {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGTERM, &dfl, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(SIGTERM);
  ::_exit(128 + SIGTERM);  // not reached
}

void service_loop(int read_fd) {
  char buf[64];
  for (;;) {
    ssize_t const n = ::read(read_fd, buf, sizeof buf);
    if (n > 0) {
      bool const term = std::memchr(buf, k_byte_term, static_cast<std::size_t>(n)) != nullptr;
      std::string const path = trigger_path();
      if (!path.empty()) dump_noexcept(path, term ? "SIGTERM" : "SIGUSR1");
      if (term) die_of_sigterm();
    } else if (n == 0 || (n < 0 && errno != EINTR)) {
      return;
    }
  }
}

/// Start a service thread on a new pipe; false (and no pipe) when either cannot be made.
/// Requires g_trigger_mu (or a single-threaded forked child).
bool start_service() noexcept {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return false;
  // The write end must never block inside the handler.
  ::fcntl(fds[1], F_SETFL, ::fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  try {
    std::thread(service_loop, fds[0]).detach();
  } catch (...) {
    ::close(fds[0]);
    ::close(fds[1]);
    return false;
  }
  g_pipe_read = fds[0];
  g_pipe_write = fds[1];
  return true;
}

// fork(): the trigger lock is held across it (so the child never inherits it locked), and the
// child, whose only thread is the one that forked, gets a pipe and a service thread of its own.
void before_fork() noexcept { g_trigger_mu.lock(); }
void after_fork_parent() noexcept { g_trigger_mu.unlock(); }
void after_fork_child() noexcept {
  g_forked_child = true;
  if (g_pipe_write >= 0) {
    int const old_read = g_pipe_read, old_write = g_pipe_write;
    g_pipe_write = -1;  // until the child's own pipe exists, its handlers write nowhere
    g_pipe_read = -1;
    ::close(old_read);
    ::close(old_write);
    start_service();  // on failure the child's handlers only chain (SIGTERM: see gact_sigterm_handler)
  }
  g_trigger_mu.unlock();
}

/// Install `handler` for `sig` unless it is there already; the action it replaces is kept in
/// `previous` (for chaining). With `only_over_default`, leave a handler or SIG_IGN someone
/// else installed alone. Requires g_trigger_mu.
void arm(int sig, void (*handler)(int, siginfo_t*, void*), std::atomic<struct sigaction*>& previous,
         bool only_over_default) {
  struct sigaction cur {};
  if (::sigaction(sig, nullptr, &cur) != 0) return;
  bool const ours = (cur.sa_flags & SA_SIGINFO) != 0 && cur.sa_sigaction == handler;
  if (ours) return;
  if (only_over_default && !((cur.sa_flags & SA_SIGINFO) == 0 && cur.sa_handler == SIG_DFL)) return;
  // Never freed (a handler may be reading the one it replaces); kept reachable, one per re-arm.
  static auto* const kept = new std::vector<std::unique_ptr<struct sigaction>>();
  kept->push_back(std::make_unique<struct sigaction>(cur));
  previous.store(kept->back().get(), std::memory_order_release);
  struct sigaction sa {};
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  if (::sigaction(sig, &sa, nullptr) != 0) {
    GACT_LOG_WARN("stats: no dump on signal {} (sigaction: {})", sig, std::strerror(errno));
  }
}

/// Set up the exit dump, the pipe, the service thread and the signal handlers (first call),
/// or re-arm the handlers (later calls: a handler installed since then is chained to).
/// Requires g_trigger_mu.
void install_locked() {
  if (!g_triggers_installed) {
    g_triggers_installed = true;
    if (std::atexit(on_exit_dump) != 0) GACT_LOG_WARN("stats: cannot register the exit dump");
    if (!start_service()) {
      GACT_LOG_WARN("stats: no dump on SIGUSR1 or SIGTERM (no pipe or service thread: {})", std::strerror(errno));
      return;
    }
    if (::pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0)
      GACT_LOG_WARN("stats: cannot register the fork handlers; a forked child's signals may reach this process");
  }
  if (g_pipe_write < 0) return;
  arm(SIGUSR1, gact_sigusr1_handler, g_previous_usr1, false);
  arm(SIGTERM, gact_sigterm_handler, g_previous_term, true);
}

bool starts_with(std::string const& s, char const* prefix) { return s.rfind(prefix, 0) == 0; }

std::string errno_text(int err) { return std::strerror(err); }

/// Write all of `text` to `fd`. @returns 0 or an errno value.
int write_all(int fd, std::string const& text) {
  char const* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    ssize_t const n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
  return 0;
}

/// Write `text` into an existing special file (FIFO, terminal, /dev/stdout, ...) or through a
/// link that must stay what it is: opened for writing (appending, so that a redirected stdout
/// keeps what was written before), never replaced. A FIFO without a reader fails at once.
void write_in_place(std::string const& path, std::string const& text, bool create) {
  int const flags = O_WRONLY | O_CLOEXEC | O_NONBLOCK | (create ? O_CREAT | O_TRUNC : O_APPEND);
  int const fd = ::open(path.c_str(), flags, 0666);
  if (fd < 0) {
    int const err = errno;
    GACT_FAIL("stats::dump: cannot open '" + path + "' for writing: " + errno_text(err) +
                  (err == ENXIO ? " (a FIFO with no reader)" : ""),
              ::gact::error);
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int const err = write_all(fd, text);
  ::close(fd);
  if (err != 0) GACT_FAIL("stats::dump: cannot write '" + path + "': " + errno_text(err), ::gact::error);
}

/// Replace the regular file (or create the file) `path` atomically: temp file + rename.
void write_atomically(std::string const& path, std::string const& text) {
  std::string const tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(g_tmp_counter.fetch_add(1, std::memory_order_relaxed));
  int const fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) GACT_FAIL("stats::dump: cannot create '" + tmp + "': " + errno_text(errno), ::gact::error);
  int err = write_all(fd, text);
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    GACT_FAIL("stats::dump: cannot write '" + tmp + "': " + errno_text(err), ::gact::error);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    GACT_FAIL("stats::dump: cannot rename '" + tmp + "' to '" + path + "': " + errno_text(err), ::gact::error);
  }
}

/// How a dump reaches `path`.
enum class write_mode { atomic, in_place, in_place_create };
struct target {
  write_mode mode;
  std::string path;  ///< where to write: `path` itself, or a link's resolved regular file
};

/// Decide how to write `path`: a regular file or a new path is replaced atomically; a
/// symbolic link to a regular file keeps the link and replaces its target atomically; a
/// FIFO, a terminal, /dev/stdout, /proc/self/fd/N and the like are written in place.
/// @throws gact::error naming the path when it is a directory or cannot be examined.
target resolve_target(std::string const& path) {
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) != 0) {
    int const err = errno;
    if (err == ENOENT) return {write_mode::atomic, path};
    GACT_FAIL("stats::dump: cannot examine '" + path + "': " + errno_text(err), ::gact::error);
  }
  if (S_ISREG(lst.st_mode)) return {write_mode::atomic, path};
  if (S_ISDIR(lst.st_mode)) GACT_FAIL("stats::dump: '" + path + "' is a directory", ::gact::error);
  if (!S_ISLNK(lst.st_mode)) return {write_mode::in_place, path};
  // A link. /proc/<pid>/fd/N and /dev/std* stand for open files (a pipe, a redirected
  // stdout): replacing what they resolve to would lose what the process already wrote.
  if (starts_with(path, "/proc/") || starts_with(path, "/dev/")) return {write_mode::in_place, path};
  char* real = ::realpath(path.c_str(), nullptr);
  if (real == nullptr) return {write_mode::in_place_create, path};  // dangling: create the target
  std::string const resolved(real);
  std::free(real);
  struct stat st {};
  if (::stat(resolved.c_str(), &st) != 0) return {write_mode::in_place_create, path};
  if (S_ISDIR(st.st_mode)) GACT_FAIL("stats::dump: '" + path + "' is a directory", ::gact::error);
  if (S_ISREG(st.st_mode) && !starts_with(resolved, "/proc/")) return {write_mode::atomic, resolved};
  return {write_mode::in_place, path};
}

std::string parent_dir(std::string const& path) {
  std::size_t const slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

/// Check that a dump to `path` can succeed, as far as that can be known before writing.
/// @throws gact::invalid_argument "<label>: ..." naming what is wrong.
void check_writable(std::string const& path, std::string_view label) {
  auto const fail = [&](std::string const& why) {
    throw ::gact::invalid_argument(std::string(label) + ": '" + path + "' " + why);
  };
  target t{write_mode::atomic, path};
  try {
    t = resolve_target(path);
  } catch (std::exception const& e) {
    fail(std::string("cannot be written: ") + e.what());
  }
  if (t.mode == write_mode::atomic) {
    std::string const dir = parent_dir(t.path);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) fail("cannot be written: directory '" + dir + "' does not exist");
    if (!S_ISDIR(st.st_mode)) fail("cannot be written: '" + dir + "' is not a directory");
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      fail("cannot be written: no permission to create files in '" + dir + "'");
    }
  } else if (t.mode == write_mode::in_place && ::access(t.path.c_str(), W_OK) != 0) {
    fail("cannot be written: " + errno_text(errno));
  }
}

/// The value of RANK when it is a non-negative integer (torch.distributed's launchers set it).
std::string rank_from_env() {
  char const* r = std::getenv("RANK");
  if (r == nullptr || *r == '\0' || std::strlen(r) > 9) return {};
  for (char const* c = r; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') return {};
  }
  return r;
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

std::string expand_path(std::string const& path_template) {
  std::string const pid = std::to_string(::getpid());
  std::string const rank = rank_from_env();
  std::string out;
  out.reserve(path_template.size() + 16);
  for (std::size_t i = 0; i < path_template.size();) {
    if (path_template.compare(i, 5, "{pid}") == 0) {
      out += pid;
      i += 5;
    } else if (path_template.compare(i, 6, "{proc}") == 0) {
      out += rank.empty() ? "pid" + pid : "rank" + rank;
      i += 6;
    } else {
      out += path_template[i++];
    }
  }
  return out;
}

void check_path(std::string const& path, std::string_view label) {
  if (path.find('\0') != std::string::npos) {
    throw ::gact::invalid_argument(std::string(label) + ": the path holds a NUL byte (at offset " +
                                   std::to_string(path.find('\0')) + ")");
  }
  if (path.empty()) return;
  check_writable(expand_path(path), label);
}

void dump(std::string const& path) {
  GACT_EXPECTS(!path.empty(), "stats::dump: empty path");
  GACT_EXPECTS(path.find('\0') == std::string::npos,
               "stats::dump: the path holds a NUL byte (at offset " + std::to_string(path.find('\0')) + ")");
  target const t = resolve_target(path);
  std::string const text = document().dump(2) + "\n";
  if (t.mode == write_mode::atomic) {
    write_atomically(t.path, text);
  } else {
    write_in_place(t.path, text, t.mode == write_mode::in_place_create);
  }
}

void install_dump_triggers() {
  std::lock_guard<std::mutex> lock(g_trigger_mu);
  if (g_path == nullptr) {
    char const* env = std::getenv("GACT_STATS_PATH");
    if (env == nullptr || *env == '\0') return;  // not now; a later call may find it set
    std::string const path(env);
    check_path(path, "GACT_STATS_PATH");  // not remembered: every later call reports it again
    g_path = new std::string(path);       // leaked: read by the exit handler
    g_path_from_env = true;
  } else if (g_path->empty()) {
    return;
  }
  install_locked();
  GACT_LOG_INFO("stats: dumping to {} at exit, on SIGUSR1 and on SIGTERM (pid {})", expand_path(*g_path), ::getpid());
}

void set_dump_path(std::string const& path) {
  check_path(path, "stats_path");
  std::lock_guard<std::mutex> lock(g_trigger_mu);
  if (g_path == nullptr) {
    g_path = new std::string(path);  // leaked: read by the exit handler
  } else {
    *g_path = path;
  }
  g_path_from_env = false;
  if (!path.empty()) install_locked();
}

std::string dump_path() {
  std::lock_guard<std::mutex> lock(g_trigger_mu);
  if (g_path == nullptr) {
    char const* env = std::getenv("GACT_STATS_PATH");
    return env != nullptr ? std::string(env) : std::string();
  }
  return *g_path;
}

}  // namespace gact::stats
