// model decode (cpu): the llama-1.1b preset (TinyLlama's shape, the decode benchmark's model: its
// exact parameter count and layer shapes, and that every recipe resolves for it), and sampler
// weights on the CPU: refresh/release are no-ops there and forward_cached keeps the reference path
// (identical logits before and after a refresh). The CUDA decode path is test_model_decode_cuda.
#include "model/config.h"
#include "model/model.h"
#include "model/params.h"

#include "model_test_util.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace fourbit::model {
namespace {

using testing::values;

TEST(ModelDecode, Llama11bPreset) {
  const ModelConfig c = preset("llama-1.1b");
  EXPECT_EQ(c.name, "llama-1.1b");
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.qkv_dim(), 2048 + 2 * 256);
  EXPECT_FALSE(c.tied_embeddings);
  const ParamTable t = ParamTable::build(c);
  // TinyLlama-1.1B: 2 x 32000 x 2048 (embedding, LM head) + 22 x 44,044,288 + 2048 (final norm).
  EXPECT_EQ(t.n_params(), 1100048384);
  EXPECT_EQ(t.find("blocks.21.mlp.up.weight").shape, (Shape{2 * 5632, 2048}));
  EXPECT_EQ(t.find("blocks.0.attn.qkv.weight").shape, (Shape{2560, 2048}));
  bool listed = false;
  for (std::string_view n : preset_names()) listed |= n == "llama-1.1b";
  EXPECT_TRUE(listed);
  for (std::string_view r : recipe::preset_names()) {
    EXPECT_NO_THROW(recipe::resolve(recipe::preset(r), c.recipe_shape())) << r;
  }
}

TEST(ModelDecode, SamplerWeightsAreANoOpOnTheCpu) {
  ModelConfig c = testing::small_dense(false);
  ModelOptions o;
  o.seed = 5;
  Model m(c, testing::resolved(c, "e2e4"), o);
  const Tensor tokens = testing::make_batch(3, 4, c.vocab, 9).tokens;
  const std::vector<int32_t> n_new{4, 4, 4};
  KvCache a = m.make_kv_cache(3, 8, 4);
  const std::vector<double> before = values(m.forward_cached(a, tokens, n_new));
  m.refresh_sampler_weights();
  EXPECT_FALSE(m.has_sampler_weights());
  EXPECT_EQ(m.sampler_weight_bytes(), 0);
  std::string why;
  EXPECT_FALSE(m.sampler_weights_supported(&why));
  EXPECT_NE(why.find("no sampler weights"), std::string::npos) << why;
  KvCache b = m.make_kv_cache(3, 8, 4);
  const std::vector<double> after = values(m.forward_cached(b, tokens, n_new));
  EXPECT_EQ(before, after);
  m.release_sampler_weights();
  EXPECT_FALSE(m.has_sampler_weights());
}

}  // namespace
}  // namespace fourbit::model
