// Training-step benchmark per recipe and shape (bench.h).
#include "train/bench.h"

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/model.h"
#include "train/optimizer.h"
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <fstream>

namespace fourbit::train {

std::vector<TrainBenchRow> run_train_bench(const TrainBenchOptions& o) {
  FOURBIT_CHECK(o.steps >= 1 && o.warmup >= 0, "bench train: --steps must be >= 1 and --warmup "
                ">= 0, got {} and {}", o.steps, o.warmup);
  if (o.device == Device::kCuda) {
    FOURBIT_CHECK(cuda_device_count() > 0,
                  "bench train needs a CUDA GPU ({}); --device cpu runs small presets for testing",
                  built_with_cuda() ? "none found" : "this build has no CUDA");
  }
  std::vector<TrainBenchRow> rows;
  for (const std::string& name : o.presets) {
    model::ModelConfig c = model::preset(name);
    model::apply_sets(c, o.sets);
    const int T = o.seq_len > 0 ? o.seq_len : std::min(1024, c.max_seq);
    const int64_t n_params = model::ParamTable::build(c).n_params();
    const int B = o.batch_size > 0 ? o.batch_size : n_params > 400'000'000 ? 16 : 32;
    FOURBIT_CHECK(T <= c.max_seq, "bench train: --seq-len {} exceeds {}'s max_seq {}", T, name,
                  c.max_seq);
    model::ModelOptions mo;
    mo.device = o.device;
    mo.max_batch = B;
    mo.max_seq = T;
    mo.keep_wgrad_inputs = o.keep_wgrad_inputs;
    mo.recompute_activations = o.recompute;
    // Random tokens (uniform over the vocabulary), fixed for all steps and recipes.
    Tensor tokens = Tensor::empty({B, T}, DType::kI32, Device::kCpu);
    Tensor targets = Tensor::empty({B, T}, DType::kI32, Device::kCpu);
    const RandomStream rs{1234, 0x7a1e};
    for (int64_t i = 0; i < (int64_t)B * T; ++i) {
      tokens.ptr<int32_t>()[i] = (int32_t)(rs.block((uint64_t)i).v[0] % (uint32_t)c.vocab);
      targets.ptr<int32_t>()[i] = (int32_t)(rs.block((uint64_t)i).v[1] % (uint32_t)c.vocab);
    }
    std::unique_ptr<model::Model> m;
    for (const std::string& rname : o.recipes) {
      const recipe::ResolvedRecipe rr = recipe::resolve(recipe::preset(rname), c.recipe_shape());
      if (!m) {
        log_info("bench train: building {} ({} parameters), B {} x T {}", name, n_params, B, T);
        m = std::make_unique<model::Model>(c, rr, mo);
      } else {
        m->set_recipe(rr);
      }
      AdamW opt(*m, AdamWConfig{});
      if (o.device == Device::kCuda) {
        device_synchronize();
        reset_device_memory_peak();
      }
      std::vector<double> ms;
      double loss = 0;
      int64_t saved_bytes = 0;
      for (int s = 0; s < o.warmup + o.steps; ++s) {
        const auto t0 = std::chrono::steady_clock::now();
        m->zero_grads();
        model::ForwardOptions fo;
        fo.step = (uint64_t)s;
        fo.check_finite = false;
        fo.loss_gradient_scale = 1.0;  // as the trainer: the loss gradient in the forward
        loss = m->forward(tokens, targets, fo).loss;
        saved_bytes = m->saved_wgrad_input_bytes();
        m->backward();
        opt.step(1e-5);  // reads the norm: synchronizes
        const double dt = std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - t0).count();
        if (s >= o.warmup) ms.push_back(dt);
      }
      std::sort(ms.begin(), ms.end());
      TrainBenchRow r;
      r.preset = name;
      r.recipe = rname;
      r.batch_size = B;
      r.seq_len = T;
      r.params = n_params;
      r.step_ms = ms[ms.size() / 2];
      r.tokens_per_s = (double)B * T / (r.step_ms / 1e3);
      const int64_t VC = (int64_t)c.vocab * c.d_model;
      const double matmul = (double)m->table().n_active_params() - (c.tied_embeddings ? 0 : VC);
      const double flops_per_token = 6.0 * matmul + 6.0 * c.n_layers * (double)T * c.d_model;
      r.mfu = o.device == Device::kCuda ? r.tokens_per_s * flops_per_token / kPeakFlops : 0;
      r.peak_gib = o.device == Device::kCuda
                       ? (double)device_memory_stats().used_peak / (1024.0 * 1024 * 1024)
                       : 0;
      constexpr double kGiB = 1024.0 * 1024 * 1024;
      r.arena_gib = (double)m->activation_bytes() / kGiB;
      r.saved_gib = (double)saved_bytes / kGiB;
      r.loss = loss;
      log_info("bench train: {} {}: {:.1f} ms/step, {:.0f} tokens/s, MFU {:.1f}%, peak {:.2f} GiB "
               "(activation arena {:.2f}, quantized Wgrad inputs {:.2f})",
               name, rname, r.step_ms, r.tokens_per_s, 100 * r.mfu, r.peak_gib, r.arena_gib, r.saved_gib);
      rows.push_back(r);
    }
  }
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    FOURBIT_CHECK(f.good(), "bench train: cannot write '{}'", o.csv_path);
    f << "preset,recipe,batch,seq_len,params,step_ms,tokens_per_s,mfu,peak_gib,loss,arena_gib,saved_gib\n";
    for (const TrainBenchRow& r : rows) {
      f << fmt::format("{},{},{},{},{},{:.3f},{:.0f},{:.4f},{:.3f},{:.4f},{:.4f},{:.4f}\n", r.preset,
                       r.recipe, r.batch_size, r.seq_len, r.params, r.step_ms, r.tokens_per_s, r.mfu,
                       r.peak_gib, r.loss, r.arena_gib, r.saved_gib);
    }
    FOURBIT_CHECK(f.good(), "bench train: failed writing '{}'", o.csv_path);
  }
  return rows;
}

std::string train_bench_table(const std::vector<TrainBenchRow>& rows) {
  std::string out = fmt::format("{:<12} {:<8} {:>4} {:>6} {:>10} {:>12} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
                                "preset", "recipe", "B", "T", "ms/step", "tokens/s", "MFU",
                                "peak GiB", "arena", "saved X", "vs bf16", "mem");
  out += std::string(out.size() - 1, '-') + "\n";
  for (const TrainBenchRow& r : rows) {
    const TrainBenchRow* base = nullptr;
    for (const TrainBenchRow& b : rows)
      if (b.preset == r.preset && b.recipe == "bf16") base = &b;
    out += fmt::format("{:<12} {:<8} {:>4} {:>6} {:>10.2f} {:>12.0f} {:>6.1f}% {:>9.2f} {:>9.2f} {:>9.2f} {:>9} {:>9}\n",
                       r.preset, r.recipe, r.batch_size, r.seq_len, r.step_ms, r.tokens_per_s,
                       100 * r.mfu, r.peak_gib, r.arena_gib, r.saved_gib,
                       base ? fmt::format("{:.2f}x", r.tokens_per_s / base->tokens_per_s) : "-",
                       base && base->peak_gib > 0 ? fmt::format("{:.2f}x", r.peak_gib / base->peak_gib) : "-");
  }
  out += "arena: the activation arena; saved X: the quantized Wgrad inputs a forward keeps (GiB); "
         "mem: peak over bf16's\n";
  out += "loss: the last timed step's, on one fixed random batch; the model carries its weights from "
         "recipe to recipe (in the order listed), so it is not a quality comparison\n";
  out += "MFU: model FLOPs (6 N_active + 6 L T d) per second over 989 TFLOP/s, the dense BF16 peak "
         "of an H100 or H200 SXM (rescale for other GPUs)\n";
  return out;
}

}  // namespace fourbit::train
