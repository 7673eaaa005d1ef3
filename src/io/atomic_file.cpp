// AtomicFile: temporary file + fsync + rename + directory fsync (POSIX).
#include "io/atomic_file.h"

#include "core/check.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace fourbit::io {

namespace {

std::string parent_dir(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

AtomicFile::AtomicFile(std::string path, AtomicWriteOptions options)
    : path_(std::move(path)), options_(std::move(options)) {
  FOURBIT_CHECK(!path_.empty(), "AtomicFile: empty destination path");
  static std::atomic<uint64_t> counter{0};
  const std::filesystem::path p(path_);
  const std::string dir = parent_dir(path_);
  for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
    temp_path_ = fmt::format("{}/.{}.tmp.{}.{}", dir, p.filename().string(), (long)::getpid(),
                             counter.fetch_add(1));
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0 && errno != EEXIST) break;
  }
  if (fd_ < 0) {
    throw Error(fmt::format("cannot create a temporary file in '{}' to write '{}': {}", dir, path_,
                            std::strerror(errno)));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_path_.c_str());
}

void AtomicFile::write(const void* data, int64_t bytes) {
  FOURBIT_CHECK(fd_ >= 0 && !committed_, "AtomicFile::write on a closed file ('{}')", path_);
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const size_t chunk = (size_t)std::min<int64_t>(bytes, int64_t{1} << 30);
    const ssize_t n = ::write(fd_, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("writing '{}' failed after {} bytes: {} (the previous file, if any, "
                              "is untouched)", path_, bytes_written_, std::strerror(errno)));
    }
    p += n;
    bytes -= n;
    bytes_written_ += n;
  }
  if (options_.after_write) options_.after_write(bytes_written_);
}

void AtomicFile::commit() {
  FOURBIT_CHECK(fd_ >= 0 && !committed_, "AtomicFile::commit called twice ('{}')", path_);
  if (::fsync(fd_) != 0) {
    throw Error(fmt::format("fsync of '{}' failed: {} (the previous file, if any, is untouched)",
                            temp_path_, std::strerror(errno)));
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    throw Error(fmt::format("closing '{}' failed: {} (the previous file, if any, is untouched)",
                            temp_path_, std::strerror(errno)));
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    throw Error(fmt::format("cannot rename '{}' to '{}': {}", temp_path_, path_,
                            std::strerror(errno)));
  }
  committed_ = true;
  // Make the rename itself durable. Some file systems cannot fsync a directory (EINVAL): the
  // file is complete either way.
  const int dir_fd = ::open(parent_dir(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    const int rc = ::fsync(dir_fd);
    const int err = errno;
    ::close(dir_fd);
    if (rc != 0 && err != EINVAL && err != EROFS) {
      throw Error(fmt::format("fsync of the directory of '{}' failed: {}", path_,
                              std::strerror(err)));
    }
  }
}

void write_file_atomically(const std::string& path, std::string_view bytes,
                           const AtomicWriteOptions& options) {
  AtomicFile f(path, options);
  f.write(bytes);
  f.commit();
}

}  // namespace fourbit::io
