// Implementation of dump.h.
#include "model/dump.h"

#include "core/check.h"
#include "core/log.h"
#include "core/rng.h"
#include "formats/element.h"
#include "model/model.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <vector>

namespace fourbit::model {

namespace {

void write_file(const std::filesystem::path& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  FOURBIT_CHECK(f.good(), "model dump: cannot write '{}'", path.string());
  f.write(static_cast<const char*>(data), (std::streamsize)bytes);
  FOURBIT_CHECK(f.good(), "model dump: failed writing '{}'", path.string());
}

// A tensor on any device as host doubles.
std::vector<double> to_doubles(const TensorView& v) {
  Tensor h = Tensor::empty(v.shape, v.dtype, Device::kCpu);
  copy_tensor(h.view(), v);
  std::vector<double> out((size_t)h.numel());
  for (int64_t i = 0; i < h.numel(); ++i) {
    switch (h.dtype()) {
      case DType::kF64: out[(size_t)i] = h.ptr<double>()[i]; break;
      case DType::kF32: out[(size_t)i] = h.ptr<float>()[i]; break;
      case DType::kBF16: out[(size_t)i] = formats::decode_bf16(h.ptr<uint16_t>()[i]); break;
      default: FOURBIT_CHECK(false, "model dump: unexpected dtype {}", dtype_name(h.dtype()));
    }
  }
  return out;
}

// Appends values in `dtype` (f64 or f32) to `bytes`.
void append(std::vector<char>& bytes, const std::vector<double>& v, DType dtype) {
  for (double x : v) {
    if (dtype == DType::kF64) {
      bytes.insert(bytes.end(), reinterpret_cast<const char*>(&x), reinterpret_cast<const char*>(&x) + 8);
    } else {
      const float f = (float)x;
      bytes.insert(bytes.end(), reinterpret_cast<const char*>(&f), reinterpret_cast<const char*>(&f) + 4);
    }
  }
}

}  // namespace

double dump_model_step(const ModelConfig& config, const DumpOptions& o, const std::string& dir) {
  config.validate();
  FOURBIT_CHECK(o.batch >= 1 && o.seq >= 1 && o.seq <= config.max_seq,
                "model dump: batch {} and seq {} must be >= 1 (seq <= max_seq {})", o.batch, o.seq,
                config.max_seq);
  ModelOptions mo;
  mo.device = o.device;
  mo.cpu_dtype = o.cpu_dtype;
  mo.seed = o.seed;
  mo.max_batch = o.batch;
  mo.max_seq = o.seq;
  Model m(config, recipe::resolve(recipe::preset(o.recipe), config.recipe_shape()), mo);
  const DType out_dtype = o.device == Device::kCpu && o.cpu_dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  const std::string ext = out_dtype == DType::kF64 ? "f64" : "f32";

  const int64_t N = (int64_t)o.batch * o.seq;
  Tensor tokens = Tensor::empty({o.batch, o.seq}, DType::kI32, Device::kCpu);
  Tensor targets = Tensor::empty({o.batch, o.seq}, DType::kI32, Device::kCpu);
  const RandomStream rs{o.data_seed, 0xd00};
  for (int64_t i = 0; i < N; ++i) {
    tokens.ptr<int32_t>()[i] = (int32_t)(rs.block((uint64_t)i).v[0] % (uint32_t)config.vocab);
    targets.ptr<int32_t>()[i] = i % 7 == 6 ? -1 : (int32_t)(rs.block((uint64_t)i).v[1] % (uint32_t)config.vocab);
  }
  m.zero_grads();
  const LossInfo info = m.forward(tokens, targets);
  const std::vector<double> logits = to_doubles(m.logits());
  Tensor ids;
  if (config.is_moe()) {
    ids = Tensor::empty({N, config.n_moe_layers(), config.moe.top_k}, DType::kI32, Device::kCpu);
    m.expert_ids(ids.view());
  }
  m.backward();

  const std::filesystem::path root(dir);
  std::filesystem::create_directories(root);
  nlohmann::json params = nlohmann::json::array();
  std::vector<char> param_bytes, grad_bytes;
  int64_t offset = 0;
  for (int i = 0; i < m.table().size(); ++i) {
    const ParamSpec& p = m.table().row(i);
    std::vector<int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
    params.push_back({{"name", p.name}, {"shape", shape}, {"offset", offset},
                      {"kind", std::string(param_kind_name(p.kind))}, {"trainable", p.trainable}});
    append(param_bytes, to_doubles(m.params().view(i)), DType::kF32);
    append(grad_bytes, to_doubles(m.grads().view(i)), out_dtype);
    offset += p.numel();
  }
  write_file(root / "params.f32", param_bytes.data(), param_bytes.size());
  write_file(root / ("grads." + ext), grad_bytes.data(), grad_bytes.size());
  write_file(root / "tokens.i32", tokens.data(), (size_t)tokens.nbytes());
  write_file(root / "targets.i32", targets.data(), (size_t)targets.nbytes());
  std::vector<char> logit_bytes;
  append(logit_bytes, logits, out_dtype);
  write_file(root / ("logits." + ext), logit_bytes.data(), logit_bytes.size());
  nlohmann::json files = {{"params", "params.f32"}, {"grads", "grads." + ext}, {"tokens", "tokens.i32"},
                          {"targets", "targets.i32"}, {"logits", "logits." + ext}};
  if (ids.defined()) {
    write_file(root / "expert_ids.i32", ids.data(), (size_t)ids.nbytes());
    files["expert_ids"] = "expert_ids.i32";
  }
  nlohmann::json manifest = {
      {"format_version", 1},
      {"config", to_json(config)},
      {"recipe", o.recipe},
      {"device", std::string(device_name(o.device))},
      {"dtype", ext},
      {"batch", o.batch},
      {"seq", o.seq},
      {"seed", o.seed},
      {"loss", {{"loss", info.loss}, {"ce", info.ce}, {"aux", info.aux}, {"z", info.z}, {"n_valid", info.n_valid}}},
      {"params", params},
      {"files", files}};
  std::ofstream f(root / "manifest.json");
  FOURBIT_CHECK(f.good(), "model dump: cannot write '{}'", (root / "manifest.json").string());
  f << manifest.dump(1) << "\n";
  FOURBIT_CHECK(f.good(), "model dump: failed writing the manifest in '{}'", dir);
  log_info("model dump: {} ({} parameters, recipe {}, {} {}) -> {}", config.name, m.table().n_params(),
           o.recipe, device_name(o.device), ext, dir);
  return info.loss;
}

}  // namespace fourbit::model
