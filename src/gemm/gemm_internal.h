// Internal to the gemm module: operand resolution and validation shared by every backend, the CPU
// backends, and the entry points of the CUDA backends (gemm_cublaslt.cpp).
//
// A GEMM (or one group of a grouped GEMM) multiplies sub-blocks of its operands: an OperandSlice
// selects rows [row0, row0 + rows) and the reduction range [k0, k0 + k) of a resolved operand.
#pragma once

#include "gemm/gemm.h"

#include <optional>
#include <string>
#include <vector>

namespace fourbit::gemm::detail {

// An Operand after validation.
struct OperandInfo {
  const Operand* op = nullptr;
  std::string role;  // "A", "B" (for messages)
  int64_t rows = 0, k = 0;
  Device device = Device::kCpu;
  // Plain operands.
  DType dtype = DType::kBF16;
  int64_t ld = 0;  // row stride of the stored view, in elements
  // Quantized operands.
  const quant::QuantizedData* data = nullptr;  // the selected copy
  quant::QuantConfig config;
  bool hadamard = false;      // column-wise copy in the Hadamard domain (RHT along K)
  uint16_t hadamard_mask = 0;

  bool quantized() const { return data != nullptr; }
  quant::Format format() const { return config.format; }
  bool emulated_format() const {
    return quantized() && (format() == quant::Format::kNvfp4 || format() == quant::Format::kMxfp8);
  }
  bool fp8_format() const {
    return quantized() && (format() == quant::Format::kFp8Tensor || format() == quant::Format::kFp8Block);
  }
  // "fp8-block 1x128", "bf16", ... (for the backend log line and messages).
  std::string format_label() const;
};

struct OperandSlice {
  const OperandInfo* info = nullptr;
  int64_t row0 = 0, rows = 0;
  int64_t k0 = 0, k = 0;
};
inline OperandSlice whole(const OperandInfo& info) { return {&info, 0, info.rows, 0, info.k}; }

OperandInfo resolve_operand(const Operand& op, std::string_view role, std::string_view gemm_name);
// Checks C (dtype, shape [rows, cols], layout, device).
void check_output(const TensorView& c, int64_t rows, int64_t cols, Device device,
                  std::string_view gemm_name, std::string_view what);
// Checks that A and B can be multiplied (same K, same device, matching Hadamard domains).
void check_pair(const OperandInfo& a, const OperandInfo& b, std::string_view gemm_name);

// kAuto -> the backend for this pair; a forced backend is checked against the pair. Logs each
// distinct (backend, formats, device) selection once per process.
Backend choose_backend(Backend requested, const OperandInfo& a, const OperandInfo& b,
                       const TensorView& c, std::string_view gemm_name);

// A view of rows [row0, row0 + rows) of a matrix view (shape [rows, cols], same strides).
TensorView row_slice(const TensorView& v, int64_t row0, int64_t rows);

// ---- CPU backends (gemm_cpu.cpp) ------------------------------------------------------------
// The operand's logical matrix [rows, K], exactly dequantized to f32 (row-major, contiguous).
// An operand's exact values, widened to float64 (plain f64 operands keep every bit).
struct DenseOperand {
  std::vector<double> values;
  int64_t rows = 0, k = 0;
};
DenseOperand materialize(const OperandInfo& info);

struct CpuGemm {
  const DenseOperand* a;
  OperandSlice sa;
  const DenseOperand* b;
  OperandSlice sb;
  TensorView c;  // [sa.rows, sb.rows]
  float alpha, beta;
  TensorView c_source{};  // the beta term's matrix when not C (GemmArgs::c_source); else empty
};
void cpu_gemm(Backend backend, const CpuGemm& g);

// ---- CUDA backends (gemm_cublaslt.cpp) --------------------------------------------------------
struct CudaGroup {
  OperandSlice a, b;
  TensorView c;  // [a.rows, b.rows]
  TensorView c_source{};  // the beta term's matrix when not C (GemmArgs::c_source); else empty
};
struct CudaGemmCall {
  Backend backend;
  std::vector<CudaGroup> groups;  // run in order on one stream; an empty reduction gives beta * C
  float alpha, beta;
  void* stream;
  std::string_view name;
  Arena* workspace;
  int* error_flag;
};
void cuda_gemm(const CudaGemmCall& call);

}  // namespace fourbit::gemm::detail
