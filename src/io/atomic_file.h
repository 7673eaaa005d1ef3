// Atomic file replacement: the bytes go to a temporary file in the destination's directory, which
// commit() fsyncs and renames over the destination (then fsyncs the directory). Until commit()
// returns, the destination keeps its previous content; a writer destroyed without commit() (an
// exception, a failed write) removes its temporary file. A process killed mid-write leaves only a
// stale hidden temporary file `.<name>.tmp.<pid>.<n>` beside the destination, never a partial
// destination.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace fourbit::io {

struct AtomicWriteOptions {
  // Called after every write() with the number of bytes written so far. Tests use it to simulate
  // a crash part-way through a file (throw, or _exit in a child process).
  std::function<void(int64_t bytes_written)> after_write;
};

class AtomicFile {
 public:
  explicit AtomicFile(std::string path, AtomicWriteOptions options = {});
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, int64_t bytes);
  void write(std::string_view text) { write(text.data(), (int64_t)text.size()); }
  // fsync, close, rename over the destination, fsync the directory.
  void commit();

  int64_t bytes_written() const { return bytes_written_; }
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  std::string path_;
  std::string temp_path_;
  AtomicWriteOptions options_;
  int fd_ = -1;
  int64_t bytes_written_ = 0;
  bool committed_ = false;
};

// Writes `bytes` to `path` atomically (an AtomicFile written once and committed).
void write_file_atomically(const std::string& path, std::string_view bytes,
                           const AtomicWriteOptions& options = {});

}  // namespace fourbit::io
