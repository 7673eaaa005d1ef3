// The declared table of an operand's quantizer fields (fields.h). One row per quant::QuantConfig
// field; adding a field to QuantConfig means adding its row here, and JSON, --set, validation and
// help follow.
#include "recipe/internal.h"

#include "core/error.h"

#include <fmt/format.h>

#include <charconv>

namespace fourbit::recipe::detail {

using quant::Format;
using quant::QuantConfig;

std::string_view precision_format_name(const Precision& p) {
  return p ? quant::format_name(p->format) : std::string_view("bf16");
}

Precision parse_format(std::string_view value, std::string_view field) {
  if (value == "bf16") return std::nullopt;
  for (Format f : {Format::kNvfp4, Format::kMxfp8, Format::kFp8Tensor, Format::kFp8Block}) {
    if (quant::format_name(f) == value) {
      QuantConfig c;
      c.format = f;
      return c;
    }
  }
  throw Error(fmt::format("{}: unknown format '{}'; allowed: {}", field, value,
                          fmt::join(kFormatNames, ", ")));
}

namespace {

bool is_nvfp4(const QuantConfig& c) { return c.format == Format::kNvfp4; }
bool is_fp8(const QuantConfig& c) {
  return c.format == Format::kFp8Block || c.format == Format::kFp8Tensor;
}

std::vector<OperandField> make_fields() {
  using T = FieldType;
  const std::vector<std::string_view> kBool = {"false", "true"};
  return {
      {"block_2d", T::kBool, kBool, "nvfp4 and fp8-block",
       "2D tiles (nvfp4 16x16, fp8-block 128x128) instead of 1D blocks (1x16, 1x128); weights only",
       [](const QuantConfig& c) { return c.format == Format::kNvfp4 || c.format == Format::kFp8Block; },
       [](const QuantConfig& c) { return (uint64_t)c.block_2d; },
       [](QuantConfig& c, uint64_t v) { c.block_2d = v != 0; }},
      {"rounding", T::kEnum, {"nearest", "stochastic"}, "every quantized format",
       "round to nearest-even, or stochastic rounding (unbiased; Philox draws, NUMERICS 1.4)",
       [](const QuantConfig&) { return true; },
       [](const QuantConfig& c) { return (uint64_t)c.rounding; },
       [](QuantConfig& c, uint64_t v) { c.rounding = (quant::Rounding)v; }},
      {"rht", T::kBool, kBool, "nvfp4",
       "16-point random Hadamard transform along tokens before quantizing (Wgrad operands only)",
       is_nvfp4,
       [](const QuantConfig& c) { return (uint64_t)c.rht; },
       [](QuantConfig& c, uint64_t v) { c.rht = v != 0; }},
      {"rht_signs", T::kEnum, {"none", "fixed", "random"}, "nvfp4 with rht = true",
       "the RHT's sign vector: none, TE's fixed one, or seeded random (rht_seed)",
       [](const QuantConfig& c) { return is_nvfp4(c) && c.rht; },
       [](const QuantConfig& c) { return (uint64_t)c.rht_signs; },
       [](QuantConfig& c, uint64_t v) { c.rht_signs = (quant::HadamardSigns)v; }},
      {"rht_seed", T::kUint, {}, "nvfp4 with rht = true and rht_signs = random",
       "seed of the random RHT sign vector (one vector shared by all layers, NUMERICS 4.2)",
       [](const QuantConfig& c) {
         return is_nvfp4(c) && c.rht && c.rht_signs == quant::HadamardSigns::kRandom;
       },
       [](const QuantConfig& c) { return c.rht_seed; },
       [](QuantConfig& c, uint64_t v) { c.rht_seed = v; }},
      {"nvfp4_scale_rule", T::kEnum, {"amax_to_6", "four_over_six"}, "nvfp4",
       "block scale: map the block amax to 6, or Four Over Six (4 or 6, per block; NUMERICS 5)",
       is_nvfp4,
       [](const QuantConfig& c) { return (uint64_t)c.nvfp4_scale_rule; },
       [](QuantConfig& c, uint64_t v) { c.nvfp4_scale_rule = (quant::Nvfp4ScaleRule)v; }},
      {"four_over_six_metric", T::kEnum, {"mse", "mae", "abs_max"},
       "nvfp4 with nvfp4_scale_rule = four_over_six",
       "the error that picks 4 or 6 per block (reference default mse)",
       [](const QuantConfig& c) {
         return is_nvfp4(c) && c.nvfp4_scale_rule == quant::Nvfp4ScaleRule::kFourOverSix;
       },
       [](const QuantConfig& c) { return (uint64_t)c.four_over_six_metric; },
       [](QuantConfig& c, uint64_t v) { c.four_over_six_metric = (quant::FourOverSixMetric)v; }},
      {"sr_unbiased_scale", T::kBool, kBool, "nvfp4 with rounding = stochastic",
       "scale elements by 16/17 so that SR cannot saturate (removes its saturation bias)",
       [](const QuantConfig& c) { return is_nvfp4(c) && c.rounding == quant::Rounding::kStochastic; },
       [](const QuantConfig& c) { return (uint64_t)c.sr_unbiased_scale; },
       [](QuantConfig& c, uint64_t v) { c.sr_unbiased_scale = v != 0; }},
      {"nvfp4_row_amax", T::kBool, kBool, "nvfp4 (true: 1x16 token operands, fprop input and dgrad gradient, only)",
       "one global amax per token (row) instead of per tensor: per-token activation scales, so the RL "
       "sampler's decode passes and the trainer's forward quantize each token alike (RL.md)",
       is_nvfp4,
       [](const QuantConfig& c) { return (uint64_t)c.nvfp4_row_amax; },
       [](QuantConfig& c, uint64_t v) { c.nvfp4_row_amax = v != 0; }},
      {"mx_scale_rule", T::kEnum, {"round_up", "floor"}, "mxfp8",
       "E8M0 scale: round up (RCEIL: TE, cuBLAS, the MXFP8 paper) or the OCP floor rule",
       [](const QuantConfig& c) { return c.format == Format::kMxfp8; },
       [](const QuantConfig& c) { return (uint64_t)c.mx_scale_rule; },
       [](QuantConfig& c, uint64_t v) { c.mx_scale_rule = (quant::MxScaleRule)v; }},
      {"fp8_pow2_scales", T::kBool, kBool, "fp8-tensor and fp8-block",
       "FP8 scales rounded down to powers of two (TE Float8BlockScaling default) or plain FP32",
       is_fp8,
       [](const QuantConfig& c) { return (uint64_t)c.fp8_pow2_scales; },
       [](QuantConfig& c, uint64_t v) { c.fp8_pow2_scales = v != 0; }},
  };
}

}  // namespace

const std::vector<OperandField>& operand_fields() {
  static const std::vector<OperandField> fields = make_fields();
  return fields;
}

const OperandField* find_operand_field(std::string_view name) {
  for (const OperandField& f : operand_fields()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string operand_field_names() {
  std::string s = "format";
  for (const OperandField& f : operand_fields()) s += fmt::format(", {}", f.name);
  return s;
}

std::string OperandField::value_text(const QuantConfig& c) const {
  const uint64_t v = get(c);
  if (type == FieldType::kUint) return std::to_string(v);
  return std::string(v < values.size() ? values[v] : std::string_view("?"));
}

std::string OperandField::allowed_text() const {
  if (type == FieldType::kUint) return "an unsigned 64-bit integer";
  return fmt::format("{}", fmt::join(values, ", "));
}

uint64_t OperandField::parse_text(std::string_view value, std::string_view path) const {
  if (type == FieldType::kUint) {
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (ec == std::errc() && end == value.data() + value.size() && !value.empty()) return v;
  } else {
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i] == value) return i;
    }
  }
  throw Error(fmt::format("{}: bad value '{}'; allowed: {}", path, value, allowed_text()));
}

void canonicalize(QuantConfig& c) {
  const QuantConfig defaults;
  for (const OperandField& f : operand_fields()) {
    if (!f.applies(c)) f.set(c, f.get(defaults));
  }
}

void check_canonical(const QuantConfig& c, std::string_view path) {
  const QuantConfig defaults;
  for (const OperandField& f : operand_fields()) {
    if (!f.applies(c) && f.get(c) != f.get(defaults)) {
      throw Error(fmt::format("{}.{} = {} is not available here ({} operand): {} applies to {} "
                              "only; leave it at {}",
                              path, f.name, f.value_text(c), quant::format_name(c.format), f.name,
                              f.applies_to, f.value_text(defaults)));
    }
  }
}

void fail(std::string_view where, const std::string& message) {
  throw Error(fmt::format("{}: {}", where, message));
}

}  // namespace fourbit::recipe::detail
