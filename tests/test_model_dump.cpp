// model dump (cpu): the folder that tools/torch_crosscheck.py reads: manifest, sizes and values
// consistent with the model that wrote them, reproducible.
#include "model/dump.h"
#include "model/model.h"

#include "model_test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <cstring>
#include <vector>

namespace fourbit::model {
namespace {

std::vector<char> read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

TEST(ModelDump, WritesAConsistentReproducibleFolder) {
  const ModelConfig c = testing::small_moe();
  const std::filesystem::path root = std::filesystem::temp_directory_path() / "fourbit_test_model_dump";
  std::filesystem::remove_all(root);
  DumpOptions o;
  o.batch = 2;
  o.seq = 8;
  const double loss = dump_model_step(c, o, (root / "a").string());
  dump_model_step(c, o, (root / "b").string());
  std::ifstream mf(root / "a" / "manifest.json");
  const nlohmann::json m = nlohmann::json::parse(mf);
  EXPECT_EQ(config_from_json(m["config"]), c);
  EXPECT_EQ(m["loss"]["loss"].get<double>(), loss);
  EXPECT_EQ(m["dtype"], "f64");
  const ParamTable t = ParamTable::build(c);
  int64_t n = 0;
  for (const ParamSpec& p : t.rows()) n += p.numel();
  EXPECT_EQ(m["params"].size(), (size_t)t.size());
  EXPECT_EQ(m["params"].back()["offset"].get<int64_t>() + t.rows().back().numel(), n);
  EXPECT_EQ(read_bytes(root / "a" / "params.f32").size(), (size_t)n * 4);
  EXPECT_EQ(read_bytes(root / "a" / "grads.f64").size(), (size_t)n * 8);
  EXPECT_EQ(read_bytes(root / "a" / "logits.f64").size(), (size_t)(16 * c.vocab * 8));
  EXPECT_EQ(read_bytes(root / "a" / "expert_ids.i32").size(), (size_t)(16 * 1 * 2 * 4));
  for (const char* f : {"params.f32", "grads.f64", "logits.f64", "tokens.i32", "targets.i32", "expert_ids.i32"})
    EXPECT_EQ(read_bytes(root / "a" / f), read_bytes(root / "b" / f)) << f;
  // The weights are the model's initialization.
  ModelOptions mo;
  mo.cpu_dtype = DType::kF32;
  mo.seed = o.seed;
  Model model(c, testing::resolved(c), mo);
  const std::vector<char> params = read_bytes(root / "a" / "params.f32");
  const int64_t off = m["params"][1]["offset"].get<int64_t>();
  const TensorView v = model.params().view(1);
  EXPECT_EQ(std::memcmp(params.data() + off * 4, v.data, (size_t)v.nbytes()), 0);
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace fourbit::model
