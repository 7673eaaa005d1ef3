// `fourbit recipe`: resolve a precision recipe (a preset or a JSON file, plus --set overrides) for a
// model shape and print the table; optionally write the resolved recipe as JSON (what a checkpoint
// stores).
#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "recipe/recipe.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

namespace fourbit::cli {

namespace {

struct RecipeArgs {
  std::string preset = "e2e4";
  std::string json_path;
  std::vector<std::string> sets;
  int n_layers = 12;
  std::string moe_blocks;
  bool shared_experts = false;
  std::string output_path;
  bool keys = false;
};

// "all", "" or a comma list of blocks and ranges: "1,3,5-7".
std::vector<int> parse_blocks(const std::string& text, int n_layers) {
  std::vector<int> blocks;
  if (text.empty()) return blocks;
  if (text == "all") {
    for (int b = 0; b < n_layers; ++b) blocks.push_back(b);
    return blocks;
  }
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string part = text.substr(start, comma - start);
    const size_t dash = part.find('-');
    try {
      const int first = std::stoi(part.substr(0, dash));
      const int last = dash == std::string::npos ? first : std::stoi(part.substr(dash + 1));
      for (int b = first; b <= last; ++b) blocks.push_back(b);
    } catch (const std::logic_error&) {  // std::stoi: not a number, or out of range
      throw Error(fmt::format("--moe-blocks: '{}' is not a block or a range (e.g. 1,3,5-7 or all)", part));
    }
    start = comma + 1;
  }
  return blocks;
}

void run_recipe(const RecipeArgs& a) {
  if (a.keys) {
    std::fputs(recipe::settable_keys_help().c_str(), stdout);
    return;
  }
  recipe::Recipe r = a.json_path.empty() ? recipe::preset(a.preset) : recipe::load_recipe_file(a.json_path);
  recipe::apply_sets(r, a.sets);
  recipe::ModelShape shape;
  shape.n_layers = a.n_layers;
  shape.moe_blocks = parse_blocks(a.moe_blocks, a.n_layers);
  shape.shared_experts = a.shared_experts;
  const recipe::ResolvedRecipe resolved = recipe::resolve(r, shape);
  const std::string text = recipe::to_json(resolved).dump(2) + "\n";
  if (a.output_path == "-") {  // only the JSON, so that stdout parses
    std::fputs(text.c_str(), stdout);
    return;
  }
  std::fputs(resolved.table().c_str(), stdout);
  if (!a.output_path.empty()) {
    std::ofstream f(a.output_path);
    FOURBIT_CHECK(f.good(), "cannot write '{}'", a.output_path);
    f << text;
    FOURBIT_CHECK(f.good(), "failed writing '{}'", a.output_path);
    log_info("wrote {}", a.output_path);
  }
}

}  // namespace

Command add_recipe_command(CLI::App& app) {
  auto args = std::make_shared<RecipeArgs>();
  CLI::App* sub = app.add_subcommand(
      "recipe", "Resolve a precision recipe (formats per stage, GEMM and operand) for a model and "
                "print it as a table");
  auto* preset = sub->add_option("--preset", args->preset,
                                 fmt::format("named recipe: {}", fmt::join(recipe::preset_names(), ", ")))
                     ->capture_default_str();
  sub->add_option("--json", args->json_path,
                  "load a recipe file (JSON: a recipe, or a resolved recipe as written by --output) "
                  "instead of a preset")
      ->excludes(preset);
  sub->add_option("--set", args->sets,
                  "override one key: stage.gemm.operand[.field]=value, high_precision.*=..., "
                  "allow_sampler_mismatch=...; repeatable (--keys lists them)");
  sub->add_option("--layers", args->n_layers, "number of transformer blocks")->capture_default_str();
  sub->add_option("--moe-blocks", args->moe_blocks, "MoE blocks: all, or a list like 1,3,5-7");
  sub->add_flag("--shared-experts", args->shared_experts, "MoE blocks also have a dense MLP");
  sub->add_option("--output", args->output_path,
                  "write the resolved recipe as JSON to this file (-: print only the JSON)");
  sub->add_flag("--keys", args->keys, "list the --set keys and their values, and exit");
  return {sub, [args] { run_recipe(*args); }};
}

}  // namespace fourbit::cli
