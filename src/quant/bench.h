// `fourbit bench quant`: throughput of every CUDA quantize kernel against the measured
// device-to-device copy bandwidth (../shared/docs/BENCHMARKS.md). CUDA builds only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fourbit::quant {

struct QuantBenchOptions {
  int64_t rows = 16384, cols = 8192;
  int reps = 50;
  std::string csv_path;  // optional: also write the table as CSV
  std::string only;      // optional: only the cases whose name contains this text
};

struct QuantBenchRow {
  std::string name;
  std::string shape;
  double ms = 0;
  double bytes = 0;   // bytes read + written by this kernel (what it must move at least)
  double gbps = 0;
  double fraction_of_copy = 0;
};

// Runs the benchmark on the current GPU, prints the table and returns the rows.
std::vector<QuantBenchRow> run_quant_bench(const QuantBenchOptions& options);

}  // namespace fourbit::quant
