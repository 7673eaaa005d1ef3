// CPU backends: the float64 reference (naive loops, the ground truth of every GEMM test) and the
// OpenBLAS path (FP32 sgemm) for the CPU runtime. Both multiply the exactly dequantized operand
// values (quant::dequantize_reference: NVFP4 with its global decode scale applied per element,
// column-wise copies in their stored, possibly Hadamard, domain).
//
// Output rounding: the reference forms alpha * sum + beta * C in float64 and stores it in C's dtype:
// f64 as is (plain f64 operands and output: the finite-difference gradient checks of the model),
// f32 rounded once, bf16 rounded to f32 and then to bf16 (round to nearest even both times).
#include "gemm/gemm_internal.h"

#include "core/check.h"
#include "formats/element.h"

#include <vector>

#if defined(FOURBIT_WITH_BLAS)
#include <cblas.h>
#endif

namespace fourbit::gemm::detail {

DenseOperand materialize(const OperandInfo& info) {
  DenseOperand d;
  d.rows = info.rows;
  d.k = info.k;
  if (info.quantized()) {
    const Tensor t = quant::dequantize_reference(*info.op->quantized, info.op->copy == Copy::kColwise);
    d.values.assign(t.ptr<const float>(), t.ptr<const float>() + t.numel());  // exact widening
    return d;
  }
  d.values.resize((size_t)(d.rows * d.k));
  const TensorView& t = info.op->plain;
  const bool transposed = info.op->transposed;
  for (int64_t r = 0; r < d.rows; ++r) {
    for (int64_t k = 0; k < d.k; ++k) {
      const int64_t i = transposed ? k * info.ld + r : r * info.ld + k;
      d.values[(size_t)(r * d.k + k)] =
          t.dtype == DType::kF64   ? t.ptr<const double>()[i]
          : t.dtype == DType::kF32 ? (double)t.ptr<const float>()[i]
                                   : (double)formats::decode_bf16(t.ptr<const uint16_t>()[i]);
    }
  }
  return d;
}

namespace {

double load_c(const TensorView& c, int64_t i, int64_t j) {
  const int64_t at = i * c.strides[0] + j;
  switch (c.dtype) {
    case DType::kF64: return c.ptr<const double>()[at];
    case DType::kF32: return c.ptr<const float>()[at];
    default: return formats::decode_bf16(c.ptr<const uint16_t>()[at]);
  }
}

void store_c(const TensorView& c, int64_t i, int64_t j, double v) {
  const int64_t at = i * c.strides[0] + j;
  switch (c.dtype) {
    case DType::kF64: c.ptr<double>()[at] = v; break;
    case DType::kF32: c.ptr<float>()[at] = (float)v; break;
    default: c.ptr<uint16_t>()[at] = formats::encode_bf16_rn((float)v); break;
  }
}

const double* slice_ptr(const DenseOperand& d, const OperandSlice& s) {
  return d.values.data() + s.row0 * d.k + s.k0;
}

// The matrix the beta term reads: c_source when given, else C.
const TensorView& beta_source(const CpuGemm& g) { return g.c_source.data ? g.c_source : g.c; }

void reference_gemm(const CpuGemm& g) {
  const int64_t m = g.sa.rows, n = g.sb.rows, k = g.sa.k;
  const TensorView& src = beta_source(g);
  const double* a = slice_ptr(*g.a, g.sa);
  const double* b = slice_ptr(*g.b, g.sb);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t l = 0; l < k; ++l) {
        acc += a[i * g.a->k + l] * b[j * g.b->k + l];
      }
      double out = (double)g.alpha * acc;
      if (g.beta != 0.0f) out += (double)g.beta * load_c(src, i, j);
      store_c(g.c, i, j, out);
    }
  }
}

#if defined(FOURBIT_WITH_BLAS)
void blas_gemm(const CpuGemm& g) {
  const int64_t m = g.sa.rows, n = g.sb.rows, k = g.sa.k;
  if (m == 0 || n == 0) return;
  const TensorView& src = beta_source(g);
  if (k == 0) {  // an empty reduction: C = beta * C (not every BLAS scales C when K = 0)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) store_c(g.c, i, j, g.beta == 0.0f ? 0.0 : g.beta * load_c(src, i, j));
    return;
  }
  // sgemm's beta term reads its output: an f32 C with a separate source becomes a staged copy.
  const bool direct = g.c.dtype == DType::kF32 && src.data == g.c.data;
  std::vector<float> staged;
  float* c = g.c.ptr<float>();
  int64_t ldc = g.c.strides[0];
  if (!direct) {  // bf16 output (or a separate source): accumulate into an f32 copy, store once
    staged.assign((size_t)(m * n), 0.0f);
    if (g.beta != 0.0f)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) staged[(size_t)(i * n + j)] = (float)load_c(src, i, j);
    c = staged.data();
    ldc = n;
  }
  FOURBIT_CHECK(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX && ldc <= INT32_MAX,
                "cpu-blas: GEMM of [{}, {}] x [{}, {}] exceeds the 32-bit BLAS interface", m, k, n, k);
  // The operands' values are f32 / bf16 / dequantized ones, exact in FP32: narrow them back.
  // (whole rows of the slice; the slice starts at column k0 of them).
  auto narrow = [](const DenseOperand& d, const OperandSlice& s) {
    std::vector<float> f((size_t)(s.rows * d.k));
    const double* p = d.values.data() + s.row0 * d.k;
    for (size_t i = 0; i < f.size(); ++i) f[i] = (float)p[i];
    return f;
  };
  const std::vector<float> a = narrow(*g.a, g.sa), b = narrow(*g.b, g.sb);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)k, g.alpha,
              a.data() + g.sa.k0, (int)g.a->k, b.data() + g.sb.k0, (int)g.b->k, g.beta, c, (int)ldc);
  if (!direct) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) store_c(g.c, i, j, staged[(size_t)(i * n + j)]);
  }
}
#endif

}  // namespace

void cpu_gemm(Backend backend, const CpuGemm& g) {
#if defined(FOURBIT_WITH_BLAS)
  if (backend == Backend::kCpuBlas) {
    blas_gemm(g);
    return;
  }
#endif
  FOURBIT_CHECK(backend == Backend::kCpuReference, "cpu_gemm: {} is not a CPU backend",
                backend_name(backend));
  reference_gemm(g);
}

}  // namespace fourbit::gemm::detail
