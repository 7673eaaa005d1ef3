// Implementation of arena.h.
#include "core/arena.h"

namespace fourbit {

Arena::Arena(int64_t capacity_bytes, Device device)
    : storage_(allocate_bytes(capacity_bytes + kAlignment, device)),
      capacity_(capacity_bytes),
      device_(device) {
  // Host storage is only 64-byte aligned: start the arena at the first 256-byte boundary.
  const auto base = reinterpret_cast<uintptr_t>(storage_.get());
  base_offset_ = (int64_t)((kAlignment - base % kAlignment) % kAlignment);
}

void* Arena::alloc_bytes(int64_t bytes, std::string_view name) {
  FOURBIT_CHECK(bytes >= 0, "arena: negative size {} for '{}'", bytes, name);
  const int64_t start = (used_ + kAlignment - 1) / kAlignment * kAlignment;
  FOURBIT_CHECK(start + bytes <= capacity_,
                "arena on {} is out of space for '{}' ({} bytes): {} of {} bytes in use (peak {}); "
                "give the arena more memory or use smaller shapes",
                device_name(device_), name, bytes, used_, capacity_, peak_);
  used_ = start + bytes;
  peak_ = std::max(peak_, used_);
  return static_cast<char*>(storage_.get()) + base_offset_ + start;
}

TensorView Arena::alloc(Shape shape, DType dtype, std::string_view name) {
  void* p = alloc_bytes(dtype_bytes(dtype, shape.numel()), name);
  return TensorView::contiguous(p, dtype, shape, device_);
}

void Arena::reset_to(int64_t mark) {
  FOURBIT_CHECK(mark >= 0 && mark <= used_, "arena: reset_to({}) outside [0, {}]", mark, used_);
  used_ = mark;
}

}  // namespace fourbit
