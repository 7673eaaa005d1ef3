// Command-line options of a training run (`fourbit pretrain`, `fourbit compare`, `fourbit run`),
// declared once and bound to a train::TrainConfig.
#pragma once

#include "train/trainer.h"

#include <CLI/CLI.hpp>

#include <string>

namespace fourbit::cli {

struct TrainArgs {
  TrainArgs() {
    config.schedule.lr = 6e-4;
    config.schedule.warmup_steps = 20;
  }
  train::TrainConfig config;
  std::string device = "auto";
  std::string schedule = "cosine";
  std::string nan_policy = "stop";
  double min_lr_ratio = 0.1;
};

// Adds the options. `with_recipe`: --recipe / --recipe-set (compare has --recipes instead).
void add_train_options(CLI::App* sub, TrainArgs& a, bool with_recipe = true);
// Resolves the strings (device, schedule, policy) into a.config and returns it.
train::TrainConfig finish_train_config(TrainArgs& a);

}  // namespace fourbit::cli
