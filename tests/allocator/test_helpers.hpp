// gact/tests/allocator/test_helpers.hpp — small helpers shared by the allocator layer's
// test files: a temporary directory, a file's text and the message of an expected exception.
#pragma once

#include <unistd.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace gact::test {

/// A fresh directory under the system temp dir, removed at scope exit.
struct temp_dir {
  std::filesystem::path path;
  explicit temp_dir(std::string const& prefix = "gact-test-") {
    path = std::filesystem::temp_directory_path() /
           (prefix + std::to_string(::getpid()) + "-" +
            std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::filesystem::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  temp_dir(temp_dir const&) = delete;
  temp_dir& operator=(temp_dir const&) = delete;
};

/// The whole content of the file `p`.
inline std::string read_text(std::filesystem::path const& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// The message of the exception `fn()` throws, or "" when it throws none.
inline std::string error_of(auto&& fn) {
  try {
    fn();
  } catch (std::exception const& e) {
    return e.what();
  }
  return "";
}

}  // namespace gact::test
