// Training the same configuration under several recipes and tabulating the loss gaps (compare.h).
#include "train/compare.h"

#include "core/check.h"
#include "core/error.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>

namespace fourbit::train {

std::string recipe_label(const std::string& recipe) {
  std::string stem = std::filesystem::path(recipe).stem().string();
  for (char& ch : stem)
    if (!std::isalnum((unsigned char)ch) && ch != '-' && ch != '_' && ch != '.') ch = '_';
  return stem.empty() ? "recipe" : stem;
}

std::vector<RecipeRun> compare_recipes(const TrainConfig& base, const std::vector<std::string>& recipes,
                                       const std::string& out_root, std::FILE* progress) {
  FOURBIT_CHECK(!recipes.empty(), "compare: give at least one recipe (--recipes bf16,e2e4)");
  // Every recipe is checked (a distinct label; a preset name or readable file that resolves with
  // the --set patches) before the first run starts: a typo in the last one must not cost the runs
  // before it.
  std::vector<std::string> labels;
  for (const std::string& r : recipes) {
    const std::string l = recipe_label(r);
    for (const std::string& seen : labels)
      FOURBIT_CHECK(seen != l, "compare: recipe '{}' appears twice (label '{}')", r, l);
    labels.push_back(l);
    TrainConfig c = base;
    c.recipe = r;
    try {
      (void)c.recipe_resolved();
    } catch (const std::exception& e) {
      throw Error(fmt::format("compare: recipe '{}' of --recipes does not resolve, so no run was started: {}", r,
                              e.what()));
    }
  }
  std::vector<RecipeRun> runs;
  for (size_t i = 0; i < recipes.size(); ++i) {
    TrainConfig c = base;
    c.recipe = recipes[i];
    c.out_dir = out_root.empty() ? "" : out_root + "/" + labels[i];
    if (progress != nullptr) {
      std::fprintf(progress, "== run %zu/%zu: recipe %s%s\n", i + 1, recipes.size(),
                   recipes[i].c_str(), c.out_dir.empty() ? "" : (" -> " + c.out_dir).c_str());
      std::fflush(progress);
    }
    Trainer t(c, progress);
    RecipeRun r;
    r.recipe = recipes[i];
    r.out_dir = c.out_dir;
    r.summary = t.run();
    runs.push_back(std::move(r));
  }
  return runs;
}

namespace {
std::string gap(double x, double base) {
  if (!std::isfinite(x) || !std::isfinite(base) || base == 0) return "n/a";
  return fmt::format("{:+.2f}%", 100.0 * (x - base) / base);
}
std::string num(double x) { return std::isfinite(x) ? fmt::format("{:.4f}", x) : "nan"; }
}  // namespace

std::string comparison_table(const std::vector<RecipeRun>& runs) {
  if (runs.empty()) return "";
  const bool mfu = runs.front().summary.mfu > 0;
  std::string out = fmt::format("{:<12} {:>6} {:>11} {:>9} {:>11} {:>9} {:>10} {:>8}{}\n", "recipe",
                                "steps", "train loss", "gap", "val loss", "gap", "tokens/s",
                                "time", mfu ? "      MFU" : "");
  out += std::string(out.size() - 1, '-') + "\n";
  const TrainSummary& b = runs.front().summary;
  for (const RecipeRun& r : runs) {
    const TrainSummary& s = r.summary;
    out += fmt::format("{:<12} {:>6} {:>11} {:>9} {:>11} {:>9} {:>10.0f} {:>7.1f}s{}\n",
                       recipe_label(r.recipe), s.steps, num(s.final_train_loss),
                       &r == &runs.front() ? "(base)" : gap(s.final_train_loss, b.final_train_loss),
                       num(s.final_val_loss),
                       &r == &runs.front() ? "(base)" : gap(s.final_val_loss, b.final_val_loss),
                       s.tokens_per_second, s.seconds,
                       mfu ? fmt::format(" {:>7.1f}%", 100 * s.mfu) : "");
  }
  out += "train loss: mean of the last 10 steps; val loss: held-out data at the last step; gap: "
         "relative to the first recipe (positive = higher loss)\n";
  return out;
}

}  // namespace fourbit::train
