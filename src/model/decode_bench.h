// `fourbit bench decode`: generation speed of a Llama-shaped model (preset llama-1.1b, TinyLlama's
// shape) on the GPU, per precision of the rl_sampler stage (recipe bf16: BF16 weights; e2e4:
// NVFP4 weights and activations; nvfp4-weights: NVFP4 weights and BF16 activations, "W4A16",
// recipe::with_sampler_precision), and the decode GEMV alone at each of its layer shapes.
//
// Steps. Per recipe and batch B: prefill B sequences of `cache_len` tokens, then time `reps`
// single-token decode steps (Model::forward_cached with sampler weights, i.e. the decode GEMV, the
// step replayed as a CUDA graph; each step synchronizes, so host time brackets it); the median gives
// tokens/s = B / time. "step-eager" rows time the same steps launched op by op. Bytes per
// step = every linear weight as stored (BF16 2 bytes per value; NVFP4 packed 0.5 + scales 1/16) +
// the KV cache read by attention (2 x B x length x Hkv x D x 2 bytes per layer); their rate over the
// device-to-device copy bandwidth measured in the same run (bytes read + written) is the fraction
// of the HBM ceiling. One extra profiled step (CUDA events around every op the model brackets; it
// runs eagerly) splits the step into linear layers (activation quantization + GEMV), attention and
// the rest, and its sum shows how much of an eager step the GPU is busy (the remainder is host
// launch overhead). The
// emulated NVFP4 path (no sampler weights; dequantize to BF16 + cuBLASLt) is timed at batch 64
// (the only batch whose 64-token tile it accepts) for comparison.
//
// GEMV alone. For each layer shape [N, K], batch and weight format: the median over `reps` of
// launches rotating through enough weight copies to exceed the L2 (>= 256 MB read per timing), with
// NVFP4 weights fed NVFP4 scaled-domain activations (weights "nvfp4": e2e4's path) and plain BF16
// activations ("nvfp4-a16": the W4A16 path), BF16 weights plain activations, against cuBLASLt BF16
// on the same shape.
//
// Needs a CUDA build and a GPU.
#pragma once

#include <string>
#include <vector>

namespace fourbit::model {

struct DecodeBenchOptions {
  std::string preset = "llama-1.1b";
  std::vector<int> batches = {1, 8, 16, 64};
  int cache_len = 512;        // tokens per sequence in the cache before the timed steps
  int reps = 20;              // timed decode steps (median), after 3 warm-up steps
  std::string recipe_filter;  // only the recipes whose name contains this text (bf16, e2e4, nvfp4-weights)
  bool steps = true;          // the model decode steps
  bool gemv = true;           // the GEMV alone at each layer shape
  std::string layer_filter;   // GEMV table: only the layers whose name contains this text (qkv, lm_head, ...)
  std::string csv_path;       // optional: also write the rows as CSV
};

struct DecodeBenchRow {
  // "step", "step-eager", "step-emulated", "gemv", "gemv-cublas", and (1-16 tokens) "gemv-swiglu" /
  // "gemv-rope": mlp_up / qkv as pair launches with the SwiGLU / RoPE epilogue (DecodeGemvArgs)
  std::string section;
  std::string weights;  // bf16, nvfp4 (step rows: the recipe name)
  std::string layer;    // step rows: the preset; gemv rows: qkv, attn_out, mlp_up, mlp_down, lm_head
  int batch = 0;
  int64_t n = 0, k = 0;       // gemv rows: the weight shape
  double ms = 0;              // median time per step / per GEMV
  double tokens_per_s = 0;    // step rows
  double bytes = 0;           // bytes that must be read (weights + KV cache, or weight + x + y)
  double gb_per_s = 0;
  double frac_copy = 0;       // GB/s over the measured copy bandwidth
  double busy_frac = 0;       // step rows: GPU-bracketed time / step time (profiled step)
  double linear_frac = 0;     // step rows: share of the bracketed time in linear layers
  double ratio = 0;           // nvfp4 rows: speed-up over bf16 (same section, layer, batch);
                              // gemv rows: speed-up over cuBLASLt BF16
};

std::vector<DecodeBenchRow> run_decode_bench(const DecodeBenchOptions& options);

}  // namespace fourbit::model
