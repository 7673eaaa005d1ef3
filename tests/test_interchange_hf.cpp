// HF / ModelOpt interchange (interchange/hf.h): the Llama and Mixtral names and shapes, configs
// both ways, F32 export -> import bit-exact (dense tied/untied, MoE), BF16 export, the NVFP4 export
// dequantized with ModelOpt's formula against fourbit's quantizer (bit for bit), the tokenizer
// files, the reference logits, and malformed inputs whose errors name the file and the tensor.
#include "interchange/hf.h"

#include "formats/element.h"
#include "io/safetensors.h"
#include "model_test_util.h"
#include "quant/quantize.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace fourbit::interchange {
namespace {

namespace fs = std::filesystem;
using model::ModelConfig;

ModelConfig dense(bool tied) {
  ModelConfig c = model::testing::small_dense(tied);
  c.vocab = 257;  // bytes + end of document: the built-in corpus calibrates the NVFP4 export
  c.d_model = 32;
  c.d_ff = 64;
  c.max_seq = 32;
  c.validate();
  return c;
}

ModelConfig mixtral() {
  ModelConfig c = dense(false);
  c.name = "small-mixtral";
  c.moe.layers = {0, 1};
  c.moe.n_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_d_ff = 32;
  c.validate();
  return c;
}

std::unique_ptr<model::Model> make(const ModelConfig& c, const std::string& recipe_name = "bf16", uint64_t seed = 3) {
  recipe::Recipe r = recipe::preset(recipe_name);
  r.high_precision.last_blocks = 0;
  model::ModelOptions o;
  o.seed = seed;
  o.max_batch = 2;
  o.max_seq = 32;
  return std::make_unique<model::Model>(c, recipe::resolve(r, c.recipe_shape()), o);
}

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("fourbit_interchange_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

std::vector<float> host(const TensorView& v) { 
  std::vector<float> out((size_t)v.numel());
  std::memcpy(out.data(), v.data, out.size() * 4);
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(InterchangeNames, LlamaAndMixtralLayouts) {
  const ModelConfig c = dense(false);
  const std::vector<HfTensorMap> m = hf_tensor_map(c);
  std::map<std::string, HfTensorMap> by;
  for (const HfTensorMap& t : m) by[t.hf_name] = t;
  const int64_t D = c.head_dim();
  EXPECT_EQ(by.at("model.embed_tokens.weight").shape, (std::vector<int64_t>{257, 32}));
  EXPECT_EQ(by.at("model.layers.1.self_attn.q_proj.weight").shape, (std::vector<int64_t>{c.n_heads * D, 32}));
  EXPECT_EQ(by.at("model.layers.1.self_attn.k_proj.weight").shape, (std::vector<int64_t>{c.n_kv_heads * D, 32}));
  EXPECT_EQ(by.at("model.layers.1.self_attn.v_proj.weight").elem_offset, (c.n_heads + c.n_kv_heads) * D * 32);
  EXPECT_EQ(by.at("model.layers.0.mlp.up_proj.weight").elem_offset, 64 * 32);  // rows F..2F-1 of mlp.up
  EXPECT_EQ(by.at("model.layers.0.mlp.down_proj.weight").shape, (std::vector<int64_t>{32, 64}));
  EXPECT_TRUE(by.count("model.layers.0.input_layernorm.weight"));
  EXPECT_TRUE(by.count("model.layers.0.post_attention_layernorm.weight"));
  EXPECT_TRUE(by.count("model.norm.weight"));
  EXPECT_TRUE(by.count("lm_head.weight"));
  EXPECT_EQ(by.size(), 1 + 2 * 9 + 1 + 1u);
  EXPECT_FALSE(by.count("lm_head.weight") && hf_tensor_map(dense(true)).size() == m.size());
  EXPECT_EQ(hf_architecture(c), "LlamaForCausalLM");

  const ModelConfig x = mixtral();
  EXPECT_EQ(hf_architecture(x), "MixtralForCausalLM");
  std::set<std::string> names;
  for (const HfTensorMap& t : hf_tensor_map(x)) names.insert(t.hf_name);
  EXPECT_TRUE(names.count("model.layers.1.block_sparse_moe.gate.weight"));
  EXPECT_TRUE(names.count("model.layers.1.block_sparse_moe.experts.3.w1.weight"));
  EXPECT_TRUE(names.count("model.layers.1.block_sparse_moe.experts.3.w2.weight"));
  EXPECT_TRUE(names.count("model.layers.1.block_sparse_moe.experts.3.w3.weight"));
  EXPECT_FALSE(names.count("model.layers.1.mlp.gate_proj.weight"));

  // Dense blocks among the MoE blocks, or a shared expert: Qwen2-MoE, with zero q/k/v biases, a
  // zero shared-expert gate and the shared down projection exported times 2.
  ModelConfig mixed = x;
  mixed.moe.layers = {1};
  mixed.moe.n_shared_experts = 1;
  mixed.validate();
  EXPECT_EQ(hf_architecture(mixed), "Qwen2MoeForCausalLM");
  std::map<std::string, HfTensorMap> q;
  for (const HfTensorMap& t : hf_tensor_map(mixed)) q[t.hf_name] = t;
  EXPECT_TRUE(q.at("model.layers.0.mlp.gate_proj.weight").param == "blocks.0.mlp.up.weight");
  EXPECT_EQ(q.at("model.layers.1.mlp.gate.weight").param, "blocks.1.moe.router.weight");
  EXPECT_EQ(q.at("model.layers.1.mlp.experts.2.up_proj.weight").elem_offset, (2 * 2 * 32 + 32) * 32);
  EXPECT_TRUE(q.at("model.layers.1.self_attn.k_proj.bias").zeros);
  EXPECT_TRUE(q.at("model.layers.1.mlp.shared_expert_gate.weight").zeros);
  EXPECT_EQ(q.at("model.layers.1.mlp.shared_expert.down_proj.weight").scale, 2.0f);
  EXPECT_EQ(q.at("model.layers.1.mlp.shared_expert.up_proj.weight").scale, 1.0f);
  const nlohmann::json qc = hf_config_json(mixed, true);
  EXPECT_EQ(qc["model_type"], "qwen2_moe");
  EXPECT_EQ(qc["mlp_only_layers"], nlohmann::json({0}));
  EXPECT_EQ(qc["norm_topk_prob"], true);
  ModelConfig no_shared = mixed;
  no_shared.moe.n_shared_experts = 0;
  for (const HfTensorMap& t : hf_tensor_map(no_shared)) {
    if (t.hf_name.find("shared_expert") != std::string::npos) {
      EXPECT_TRUE(t.zeros) << t.hf_name;
    }
  }
}

TEST(InterchangeConfig, RoundTripAndRejections) {
  for (const ModelConfig& c : {dense(true), dense(false), mixtral()}) {
    SCOPED_TRACE(c.name);
    const nlohmann::json j = hf_config_json(c, true);
    ModelConfig back = config_from_hf(j, "config.json");
    if (c.is_moe()) back.d_ff = c.d_ff;  // Mixtral has one intermediate_size (the experts')
    back.moe.aux_loss_coef = c.moe.aux_loss_coef;
    back.moe.z_loss_coef = c.moe.z_loss_coef;
    EXPECT_EQ(back, c);
  }
  nlohmann::json j = hf_config_json(dense(true), false);
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  EXPECT_NE(error_of([&] { config_from_hf(j, "dir/config.json"); }).find("rope_scaling"), std::string::npos);
  j = hf_config_json(dense(true), false);
  j["attention_bias"] = true;
  EXPECT_NE(error_of([&] { config_from_hf(j, "dir/config.json"); }).find("dir/config.json: attention_bias"),
            std::string::npos);
  j = hf_config_json(dense(true), false);
  j["model_type"] = "gpt2";
  EXPECT_NE(error_of([&] { config_from_hf(j, "x"); }).find("gpt2"), std::string::npos);
  j = hf_config_json(dense(true), false);
  j.erase("hidden_size");
  EXPECT_NE(error_of([&] { config_from_hf(j, "x"); }).find("hidden_size"), std::string::npos);
}

void expect_same_params(const model::Model& a, const model::Model& b, bool bf16_rounded) {
  ASSERT_EQ(a.table().size(), b.table().size());
  for (int i = 0; i < a.table().size(); ++i) {
    SCOPED_TRACE(a.table().row(i).name);
    std::vector<float> x = host(a.params().view(i));
    const std::vector<float> y = host(b.params().view(i));
    if (bf16_rounded) {
      for (float& v : x) v = formats::round_to_bf16(v);
    }
    ASSERT_EQ(x.size(), y.size());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * 4), 0);
  }
}

TEST(InterchangeRoundTrip, F32ExportImportIsBitExact) {
  for (const ModelConfig& c : {dense(true), dense(false), mixtral()}) {
    SCOPED_TRACE(c.name + (c.tied_embeddings ? " tied" : " untied"));
    const auto m = make(c, "bf16", 11);
    const fs::path dir = scratch("f32");
    ExportOptions o;
    o.format = ExportFormat::kF32;
    const ExportSummary s = export_hf(*m, dir.string(), o);
    EXPECT_EQ(s.architecture, c.is_moe() ? "MixtralForCausalLM" : "LlamaForCausalLM");
    // The file: names, shapes, and one split checked against the fused weight.
    const io::SafetensorsFile f = io::SafetensorsFile::open((dir / "model.safetensors").string());
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ((int)f.tensors().size(), s.tensors);
    EXPECT_EQ(f.contains("lm_head.weight"), !c.tied_embeddings);
    const Tensor k = f.to_tensor("model.layers.1.self_attn.k_proj.weight");
    const std::vector<float> qkv = host(m->param("blocks.1.attn.qkv.weight"));
    const int64_t HD = (int64_t)c.n_heads * c.head_dim();
    EXPECT_EQ(std::memcmp(k.data(), qkv.data() + HD * c.d_model, (size_t)k.nbytes()), 0);
    const auto back = import_hf(dir.string(), recipe::preset("bf16"));
    EXPECT_EQ(back->config().name, c.name);
    expect_same_params(*m, *back, false);
    fs::remove_all(dir);
  }
}

TEST(InterchangeRoundTrip, Bf16ExportRoundsTheWeights) {
  const ModelConfig c = dense(false);
  const auto m = make(c);
  const fs::path dir = scratch("bf16");
  export_hf(*m, dir.string());
  const io::SafetensorsFile f = io::SafetensorsFile::open((dir / "model.safetensors").string());
  EXPECT_EQ(f.get("model.norm.weight").dtype, io::StDType::kBF16);
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  EXPECT_EQ(cfg["torch_dtype"], "bfloat16");
  EXPECT_EQ(cfg["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(cfg["num_key_value_heads"], c.n_kv_heads);
  const auto back = import_hf(dir.string(), recipe::preset("bf16"));
  expect_same_params(*m, *back, true);
  fs::remove_all(dir);
}

TEST(InterchangeTokenizer, ByteLevelVocabulary) {
  const auto m = make(dense(true));
  const fs::path dir = scratch("tok");
  export_hf(*m, dir.string());
  const nlohmann::json t = nlohmann::json::parse(std::ifstream(dir / "tokenizer.json"));
  const nlohmann::json& v = t["model"]["vocab"];
  ASSERT_EQ(v.size(), 256u);
  std::set<int> ids;
  for (const auto& [k, id] : v.items()) ids.insert(id.get<int>());
  EXPECT_EQ(ids.size(), 256u);
  EXPECT_EQ(v["A"], 65);
  EXPECT_EQ(v["\xC4\xA0"], 32);  // U+0120 stands for the space byte in the ByteLevel alphabet
  EXPECT_EQ(v["\xC4\x8A"], 10);  // U+010A for '\n'
  EXPECT_EQ(t["added_tokens"][0]["content"], "<|endoftext|>");
  EXPECT_EQ(t["added_tokens"][0]["id"], 256);
  EXPECT_TRUE(fs::exists(dir / "tokenizer_config.json"));
  fs::remove_all(dir);
}

// ModelOpt's dequantization of one exported module: e2m1 (low nibble first) * e4m3 scale * scale_2.
std::vector<float> modelopt_dequant(const io::SafetensorsFile& f, const std::string& module) {
  const io::StTensor& w = f.get(module + ".weight");
  const io::StTensor& s = f.get(module + ".weight_scale");
  const io::StTensor& s2 = f.get(module + ".weight_scale_2");
  EXPECT_EQ(w.dtype, io::StDType::kU8);
  EXPECT_EQ(s.dtype, io::StDType::kF8E4M3);
  EXPECT_EQ(s2.dtype, io::StDType::kF32);
  EXPECT_TRUE(s2.shape.empty());
  float scale2;
  std::memcpy(&scale2, s2.bytes.data(), 4);
  const int64_t rows = w.shape[0], K = w.shape[1] * 2;
  EXPECT_EQ(s.shape[1], K / 16);
  std::vector<float> out((size_t)(rows * K));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t byte = w.bytes[(size_t)(r * K / 2 + k / 2)];
      const float e = formats::decode_e2m1(k % 2 == 0 ? byte & 0xF : byte >> 4);
      const float sb = formats::decode_e4m3(s.bytes[(size_t)(r * (K / 16) + k / 16)]);
      out[(size_t)(r * K + k)] = e * sb * scale2;
    }
  }
  return out;
}

TEST(InterchangeNvfp4, DequantizesToFourbitsQuantizerBitForBit) {
  for (const ModelConfig& c : {dense(false), mixtral()}) {
    SCOPED_TRACE(c.name);
    const auto m = make(c, "nvfp4", 5);
    const fs::path dir = scratch("nvfp4");
    ExportOptions o;
    o.format = ExportFormat::kNvfp4;
    o.calib_batch = 1;
    o.calib_seq = 32;
    const ExportSummary s = export_hf(*m, dir.string(), o);
    EXPECT_GT(s.nvfp4_modules, 0);
    const io::SafetensorsFile f = io::SafetensorsFile::open((dir / "model.safetensors").string());
    // Our quantizer on the BF16 copy of the fused qkv weight of block 1; k_proj is its rows HD..
    const TensorView qkv = m->param("blocks.1.attn.qkv.weight");
    Tensor bf = Tensor::empty(qkv.shape, DType::kBF16, Device::kCpu);
    for (int64_t i = 0; i < qkv.numel(); ++i) bf.ptr<uint16_t>()[i] = formats::encode_bf16_rn(qkv.ptr<float>()[i]);
    const quant::QuantConfig qc = *m->recipe().linear(recipe::Stage::kRlSampler, 1, recipe::LinearKind::kQkv).fprop_w.quant;
    const Tensor ours = quant::dequantize_reference(quant::quantize_reference(bf, qc, {true, false}, {}), false);
    const int64_t HD = (int64_t)c.n_heads * c.head_dim(), KD = (int64_t)c.n_kv_heads * c.head_dim();
    const std::vector<float> k = modelopt_dequant(f, "model.layers.1.self_attn.k_proj");
    ASSERT_EQ((int64_t)k.size(), KD * c.d_model);
    EXPECT_EQ(std::memcmp(k.data(), ours.ptr<float>() + HD * c.d_model, k.size() * 4), 0);
    // The same weight_scale_2 on q, k and v (one fused unit); a positive input scale.
    for (const char* p : {"q_proj", "v_proj"}) {
      const io::StTensor& a = f.get(std::string("model.layers.1.self_attn.") + p + ".weight_scale_2");
      EXPECT_EQ(std::memcmp(a.bytes.data(), f.get("model.layers.1.self_attn.k_proj.weight_scale_2").bytes.data(), 4), 0);
    }
    float in_scale;
    std::memcpy(&in_scale, f.get("model.layers.0.self_attn.q_proj.input_scale").bytes.data(), 4);
    EXPECT_GT(in_scale, 0.0f);
    EXPECT_TRUE(std::isfinite(in_scale));
    // Excluded: lm_head (and the routers) stay BF16 and are listed.
    const nlohmann::json q = nlohmann::json::parse(std::ifstream(dir / "hf_quant_config.json"));
    EXPECT_EQ(q["quantization"]["quant_algo"], "NVFP4");
    EXPECT_EQ(q["quantization"]["group_size"], 16);
    const std::vector<std::string> ex = q["quantization"]["exclude_modules"];
    EXPECT_NE(std::find(ex.begin(), ex.end(), "lm_head"), ex.end());
    EXPECT_EQ(f.get("lm_head.weight").dtype, io::StDType::kBF16);
    if (c.is_moe()) {
      EXPECT_NE(std::find(ex.begin(), ex.end(), "model.layers.0.block_sparse_moe.gate"), ex.end());
      // Expert 2's w2 against our quantizer on that expert's own slice.
      const TensorView down = m->param("blocks.0.moe.experts.down.weight");
      const int64_t n = down.shape[1] * down.shape[2];
      Tensor e2 = Tensor::empty({down.shape[1], down.shape[2]}, DType::kBF16, Device::kCpu);
      for (int64_t i = 0; i < n; ++i) e2.ptr<uint16_t>()[i] = formats::encode_bf16_rn(down.ptr<float>()[2 * n + i]);
      const quant::QuantConfig dq =
          *m->recipe().linear(recipe::Stage::kRlSampler, 0, recipe::LinearKind::kExpertDown).fprop_w.quant;
      const Tensor e2q = quant::dequantize_reference(quant::quantize_reference(e2, dq, {true, false}, {}), false);
      const std::vector<float> w2 = modelopt_dequant(f, "model.layers.0.block_sparse_moe.experts.2.w2");
      EXPECT_EQ(std::memcmp(w2.data(), e2q.ptr<float>(), w2.size() * 4), 0);
    }
    const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
    EXPECT_EQ(cfg["quantization_config"]["quant_method"], "modelopt");
    fs::remove_all(dir);
  }
}

TEST(InterchangeQwen2Moe, ExportWritesTheEquivalentTensors) {
  ModelConfig c = mixtral();
  c.moe.layers = {1};
  c.moe.n_shared_experts = 1;
  c.validate();
  const auto m = make(c, "nvfp4", 6);
  for (ExportFormat fmt : {ExportFormat::kF32, ExportFormat::kNvfp4}) {
    const fs::path dir = scratch("qwen");
    ExportOptions o;
    o.format = fmt;
    o.calib_batch = 1;
    o.calib_seq = 32;
    const ExportSummary s = export_hf(*m, dir.string(), o);
    EXPECT_EQ(s.architecture, "Qwen2MoeForCausalLM");
    const io::SafetensorsFile f = io::SafetensorsFile::open((dir / "model.safetensors").string());
    const io::StTensor& bias = f.get("model.layers.1.self_attn.q_proj.bias");
    EXPECT_EQ(bias.dtype, fmt == ExportFormat::kF32 ? io::StDType::kF32 : io::StDType::kBF16);
    for (uint8_t byte : bias.bytes) ASSERT_EQ(byte, 0);
    if (fmt == ExportFormat::kF32) {
      const Tensor down = f.to_tensor("model.layers.1.mlp.shared_expert.down_proj.weight");
      const std::vector<float> p = host(m->param("blocks.1.moe.shared.down.weight"));
      for (int64_t i = 0; i < down.numel(); ++i) ASSERT_EQ(down.ptr<float>()[i], 2.0f * p[(size_t)i]);
      EXPECT_THROW(import_hf(dir.string(), recipe::preset("bf16")), Error);  // Llama family only
    } else {
      // Doubling the weight doubles the NVFP4 decode scale exactly and keeps every code.
      const TensorView sd = m->param("blocks.1.moe.shared.down.weight");
      Tensor bf = Tensor::empty(sd.shape, DType::kBF16, Device::kCpu);
      for (int64_t i = 0; i < sd.numel(); ++i) bf.ptr<uint16_t>()[i] = formats::encode_bf16_rn(sd.ptr<float>()[i]);
      const quant::QuantConfig qc = *m->recipe().linear(recipe::Stage::kRlSampler, 1, recipe::LinearKind::kMlpDown).fprop_w.quant;
      const Tensor ours = quant::dequantize_reference(quant::quantize_reference(bf, qc, {true, false}, {}), false);
      const std::vector<float> got = modelopt_dequant(f, "model.layers.1.mlp.shared_expert.down_proj");
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 2.0f * ours.ptr<float>()[i]) << i;
    }
    fs::remove_all(dir);
  }
}

TEST(InterchangeReference, LogitsFileHasTheBatch) {
  const ModelConfig c = dense(true);
  const auto m = make(c);
  const fs::path dir = scratch("ref");
  write_reference_logits(*m, dir.string(), 2, 16, true);
  EXPECT_EQ((int64_t)fs::file_size(dir / "logits.f64"), 2 * 16 * (int64_t)c.vocab * 8);
  EXPECT_EQ((int64_t)fs::file_size(dir / "tokens.i32"), 2 * 16 * 4);
  const nlohmann::json r = nlohmann::json::parse(std::ifstream(dir / "reference.json"));
  EXPECT_EQ(r["weights"], "bf16");
  EXPECT_GT(r["loss"].get<double>(), 0.0);
  fs::remove_all(dir);
}

TEST(InterchangeImport, MalformedInputsNameTheFileAndTensor) {
  const ModelConfig c = dense(true);
  const auto m = make(c);
  const fs::path dir = scratch("bad");
  ExportOptions o;
  o.format = ExportFormat::kF32;
  export_hf(*m, dir.string(), o);
  const io::SafetensorsFile good = io::SafetensorsFile::open((dir / "model.safetensors").string());
  // Rewrites model.safetensors with one tensor dropped, reshaped, retyped, or an extra one.
  auto rewrite = [&](const std::string& victim, const std::string& how) {
    io::SafetensorsWriter w;
    w.set_metadata("format", "pt");
    static std::vector<uint8_t> zeros(1 << 16, 0);
    for (const io::StTensor& t : good.tensors()) {
      if (t.name != victim) {
        w.add(t.name, t.dtype, t.shape, t.bytes);
      } else if (how == "shape") {
        w.add(t.name, t.dtype, {t.numel()}, t.bytes);
      } else if (how == "dtype") {
        w.add(t.name, io::StDType::kI32, t.shape, t.bytes);
      }
    }
    if (how == "extra") w.add("model.layers.0.self_attn.q_proj.bias", io::StDType::kF32, {4}, std::span<const uint8_t>(zeros.data(), 16));
    const fs::path p = dir / "bad" / "model.safetensors";
    fs::create_directories(p.parent_path());
    fs::copy_file(dir / "config.json", dir / "bad" / "config.json", fs::copy_options::overwrite_existing);
    w.write(p.string());
    return p.string();
  };
  const std::string victim = "model.layers.1.mlp.down_proj.weight";
  std::string file = rewrite(victim, "drop");
  std::string e = error_of([&] { import_hf((dir / "bad").string(), recipe::preset("bf16")); });
  EXPECT_NE(e.find(victim), std::string::npos) << e;
  file = rewrite(victim, "shape");
  e = error_of([&] { import_hf((dir / "bad").string(), recipe::preset("bf16")); });
  EXPECT_NE(e.find(victim), std::string::npos) << e;
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("shape"), std::string::npos) << e;
  file = rewrite(victim, "dtype");
  e = error_of([&] { import_hf((dir / "bad").string(), recipe::preset("bf16")); });
  EXPECT_NE(e.find(victim), std::string::npos) << e;
  EXPECT_NE(e.find("I32"), std::string::npos) << e;
  file = rewrite("", "extra");
  e = error_of([&] { import_hf((dir / "bad").string(), recipe::preset("bf16")); });
  EXPECT_NE(e.find("q_proj.bias"), std::string::npos) << e;
  // A corrupt file: the safetensors reader names it.
  { std::ofstream(dir / "bad" / "model.safetensors", std::ios::binary) << "garbage"; }
  e = error_of([&] { import_hf((dir / "bad").string(), recipe::preset("bf16")); });
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  // No weights at all.
  fs::remove(dir / "bad" / "model.safetensors");
  e = error_of([&] { import_hf((dir / "bad").string(), recipe::preset("bf16")); });
  EXPECT_NE(e.find("model.safetensors.index.json"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(InterchangeImport, ShardedIndexAndRouterBias) {
  const ModelConfig c = dense(true);
  const auto m = make(c, "bf16", 8);
  const fs::path dir = scratch("shards");
  ExportOptions o;
  o.format = ExportFormat::kF32;
  export_hf(*m, dir.string(), o);
  // Split into two shards with an index, as HF writes large models.
  const io::SafetensorsFile f = io::SafetensorsFile::open((dir / "model.safetensors").string());
  io::SafetensorsWriter a, b;
  nlohmann::json map = nlohmann::json::object();
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const io::StTensor& t = f.tensors()[i];
    (i % 2 == 0 ? a : b).add(t.name, t.dtype, t.shape, t.bytes);
    map[t.name] = i % 2 == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  a.write((dir / "model-00001-of-00002.safetensors").string());
  b.write((dir / "model-00002-of-00002.safetensors").string());
  { std::ofstream(dir / "model.safetensors.index.json") << nlohmann::json({{"weight_map", map}}).dump(); }
  fs::remove(dir / "model.safetensors");
  const auto back = import_hf(dir.string(), recipe::preset("bf16"));
  expect_same_params(*m, *back, false);
  fs::remove_all(dir);

  // A non-zero selection bias is refused unless dropped.
  ModelConfig x = mixtral();
  x.moe.load_balancing = model::LoadBalancing::kBias;
  const auto mb = make(x);
  mb->param("blocks.0.moe.router.bias").ptr<float>()[1] = 0.5f;
  const fs::path d2 = scratch("bias");
  EXPECT_NE(error_of([&] { export_hf(*mb, d2.string()); }).find("blocks.0.moe.router.bias"), std::string::npos);
  ExportOptions drop;
  drop.drop_router_bias = true;
  EXPECT_NO_THROW(export_hf(*mb, d2.string(), drop));
  fs::remove_all(d2);
}

}  // namespace
}  // namespace fourbit::interchange
