// Host side of the embedding: checks, dispatch, and the CPU reference (templated over f32/f64).
#include "ops/embedding.h"

#include "ops/arg_checks.h"
#include "ops/error_flags.h"

#include <limits>

#if defined(FOURBIT_WITH_CUDA)
#include "ops/embedding_kernels.h"
#endif

namespace fourbit::ops {
namespace {

using detail::check_dtype;
using detail::check_shape;
using detail::present;

template <typename T>
void forward_reference(T* out, const int32_t* ids, const T* table, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = table[(int64_t)ids[n] * C + c];
}

template <typename T>
void backward_reference(T* dtable, const T* dout, const int32_t* ids, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) dtable[(int64_t)ids[n] * C + c] += dout[n * C + c];
}

void check_ids_cpu(std::string_view op, const TensorView& ids, int64_t V) {
  const int32_t* p = ids.ptr<const int32_t>();
  for (int64_t n = 0; n < ids.numel(); ++n) {
    FOURBIT_CHECK(p[n] >= 0 && p[n] < V,
                  "{}: ids[{}] = {} is outside the vocabulary [0, {}); check the tokenizer's "
                  "vocabulary size against the model's",
                  op, n, p[n], V);
  }
}

#if defined(FOURBIT_WITH_CUDA)
kernels::FloatType float_type(const TensorView& t) {
  return t.dtype == DType::kBF16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
}

void report(std::string_view op, int bits, int64_t V) {
  FOURBIT_CHECK((bits & kErrIndexOutOfRange) == 0,
                "{}: a token id lies outside the vocabulary [0, {}) (its row was {}); check the "
                "tokenizer's vocabulary size against the model's",
                op, V, op == "embedding_forward" ? "written as zeros" : "skipped");
}
#endif

// [V, C] of a table-shaped tensor.
std::pair<int64_t, int64_t> table_shape(std::string_view op, std::string_view name,
                                        const TensorView& t) {
  FOURBIT_CHECK(t.shape.ndim == 2, "{}: {} must be [V, C], got {}", op, name,
                present(t) ? t.describe() : "none");
  return {t.shape[0], t.shape[1]};
}

}  // namespace

void embedding_forward(const TensorView& out, const TensorView& ids, const TensorView& table,
                       int* error_flag, void* stream) {
  constexpr std::string_view op = "embedding_forward";
  const Device dev = detail::common_device(op, {{"out", &out}, {"ids", &ids}, {"table", &table}});
  const auto [V, C] = table_shape(op, "table", table);
  FOURBIT_CHECK(ids.shape.ndim == 1, "{}: ids must be [N], got {}", op, ids.describe());
  const int64_t N = ids.shape[0];
  check_shape(op, "ids", ids, {N});
  check_dtype(op, "ids", ids, {DType::kI32});
  check_shape(op, "table", table, {V, C});
  check_shape(op, "out", out, {N, C});
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"out", &out}, {"table", &table}});
    check_ids_cpu(op, ids, V);
    if (dt == DType::kF64) {
      forward_reference(out.ptr<double>(), ids.ptr<const int32_t>(), table.ptr<const double>(), N,
                        C);
    } else {
      forward_reference(out.ptr<float>(), ids.ptr<const int32_t>(), table.ptr<const float>(), N, C);
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "table", table, {DType::kBF16, DType::kF32});
  check_dtype(op, "out", out, {DType::kBF16, DType::kF32});
  kernels::EmbeddingForwardArgs a{};
  a.out = out.data;
  a.ids = ids.ptr<const int32_t>();
  a.table = table.data;
  a.out_type = float_type(out);
  a.table_type = float_type(table);
  a.n_tokens = N;
  a.vocab = V;
  a.cols = C;
  detail::DeviceFlag flag(error_flag, stream);
  a.error_flag = flag.get();
  kernels::launch_embedding_forward(a, static_cast<cudaStream_t>(stream));
  report(op, flag.finish(), V);
#else
  (void)error_flag;
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

int64_t embedding_backward_workspace_bytes(int64_t n_tokens, int64_t vocab, Device device) {
  FOURBIT_CHECK(n_tokens >= 0 && n_tokens <= std::numeric_limits<int32_t>::max() && vocab >= 1 &&
                    vocab < std::numeric_limits<int32_t>::max(),
                "embedding_backward_workspace_bytes: need 0 <= n_tokens < 2^31 and 1 <= vocab < "
                "2^31 - 1, got {} and {}",
                n_tokens, vocab);
  if (device == Device::kCpu) return 0;
#if defined(FOURBIT_WITH_CUDA)
  return kernels::embedding_backward_workspace_bytes(n_tokens, vocab);
#else
  detail::no_cuda_build("embedding_backward_workspace_bytes");
#endif
}

void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids,
                        const TensorView& workspace, int* error_flag, void* stream) {
  constexpr std::string_view op = "embedding_backward";
  const Device dev =
      detail::common_device(op, {{"dtable", &dtable}, {"dout", &dout}, {"ids", &ids}});
  const auto [V, C] = table_shape(op, "dtable", dtable);
  FOURBIT_CHECK(ids.shape.ndim == 1, "{}: ids must be [N], got {}", op, ids.describe());
  const int64_t N = ids.shape[0];
  check_shape(op, "ids", ids, {N});
  check_dtype(op, "ids", ids, {DType::kI32});
  check_shape(op, "dtable", dtable, {V, C});
  check_shape(op, "dout", dout, {N, C});
  if (dev == Device::kCpu) {
    const DType dt = detail::cpu_float_dtype(op, {{"dtable", &dtable}, {"dout", &dout}});
    check_ids_cpu(op, ids, V);
    if (dt == DType::kF64) {
      backward_reference(dtable.ptr<double>(), dout.ptr<const double>(), ids.ptr<const int32_t>(),
                         N, C);
    } else {
      backward_reference(dtable.ptr<float>(), dout.ptr<const float>(), ids.ptr<const int32_t>(), N,
                         C);
    }
    return;
  }
#if defined(FOURBIT_WITH_CUDA)
  check_dtype(op, "dtable", dtable, {DType::kF32});
  check_dtype(op, "dout", dout, {DType::kBF16, DType::kF32});
  const int64_t need = embedding_backward_workspace_bytes(N, V, Device::kCuda);
  FOURBIT_CHECK(need == 0 || (present(workspace) && workspace.device == Device::kCuda &&
                              workspace.is_contiguous() && workspace.nbytes() >= need),
                "{}: workspace must be a contiguous CUDA tensor of at least {} bytes "
                "(embedding_backward_workspace_bytes({}, {}, cuda)), got {}",
                op, need, N, V, present(workspace) ? workspace.describe() : "none");
  kernels::EmbeddingBackwardArgs a{};
  a.dtable = dtable.ptr<float>();
  a.dout = dout.data;
  a.ids = ids.ptr<const int32_t>();
  a.dout_type = float_type(dout);
  a.n_tokens = N;
  a.vocab = V;
  a.cols = C;
  a.workspace = workspace.data;
  detail::DeviceFlag flag(error_flag, stream);
  a.error_flag = flag.get();
  kernels::launch_embedding_backward(a, static_cast<cudaStream_t>(stream));
  report(op, flag.finish(), V);
#else
  (void)workspace;
  (void)error_flag;
  (void)stream;
  detail::no_cuda_build(op);
#endif
}

}  // namespace fourbit::ops
