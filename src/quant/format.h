// The quantized formats and quantizer options as closed enums (no formatting library, so that
// nvcc-compiled kernels can include it).
#pragma once

#include <cstdint>

namespace fourbit::quant {

enum class Format : uint8_t { kNvfp4, kMxfp8, kFp8Tensor, kFp8Block };
enum class Rounding : uint8_t { kNearest, kStochastic };
enum class Nvfp4ScaleRule : uint8_t { kAmaxTo6, kFourOverSix };
enum class HadamardSigns : uint8_t { kNone, kFixed, kRandom };

}  // namespace fourbit::quant
