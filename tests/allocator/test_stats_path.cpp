// gact/tests/allocator/test_stats_path.cpp — where stats dumps go (issue 15): a symlink
// stays a link, a FIFO, a pipe behind /proc/self/fd/N or a redirected stdout are written
// in place and never replaced, a path with a NUL byte is rejected, a bad configured path
// is reported at start naming its setting, {pid}/{proc} name one file per process, and
// SIGUSR1 dumps to a path set with set_dump_path(), re-armed over a later handler.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "allocator/error.hpp"
#include "allocator/stats_registry.hpp"
#include "test_helpers.hpp"

namespace fs = std::filesystem;
using gact::test::error_of;

namespace {

struct temp_dir : gact::test::temp_dir {
  temp_dir() : gact::test::temp_dir("gact-test-stats-path-") {}
};

/// Read a non-blocking pipe or FIFO read end until its writer, once it came and wrote,
/// closes: before any writer has opened a FIFO, a read sees end-of-file too, so that is
/// waited out.
std::string drain(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t const n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 && !out.empty()) {
      return out;
    } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return out;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

bool is_document(std::string const& text) {
  auto const j = nlohmann::json::parse(text, nullptr, false);
  return !j.is_discarded() && j.contains("schema_version");
}

/// Poll (bounded) until `p` exists; the service thread writes it soon after a signal.
bool appears(fs::path const& p) {
  for (int i = 0; i < 500; ++i) {
    if (fs::exists(p)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

TEST_SUITE("unit") {

TEST_CASE("dump through a symlink replaces its target and keeps the link") {
  temp_dir d;
  fs::path const target = d.path / "real.json";
  fs::path const link = d.path / "link.json";
  { std::ofstream(target) << "old"; }
  fs::create_symlink(target, link);
  gact::stats::dump(link.string());
  CHECK(fs::is_symlink(link));
  CHECK(is_document(gact::test::read_text(target)));
}

TEST_CASE("dump into a FIFO writes in place; without a reader it fails at once") {
  temp_dir d;
  fs::path const fifo = d.path / "stats.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(gact::stats::dump(fifo.string()), doctest::Contains("a FIFO with no reader"), gact::error);
  int const rd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  REQUIRE(rd >= 0);
  std::string got;
  std::thread reader([&] { got = drain(rd); });
  gact::stats::dump(fifo.string());  // closes its end: the reader sees EOF
  reader.join();
  ::close(rd);
  CHECK(is_document(got));
  struct stat st {};
  REQUIRE(::lstat(fifo.c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));  // still a FIFO, not a regular file put in its place
}

TEST_CASE("dump to /proc/self/fd/N: into the pipe, or appended to the file it stands for") {
  int fds[2];
  REQUIRE(::pipe2(fds, O_NONBLOCK) == 0);  // the write end too: the dump opens its own through /proc
  std::string got;
  std::thread reader([&] { got = drain(fds[0]); });
  gact::stats::dump("/proc/self/fd/" + std::to_string(fds[1]));
  ::close(fds[1]);
  reader.join();
  ::close(fds[0]);
  CHECK(is_document(got));

  temp_dir d;
  fs::path const out = d.path / "stdout.txt";
  int const fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, "before\n", 7) == 7);
  struct stat before {};
  REQUIRE(::stat(out.c_str(), &before) == 0);
  gact::stats::dump("/proc/self/fd/" + std::to_string(fd));
  ::close(fd);
  struct stat after {};
  REQUIRE(::stat(out.c_str(), &after) == 0);
  CHECK(after.st_ino == before.st_ino);  // the same file, not a replacement
  std::string const text = gact::test::read_text(out);
  REQUIRE(text.starts_with("before\n"));
  CHECK(is_document(text.substr(7)));
}

TEST_CASE("a path holding a NUL byte is rejected, never cut at the NUL") {
  temp_dir d;
  std::string const cut = (d.path / "a").string();
  std::string const path = cut + std::string(1, '\0') + "b.json";
  CHECK_THROWS_WITH_AS(gact::stats::dump(path), doctest::Contains("NUL byte"), gact::invalid_argument);
  CHECK_FALSE(fs::exists(cut));
  CHECK_THROWS_WITH_AS(gact::stats::check_path(path, "stats_path"), doctest::Contains("stats_path: the path holds a NUL"),
                       gact::invalid_argument);
}

TEST_CASE("check_path reports a bad configured path naming its setting") {
  temp_dir d;
  std::string const missing = (d.path / "no-such-dir" / "s.json").string();
  CHECK(error_of([&] { gact::stats::check_path(missing, "GACT_STATS_PATH"); }) ==
        "GACT_STATS_PATH: '" + missing + "' cannot be written: directory '" + (d.path / "no-such-dir").string() +
            "' does not exist");
  CHECK_THROWS_WITH_AS(gact::stats::check_path(d.path.string(), "GACT_STATS_PATH"),
                       doctest::Contains("is a directory"), gact::invalid_argument);
  CHECK_NOTHROW(gact::stats::check_path((d.path / "new.json").string(), "GACT_STATS_PATH"));
  CHECK_NOTHROW(gact::stats::check_path("", "GACT_STATS_PATH"));
  CHECK_NOTHROW(gact::stats::check_path("/dev/stdout", "GACT_STATS_PATH"));
}

TEST_CASE("{pid} and {proc} name one file per process") {
  std::string const pid = std::to_string(::getpid());
  ::unsetenv("RANK");
  CHECK(gact::stats::expand_path("/tmp/s.{pid}.json") == "/tmp/s." + pid + ".json");
  CHECK(gact::stats::expand_path("/tmp/s.{proc}.json") == "/tmp/s.pid" + pid + ".json");
  ::setenv("RANK", "3", 1);
  CHECK(gact::stats::expand_path("/tmp/s.{proc}.json") == "/tmp/s.rank3.json");
  ::setenv("RANK", "x1", 1);  // not a rank: the pid names the file
  CHECK(gact::stats::expand_path("{proc}") == "pid" + pid);
  ::unsetenv("RANK");
  CHECK(gact::stats::expand_path("{nothing}") == "{nothing}");
}

}  // TEST_SUITE

TEST_SUITE("threads") {

std::atomic<int> g_user_calls{0};
extern "C" void user_handler(int) { g_user_calls.fetch_add(1); }

TEST_CASE("SIGUSR1 dumps to a path set with set_dump_path; re-arming chains to a later handler") {
  temp_dir d;
  fs::path const file = d.path / "s.{pid}.json";
  fs::path const expanded = d.path / ("s." + std::to_string(::getpid()) + ".json");
  CHECK_THROWS_WITH_AS(gact::stats::set_dump_path((d.path / "missing" / "x.json").string()),
                       doctest::Contains("stats_path: '"), gact::invalid_argument);
  gact::stats::set_dump_path(file.string());
  CHECK(gact::stats::dump_path() == file.string());
  std::raise(SIGUSR1);
  REQUIRE(appears(expanded));
  CHECK(is_document(gact::test::read_text(expanded)));

  // A handler installed after gact's replaces it; install_dump_triggers() puts gact's back
  // on top and chains to it, so both run.
  struct sigaction sa {}, old {};
  sa.sa_handler = user_handler;
  sigemptyset(&sa.sa_mask);
  REQUIRE(::sigaction(SIGUSR1, &sa, &old) == 0);
  gact::stats::install_dump_triggers();
  fs::remove(expanded);
  int const calls = g_user_calls.load();
  std::raise(SIGUSR1);
  REQUIRE(appears(expanded));
  for (int i = 0; i < 500 && g_user_calls.load() == calls; ++i) {  // ThreadSanitizer delivers signals late
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(g_user_calls.load() == calls + 1);
  CHECK(is_document(gact::test::read_text(expanded)));

  gact::stats::set_dump_path("");  // dumps off: nothing at exit into the removed directory
  CHECK(gact::stats::dump_path().empty());
}

}  // TEST_SUITE
