// A bump ("arena") allocator over one big host or device buffer.
//
// Transient buffers (activations, quantized operands, workspaces) are carved out of the arena in
// order and released all at once with reset(); no per-buffer free and no fragmentation. Every
// allocation is aligned to 256 bytes (what cuBLASLt and 16-byte vector loads want). Running out
// of space is an error that names the buffer, its size and the arena's capacity and peak use.
#pragma once

#include "core/tensor.h"

#include <cstdint>
#include <memory>
#include <string_view>

namespace fourbit {

class Arena {
 public:
  static constexpr int64_t kAlignment = 256;

  Arena(int64_t capacity_bytes, Device device);

  // A contiguous tensor of the given shape; `name` appears in the out-of-space error.
  TensorView alloc(Shape shape, DType dtype, std::string_view name);
  void* alloc_bytes(int64_t bytes, std::string_view name);
  // Releases everything allocated since construction (or since `mark`).
  void reset() { used_ = 0; }
  int64_t mark() const { return used_; }
  void reset_to(int64_t mark);

  int64_t capacity() const { return capacity_; }
  int64_t used() const { return used_; }
  int64_t peak() const { return peak_; }
  Device device() const { return device_; }

 private:
  std::shared_ptr<void> storage_;
  int64_t base_offset_ = 0;
  int64_t capacity_ = 0;
  int64_t used_ = 0;
  int64_t peak_ = 0;
  Device device_;
};

}  // namespace fourbit
