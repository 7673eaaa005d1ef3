// `fourbit compare --recipes bf16,e2e4,...`: the same model, data and schedule trained once per
// recipe (train/compare.h); prints the final-loss gap table and writes OUT/comparison.txt,
// OUT/comparison.json and the loss curves OUT/loss.svg.
#include "cli/compare_command.h"

#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "io/atomic_file.h"
#include "train/plot.h"

#include <nlohmann/json.hpp>

namespace fourbit::cli {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find(',', start), s.size());
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

std::vector<train::RecipeRun> compare_and_report(const train::TrainConfig& base,
                                                 const std::vector<std::string>& recipes,
                                                 const std::string& out_dir,
                                                 const std::string& plot_path) {
  std::vector<train::RecipeRun> runs = train::compare_recipes(base, recipes, out_dir);
  const std::string table = train::comparison_table(runs);
  std::printf("\n%s", table.c_str());
  std::fflush(stdout);
  if (!out_dir.empty()) {
    nlohmann::json j = nlohmann::json::array();
    std::vector<train::LossSeries> series;
    for (const train::RecipeRun& r : runs) {
      j.push_back({{"recipe", r.recipe}, {"out_dir", r.out_dir}, {"summary", r.summary.to_json()}});
      series.push_back(train::read_loss_series(r.out_dir + "/metrics.jsonl"));
      series.back().label = train::recipe_label(r.recipe);
    }
    io::write_file_atomically(out_dir + "/comparison.txt", table);
    io::write_file_atomically(out_dir + "/comparison.json", j.dump(2) + "\n");
    const std::string svg = plot_path.empty() ? out_dir + "/loss.svg" : plot_path;
    train::PlotOptions po;
    po.title = fmt::format("{} ({}): loss per recipe", base.model_config.empty() ? base.preset : base.model_config,
                           device_name(base.device));
    io::write_file_atomically(svg, train::render_loss_svg(series, po));
    log_info("wrote {}/comparison.txt, {}/comparison.json and {}", out_dir, out_dir, svg);
  }
  return runs;
}

namespace {

struct CompareArgs {
  TrainArgs train;
  std::string recipes = "bf16,e2e4";
  std::string out = "runs/compare";
  std::string plot;
};

}  // namespace

Command add_compare_command(CLI::App& app) {
  auto args = std::make_shared<CompareArgs>();
  CLI::App* sub = app.add_subcommand(
      "compare", "Train the same config under several recipes and print the final-loss gaps");
  sub->add_option("--recipes", args->recipes,
                  "comma-separated recipes (presets or files); the first is the baseline")
      ->capture_default_str();
  add_train_options(sub, args->train, /*with_recipe=*/false);
  sub->add_option("--out,-o", args->out, "root directory: one run directory per recipe")
      ->capture_default_str()->group("Run");
  sub->add_option("--plot", args->plot, "the SVG to write (default OUT/loss.svg)")->group("Run");
  return {sub, [args] {
            const train::TrainConfig c = finish_train_config(args->train);
            compare_and_report(c, split_list(args->recipes), args->out, args->plot);
          }};
}

}  // namespace fourbit::cli
