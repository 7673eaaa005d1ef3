// Programmatic dependent launch (PDL, sm_90 and later), the device side. A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in the
// stream is still running: once every CTA of that kernel has called pdl_allow_dependents() (or
// exited). Such a kernel must call pdl_wait_for_producer() before it reads anything the earlier
// kernels wrote or writes anything they read; the wait returns when the producer has completed and
// its memory is visible. Work that touches only data no kernel of the stream writes (weights) may
// go before the wait: that is the point, the decode GEMV's weight loads overlap the kernel before.
// Invariant: a kernel launched with the attribute calls pdl_wait_for_producer() on every path
// before it exits, so completion stays transitive along the stream. pdl_allow_dependents() is
// only a hint and is safe in any kernel. Both compile to nothing below sm_90.
//
// Host side: launch_pdl() launches a kernel with the attribute, unless the environment sets
// FOURBIT_PDL=0 (read once per process; for A/B measurements and for ruling PDL out when
// debugging). FOURBIT_PDL=no-quant keeps it on except for the decode activation quantizer (a
// diagnostic: decode_gemv_kernels.cu). Kernels launched through it must follow the invariant above.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string_view>
#include <utility>

namespace fourbit::core {

// FOURBIT_PDL, read once: unset or anything but "0" means on.
inline std::string_view pdl_setting() {
  static const std::string_view setting = [] {
    const char* v = std::getenv("FOURBIT_PDL");
    return std::string_view(v == nullptr ? "1" : v);
  }();
  return setting;
}

inline bool pdl_enabled() { return pdl_setting() != "0"; }

// How launch_pdl launches: the PDL attribute unless `pdl` is false (default: pdl_enabled()), and
// with cluster_y > 1 clusters of (1, cluster_y, 1) CTAs.
struct PdlLaunch {
  dim3 grid, block;
  size_t smem_bytes = 0;
  unsigned cluster_y = 1;
  bool pdl = pdl_enabled();
};

// kernel<<<grid, block, smem_bytes, stream>>>(args...) with the attributes of `how`; returns the
// launch's error (check it with FOURBIT_CUDA_CHECK).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(const PdlLaunch& how, cudaStream_t stream, void (*kernel)(KernelArgs...), Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = how.grid;
  config.blockDim = how.block;
  config.dynamicSmemBytes = how.smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (how.cluster_y > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = 1;
    attrs[n].val.clusterDim.y = how.cluster_y;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (how.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attrs;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// The common case: kernel<<<grid, block, smem_bytes, stream>>>(args...) with the PDL attribute.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                       cudaStream_t stream, Args&&... args) {
  return launch_pdl(PdlLaunch{grid, block, smem_bytes}, stream, kernel, std::forward<Args>(args)...);
}

#if defined(__CUDACC__)
__device__ __forceinline__ void pdl_wait_for_producer() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#endif  // __CUDACC__

}  // namespace fourbit::core
