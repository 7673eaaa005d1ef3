// Read-only memory mapping of a whole file, shared by the safetensors reader and the token shards.
//
// The mapping lives as long as any copy of the MappedFile (shared ownership), so views into it can
// outlive the object that opened it when they hold a copy. A file of zero bytes maps to an empty
// span. Errors (missing file, not a regular file, mmap failure) throw fourbit::Error naming the path.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace fourbit::io {

class MappedFile {
 public:
  MappedFile() = default;
  static MappedFile open(const std::string& path);

  std::span<const uint8_t> bytes() const { return {data_.get(), (size_t)size_}; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Keeps the mapping alive (for views that must outlive this object).
  std::shared_ptr<const uint8_t> keep_alive() const { return data_; }

 private:
  std::shared_ptr<const uint8_t> data_;
  int64_t size_ = 0;
  std::string path_;
};

}  // namespace fourbit::io
