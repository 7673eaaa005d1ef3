// `fourbit bench <what>`: benchmarks that print a figure and its ratio to the hardware ceiling.
#include "cli/commands.h"
#include "core/check.h"
#include "core/device.h"
#include "quant/bench.h"

namespace fourbit::cli {

Command add_bench_command(CLI::App& app) {
  auto opts = std::make_shared<quant::QuantBenchOptions>();
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks against the GPU's ceilings");
  bench->require_subcommand(1);
  CLI::App* q = bench->add_subcommand(
      "quant", "GB/s of every CUDA quantize kernel and its fraction of the copy bandwidth");
  q->add_option("--rows", opts->rows, "rows of the BF16 source")->capture_default_str();
  q->add_option("--cols", opts->cols, "columns of the BF16 source")->capture_default_str();
  q->add_option("--reps", opts->reps, "timed repetitions (median reported)")->capture_default_str();
  q->add_option("--csv", opts->csv_path, "also write the table as CSV to this file");
  return {bench, [opts] {
            FOURBIT_CHECK(built_with_cuda() && cuda_device_count() > 0,
                          "bench quant needs a CUDA GPU (this binary: {}; GPUs visible: {})",
                          built_with_cuda() ? "CUDA build" : "CPU-only build", cuda_device_count());
#if defined(FOURBIT_WITH_CUDA)
            quant::run_quant_bench(*opts);
#endif
          }};
}

}  // namespace fourbit::cli
