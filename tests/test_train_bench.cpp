// train/bench.h on the CPU (the GPU run is `fourbit bench train` in tools/gpu-test.sh): one row per
// preset and recipe, positive timings, a finite loss near ln(vocab) for random tokens, the CSV.
#include "train/bench.h"

#include "core/device.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace fourbit::train {
namespace {

TEST(TrainBench, CpuRowsAndCsv) {
  TrainBenchOptions o;
  o.device = Device::kCpu;
  o.presets = {"tiny"};
  o.recipes = {"bf16", "nvfp4"};
  o.sets = {"d_model=64", "n_heads=1", "n_kv_heads=1", "d_ff=128", "n_layers=2"};
  o.batch_size = 2;
  o.seq_len = 32;
  o.warmup = 0;
  o.steps = 1;
  o.csv_path = (std::filesystem::temp_directory_path() / fmt::format("fourbit_bt_{}.csv", ::getpid())).string();
  const std::vector<TrainBenchRow> rows = run_train_bench(o);
  ASSERT_EQ(rows.size(), 2u);
  for (const TrainBenchRow& r : rows) {
    EXPECT_EQ(r.preset, "tiny");
    EXPECT_GT(r.step_ms, 0);
    EXPECT_NEAR(r.tokens_per_s, 64 / (r.step_ms / 1e3), 1e-6 * r.tokens_per_s);
    EXPECT_NEAR(r.loss, std::log(256.0), 0.3);  // random targets over the 256-token vocabulary
    EXPECT_GT(r.arena_gib, 0);
  }
  // One model for both recipes, its arena resized per recipe: nvfp4 keeps its Wgrad inputs as
  // quantized copies (outside the arena), so its arena is smaller; bf16 keeps none.
  EXPECT_EQ(rows[0].saved_gib, 0);
  EXPECT_GT(rows[1].saved_gib, 0);
  EXPECT_LT(rows[1].arena_gib, rows[0].arena_gib);
  std::ifstream f(o.csv_path);
  std::string header, line;
  std::getline(f, header);
  EXPECT_EQ(header, "preset,recipe,batch,seq_len,params,step_ms,tokens_per_s,mfu,peak_gib,loss,arena_gib,saved_gib");
  int n = 0;
  while (std::getline(f, line)) {
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), 11) << line;
    ++n;
  }
  EXPECT_EQ(n, 2);
  std::filesystem::remove(o.csv_path);
  const std::string table = train_bench_table(rows);
  EXPECT_NE(table.find("1.00x"), std::string::npos) << table;
  o.device = Device::kCuda;
  if (cuda_device_count() == 0) {
    EXPECT_THROW(run_train_bench(o), Error);
  }
}

}  // namespace
}  // namespace fourbit::train
