// Element types of fourbit tensors, described once in a small descriptor table.
//
// kE2M1x2 is packed FP4: two E2M1 codes per byte, the element with the lower index in bits 3..0
// (the PyTorch float4_e2m1fn_x2 / Transformer Engine convention). Its shape and strides count
// elements, not bytes; its innermost dimension must be contiguous.
#pragma once

#include <cstdint>
#include <string_view>

namespace fourbit {

enum class DType : uint8_t {
  kF64,
  kF32,
  kBF16,
  kF16,
  kE4M3,   // FP8 E4M3 (OCP "fn": no Inf, NaN = S.1111.111, max 448)
  kE5M2,   // FP8 E5M2 (IEEE-like, max 57344)
  kE8M0,   // unsigned power-of-two scale 2^(code-127), 0xFF = NaN
  kE2M1x2, // packed FP4, see above
  kU8,
  kU16,
  kI32,
  kU32,
  kI64,
};

struct DTypeInfo {
  std::string_view name;
  int bits;  // storage bits per element (4 for packed FP4)
};

constexpr DTypeInfo dtype_info(DType t) {
  switch (t) {
    case DType::kF64: return {"f64", 64};
    case DType::kF32: return {"f32", 32};
    case DType::kBF16: return {"bf16", 16};
    case DType::kF16: return {"f16", 16};
    case DType::kE4M3: return {"e4m3", 8};
    case DType::kE5M2: return {"e5m2", 8};
    case DType::kE8M0: return {"e8m0", 8};
    case DType::kE2M1x2: return {"e2m1x2", 4};
    case DType::kU8: return {"u8", 8};
    case DType::kU16: return {"u16", 16};
    case DType::kI32: return {"i32", 32};
    case DType::kU32: return {"u32", 32};
    case DType::kI64: return {"i64", 64};
  }
  return {"?", 0};
}

constexpr std::string_view dtype_name(DType t) { return dtype_info(t).name; }
constexpr int dtype_bits(DType t) { return dtype_info(t).bits; }

// Bytes needed for n elements of type t (packed FP4 rounds up to whole bytes).
constexpr int64_t dtype_bytes(DType t, int64_t n) { return (n * dtype_bits(t) + 7) / 8; }

}  // namespace fourbit
