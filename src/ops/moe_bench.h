// `fourbit bench moe`: the CUDA MoE routing and permutation kernels at MoE training shapes, as
// GB/s of the bytes each op must move (read + written) and the ratio to the measured copy
// bandwidth (../shared/docs/BENCHMARKS.md): they are memory-bound. Needs a CUDA build and a GPU.
#pragma once

#include <string>
#include <vector>

namespace fourbit::ops {

struct MoeBenchOptions {
  int reps = 20;             // timed repetitions; the median is reported
  std::string shape_filter;  // only the shapes whose name contains this text
  std::string csv_path;      // optional: also write the table as CSV
};

struct MoeBenchRow {
  std::string shape;  // e.g. "8x-top2-d768 (N 32768, E 8, k 2, C 768)"
  std::string op;     // router_forward, router_backward, plan, permute, unpermute, ...
  double ms = 0;
  double bytes = 0;
  double gbps = 0;
  double fraction_of_copy = 0;
};

std::vector<MoeBenchRow> run_moe_bench(const MoeBenchOptions& options);

}  // namespace fourbit::ops
