// quant (gpu): every CUDA quantizer against the CPU reference, bit for bit: packed values, scales,
// global amaxes, scaled-domain BF16 and dequantized values, for every format and option, BF16 and
// FP32 sources, several shapes and edge-case fills. Outputs live inside guard regions that must
// stay untouched, and each case runs twice with two different poison patterns so that an output
// byte the kernel forgot to write cannot match the reference by accident.
#include "core/device.h"
#include "formats/element.h"
#include "quant/quantize.h"
#include "quant/report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace fourbit::quant {
namespace {

constexpr int64_t kGuard = 256;  // bytes of guard on each side of every device output

// A device allocation with guard bytes around the usable region.
struct Guarded {
  std::shared_ptr<void> storage;
  int64_t bytes = 0;
  TensorView view;

  static Guarded make(Shape shape, DType dtype) {
    Guarded g;
    g.bytes = dtype_bytes(dtype, shape.numel());
    g.storage = allocate_bytes(g.bytes + 2 * kGuard, Device::kCuda);
    g.view = TensorView::contiguous(static_cast<char*>(g.storage.get()) + kGuard, dtype, shape,
                                    Device::kCuda);
    return g;
  }
  void poison(uint8_t byte) const {
    device_memset(g_base(), byte, bytes + 2 * kGuard);
  }
  void* g_base() const { return storage.get(); }
  // Returns the number of guard bytes that are not `byte`.
  int64_t damaged_guard_bytes(uint8_t byte) const {
    std::vector<uint8_t> h((size_t)(bytes + 2 * kGuard));
    device_memcpy(h.data(), Device::kCpu, g_base(), Device::kCuda, (int64_t)h.size());
    int64_t bad = 0;
    for (int64_t i = 0; i < kGuard; ++i) bad += h[(size_t)i] != byte;
    for (int64_t i = kGuard + bytes; i < (int64_t)h.size(); ++i) bad += h[(size_t)i] != byte;
    return bad;
  }
  Tensor tensor() const { return Tensor::alias(view, storage); }
};

enum class Fill { kNormal, kHeavyTailed, kOutliers, kZeros, kAllEqualBlocks, kOneOutlier, kSubnormal, kNearMax, kRowScales };

const char* fill_name(Fill f) {
  switch (f) {
    case Fill::kNormal: return "normal";
    case Fill::kHeavyTailed: return "student-t";
    case Fill::kOutliers: return "outliers";
    case Fill::kZeros: return "zeros";
    case Fill::kAllEqualBlocks: return "all-equal-blocks";
    case Fill::kOneOutlier: return "one-outlier";
    case Fill::kSubnormal: return "subnormal";
    case Fill::kNearMax: return "near-max";
    case Fill::kRowScales: return "row-scales";
  }
  return "?";
}

// f32 host tensor, then optionally rounded to BF16 (the source dtype).
Tensor make_source(Fill fill, int64_t rows, int64_t cols, bool bf16, uint64_t seed) {
  Tensor x = make_synthetic(fill == Fill::kHeavyTailed ? Distribution::kHeavyTailed
                            : fill == Fill::kOutliers  ? Distribution::kOutliers
                                                       : Distribution::kNormal,
                            rows, cols, seed);
  float* p = x.ptr<float>();
  const int64_t n = rows * cols;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i / cols, c = i % cols;
    switch (fill) {
      case Fill::kZeros: p[i] = (i % 3 == 0) ? -0.0f : 0.0f; break;
      case Fill::kAllEqualBlocks: p[i] = ((r / 16 + c / 16) % 2 ? -1.0f : 1.0f) * (1 + (c / 32) % 5); break;
      case Fill::kOneOutlier: if (i == n / 3) p[i] = 3.0e4f; break;
      case Fill::kSubnormal: p[i] *= bf16 ? 1e-39f : 1e-40f; break;  // FP32/BF16 subnormals
      case Fill::kNearMax: p[i] = p[i] * 1e37f; break;
      case Fill::kRowScales: p[i] *= std::ldexp(1.0f, (int)(r % 40) - 30); break;  // incl. tiny block scales
      default: break;
    }
  }
  if (!bf16) return x;
  Tensor b = Tensor::empty({rows, cols}, DType::kBF16, Device::kCpu);
  for (int64_t i = 0; i < n; ++i) b.ptr<uint16_t>()[i] = formats::encode_bf16_rn(p[i]);
  return b;
}

// The device bundle with guarded tensors, mirroring allocate_quantized's shapes.
struct GuardedBundle {
  QuantizedTensor q;
  std::vector<Guarded> buffers;
};

GuardedBundle allocate_guarded(const QuantConfig& cfg, int64_t rows, int64_t cols, Orientations o) {
  const QuantizedTensor shape_only = allocate_quantized(cfg, rows, cols, o, Device::kCpu);
  GuardedBundle gb;
  gb.q = shape_only;
  gb.q.device = Device::kCuda;
  auto guard = [&](Tensor& t) {
    if (!t.defined()) return;
    Guarded g = Guarded::make(t.shape(), t.dtype());
    t = g.tensor();
    gb.buffers.push_back(g);
  };
  for (std::optional<QuantizedData>* d : {&gb.q.rowwise, &gb.q.colwise}) {
    if (!d->has_value()) continue;
    guard((*d)->data);
    guard((*d)->scales);
    guard((*d)->amax);
  }
  return gb;
}

::testing::AssertionResult same_bytes(const Tensor& gpu, const Tensor& ref, const std::string& what) {
  const Tensor h = gpu.to(Device::kCpu);
  if (h.nbytes() != ref.nbytes()) return ::testing::AssertionFailure() << what << ": size differs";
  const uint8_t* a = h.ptr<uint8_t>();
  const uint8_t* b = ref.ptr<uint8_t>();
  int64_t first = -1, count = 0;
  for (int64_t i = 0; i < h.nbytes(); ++i) {
    if (a[i] != b[i]) {
      if (first < 0) first = i;
      ++count;
    }
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << count << " of " << h.nbytes()
                                       << " bytes differ, first at byte " << first << " (gpu 0x"
                                       << std::hex << (int)a[first] << ", cpu 0x" << (int)b[first]
                                       << ")";
}

struct Case {
  std::string name;
  QuantConfig config;
};

std::vector<Case> all_configs() {
  std::vector<Case> v;
  for (bool two_d : {false, true})
    for (bool sr : {false, true})
      for (bool rht : {false, true})
        for (bool fos : {false, true})
          for (bool unbiased : {false, true}) {
            if (two_d && rht) continue;
            if (unbiased && !sr) continue;
            QuantConfig c;
            c.block_2d = two_d;
            c.rounding = sr ? Rounding::kStochastic : Rounding::kNearest;
            c.rht = rht;
            c.sr_unbiased_scale = unbiased;
            if (fos) c.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
            v.push_back({c.describe(), c});
          }
  QuantConfig c;
  c.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
  c.four_over_six_metric = FourOverSixMetric::kMae;
  v.push_back({c.describe(), c});
  c.block_2d = true;
  c.four_over_six_metric = FourOverSixMetric::kAbsMax;
  v.push_back({c.describe(), c});
  c = {};
  c.rht = true;
  c.rht_signs = HadamardSigns::kRandom;
  c.rht_seed = 99;
  v.push_back({c.describe(), c});
  for (MxScaleRule rule : {MxScaleRule::kRoundUp, MxScaleRule::kFloor})
    for (bool sr : {false, true}) {
      QuantConfig m;
      m.format = Format::kMxfp8;
      m.mx_scale_rule = rule;
      m.rounding = sr ? Rounding::kStochastic : Rounding::kNearest;
      v.push_back({m.describe(), m});
    }
  for (bool two_d : {false, true})
    for (bool pow2 : {true, false})
      for (bool sr : {false, true}) {
        QuantConfig f;
        f.format = Format::kFp8Block;
        f.block_2d = two_d;
        f.fp8_pow2_scales = pow2;
        f.rounding = sr ? Rounding::kStochastic : Rounding::kNearest;
        v.push_back({f.describe(), f});
      }
  for (bool pow2 : {true, false}) {
    QuantConfig t;
    t.format = Format::kFp8Tensor;
    t.fp8_pow2_scales = pow2;
    v.push_back({t.describe(), t});
  }
  return v;
}

// Quantizes on the GPU (twice, two poisons) and compares everything with the CPU reference.
// packed = false: the scaled-domain BF16 copies alone (write_packed off, what the emulated GEMMs
// of training read), compared with the reference's; the amaxes as well.
void check_case(const QuantConfig& cfg, Fill fill, int64_t rows, int64_t cols, bool bf16,
                Orientations o, uint64_t seed, bool packed = true) {
  SCOPED_TRACE(::testing::Message() << cfg.describe() << " | " << fill_name(fill) << " | " << rows
                                    << "x" << cols << (bf16 ? " bf16" : " f32") << " | row "
                                    << o.rowwise << " col " << o.colwise << (packed ? "" : " | bf16 only"));
  const Tensor host = make_source(fill, rows, cols, bf16, seed);
  QuantizeOptions ro;
  ro.tensor_name = "test";
  ro.sr = RandomStream{seed, 77};
  const QuantizedTensor ref = quantize_reference(host.view(), cfg, o, ro);
  const Tensor dev = host.to(Device::kCuda);
  const bool mx_exact_ok = !(cfg.format == Format::kMxfp8 && (fill == Fill::kSubnormal || fill == Fill::kRowScales || fill == Fill::kNearMax));

  for (uint8_t poison : {(uint8_t)0xA5, (uint8_t)0x3C}) {
    GuardedBundle gb = allocate_guarded(cfg, rows, cols, o);
    for (const Guarded& g : gb.buffers) g.poison(poison);
    std::vector<Guarded> bf16_out;
    bf16_out.push_back(Guarded::make({rows, cols}, DType::kBF16));
    bf16_out.push_back(Guarded::make({cols, rows}, DType::kBF16));
    for (const Guarded& g : bf16_out) g.poison(poison);
    CudaQuantizeOptions co;
    co.tensor_name = "test";
    co.sr = ro.sr;
    co.write_bf16_scaled = mx_exact_ok;
    co.write_packed = packed;
    if (!packed && !mx_exact_ok) return;  // nothing would be written
    quantize_cuda(dev.view(), gb.q, co, &bf16_out[0].view, &bf16_out[1].view);
    device_synchronize();
    for (const Guarded& g : gb.buffers) ASSERT_EQ(g.damaged_guard_bytes(poison), 0) << "guard overwritten";
    for (const Guarded& g : bf16_out) ASSERT_EQ(g.damaged_guard_bytes(poison), 0) << "bf16 guard overwritten";
    for (bool col : {false, true}) {
      const std::optional<QuantizedData>& g = col ? gb.q.colwise : gb.q.rowwise;
      const std::optional<QuantizedData>& r = col ? ref.colwise : ref.rowwise;
      if (!r) continue;
      const std::string which = col ? "colwise" : "rowwise";
      if (packed) {
        ASSERT_TRUE(same_bytes(g->data, r->data, which + " data"));
        ASSERT_TRUE(same_bytes(g->scales, r->scales, which + " scales"));
      }
      if (r->amax.defined()) {
        ASSERT_TRUE(same_bytes(g->amax, r->amax, which + " amax"));
      }
      if (mx_exact_ok) {
        const Tensor want = dequantize_bf16_scaled_reference(ref, col);
        ASSERT_TRUE(same_bytes(bf16_out[col ? 1 : 0].tensor(), want, which + " bf16 scaled"));
      }
      if (poison == 0xA5 && packed) {
        Tensor out = Tensor::empty({r->rows, r->cols}, DType::kF32, Device::kCuda);
        dequantize_cuda(gb.q, col, out.view(), nullptr);
        ASSERT_TRUE(same_bytes(out, dequantize_reference(ref, col), which + " dequantized"));
      }
    }
  }
}

class QuantCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU";
  }
};

TEST_F(QuantCuda, EveryConfigMatchesTheReferenceOnRandomData) {
  uint64_t seed = 1;
  for (const Case& c : all_configs()) {
    const int64_t tr = c.config.format == Format::kFp8Block ? 128 : 64;
    for (bool bf16 : {true, false}) {
      check_case(c.config, Fill::kNormal, 2 * tr, 256, bf16, {true, true}, seed++);
      check_case(c.config, Fill::kHeavyTailed, tr, 384, bf16, {true, true}, seed++);
    }
    check_case(c.config, Fill::kOutliers, 4 * tr, 128, true, {false, true}, seed++);
    check_case(c.config, Fill::kNormal, 2 * tr, 128, true, {true, false}, seed++);
    check_case(c.config, Fill::kHeavyTailed, 3 * tr, 384, false, {true, false}, seed++);
    if (HasFatalFailure()) return;
  }
}

// nvfp4_row_amax (one global amax per row, the RL sampler's per-token scales): the streaming
// kernel (round to nearest, amax to 6) and the tile kernel (Four Over Six, stochastic rounding) on
// fills whose rows differ in scale by orders of magnitude, plus all-zero and subnormal rows.
TEST_F(QuantCuda, PerRowAmaxMatchesTheReference) {
  uint64_t seed = 900;
  for (bool fos : {false, true})
    for (bool sr : {false, true}) {
      QuantConfig c;
      c.nvfp4_row_amax = true;
      c.rounding = sr ? Rounding::kStochastic : Rounding::kNearest;
      if (fos) c.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
      for (Fill fill : {Fill::kNormal, Fill::kRowScales, Fill::kOutliers, Fill::kZeros, Fill::kOneOutlier,
                        Fill::kSubnormal, Fill::kNearMax})
        for (bool bf16 : {true, false}) {
          check_case(c, fill, 128, 256, bf16, {true, false}, seed++);
          if (HasFatalFailure()) return;
        }
    }
}

// fn(config, fill, bf16 source) for NVFP4 1x16 with and without SR and RHT, over the fills that
// stress the block scales.
template <typename Fn>
void for_each_nvfp4_1x16_case(Fn&& fn) {
  for (bool sr : {false, true})
    for (bool rht : {false, true})
      for (bool bf16 : {true, false}) {
        QuantConfig c;
        c.rounding = sr ? Rounding::kStochastic : Rounding::kNearest;
        c.rht = rht;
        for (Fill fill : {Fill::kNormal, Fill::kHeavyTailed, Fill::kZeros, Fill::kOneOutlier, Fill::kSubnormal,
                          Fill::kNearMax, Fill::kAllEqualBlocks}) {
          fn(c, fill, bf16);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
}

// The forward's X call (gemm::linear_fprop_saving_x): the row-wise copy as scaled-domain BF16 only
// (no packed data or scales), the column-wise copy packed only. The tile kernel's variant for it
// is picked by the call's outputs (kSrRhtRowGrid under FOURBIT_QUANT_X_ROW_GRID=1, else kSrRht;
// kRoundNearest without RHT and SR).
void check_row_bf16_column_packed(const QuantConfig& c, Fill fill, bool bf16, uint64_t seed) {
  const int64_t rows = 128, cols = 256;
  SCOPED_TRACE(::testing::Message() << c.describe() << " | " << fill_name(fill) << (bf16 ? " bf16" : " f32")
                                    << " | row bf16 only, column packed");
  const Tensor host = make_source(fill, rows, cols, bf16, seed);
  QuantizeOptions ro;
  ro.tensor_name = "x";
  ro.sr = RandomStream{seed, 78};
  const QuantizedTensor ref = quantize_reference(host.view(), c, {true, true}, ro);
  const Tensor dev = host.to(Device::kCuda);
  GuardedBundle gb = allocate_guarded(c, rows, cols, {true, true});
  for (const Guarded& g : gb.buffers) g.poison(0xA5);
  gb.q.rowwise->data = Tensor();  // the row-wise copy as BF16 alone, as the forward asks
  gb.q.rowwise->scales = Tensor();
  Guarded row_bf16 = Guarded::make({rows, cols}, DType::kBF16);
  row_bf16.poison(0xA5);
  CudaQuantizeOptions co;
  co.tensor_name = "x";
  co.sr = ro.sr;
  co.write_bf16_scaled = true;
  quantize_cuda(dev.view(), gb.q, co, &row_bf16.view, nullptr);
  device_synchronize();
  for (const Guarded& g : gb.buffers) ASSERT_EQ(g.damaged_guard_bytes(0xA5), 0) << "guard overwritten";
  ASSERT_EQ(row_bf16.damaged_guard_bytes(0xA5), 0) << "bf16 guard overwritten";
  ASSERT_TRUE(same_bytes(row_bf16.tensor(), dequantize_bf16_scaled_reference(ref, false), "rowwise bf16 scaled"));
  ASSERT_TRUE(same_bytes(gb.q.colwise->data, ref.colwise->data, "colwise data"));
  ASSERT_TRUE(same_bytes(gb.q.colwise->scales, ref.colwise->scales, "colwise scales"));
  ASSERT_TRUE(same_bytes(gb.q.colwise->amax, ref.colwise->amax, "colwise amax"));
}

// The training path: NVFP4 1x16 copies written as scaled-domain BF16 only (no packed data), which
// the kernels compute from the encoders' grid values without forming codes.
TEST_F(QuantCuda, Bf16OnlyCopiesMatchTheReference) {
  uint64_t seed = 5000;
  for_each_nvfp4_1x16_case([&](const QuantConfig& c, Fill fill, bool bf16) {
    check_case(c, fill, 128, 256, bf16, {true, true}, seed++, false);  // tile kernel
    check_case(c, fill, 64, 384, bf16, {true, false}, seed++, false);  // streaming row kernel
    check_case(c, fill, 192, 128, bf16, {false, true}, seed++, false);
  });
}

TEST_F(QuantCuda, RowBf16ColumnPackedMatchesTheReference) {
  uint64_t seed = 9000;
  for_each_nvfp4_1x16_case(
      [&](const QuantConfig& c, Fill fill, bool bf16) { check_row_bf16_column_packed(c, fill, bf16, seed++); });
}

TEST_F(QuantCuda, EdgeFillsMatchTheReference) {
  const Fill fills[] = {Fill::kZeros, Fill::kAllEqualBlocks, Fill::kOneOutlier, Fill::kSubnormal,
                        Fill::kNearMax, Fill::kRowScales, Fill::kOutliers};
  uint64_t seed = 1000;
  for (const Case& c : all_configs()) {
    const int64_t tr = c.config.format == Format::kFp8Block ? 128 : 64;
    for (Fill f : fills) {
      for (bool bf16 : {true, false}) check_case(c.config, f, 2 * tr, 256, bf16, {true, true}, seed++);
      // Row-wise only: the 1D formats without Four Over Six take the streaming kernel then.
      for (bool bf16 : {true, false}) check_case(c.config, f, 2 * tr, 256, bf16, {true, false}, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(QuantCuda, LargeTensorMatchesTheReference) {
  QuantConfig c;
  check_case(c, Fill::kNormal, 1024, 2048, true, {true, true}, 5);
  c.rht = true;
  c.rounding = Rounding::kStochastic;
  check_case(c, Fill::kHeavyTailed, 1024, 2048, true, {true, true}, 6);
  QuantConfig f;
  f.format = Format::kFp8Block;
  f.block_2d = true;
  check_case(f, Fill::kNormal, 1024, 1024, true, {true, true}, 7);
}

TEST_F(QuantCuda, ManyTilesInBothDirections) {
  // 17 x 33 tiles of every tile-kernel variant (more tiles than one wave of CTAs, in both grid
  // dimensions), an FP32 source with row scales, and one column of 600 tiles.
  QuantConfig rn;
  QuantConfig grad;
  grad.rounding = Rounding::kStochastic;
  grad.rht = true;
  QuantConfig weight;
  weight.block_2d = true;
  QuantConfig fos;
  fos.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
  QuantConfig mx;
  mx.format = Format::kMxfp8;
  QuantConfig f8;
  f8.format = Format::kFp8Block;
  uint64_t seed = 2000;
  for (const QuantConfig& c : {rn, grad, weight, fos, mx, f8}) {
    const int64_t tr = c.format == Format::kFp8Block ? 128 : 64;
    check_case(c, Fill::kHeavyTailed, 17 * tr, 33 * 128, true, {true, true}, seed++);
    if (HasFatalFailure()) return;
  }
  // Row-wise only: the streaming kernel (1D formats; the gradient config's stochastic rounding,
  // its RHT unused row-wise) and the tile kernel's row-only 16x16 path, many CTAs of each, from
  // BF16 and FP32 sources.
  for (const QuantConfig& c : {rn, grad, weight, mx, f8}) {
    const int64_t tr = c.format == Format::kFp8Block ? 128 : 64;
    for (bool bf16 : {true, false}) check_case(c, Fill::kHeavyTailed, 17 * tr, 33 * 128, bf16, {true, false}, seed++);
    if (HasFatalFailure()) return;
  }
  check_case(rn, Fill::kRowScales, 17 * 64, 33 * 128, false, {true, true}, seed++);
  check_case(rn, Fill::kNormal, 600 * 64, 128, true, {true, true}, seed++);
  check_case(grad, Fill::kNormal, 600 * 64, 128, true, {false, true}, seed++);
}

TEST_F(QuantCuda, QuantReportOnTheGpuEqualsTheCpuReport) {
  ReportOptions o;
  o.rows = 256;
  o.cols = 256;
  o.device = Device::kCpu;
  const std::vector<ReportRow> cpu = run_quant_report(o);
  o.device = Device::kCuda;
  const std::vector<ReportRow> gpu = run_quant_report(o);
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_EQ(cpu[i].stats.relative_error, gpu[i].stats.relative_error) << cpu[i].case_name;
    EXPECT_EQ(cpu[i].stats.relative_bias, gpu[i].stats.relative_bias) << cpu[i].case_name;
  }
}

// amax_cuda's ticket reduction (set_amax_reduction(1): no zeroed outputs, the last CTA writes) gives
// the bits of the atomic one (outputs zeroed by fills, atomicMax), for the flat and the RHT kernel,
// BF16 and FP32, a one-CTA and a full grid, a NaN / Inf (left out of the amax / kept, flagged), on
// outputs that hold garbage beforehand; the ticket is reusable (the same call twice) and per stream.
TEST_F(QuantCuda, AmaxTicketReductionEqualsTheAtomicOne) {
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  struct Case {
    int64_t rows, cols;
    bool bf16, rht;
    int poke;  // 0: none, 1: NaN, 2: Inf at one element
  };
  for (const Case& k : {Case{16, 128, true, false, 0}, Case{16, 128, false, true, 0}, Case{1024, 1024, true, false, 0},
                        Case{1024, 1024, true, true, 0}, Case{4096, 4096, true, true, 0}, Case{4096, 4096, false, false, 0},
                        Case{2048, 512, true, false, 1}, Case{2048, 512, true, true, 2}, Case{2048, 512, false, true, 1}}) {
    SCOPED_TRACE(::testing::Message() << k.rows << " x " << k.cols << (k.bf16 ? " bf16" : " f32")
                                      << (k.rht ? " rht" : "") << " poke " << k.poke);
    Tensor host = make_source(Fill::kNormal, k.rows, k.cols, k.bf16, 11);
    if (k.poke != 0) {
      const int64_t at = k.rows * k.cols / 3 + 5;
      if (k.bf16) {
        host.ptr<uint16_t>()[at] = k.poke == 1 ? 0x7FC0 : 0x7F80;
      } else {
        host.ptr<float>()[at] = k.poke == 1 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      }
    }
    const Tensor dev = host.to(Device::kCuda);
    auto run = [&](int mode, void* stream) {
      set_amax_reduction(mode);
      Tensor garbage = Tensor::empty({2}, DType::kF32, Device::kCpu);
      garbage.ptr<float>()[0] = garbage.ptr<float>()[1] = 12345.0f;  // a ticket call must overwrite it
      Tensor amax = garbage.to(Device::kCuda);
      Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
      amax_cuda(dev.view(), amax.ptr<float>(), amax.ptr<float>() + 1, k.rht, 0xB5A3, flag.ptr<int>(), stream);
      if (stream != nullptr) EXPECT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), cudaSuccess);
      const Tensor a = amax.to(Device::kCpu), f = flag.to(Device::kCpu);
      return std::tuple{a.ptr<float>()[0], a.ptr<float>()[1], f.ptr<int>()[0]};
    };
    const auto [want_row, want_col, want_flag] = run(0, nullptr);
    EXPECT_EQ(want_flag != 0, k.poke != 0);
    for (void* stream : {static_cast<void*>(nullptr), static_cast<void*>(nullptr), static_cast<void*>(other)}) {
      const auto [row, col, flag] = run(1, stream);
      EXPECT_EQ(std::memcmp(&row, &want_row, 4), 0) << "row amax " << row << " want " << want_row;
      EXPECT_EQ(std::memcmp(&col, &want_col, 4), 0) << "column amax " << col << " want " << want_col;
      EXPECT_EQ(flag, want_flag);
    }
  }
  set_amax_reduction(-1);
  cudaStreamDestroy(other);
}

TEST_F(QuantCuda, GivenAmaxIsUsedInsteadOfAPass) {
  const Tensor host = make_source(Fill::kNormal, 128, 256, true, 3);
  const Tensor dev = host.to(Device::kCuda);
  QuantConfig cfg;
  QuantizedTensor a = allocate_quantized(cfg, 128, 256, {true, false}, Device::kCuda);
  QuantizedTensor b = allocate_quantized(cfg, 128, 256, {true, false}, Device::kCuda);
  quantize_cuda(dev.view(), a, CudaQuantizeOptions{});
  // A larger given amax changes the global scale: the scales must differ from a's.
  Tensor given = Tensor::empty({1}, DType::kF32, Device::kCpu);
  *given.ptr<float>() = 100.0f;
  const Tensor given_dev = given.to(Device::kCuda);
  CudaQuantizeOptions co;
  co.given_rowwise_amax = given_dev.ptr<float>();
  quantize_cuda(dev.view(), b, co);
  EXPECT_EQ(*b.rowwise->amax.to(Device::kCpu).ptr<float>(), 100.0f);
  EXPECT_FALSE(same_bytes(a.rowwise->scales, b.rowwise->scales.to(Device::kCpu), "scales"));
}

// Given amaxes equal to the ones a pass computes give the same bytes as the pass, and each lands in
// its bundle (the quantize kernel copies it there: no memcpy launch), for both orientations, with
// and without RHT (the column-wise amax given after the transform), BF16-only copies included.
TEST_F(QuantCuda, GivenAmaxesReproduceThePassAndReachTheBundles) {
  const Tensor dev = make_source(Fill::kNormal, 256, 512, true, 5).to(Device::kCuda);
  for (bool rht : {false, true})
    for (bool bf16_only : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "rht " << rht << " bf16-only " << bf16_only);
      QuantConfig cfg;
      cfg.rht = rht;
      cfg.rht_signs = HadamardSigns::kRandom;
      cfg.rht_seed = 7;
      QuantizedTensor a = allocate_quantized(cfg, 256, 512, {true, true}, Device::kCuda);
      QuantizedTensor b = allocate_quantized(cfg, 256, 512, {true, true}, Device::kCuda);
      Tensor a_row = Tensor::zeros({256, 512}, DType::kBF16, Device::kCuda), a_col = Tensor::zeros({512, 256}, DType::kBF16, Device::kCuda);
      Tensor b_row = Tensor::zeros({256, 512}, DType::kBF16, Device::kCuda), b_col = Tensor::zeros({512, 256}, DType::kBF16, Device::kCuda);
      CudaQuantizeOptions ca;
      ca.write_bf16_scaled = bf16_only;
      ca.write_packed = !bf16_only;
      const TensorView ar = a_row.view(), ac = a_col.view(), br = b_row.view(), bc = b_col.view();
      quantize_cuda(dev.view(), a, ca, bf16_only ? &ar : nullptr, bf16_only ? &ac : nullptr);
      const Tensor row_amax = a.rowwise->amax.to(Device::kCuda), col_amax = a.colwise->amax.to(Device::kCuda);
      CudaQuantizeOptions cb = ca;
      cb.given_rowwise_amax = row_amax.ptr<float>();
      cb.given_colwise_amax = rht ? col_amax.ptr<float>() : nullptr;
      quantize_cuda(dev.view(), b, cb, bf16_only ? &br : nullptr, bf16_only ? &bc : nullptr);
      EXPECT_TRUE(same_bytes(b.rowwise->amax, a.rowwise->amax.to(Device::kCpu), "row amax"));
      EXPECT_TRUE(same_bytes(b.colwise->amax, a.colwise->amax.to(Device::kCpu), "column amax"));
      if (bf16_only) {
        EXPECT_TRUE(same_bytes(b_row, a_row.to(Device::kCpu), "row bf16"));
        EXPECT_TRUE(same_bytes(b_col, a_col.to(Device::kCpu), "column bf16"));
      } else {
        EXPECT_TRUE(same_bytes(b.rowwise->data, a.rowwise->data.to(Device::kCpu), "row data"));
        EXPECT_TRUE(same_bytes(b.rowwise->scales, a.rowwise->scales.to(Device::kCpu), "row scales"));
        EXPECT_TRUE(same_bytes(b.colwise->data, a.colwise->data.to(Device::kCpu), "column data"));
        EXPECT_TRUE(same_bytes(b.colwise->scales, a.colwise->scales.to(Device::kCpu), "column scales"));
      }
    }
  // FP8 per-tensor scaling reads one amax for both orientations, also when only the column-wise
  // bundle exists.
  for (Orientations o : {Orientations{true, true}, Orientations{false, true}}) {
    SCOPED_TRACE(::testing::Message() << "fp8 tensor, row " << o.rowwise << " col " << o.colwise);
    QuantConfig cfg;
    cfg.format = Format::kFp8Tensor;
    QuantizedTensor a = allocate_quantized(cfg, 256, 512, o, Device::kCuda);
    QuantizedTensor b = allocate_quantized(cfg, 256, 512, o, Device::kCuda);
    quantize_cuda(dev.view(), a, CudaQuantizeOptions{});
    const Tensor amax = (o.rowwise ? a.rowwise : a.colwise)->amax.to(Device::kCuda);
    CudaQuantizeOptions cb;
    cb.given_rowwise_amax = amax.ptr<float>();
    quantize_cuda(dev.view(), b, cb);
    for (auto [qa, qb, what] : {std::tuple{&a.rowwise, &b.rowwise, "row"}, std::tuple{&a.colwise, &b.colwise, "column"}}) {
      if (!*qa) continue;
      EXPECT_TRUE(same_bytes((*qb)->amax, (*qa)->amax.to(Device::kCpu), std::string(what) + " amax"));
      EXPECT_TRUE(same_bytes((*qb)->data, (*qa)->data.to(Device::kCpu), std::string(what) + " data"));
    }
  }
}

TEST_F(QuantCuda, NonFiniteInputIsReportedWithTheTensorName) {
  // NaN and Inf, BF16 (checked on BF16 pairs by the NVFP4 1x16 kernels) and FP32 sources, each
  // orientation alone and both, the bad value in either column of a BF16 pair; with the global
  // amax given (no amax pass), the quantize kernel itself must see it.
  Tensor one = Tensor::empty({1}, DType::kF32, Device::kCpu);
  *one.ptr<float>() = 1.0f;
  const Tensor one_dev = one.to(Device::kCuda);
  for (bool given : {false, true})
  for (Format f : {Format::kNvfp4, Format::kMxfp8, Format::kFp8Block})
    for (bool bf16 : {false, true})
      for (bool inf : {false, true})
        for (int64_t at : {777, 778})
          for (Orientations o : {Orientations{true, true}, Orientations{true, false}, Orientations{false, true}}) {
            SCOPED_TRACE(::testing::Message() << format_name(f) << (bf16 ? " bf16" : " f32")
                                              << (inf ? " inf" : " nan") << " at " << at
                                              << " row " << o.rowwise << " col " << o.colwise
                                              << (given ? " amax given" : ""));
            Tensor host = make_source(Fill::kNormal, 128, 128, bf16, 4);
            if (bf16) {
              host.ptr<uint16_t>()[at] = inf ? 0xFF80 : 0x7FC0;
            } else {
              host.ptr<float>()[at] = inf ? -std::numeric_limits<float>::infinity()
                                          : std::numeric_limits<float>::quiet_NaN();
            }
            const Tensor dev = host.to(Device::kCuda);
            QuantConfig cfg;
            cfg.format = f;
            QuantizedTensor q = allocate_quantized(cfg, 128, 128, o, Device::kCuda);
            CudaQuantizeOptions co;
            co.tensor_name = "blocks.7.attn.qkv.grad_output";
            if (given) co.given_rowwise_amax = one_dev.ptr<float>();
            try {
              quantize_cuda(dev.view(), q, co);
              ADD_FAILURE() << "a non-finite value was quantized silently";
            } catch (const Error& e) {
              EXPECT_NE(std::string(e.what()).find("blocks.7.attn.qkv.grad_output"), std::string::npos) << e.what();
            }
          }
}

TEST_F(QuantCuda, UnalignedShapesAreRejectedClearly) {
  const Tensor dev = make_source(Fill::kNormal, 64, 100, true, 1).to(Device::kCuda);
  QuantizedTensor q = allocate_quantized(QuantConfig{}, 64, 100, {true, false}, Device::kCuda);
  CudaQuantizeOptions co;
  co.tensor_name = "odd";
  try {
    quantize_cuda(dev.view(), q, co);
    FAIL() << "accepted a 64 x 100 tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pad"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fourbit::quant
