// Token embedding: a row lookup in the [V, C] table, and its backward, a scatter-add of the output
// gradient into the table's gradient. N = tokens (B*T), V = vocabulary, C = d_model.
//
// Dtypes. CPU reference: out, table, dout, dtable all f32 or all f64. CUDA: table bf16 or f32 and
// out bf16 or f32 (independently; the value passes through FP32, so bf16 -> f32 is exact); dout
// bf16 or f32; dtable f32. ids i32. Contiguous tensors.
//
// Out-of-range ids. CPU: an error naming the token. CUDA: kernels cannot throw; they set
// kErrIndexOutOfRange in the error flag (ops/error_flags.h), write a zero row (forward) or skip
// the token (backward). error_flag: null -> an internal flag, checked synchronously (throws); a
// device int -> OR-ed into asynchronously, for the caller to read once per step. Ignored on the
// CPU.
//
// CUDA backward, deterministic without float atomics: the (id, token) pairs are radix-sorted by id
// with CUB (a stable sort, so the tokens of one id stay in increasing order); then one warp per
// (run of equal ids, 256-column slice) sums its tokens' dout rows in token order and adds the sum
// to the id's dtable row. Each dtable row is owned by exactly one warp per slice: no races, and
// the same inputs give the same bits. Cost: the sort (~N * 16 bytes of traffic per pass) plus one
// read of dout and one read-modify-write of the touched dtable rows. A very frequent id (e.g. a
// padding token that is not ignored) is summed by one warp per slice, serially.
#pragma once

#include "core/tensor.h"

#include <cstdint>

namespace fourbit::ops {

// out[n, :] = table[ids[n], :]
// out:   [N, C]  overwritten
// ids:   [N] i32, each in [0, V)
// table: [V, C]
void embedding_forward(const TensorView& out, const TensorView& ids, const TensorView& table,
                       int* error_flag = nullptr, void* stream = nullptr);

// Bytes of workspace embedding_backward needs on `device`: 0 on the CPU; on CUDA the sort keys,
// values and CUB's temporary storage (asks CUB, so a CUDA device must be present).
int64_t embedding_backward_workspace_bytes(int64_t n_tokens, int64_t vocab, Device device);

// dtable[v, :] += sum over n with ids[n] == v of dout[n, :]
// dtable:    [V, C]  ACCUMULATED (a parameter gradient; f32 on CUDA)
// dout:      [N, C]
// ids:       [N] i32, each in [0, V)
// workspace: CUDA: any dtype and alignment, contiguous, at least
//            embedding_backward_workspace_bytes(N, V, Device::kCuda) bytes; CPU: ignored.
// N < 2^31 and V < 2^31 - 1 on CUDA.
void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids,
                        const TensorView& workspace, int* error_flag = nullptr,
                        void* stream = nullptr);

}  // namespace fourbit::ops
