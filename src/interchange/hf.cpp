// Implementation of hf.h: the name map, config.json both ways, the export (BF16 / F32 / ModelOpt
// NVFP4 with calibrated input scales), the byte-level tokenizer files, the import, and the
// reference logits of the cross-check.
#include "interchange/hf.h"

#include "core/check.h"
#include "core/log.h"
#include "formats/element.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "quant/quantize.h"
#include "rl/byte_tokens.h"
#include "rl/synthetic_corpus.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

namespace fourbit::interchange {

using recipe::LinearKind;
namespace fs = std::filesystem;

namespace {

int64_t prod(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Host f32 copy of a tensor on any device (f32, f64 or bf16).
std::vector<float> host_f32(const TensorView& v) {
  Tensor raw = Tensor::empty(v.shape, v.dtype, Device::kCpu);
  copy_tensor(raw.view(), v);
  std::vector<float> out((size_t)v.numel());
  for (int64_t i = 0; i < v.numel(); ++i) {
    switch (v.dtype) {
      case DType::kF32: out[(size_t)i] = raw.ptr<float>()[i]; break;
      case DType::kF64: out[(size_t)i] = (float)raw.ptr<double>()[i]; break;
      case DType::kBF16: out[(size_t)i] = formats::decode_bf16(raw.ptr<uint16_t>()[i]); break;
      default: FOURBIT_CHECK(false, "interchange: unexpected dtype {} of {}", dtype_name(v.dtype), v.describe());
    }
  }
  return out;
}

std::string layer_key(int block, LinearKind kind) {
  return kind == LinearKind::kLmHead ? std::string("lm_head")
                                     : fmt::format("blocks.{}.{}", block, recipe::kind_name(kind));
}

void write_json(const fs::path& path, const nlohmann::json& j) {
  const std::string text = j.dump(2) + "\n";
  io::write_file_atomically(path.string(), text);
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream f(path);
  FOURBIT_CHECK(f.good(), "cannot read '{}'", path.string());
  try {
    nlohmann::json j;
    f >> j;
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("'{}' is not valid JSON: {}", path.string(), e.what()));
  }
}

// GPT-2's ByteLevel alphabet: byte b -> the Unicode code point that stands for it.
std::vector<uint32_t> byte_level_alphabet() {
  std::vector<uint32_t> cp(256, 0);
  std::vector<bool> direct(256, false);
  for (int b = '!'; b <= '~'; ++b) direct[(size_t)b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[(size_t)b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[(size_t)b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) cp[(size_t)b] = direct[(size_t)b] ? (uint32_t)b : next++;
  return cp;
}

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += (char)cp;
  } else if (cp < 0x800) {
    s += (char)(0xC0 | (cp >> 6));
    s += (char)(0x80 | (cp & 0x3F));
  } else {
    s += (char)(0xE0 | (cp >> 12));
    s += (char)(0x80 | ((cp >> 6) & 0x3F));
    s += (char)(0x80 | (cp & 0x3F));
  }
  return s;
}

void write_tokenizer(const fs::path& dir, int vocab) {
  const std::vector<uint32_t> cp = byte_level_alphabet();
  nlohmann::json v = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) v[utf8(cp[(size_t)b])] = b;
  const bool eod = vocab >= rl::kByteVocabSize;
  nlohmann::json added = nlohmann::json::array();
  if (eod) {
    added.push_back({{"id", rl::kEndOfDocumentToken}, {"content", std::string(rl::kEndOfDocumentText)},
                     {"single_word", false}, {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                     {"special", true}});
  }
  const nlohmann::json tok = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                 {"vocab", v}, {"merges", nlohmann::json::array()}}}};
  write_json(dir / "tokenizer.json", tok);
  nlohmann::json cfg = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                        {"model_max_length", 1000000000},
                        {"clean_up_tokenization_spaces", false}};
  nlohmann::json special = nlohmann::json::object();
  if (eod) {
    const std::string e(rl::kEndOfDocumentText);
    cfg["eos_token"] = e;
    cfg["bos_token"] = e;
    special = {{"eos_token", e}, {"bos_token", e}};
  }
  write_json(dir / "tokenizer_config.json", cfg);
  write_json(dir / "special_tokens_map.json", special);
}

}  // namespace

// ---- architecture and names -------------------------------------------------------------------------

std::string hf_architecture(const model::ModelConfig& c) {
  if (!c.is_moe()) return "LlamaForCausalLM";
  if (c.n_moe_layers() == c.n_layers && c.moe.n_shared_experts == 0) return "MixtralForCausalLM";
  return "Qwen2MoeForCausalLM";
}

std::vector<HfTensorMap> hf_tensor_map(const model::ModelConfig& c) {
  std::vector<HfTensorMap> m;
  const int64_t C = c.d_model, D = c.head_dim(), HD = (int64_t)c.n_heads * D, KD = (int64_t)c.n_kv_heads * D;
  auto plain = [&](std::string hf, std::string param, std::vector<int64_t> shape) {
    HfTensorMap t;
    t.hf_name = std::move(hf);
    t.param = std::move(param);
    t.shape = std::move(shape);
    m.push_back(std::move(t));
  };
  // A row range [row0, row0 + rows) of the quantization unit [unit_rows, cols] at unit_offset.
  auto linear = [&](std::string module, std::string param, int block, LinearKind kind, int64_t unit_offset,
                    int64_t unit_rows, int64_t cols, int64_t row0, int64_t rows, int expert = -1) {
    HfTensorMap t;
    t.hf_name = module + ".weight";
    t.module = std::move(module);
    t.param = std::move(param);
    t.elem_offset = unit_offset + row0 * cols;
    t.shape = {rows, cols};
    t.linear = true;
    t.block = block;
    t.kind = kind;
    t.unit_offset = unit_offset;
    t.unit_rows = unit_rows;
    t.unit_cols = cols;
    t.row0 = row0;
    t.expert = expert;
    m.push_back(std::move(t));
  };
  // Tensors with no fourbit counterpart that the HF architecture needs: zeros (`module` set: the
  // weight of a linear module, which NVFP4 exports list as excluded).
  auto zeros = [&](std::string hf, std::string module, std::vector<int64_t> shape) {
    HfTensorMap t;
    t.hf_name = std::move(hf);
    t.module = std::move(module);
    t.linear = !t.module.empty();
    t.zeros = true;
    t.shape = std::move(shape);
    m.push_back(std::move(t));
  };
  const bool qwen = hf_architecture(c) == "Qwen2MoeForCausalLM";
  plain("model.embed_tokens.weight", "embedding.weight", {c.vocab, C});
  for (int b = 0; b < c.n_layers; ++b) {
    const std::string hp = fmt::format("model.layers.{}.", b), fp = fmt::format("blocks.{}.", b);
    plain(hp + "input_layernorm.weight", fp + "attn_norm.weight", {C});
    const std::string qkv = fp + "attn.qkv.weight";
    linear(hp + "self_attn.q_proj", qkv, b, LinearKind::kQkv, 0, HD + 2 * KD, C, 0, HD);
    linear(hp + "self_attn.k_proj", qkv, b, LinearKind::kQkv, 0, HD + 2 * KD, C, HD, KD);
    linear(hp + "self_attn.v_proj", qkv, b, LinearKind::kQkv, 0, HD + 2 * KD, C, HD + KD, KD);
    if (qwen) {  // Qwen2's q/k/v projections have biases: zero
      zeros(hp + "self_attn.q_proj.bias", "", {HD});
      zeros(hp + "self_attn.k_proj.bias", "", {KD});
      zeros(hp + "self_attn.v_proj.bias", "", {KD});
    }
    linear(hp + "self_attn.o_proj", fp + "attn.out.weight", b, LinearKind::kAttnOut, 0, C, HD, 0, C);
    plain(hp + "post_attention_layernorm.weight", fp + "mlp_norm.weight", {C});
    if (qwen && c.is_moe_block(b)) {
      const int64_t E = c.moe.n_experts, Fe = c.moe.expert_d_ff;
      const std::string mp = hp + "mlp.";
      linear(mp + "gate", fp + "moe.router.weight", b, LinearKind::kRouter, 0, E, C, 0, E);
      const std::string up = fp + "moe.experts.up.weight", down = fp + "moe.experts.down.weight";
      for (int e = 0; e < E; ++e) {
        const std::string ep = fmt::format("{}experts.{}.", mp, e);
        linear(ep + "gate_proj", up, b, LinearKind::kExpertUp, e * 2 * Fe * C, 2 * Fe, C, 0, Fe, e);
        linear(ep + "up_proj", up, b, LinearKind::kExpertUp, e * 2 * Fe * C, 2 * Fe, C, Fe, Fe, e);
        linear(ep + "down_proj", down, b, LinearKind::kExpertDown, e * C * Fe, C, Fe, 0, C, e);
      }
      // Qwen2-MoE adds sigmoid(shared_expert_gate x) * shared_expert(x): a zero gate gives exactly
      // 0.5, so the down projection is exported times 2 (exact); no shared expert: zero weights.
      if (c.moe.n_shared_experts == 1) {
        const std::string su = fp + "moe.shared.up.weight";
        linear(mp + "shared_expert.gate_proj", su, b, LinearKind::kMlpUp, 0, 2 * Fe, C, 0, Fe);
        linear(mp + "shared_expert.up_proj", su, b, LinearKind::kMlpUp, 0, 2 * Fe, C, Fe, Fe);
        linear(mp + "shared_expert.down_proj", fp + "moe.shared.down.weight", b, LinearKind::kMlpDown, 0, C, Fe, 0, C);
        m.back().scale = 2.0f;
      } else {
        for (const char* n : {"gate_proj", "up_proj"}) {
          zeros(mp + "shared_expert." + n + ".weight", mp + "shared_expert." + n, {Fe, C});
        }
        zeros(mp + "shared_expert.down_proj.weight", mp + "shared_expert.down_proj", {C, Fe});
      }
      zeros(mp + "shared_expert_gate.weight", mp + "shared_expert_gate", {1, C});
    } else if (c.is_moe_block(b)) {
      const int64_t E = c.moe.n_experts, Fe = c.moe.expert_d_ff;
      const std::string mp = hp + "block_sparse_moe.";
      linear(mp + "gate", fp + "moe.router.weight", b, LinearKind::kRouter, 0, E, C, 0, E);
      for (int e = 0; e < E; ++e) {
        const std::string ep = fmt::format("{}experts.{}.", mp, e);
        const std::string up = fp + "moe.experts.up.weight", down = fp + "moe.experts.down.weight";
        linear(ep + "w1", up, b, LinearKind::kExpertUp, e * 2 * Fe * C, 2 * Fe, C, 0, Fe, e);
        linear(ep + "w3", up, b, LinearKind::kExpertUp, e * 2 * Fe * C, 2 * Fe, C, Fe, Fe, e);
        linear(ep + "w2", down, b, LinearKind::kExpertDown, e * C * Fe, C, Fe, 0, C, e);
      }
    } else {
      const int64_t F = c.d_ff;
      const std::string up = fp + "mlp.up.weight";
      linear(hp + "mlp.gate_proj", up, b, LinearKind::kMlpUp, 0, 2 * F, C, 0, F);
      linear(hp + "mlp.up_proj", up, b, LinearKind::kMlpUp, 0, 2 * F, C, F, F);
      linear(hp + "mlp.down_proj", fp + "mlp.down.weight", b, LinearKind::kMlpDown, 0, C, F, 0, C);
    }
  }
  plain("model.norm.weight", "final_norm.weight", {C});
  if (!c.tied_embeddings) linear("lm_head", "lm_head.weight", -1, LinearKind::kLmHead, 0, c.vocab, C, 0, c.vocab);
  return m;
}

nlohmann::json hf_config_json(const model::ModelConfig& c, bool f32) {
  const std::string arch = hf_architecture(c);
  const bool qwen = arch == "Qwen2MoeForCausalLM";
  const bool moe = c.is_moe() && !qwen;  // Mixtral
  nlohmann::json j = {
      {"architectures", {arch}},
      {"model_type", qwen ? "qwen2_moe" : moe ? "mixtral" : "llama"},
      {"vocab_size", c.vocab},
      {"hidden_size", c.d_model},
      {"intermediate_size", moe ? c.moe.expert_d_ff : c.d_ff},
      {"num_hidden_layers", c.n_layers},
      {"num_attention_heads", c.n_heads},
      {"num_key_value_heads", c.n_kv_heads},
      {"head_dim", c.head_dim()},
      {"hidden_act", "silu"},
      {"max_position_embeddings", c.max_seq},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"tie_word_embeddings", c.tied_embeddings},
      {"torch_dtype", f32 ? "float32" : "bfloat16"},
      {"initializer_range", 0.02},
      {"use_cache", true},
      {"fourbit_model_name", c.name}};
  if (c.vocab >= rl::kByteVocabSize) {
    j["eos_token_id"] = rl::kEndOfDocumentToken;
    j["bos_token_id"] = rl::kEndOfDocumentToken;
  }
  if (moe) {
    j["num_local_experts"] = c.moe.n_experts;
    j["num_experts_per_tok"] = c.moe.top_k;
    j["router_aux_loss_coef"] = c.moe.aux_loss_coef;
    j["output_router_logits"] = false;
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = nullptr;
  } else if (qwen) {
    std::vector<int> dense_blocks;
    for (int b = 0; b < c.n_layers; ++b) {
      if (!c.is_moe_block(b)) dense_blocks.push_back(b);
    }
    j["num_experts"] = c.moe.n_experts;
    j["num_experts_per_tok"] = c.moe.top_k;
    j["moe_intermediate_size"] = c.moe.expert_d_ff;
    j["shared_expert_intermediate_size"] = c.moe.expert_d_ff;
    j["norm_topk_prob"] = true;
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = dense_blocks;
    j["qkv_bias"] = true;
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.n_layers;
    j["router_aux_loss_coef"] = c.moe.aux_loss_coef;
    j["output_router_logits"] = false;
  } else {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  return j;
}

model::ModelConfig config_from_hf(const nlohmann::json& j, const std::string& where) {
  FOURBIT_CHECK(j.is_object(), "{}: not a JSON object", where);
  auto has = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };
  auto int_of = [&](const char* k) -> int {
    FOURBIT_CHECK(has(k) && j[k].is_number_integer(), "{}: '{}' is missing or not an integer", where, k);
    return j[k].get<int>();
  };
  auto num_of = [&](const char* k, double def) -> double {
    if (!has(k)) return def;
    FOURBIT_CHECK(j[k].is_number(), "{}: '{}' is not a number", where, k);
    return j[k].get<double>();
  };
  auto bool_of = [&](const char* k, bool def) -> bool {
    if (!has(k)) return def;
    FOURBIT_CHECK(j[k].is_boolean(), "{}: '{}' is not true/false", where, k);
    return j[k].get<bool>();
  };
  const std::string type = has("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
  FOURBIT_CHECK(type == "llama" || type == "mistral" || type == "mixtral",
                "{}: model_type '{}' is not supported; fourbit imports the Llama family (llama, mistral, "
                "mixtral)", where, type);
  const std::string act = has("hidden_act") && j["hidden_act"].is_string() ? j["hidden_act"].get<std::string>() : "silu";
  FOURBIT_CHECK(act == "silu", "{}: hidden_act '{}': fourbit's MLP is SwiGLU (silu)", where, act);
  FOURBIT_CHECK(!bool_of("attention_bias", false), "{}: attention_bias = true: fourbit has no biases", where);
  FOURBIT_CHECK(!bool_of("mlp_bias", false), "{}: mlp_bias = true: fourbit has no biases", where);
  FOURBIT_CHECK(!has("rope_scaling"), "{}: rope_scaling = {}: fourbit implements plain RoPE only (no Llama 3.1 / "
                "YaRN / linear scaling)", where, has("rope_scaling") ? j["rope_scaling"].dump() : "");
  FOURBIT_CHECK(num_of("partial_rotary_factor", 1.0) == 1.0, "{}: partial_rotary_factor != 1: fourbit rotates the "
                "whole head", where);
  model::ModelConfig c;
  c.name = has("fourbit_model_name") && j["fourbit_model_name"].is_string() ? j["fourbit_model_name"].get<std::string>()
                                                                             : "hf-" + type;
  c.vocab = int_of("vocab_size");
  c.d_model = int_of("hidden_size");
  c.n_layers = int_of("num_hidden_layers");
  c.n_heads = int_of("num_attention_heads");
  c.n_kv_heads = has("num_key_value_heads") ? int_of("num_key_value_heads") : c.n_heads;
  c.d_ff = int_of("intermediate_size");
  c.max_seq = int_of("max_position_embeddings");
  c.rope_theta = num_of("rope_theta", 10000.0);
  c.norm_eps = num_of("rms_norm_eps", 1e-6);
  c.tied_embeddings = bool_of("tie_word_embeddings", false);
  FOURBIT_CHECK(c.n_heads > 0 && c.d_model % c.n_heads == 0, "{}: hidden_size {} is not a multiple of "
                "num_attention_heads {}", where, c.d_model, c.n_heads);
  if (has("head_dim")) {
    FOURBIT_CHECK(int_of("head_dim") == c.d_model / c.n_heads, "{}: head_dim {} != hidden_size / "
                  "num_attention_heads = {}: fourbit derives the head size from d_model", where,
                  int_of("head_dim"), c.d_model / c.n_heads);
  }
  if (has("sliding_window")) {
    FOURBIT_CHECK(j["sliding_window"].is_number_integer() && j["sliding_window"].get<int64_t>() >= c.max_seq,
                  "{}: sliding_window {} < max_position_embeddings {}: fourbit's attention is full causal", where,
                  j["sliding_window"].dump(), c.max_seq);
  }
  if (type == "mixtral") {
    c.moe.n_experts = int_of("num_local_experts");
    c.moe.top_k = int_of("num_experts_per_tok");
    c.moe.expert_d_ff = c.d_ff;
    c.moe.aux_loss_coef = num_of("router_aux_loss_coef", 0.001);
    for (int b = 0; b < c.n_layers; ++b) c.moe.layers.push_back(b);
  }
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(fmt::format("{}: the config does not make a valid fourbit model: {}", where, e.what()));
  }
  return c;
}

// ---- batches ------------------------------------------------------------------------------------

TokenBatch corpus_batch(int vocab, int B, int T, uint64_t first_document) {
  FOURBIT_CHECK(vocab >= rl::kByteTokenCount, "the built-in corpus needs a vocabulary of >= 256 byte tokens, "
                "the model has {}", vocab);
  std::vector<int32_t> t((size_t)B * (T + 1));
  rl::SyntheticCorpus corpus;
  rl::CorpusReader reader(corpus, rl::CorpusSplit::kTrain, {first_document, 0});
  reader.fill_tokens(std::span<int32_t>(t));
  if (vocab < rl::kByteVocabSize) {
    for (int32_t& x : t) {
      if (x == rl::kEndOfDocumentToken) x = 0;
    }
  }
  TokenBatch b{Tensor::empty({B, T}, DType::kI32, Device::kCpu), Tensor::empty({B, T}, DType::kI32, Device::kCpu)};
  for (int s = 0; s < B; ++s) {
    for (int i = 0; i < T; ++i) {
      b.tokens.ptr<int32_t>()[s * T + i] = t[(size_t)(s * (T + 1) + i)];
      b.targets.ptr<int32_t>()[s * T + i] = t[(size_t)(s * (T + 1) + i + 1)];
    }
  }
  return b;
}

// ---- export -------------------------------------------------------------------------------------

namespace {

// Largest |x| of each linear layer's Fprop input over a KV-cache (rl_sampler) pass of a corpus
// batch; routed experts per expert (over their rows). Key: layer_key + "#" + expert (-1 dense).
std::map<std::string, float> calibrate(model::Model& m, const ExportOptions& o) {
  std::map<std::string, float> amax;
  const TokenBatch batch = corpus_batch(m.config().vocab, o.calib_batch, o.calib_seq, o.calib_document);
  m.set_gemm_observer([&](const model::GemmObservation& obs) {
    if (obs.gemm != recipe::Gemm::kFprop) return;
    const std::vector<float> x = host_f32(obs.a);
    const int64_t cols = obs.a.shape[obs.a.shape.ndim - 1];
    if (obs.group_sizes.empty()) {
      float a = 0;
      for (float v : x) a = std::max(a, std::fabs(v));
      float& slot = amax[std::string(obs.layer) + "#-1"];
      slot = std::max(slot, a);
      return;
    }
    int64_t row = 0;
    for (size_t e = 0; e < obs.group_sizes.size(); ++e) {
      float a = 0;
      for (int64_t r = row; r < row + obs.group_sizes[e]; ++r)
        for (int64_t k = 0; k < cols; ++k) a = std::max(a, std::fabs(x[(size_t)(r * cols + k)]));
      row += obs.group_sizes[e];
      float& slot = amax[fmt::format("{}#{}", obs.layer, e)];
      slot = std::max(slot, a);
    }
  });
  struct Detach {
    model::Model& m;
    ~Detach() { m.set_gemm_observer({}); }
  } detach{m};
  model::KvCache cache = m.make_kv_cache(o.calib_batch, o.calib_seq, o.calib_seq);
  std::vector<int32_t> n_new((size_t)o.calib_batch, o.calib_seq);
  model::CachedForwardOptions co;
  co.stage = recipe::Stage::kRlSampler;
  m.forward_cached(cache, batch.tokens, n_new, co);
  return amax;
}

std::span<const uint8_t> bytes_of(const void* p, size_t n) { return {static_cast<const uint8_t*>(p), n}; }

}  // namespace

ExportSummary export_hf(model::Model& m, const std::string& dir, const ExportOptions& o) {
  const model::ModelConfig& c = m.config();
  ExportSummary summary;
  summary.architecture = hf_architecture(c);
  const std::vector<HfTensorMap> map = hf_tensor_map(c);
  const model::ParamTable& table = m.table();
  // Host f32 copies of the parameters the map reads.
  std::map<std::string, std::vector<float>> host;
  for (const HfTensorMap& t : map) {
    if (!t.zeros && !host.count(t.param)) host[t.param] = host_f32(m.param(t.param));
  }
  // What is written: the parameters, times the scale of the entries that have one (exact: 2).
  std::map<std::string, std::vector<float>> values = host;
  for (const HfTensorMap& t : map) {
    if (t.scale == 1.0f) continue;
    std::vector<float>& v = values.at(t.param);
    for (int64_t i = 0; i < prod(t.shape); ++i) v[(size_t)(t.elem_offset + i)] *= t.scale;
  }
  // The selection bias has no Mixtral / Qwen2-MoE counterpart.
  for (int i = 0; i < table.size(); ++i) {
    if (table.row(i).kind != model::ParamKind::kRouterBias) continue;
    const std::vector<float> bias = host_f32(m.params().view(i));
    bool nonzero = false;
    for (float v : bias) nonzero = nonzero || v != 0.0f;
    FOURBIT_CHECK(!nonzero || o.drop_router_bias,
                  "HF export: '{}' is non-zero (load_balancing = bias): {} selects experts by the "
                  "router logits alone, so the exported model would route differently. Pass "
                  "--drop-router-bias to export without it", table.row(i).name, summary.architecture);
    if (nonzero) log_warn("HF export: dropping the router selection bias '{}'", table.row(i).name);
  }

  const bool nvfp4 = o.format == ExportFormat::kNvfp4;
  std::map<std::string, float> input_amax;
  if (nvfp4) input_amax = calibrate(m, o);

  io::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.set_metadata("producer", "fourbit");
  std::deque<std::vector<uint8_t>> keep;  // bytes alive until the write
  std::deque<float> scalars;
  std::map<std::string, quant::QuantizedTensor> units;  // param + unit offset -> quantized unit
  std::set<std::string> excluded;
  auto add_values = [&](const std::string& name, const float* src, std::vector<int64_t> shape, bool f32) {
    const int64_t n = prod(shape);
    std::vector<uint8_t>& b = keep.emplace_back();
    if (f32) {
      b.resize((size_t)n * 4);
      std::memcpy(b.data(), src, (size_t)n * 4);
      w.add(name, io::StDType::kF32, std::move(shape), b);
    } else {
      b.resize((size_t)n * 2);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = formats::encode_bf16_rn(src[i]);
        std::memcpy(b.data() + i * 2, &h, 2);
      }
      w.add(name, io::StDType::kBF16, std::move(shape), b);
    }
  };
  std::vector<float> zero_values;
  for (const HfTensorMap& t : map) {
    if (t.zeros) {
      zero_values.assign((size_t)prod(t.shape), 0.0f);
      add_values(t.hf_name, zero_values.data(), t.shape, o.format == ExportFormat::kF32);
      if (nvfp4 && t.linear) excluded.insert(t.module);
      continue;
    }
    const float* src = values.at(t.param).data() + t.elem_offset;
    std::optional<quant::QuantConfig> qc;
    if (nvfp4 && t.linear && t.kind != LinearKind::kRouter && t.kind != LinearKind::kLmHead) {
      if (o.nvfp4_all) {
        qc = quant::QuantConfig{};  // NVFP4 1x16, round to nearest
      } else {
        const std::optional<quant::QuantConfig>& q = m.recipe().linear(recipe::Stage::kRlSampler, t.block, t.kind).fprop_w.quant;
        if (q && q->format == quant::Format::kNvfp4 && q->rounding == quant::Rounding::kNearest && !q->rht) qc = q;
      }
    }
    if (!qc) {
      if (nvfp4 && t.linear) excluded.insert(t.module);
      add_values(t.hf_name, src, t.shape, o.format == ExportFormat::kF32);
      continue;
    }
    FOURBIT_CHECK(t.unit_cols % 16 == 0, "HF export (NVFP4): '{}' has {} columns, not a multiple of the 16-element "
                  "block", t.param, t.unit_cols);
    const std::string unit_key = fmt::format("{}@{}", t.param, t.unit_offset);
    if (!units.count(unit_key)) {
      // The unit's BF16 copy (what the CUDA model quantizes), then the reference quantizer.
      Tensor bf = Tensor::empty({t.unit_rows, t.unit_cols}, DType::kBF16, Device::kCpu);
      const float* u = values.at(t.param).data() + t.unit_offset;
      for (int64_t i = 0; i < t.unit_rows * t.unit_cols; ++i) bf.ptr<uint16_t>()[i] = formats::encode_bf16_rn(u[i]);
      units[unit_key] = quant::quantize_reference(bf, *qc, {true, false}, {t.param, {}});
    }
    const quant::QuantizedTensor& q = units.at(unit_key);
    const quant::QuantizedData& d = *q.rowwise;
    const int64_t rows = t.shape[0], K = t.unit_cols;
    const int64_t data_row = K / 2, scale_row = K / 16;
    w.add(t.module + ".weight", io::StDType::kU8, {rows, data_row},
          bytes_of(d.data.ptr<uint8_t>() + t.row0 * data_row, (size_t)(rows * data_row)));
    w.add(t.module + ".weight_scale", io::StDType::kF8E4M3, {rows, scale_row},
          bytes_of(d.scales.ptr<uint8_t>() + t.row0 * scale_row, (size_t)(rows * scale_row)));
    scalars.push_back(quant::global_decode_scale(q, false));
    w.add(t.module + ".weight_scale_2", io::StDType::kF32, {}, bytes_of(&scalars.back(), 4));
    const std::string key = fmt::format("{}#{}", layer_key(t.block, t.kind), t.expert);
    const auto it = input_amax.find(key);
    FOURBIT_CHECK(it != input_amax.end(), "HF export (NVFP4): no calibration data for the input of '{}' (layer {})",
                  t.module, key);
    // An expert that no calibration token reached takes its block's largest input amax.
    float amax = it->second;
    if (amax == 0.0f && t.expert >= 0) {
      for (int e = 0; e < c.moe.n_experts; ++e)
        amax = std::max(amax, input_amax[fmt::format("{}#{}", layer_key(t.block, t.kind), e)]);
    }
    const float inv = 1.0f / 2688.0f;
    scalars.push_back(amax * inv);
    w.add(t.module + ".input_scale", io::StDType::kF32, {}, bytes_of(&scalars.back(), 4));
    ++summary.nvfp4_modules;
  }
  if (o.reference_logits) {
    // The weights as exported: BF16 everywhere, the NVFP4 modules' dequantized values on top.
    std::map<std::string, std::vector<float>> exported;
    const bool bf16 = o.format != ExportFormat::kF32;
    for (const auto& [name, values] : host) {
      std::vector<float>& v = exported[name] = values;
      if (bf16) {
        for (float& x : v) x = formats::round_to_bf16(x);
      }
    }
    for (const HfTensorMap& t : map) {
      const auto it = units.find(fmt::format("{}@{}", t.param, t.unit_offset));
      if (it == units.end() || t.row0 != 0) continue;  // once per unit
      const Tensor dq = quant::dequantize_reference(it->second, false);
      float* dst = exported.at(t.param).data() + t.unit_offset;
      // fourbit's own weights: undo the export scale (a power of two: exact).
      for (int64_t i = 0; i < dq.numel(); ++i) dst[i] = dq.ptr<float>()[i] / t.scale;
    }
    write_reference_logits(m, (fs::path(dir) / "fourbit_reference").string(), o.ref_batch, o.ref_seq, false, 0,
                           &exported, nvfp4 ? "nvfp4 (dequantized) + bf16" : (bf16 ? "bf16" : "f32"));
  }
  summary.tensors = (int)map.size();
  summary.excluded_modules.assign(excluded.begin(), excluded.end());

  const fs::path root(dir);
  fs::create_directories(root);
  w.write((root / "model.safetensors").string());
  summary.bytes = (int64_t)fs::file_size(root / "model.safetensors");
  nlohmann::json cfg = hf_config_json(c, o.format == ExportFormat::kF32);
  if (nvfp4) {
    const nlohmann::json quant = {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr}, {"group_size", 16},
                                  {"exclude_modules", summary.excluded_modules}};
    write_json(root / "hf_quant_config.json",
               {{"producer", {{"name", "modelopt"}, {"version", "fourbit-export"}}}, {"quantization", quant}});
    nlohmann::json qc = quant;
    qc["quant_method"] = "modelopt";
    cfg["quantization_config"] = qc;
  }
  write_json(root / "config.json", cfg);
  nlohmann::json gen = {{"_from_model_config", true}};
  if (c.vocab >= rl::kByteVocabSize) gen["eos_token_id"] = rl::kEndOfDocumentToken;
  write_json(root / "generation_config.json", gen);
  if (o.tokenizer) write_tokenizer(root, c.vocab);
  log_info("HF export: {} ({}, {} tensors{}) -> {}", c.name, summary.architecture, summary.tensors,
           nvfp4 ? fmt::format(", {} NVFP4 modules, {} excluded", summary.nvfp4_modules, excluded.size()) : "", dir);
  return summary;
}

// ---- import -------------------------------------------------------------------------------------

namespace {

float decode_f16(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31;
  const int exp = (h >> 10) & 0x1F;
  const uint32_t man = h & 0x3FF;
  if (exp == 0) {
    const float v = std::ldexp((float)man, -24);
    return sign ? -v : v;
  }
  if (exp == 31) {
    uint32_t bits = sign | 0x7F800000u | (man << 13);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  const uint32_t bits = sign | (uint32_t)(exp - 15 + 127) << 23 | man << 13;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

std::unique_ptr<model::Model> import_hf(const std::string& dir, const recipe::Recipe& rec, model::ModelOptions options) {
  const fs::path root(dir);
  const model::ModelConfig c = config_from_hf(read_json(root / "config.json"), (root / "config.json").string());
  // The files: one model.safetensors, or the shards of the index.
  std::vector<io::SafetensorsFile> files;
  std::map<std::string, size_t> where;  // tensor -> file
  if (fs::exists(root / "model.safetensors")) {
    files.push_back(io::SafetensorsFile::open((root / "model.safetensors").string()));
  } else {
    const fs::path index = root / "model.safetensors.index.json";
    FOURBIT_CHECK(fs::exists(index), "HF import: '{}' has neither model.safetensors nor model.safetensors.index.json",
                  dir);
    const nlohmann::json j = read_json(index);
    FOURBIT_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "HF import: '{}' has no weight_map object",
                  index.string());
    std::set<std::string> shards;
    for (const auto& [k, v] : j["weight_map"].items()) {
      FOURBIT_CHECK(v.is_string() && v.get<std::string>().find('/') == std::string::npos,
                    "HF import: '{}': weight_map['{}'] is not a file name in the folder", index.string(), k);
      shards.insert(v.get<std::string>());
    }
    for (const std::string& s : shards) files.push_back(io::SafetensorsFile::open((root / s).string()));
  }
  for (size_t f = 0; f < files.size(); ++f) {
    for (const io::StTensor& t : files[f].tensors()) {
      FOURBIT_CHECK(!where.count(t.name), "HF import: tensor '{}' is in both '{}' and '{}'", t.name,
                    files[where[t.name]].path(), files[f].path());
      where[t.name] = f;
    }
  }
  auto model = std::make_unique<model::Model>(c, recipe::resolve(rec, c.recipe_shape()), options);
  const model::ParamTable& table = model->table();
  std::map<std::string, std::vector<float>> host;
  for (int i = 0; i < table.size(); ++i) host[table.row(i).name] = std::vector<float>((size_t)table.row(i).numel(), 0.0f);
  std::set<std::string> used;
  auto read = [&](const std::string& name, const std::vector<int64_t>& shape, float* out) {
    const auto it = where.find(name);
    FOURBIT_CHECK(it != where.end(), "HF import: '{}' has no tensor '{}' (a {} model needs it)", dir, name,
                  hf_architecture(c));
    const io::SafetensorsFile& f = files[it->second];
    const io::StTensor& t = f.get(name);
    FOURBIT_CHECK(t.shape == shape, "HF import: '{}': tensor '{}' has shape {}, the config implies {}", f.path(), name,
                  t.shape_str(), nlohmann::json(shape).dump());
    const int64_t n = prod(shape);
    const uint8_t* b = t.bytes.data();
    switch (t.dtype) {
      case io::StDType::kF32: std::memcpy(out, b, (size_t)n * 4); break;
      case io::StDType::kBF16:
        for (int64_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, b + 2 * i, 2);
          out[i] = formats::decode_bf16(h);
        }
        break;
      case io::StDType::kF16:
        for (int64_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, b + 2 * i, 2);
          out[i] = decode_f16(h);
        }
        break;
      default:
        throw Error(fmt::format("HF import: '{}': tensor '{}' has dtype {}; fourbit imports F32, BF16 or F16 weights "
                                "(a quantized checkpoint must be dequantized first)", f.path(), name,
                                io::st_dtype_name(t.dtype)));
    }
    for (int64_t i = 0; i < n; ++i) {
      FOURBIT_CHECK(std::isfinite(out[i]), "HF import: '{}': tensor '{}' holds a non-finite value at element {}",
                    f.path(), name, i);
    }
    used.insert(name);
  };
  for (const HfTensorMap& t : hf_tensor_map(c)) {
    FOURBIT_CHECK(!t.zeros && t.scale == 1.0f, "HF import: {} checkpoints are not imported", hf_architecture(c));
    read(t.hf_name, t.shape, host.at(t.param).data() + t.elem_offset);
  }
  if (c.tied_embeddings && where.count("lm_head.weight")) {
    std::vector<float> head((size_t)c.vocab * c.d_model);
    read("lm_head.weight", {c.vocab, c.d_model}, head.data());
    FOURBIT_CHECK(head == host.at("embedding.weight"), "HF import: '{}': tie_word_embeddings is true but "
                  "lm_head.weight differs from model.embed_tokens.weight", dir);
  }
  for (const auto& [name, f] : where) {
    if (used.count(name)) continue;
    if (name.size() >= 24 && name.ends_with("rotary_emb.inv_freq")) continue;
    throw Error(fmt::format("HF import: '{}': unexpected tensor '{}' (not part of the {} model the config "
                            "describes)", files[f].path(), name, hf_architecture(c)));
  }
  for (int i = 0; i < table.size(); ++i) {
    const TensorView dst = model->params().view(i);
    const std::vector<float>& src = host.at(table.row(i).name);
    if (dst.dtype == DType::kF32) {
      Tensor h = Tensor::empty(dst.shape, DType::kF32, Device::kCpu);
      std::memcpy(h.data(), src.data(), src.size() * 4);
      copy_tensor(dst, h.view());
    } else {
      FOURBIT_CHECK(dst.dtype == DType::kF64 && dst.device == Device::kCpu, "HF import: unexpected parameter dtype {}",
                    dtype_name(dst.dtype));
      for (size_t k = 0; k < src.size(); ++k) dst.ptr<double>()[k] = src[k];
    }
  }
  model->params_changed();
  log_info("HF import: {} ({} tensors from {} file(s)) -> fourbit '{}', {} parameters", dir, used.size(), files.size(),
           c.name, table.n_params());
  return model;
}

// ---- reference logits ---------------------------------------------------------------------------

void write_reference_logits(const model::Model& m, const std::string& dir, int B, int T, bool bf16_weights,
                            uint64_t first_document, const std::map<std::string, std::vector<float>>* overrides,
                            const std::string& weights_label) {
  const model::ModelConfig& c = m.config();
  model::ModelOptions mo;
  mo.device = Device::kCpu;
  mo.cpu_dtype = DType::kF64;
  mo.max_batch = B;
  mo.max_seq = T;
  model::Model ref(c, recipe::resolve(recipe::preset("bf16"), c.recipe_shape()), mo);
  const model::ParamTable& table = m.table();
  for (int i = 0; i < table.size(); ++i) {
    const TensorView dst = ref.params().view(i);
    if (table.row(i).kind == model::ParamKind::kRouterBias) {
      for (int64_t k = 0; k < dst.numel(); ++k) dst.ptr<double>()[k] = 0.0;  // not exported
      continue;
    }
    const auto ov = overrides != nullptr ? overrides->find(table.row(i).name) : std::map<std::string, std::vector<float>>::const_iterator{};
    const std::vector<float> src = overrides != nullptr && ov != overrides->end() ? ov->second : host_f32(m.params().view(i));
    FOURBIT_CHECK((int64_t)src.size() == dst.numel(), "reference logits: '{}' has {} values, expected {}",
                  table.row(i).name, src.size(), dst.numel());
    for (size_t k = 0; k < src.size(); ++k)
      dst.ptr<double>()[k] = bf16_weights ? formats::round_to_bf16(src[k]) : src[k];
  }
  const TokenBatch batch = corpus_batch(c.vocab, B, T, first_document);
  const model::LossInfo info = ref.forward(batch.tokens, batch.targets);
  const TensorView logits = ref.logits();
  const fs::path root(dir);
  fs::create_directories(root);
  io::write_file_atomically((root / "tokens.i32").string(),
                            std::string_view((const char*)batch.tokens.data(), (size_t)batch.tokens.nbytes()));
  io::write_file_atomically((root / "logits.f64").string(),
                            std::string_view((const char*)logits.data, (size_t)logits.nbytes()));
  write_json(root / "reference.json", {{"batch", B}, {"seq", T}, {"vocab", c.vocab}, {"logits", "logits.f64"},
                                       {"logits_shape", {(int64_t)B * T, c.vocab}}, {"tokens", "tokens.i32"},
                                       {"weights", weights_label.empty() ? (bf16_weights ? "bf16" : "f32") : weights_label}, {"loss", info.ce},
                                       {"what", "fourbit CPU float64 forward, plain recipe, the exported weights"}});
}

}  // namespace fourbit::interchange
