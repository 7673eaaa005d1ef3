// Implementation of the error helpers declared in check.h.
#include "core/check.h"

namespace fourbit::core {

void throw_check_failure(const char* file, int line, const char* condition,
                         const std::string& message) {
  throw Error(fmt::format("{}:{}: check failed ({}): {}", file, line, condition, message));
}

const char* cuda_error_hint(int code) {
  // Codes from cudaError_t (stable across CUDA releases).
  switch (code) {
    case 2: return "out of device memory: lower the batch size or sequence length";
    case 35: return "the NVIDIA driver is older than this CUDA runtime: update the driver";
    case 100: return "no CUDA GPU is visible: run on a GPU machine, or use --device cpu";
    case 209: return "no kernel image for this GPU: rebuild with -DFOURBIT_CUDA_GENCODE matching it";
    case 700: return "illegal memory access in a kernel: rerun under compute-sanitizer";
    case 719: return "a kernel failed (launch failure): rerun under compute-sanitizer";
    default: return "";
  }
}

void throw_cuda_failure(const char* file, int line, const char* call, int code, const char* name,
                        const char* description) {
  const char* hint = cuda_error_hint(code);
  throw Error(fmt::format("{}:{}: CUDA error {} ({}: {}) in {}{}{}", file, line, code, name,
                          description, call, *hint ? "\n  hint: " : "", hint));
}

void throw_cublas_failure(const char* file, int line, const char* call, int status) {
  // cublasStatus_t values; names spelled out so that no cuBLAS library is needed for the message.
  const char* name = "CUBLAS_STATUS_UNKNOWN";
  const char* hint = "";
  switch (status) {
    case 1: name = "CUBLAS_STATUS_NOT_INITIALIZED"; hint = "create the handle after selecting the device"; break;
    case 3: name = "CUBLAS_STATUS_ALLOC_FAILED"; hint = "out of device memory for the workspace"; break;
    case 7: name = "CUBLAS_STATUS_INVALID_VALUE"; hint = "a shape, leading dimension or alignment is invalid for this GEMM"; break;
    case 8: name = "CUBLAS_STATUS_ARCH_MISMATCH"; hint = "this GEMM type is not supported on this GPU architecture"; break;
    case 11: name = "CUBLAS_STATUS_MAPPING_ERROR"; break;
    case 13: name = "CUBLAS_STATUS_EXECUTION_FAILED"; hint = "a kernel failed: rerun under compute-sanitizer"; break;
    case 14: name = "CUBLAS_STATUS_INTERNAL_ERROR"; break;
    case 15: name = "CUBLAS_STATUS_NOT_SUPPORTED"; hint = "no cuBLASLt algorithm for this type/layout/scale combination"; break;
    case 16: name = "CUBLAS_STATUS_LICENSE_ERROR"; break;
    default: break;
  }
  throw Error(fmt::format("{}:{}: cuBLAS error {} ({}) in {}{}{}", file, line, status, name, call,
                          *hint ? "\n  hint: " : "", hint));
}

}  // namespace fourbit::core
