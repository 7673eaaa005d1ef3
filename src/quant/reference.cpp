// CPU reference quantizers: deliberately plain loops over the block math of block_math.h.
// This file is the ground truth that the CUDA kernels are tested against, bit for bit.
#include "quant/quantize.h"

#include "formats/element.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace fourbit::quant {

using formats::abs_f32;
using formats::fmax_ieee;

std::string_view format_name(Format f) {
  switch (f) {
    case Format::kNvfp4: return "nvfp4";
    case Format::kMxfp8: return "mxfp8";
    case Format::kFp8Tensor: return "fp8-tensor";
    case Format::kFp8Block: return "fp8-block";
  }
  return "?";
}

int QuantConfig::block_size() const {
  switch (format) {
    case Format::kNvfp4: return 16;
    case Format::kMxfp8: return 32;
    case Format::kFp8Block: return 128;
    case Format::kFp8Tensor: return 0;
  }
  return 0;
}

float QuantConfig::nvfp4_scale_constant() const {
  return nvfp4_scale_rule == Nvfp4ScaleRule::kFourOverSix ? kFourOverSixGlobalConstant
                                                          : kNvfp4GlobalConstant;
}

float QuantConfig::nvfp4_global_constant() const {
  const bool unbiased = sr_unbiased_scale && rounding == Rounding::kStochastic;
  if (nvfp4_scale_rule == Nvfp4ScaleRule::kFourOverSix) {
    return unbiased ? kFourOverSixGlobalConstantUnbiasedSr : kFourOverSixGlobalConstant;
  }
  return unbiased ? kNvfp4GlobalConstantUnbiasedSr : kNvfp4GlobalConstant;
}

uint16_t QuantConfig::rht_sign_mask() const {
  switch (rht_signs) {
    case HadamardSigns::kNone: return 0;
    case HadamardSigns::kFixed: return kRhtFixedSignMask;
    case HadamardSigns::kRandom: {
      const RandomStream s{rht_seed, 0x5248540000000000ull};  // "RHT"
      return (uint16_t)(s.block(0).v[0] & 0xFFFFu);
    }
  }
  return 0;
}

std::string QuantConfig::describe() const {
  std::string s(format_name(format));
  if (format == Format::kNvfp4) s += block_2d ? " 16x16" : " 1x16";
  if (format == Format::kFp8Block) s += block_2d ? " 128x128" : " 1x128";
  s += rounding == Rounding::kNearest ? " rn" : " sr";
  if (format == Format::kNvfp4 && nvfp4_scale_rule == Nvfp4ScaleRule::kFourOverSix) {
    static constexpr const char* kMetric[] = {"mse", "mae", "absmax"};
    s += fmt::format(" 4/6({})", kMetric[(int)four_over_six_metric]);
  }
  if (sr_unbiased_scale && rounding == Rounding::kStochastic && format == Format::kNvfp4) {
    s += " 16/17";
  }
  if (nvfp4_row_amax && format == Format::kNvfp4) s += " row-amax";
  if (rht) s += rht_signs == HadamardSigns::kRandom ? " rht(random)" : " rht";
  if (format == Format::kMxfp8 && mx_scale_rule == MxScaleRule::kFloor) s += " floor";
  if ((format == Format::kFp8Block || format == Format::kFp8Tensor) && !fp8_pow2_scales) {
    s += " fp32-scales";
  }
  return s;
}

void QuantConfig::validate() const {
  FOURBIT_CHECK(!block_2d || format == Format::kNvfp4 || format == Format::kFp8Block,
                "quant config '{}': block_2d applies to nvfp4 (16x16) and fp8-block (128x128) only",
                describe());
  FOURBIT_CHECK(!rht || format == Format::kNvfp4,
                "quant config '{}': rht (random Hadamard transform) is defined for nvfp4 only",
                describe());
  FOURBIT_CHECK(!(rht && block_2d),
                "quant config '{}': rht applies to the column-wise copy of 1x16 tensors; 2D "
                "(weight) quantization has no RHT",
                describe());
  FOURBIT_CHECK(nvfp4_scale_rule == Nvfp4ScaleRule::kAmaxTo6 || format == Format::kNvfp4,
                "quant config '{}': the Four Over Six scale rule is for nvfp4 only", describe());
  FOURBIT_CHECK(!sr_unbiased_scale || format == Format::kNvfp4,
                "quant config '{}': sr_unbiased_scale (16/17) is for nvfp4 only", describe());
  FOURBIT_CHECK(!nvfp4_row_amax || (format == Format::kNvfp4 && !block_2d),
                "quant config '{}': nvfp4_row_amax (one global amax per row) is for nvfp4 1x16 "
                "(row-wise token operands) only",
                describe());
}

namespace {

struct Matrix {
  std::vector<float> v;
  int64_t rows = 0, cols = 0;
  float& at(int64_t r, int64_t c) { return v[(size_t)(r * cols + c)]; }
  float at(int64_t r, int64_t c) const { return v[(size_t)(r * cols + c)]; }
};

Matrix load_source(const TensorView& src) {
  FOURBIT_CHECK(src.device == Device::kCpu, "quantize_reference needs a CPU tensor, got {}",
                src.describe());
  FOURBIT_CHECK(src.is_contiguous(), "quantize_reference needs a contiguous tensor, got {}",
                src.describe());
  Matrix m;
  m.rows = src.rows();
  m.cols = src.cols();
  m.v.resize((size_t)src.numel());
  if (src.dtype == DType::kF32) {
    std::copy_n(src.ptr<const float>(), src.numel(), m.v.begin());
  } else {
    FOURBIT_CHECK(src.dtype == DType::kBF16, "quantizers take f32 or bf16 sources, got {}",
                  src.describe());
    const uint16_t* p = src.ptr<const uint16_t>();
    for (int64_t i = 0; i < src.numel(); ++i) m.v[(size_t)i] = formats::decode_bf16(p[i]);
  }
  return m;
}

Matrix transpose(const Matrix& m) {
  Matrix t;
  t.rows = m.cols;
  t.cols = m.rows;
  t.v.resize(m.v.size());
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) t.at(c, r) = m.at(r, c);
  return t;
}

float matrix_amax(const Matrix& m) {
  float a = 0.0f;
  for (float x : m.v) a = fmax_ieee(a, abs_f32(x));
  return a;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void set_fp4(uint8_t* row, int64_t c, uint8_t code) {
  uint8_t& b = row[c / 2];
  b = (c & 1) ? (uint8_t)((b & 0x0F) | (code << 4)) : (uint8_t)((b & 0xF0) | (code & 0xF));
}
uint8_t get_fp4(const uint8_t* row, int64_t c) { return formats::unpack_e2m1(row[c / 2], (int)(c & 1)); }

int64_t fp4_row_bytes(int64_t cols) { return (cols + 1) / 2; }

// `rowwise`: the row-wise copy (the only one that can carry per-row amaxes).
QuantizedData make_data(const QuantConfig& cfg, int64_t rows, int64_t cols, Device device, bool rowwise) {
  QuantizedData d;
  d.rows = rows;
  d.cols = cols;
  switch (cfg.format) {
    case Format::kNvfp4:
      d.data = Tensor::empty({rows, fp4_row_bytes(cols) * 2}, DType::kE2M1x2, device);
      d.scales = Tensor::empty({rows, ceil_div(cols, 16)}, DType::kE4M3, device);
      d.amax = Tensor::empty({cfg.nvfp4_row_amax && rowwise ? rows : 1}, DType::kF32, device);
      break;
    case Format::kMxfp8:
      d.data = Tensor::empty({rows, cols}, DType::kE4M3, device);
      d.scales = Tensor::empty({rows, ceil_div(cols, 32)}, DType::kE8M0, device);
      break;
    case Format::kFp8Block:
      d.data = Tensor::empty({rows, cols}, DType::kE4M3, device);
      d.scales = cfg.block_2d
                     ? Tensor::empty({ceil_div(rows, 128), ceil_div(cols, 128)}, DType::kF32, device)
                     : Tensor::empty({rows, ceil_div(cols, 128)}, DType::kF32, device);
      break;
    case Format::kFp8Tensor:
      d.data = Tensor::empty({rows, cols}, DType::kE4M3, device);
      d.scales = Tensor::empty({1}, DType::kF32, device);
      d.amax = Tensor::empty({1}, DType::kF32, device);
      break;
  }
  return d;
}

// ---- NVFP4 ------------------------------------------------------------------------------------

// 1x16 blocks along the columns of m; with cfg.nvfp4_row_amax each row is quantized with its own
// global amax (the row's amax, stored in out.amax[r]) instead of `amax`.
void nvfp4_quantize_1d(const Matrix& m, float amax, const QuantConfig& cfg,
                       const RandomStream& sr, QuantizedData& out) {
  const bool stochastic = cfg.rounding == Rounding::kStochastic;
  const int64_t n_blocks = ceil_div(m.cols, 16);
  uint8_t* data = out.data.ptr<uint8_t>();
  uint8_t* scales = out.scales.ptr<uint8_t>();
  const int64_t row_bytes = fp4_row_bytes(m.cols);
  std::fill_n(data, out.data.nbytes(), 0);
  *out.amax.ptr<float>() = amax;
  const float scale_constant = cfg.nvfp4_scale_constant();
  const float element_constant = cfg.nvfp4_global_constant();
  const bool four_over_six = cfg.nvfp4_scale_rule == Nvfp4ScaleRule::kFourOverSix;
  Nvfp4TensorScales ts = nvfp4_tensor_scales(amax, scale_constant, element_constant);
  FourOverSixTensorScales ts46 = four_over_six_tensor_scales(amax, scale_constant, element_constant);
  for (int64_t r = 0; r < m.rows; ++r) {
    if (cfg.nvfp4_row_amax) {
      float row_amax = 0.0f;
      for (int64_t c = 0; c < m.cols; ++c) row_amax = fmax_ieee(row_amax, abs_f32(m.at(r, c)));
      out.amax.ptr<float>()[r] = row_amax;
      ts = nvfp4_tensor_scales(row_amax, scale_constant, element_constant);
      ts46 = four_over_six_tensor_scales(row_amax, scale_constant, element_constant);
    }
    uint8_t* row = data + r * row_bytes;
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t c0 = b * 16, c1 = std::min(m.cols, c0 + 16);
      float block_amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) block_amax = fmax_ieee(block_amax, abs_f32(m.at(r, c)));
      auto rbits = [&](int64_t c) {
        return stochastic ? sr.byte_at((uint64_t)(r * m.cols + c)) : 0u;
      };
      if (!four_over_six) {
        const uint8_t s = nvfp4_block_scale(block_amax, ts);
        const float mult = nvfp4_element_multiplier(s, ts);
        scales[r * n_blocks + b] = s;
        for (int64_t c = c0; c < c1; ++c)
          set_fp4(row, c, nvfp4_encode_element(m.at(r, c), mult, stochastic, rbits(c)));
      } else {
        const FourOverSixScalePair pair = four_over_six_scales(block_amax, ts46);
        float err[2] = {0.0f, 0.0f};
        const uint8_t cand[2] = {pair.map6, pair.map4};
        for (int k = 0; k < 2; ++k) {
          const float mult = four_over_six_multiplier(cand[k], ts46);
          for (int64_t c = c0; c < c1; ++c) {
            const uint8_t q = four_over_six_encode_element(m.at(r, c), mult, stochastic, rbits(c));
            err[k] = four_over_six_accumulate_error(
                err[k], four_over_six_dequantize_element(q, cand[k], ts46), m.at(r, c),
                cfg.four_over_six_metric);
          }
        }
        const uint8_t s = err[1] < err[0] ? pair.map4 : pair.map6;
        const float mult = four_over_six_multiplier(s, ts46);
        scales[r * n_blocks + b] = s;
        for (int64_t c = c0; c < c1; ++c)
          set_fp4(row, c, four_over_six_encode_element(m.at(r, c), mult, stochastic, rbits(c)));
      }
    }
  }
}

// 16x16 tiles over m (the source orientation); scales repeated per row of the tile.
void nvfp4_quantize_2d(const Matrix& m, float amax, const QuantConfig& cfg,
                       const RandomStream& sr, QuantizedData& out) {
  const bool stochastic = cfg.rounding == Rounding::kStochastic;
  const int64_t n_blocks = ceil_div(m.cols, 16);
  uint8_t* data = out.data.ptr<uint8_t>();
  uint8_t* scales = out.scales.ptr<uint8_t>();
  const int64_t row_bytes = fp4_row_bytes(m.cols);
  std::fill_n(data, out.data.nbytes(), 0);
  *out.amax.ptr<float>() = amax;
  const float scale_constant = cfg.nvfp4_scale_constant();
  const float element_constant = cfg.nvfp4_global_constant();
  const bool four_over_six = cfg.nvfp4_scale_rule == Nvfp4ScaleRule::kFourOverSix;
  const Nvfp4TensorScales ts = nvfp4_tensor_scales(amax, scale_constant, element_constant);
  const FourOverSixTensorScales ts46 =
      four_over_six_tensor_scales(amax, scale_constant, element_constant);
  for (int64_t tr = 0; tr < ceil_div(m.rows, 16); ++tr) {
    const int64_t r0 = tr * 16, r1 = std::min(m.rows, r0 + 16);
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t c0 = b * 16, c1 = std::min(m.cols, c0 + 16);
      float tile_amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) tile_amax = fmax_ieee(tile_amax, abs_f32(m.at(r, c)));
      auto rbits = [&](int64_t r, int64_t c) {
        return stochastic ? sr.byte_at((uint64_t)(r * m.cols + c)) : 0u;
      };
      uint8_t s;
      float mult;
      if (!four_over_six) {
        s = nvfp4_block_scale(tile_amax, ts);
        mult = nvfp4_element_multiplier(s, ts);
      } else {
        const FourOverSixScalePair pair = four_over_six_scales(tile_amax, ts46);
        float err[2] = {0.0f, 0.0f};
        const uint8_t cand[2] = {pair.map6, pair.map4};
        // Error order: each row's 16 elements summed in order, then the row sums in row order
        // (what one thread per row and a fixed reduction do on the GPU).
        for (int k = 0; k < 2; ++k) {
          const float mk = four_over_six_multiplier(cand[k], ts46);
          for (int64_t r = r0; r < r1; ++r) {
            float row_err = 0.0f;
            for (int64_t c = c0; c < c1; ++c) {
              const uint8_t q = four_over_six_encode_element(m.at(r, c), mk, stochastic, rbits(r, c));
              row_err = four_over_six_accumulate_error(
                  row_err, four_over_six_dequantize_element(q, cand[k], ts46), m.at(r, c),
                  cfg.four_over_six_metric);
            }
            err[k] = four_over_six_combine_errors(err[k], row_err, cfg.four_over_six_metric);
          }
        }
        s = err[1] < err[0] ? pair.map4 : pair.map6;
        mult = four_over_six_multiplier(s, ts46);
      }
      for (int64_t r = r0; r < r1; ++r) {
        scales[r * n_blocks + b] = s;
        for (int64_t c = c0; c < c1; ++c) {
          const uint8_t q = four_over_six ? four_over_six_encode_element(m.at(r, c), mult, stochastic, rbits(r, c))
                                          : nvfp4_encode_element(m.at(r, c), mult, stochastic, rbits(r, c));
          set_fp4(data + r * row_bytes, c, q);
        }
      }
    }
  }
}

// The column-wise copy of a 2D-quantized tensor: the transpose of the row-wise data and scales.
QuantizedData transpose_2d(const QuantConfig& cfg, const QuantizedData& row) {
  QuantizedData col = make_data(cfg, row.cols, row.rows, Device::kCpu, false);
  if (cfg.format == Format::kNvfp4) {
    std::fill_n(col.data.ptr<uint8_t>(), col.data.nbytes(), 0);
    const int64_t rb = fp4_row_bytes(row.cols), cb = fp4_row_bytes(col.cols);
    const int64_t row_blocks = ceil_div(row.cols, 16), col_blocks = ceil_div(col.cols, 16);
    for (int64_t r = 0; r < row.rows; ++r)
      for (int64_t c = 0; c < row.cols; ++c) {
        set_fp4(col.data.ptr<uint8_t>() + c * cb, r, get_fp4(row.data.ptr<uint8_t>() + r * rb, c));
        col.scales.ptr<uint8_t>()[c * col_blocks + r / 16] =
            row.scales.ptr<uint8_t>()[r * row_blocks + c / 16];
      }
    *col.amax.ptr<float>() = *row.amax.ptr<float>();
  } else {  // FP8 128x128
    for (int64_t r = 0; r < row.rows; ++r)
      for (int64_t c = 0; c < row.cols; ++c)
        col.data.ptr<uint8_t>()[c * row.rows + r] = row.data.ptr<uint8_t>()[r * row.cols + c];
    const int64_t tr = ceil_div(row.rows, 128), tc = ceil_div(row.cols, 128);
    for (int64_t i = 0; i < tr; ++i)
      for (int64_t j = 0; j < tc; ++j)
        col.scales.ptr<float>()[j * tr + i] = row.scales.ptr<float>()[i * tc + j];
  }
  return col;
}

// ---- MXFP8 ------------------------------------------------------------------------------------

void mxfp8_quantize(const Matrix& m, const QuantConfig& cfg, const RandomStream& sr,
                    QuantizedData& out) {
  const bool stochastic = cfg.rounding == Rounding::kStochastic;
  const int64_t n_blocks = ceil_div(m.cols, 32);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t c0 = b * 32, c1 = std::min(m.cols, c0 + 32);
      float block_amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) block_amax = fmax_ieee(block_amax, abs_f32(m.at(r, c)));
      const uint8_t code = mxfp8_scale_code(block_amax, cfg.mx_scale_rule);
      out.scales.ptr<uint8_t>()[r * n_blocks + b] = code;
      for (int64_t c = c0; c < c1; ++c) {
        const uint32_t rb = stochastic ? sr.byte_at((uint64_t)(r * m.cols + c)) : 0u;
        out.data.ptr<uint8_t>()[r * m.cols + c] = mxfp8_encode_element(m.at(r, c), code, stochastic, rb);
      }
    }
}

// ---- FP8 with FP32 scales -----------------------------------------------------------------------

void fp8_quantize(const Matrix& m, const QuantConfig& cfg, const RandomStream& sr,
                  QuantizedData& out) {
  const bool stochastic = cfg.rounding == Rounding::kStochastic;
  const int64_t bs_r = cfg.format == Format::kFp8Tensor ? m.rows : (cfg.block_2d ? 128 : 1);
  const int64_t bs_c = cfg.format == Format::kFp8Tensor ? m.cols : 128;
  const int64_t nbr = ceil_div(m.rows, bs_r), nbc = ceil_div(m.cols, bs_c);
  for (int64_t i = 0; i < nbr; ++i)
    for (int64_t j = 0; j < nbc; ++j) {
      const int64_t r0 = i * bs_r, r1 = std::min(m.rows, r0 + bs_r);
      const int64_t c0 = j * bs_c, c1 = std::min(m.cols, c0 + bs_c);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = fmax_ieee(amax, abs_f32(m.at(r, c)));
      const float enc = fp8_encode_scale(amax, cfg.fp8_pow2_scales);
      out.scales.ptr<float>()[i * nbc + j] = div_rn(1.0f, enc);
      if (cfg.format == Format::kFp8Tensor) *out.amax.ptr<float>() = amax;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          const uint32_t rb = stochastic ? sr.byte_at((uint64_t)(r * m.cols + c)) : 0u;
          out.data.ptr<uint8_t>()[r * m.cols + c] = fp8_encode_element(m.at(r, c), enc, stochastic, rb);
        }
    }
}

void quantize_matrix(const Matrix& m, float nvfp4_amax, const QuantConfig& cfg,
                     const RandomStream& sr, QuantizedData& out) {
  switch (cfg.format) {
    case Format::kNvfp4:
      if (cfg.block_2d) {
        nvfp4_quantize_2d(m, nvfp4_amax, cfg, sr, out);
      } else {
        nvfp4_quantize_1d(m, nvfp4_amax, cfg, sr, out);
      }
      break;
    case Format::kMxfp8: mxfp8_quantize(m, cfg, sr, out); break;
    case Format::kFp8Block:
    case Format::kFp8Tensor: fp8_quantize(m, cfg, sr, out); break;
  }
}

}  // namespace

void check_finite_reference(const TensorView& src, std::string_view tensor_name) {
  const Matrix m = load_source(src);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) {
      const float x = m.at(r, c);
      FOURBIT_CHECK(formats::is_finite_f32(x),
                    "tensor '{}' ({}) contains {} at row {}, column {}: refusing to quantize a "
                    "non-finite value; find where it was produced (fourbit reports NaN/Inf at "
                    "the first quantizer that sees it)",
                    tensor_name, src.describe(), std::isnan(x) ? "NaN" : "Inf", r, c);
    }
}

QuantizedTensor allocate_quantized(const QuantConfig& config, int64_t src_rows, int64_t src_cols,
                                   Orientations orientations, Device device) {
  config.validate();
  QuantizedTensor q;
  q.config = config;
  q.rows = src_rows;
  q.cols = src_cols;
  q.device = device;
  FOURBIT_CHECK(!config.nvfp4_row_amax || !orientations.colwise,
                "quant config '{}': a per-row amax (nvfp4_row_amax) exists for the row-wise copy "
                "only; quantize the column-wise copy with a per-tensor amax",
                config.describe());
  if (orientations.rowwise) q.rowwise = make_data(config, src_rows, src_cols, device, true);
  if (orientations.colwise) q.colwise = make_data(config, src_cols, src_rows, device, false);
  return q;
}

void rht_reference(float* data, int64_t rows, int64_t cols, uint16_t sign_mask, bool inverse) {
  FOURBIT_CHECK(cols % 16 == 0, "the 16-point Hadamard transform needs the blocked dimension to "
                "be a multiple of 16, got {}", cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 16) {
      float* v = data + r * cols + c;
      if (inverse) {
        rht16_inverse(v, sign_mask);
      } else {
        rht16_forward(v, sign_mask);
      }
    }
}

namespace {
QuantizedTensor quantize_reference_impl(const TensorView& src, const QuantConfig& config,
                                        Orientations orientations, const QuantizeOptions& options,
                                        const std::optional<RandomStream>& colwise_sr);
}  // namespace

QuantizedTensor quantize_reference(const TensorView& src, const QuantConfig& config,
                                   Orientations orientations, const QuantizeOptions& options) {
  return quantize_reference_impl(src, config, orientations, options, std::nullopt);
}

QuantizedTensor quantize_reference(const TensorView& src, const QuantConfig& config,
                                   Orientations orientations, const QuantizeOptions& options,
                                   RandomStream colwise_sr) {
  return quantize_reference_impl(src, config, orientations, options, colwise_sr);
}

namespace {
QuantizedTensor quantize_reference_impl(const TensorView& src, const QuantConfig& config,
                                        Orientations orientations, const QuantizeOptions& options,
                                        const std::optional<RandomStream>& colwise_sr) {
  config.validate();
  check_finite_reference(src, options.tensor_name);
  const Matrix m = load_source(src);
  QuantizedTensor q = allocate_quantized(config, m.rows, m.cols, orientations, Device::kCpu);
  const RandomStream row_stream = options.sr;
  FOURBIT_CHECK(!colwise_sr || !config.block_2d,
                "tensor '{}': a column-wise stream of its own applies to 1D blocks only (a 2D "
                "column-wise copy is the transpose of the row-wise one)", options.tensor_name);
  const RandomStream col_stream =
      colwise_sr ? *colwise_sr : RandomStream{options.sr.seed, options.sr.stream ^ kColwiseStreamBit};
  const bool two_d = config.block_2d;
  const float amax = matrix_amax(m);
  if (orientations.rowwise || (orientations.colwise && two_d)) {
    QuantizedData row = make_data(config, m.rows, m.cols, Device::kCpu, true);
    quantize_matrix(m, amax, config, row_stream, row);
    if (orientations.colwise && two_d) q.colwise = transpose_2d(config, row);
    if (orientations.rowwise) q.rowwise = std::move(row);
  }
  if (orientations.colwise && !two_d) {
    Matrix t = transpose(m);
    float col_amax = amax;
    if (config.rht) {
      FOURBIT_CHECK(t.cols % 16 == 0,
                    "tensor '{}': the RHT of the column-wise copy needs rows (M = {}) to be a "
                    "multiple of 16; pad the token dimension",
                    options.tensor_name, m.rows);
      rht_reference(t.v.data(), t.rows, t.cols, config.rht_sign_mask(), false);
      col_amax = matrix_amax(t);
    }
    quantize_matrix(t, col_amax, config, col_stream, *q.colwise);
  }
  return q;
}
}  // namespace

Tensor dequantize_reference(const QuantizedTensor& q, bool colwise) {
  const std::optional<QuantizedData>& od = colwise ? q.colwise : q.rowwise;
  FOURBIT_CHECK(od.has_value(), "dequantize: the {} copy was not quantized",
                colwise ? "column-wise" : "row-wise");
  FOURBIT_CHECK(q.device == Device::kCpu, "dequantize_reference needs a CPU quantized tensor");
  const QuantizedData& d = *od;
  const QuantConfig& cfg = q.config;
  Tensor out = Tensor::empty({d.rows, d.cols}, DType::kF32, Device::kCpu);
  float* o = out.ptr<float>();
  const uint8_t* data = d.data.ptr<const uint8_t>();
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t c = 0; c < d.cols; ++c) {
      float v = 0.0f;
      switch (cfg.format) {
        case Format::kNvfp4: {
          const uint8_t code = get_fp4(data + r * fp4_row_bytes(d.cols), c);
          const uint8_t s = d.scales.ptr<const uint8_t>()[r * ceil_div(d.cols, 16) + c / 16];
          const float amax = d.amax.ptr<const float>()[d.amax.numel() > 1 ? r : 0];
          v = nvfp4_dequantize_element(code, s, amax, cfg.nvfp4_global_constant());
          break;
        }
        case Format::kMxfp8:
          v = mxfp8_dequantize_element(data[r * d.cols + c],
                                       d.scales.ptr<const uint8_t>()[r * ceil_div(d.cols, 32) + c / 32]);
          break;
        case Format::kFp8Block: {
          const float s = cfg.block_2d
                              ? d.scales.ptr<const float>()[(r / 128) * ceil_div(d.cols, 128) + c / 128]
                              : d.scales.ptr<const float>()[r * ceil_div(d.cols, 128) + c / 128];
          v = fp8_dequantize_element(data[r * d.cols + c], s);
          break;
        }
        case Format::kFp8Tensor:
          v = fp8_dequantize_element(data[r * d.cols + c], *d.scales.ptr<const float>());
          break;
      }
      o[r * d.cols + c] = v;
    }
  return out;
}

Tensor dequantize_to_source_reference(const QuantizedTensor& q, bool colwise) {
  Tensor stored = dequantize_reference(q, colwise);
  if (!colwise) return stored;
  const QuantizedData& d = *q.colwise;
  if (q.config.rht && !q.config.block_2d) {
    rht_reference(stored.ptr<float>(), d.rows, d.cols, q.config.rht_sign_mask(), true);
  }
  Tensor out = Tensor::empty({q.rows, q.cols}, DType::kF32, Device::kCpu);
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t c = 0; c < d.cols; ++c) out.ptr<float>()[c * d.rows + r] = stored.ptr<float>()[r * d.cols + c];
  return out;
}

Tensor dequantize_bf16_scaled_reference(const QuantizedTensor& q, bool colwise) {
  const std::optional<QuantizedData>& od = colwise ? q.colwise : q.rowwise;
  FOURBIT_CHECK(od.has_value(), "dequantize: the {} copy was not quantized",
                colwise ? "column-wise" : "row-wise");
  const QuantizedData& d = *od;
  const QuantConfig& cfg = q.config;
  Tensor out = Tensor::empty({d.rows, d.cols}, DType::kBF16, Device::kCpu);
  uint16_t* o = out.ptr<uint16_t>();
  const uint8_t* data = d.data.ptr<const uint8_t>();
  for (int64_t r = 0; r < d.rows; ++r)
    for (int64_t c = 0; c < d.cols; ++c) {
      float v = 0.0f;
      switch (cfg.format) {
        case Format::kNvfp4: {
          const uint8_t code = get_fp4(data + r * fp4_row_bytes(d.cols), c);
          const uint8_t s = d.scales.ptr<const uint8_t>()[r * ceil_div(d.cols, 16) + c / 16];
          v = mul_rn(formats::decode_e2m1(code), formats::decode_e4m3(s));
          break;
        }
        case Format::kMxfp8: {
          const uint8_t s = d.scales.ptr<const uint8_t>()[r * ceil_div(d.cols, 32) + c / 32];
          const uint8_t code = data[r * d.cols + c];
          FOURBIT_CHECK((code & 0x7F) == 0 || (s >= 3 && s <= 246),
                        "MXFP8 block at stored ({}, {}) has scale code {} outside [3, 246]: its "
                        "values are not exact in BF16; the exact emulation cannot consume it",
                        r, c, s);
          v = mxfp8_dequantize_element(code, s);
          break;
        }
        case Format::kFp8Block: {
          const float s = cfg.block_2d
                              ? d.scales.ptr<const float>()[(r / 128) * ceil_div(d.cols, 128) + c / 128]
                              : d.scales.ptr<const float>()[r * ceil_div(d.cols, 128) + c / 128];
          v = fp8_dequantize_element(data[r * d.cols + c], s);
          break;
        }
        case Format::kFp8Tensor:
          v = fp8_dequantize_element(data[r * d.cols + c], *d.scales.ptr<const float>());
          break;
      }
      o[r * d.cols + c] = formats::encode_bf16_rn(v);
    }
  return out;
}

float global_decode_scale(const QuantizedTensor& q, bool colwise, int64_t row) {
  if (q.config.format != Format::kNvfp4) return 1.0f;
  const std::optional<QuantizedData>& od = colwise ? q.colwise : q.rowwise;
  FOURBIT_CHECK(od.has_value(), "global_decode_scale: the {} copy was not quantized",
                colwise ? "column-wise" : "row-wise");
  FOURBIT_CHECK(od->amax.device() == Device::kCpu, "global_decode_scale reads a host amax");
  const int64_t n = od->amax.numel();
  FOURBIT_CHECK(n == 1 || (row >= 0 && row < n), "global_decode_scale: row {} of {} per-row amaxes", row, n);
  return nvfp4_global_decode_scale(od->amax.ptr<const float>()[n > 1 ? row : 0], q.config.nvfp4_global_constant());
}

}  // namespace fourbit::quant
