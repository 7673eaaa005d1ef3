// Model interchange with the Hugging Face ecosystem: export of a fourbit model as an HF
// checkpoint (safetensors + config.json + a byte-level tokenizer), optionally in NVIDIA ModelOpt's
// NVFP4 layout, and import of Llama-family HF checkpoints into a fourbit Model. The io module
// reads and writes the files; this module knows the model (io must not depend on model).
//
// Architectures. A dense fourbit model is a Llama (LlamaForCausalLM): pre-norm RMSNorm, no biases,
// SwiGLU, GQA, RoPE in the rotate-half convention (ops/rope.h pairs dimension i with i + D/2,
// exactly HF's rotate_half, so q/k rows need NO permutation), the whole head rotated, no RoPE
// scaling. An MoE model whose blocks are ALL MoE, without a shared expert, is a Mixtral
// (MixtralForCausalLM): Mixtral's router takes softmax over all experts, keeps the top-k and
// renormalizes them, which is fourbit's router (ops/moe.h: gates = probs[top-k] / their sum).
// Any other MoE model (dense blocks among the MoE blocks, or a shared expert) is a Qwen2-MoE
// (Qwen2MoeForCausalLM) with norm_topk_prob = true (the same router), decoder_sparse_step = 1 and
// mlp_only_layers = the dense blocks, and these exact equivalences for what Qwen2-MoE has and
// fourbit has not: the q/k/v biases are written as zeros; the shared expert's output is scaled
// by sigmoid(shared_expert_gate x), so the gate is written as zeros (sigmoid(0) = 0.5 exactly) and
// the shared expert's down_proj as 2 x fourbit's (a power of two: exact, also in NVFP4, whose
// global scale doubles exactly); a model without a shared expert gets zero shared-expert weights
// (its output is exactly 0). Qwen3-MoE is not used: it normalizes q and k per head (q_norm,
// k_norm), which fourbit does not. Qwen2-MoE exports are not imported back (import: Llama family).
// What fourbit has and no exported architecture has: a non-zero router selection bias
// (load_balancing = bias) is refused, naming the tensor; ExportOptions::drop_router_bias exports
// without it (the routing then differs).
// The auxiliary and z losses are training-only and not part of the exported function.
//
// Tensor names (N = block, e = expert; fourbit's fused tensors are split by rows):
//   embedding.weight             -> model.embed_tokens.weight
//   blocks.N.attn_norm.weight    -> model.layers.N.input_layernorm.weight
//   blocks.N.attn.qkv.weight     -> model.layers.N.self_attn.{q,k,v}_proj.weight (rows H*D, Hkv*D, Hkv*D)
//   blocks.N.attn.out.weight     -> model.layers.N.self_attn.o_proj.weight
//   blocks.N.mlp_norm.weight     -> model.layers.N.post_attention_layernorm.weight
//   blocks.N.mlp.up.weight       -> model.layers.N.mlp.{gate,up}_proj.weight (rows 0..F-1, F..2F-1)
//   blocks.N.mlp.down.weight     -> model.layers.N.mlp.down_proj.weight
//   blocks.N.moe.router.weight   -> model.layers.N.block_sparse_moe.gate.weight
//   blocks.N.moe.experts.up.weight[e]   -> model.layers.N.block_sparse_moe.experts.e.{w1,w3}.weight
//                                          (w1 = gate rows 0..Fe-1, w3 = up rows Fe..2Fe-1)
//   blocks.N.moe.experts.down.weight[e] -> model.layers.N.block_sparse_moe.experts.e.w2.weight
//   (Qwen2-MoE: model.layers.N.mlp.gate.weight, mlp.experts.e.{gate,up,down}_proj.weight,
//    mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, C] = 0,
//    self_attn.{q,k,v}_proj.bias = 0)
//   final_norm.weight            -> model.norm.weight
//   lm_head.weight               -> lm_head.weight (untied; tied models set tie_word_embeddings
//                                   and write no lm_head.weight)
// Every HF tensor is a contiguous element range of one fourbit parameter (or, Qwen2-MoE only, a
// zero tensor or a parameter times 2), so export and import are exact copies (F32 round trip:
// bit-exact).
//
// NVFP4 (ModelOpt "unified HF checkpoint", quant_algo NVFP4, group_size 16). For every linear
// layer whose rl_sampler Fprop weight the recipe quantizes to NVFP4 (the weights the sampler
// serves; ExportOptions::nvfp4_all quantizes every linear but lm_head and the routers with 1x16
// round-to-nearest blocks), quant::quantize_reference is applied to the BF16 copy of the master
// weight (what the CUDA model quantizes), per fourbit quantization unit (a whole fused weight,
// or one expert's slice), with that layer's QuantConfig (16x16 tiles for the recipes' weights: each
// row carries its tile's scale, which the 1x16 layout holds exactly). Then per HF module:
//   <module>.weight          U8  [rows, K/2]   packed E2M1, element 2i in the low nibble of byte i
//   <module>.weight_scale    F8_E4M3 [rows, K/16]  block scales (the row range of the unit's)
//   <module>.weight_scale_2  F32 []  the per-tensor decode scale
//   <module>.input_scale     F32 []  the activation's per-tensor decode scale, calibrated
// Scale mapping. fourbit (Transformer Engine, NUMERICS.md) encodes with the global scale
// S = 2688 / amax (2688 = 6 * 448) and decodes x = e2m1 * s_b * f32(amax * f32(1 / 2688))
// (quant::global_decode_scale). ModelOpt stores weight_scale_2 = amax / (6 * 448) and dequantizes
// w = e2m1 * weight_scale * weight_scale_2: so weight_scale_2 := global_decode_scale(q), and the
// ModelOpt dequantization of the exported tensors equals quant::dequantize_reference bit for bit.
// A fused weight split into modules (q/k/v, gate/up) writes the unit's one weight_scale_2 for
// each, which is what fused loaders (vLLM takes the max over q/k/v) need. input_scale =
// f32(amax_x) * f32(1 / 2688) with amax_x the largest |x| the layer's input reached over a
// calibration batch (ExportOptions::calib_*, the built-in corpus, the rl_sampler pass; routed
// experts: over the rows routed to each expert). Layers not quantized (lm_head, routers, the
// recipe's high-precision blocks) are BF16 and listed in exclude_modules of hf_quant_config.json
// (and of config.json's quantization_config). Embeddings and norms are BF16.
//
// Tokenizer. fourbit's byte-level tokenizer (ids 0..255 = bytes, 256 = <|endoftext|> when the
// vocabulary has it) is written as tokenizer.json: a byte-level BPE with no merges (the 256 byte
// symbols of GPT-2's ByteLevel alphabet, each its byte's id), the ByteLevel pre-tokenizer
// (no prefix space, no regex split) and decoder, and <|endoftext|> as a special added token, plus
// tokenizer_config.json and special_tokens_map.json. Ids >= 257 of a larger vocabulary have no
// token (they are never produced by this tokenizer). SentencePiece models are not exported.
#pragma once

#include "model/model.h"
#include "recipe/recipe.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fourbit::interchange {

// One HF tensor = elements [elem_offset, elem_offset + prod(shape)) of fourbit parameter `param`.
struct HfTensorMap {
  std::string hf_name;  // "model.layers.0.self_attn.q_proj.weight"
  std::string param;    // "blocks.0.attn.qkv.weight"
  int64_t elem_offset = 0;
  std::vector<int64_t> shape;
  // Linear weights only: the fourbit quantization unit this tensor is a row range of (the fused
  // weight, or expert e's slice), for NVFP4.
  bool linear = false;
  int block = -1;  // -1: lm_head
  recipe::LinearKind kind = recipe::LinearKind::kQkv;
  std::string module;          // hf_name without ".weight"
  int64_t unit_offset = 0;     // elements: start of the unit within the parameter
  int64_t unit_rows = 0, unit_cols = 0;
  int64_t row0 = 0;            // first row of this tensor within the unit
  int expert = -1;             // routed expert index, -1 otherwise
  bool zeros = false;          // no fourbit counterpart: written as zeros (param empty)
  float scale = 1.0f;          // exported as scale * the parameter (a power of two: exact)
};

// "LlamaForCausalLM", "MixtralForCausalLM" or "Qwen2MoeForCausalLM" for this config (see above).
std::string hf_architecture(const model::ModelConfig& config);
std::vector<HfTensorMap> hf_tensor_map(const model::ModelConfig& config);
// config.json; torch_dtype "float32" or "bfloat16".
nlohmann::json hf_config_json(const model::ModelConfig& config, bool f32);
// The fourbit config of an HF config.json (Llama, Mistral without a binding sliding window,
// Mixtral); `where` names the file in errors. Rejects what fourbit cannot hold, naming the key.
model::ModelConfig config_from_hf(const nlohmann::json& j, const std::string& where);

enum class ExportFormat { kBf16, kF32, kNvfp4 };

struct ExportOptions {
  ExportFormat format = ExportFormat::kBf16;
  bool drop_router_bias = false;  // export a model with a non-zero selection bias without it
  bool nvfp4_all = false;         // NVFP4: every linear but lm_head and routers, 1x16 RN
  int calib_batch = 2;            // NVFP4 input_scale calibration: sequences of the built-in
  int calib_seq = 128;            //   corpus (training split) from document calib_document
  uint64_t calib_document = 0;
  bool tokenizer = true;          // write the byte-level tokenizer files
  // Also write fourbit's reference logits of the EXPORTED weights (write_reference_logits) to
  // DIR/fourbit_reference: ref_batch x ref_seq corpus tokens. For NVFP4 the reference model holds
  // the dequantized NVFP4 weights of the quantized modules and the BF16 values of the rest.
  bool reference_logits = false;
  int ref_batch = 2, ref_seq = 64;
};

struct ExportSummary {
  std::string architecture;
  int tensors = 0;
  int nvfp4_modules = 0;
  std::vector<std::string> excluded_modules;  // NVFP4: left in BF16
  int64_t bytes = 0;                          // of model.safetensors
};

// Writes DIR/model.safetensors, DIR/config.json, DIR/generation_config.json, the tokenizer files
// and (NVFP4) DIR/hf_quant_config.json. The model is only read, except that NVFP4 calibration
// runs a KV-cache forward (its activations and caches; weights and gradients untouched).
ExportSummary export_hf(model::Model& model, const std::string& dir, const ExportOptions& options = {});

// Imports DIR (config.json plus model.safetensors, or the shards of model.safetensors.index.json;
// F32, BF16 or F16 tensors) into a new model under `recipe`, with the model options given
// (device, max_batch, ...; the config comes from config.json). Every expected tensor must be
// present with its shape (errors name the file and the tensor); rotary inv_freq buffers are
// ignored, any other extra tensor is an error; a tied model's lm_head.weight, if present, must
// equal the embedding.
std::unique_ptr<model::Model> import_hf(const std::string& dir, const recipe::Recipe& recipe,
                                        model::ModelOptions options = {});

// B sequences of T tokens of the built-in corpus (training split, from document `first`), with
// next-token targets; host i32 [B, T] each. A vocabulary of 256 (no end-of-document id) reads the
// end-of-document token as byte 0.
struct TokenBatch {
  Tensor tokens, targets;
};
TokenBatch corpus_batch(int vocab, int B, int T, uint64_t first_document = 0);

// For tools/hf_crosscheck.py: fourbit's float64 CPU logits of the model's weights (a plain recipe,
// the weights as exported: BF16-rounded for a bf16 export, F32 otherwise; `overrides`: parameter
// name -> its full f32 values, replacing the model's, e.g. dequantized NVFP4 weights) on a corpus
// batch, written to DIR/tokens.i32 [B, T], DIR/logits.f64 [B*T, V] and DIR/reference.json.
void write_reference_logits(const model::Model& model, const std::string& dir, int B, int T,
                            bool bf16_weights, uint64_t first_document = 0,
                            const std::map<std::string, std::vector<float>>* overrides = nullptr,
                            const std::string& weights_label = "");

}  // namespace fourbit::interchange
