// Helpers of the io tests: a scratch folder per test, file bytes, error-message matching.
#pragma once

#include "core/error.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace fourbit::io::test {

// A fresh folder under the system temp folder, removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "fourbit_io_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }
  // Names of the entries of the folder, sorted.
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const void* data, size_t n) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), (std::streamsize)n);
}
inline void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  write_bytes(path, bytes.data(), bytes.size());
}
inline void write_text(const std::string& path, const std::string& text) {
  write_bytes(path, text.data(), text.size());
}

// The message of the fourbit::Error that `f` throws ("" and a test failure if it throws nothing).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const fourbit::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a fourbit::Error";
  return "";
}

}  // namespace fourbit::io::test

// Asserts that `statement` throws a fourbit::Error whose message contains every given substring.
#define EXPECT_ERROR_CONTAINS(statement, ...)                                               \
  do {                                                                                      \
    const std::string fourbit_msg_ = ::fourbit::io::test::error_of([&] { statement; });     \
    for (const std::string& fourbit_part_ : std::vector<std::string>{__VA_ARGS__}) {        \
      EXPECT_NE(fourbit_msg_.find(fourbit_part_), std::string::npos)                        \
          << "message: " << fourbit_msg_ << "\nmissing: " << fourbit_part_;                 \
    }                                                                                       \
  } while (0)
