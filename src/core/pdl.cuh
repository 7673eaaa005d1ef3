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
#pragma once

namespace fourbit::core {

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

}  // namespace fourbit::core
