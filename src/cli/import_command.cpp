// `fourbit import`: a Llama-family Hugging Face checkpoint (--hf DIR: config.json plus
// model.safetensors or a sharded index; F32/BF16/F16) into a fourbit checkpoint (--out DIR, the
// train module's layout, no optimizer state, step 0) under a recipe (--recipe, --recipe-set), to
// continue training or for RL (interchange/hf.h lists what is accepted).
#include "cli/commands.h"
#include "core/check.h"
#include "interchange/hf.h"
#include "recipe/recipe.h"
#include "train/checkpoint.h"

#include <cstdio>

namespace fourbit::cli {

namespace {

struct ImportArgs {
  std::string hf, out, recipe = "e2e4";
  std::vector<std::string> recipe_sets;
};

void run_import(const ImportArgs& a) {
  recipe::Recipe r = recipe::preset(a.recipe);
  recipe::apply_sets(r, a.recipe_sets);
  const std::unique_ptr<model::Model> m = interchange::import_hf(a.hf, r);
  train::CheckpointState state;
  state.metrics = {{"imported_from", a.hf}};
  train::save_checkpoint(a.out, *m, nullptr, state);
  std::printf("imported %s: model '%s', %lld parameters, recipe %s -> checkpoint %s\n", a.hf.c_str(),
              m->config().name.c_str(), (long long)m->table().n_params(), a.recipe.c_str(), a.out.c_str());
}

}  // namespace

Command add_import_command(CLI::App& app) {
  auto a = std::make_shared<ImportArgs>();
  CLI::App* sub = app.add_subcommand(
      "import", "Import a Llama-family Hugging Face checkpoint (Llama, Mistral, Mixtral) as a fourbit checkpoint");
  sub->add_option("--hf", a->hf, "Hugging Face checkpoint directory (config.json + safetensors)")->required();
  sub->add_option("--out", a->out, "fourbit checkpoint directory to write")->required();
  sub->add_option("--recipe", a->recipe, "recipe preset of the imported model")->capture_default_str();
  sub->add_option("--recipe-set", a->recipe_sets, "recipe override key=value (repeatable)");
  return {sub, [a] { run_import(*a); }};
}

}  // namespace fourbit::cli
