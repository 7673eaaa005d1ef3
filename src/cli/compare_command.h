// Shared by `fourbit compare` and the default job `fourbit run`: train one config per recipe,
// print the gap table, write OUT/comparison.{txt,json} and the loss plot.
#pragma once

#include "cli/train_options.h"
#include "train/compare.h"

#include <string>
#include <vector>

namespace fourbit::cli {

std::vector<std::string> split_list(const std::string& comma_separated);

// plot_path empty: OUT/loss.svg. out_dir empty: nothing is written.
std::vector<train::RecipeRun> compare_and_report(const train::TrainConfig& base,
                                                 const std::vector<std::string>& recipes,
                                                 const std::string& out_dir,
                                                 const std::string& plot_path = "");

}  // namespace fourbit::cli
