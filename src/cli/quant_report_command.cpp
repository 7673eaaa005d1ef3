// `fourbit quant-report`: quantization error and bias of every format and option on synthetic
// distributions. (`fourbit run`, the main job, is in run_command.cpp.)
#include "cli/commands.h"
#include "core/device.h"
#include "core/log.h"
#include "quant/report.h"

#include <nlohmann/json.hpp>

#include <fstream>

namespace fourbit::cli {

namespace {
struct ReportArgs {
  std::string device = "auto";
  int64_t rows = 1024, cols = 1024;
  uint64_t seed = 1234;
  std::string json_path;
};

Device resolve_device(const std::string& d) {
  if (d == "cpu") return Device::kCpu;
  if (d == "cuda") {
    FOURBIT_CHECK(cuda_device_count() > 0,
                  "--device cuda: no CUDA GPU is visible{}; use --device cpu",
                  built_with_cuda() ? "" : " (this binary was built without CUDA)");
    return Device::kCuda;
  }
  FOURBIT_CHECK(d == "auto", "--device must be cpu, cuda or auto, got '{}'", d);
  return cuda_device_count() > 0 ? Device::kCuda : Device::kCpu;
}

void run_report(const ReportArgs& a) {
  quant::ReportOptions o;
  o.rows = a.rows;
  o.cols = a.cols;
  o.seed = a.seed;
  o.device = resolve_device(a.device);
  FOURBIT_CHECK(a.rows > 0 && a.cols > 0 && a.rows % 16 == 0,
                "--rows must be a positive multiple of 16 (the RHT and column-wise blocks run "
                "along rows), got {} x {}",
                a.rows, a.cols);
  log_info("quant-report: {} x {} tensors, seed {}, on {}", a.rows, a.cols, a.seed,
           device_name(o.device));
  const auto rows = quant::run_quant_report(o);
  std::fputs(quant::format_report_table(rows).c_str(), stdout);
  std::fputs(
      "\nrel.error = ||q(x) - x|| / ||x||;  rel.bias = sum(sign(x) (q(x) - x)) / sum |x| "
      "(negative: magnitudes shrink).\nColumn-wise copies (blocks along M); RHT undone before "
      "measuring. bits = storage per element incl. scales.\n",
      stdout);
  if (!a.json_path.empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& r : rows) {
      j.push_back({{"distribution", r.distribution},
                   {"case", r.case_name},
                   {"quantizer", r.config},
                   {"bits_per_element", r.bits_per_element},
                   {"relative_error", r.stats.relative_error},
                   {"relative_bias", r.stats.relative_bias}});
    }
    const std::string tmp = a.json_path + ".tmp";
    {
      std::ofstream f(tmp);
      FOURBIT_CHECK(f.good(), "cannot write '{}'", tmp);
      f << j.dump(2) << "\n";
    }
    FOURBIT_CHECK(std::rename(tmp.c_str(), a.json_path.c_str()) == 0, "cannot rename '{}' to '{}'",
                  tmp, a.json_path);
    log_info("wrote {}", a.json_path);
  }
}

void add_report_options(CLI::App* sub, ReportArgs& a) {
  sub->add_option("--device", a.device, "cpu, cuda or auto")->capture_default_str();
  sub->add_option("--rows", a.rows, "rows (M) of each synthetic tensor")->capture_default_str();
  sub->add_option("--cols", a.cols, "columns (K) of each synthetic tensor")->capture_default_str();
  sub->add_option("--seed", a.seed, "seed of the synthetic data and of stochastic rounding")
      ->capture_default_str();
  sub->add_option("--json", a.json_path, "also write the table as JSON to this file");
}
}  // namespace

Command add_quant_report_command(CLI::App& app) {
  auto args = std::make_shared<ReportArgs>();
  CLI::App* sub = app.add_subcommand(
      "quant-report", "Relative error and bias of each format/option on synthetic tensors");
  add_report_options(sub, *args);
  return {sub, [args] { run_report(*args); }};
}

}  // namespace fourbit::cli
