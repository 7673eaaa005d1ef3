// CUDA backends through cuBLASLt: BF16, FP8 (per-tensor and 1x128 / 128x128 block scales) and the
// exact NVFP4 / MXFP8 emulation; plus fourbit's own FP8 block kernel for a 1x128 A and a 1x128 or
// 128x128 B (kWgmmaFp8, fp8_wgmma_kernels.h), which takes the same operand views and converted
// scales as cuBLASLt's block modes. Single and grouped GEMMs share one path (cuda_gemm), a list of
// group GEMMs launched back to back on one stream.
//
// Layout. fourbit's row-major TN GEMM C[M, N] = A[M, K] . B[N, K]^T is cuBLASLt's column-major
// C^T[N, M] = op(B) . op(A): cuBLAS "A" is our B (transa = T for a K-contiguous operand), cuBLAS
// "B" is our A (transb = N), m = N, n = M. Quantized operands are always K-contiguous, so every
// FP8 GEMM is "TN", the only FP8 layout on Hopper.
//
// cuBLASLt requirements enforced here (cuBLAS docs, cublasLtMatmul and "Scaling factors layouts"):
// FP8 operands 16-byte aligned with K and leading dimensions multiples of 16; block scales need the
// rows of each operand (M, N) to be multiples of 4 and 16-byte aligned scale arrays (ours come from
// 256-byte aligned scratch); at most one 128x128 operand (checked in gemm.cpp); the split
// accumulator (FAST_ACCUM = 0) is always used, so FP8 partial sums are promoted to FP32. A
// configuration for which the heuristic finds no algorithm is an error naming the shapes and types.
//
// Caching. One cuBLASLt handle and a 32 MiB workspace per process; a matmul plan (descriptor,
// layouts, heuristic result) per (shape, types, transposes, leading dimensions, scale modes,
// pointer mode, pointer alignments). Scale pointers are set on the cached descriptor per call; a
// process-wide mutex serializes the host side of GEMM calls (the GPU work stays asynchronous).
#include "gemm/gemm_internal.h"

#include "core/check.h"
#include "core/device.h"
#include "core/env.h"
#include "core/fill.h"
#include "core/log.h"
#include "gemm/fp8_wgmma_kernels.h"
#include "gemm/gemm_kernels.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

namespace fourbit::gemm::detail {
namespace {

constexpr size_t kCublasWorkspaceBytes = 32u << 20;  // cuBLAS's recommendation for Hopper

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

uint32_t pointer_alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// What cuBLASLt gets for one of our operands (after conversions).
struct MatmulOperand {
  const void* ptr = nullptr;
  cudaDataType_t type = CUDA_R_16BF;
  int64_t rows = 0, k = 0;
  int64_t ld = 0;             // row stride of the stored matrix, elements
  bool stored_transposed = false;  // stored [k, rows] instead of [rows, k]
  int32_t scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  const void* scale = nullptr;  // FP8 decode scales (device)
};

struct PlanKey {
  int64_t m, n, k;
  int32_t type_a, type_b, type_c;
  int32_t trans_a, trans_b;
  int64_t ld_a, ld_b, ld_c;
  int32_t scale_a, scale_b;
  bool fp8, device_scalars;
  uint32_t align_a, align_b, align_c;
  auto operator<=>(const PlanKey&) const = default;
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

class Lt {
 public:
  Lt() {
    FOURBIT_CUBLAS_CHECK(cublasLtCreate(&handle_));
    FOURBIT_CUDA_CHECK(cudaMalloc(&workspace_, kCublasWorkspaceBytes));
    FOURBIT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&error_flag_), sizeof(int)));
  }
  Lt(const Lt&) = delete;
  Lt& operator=(const Lt&) = delete;
  // The process-wide instance lives until exit; its plans and buffers are not released (the CUDA
  // context may already be gone when static destructors run).

  cublasLtHandle_t handle() const { return handle_; }
  void* workspace() const { return workspace_; }
  int* internal_error_flag() const { return error_flag_; }
  std::mutex& mutex() { return mutex_; }
  std::map<PlanKey, Plan>& plans() { return plans_; }

  // The per-process scratch arena, grown (and emptied) to hold at least `bytes`.
  Arena& default_scratch(int64_t bytes) {
    if (!scratch_ || scratch_->capacity() < bytes) {
      scratch_.reset();  // frees (cudaFree synchronizes the device, so nothing still uses it)
      scratch_ = std::make_unique<Arena>(std::max<int64_t>(bytes, 64ll << 20), Device::kCuda);
    }
    scratch_->reset();
    return *scratch_;
  }

 private:
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  int* error_flag_ = nullptr;
  std::mutex mutex_;
  std::map<PlanKey, Plan> plans_;
  std::unique_ptr<Arena> scratch_;
};

Lt& lt() {
  static Lt* instance = new Lt();  // intentionally never destroyed, see above
  return *instance;
}

// Scratch for one call: from the caller's arena (rewound on return) or the module's own.
class Scratch {
 public:
  Scratch(Arena* user, int64_t bytes, std::string_view gemm_name) : user_(user) {
    if (user_) {
      FOURBIT_CHECK(user_->device() == Device::kCuda, "{}: the workspace arena must be on cuda",
                    gemm_name);
      mark_ = user_->mark();
      arena_ = user_;
    } else {
      arena_ = &lt().default_scratch(bytes);
    }
  }
  ~Scratch() {
    if (user_) user_->reset_to(mark_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* take(int64_t bytes, std::string_view what) { return arena_->alloc_bytes(bytes, what); }

 private:
  Arena* user_ = nullptr;
  Arena* arena_ = nullptr;
  int64_t mark_ = 0;
};

const Plan& get_plan(const PlanKey& key, const MatmulOperand& a, const MatmulOperand& b,
                     cudaDataType_t c_type, std::string_view gemm_name) {
  auto& plans = lt().plans();
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  Plan p;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = (cublasOperation_t)key.trans_a, trans_b = (cublasOperation_t)key.trans_b;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  const int32_t pointer_mode = key.device_scalars ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode, sizeof(pointer_mode)));
  if (key.fp8) {
    const int8_t fast_accum = 0;  // split accumulator: promote FP8 partial sums to FP32
    FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
    FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &key.scale_a, sizeof(key.scale_a)));
    FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &key.scale_b, sizeof(key.scale_b)));
    // Block-scaled modes are refused by the heuristic (CUBLAS_STATUS_INVALID_VALUE, seen on the
    // H200 with cuBLAS 13.1) while their scale pointers are unset: set this call's pointers now
    // (run_matmul sets them again on every call of the cached plan).
    FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b.scale, sizeof(b.scale)));
    FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a.scale, sizeof(a.scale)));
  }
  // cuBLAS A = our B, cuBLAS B = our A (see the file comment).
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_a, b.type, trans_a == CUBLAS_OP_T ? key.k : key.m,
                                                  trans_a == CUBLAS_OP_T ? key.m : key.k, key.ld_a));
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_b, a.type, trans_b == CUBLAS_OP_N ? key.k : key.n,
                                                  trans_b == CUBLAS_OP_N ? key.n : key.k, key.ld_b));
  FOURBIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.layout_c, c_type, key.m, key.n, key.ld_c));

  cublasLtMatmulPreference_t pref = nullptr;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kCublasWorkspaceBytes;
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a, sizeof(key.align_a)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b, sizeof(key.align_b)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c, sizeof(key.align_c)));
  FOURBIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c, sizeof(key.align_c)));
  // FOURBIT_CUBLASLT_SPLITK=0 (A/B runs): the heuristic's best algorithm that does not split K,
  // where it offers one among its first kCandidates. The default takes its first choice. (At
  // gpt2-124m every split-K GEMM of a step came with idle gaps before memsets, 0.7 ms a step on an
  // H200 by ktrace, session 27.)
  static const bool no_split_k = env_switch("FOURBIT_CUBLASLT_SPLITK") == 0;
  constexpr int kCandidates = 16;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(lt().handle(), p.desc, p.layout_a, p.layout_b, p.layout_c, p.layout_c, pref,
                                     no_split_k ? kCandidates : 1, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  int pick = 0;
  if (no_split_k && status == CUBLAS_STATUS_SUCCESS) {
    const auto split_k_of = [](const cublasLtMatmulAlgo_t& algo) {
      int32_t splits = 1;
      size_t written = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits), &written);
      return splits;
    };
    while (pick < found && split_k_of(results[pick].algo) > 1) ++pick;
    if (pick == found) pick = 0;
    log_info("{}: FOURBIT_CUBLASLT_SPLITK=0: C[{}, {}], K {}: candidate {} of {} (split-K {}; the first choice's: {})",
             gemm_name, key.n, key.m, key.k, pick, found, split_k_of(results[pick].algo), split_k_of(results[0].algo));
  }
  const cublasLtMatmulHeuristicResult_t& result = results[pick];
  FOURBIT_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0,
                "{}: cuBLASLt has no algorithm for C[{}, {}] = A[{}, {}] . B[{}, {}]^T (cuBLAS types: "
                "A {}, B {}, C {}; scale modes A {}, B {}; leading dimensions A {}, B {}, C {}; "
                "alignments A {}, B {}, C {} bytes; heuristic status {}). Check the shape and "
                "alignment rules in gemm_cublaslt.cpp's header, or use another format or backend",
                gemm_name, key.n, key.m, key.n, key.k, key.m, key.k, (int)a.type, (int)b.type,
                (int)c_type, key.scale_b, key.scale_a, key.ld_b, key.ld_a, key.ld_c, key.align_b,
                key.align_a, key.align_c, (int)status);
  p.algo = result.algo;
  return plans.emplace(key, p).first->second;
}

// One cuBLASLt matmul: c[a.rows, b.rows] = alpha * a . b^T + beta * c_source (C when c_source is
// null; c_source has C's layout).
void run_matmul(const MatmulOperand& a, const MatmulOperand& b, const TensorView& c,
                const void* alpha, const void* beta, bool device_scalars, bool fp8,
                cudaStream_t stream, std::string_view gemm_name, const void* c_source = nullptr) {
  const cudaDataType_t c_type = c.dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  PlanKey key{};
  key.m = b.rows;
  key.n = a.rows;
  key.k = a.k;
  key.type_a = (int32_t)b.type;
  key.type_b = (int32_t)a.type;
  key.type_c = (int32_t)c_type;
  key.trans_a = b.stored_transposed ? CUBLAS_OP_N : CUBLAS_OP_T;
  key.trans_b = a.stored_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  key.ld_a = b.ld;
  key.ld_b = a.ld;
  key.ld_c = c.strides[0];
  key.scale_a = b.scale_mode;
  key.scale_b = a.scale_mode;
  key.fp8 = fp8;
  key.device_scalars = device_scalars;
  key.align_a = pointer_alignment(b.ptr);
  key.align_b = pointer_alignment(a.ptr);
  key.align_c = c_source ? std::min(pointer_alignment(c.data), pointer_alignment(c_source))
                         : pointer_alignment(c.data);
  const Plan& plan = get_plan(key, a, b, c_type, gemm_name);
  if (fp8) {
    FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b.scale, sizeof(b.scale)));
    FOURBIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a.scale, sizeof(a.scale)));
  }
  FOURBIT_CUBLAS_CHECK(cublasLtMatmul(lt().handle(), plan.desc, alpha, b.ptr, plan.layout_a, a.ptr,
                                      plan.layout_b, beta, c_source ? c_source : c.data,
                                      plan.layout_c, c.data,
                                      plan.layout_c, &plan.algo, lt().workspace(),
                                      kCublasWorkspaceBytes, stream));
}

// The cuBLAS view of a plain bf16 slice (no conversion).
MatmulOperand plain_operand(const OperandSlice& s) {
  const OperandInfo& info = *s.info;
  const auto* base = static_cast<const uint16_t*>(info.op->plain.data);
  MatmulOperand m;
  m.type = CUDA_R_16BF;
  m.rows = s.rows;
  m.k = s.k;
  m.ld = info.ld;
  m.stored_transposed = info.op->transposed;
  m.ptr = m.stored_transposed ? base + s.k0 * info.ld + s.row0 : base + s.row0 * info.ld + s.k0;
  return m;
}

// A slice of a contiguous bf16 [info.rows, info.k] matrix (the scaled-domain copy).
MatmulOperand scaled_operand(const OperandSlice& s, const uint16_t* bf16) {
  MatmulOperand m;
  m.type = CUDA_R_16BF;
  m.rows = s.rows;
  m.k = s.k;
  m.ld = s.info->k;
  m.ptr = bf16 + s.row0 * s.info->k + s.k0;
  return m;
}

void check_fp8_alignment(const OperandSlice& s, const MatmulOperand& m, std::string_view gemm_name) {
  const OperandInfo& info = *s.info;
  FOURBIT_CHECK(m.k % 16 == 0 && m.ld % 16 == 0 && reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0,
                "{}: FP8 operand {} {}: cuBLASLt's FP8 GEMMs need K (here {}) and the row length "
                "(here {}) to be multiples of 16 and 16-byte aligned rows{}; pad K to a multiple of "
                "16 (zeros do not change the product)",
                gemm_name, info.role, info.op->describe(), m.k, m.ld,
                s.k0 != 0 ? fmt::format(" (this group starts at K offset {})", s.k0) : "");
  if (info.format() != quant::Format::kFp8Block) return;
  FOURBIT_CHECK(s.rows % 4 == 0,
                "{}: FP8 operand {} {}: cuBLASLt's block-scaled FP8 GEMMs need the operand's rows "
                "(M or N, here {}) to be a multiple of 4; pad the token dimension",
                gemm_name, info.role, info.op->describe(), s.rows);
  FOURBIT_CHECK(s.k0 % kFp8ScaleBlock == 0,
                "{}: FP8 operand {} {}: a group starts at K offset {} inside a 128-element scale "
                "block; with fp8-block operands every group must start at a multiple of 128 tokens",
                gemm_name, info.role, info.op->describe(), s.k0);
  FOURBIT_CHECK(!info.config.block_2d || s.row0 % kFp8ScaleBlock == 0,
                "{}: FP8 operand {} {}: a row slice of a 128x128-scaled operand must start at a "
                "multiple of 128 rows (starts at {})", gemm_name, info.role, info.op->describe(), s.row0);
}

// The cuBLAS view of an FP8 slice; block scales are converted into `scale_buffer`.
MatmulOperand fp8_operand(const OperandSlice& s, float* scale_buffer, cudaStream_t stream,
                          std::string_view gemm_name) {
  const OperandInfo& info = *s.info;
  const quant::QuantizedData& d = *info.data;
  MatmulOperand m;
  m.type = CUDA_R_8F_E4M3;
  m.rows = s.rows;
  m.k = s.k;
  m.ld = d.cols;
  m.ptr = d.data.ptr<const uint8_t>() + s.row0 * d.cols + s.k0;
  check_fp8_alignment(s, m, gemm_name);
  if (info.format() == quant::Format::kFp8Tensor) {
    m.scale_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    m.scale = d.scales.data();
    return m;
  }
  const bool two_d = info.config.block_2d;
  Fp8BlockScaleSlice slice;
  slice.src = d.scales.ptr<const float>();
  slice.src_ld = d.scales.shape()[1];
  slice.block_2d = two_d;
  slice.row0 = s.row0;
  slice.rows = s.rows;
  slice.block0 = s.k0 / kFp8ScaleBlock;
  slice.blocks = (s.k + kFp8ScaleBlock - 1) / kFp8ScaleBlock;
  kernels::launch_fp8_block_scales(slice, scale_buffer, stream);
  m.scale_mode = two_d ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  m.scale = scale_buffer;
  return m;
}

// fourbit's FP8 block kernel (fp8_wgmma_kernels.h) on operands prepared by fp8_operand.
void run_wgmma_fp8(const CudaGroup& g, const MatmulOperand& a, const MatmulOperand& b, const void* c_source,
                   const CudaGemmCall& call, cudaStream_t stream) {
  FOURBIT_CHECK(g.a.rows < (int64_t{1} << 31) && g.b.rows < (int64_t{1} << 31) && g.a.k < (int64_t{1} << 31),
                "{}: backend wgmma-fp8-block takes M, N and K below 2^31 (got {}, {}, {}); use cublaslt-fp8",
                call.name, g.a.rows, g.b.rows, g.a.k);
  kernels::Fp8BlockGemmParams p;
  p.a = static_cast<const uint8_t*>(a.ptr);
  p.a_ld = a.ld;
  p.b = static_cast<const uint8_t*>(b.ptr);
  p.b_ld = b.ld;
  p.scales_a = static_cast<const float*>(a.scale);
  p.scales_b = static_cast<const float*>(b.scale);
  p.b_2d = g.b.info->config.block_2d;
  p.scales_b_ld = fp8_round_up4((g.b.k + kFp8ScaleBlock - 1) / kFp8ScaleBlock);
  p.m = g.a.rows;
  p.n = g.b.rows;
  p.k = g.a.k;
  p.c = g.c.data;
  p.c_source = c_source;
  p.ldc = g.c.strides[0];
  p.c_bf16 = g.c.dtype == DType::kBF16;
  p.alpha = call.alpha;
  p.beta = call.beta;
  kernels::launch_fp8_block_gemm(p, stream);
}

int64_t fp8_scale_floats(const OperandSlice& s) {
  if (s.info->format() != quant::Format::kFp8Block) return 0;
  return cublas_fp8_scale_count(s.info->config.block_2d, s.rows, (s.k + kFp8ScaleBlock - 1) / kFp8ScaleBlock);
}

// An emulated operand that the GEMM must dequantize itself (no producer-written BF16 copy).
bool needs_scaled_conversion(const OperandInfo& info) {
  return info.emulated_format() && info.op->scaled_bf16.data == nullptr;
}

}  // namespace

void cuda_gemm(const CudaGemmCall& call) {
  std::lock_guard<std::mutex> lock(lt().mutex());
  const cudaStream_t stream = static_cast<cudaStream_t>(call.stream);
  const bool emulated = call.backend == Backend::kEmulated;
  const bool fp8 = call.backend == Backend::kCublasFp8 || call.backend == Backend::kWgmmaFp8;

  // Scratch: scaled-domain BF16 copies of the distinct operands that need one (shared by all
  // groups), the largest per-group pair of converted FP8 scale arrays, the epilogue scalars.
  std::vector<const OperandInfo*> to_convert;
  int64_t scale_floats = 0;
  for (const CudaGroup& g : call.groups) {
    for (const OperandSlice* s : {&g.a, &g.b}) {
      if (emulated && needs_scaled_conversion(*s->info) &&
          std::find(to_convert.begin(), to_convert.end(), s->info) == to_convert.end()) {
        to_convert.push_back(s->info);
      }
    }
    if (fp8) scale_floats = std::max(scale_floats, round_up(fp8_scale_floats(g.a), 64) + fp8_scale_floats(g.b));
  }
  // An A with per-row NVFP4 amaxes: cuBLASLt writes raw FP32 sums here, the row-scaled epilogue
  // applies the per-row factors (gemm_kernels.h).
  auto row_scaled = [&](const OperandInfo& info) {
    return emulated && info.quantized() && info.config.nvfp4_row_amax;
  };
  int64_t acc_floats = 0;
  for (const CudaGroup& g : call.groups) {
    if (row_scaled(*g.a.info)) acc_floats = std::max(acc_floats, g.a.rows * g.b.rows);
  }
  int64_t bytes = 256 + 4 * round_up(scale_floats, 64) + 256 + round_up(4 * acc_floats, 256);
  for (const OperandInfo* info : to_convert) bytes += round_up(2 * info->rows * info->k, 256);
  Scratch scratch(call.workspace, bytes, call.name);

  // Shared conversions, once per call.
  int* flag = call.error_flag ? call.error_flag : lt().internal_error_flag();
  bool check_flag_here = false;
  std::vector<std::pair<const OperandInfo*, const uint16_t*>> converted;
  for (const OperandInfo* info : to_convert) {
    auto* out = static_cast<uint16_t*>(scratch.take(2 * info->rows * info->k, "scaled-domain bf16 operand"));
    if (info->format() == quant::Format::kMxfp8 && !call.error_flag && !check_flag_here) {
      device_fill_async(flag, 0, sizeof(int), stream);
      check_flag_here = true;
    }
    kernels::launch_scaled_bf16({info->format(), info->data->data.ptr<const uint8_t>(),
                                 info->data->scales.ptr<const uint8_t>(), info->rows, info->k, out,
                                 flag},
                                stream);
    converted.emplace_back(info, out);
  }
  auto scaled_bf16_of = [&](const OperandInfo* info) -> const uint16_t* {
    if (info->op->scaled_bf16.data) return info->op->scaled_bf16.ptr<const uint16_t>();
    for (const auto& [i, p] : converted)
      if (i == info) return p;
    return nullptr;
  };
  float* scales_a = fp8 ? static_cast<float*>(scratch.take(4 * round_up(scale_floats, 64), "fp8 block scales")) : nullptr;
  float* epilogue_scalars = emulated ? static_cast<float*>(scratch.take(2 * sizeof(float), "epilogue scalars")) : nullptr;
  float* row_acc = acc_floats > 0 ? static_cast<float*>(scratch.take(4 * acc_floats, "row-scaled fp32 sums")) : nullptr;

  for (const CudaGroup& g : call.groups) {
    if (g.a.rows == 0 || g.b.rows == 0) continue;
    const void* c_source = g.c_source.data != nullptr && g.c_source.data != g.c.data ? g.c_source.data : nullptr;
    if (g.a.k == 0) {  // empty reduction (an expert without tokens in Wgrad)
      if (c_source != nullptr && call.beta != 0.0f) {  // C = beta * c_source: copy, then scale
        const int64_t elem = g.c.dtype == DType::kBF16 ? 2 : 4;
        FOURBIT_CUDA_CHECK(cudaMemcpy2DAsync(g.c.data, g.c.strides[0] * elem, c_source, g.c.strides[0] * elem,
                                             g.c.shape[1] * elem, g.c.shape[0], cudaMemcpyDeviceToDevice, stream));
      }
      kernels::launch_scale_matrix(g.c.data, g.c.dtype == DType::kBF16, g.c.shape[0], g.c.shape[1],
                                   g.c.strides[0], call.beta, stream);
      continue;
    }
    MatmulOperand a, b;
    switch (call.backend) {
      case Backend::kCublasBf16:
        run_matmul(plain_operand(g.a), plain_operand(g.b), g.c, &call.alpha, &call.beta, false,
                   false, stream, call.name, c_source);
        break;
      case Backend::kCublasFp8:
      case Backend::kWgmmaFp8: {  // the same operand views and converted scales for both kernels
        float* scales_b = scales_a + round_up(fp8_scale_floats(g.a), 64);
        a = fp8_operand(g.a, scales_a, stream, call.name);
        b = fp8_operand(g.b, scales_b, stream, call.name);
        if (call.backend == Backend::kCublasFp8) {
          run_matmul(a, b, g.c, &call.alpha, &call.beta, false, true, stream, call.name, c_source);
        } else {
          run_wgmma_fp8(g, a, b, c_source, call, stream);
        }
        break;
      }
      case Backend::kEmulated: {
        a = g.a.info->quantized() ? scaled_operand(g.a, scaled_bf16_of(g.a.info)) : plain_operand(g.a);
        b = g.b.info->quantized() ? scaled_operand(g.b, scaled_bf16_of(g.b.info)) : plain_operand(g.b);
        auto amax_of = [](const OperandInfo& info) -> const float* {
          return info.quantized() && info.format() == quant::Format::kNvfp4 ? info.data->amax.ptr<const float>() : nullptr;
        };
        if (row_scaled(*g.a.info)) {
          // Raw sums, then C[m, :] = alpha_eff_m * sums[m, :] (+ beta C) with A's amax of row m.
          static const float kOne = 1.0f, kZero = 0.0f;
          const TensorView acc = TensorView::contiguous(row_acc, DType::kF32, Shape{g.a.rows, g.b.rows}, Device::kCuda);
          run_matmul(a, b, acc, &kOne, &kZero, false, false, stream, call.name);
          kernels::launch_row_scaled_epilogue(
              {row_acc, g.a.rows, g.b.rows, amax_of(*g.a.info) + g.a.row0, g.a.info->config.nvfp4_global_constant(),
               amax_of(*g.b.info), g.b.info->config.nvfp4_global_constant(), call.alpha, call.beta, g.c.data,
               c_source ? c_source : g.c.data, g.c.dtype == DType::kBF16, g.c.strides[0]},
              stream);
          break;
        }
        kernels::launch_epilogue_scalars({call.alpha, call.beta, amax_of(*g.a.info),
                                          g.a.info->config.nvfp4_global_constant(), amax_of(*g.b.info),
                                          g.b.info->config.nvfp4_global_constant(), epilogue_scalars},
                                         stream);
        run_matmul(a, b, g.c, epilogue_scalars, epilogue_scalars + 1, true, false, stream, call.name,
                   c_source);
        break;
      }
      default:
        FOURBIT_CHECK(false, "{}: {} is not a CUDA backend", call.name, backend_name(call.backend));
    }
  }

  if (check_flag_here) {
    int host_flag = 0;
    FOURBIT_CUDA_CHECK(cudaMemcpyAsync(&host_flag, flag, sizeof(int), cudaMemcpyDeviceToHost, stream));
    FOURBIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    FOURBIT_CHECK((host_flag & kernels::kErrMxfp8NotExact) == 0,
                  "{}: an MXFP8 operand has a block scale code outside [3, 246]: its values are not "
                  "exact in BF16, so the exact emulation cannot multiply them (those products are "
                  "NaN in C). The block amax is below ~2^-115 or above ~2^127: rescale the tensor",
                  call.name);
  }
}

}  // namespace fourbit::gemm::detail
