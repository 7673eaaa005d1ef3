// `fourbit plot run1/metrics.jsonl run2 ... -o loss.svg`: training and validation loss curves of
// one or more runs side by side as a self-contained SVG (train/plot.h); for RL runs
// (rl_metrics.jsonl) the mean reward and the K3 divergence instead.
#include "cli/commands.h"
#include "core/check.h"
#include "core/log.h"
#include "io/atomic_file.h"
#include "train/plot.h"

namespace fourbit::cli {

namespace {

struct PlotArgs {
  std::vector<std::string> inputs;
  std::vector<std::string> labels;
  std::string output = "loss.svg";
  train::PlotOptions options;
};

void run_plot(const PlotArgs& a) {
  FOURBIT_CHECK(a.labels.empty() || a.labels.size() == a.inputs.size(),
                "plot: {} --label values for {} inputs: give one per input or none",
                a.labels.size(), a.inputs.size());
  std::vector<train::LossSeries> series;
  for (size_t i = 0; i < a.inputs.size(); ++i) {
    series.push_back(train::read_loss_series(a.inputs[i]));
    if (!a.labels.empty()) series.back().label = a.labels[i];
  }
  train::PlotOptions o = a.options;
  const train::MetricsKind kind = series.front().kind;
  for (size_t i = 0; i < series.size(); ++i) {
    FOURBIT_CHECK(series[i].kind == kind, "plot: '{}' is {} run and '{}' {}: plot pretraining and RL runs "
                  "separately", a.inputs[0], kind == train::MetricsKind::kRl ? "an RL" : "a pretraining",
                  a.inputs[i], series[i].kind == train::MetricsKind::kRl ? "an RL run" : "a pretraining run");
  }
  if (kind == train::MetricsKind::kRl) {
    o.panels = train::rl_panels();
    if (o.title == "loss") o.title = "RL";
  }
  io::write_file_atomically(a.output, train::render_loss_svg(series, o));
  log_info("wrote {} ({} run{})", a.output, series.size(), series.size() == 1 ? "" : "s");
}

}  // namespace

Command add_plot_command(CLI::App& app) {
  auto args = std::make_shared<PlotArgs>();
  CLI::App* sub = app.add_subcommand(
      "plot", "Plot training and validation loss of runs (metrics.jsonl files or run directories) "
              "as an SVG; RL runs (rl_metrics.jsonl): mean reward and K3 divergence");
  sub->add_option("inputs", args->inputs, "metrics.jsonl / rl_metrics.jsonl files or run directories")->required();
  sub->add_option("-o,--output", args->output, "the SVG file to write")->capture_default_str();
  sub->add_option("--label", args->labels, "legend label per input (default: the run's recipe)");
  sub->add_option("--smooth", args->options.smooth,
                  "exponential moving average of the training curves, in [0, 1)")
      ->capture_default_str();
  sub->add_option("--title", args->options.title)->capture_default_str();
  sub->add_option("--width", args->options.width)->capture_default_str();
  sub->add_option("--height", args->options.height)->capture_default_str();
  return {sub, [args] { run_plot(*args); }};
}

}  // namespace fourbit::cli
