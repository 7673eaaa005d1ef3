// Expert parallelism for the routed experts of an MoE block: the E experts are split into
// contiguous ranges over the ranks of a communicator; every rank routes its own tokens (the router
// is replicated, as in data parallelism), sends each token's row to the rank that owns its expert
// (all_to_allv), runs its local experts on what it received, sends the results back (all_to_allv)
// and combines them with the gate weights. Same math as the single-rank block (model.cpp,
// forward_moe / backward_ffn: the routed part), built from the same ops (ops/moe.h) and the same
// grouped expert GEMMs (model/expert_linear.h).
//
// Expert ranges (ExpertPartition): rank r owns experts [first[r], first[r + 1]); when E is not a
// multiple of the number of ranks R the first E % R ranks own one expert more (uneven ranges,
// allowed); E < R is an error (a rank would own no expert).
//
// Forward, on every rank (N tokens, k slots per token, C channels, Fe expert width):
//   1. plan A = moe_plan(expert_ids, row_align 1): the N k slots sorted by GLOBAL expert id
//      (stable: token order, then slot order). Experts of a rank are contiguous, so the rows for
//      destination rank d are one contiguous block: x_send [N k, C] = permute(x, plan A).
//   2. exchange the per-expert counts (all_to_allv of i64), then the rows: x_recv [M, C], blocks
//      by source rank, within a block by local expert, within an expert in the source's order.
//   3. plan B = moe_plan(local expert id of every received row, row_align of the recipe): groups
//      the received rows by local expert (stable: source rank, then source order; which is the
//      order of a single rank holding all ranks' tokens one after another), padded as the model
//      pads its groups. x_local [Rb, C] = permute(x_recv, plan B).
//   4. the local experts: h = expert_fprop(up), a = swiglu(h), y_local = expert_fprop(down).
//   5. y_recv [M, C] = the rows of y_local in received order (moe_permute_backward of plan B with
//      one slot per row is that gather); all_to_allv back: y_send [N k, C] in plan A's order.
//   6. y [N, C] = moe_unpermute(y_send, gates, plan A)  (sum over the k slots of gate * row).
// Backward: the same path in reverse (unpermute backward gives d_gates and the rows' gradients,
// which travel to the experts' owners; expert Dgrad/Wgrad there; the input gradients travel back
// and are summed over each token's slots).
//
// Tensors: x, y, dy, dx and the permuted buffers in one activation dtype (CPU: f32 or f64; CUDA:
// bf16 or f32); gates, d_gates: [N, k] (CPU: that dtype; CUDA: f32); expert ids i32 [N, k];
// local weights w_up [E_local, 2 Fe, C], w_down [E_local, C, Fe] and their gradients (master
// dtype). Every buffer of a call lives on comm.device(). Calls allocate their temporaries and
// synchronize (the counts go through the host); every rank must call forward/backward together.
// A rank may receive no rows at all (its experts got no tokens): it then skips the expert GEMMs.
//
// In a model: ExpertParallelModel (below) is the model::RoutedExperts of one rank, one
// ExpertParallelMoe per MoE block; dist::DataParallel attaches it (DataParallelOptions::
// expert_parallel, `fourbit pretrain --expert-parallel`). Stochastic rounding of the expert GEMMs
// draws the same streams as the one-rank model (LinearOptions per block and GEMM), but over the
// rows and local expert indices of this layout, so quantized recipes match the one-rank run in
// distribution, not bit for bit (BF16 matches to float summation order).
#pragma once

#include "dist/communicator.h"
#include "gemm/linear.h"
#include "model/config.h"
#include "model/model.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fourbit::dist {

struct ExpertPartition {
  int n_experts = 0;
  std::vector<int> first;  // [world + 1]
  // Contiguous ranges, the first n_experts % world ranks one expert larger; throws when
  // n_experts < world, naming both.
  static ExpertPartition contiguous(int n_experts, int world);
  int world() const { return (int)first.size() - 1; }
  int n_local(int rank) const { return first[(size_t)rank + 1] - first[(size_t)rank]; }
  int owner(int expert) const;
};

struct ExpertParallelRecipes {
  gemm::LinearRecipe up, down;  // the block's expert_up and expert_down recipes
};

class ExpertParallelMoe {
 public:
  ExpertParallelMoe(Communicator& comm, int n_experts, ExpertParallelRecipes recipes);

  const ExpertPartition& partition() const { return partition_; }
  int first_local_expert() const { return partition_.first[(size_t)comm_.rank()]; }
  int n_local_experts() const { return partition_.n_local(comm_.rank()); }

  // y [N, C] (overwritten) = the routed experts' output for this rank's tokens. x [N, C], expert_ids
  // i32 [N, k] (global expert ids), gates [N, k], w_up [E_local, 2 Fe, C], w_down [E_local, C, Fe]
  // (model::expert_range of the stacked weights). Keeps what the backward needs (the views x,
  // gates, w_* must stay valid until then). `options` are the expert_up GEMMs' (stream, backend,
  // stochastic-rounding streams), `down_options` the expert_down GEMMs' (null: `options`).
  void forward(const TensorView& x, const TensorView& expert_ids, const TensorView& gates,
               const TensorView& w_up, const TensorView& w_down, const TensorView& y,
               const gemm::LinearOptions& options = {},
               const gemm::LinearOptions* down_options = nullptr);
  // The gradient of the last forward: dx [N, C] and d_gates [N, k] are overwritten; dw_up
  // [E_local, 2 Fe, C] and dw_down [E_local, C, Fe] ACCUMULATE (+=) the gradients of the local
  // experts over the tokens of every rank.
  void backward(const TensorView& dy, const TensorView& dx, const TensorView& d_gates,
                const TensorView& dw_up, const TensorView& dw_down,
                const gemm::LinearOptions& options = {},
                const gemm::LinearOptions* down_options = nullptr);

  // Rows this rank's experts processed in the last forward (M), and the per-local-expert counts.
  int64_t received_rows() const { return m_rows_; }
  const std::vector<int32_t>& local_counts() const { return local_counts_; }

 private:
  Communicator& comm_;
  ExpertPartition partition_;
  ExpertParallelRecipes recipes_;
  int row_align_ = 8, rows_tile_ = 1;
  // The last forward.
  bool have_forward_ = false;
  int64_t n_tokens_ = 0, top_k_ = 0, channels_ = 0, expert_ff_ = 0;
  TensorView w_up_, w_down_, gates_;
  Tensor offsets_a_, slot_rows_a_, row_slots_a_;  // plan A: i32 [E + 1], [N, k], [N k]
  Tensor offsets_b_, slot_rows_b_, row_slots_b_;  // plan B: i32 [E_local + 1], [M, 1], [Rb]
  std::vector<int64_t> send_rows_, recv_rows_;     // [world] rows to / from each rank
  int64_t m_rows_ = 0, rows_b_ = 0;                // received rows; rows of the local groups
  std::vector<int32_t> local_counts_;              // [E_local]
  std::vector<int64_t> group_sizes_;               // [E_local], padded, summing to rows_b_
  Tensor x_local_, h_local_, act_local_;           // [Rb, C], [Rb, 2 Fe], [Rb, Fe]
  Tensor y_send_;                                  // [N k, C] the expert outputs in plan A order
};

// model::RoutedExperts over a communicator: one ExpertParallelMoe per MoE block of a model (each
// keeps its block's forward for the backward), rebuilt when the block's expert recipes change
// (Model::set_recipe, another training stage). Every rank must attach one to its model and run
// the same forwards and backwards (train::Trainer keeps the ranks in step, evaluation included).
class ExpertParallelModel final : public model::RoutedExperts {
 public:
  // Throws when the model is not MoE or has fewer experts than the communicator has ranks.
  ExpertParallelModel(Communicator& comm, const model::ModelConfig& config);

  int first_local_expert() const override { return partition_.first[(size_t)comm_.rank()]; }
  int n_local_experts() const override { return partition_.n_local(comm_.rank()); }
  const ExpertPartition& partition() const { return partition_; }
  // Rows the local experts have processed in block moe_index, over every forward so far (the
  // tokens of every rank that chose them).
  int64_t rows_processed(int moe_index) const;

  void forward(int moe_index, const TensorView& x, const TensorView& expert_ids,
               const TensorView& gates, const TensorView& w_up, const TensorView& w_down,
               const TensorView& y, const gemm::LinearRecipe& up_recipe,
               const gemm::LinearRecipe& down_recipe, const gemm::LinearOptions& up,
               const gemm::LinearOptions& down) override;
  void backward(int moe_index, const TensorView& dy, const TensorView& dx,
                const TensorView& d_gates, const TensorView& dw_up, const TensorView& dw_down,
                const gemm::LinearOptions& up, const gemm::LinearOptions& down) override;

 private:
  struct Block {
    std::string recipes;  // up and down LinearRecipe::describe() of `moe`
    std::unique_ptr<ExpertParallelMoe> moe;
    int64_t rows = 0;  // rows_processed
  };
  Block& block(int moe_index);

  Communicator& comm_;
  int n_experts_ = 0;
  ExpertPartition partition_;
  std::vector<Block> blocks_;  // [n_moe_layers]
};

}  // namespace fourbit::dist
