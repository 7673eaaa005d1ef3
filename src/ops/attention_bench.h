// `fourbit bench attention`: the CUDA attention kernels at training and decode shapes. Training
// rows report model TFLOP/s (causal forward 2 B H T^2 D, backward 2.5x that, the usual
// FlashAttention accounting; our backward does 3.5x the forward's math because of its separate
// dq pass) and their ratio to the measured cuBLASLt BF16 ceiling; decode rows report GB/s of
// key/value cache read and the ratio to the measured copy bandwidth (../shared/docs/BENCHMARKS.md).
// "forward" and "backward" time the default kernels (wgmma where attention_wgmma_available()).
// There, every training shape also gets "forward (mma.sync)" and "backward (mma.sync)" rows
// (AttentionOptions::wgmma_* off), a "backward (wgmma, no overlap)" row
// (AttentionOptions::wgmma_overlap off) and "forward / backward (wgmma fast exp)" rows
// (AttentionOptions::wgmma_fast_exp), so each run is an A/B of the kernel variants
// (FOURBIT_ATTENTION_WGMMA* set in the environment override every row alike).
// Needs a CUDA build and a GPU.
#pragma once

#include <string>
#include <vector>

namespace fourbit::ops {

struct AttentionBenchOptions {
  int reps = 20;             // timed repetitions; the median is reported
  std::string shape_filter;  // only the shapes whose name contains this text
  std::string csv_path;      // optional: also write the table as CSV
};

struct AttentionBenchRow {
  std::string shape;  // e.g. "gpt2-124m (B 32, T 1024, H 12/12, D 64)"
  std::string op;     // forward, backward, forward (mma.sync), ..., decode
  double ms = 0;
  double tflops = 0;  // training rows
  double gbps = 0;    // decode rows
  double fraction_of_ceiling = 0;
};

std::vector<AttentionBenchRow> run_attention_bench(const AttentionBenchOptions& options);

}  // namespace fourbit::ops
