// `fourbit model`: print a model config (a preset or a JSON file, plus --set overrides), its
// parameter table and, with --recipe, the recipe resolved for it; optionally write the config JSON.
// `fourbit model-dump`: run one training step on a seeded batch and write weights, batch, losses,
// logits, gradients and routing to a folder (what tools/torch_crosscheck.py compares with PyTorch).
#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "model/config.h"
#include "model/dump.h"
#include "model/params.h"
#include "recipe/recipe.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

namespace fourbit::cli {

namespace {

struct ConfigArgs {
  std::string preset = "tiny";
  std::string json_path;
  std::vector<std::string> sets;
};

void add_config_options(CLI::App* sub, ConfigArgs& a) {
  auto* preset = sub->add_option("--preset", a.preset,
                                 fmt::format("model preset: {}", fmt::join(model::preset_names(), ", ")))
                     ->capture_default_str();
  sub->add_option("--config", a.json_path, "load a model config JSON file instead of a preset")->excludes(preset);
  sub->add_option("--set", a.sets, "override one field: key=value (repeatable; `fourbit model --keys` lists them)");
}

model::ModelConfig load_config(const ConfigArgs& a) {
  model::ModelConfig c;
  if (a.json_path.empty()) {
    c = model::preset(a.preset);
  } else {
    std::ifstream f(a.json_path);
    FOURBIT_CHECK(f.good(), "cannot read the model config '{}'", a.json_path);
    nlohmann::json j;
    try {
      f >> j;
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("model config '{}' is not valid JSON: {}", a.json_path, e.what()));
    }
    c = model::config_from_json(j.contains("config") ? j["config"] : j);
  }
  model::apply_sets(c, a.sets);
  return c;
}

struct ModelArgs {
  ConfigArgs config;
  std::string recipe;
  std::string output_path;
  bool keys = false;
};

void run_model(const ModelArgs& a) {
  if (a.keys) {
    std::fputs(model::settable_keys_help().c_str(), stdout);
    return;
  }
  const model::ModelConfig c = load_config(a.config);
  std::printf("model '%s'\n%s\n", c.name.c_str(), model::describe(c).c_str());
  std::fputs(model::ParamTable::build(c).table().c_str(), stdout);
  if (!a.recipe.empty()) {
    std::printf("\n");
    std::fputs(recipe::resolve(recipe::preset(a.recipe), c.recipe_shape()).table().c_str(), stdout);
  }
  if (!a.output_path.empty()) {
    std::ofstream f(a.output_path);
    FOURBIT_CHECK(f.good(), "cannot write '{}'", a.output_path);
    f << model::to_json(c).dump(2) << "\n";
    FOURBIT_CHECK(f.good(), "failed writing '{}'", a.output_path);
    log_info("wrote {}", a.output_path);
  }
}

struct DumpArgs {
  ConfigArgs config;
  model::DumpOptions options;
  std::string device = "cpu";
  std::string dtype = "f64";
  std::string out;
};

void run_dump(const DumpArgs& a) {
  model::DumpOptions o = a.options;
  FOURBIT_CHECK(a.device == "cpu" || a.device == "cuda", "--device must be cpu or cuda, got '{}'", a.device);
  FOURBIT_CHECK(a.dtype == "f32" || a.dtype == "f64", "--dtype must be f32 or f64, got '{}'", a.dtype);
  o.device = a.device == "cpu" ? Device::kCpu : Device::kCuda;
  o.cpu_dtype = a.dtype == "f64" ? DType::kF64 : DType::kF32;
  const double loss = model::dump_model_step(load_config(a.config), o, a.out);
  std::printf("loss %.9f -> %s\n", loss, a.out.c_str());
}

}  // namespace

Command add_model_command(CLI::App& app) {
  auto args = std::make_shared<ModelArgs>();
  CLI::App* sub = app.add_subcommand(
      "model", "Print a model config, its parameter table and (with --recipe) its resolved recipe");
  add_config_options(sub, args->config);
  sub->add_option("--recipe", args->recipe, "also print this recipe preset resolved for the model");
  sub->add_option("--output", args->output_path, "write the config as JSON to this file");
  sub->add_flag("--keys", args->keys, "list the --set keys and exit");
  return {sub, [args] { run_model(*args); }};
}

Command add_model_dump_command(CLI::App& app) {
  auto args = std::make_shared<DumpArgs>();
  CLI::App* sub = app.add_subcommand(
      "model-dump", "Run one training step on a seeded batch and write weights, batch, losses, logits, "
                    "gradients and routing to a folder (for tools/torch_crosscheck.py)");
  add_config_options(sub, args->config);
  sub->add_option("--recipe", args->options.recipe, "recipe preset")->capture_default_str();
  sub->add_option("--device", args->device, "cpu or cuda")->capture_default_str();
  sub->add_option("--dtype", args->dtype, "CPU dtype: f64 or f32")->capture_default_str();
  sub->add_option("--batch", args->options.batch, "sequences")->capture_default_str();
  sub->add_option("--seq", args->options.seq, "tokens per sequence")->capture_default_str();
  sub->add_option("--seed", args->options.seed, "weight seed")->capture_default_str();
  sub->add_option("--data-seed", args->options.data_seed, "batch seed")->capture_default_str();
  sub->add_option("--out", args->out, "output folder")->required();
  return {sub, [args] { run_dump(*args); }};
}

}  // namespace fourbit::cli
