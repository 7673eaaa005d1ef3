// Host/device qualifiers so that one header compiles under g++ and nvcc alike.
// Code marked FOURBIT_HD must give bit-identical results on the CPU and on the GPU: it uses only
// integer arithmetic and the explicitly rounded FP32 helpers in formats/fp_ops.h.
#pragma once

#if defined(__CUDACC__)
#define FOURBIT_HD __host__ __device__ __forceinline__
#define FOURBIT_DEVICE_CODE_PATH 1
#else
#define FOURBIT_HD inline
#endif
