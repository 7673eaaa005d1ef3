// The floating storage types that the dense ops' CUDA kernels read and write, named in the plain
// launch interfaces (<op>_kernels.h) shared by host code and nvcc. Internal to the ops module.
#pragma once

#include <cstdint>

namespace fourbit::ops::kernels {

// Storage of one tensor argument; all kernel math is FP32 whatever the storage.
enum class FloatType : uint8_t { kF32, kBF16 };

}  // namespace fourbit::ops::kernels
