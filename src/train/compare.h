// Recipe comparison: the same model, data, seeds and schedule trained once per recipe, and the
// final-loss gap table (`fourbit compare` and the default job `fourbit run`).
//
// Every run gets its own directory OUT/<recipe> (metrics.jsonl, checkpoint/); runs are sequential
// and independent (each builds its own model from the same seed, so the initial weights and the
// data order are identical). The first recipe is the baseline of the gap columns:
//   gap % = 100 * (loss - baseline loss) / baseline loss   (positive: worse than the baseline).
#pragma once

#include "train/trainer.h"

#include <cstdio>
#include <string>
#include <vector>

namespace fourbit::train {

struct RecipeRun {
  std::string recipe;   // as given (preset name or file)
  std::string out_dir;  // OUT/<label>
  TrainSummary summary;
};

// A directory-safe label of a recipe: the preset name, or the file's stem.
std::string recipe_label(const std::string& recipe);

// Trains `base` once per recipe (base.recipe and base.out_dir are replaced).
std::vector<RecipeRun> compare_recipes(const TrainConfig& base, const std::vector<std::string>& recipes,
                                       const std::string& out_root, std::FILE* progress = stderr);

// The table: recipe, steps, final train loss, gap %, final val loss, gap %, tokens/s, time
// (and MFU on CUDA), one row per run, the first run the baseline.
std::string comparison_table(const std::vector<RecipeRun>& runs);

}  // namespace fourbit::train
