// The gemm() and grouped_gemm() entry points: operand validation, backend selection (logged once
// per distinct selection) and dispatch to the CPU backends (gemm_cpu.cpp) or the CUDA backends
// (gemm_cublaslt.cpp). Everything that can be checked on the host is checked here, before any
// work is launched, with messages that name the GEMM and the operand.
#include "gemm/gemm_internal.h"

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"

#include <cstdlib>
#include <mutex>
#include <numeric>
#include <set>

namespace fourbit::gemm {

std::string_view backend_name(Backend b) {
  switch (b) {
    case Backend::kAuto: return "auto";
    case Backend::kCpuReference: return "cpu-reference";
    case Backend::kCpuBlas: return "cpu-blas";
    case Backend::kCublasBf16: return "cublaslt-bf16";
    case Backend::kCublasFp8: return "cublaslt-fp8";
    case Backend::kEmulated: return "emulated-bf16";
    case Backend::kWgmmaFp8: return "wgmma-fp8-block";
  }
  return "?";
}

bool backend_built(Backend b) {
  switch (b) {
    case Backend::kAuto:
    case Backend::kCpuReference: return true;
    case Backend::kCpuBlas:
#if defined(FOURBIT_WITH_BLAS)
      return true;
#else
      return false;
#endif
    case Backend::kCublasBf16:
    case Backend::kCublasFp8:
    case Backend::kEmulated:
    case Backend::kWgmmaFp8: return built_with_cuda();
  }
  return false;
}

Backend fp8_block_backend(bool b_128x128) {
  static const std::string setting = [] {
    const char* v = std::getenv("FOURBIT_GEMM_FP8_BLOCK");
    const std::string s = v == nullptr ? "" : v;
    FOURBIT_CHECK(s.empty() || s == "cublas" || s == "wgmma" || s == "wgmma-wgrad",
                  "FOURBIT_GEMM_FP8_BLOCK={}: expected cublas, wgmma or wgmma-wgrad (the kernel of "
                  "block-scaled FP8 GEMMs; wgmma-wgrad: fourbit's kernel for the 1x128 x 1x128 pair only)", s);
    return s;
  }();
  const bool wgmma = setting == "wgmma" || (setting == "wgmma-wgrad" && !b_128x128);
  return wgmma ? Backend::kWgmmaFp8 : Backend::kCublasFp8;
}

Operand Operand::dense(const TensorView& t, std::string_view name, bool transposed) {
  Operand o;
  o.plain = t;
  o.transposed = transposed;
  o.name = name;
  return o;
}

Operand Operand::quant(const quant::QuantizedTensor& q, Copy copy, std::string_view name,
                       const TensorView& scaled_bf16) {
  Operand o;
  o.quantized = &q;
  o.copy = copy;
  o.scaled_bf16 = scaled_bf16;
  o.name = name;
  return o;
}

int64_t Operand::rows() const {
  if (quantized) return copy == Copy::kRowwise ? quantized->rows : quantized->cols;
  return transposed ? plain.shape[1] : plain.shape[0];
}

int64_t Operand::k() const {
  if (quantized) return copy == Copy::kRowwise ? quantized->cols : quantized->rows;
  return transposed ? plain.shape[0] : plain.shape[1];
}

std::string Operand::describe() const {
  if (quantized) {
    return fmt::format("'{}' ({}, {} copy) [{}, {}] on {}", name, quantized->config.describe(),
                       copy == Copy::kRowwise ? "row-wise" : "column-wise", rows(), k(),
                       device_name(quantized->device));
  }
  return fmt::format("'{}' ({}{}) [{}, {}] on {}", name, dtype_name(plain.dtype),
                     transposed ? ", transposed view" : "", plain.shape.ndim == 2 ? rows() : -1,
                     plain.shape.ndim == 2 ? k() : -1, device_name(plain.device));
}

namespace detail {

std::string OperandInfo::format_label() const {
  if (!quantized()) return std::string(dtype_name(dtype));
  return config.describe();
}

OperandInfo resolve_operand(const Operand& op, std::string_view role, std::string_view gemm_name) {
  OperandInfo info;
  info.op = &op;
  info.role = std::string(role);
  if (op.quantized) {
    const quant::QuantizedTensor& q = *op.quantized;
    const bool colwise = op.copy == Copy::kColwise;
    const std::optional<quant::QuantizedData>& copy = colwise ? q.colwise : q.rowwise;
    FOURBIT_CHECK(op.plain.data == nullptr,
                  "{}: operand {} {} is both a plain tensor and a quantized bundle; give one",
                  gemm_name, role, op.name);
    FOURBIT_CHECK(copy.has_value(),
                  "{}: operand {} {} needs the {} copy of its quantized bundle, which was not "
                  "quantized; quantize it with Orientations{{.rowwise = {}, .colwise = {}}}",
                  gemm_name, role, op.describe(), colwise ? "column-wise" : "row-wise", !colwise,
                  colwise);
    info.data = &*copy;
    info.config = q.config;
    info.rows = copy->rows;
    info.k = copy->cols;
    info.device = q.device;
    info.hadamard = colwise && q.config.rht;
    info.hadamard_mask = info.hadamard ? q.config.rht_sign_mask() : 0;
    if (op.scaled_bf16.data != nullptr) {
      const TensorView& s = op.scaled_bf16;
      FOURBIT_CHECK(info.emulated_format(),
                    "{}: operand {} {}: a scaled-domain BF16 copy is only used for nvfp4 and "
                    "mxfp8 operands",
                    gemm_name, role, op.describe());
      FOURBIT_CHECK(s.dtype == DType::kBF16 && s.device == Device::kCuda && s.is_contiguous() &&
                        s.numel() == info.rows * info.k,
                    "{}: operand {} {}: its scaled-domain BF16 copy must be a contiguous bf16 CUDA "
                    "tensor of [{}, {}] (the stored layout of that copy), got {}",
                    gemm_name, role, op.describe(), info.rows, info.k, s.describe());
    }
    return info;
  }
  const TensorView& t = op.plain;
  FOURBIT_CHECK(t.data != nullptr, "{}: operand {} '{}' is empty: give a tensor or a quantized bundle",
                gemm_name, role, op.name);
  FOURBIT_CHECK(t.dtype == DType::kBF16 || t.dtype == DType::kF32 ||
                    (t.dtype == DType::kF64 && t.device == Device::kCpu),
                "{}: operand {} {} must be bf16 or f32 (f64 on the CPU), or a quantized bundle; "
                "got {}", gemm_name, role, op.describe(), dtype_name(t.dtype));
  FOURBIT_CHECK(t.shape.ndim == 2 && t.strides[1] == 1 && t.strides[0] >= t.shape[1],
                "{}: operand {} '{}' must be a matrix with unit column stride and row stride >= its "
                "columns, got {} with strides {}; fold leading dimensions into rows first",
                gemm_name, role, op.name, t.describe(), t.strides.str());
  FOURBIT_CHECK(op.scaled_bf16.data == nullptr,
                "{}: operand {} '{}' is plain: a scaled-domain BF16 copy belongs to a quantized "
                "operand", gemm_name, role, op.name);
  info.dtype = t.dtype;
  info.rows = op.rows();
  info.k = op.k();
  info.ld = t.strides[0];
  info.device = t.device;
  return info;
}

void check_output(const TensorView& c, int64_t rows, int64_t cols, Device device,
                  std::string_view gemm_name, std::string_view what) {
  FOURBIT_CHECK(c.data != nullptr, "{}: output {} is missing", gemm_name, what);
  FOURBIT_CHECK(c.dtype == DType::kF32 || c.dtype == DType::kBF16 ||
                    (c.dtype == DType::kF64 && c.device == Device::kCpu),
                "{}: output {} must be f32 or bf16 (f64 on the CPU), got {}", gemm_name, what,
                c.describe());
  FOURBIT_CHECK(c.shape.ndim == 2 && c.shape[0] == rows && c.shape[1] == cols,
                "{}: output {} must be [{}, {}] ([rows of A, rows of B]), got {}", gemm_name, what,
                rows, cols, c.describe());
  FOURBIT_CHECK(c.strides[1] == 1 && c.strides[0] >= cols,
                "{}: output {} needs unit column stride and row stride >= {}, got strides {}",
                gemm_name, what, cols, c.strides.str());
  FOURBIT_CHECK(c.device == device, "{}: output {} is on {}, the operands on {}", gemm_name, what,
                device_name(c.device), device_name(device));
}

void check_pair(const OperandInfo& a, const OperandInfo& b, std::string_view gemm_name) {
  FOURBIT_CHECK(a.k == b.k,
                "{}: A {} and B {} have different reduction lengths ({} vs {}). Operands are "
                "[rows, K] with K contiguous: Dgrad takes W's column-wise copy [K, N], Wgrad the "
                "column-wise copies of dY [N, M] and X [K, M]",
                gemm_name, a.op->describe(), b.op->describe(), a.k, b.k);
  FOURBIT_CHECK(a.device == b.device, "{}: A is on {} and B on {}; put both on one device",
                gemm_name, device_name(a.device), device_name(b.device));
  FOURBIT_CHECK(a.hadamard == b.hadamard && a.hadamard_mask == b.hadamard_mask,
                "{}: A {} and B {} are not in the same Hadamard domain along K (A: {}, B: {}); the "
                "random Hadamard transform only cancels (H H^T = I) when both Wgrad operands are "
                "transformed with the same signs: give both, or neither, rht with the same "
                "rht_signs/rht_seed",
                gemm_name, a.op->describe(), b.op->describe(),
                a.hadamard ? fmt::format("rht signs 0x{:04x}", a.hadamard_mask) : "none",
                b.hadamard ? fmt::format("rht signs 0x{:04x}", b.hadamard_mask) : "none");
  // A per-row amax scales the rows of C in the epilogue; on B it would scale C's columns, which no
  // recipe needs (recipe validation allows it on the token-side A operands only).
  FOURBIT_CHECK(!(b.quantized() && b.config.nvfp4_row_amax),
                "{}: B {} has per-row amaxes (nvfp4_row_amax); only operand A (the token-side "
                "row-wise copy: Fprop X, Dgrad dY) may carry them",
                gemm_name, b.op->describe());
}

TensorView row_slice(const TensorView& v, int64_t row0, int64_t rows) {
  TensorView s = v;
  s.data = static_cast<char*>(v.data) + dtype_bytes(v.dtype, row0 * v.strides[0]);
  s.shape[0] = rows;
  return s;
}

namespace {

// Compute capability of the current device (major * 10 + minor), read once per process.
int cuda_sm() {
  static const int sm = [] {
    const DeviceProperties p = current_device_properties();
    return p.sm_major * 10 + p.sm_minor;
  }();
  return sm;
}

// The pairs of the block-scaled FP8 kernels: an fp8-block A with 1x128 scales (not 128x128) and an
// fp8-block B (either).
bool fp8_block_pair(const OperandInfo& a, const OperandInfo& b) {
  const auto fp8_block = [](const OperandInfo& x) { return x.quantized() && x.format() == quant::Format::kFp8Block; };
  return fp8_block(a) && !a.config.block_2d && fp8_block(b);
}

Backend auto_backend(const OperandInfo& a, const OperandInfo& b, const TensorView& c,
                     std::string_view gemm_name) {
  if (a.device == Device::kCpu) {
    // float64 operands or output (finite-difference gradient checks) need the float64 reference.
    const bool f64 = a.dtype == DType::kF64 || b.dtype == DType::kF64 || c.dtype == DType::kF64;
    return backend_built(Backend::kCpuBlas) && !f64 ? Backend::kCpuBlas : Backend::kCpuReference;
  }
  FOURBIT_CHECK(built_with_cuda(),
                "{}: the operands are on cuda but this fourbit binary was built without CUDA",
                gemm_name);
  if (!a.quantized() && !b.quantized()) return Backend::kCublasBf16;
  if (a.fp8_format() || b.fp8_format()) {
    return fp8_block_pair(a, b) ? fp8_block_backend(b.config.block_2d) : Backend::kCublasFp8;
  }
  return Backend::kEmulated;
}

// Throws unless `backend` can run this pair on this device.
void check_backend(Backend backend, const OperandInfo& a, const OperandInfo& b,
                   std::string_view gemm_name) {
  const bool cpu = backend == Backend::kCpuReference || backend == Backend::kCpuBlas;
  FOURBIT_CHECK(backend_built(backend),
                "{}: backend {} is not part of this build ({}); {}", gemm_name,
                backend_name(backend), built_with_cuda() ? "CUDA build" : "CPU-only build",
                backend == Backend::kCpuBlas
                    ? "install libopenblas-dev and configure with -DFOURBIT_BLAS=ON"
                    : "rebuild with nvcc available (-DFOURBIT_CUDA=ON)");
  FOURBIT_CHECK(cpu == (a.device == Device::kCpu),
                "{}: backend {} runs on {}, but the operands are on {}", gemm_name,
                backend_name(backend), cpu ? "the CPU" : "a CUDA GPU", device_name(a.device));
  FOURBIT_CHECK(backend != Backend::kCpuBlas || (a.dtype != DType::kF64 && b.dtype != DType::kF64),
                "{}: backend cpu-blas computes in FP32; float64 operands need cpu-reference "
                "(backend auto picks it)", gemm_name);
  if (cpu) return;
  for (const OperandInfo* x : {&a, &b}) {
    FOURBIT_CHECK(x->quantized() || x->dtype == DType::kBF16,
                  "{}: operand {} {} is f32 on cuda; the CUDA backends take bf16 or quantized "
                  "operands: convert it to bf16 (or quantize it)",
                  gemm_name, x->role, x->op->describe());
  }
  switch (backend) {
    case Backend::kCublasBf16:
      FOURBIT_CHECK(!a.quantized() && !b.quantized(),
                    "{}: backend cublaslt-bf16 takes plain bf16 operands; A is {}, B is {} (use "
                    "backend auto)", gemm_name, a.format_label(), b.format_label());
      break;
    case Backend::kCublasFp8: {
      FOURBIT_CHECK(a.fp8_format() && b.fp8_format(),
                    "{}: an FP8 GEMM needs both operands in fp8 (tensor or block scaled); A {} is "
                    "{}, B {} is {}: quantize the other operand to fp8 as well, or both to the "
                    "same emulated format",
                    gemm_name, a.op->name, a.format_label(), b.op->name, b.format_label());
      FOURBIT_CHECK(a.format() == b.format(),
                    "{}: cuBLASLt cannot mix per-tensor and block FP8 scales (A {}, B {}); "
                    "quantize both operands fp8-tensor or both fp8-block",
                    gemm_name, a.format_label(), b.format_label());
      const bool block = a.format() == quant::Format::kFp8Block;
      FOURBIT_CHECK(!(block && a.config.block_2d && b.config.block_2d),
                    "{}: cuBLASLt has no 128x128 x 128x128 FP8 GEMM (A {}, B {}); quantize the "
                    "activation or gradient operand with 1x128 blocks",
                    gemm_name, a.op->name, b.op->name);
      const int sm = cuda_sm();
      FOURBIT_CHECK(block ? sm == 90 : sm >= 89,
                    "{}: {} FP8 GEMMs need {} (cuBLASLt {}); this GPU is sm_{}. {}", gemm_name,
                    block ? "block-scaled" : "per-tensor scaled",
                    block ? "a Hopper GPU (sm_90)" : "sm_89 or newer",
                    block ? "VEC128_32F / BLK128x128_32F" : "SCALAR_32F", sm,
                    block ? "On Blackwell use MXFP8 instead (no native path exists yet)" : "");
      break;
    }
    case Backend::kWgmmaFp8: {
      FOURBIT_CHECK(fp8_block_pair(a, b),
                    "{}: backend wgmma-fp8-block multiplies an fp8-block A with 1x128 scales by an "
                    "fp8-block B (1x128 or 128x128 scales); A {} is {}, B {} is {}: use backend "
                    "auto or cublaslt-fp8", gemm_name, a.op->name, a.format_label(), b.op->name, b.format_label());
      const int sm = cuda_sm();
      FOURBIT_CHECK(sm == 90,
                    "{}: backend wgmma-fp8-block runs on Hopper (sm_90a wgmma and TMA); this GPU is "
                    "sm_{}: use backend auto", gemm_name, sm);
      break;
    }
    case Backend::kEmulated:
      FOURBIT_CHECK((a.emulated_format() || b.emulated_format()) && !a.fp8_format() &&
                        !b.fp8_format(),
                    "{}: the emulated backend multiplies nvfp4 / mxfp8 operands (or one of them "
                    "with a bf16 operand); A is {}, B is {}",
                    gemm_name, a.format_label(), b.format_label());
      break;
    default: break;
  }
}

void log_selection_once(Backend backend, const OperandInfo& a, const OperandInfo& b,
                        const TensorView& c, std::string_view gemm_name) {
  const std::string line =
      fmt::format("gemm backend {}: A {}, B {}, C {} on {}", backend_name(backend),
                  a.format_label(), b.format_label(), dtype_name(c.dtype), device_name(a.device));
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(line).second) log_info("{} (first use: {})", line, gemm_name);
}

}  // namespace

Backend choose_backend(Backend requested, const OperandInfo& a, const OperandInfo& b,
                       const TensorView& c, std::string_view gemm_name) {
  const Backend backend = requested == Backend::kAuto ? auto_backend(a, b, c, gemm_name) : requested;
  check_backend(backend, a, b, gemm_name);
  log_selection_once(backend, a, b, c, gemm_name);
  return backend;
}

}  // namespace detail

using detail::OperandInfo;

Backend select_backend(const GemmArgs& args) {
  const OperandInfo a = detail::resolve_operand(args.a, "A", args.name);
  const OperandInfo b = detail::resolve_operand(args.b, "B", args.name);
  detail::check_pair(a, b, args.name);
  return args.backend == Backend::kAuto ? detail::auto_backend(a, b, args.c, args.name) : args.backend;
}

void gemm(const GemmArgs& args) {
  const OperandInfo a = detail::resolve_operand(args.a, "A", args.name);
  const OperandInfo b = detail::resolve_operand(args.b, "B", args.name);
  detail::check_pair(a, b, args.name);
  detail::check_output(args.c, a.rows, b.rows, a.device, args.name, "C");
  if (args.c_source.data != nullptr) {
    const TensorView& s = args.c_source;
    FOURBIT_CHECK(s.dtype == args.c.dtype && s.shape == args.c.shape && s.strides == args.c.strides &&
                      s.device == args.c.device,
                  "{}: c_source (the beta term's matrix) must have C's dtype, shape, strides and "
                  "device; C is {}, c_source {}", args.name, args.c.describe(), s.describe());
    FOURBIT_CHECK(s.data != args.a.plain.data && s.data != args.b.plain.data,
                  "{}: c_source may not alias an operand", args.name);
  }
  const Backend backend = detail::choose_backend(args.backend, a, b, args.c, args.name);
  if (a.device == Device::kCpu) {
    const detail::DenseOperand da = detail::materialize(a), db = detail::materialize(b);
    detail::cpu_gemm(backend, {&da, detail::whole(a), &db, detail::whole(b), args.c, args.alpha,
                               args.beta, args.c_source});
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  detail::cuda_gemm({backend, {{detail::whole(a), detail::whole(b), args.c, args.c_source}}, args.alpha,
                     args.beta, args.stream, args.name, args.workspace, args.error_flag});
#endif
}

void grouped_gemm(const GroupedGemmArgs& args) {
  const std::string_view name = args.name;
  const int64_t groups = (int64_t)args.group_sizes.size();
  FOURBIT_CHECK(groups > 0, "{}: no groups", name);
  for (int64_t g = 0; g < groups; ++g) {
    FOURBIT_CHECK(args.group_sizes[g] >= 0, "{}: group {} has a negative size {}", name, g,
                  args.group_sizes[g]);
  }
  const int64_t total = std::accumulate(args.group_sizes.begin(), args.group_sizes.end(), int64_t{0});
  const bool rows_split = args.split == GroupSplit::kRows;
  FOURBIT_CHECK((int64_t)args.b.size() == (rows_split ? groups : 1) &&
                    (int64_t)args.c.size() == (rows_split ? 1 : groups),
                "{}: a {} grouped GEMM of {} groups takes {} B operand(s) and {} output(s); got {} "
                "and {}",
                name, rows_split ? "row-split" : "reduction-split", groups,
                rows_split ? groups : 1, rows_split ? 1 : groups, args.b.size(), args.c.size());

  const OperandInfo a = detail::resolve_operand(args.a, "A", name);
  std::vector<OperandInfo> b;
  b.reserve(args.b.size());
  for (size_t i = 0; i < args.b.size(); ++i) {
    b.push_back(detail::resolve_operand(args.b[i], rows_split ? fmt::format("B[{}]", i) : "B", name));
    detail::check_pair(a, b.back(), name);
    FOURBIT_CHECK(b.back().rows == b.front().rows,
                  "{}: every expert operand must have the same rows (N); B[0] has {}, B[{}] {}",
                  name, b.front().rows, i, b.back().rows);
  }
  FOURBIT_CHECK((rows_split ? a.rows : a.k) == total,
                "{}: the group sizes add up to {} tokens, but A {} has {} along the {} dimension",
                name, total, a.op->describe(), rows_split ? a.rows : a.k,
                rows_split ? "row" : "reduction");
  if (rows_split) {
    detail::check_output(args.c[0], a.rows, b.front().rows, a.device, name, "C");
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      detail::check_output(args.c[g], a.rows, b.front().rows, a.device, name, fmt::format("C[{}]", g));
    }
  }
  // The Hadamard transform is applied per 16 tokens: a group must consist of whole 16-blocks for
  // the transforms of its two operands to cancel.
  if (!rows_split && a.hadamard) {
    for (int64_t g = 0; g < groups; ++g) {
      FOURBIT_CHECK(args.group_sizes[g] % 16 == 0,
                    "{}: group {} has {} tokens; with RHT-transformed Wgrad operands every group "
                    "must be a multiple of 16 tokens (pad each expert's tokens)",
                    name, g, args.group_sizes[g]);
    }
  }
  Backend backend = detail::choose_backend(args.backend, a, b.front(), args.c.front(), name);
  for (size_t i = 1; i < b.size(); ++i) {
    const Backend other = detail::choose_backend(args.backend, a, b[i], args.c.front(), name);
    FOURBIT_CHECK(other == backend, "{}: B[0] selects backend {} but B[{}] selects {}: give every "
                  "expert weight the same format", name, backend_name(backend), i, backend_name(other));
  }

  // The group slices.
  std::vector<detail::OperandSlice> a_slices, b_slices;
  std::vector<TensorView> c_views;
  int64_t offset = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = args.group_sizes[g];
    if (rows_split) {
      a_slices.push_back({&a, offset, n, 0, a.k});
      b_slices.push_back(detail::whole(b[g]));
      c_views.push_back(detail::row_slice(args.c[0], offset, n));
    } else {
      a_slices.push_back({&a, 0, a.rows, offset, n});
      b_slices.push_back({&b[0], 0, b[0].rows, offset, n});
      c_views.push_back(args.c[g]);
    }
    offset += n;
  }

  if (a.device == Device::kCpu) {
    const detail::DenseOperand da = detail::materialize(a);
    std::vector<detail::DenseOperand> db;
    for (const OperandInfo& x : b) db.push_back(detail::materialize(x));
    for (int64_t g = 0; g < groups; ++g) {
      if (rows_split && args.group_sizes[g] == 0) continue;
      detail::cpu_gemm(backend, {&da, a_slices[g], &db[rows_split ? g : 0], b_slices[g],
                                 c_views[g], args.alpha, args.beta});
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  detail::CudaGemmCall call{backend, {}, args.alpha, args.beta, args.stream, name, args.workspace,
                            args.error_flag};
  for (int64_t g = 0; g < groups; ++g) {
    if (rows_split && args.group_sizes[g] == 0) continue;
    call.groups.push_back({a_slices[g], b_slices[g], c_views[g]});
  }
  detail::cuda_gemm(call);
#endif
}

}  // namespace fourbit::gemm
