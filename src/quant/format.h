// The quantized formats and quantizer options as closed enums (no formatting library, so that
// nvcc-compiled kernels can include it).
#pragma once

#include <cstdint>

namespace fourbit::quant {

enum class Format : uint8_t { kNvfp4, kMxfp8, kFp8Tensor, kFp8Block };
enum class Rounding : uint8_t { kNearest, kStochastic };
enum class Nvfp4ScaleRule : uint8_t { kAmaxTo6, kFourOverSix };
enum class HadamardSigns : uint8_t { kNone, kFixed, kRandom };

// Bits that CUDA quantizers and GEMMs OR into one device error flag (an int32), checked by the
// host at a synchronization point, which names the tensor.
inline constexpr int kDeviceErrNonFinite = 1;      // a NaN or Inf in a tensor being quantized
inline constexpr int kDeviceErrMxfp8NotExact = 2;  // MXFP8 scaled-domain BF16 would not be exact

}  // namespace fourbit::quant
