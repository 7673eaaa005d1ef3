// `fourbit bench <what>`: benchmarks that print a figure and its ratio to the hardware ceiling.
#include "cli/commands.h"
#include "core/check.h"
#include "core/device.h"
#include "gemm/bench.h"
#include "model/bench.h"
#include "model/decode_bench.h"
#include "ops/attention_bench.h"
#include "ops/moe_bench.h"
#include "quant/bench.h"

namespace fourbit::cli {

namespace {
void require_gpu(std::string_view what) {
  FOURBIT_CHECK(built_with_cuda() && cuda_device_count() > 0,
                "bench {} needs a CUDA GPU (this binary: {}; GPUs visible: {})", what,
                built_with_cuda() ? "CUDA build" : "CPU-only build", cuda_device_count());
}
}  // namespace

Command add_bench_command(CLI::App& app) {
  auto quant_opts = std::make_shared<quant::QuantBenchOptions>();
  auto gemm_opts = std::make_shared<gemm::GemmBenchOptions>();
  auto attn_opts = std::make_shared<ops::AttentionBenchOptions>();
  auto moe_opts = std::make_shared<ops::MoeBenchOptions>();
  auto model_opts = std::make_shared<model::ModelBenchOptions>();
  auto decode_opts = std::make_shared<model::DecodeBenchOptions>();
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks against the GPU's ceilings");
  bench->require_subcommand(1);
  CLI::App* q = bench->add_subcommand(
      "quant", "GB/s of every CUDA quantize kernel and its fraction of the copy bandwidth");
  q->add_option("--rows", quant_opts->rows, "rows of the BF16 source")->capture_default_str();
  q->add_option("--cols", quant_opts->cols, "columns of the BF16 source")->capture_default_str();
  q->add_option("--reps", quant_opts->reps, "timed repetitions (median reported)")->capture_default_str();
  q->add_option("--csv", quant_opts->csv_path, "also write the table as CSV to this file");
  q->add_option("--only", quant_opts->only, "only the cases whose name contains this text (e.g. 'train dy')");
  CLI::App* g = bench->add_subcommand(
      "gemm", "TFLOP/s of every CUDA GEMM backend and its ratio to cuBLASLt BF16, quantization "
              "excluded and included");
  g->add_option("--reps", gemm_opts->reps, "timed repetitions (median reported)")->capture_default_str();
  g->add_option("--shapes", gemm_opts->shape_filter,
                "only the shapes whose name contains this text (e.g. gpt2, 1.3b, 8192^3)");
  g->add_option("--csv", gemm_opts->csv_path, "also write the table as CSV to this file");
  CLI::App* at = bench->add_subcommand(
      "attention", "model TFLOP/s of the attention forward and backward kernels (ratio to cuBLASLt "
                   "BF16) and GB/s of the KV-cache decode kernel (ratio to the copy bandwidth)");
  at->add_option("--reps", attn_opts->reps, "timed repetitions (median reported)")->capture_default_str();
  at->add_option("--shapes", attn_opts->shape_filter,
                 "only the shapes whose name contains this text (e.g. gpt2, 1.3b, decode)");
  at->add_option("--csv", attn_opts->csv_path, "also write the table as CSV to this file");
  CLI::App* mo = bench->add_subcommand(
      "moe", "GB/s of the MoE router, plan, permute and un-permute kernels and their backwards "
             "(ratio to the copy bandwidth)");
  mo->add_option("--reps", moe_opts->reps, "timed repetitions (median reported)")->capture_default_str();
  mo->add_option("--shapes", moe_opts->shape_filter, "only the shapes whose name contains this text");
  mo->add_option("--csv", moe_opts->csv_path, "also write the table as CSV to this file");
  CLI::App* md = bench->add_subcommand(
      "model", "one training step (forward + backward) per recipe at the gpt2-124m, gpt2-124m-moe8 "
               "and 1.3b shapes: time per layer type, share in GEMMs, attention, quantization and the "
               "rest, tokens/s");
  md->add_option("--reps", model_opts->reps, "timed steps (median reported)")->capture_default_str();
  md->add_option("--shapes", model_opts->shape_filter, "only the shapes whose name contains this text");
  md->add_option("--recipes", model_opts->recipe_filter, "only the recipes whose name contains this text");
  md->add_option("--csv", model_opts->csv_path, "also write the table as CSV to this file");
  CLI::App* dc = bench->add_subcommand(
      "decode", "generation with the KV cache (llama-1.1b shape): tokens/s and fraction of the copy "
                "bandwidth per batch with BF16 and NVFP4 sampler weights, and the decode GEMV alone at "
                "each layer shape against cuBLASLt BF16");
  dc->add_option("--preset", decode_opts->preset, "dense model preset")->capture_default_str();
  dc->add_option("--batches", decode_opts->batches, "batch sizes (1 to 64), space- or comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  dc->add_option("--cache", decode_opts->cache_len, "tokens per sequence in the KV cache (prefilled)")
      ->capture_default_str();
  dc->add_option("--reps", decode_opts->reps, "timed decode steps (median reported)")->capture_default_str();
  dc->add_option("--recipes", decode_opts->recipe_filter, "only the recipes whose name contains this text (bf16, e2e4, nvfp4-weights)");
  dc->add_flag("!--no-steps", decode_opts->steps, "skip the model decode steps");
  dc->add_flag("!--no-gemv", decode_opts->gemv, "skip the GEMV-alone table");
  dc->add_option("--layers", decode_opts->layer_filter,
                 "GEMV table: only the layers whose name contains this text (qkv, attn_out, mlp_up, mlp_down, "
                 "lm_head); with --no-steps it isolates one layer's launches for a profiler");
  dc->add_option("--csv", decode_opts->csv_path, "also write the table as CSV to this file");
  return {bench, [q, g, at, mo, md, dc, quant_opts, gemm_opts, attn_opts, moe_opts, model_opts, decode_opts] {
            if (q->parsed()) {
              require_gpu("quant");
#if defined(FOURBIT_WITH_CUDA)
              quant::run_quant_bench(*quant_opts);
#endif
            }
            if (g->parsed()) {
              require_gpu("gemm");
#if defined(FOURBIT_WITH_CUDA)
              gemm::run_gemm_bench(*gemm_opts);
#endif
            }
            if (at->parsed()) {
              require_gpu("attention");
              ops::run_attention_bench(*attn_opts);
            }
            if (mo->parsed()) {
              require_gpu("moe");
              ops::run_moe_bench(*moe_opts);
            }
            if (md->parsed()) {
              require_gpu("model");
              model::run_model_bench(*model_opts);
            }
            if (dc->parsed()) {
              require_gpu("decode");
              model::run_decode_bench(*decode_opts);
            }
          }};
}

}  // namespace fourbit::cli
