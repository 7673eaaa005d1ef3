// Argument checking and dispatch helpers shared by the host side of the dense ops (embedding,
// rmsnorm, rope, swiglu, cross_entropy, adamw, elementwise, nonfinite). Internal: not part of the
// ops API. Every message names the op and the tensor and says what was expected.
//
// An optional tensor argument is "absent" when it is a default-constructed TensorView{} (no data,
// no dimensions); a zero-size tensor with a shape is present.
#pragma once

#include "core/check.h"
#include "core/tensor.h"

#include <initializer_list>
#include <string>
#include <string_view>

namespace fourbit::ops::detail {

inline bool present(const TensorView& t) { return t.data != nullptr || t.shape.ndim != 0; }

struct Named {
  std::string_view name;
  const TensorView* t;
};

// The device of the present tensors (kCpu if none is present). Mixed devices are an error that
// names the first tensor whose device differs from the first present one.
Device common_device(std::string_view op, std::initializer_list<Named> tensors);

// A CUDA dispatch in a CPU-only build: an error saying how to get a CUDA build.
[[noreturn]] void no_cuda_build(std::string_view op);

std::string dtype_list(std::initializer_list<DType> dtypes);  // "bf16 or f32"

inline void check_dtype(std::string_view op, std::string_view name, const TensorView& t,
                        std::initializer_list<DType> allowed) {
  bool ok = false;
  for (DType d : allowed) ok = ok || t.dtype == d;
  FOURBIT_CHECK(ok, "{}: {} must be {} on {}, got {}", op, name, dtype_list(allowed),
                device_name(t.device), t.describe());
}

// Shape equality and contiguity in one check (every dense op wants both).
inline void check_shape(std::string_view op, std::string_view name, const TensorView& t,
                        const Shape& want) {
  FOURBIT_CHECK(t.shape == want, "{}: {} must have shape {}, got {}", op, name, want.str(),
                t.describe());
  FOURBIT_CHECK(t.is_contiguous(), "{}: {} must be contiguous (row-major), got strides {}", op,
                name, t.strides.str());
}

// The CPU reference computes in one floating dtype for all floating tensors of a call: f32 or
// f64. Returns it (the dtype of the first tensor); throws naming a tensor that differs.
DType cpu_float_dtype(std::string_view op, std::initializer_list<Named> tensors);

// False when a and b are the same non-empty buffer (the ops check that outputs do not alias inputs
// by their data pointers: outputs and inputs of a call are whole tensors, never overlapping
// slices).
inline bool distinct(const TensorView& a, const TensorView& b) {
  return a.data != b.data || a.numel() == 0 || b.numel() == 0;
}

// The data pointer as an integer, for 16-byte alignment decisions on the host.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

#if defined(FOURBIT_WITH_CUDA)
// The device error flag an op writes: the caller's, or (when the caller passed null) a
// process-wide internal one, zeroed on `stream` first. finish() then waits for the stream and
// returns the bits of the internal flag (0 when the caller's flag is used: the caller checks it).
// The internal flag is shared: host threads must not run flag-checked ops concurrently.
class DeviceFlag {
 public:
  DeviceFlag(int* caller_flag, void* stream);
  int* get() const { return flag_; }
  int finish();

 private:
  int* flag_;
  bool internal_;
  void* stream_;
};
#endif

}  // namespace fourbit::ops::detail
