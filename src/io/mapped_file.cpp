// MappedFile: open + fstat + mmap(PROT_READ, MAP_PRIVATE); the descriptor is closed right after
// mapping (the mapping keeps the file alive).
#include "io/mapped_file.h"

#include "core/check.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fourbit::io {

MappedFile MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(fmt::format("cannot open '{}': {}", path, std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(fmt::format("cannot stat '{}': {}", path, std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("'{}' is not a regular file", path));
  }
  MappedFile f;
  f.path_ = path;
  f.size_ = (int64_t)st.st_size;
  if (f.size_ > 0) {
    void* p = ::mmap(nullptr, (size_t)f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      throw Error(fmt::format("cannot memory-map '{}' ({} bytes): {}", path, f.size_,
                              std::strerror(err)));
    }
    const size_t n = (size_t)f.size_;
    f.data_ = std::shared_ptr<const uint8_t>(static_cast<const uint8_t*>(p),
                                             [n](const uint8_t* q) { ::munmap((void*)q, n); });
  } else {
    ::close(fd);
  }
  return f;
}

}  // namespace fourbit::io
