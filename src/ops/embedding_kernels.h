// Launch interface of the embedding kernels (embedding_kernels.cu), used by embedding.cpp. Plain
// arguments only; validation and messages live on the host side.
#pragma once

#include "ops/kernel_types.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fourbit::ops::kernels {

struct EmbeddingForwardArgs {
  void* out;             // [N, C] out_type
  const int32_t* ids;    // [N]
  const void* table;     // [V, C] table_type
  FloatType out_type, table_type;
  int64_t n_tokens, vocab, cols;
  int* error_flag;       // device int: kErrIndexOutOfRange
};
void launch_embedding_forward(const EmbeddingForwardArgs& a, cudaStream_t stream);

// Workspace of the backward for n_tokens < 2^31 and this vocabulary (asks CUB for its part).
int64_t embedding_backward_workspace_bytes(int64_t n_tokens, int64_t vocab);

struct EmbeddingBackwardArgs {
  float* dtable;         // [V, C]
  const void* dout;      // [N, C] dout_type
  const int32_t* ids;    // [N]
  FloatType dout_type;
  int64_t n_tokens, vocab, cols;
  void* workspace;       // embedding_backward_workspace_bytes(n_tokens, vocab) bytes, 256-aligned
  int* error_flag;
};
void launch_embedding_backward(const EmbeddingBackwardArgs& a, cudaStream_t stream);

}  // namespace fourbit::ops::kernels
