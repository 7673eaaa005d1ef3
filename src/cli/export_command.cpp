// `fourbit export`: a checkpoint (--ckpt DIR) or a fresh seeded model (--preset / --config, --set,
// --seed) as a Hugging Face checkpoint in --out (interchange/hf.h): Llama or Mixtral layout,
// config.json, the byte-level tokenizer; --format bf16 (default), f32, or nvfp4 (ModelOpt's NVFP4
// layout with hf_quant_config.json; the weights the recipe's sampler quantizes, or every linear
// but lm_head and routers with --nvfp4-all). --reference-logits also writes fourbit's float64
// logits of the exported weights (NVFP4: dequantized) on a corpus batch to OUT/fourbit_reference/,
// which tools/hf_crosscheck.py compares with transformers (or its own forward).
#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "interchange/hf.h"
#include "model/config.h"
#include "recipe/recipe.h"
#include "train/checkpoint.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

namespace fourbit::cli {

namespace {

struct ExportArgs {
  std::string ckpt, preset = "tiny", config_path, recipe, out, format = "bf16";
  std::vector<std::string> sets;
  uint64_t seed = 1;
  bool nvfp4_all = false, drop_router_bias = false, reference = false, no_tokenizer = false;
  int calib_batch = 2, calib_seq = 128, ref_batch = 2, ref_seq = 64;
};

void run_export(const ExportArgs& a) {
  FOURBIT_CHECK(a.format == "bf16" || a.format == "f32" || a.format == "nvfp4",
                "export: --format must be bf16, f32 or nvfp4, got '{}'", a.format);
  model::ModelOptions mo;
  mo.seed = a.seed;
  std::unique_ptr<model::Model> m;
  if (!a.ckpt.empty()) {
    m = train::load_model_from_checkpoint(a.ckpt, Device::kCpu, mo);
    if (!a.recipe.empty()) m->set_recipe(recipe::resolve(recipe::preset(a.recipe), m->config().recipe_shape()));
  } else {
    model::ModelConfig c;
    if (a.config_path.empty()) {
      c = model::preset(a.preset);
    } else {
      std::ifstream f(a.config_path);
      FOURBIT_CHECK(f.good(), "export: cannot read the model config '{}'", a.config_path);
      nlohmann::json j;
      try {
        f >> j;
      } catch (const nlohmann::json::exception& e) {
        throw Error(fmt::format("export: model config '{}' is not valid JSON: {}", a.config_path, e.what()));
      }
      c = model::config_from_json(j.contains("config") ? j["config"] : j);
    }
    model::apply_sets(c, a.sets);
    m = std::make_unique<model::Model>(c, recipe::resolve(recipe::preset(a.recipe.empty() ? "e2e4" : a.recipe),
                                                          c.recipe_shape()), mo);
  }
  interchange::ExportOptions o;
  o.format = a.format == "f32" ? interchange::ExportFormat::kF32
             : a.format == "nvfp4" ? interchange::ExportFormat::kNvfp4 : interchange::ExportFormat::kBf16;
  o.nvfp4_all = a.nvfp4_all;
  o.drop_router_bias = a.drop_router_bias;
  o.calib_batch = a.calib_batch;
  o.calib_seq = a.calib_seq;
  o.tokenizer = !a.no_tokenizer;
  o.reference_logits = a.reference;
  o.ref_batch = a.ref_batch;
  o.ref_seq = a.ref_seq;
  const interchange::ExportSummary s = interchange::export_hf(*m, a.out, o);
  std::printf("exported '%s' as %s (%s): %d tensors, %lld bytes -> %s\n", m->config().name.c_str(),
              s.architecture.c_str(), a.format.c_str(), s.tensors, (long long)s.bytes, a.out.c_str());
  if (o.format == interchange::ExportFormat::kNvfp4) {
    std::printf("NVFP4 modules: %d; left in BF16 (exclude_modules): %s\n", s.nvfp4_modules,
                fmt::format("{}", fmt::join(s.excluded_modules, ", ")).c_str());
  }
  if (a.reference) {
    std::printf("reference logits (float64, %d x %d tokens, the exported weights) -> %s/fourbit_reference\n",
                a.ref_batch, a.ref_seq, a.out.c_str());
  }
}

}  // namespace

Command add_export_command(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* sub = app.add_subcommand(
      "export", "Export a checkpoint or a fresh seeded model as a Hugging Face checkpoint (Llama / Mixtral; "
                "bf16, f32 or ModelOpt NVFP4)");
  auto* ckpt = sub->add_option("--ckpt", a->ckpt, "checkpoint directory to export");
  auto* preset = sub->add_option("--preset", a->preset, "fresh seeded model preset")->capture_default_str();
  auto* config = sub->add_option("--config", a->config_path, "fresh model from a config JSON file");
  ckpt->excludes(preset)->excludes(config);
  config->excludes(preset);
  sub->add_option("--set", a->sets, "model config override key=value (fresh models; repeatable)");
  sub->add_option("--seed", a->seed, "weight seed of a fresh model")->capture_default_str();
  sub->add_option("--recipe", a->recipe, "recipe preset (NVFP4: which weights the sampler quantizes; default: "
                                         "the checkpoint's, else e2e4)");
  sub->add_option("--out", a->out, "output directory")->required();
  sub->add_option("--format", a->format, "bf16, f32 or nvfp4")->capture_default_str();
  sub->add_flag("--nvfp4-all", a->nvfp4_all, "NVFP4: quantize every linear but lm_head and routers (1x16, RN)");
  sub->add_flag("--drop-router-bias", a->drop_router_bias, "export a model with a selection bias without it");
  sub->add_option("--calib-batch", a->calib_batch, "NVFP4 input-scale calibration sequences")->capture_default_str();
  sub->add_option("--calib-seq", a->calib_seq, "NVFP4 calibration tokens per sequence")->capture_default_str();
  sub->add_flag("--no-tokenizer", a->no_tokenizer, "do not write the byte-level tokenizer files");
  sub->add_flag("--reference-logits", a->reference, "also write fourbit's float64 logits to OUT/fourbit_reference");
  sub->add_option("--ref-batch", a->ref_batch, "reference logits: sequences")->capture_default_str();
  sub->add_option("--ref-seq", a->ref_seq, "reference logits: tokens per sequence")->capture_default_str();
  return {sub, [a] { run_export(*a); }};
}

}  // namespace fourbit::cli
