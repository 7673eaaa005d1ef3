// `fourbit audit`: the precision audit (audit/audit.h) of a checkpoint (--ckpt DIR) or of a fresh
// seeded model (--preset / --config, --set), under its recipe or another one (--recipe, --recipe-set),
// on one batch of the built-in synthetic corpus (default) or of token shards (--shards). Prints
// the table (per stage, layer, GEMM and operand: relative error and bias; the GEMM output's error
// against the FP32 GEMM of the unquantized operands; a summary) and writes it as JSON (--json).
//
// Data: B sequences of T + 1 consecutive tokens (inputs and next-token targets). The corpus's
// byte tokens include the end-of-document id 256; a model with a vocabulary of 256 (the `tiny`
// presets) gets byte 0 in its place (said once on stderr); other out-of-vocabulary ids are an
// error naming the source.
#include "audit/audit.h"
#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "io/token_shards.h"
#include "model/config.h"
#include "model/model.h"
#include "recipe/recipe.h"
#include "rl/byte_tokens.h"
#include "rl/synthetic_corpus.h"
#include "train/checkpoint.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <memory>

namespace fourbit::cli {

namespace {

struct AuditArgs {
  std::string ckpt;
  std::string preset = "tiny";
  std::string config_path;
  std::vector<std::string> sets;
  std::string recipe;  // default: the checkpoint's, or e2e4 for a fresh model
  std::vector<std::string> recipe_sets;
  std::string shards;
  std::string device = "cpu";
  int batch = 2;
  int seq = 64;
  uint64_t seed = 1;
  uint64_t data_seed = 0;
  uint64_t step = 0;
  int64_t max_rows = 0;
  std::vector<std::string> stages;
  std::string json_path;
};

model::ModelConfig fresh_config(const AuditArgs& a) {
  model::ModelConfig c;
  if (a.config_path.empty()) {
    c = model::preset(a.preset);
  } else {
    std::ifstream f(a.config_path);
    FOURBIT_CHECK(f.good(), "audit: cannot read the model config '{}'", a.config_path);
    nlohmann::json j;
    try {
      f >> j;
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("audit: model config '{}' is not valid JSON: {}", a.config_path, e.what()));
    }
    c = model::config_from_json(j.contains("config") ? j["config"] : j);
  }
  model::apply_sets(c, a.sets);
  return c;
}

// B x (T + 1) tokens: the corpus's training split from document data_seed on, or the shards.
std::vector<int32_t> load_tokens(const AuditArgs& a, int vocab, int64_t n) {
  std::vector<int32_t> t((size_t)n);
  std::string source;
  if (a.shards.empty()) {
    rl::SyntheticCorpus corpus;
    rl::CorpusReader reader(corpus, rl::CorpusSplit::kTrain, {a.data_seed, 0});
    reader.fill_tokens(std::span<int32_t>(t));
    source = "the built-in corpus";
    if (vocab < rl::kByteVocabSize) {
      FOURBIT_CHECK(vocab >= rl::kByteTokenCount,
                    "audit: the built-in corpus needs a vocabulary of >= 256 byte tokens; the model has "
                    "{} (pass --shards)", vocab);
      int64_t replaced = 0;
      for (int32_t& x : t) {
        if (x == rl::kEndOfDocumentToken) x = 0, ++replaced;
      }
      if (replaced > 0) {
        log_info("audit: the model's vocabulary ({}) has no end-of-document token; {} of them read as "
                 "byte 0", vocab, replaced);
      }
    }
  } else {
    const std::vector<std::string> paths = io::find_shards(a.shards);
    int64_t filled = 0;
    for (const std::string& p : paths) {
      if (filled == n) break;
      const io::TokenShard shard = io::TokenShard::open(p, vocab);
      const int64_t take = std::min(n - filled, shard.size());
      shard.read(0, take, t.data() + filled);
      filled += take;
    }
    FOURBIT_CHECK(filled == n, "audit: the shards '{}' hold {} tokens; --batch {} x (--seq {} + 1) needs {}",
                  a.shards, filled, a.batch, a.seq, n);
    source = a.shards;
  }
  for (int64_t i = 0; i < n; ++i) {
    FOURBIT_CHECK(t[(size_t)i] >= 0 && t[(size_t)i] < vocab, "audit: token {} of {} is {}, outside the "
                  "model's vocabulary of {}", i, source, t[(size_t)i], vocab);
  }
  return t;
}

recipe::Stage parse_stage(const std::string& s) {
  for (recipe::Stage st : recipe::kStages) {
    if (recipe::stage_name(st) == s) return st;
  }
  throw Error(fmt::format("audit: --stages: unknown stage '{}' (pretrain_forward, pretrain_backward, "
                          "rl_sampler, rl_trainer)", s));
}

void run_audit_command(const AuditArgs& a) {
  FOURBIT_CHECK(a.device == "cpu" || a.device == "cuda", "audit: --device must be cpu or cuda, got '{}'", a.device);
  FOURBIT_CHECK(a.batch >= 1 && a.seq >= 1, "audit: --batch and --seq must be >= 1");
  const Device device = a.device == "cuda" ? Device::kCuda : Device::kCpu;
  model::ModelOptions mo;
  mo.seed = a.seed;
  mo.max_batch = a.batch;
  mo.max_seq = a.seq;
  mo.device = device;
  std::unique_ptr<model::Model> m;
  if (!a.ckpt.empty()) {
    m = train::load_model_from_checkpoint(a.ckpt, device, mo);
  } else {
    const model::ModelConfig c = fresh_config(a);
    recipe::Recipe r = recipe::preset(a.recipe.empty() ? "e2e4" : a.recipe);
    recipe::apply_sets(r, a.recipe_sets);
    m = std::make_unique<model::Model>(c, recipe::resolve(r, c.recipe_shape()), mo);
  }
  if (!a.ckpt.empty() && (!a.recipe.empty() || !a.recipe_sets.empty())) {
    recipe::Recipe r = a.recipe.empty() ? m->recipe().recipe() : recipe::preset(a.recipe);
    recipe::apply_sets(r, a.recipe_sets);
    m->set_recipe(recipe::resolve(r, m->config().recipe_shape()));
  }
  FOURBIT_CHECK(a.seq <= m->max_seq(), "audit: --seq {} exceeds the model's max_seq {}", a.seq, m->max_seq());

  const int B = a.batch, T = a.seq;
  const std::vector<int32_t> stream = load_tokens(a, m->config().vocab, (int64_t)B * (T + 1));
  Tensor tokens = Tensor::empty({B, T}, DType::kI32, Device::kCpu);
  Tensor targets = Tensor::empty({B, T}, DType::kI32, Device::kCpu);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      tokens.ptr<int32_t>()[b * T + t] = stream[(size_t)(b * (T + 1) + t)];
      targets.ptr<int32_t>()[b * T + t] = stream[(size_t)(b * (T + 1) + t + 1)];
    }
  }
  audit::AuditOptions o;
  o.step = a.step;
  o.max_rows = a.max_rows;
  if (!a.stages.empty()) {
    o.stages.clear();
    for (const std::string& s : a.stages) o.stages.push_back(parse_stage(s));
  }
  const audit::AuditReport report = audit::run_audit(*m, tokens, targets, o, m->recipe().recipe().name);
  std::fputs(report.table().c_str(), stdout);
  if (!a.json_path.empty()) {
    std::ofstream f(a.json_path);
    FOURBIT_CHECK(f.good(), "audit: cannot write --json '{}'", a.json_path);
    f << report.to_json().dump(1) << "\n";
    FOURBIT_CHECK(f.good(), "audit: failed writing --json '{}'", a.json_path);
    log_info("audit: wrote {}", a.json_path);
  }
}

}  // namespace

Command add_audit_command(CLI::App& app) {
  auto a = std::make_shared<AuditArgs>();
  CLI::App* sub = app.add_subcommand(
      "audit", "Precision audit: relative error and bias of every quantized GEMM operand and output, "
               "per layer, GEMM and stage, on one batch (table; --json FILE)");
  auto* ckpt = sub->add_option("--ckpt", a->ckpt, "audit this checkpoint directory (its config and recipe)");
  auto* preset = sub->add_option("--preset", a->preset, "fresh seeded model preset")->capture_default_str();
  auto* config = sub->add_option("--config", a->config_path, "fresh model from a config JSON file");
  sub->add_option("--set", a->sets, "model config override key=value (fresh models; repeatable)");
  ckpt->excludes(preset)->excludes(config);
  config->excludes(preset);
  sub->add_option("--recipe", a->recipe, "recipe preset (default: the checkpoint's, else e2e4)");
  sub->add_option("--recipe-set", a->recipe_sets, "recipe override key=value (repeatable; `fourbit recipe --keys`)");
  sub->add_option("--shards", a->shards, "token shards (dir, glob or file) instead of the built-in corpus");
  sub->add_option("--device", a->device, "cpu or cuda")->capture_default_str();
  sub->add_option("--batch", a->batch, "sequences")->capture_default_str();
  sub->add_option("--seq", a->seq, "tokens per sequence")->capture_default_str();
  sub->add_option("--seed", a->seed, "weight seed of a fresh model (and the SR seed)")->capture_default_str();
  sub->add_option("--data-seed", a->data_seed, "first corpus document")->capture_default_str();
  sub->add_option("--step", a->step, "training step keying the stochastic rounding")->capture_default_str();
  sub->add_option("--max-rows", a->max_rows, "measure at most this many token rows per dense GEMM (0: all)")
      ->capture_default_str();
  sub->add_option("--stages", a->stages, "stages to audit (default all): pretrain_forward pretrain_backward "
                                         "rl_sampler rl_trainer")->delimiter(',');
  sub->add_option("--json", a->json_path, "write the report as JSON");
  return {sub, [a] { run_audit_command(*a); }};
}

}  // namespace fourbit::cli
