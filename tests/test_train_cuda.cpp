// The train module on a CUDA GPU (label gpu), against the CPU:
//   - AdamW on CUDA vs the CPU on identical gradients: the gradient norm, the updated FP32 master
//     weights and moments (FP32 formulas on both sides: a few ulps), and the BF16 compute copy
//     written in the same pass equal to bf16(master) exactly;
//   - the trainer on CUDA: the loss falls on the built-in corpus (bf16 and e2e4); resume is
//     bit-exact (deterministic kernels); a checkpoint written from the GPU loads on the CPU with
//     identical bits; an injected NaN gradient stops the run leaving parameters untouched.
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/trainer.h"

#include "core/device.h"
#include "core/rng.h"
#include "formats/element.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

namespace fourbit::train {
namespace {

namespace fs = std::filesystem;

bool have_gpu() { return cuda_device_count() > 0; }

std::vector<float> host_f32(const TensorView& v) {
  Tensor h = Tensor::empty(v.shape, v.dtype, Device::kCpu);
  copy_tensor(h, v);
  std::vector<float> out((size_t)v.numel());
  std::memcpy(out.data(), h.data(), out.size() * sizeof(float));
  return out;
}

std::vector<uint16_t> host_u16(const TensorView& v) {
  Tensor h = Tensor::empty(v.shape, v.dtype, Device::kCpu);
  copy_tensor(h, v);
  std::vector<uint16_t> out((size_t)v.numel());
  std::memcpy(out.data(), h.data(), out.size() * sizeof(uint16_t));
  return out;
}

// head_dim 64 (the CUDA attention kernels' sizes), widths multiples of 128.
TrainConfig gpu_config() {
  TrainConfig c;
  c.preset = "tiny";
  c.sets = {"d_model=128", "n_heads=2", "n_kv_heads=1", "d_ff=384", "n_layers=2", "max_seq=64"};
  c.device = Device::kCuda;
  c.data.batch_size = 8;
  c.data.seq_len = 64;  // 512 tokens: a multiple of the quantize tiles
  c.steps = 40;
  c.schedule.lr = 3e-3;
  c.schedule.min_lr = 3e-4;
  c.schedule.warmup_steps = 4;
  c.eval_every = 0;
  c.eval_batches = 2;
  c.log_every = 0;
  return c;
}

TEST(TrainCuda, AdamWMatchesCpu) {
  ASSERT_TRUE(have_gpu()) << "the gpu tests need a CUDA GPU (run them with tools/gpu-test.sh)";
  const model::ModelConfig mc = gpu_config().model_config_resolved();
  const recipe::ResolvedRecipe rr = recipe::resolve(recipe::preset("bf16"), mc.recipe_shape());
  model::Model cpu(mc, rr, {}), gpu(mc, rr, model::ModelOptions{.device = Device::kCuda});
  // Identical seeded gradients on both.
  Tensor g = Tensor::zeros(cpu.grads().flat().shape, DType::kF32, Device::kCpu);
  const RandomStream rs{5, 77};
  for (int64_t i = 0; i < g.numel(); ++i)
    g.ptr<float>()[i] = ((float)(rs.block((uint64_t)i).v[0] >> 8) / 16777216.0f - 0.5f) * 0.02f;
  copy_tensor(cpu.grads().flat(), g);
  copy_tensor(gpu.grads().flat(), g);
  const AdamWConfig cfg{.weight_decay = 0.1, .grad_clip = 0.5};
  AdamW oc(cpu, cfg), og(gpu, cfg);
  for (int s = 0; s < 3; ++s) {
    const StepResult a = oc.step(1e-2), b = og.step(1e-2);
    ASSERT_TRUE(a.applied && b.applied);
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-6 * a.grad_norm);
    EXPECT_NEAR(a.clip_scale, b.clip_scale, 1e-6);
  }
  const std::vector<float> pc = host_f32(cpu.params().flat()), pg = host_f32(gpu.params().flat());
  const std::vector<float> mcpu = host_f32(oc.exp_avg().flat()), mgpu = host_f32(og.exp_avg().flat());
  // nvcc contracts p - lr * (u + wd * p) into FMAs, so the GPU's update differs from the CPU's by
  // a few ulps of the update (lr = 1e-2: ~1e-9), which is large relative to the parameters that
  // three steps brought close to zero: the bound is relative to max(|p|, lr).
  double worst = 0;
  for (size_t i = 0; i < pc.size(); ++i) {
    worst = std::max(worst, (double)std::fabs(pc[i] - pg[i]) / std::max(std::fabs(pc[i]), 1e-2f));
    ASSERT_NEAR(mcpu[i], mgpu[i], 1e-6 * std::fabs(mcpu[i]) + 1e-12) << i;
  }
  EXPECT_LT(worst, 1e-5);
  // The BF16 copy the GEMMs read was written in the update pass: bf16(master) exactly.
  const std::vector<uint16_t> bf = host_u16(gpu.compute_params().flat());
  for (size_t i = 0; i < pg.size(); ++i) ASSERT_EQ(bf[i], formats::encode_bf16_rn(pg[i])) << i;
}

TEST(TrainCuda, TrainerLearnsResumesAndCheckpointsLoadOnCpu) {
  ASSERT_TRUE(have_gpu()) << "the gpu tests need a CUDA GPU (run them with tools/gpu-test.sh)";
  for (const char* recipe : {"bf16", "e2e4"}) {
    SCOPED_TRACE(recipe);
    TrainConfig c = gpu_config();
    c.recipe = recipe;
    Trainer straight(c, nullptr);
    const TrainSummary s = straight.run();
    EXPECT_LT(s.final_train_loss, s.first_loss - 1.5);
    EXPECT_GT(s.tokens_per_second, 0);
    EXPECT_GT(s.mfu, 0);

    const std::string dir = (fs::temp_directory_path() / fmt::format("fourbit_train_cuda_{}_{}", ::getpid(), recipe)).string();
    fs::remove_all(dir);
    TrainConfig c1 = c;
    c1.out_dir = dir;
    Trainer(c1, nullptr).run(15);
    Trainer second(c1, nullptr);
    second.resume(dir + "/checkpoint");
    second.run();
    EXPECT_EQ(host_f32(second.model().params().flat()), host_f32(straight.model().params().flat()));
    const std::vector<double>& a = straight.train_losses();
    const std::vector<double>& b = second.train_losses();
    // After resume: the checkpoint's first loss, its 10 most recent, then the 25 run here.
    ASSERT_EQ(b.size(), 1u + 10u + 25u);
    EXPECT_EQ(a[0], b[0]);
    for (size_t i = 1; i < b.size(); ++i) EXPECT_EQ(a[a.size() - (b.size() - 1) + (i - 1)], b[i]) << i;

    std::unique_ptr<model::Model> on_cpu = load_model_from_checkpoint(dir + "/checkpoint", Device::kCpu);
    // The checkpoint holds the model after the final step of `second`.
    EXPECT_EQ(host_f32(on_cpu->params().flat()), host_f32(second.model().params().flat()));
    fs::remove_all(dir);
  }
}

TEST(TrainCuda, InjectedNanStopsWithStateIntact) {
  ASSERT_TRUE(have_gpu()) << "the gpu tests need a CUDA GPU (run them with tools/gpu-test.sh)";
  TrainConfig c = gpu_config();
  c.inject_nan_steps = {2};
  Trainer t(c, nullptr);
  t.step();
  const std::vector<float> p = host_f32(t.model().params().flat());
  EXPECT_THROW(t.step(), Error);
  EXPECT_EQ(host_f32(t.model().params().flat()), p);
  EXPECT_EQ(t.optimizer().steps(), 1);
}

}  // namespace
}  // namespace fourbit::train
