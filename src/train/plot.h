// Loss curves as a self-contained SVG (no library, no fonts beyond the viewer's sans-serif): two
// panels side by side, training loss (left) and validation loss (right), against the step, one
// colored line per run with a shared legend; axes with "nice" ticks (1, 2, 5 x 10^k) and labels.
//
// Input: metrics.jsonl files written by the trainer (trainer.h): {"type": "train", "step",
// "loss"} and {"type": "eval", "step", "val_loss"} lines; the first {"type": "run"} line names the
// recipe. Skipped steps (null loss) are gaps in the line. A run's label is given or, by default,
// "<recipe>" from the run line (or the directory name when absent or repeated).
// RL runs: rl_metrics.jsonl files written by `fourbit rl` / the RL stage of `fourbit run` (one
// object per step with "step", "reward_mean", "k3", no "type") plot the mean reward (left panel)
// and the K3 divergence between trainer and sampler (right panel); rl_panels() gives their titles.
// One plot holds one kind of run.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace fourbit::train {

enum class MetricsKind { kPretrain, kRl };

struct LossSeries {
  std::string label;
  MetricsKind kind = MetricsKind::kPretrain;
  // Pretraining: (step, loss), NaN loss a skipped step / (step, val loss).
  // RL: (step, mean reward) / (step, K3 divergence).
  std::vector<std::pair<double, double>> train;
  std::vector<std::pair<double, double>> val;
};

// Reads a metrics.jsonl or rl_metrics.jsonl (or a run directory holding one; metrics.jsonl first).
// Throws naming the file and the line when a line is not JSON or lacks its fields.
LossSeries read_loss_series(const std::string& path);

struct PlotPanels {
  std::string left = "training loss", right = "validation loss";  // panel titles
  std::string left_axis = "loss", right_axis = "loss";            // y-axis labels
};
PlotPanels rl_panels();  // mean reward / K3 divergence (trainer vs sampler)

struct PlotOptions {
  int width = 1000;        // whole image, pixels
  int height = 420;
  double smooth = 0.0;     // EMA factor in [0, 1) applied to the left panel's curves (0: raw)
  std::string title = "loss";
  PlotPanels panels;
};

std::string render_loss_svg(const std::vector<LossSeries>& series, const PlotOptions& options = {});

// Tick values at a step of 1, 2 or 5 x 10^k (the smallest giving at most about `target` ticks)
// from the largest multiple <= lo to the smallest multiple >= hi: the axis spans them.
std::vector<double> nice_ticks(double lo, double hi, int target = 6);

}  // namespace fourbit::train
