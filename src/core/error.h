// fourbit::Error and the CUDA / cuBLAS error-check macros, without any formatting library so
// that nvcc-compiled files (.cu) can include it. FOURBIT_CHECK (with a formatted message) is in
// core/check.h, for host code.
//
// FOURBIT_CUDA_CHECK / FOURBIT_CUBLAS_CHECK wrap every CUDA runtime and cuBLAS(Lt) call and throw
// fourbit::Error with file:line, the call, the error name and a hint for the common failures.
#pragma once

#include <stdexcept>
#include <string>

namespace fourbit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace core {
[[noreturn]] void throw_check_failure(const char* file, int line, const char* condition,
                                      const std::string& message);
[[noreturn]] void throw_cuda_failure(const char* file, int line, const char* call, int code,
                                     const char* name, const char* description);
[[noreturn]] void throw_cublas_failure(const char* file, int line, const char* call, int status);
// Hint for a CUDA runtime error code: what the user can do about it ("" if none).
const char* cuda_error_hint(int code);
}  // namespace core

}  // namespace fourbit

#if defined(FOURBIT_WITH_CUDA)
#include <cuda_runtime_api.h>
#define FOURBIT_CUDA_CHECK(call)                                                                \
  do {                                                                                          \
    cudaError_t fourbit_err_ = (call);                                                          \
    if (fourbit_err_ != cudaSuccess) [[unlikely]] {                                             \
      ::fourbit::core::throw_cuda_failure(__FILE__, __LINE__, #call, (int)fourbit_err_,        \
                                          cudaGetErrorName(fourbit_err_),                       \
                                          cudaGetErrorString(fourbit_err_));                    \
    }                                                                                           \
  } while (0)
// After a kernel launch: catches launch-configuration errors without synchronizing.
#define FOURBIT_CUDA_CHECK_LAUNCH() FOURBIT_CUDA_CHECK(cudaGetLastError())
#define FOURBIT_CUBLAS_CHECK(call)                                                              \
  do {                                                                                          \
    int fourbit_status_ = (int)(call);                                                          \
    if (fourbit_status_ != 0) [[unlikely]] {                                                    \
      ::fourbit::core::throw_cublas_failure(__FILE__, __LINE__, #call, fourbit_status_);       \
    }                                                                                           \
  } while (0)
#endif
