// ops attention (gpu): the CUDA kernels against the CPU reference run in f32 on the very bf16
// values the kernels consumed. Outputs live inside guard regions (an out-of-bounds write fails the
// case) and every case runs twice with two poison fills (an unwritten element cannot match by
// accident; the two runs must also agree bit for bit: determinism). The backward is compared on
// the forward's own bf16 out and f32 lse, so only the backward's error is measured.
//
// Tolerances (elementwise, derived from where the kernels round; u = 2^-8 is bf16's unit roundoff:
// 8 significant bits, so round-to-nearest moves a value by at most u times itself):
//   lse: FP32 scores and softmax only: 1e-4 + 1e-5 |lse|.
//   out: P is rounded to bf16 before P V (u per term), the FP32 row sum uses the unrounded P
//        (another u), out is rounded to bf16 (u |out|): at most 3 u sum_j P_ij |v_j|. Tolerance
//        4 u = 2^-6 times sum_j P_ij |v_j| (computed by running the reference on |v|).
//   dq, dk, dv: dS (for dq, dk) or P (for dv) is rounded to bf16 before its product and the result
//        is rounded to bf16: at most 2 u times the bound, where, with M_ij = P_ij (|dP_ij| + |D_i|),
//          dq: scale sum_j M_ij |k_j|,  dk: scale sum_{i, heads of the group} M_ij |q_i|,
//          dv: sum_{i, heads} P_ij |dout_i|.
//        Tolerance 4 u = 2^-6 times the bound, plus 1e-4 times the largest bound of the tensor
//        (FP32 accumulation noise of dP over D terms and of the recomputed scores).
//   decode: FP32 throughout, bf16 output only (u |out|): 2 u = 2^-7 times sum_j P_j |v_j|, + 1e-6.
// (A host emulation of these kernels, run while writing them, stayed below half of each tolerance.)
// A wrong mask, tile or fragment mapping produces errors of the order of the values themselves,
// far above these bounds.
#include "core/device.h"
#include "ops/attention.h"
#include "ops/rope.h"

#include "dense_ops_test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

namespace fourbit::ops {
namespace {

using testing::all_close;
using testing::Guarded;
using testing::host_ints;
using testing::host_tensor;
using testing::random_ints;
using testing::random_normal;
using testing::rounded;
using testing::values_of;

constexpr uint8_t kPoisons[2] = {0xFF, 0x7F};  // bf16 NaN pattern; 0x7F7F ~ 3.4e38

struct Case {
  int64_t B, T, H, Hkv, D;
  double input_scale = 1.0;
  bool fused = false;  // q, k, v (and dq, dk, dv) as strided slices of one fused buffer
  // D = 64 kernel shapes (AttentionOptions::tiles): the defaults, every kernel narrow (16 rows a
  // warp) or every kernel wide (32 rows a warp).
  // kWgmma: the warpgroup-MMA forward and backward kernels (any D), without the pipelined
  // backward; kWgmmaOverlap: with it (AttentionOptions::wgmma_overlap); kWgmmaFastExp: pipelined
  // and with ex2.approx.ftz exponentials (AttentionOptions::wgmma_fast_exp).
  enum class Tiles { kDefault, kNarrow, kWide, kWgmma, kWgmmaOverlap, kWgmmaFastExp } tiles = Tiles::kDefault;
};

AttentionTiles tiles_of(const Case& c) {
  switch (c.tiles) {
    case Case::Tiles::kNarrow: return AttentionTiles{false, false, false};
    case Case::Tiles::kWide: return AttentionTiles{true, true, true};
    case Case::Tiles::kDefault:
    case Case::Tiles::kWgmma:
    case Case::Tiles::kWgmmaOverlap:
    case Case::Tiles::kWgmmaFastExp: break;
  }
  return AttentionTiles{};
}

AttentionOptions options_of(const Case& c) {
  AttentionOptions o;
  o.tiles = tiles_of(c);
  const bool fast_exp = c.tiles == Case::Tiles::kWgmmaFastExp;
  const bool overlap = c.tiles == Case::Tiles::kWgmmaOverlap || fast_exp;
  o.wgmma_backward = o.wgmma_forward = c.tiles == Case::Tiles::kWgmma || overlap;
  o.wgmma_overlap = overlap;
  o.wgmma_fast_exp = fast_exp;
  return o;
}

std::string describe(const Case& c) {
  return "B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " H " + std::to_string(c.H) +
         " Hkv " + std::to_string(c.Hkv) + " D " + std::to_string(c.D) +
         (c.input_scale != 1.0 ? " input scale " + std::to_string(c.input_scale) : "") +
         (c.fused ? " fused-QKV views" : "") +
         (c.tiles == Case::Tiles::kWide     ? " all wide"
          : c.tiles == Case::Tiles::kNarrow ? " all narrow"
          : c.tiles == Case::Tiles::kWgmma  ? " wgmma"
          : c.tiles == Case::Tiles::kWgmmaOverlap ? " wgmma, overlapped backward"
          : c.tiles == Case::Tiles::kWgmmaFastExp ? " wgmma fast exp"
                                            : "");
}

std::vector<double> abs_of(std::vector<double> v) {
  for (double& x : v) x = std::fabs(x);
  return v;
}

double max_of(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, x);
  return m;
}

// Row-major [B, T, heads, D] values; element access.
struct HostHeads {
  const std::vector<double>* v;
  int64_t T, heads, D;
  const double* row(int64_t b, int64_t t, int64_t h) const {
    return v->data() + ((b * T + t) * heads + h) * D;
  }
};

double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The error bounds of the backward (see the file comment).
struct BackwardBounds {
  std::vector<double> dq, dk, dv;
};

BackwardBounds backward_bounds(const Case& c, double scale, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               const std::vector<double>& out, const std::vector<double>& lse,
                               const std::vector<double>& dout) {
  const HostHeads Q{&q, c.T, c.H, c.D}, K{&k, c.T, c.Hkv, c.D}, V{&v, c.T, c.Hkv, c.D},
      O{&out, c.T, c.H, c.D}, G{&dout, c.T, c.H, c.D};
  BackwardBounds r{std::vector<double>(q.size()), std::vector<double>(k.size()),
                   std::vector<double>(v.size())};
  const int64_t group = c.H / c.Hkv;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < c.T; ++i) {
        const double l = lse[(size_t)((b * c.H + h) * c.T + i)];
        const double delta = dot(G.row(b, i, h), O.row(b, i, h), c.D);
        double* dqb = r.dq.data() + ((b * c.T + i) * c.H + h) * c.D;
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(scale * dot(Q.row(b, i, h), K.row(b, j, hk), c.D) - l);
          const double m = p * (std::fabs(dot(G.row(b, i, h), V.row(b, j, hk), c.D)) + std::fabs(delta));
          double* dkb = r.dk.data() + ((b * c.T + j) * c.Hkv + hk) * c.D;
          double* dvb = r.dv.data() + ((b * c.T + j) * c.Hkv + hk) * c.D;
          const double *kj = K.row(b, j, hk), *qi = Q.row(b, i, h), *gi = G.row(b, i, h);
          for (int64_t d = 0; d < c.D; ++d) {
            dqb[d] += scale * m * std::fabs(kj[d]);
            dkb[d] += scale * m * std::fabs(qi[d]);
            dvb[d] += p * std::fabs(gi[d]);
          }
        }
      }
    }
  return r;
}

// Device tensors for q, k, v (or dq, dk, dv): plain, or slices of one fused buffer
// [B, T, H + 2 Hkv + 1, D] whose last head slot is never part of a view (it must stay poisoned).
struct DeviceQkv {
  Guarded fused;
  std::vector<Guarded> plain;
  TensorView q, k, v;
};

TensorView slice(const TensorView& fused, int64_t head0, int64_t heads) {
  TensorView v = fused;
  v.data = static_cast<uint16_t*>(fused.data) + head0 * fused.shape[3];
  v.shape = {fused.shape[0], fused.shape[1], heads, fused.shape[3]};
  return v;
}

DeviceQkv make_qkv(const Case& c, uint8_t poison) {
  DeviceQkv r;
  if (c.fused) {
    r.fused = Guarded::make({c.B, c.T, c.H + 2 * c.Hkv + 1, c.D}, DType::kBF16, poison);
    r.q = slice(r.fused.view, 0, c.H);
    r.k = slice(r.fused.view, c.H, c.Hkv);
    r.v = slice(r.fused.view, c.H + c.Hkv, c.Hkv);
  } else {
    r.plain.push_back(Guarded::make({c.B, c.T, c.H, c.D}, DType::kBF16, poison));
    r.plain.push_back(Guarded::make({c.B, c.T, c.Hkv, c.D}, DType::kBF16, poison));
    r.plain.push_back(Guarded::make({c.B, c.T, c.Hkv, c.D}, DType::kBF16, poison));
    r.q = r.plain[0].view;
    r.k = r.plain[1].view;
    r.v = r.plain[2].view;
  }
  return r;
}

// Host values of a [B, T, heads, D] view into a fused or plain device buffer.
std::vector<double> read_heads(const DeviceQkv& d, const TensorView& x) {
  if (d.plain.size() == 3) return values_of(x);
  const std::vector<double> all = values_of(d.fused.view);
  std::vector<double> r((size_t)x.numel());
  const int64_t base = (static_cast<uint16_t*>(x.data) - static_cast<uint16_t*>(d.fused.view.data));
  int64_t i = 0;
  for (int64_t b = 0; b < x.shape[0]; ++b)
    for (int64_t t = 0; t < x.shape[1]; ++t)
      for (int64_t h = 0; h < x.shape[2]; ++h)
        for (int64_t e = 0; e < x.shape[3]; ++e)
          r[(size_t)i++] = all[(size_t)(base + b * x.strides[0] + t * x.strides[1] + h * x.strides[2] + e)];
  return r;
}

// Uploads host values into a [B, T, heads, D] view (element by element through a host image of
// the whole buffer, so that fused slices keep their neighbours).
void write_heads(const DeviceQkv& d, const TensorView& x, const std::vector<double>& values) {
  if (d.plain.size() == 3) {
    copy_tensor(x, host_tensor(x.shape, DType::kBF16, values).view());
    return;
  }
  Tensor host = Tensor::empty(d.fused.view.shape, DType::kBF16, Device::kCpu);
  copy_tensor(host.view(), d.fused.view);
  const int64_t base = (static_cast<uint16_t*>(x.data) - static_cast<uint16_t*>(d.fused.view.data));
  int64_t i = 0;
  for (int64_t b = 0; b < x.shape[0]; ++b)
    for (int64_t t = 0; t < x.shape[1]; ++t)
      for (int64_t h = 0; h < x.shape[2]; ++h)
        for (int64_t e = 0; e < x.shape[3]; ++e)
          host.ptr<uint16_t>()[base + b * x.strides[0] + t * x.strides[1] + h * x.strides[2] + e] =
              formats::encode_bf16_rn((float)values[(size_t)i++]);
  copy_tensor(d.fused.view, host.view());
}

// The fused buffer's spare head slot (never in a view) must still hold the poison.
::testing::AssertionResult spare_slot_untouched(const DeviceQkv& d, const Case& c, uint8_t poison) {
  if (d.plain.size() == 3) return ::testing::AssertionSuccess();
  Tensor host = Tensor::empty(d.fused.view.shape, DType::kBF16, Device::kCpu);
  copy_tensor(host.view(), d.fused.view);
  const int64_t heads = c.H + 2 * c.Hkv + 1;
  const uint16_t want = (uint16_t)(poison | (poison << 8));
  for (int64_t bt = 0; bt < c.B * c.T; ++bt)
    for (int64_t e = 0; e < c.D; ++e)
      if (host.ptr<uint16_t>()[(bt * heads + heads - 1) * c.D + e] != want)
        return ::testing::AssertionFailure() << "the spare head slot of the fused buffer was written at "
                                             << "token " << bt << " element " << e;
  return ::testing::AssertionSuccess();
}

std::vector<uint8_t> bytes_of(const TensorView& x) {
  std::vector<uint8_t> h((size_t)x.nbytes());
  device_memcpy(h.data(), Device::kCpu, x.data, Device::kCuda, x.nbytes());
  return h;
}

class OpsAttentionCuda : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda_device_count(), 0) << "the gpu tests need a CUDA GPU"; }
};

void check_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const double scale = 1.0 / std::sqrt((double)c.D);
  const int64_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.T * c.Hkv * c.D;
  const std::vector<double> q = rounded(random_normal(nq, seed, c.input_scale), DType::kBF16);
  const std::vector<double> k = rounded(random_normal(nk, seed + 1, c.input_scale), DType::kBF16);
  const std::vector<double> v = rounded(random_normal(nk, seed + 2), DType::kBF16);
  const std::vector<double> dout = rounded(random_normal(nq, seed + 3), DType::kBF16);

  // Reference forward (f32 storage, float64 math) and the |v| run that gives sum_j P_ij |v_j|.
  const Tensor q32 = host_tensor({c.B, c.T, c.H, c.D}, DType::kF32, q);
  const Tensor k32 = host_tensor({c.B, c.T, c.Hkv, c.D}, DType::kF32, k);
  const Tensor v32 = host_tensor({c.B, c.T, c.Hkv, c.D}, DType::kF32, v);
  const Tensor vabs32 = host_tensor({c.B, c.T, c.Hkv, c.D}, DType::kF32, abs_of(v));
  Tensor out_ref = Tensor::empty({c.B, c.T, c.H, c.D}, DType::kF32, Device::kCpu);
  Tensor out_abs = Tensor::empty({c.B, c.T, c.H, c.D}, DType::kF32, Device::kCpu);
  Tensor lse_ref = Tensor::empty({c.B, c.H, c.T}, DType::kF32, Device::kCpu);
  Tensor lse_tmp = Tensor::empty({c.B, c.H, c.T}, DType::kF32, Device::kCpu);
  attention_forward(q32, k32, v32, out_ref, lse_ref);
  attention_forward(q32, k32, vabs32, out_abs, lse_tmp);
  const std::vector<double> out_want = values_of(out_ref), lse_want = values_of(lse_ref);
  const std::vector<double> out_bound = values_of(out_abs);
  const double out_floor = 1e-6;

  // Forward, twice.
  std::vector<double> out_gpu, lse_gpu;
  std::vector<uint8_t> out_bits, lse_bits;
  for (uint8_t poison : kPoisons) {
    SCOPED_TRACE(::testing::Message() << "forward, poison 0x" << std::hex << (int)poison);
    DeviceQkv in = make_qkv(c, poison);
    write_heads(in, in.q, q);
    write_heads(in, in.k, k);
    write_heads(in, in.v, v);
    Guarded out = Guarded::make({c.B, c.T, c.H, c.D}, DType::kBF16, poison);
    Guarded lse = Guarded::make({c.B, c.H, c.T}, DType::kF32, poison);
    AttentionOptions fwd_options = options_of(c);
    attention_forward(in.q, in.k, in.v, out.view, lse.view, fwd_options);
    device_synchronize();
    ASSERT_EQ(out.damaged_guard_bytes(), 0) << "out: write outside the tensor";
    ASSERT_EQ(lse.damaged_guard_bytes(), 0) << "lse: write outside the tensor";
    const std::vector<double> o = out.values(), l = lse.values();
    ASSERT_TRUE(all_close(o, out_want, [&](int64_t i) { return std::ldexp(out_bound[(size_t)i], -6) + out_floor; },
                          "out"));
    ASSERT_TRUE(all_close(l, lse_want, [&](int64_t i) { return 1e-4 + 1e-5 * std::fabs(lse_want[(size_t)i]); },
                          "lse"));
    if (out_bits.empty()) {
      out_gpu = o;
      lse_gpu = l;
      out_bits = bytes_of(out.view);
      lse_bits = bytes_of(lse.view);
    } else {
      ASSERT_TRUE(out_bits == bytes_of(out.view)) << "forward not deterministic: out differs between runs";
      ASSERT_TRUE(lse_bits == bytes_of(lse.view)) << "forward not deterministic: lse differs between runs";
    }
  }

  // Reference backward on the kernel's own out and lse.
  const Tensor out32 = host_tensor({c.B, c.T, c.H, c.D}, DType::kF32, out_gpu);
  const Tensor lse32 = host_tensor({c.B, c.H, c.T}, DType::kF32, lse_gpu);
  const Tensor dout32 = host_tensor({c.B, c.T, c.H, c.D}, DType::kF32, dout);
  Tensor dq_ref = Tensor::empty({c.B, c.T, c.H, c.D}, DType::kF32, Device::kCpu);
  Tensor dk_ref = Tensor::empty({c.B, c.T, c.Hkv, c.D}, DType::kF32, Device::kCpu);
  Tensor dv_ref = Tensor::empty({c.B, c.T, c.Hkv, c.D}, DType::kF32, Device::kCpu);
  attention_backward(dout32, q32, k32, v32, out32, lse32, dq_ref, dk_ref, dv_ref);
  const std::vector<double> dq_want = values_of(dq_ref), dk_want = values_of(dk_ref), dv_want = values_of(dv_ref);
  const BackwardBounds bound = backward_bounds(c, scale, q, k, v, out_gpu, lse_gpu, dout);
  auto tol = [](const std::vector<double>& b) {
    const double floor = 1e-4 * max_of(b);
    return [&b, floor](int64_t i) { return std::ldexp(b[(size_t)i], -6) + floor; };
  };

  std::vector<uint8_t> dq_bits, dk_bits, dv_bits;
  for (uint8_t poison : kPoisons) {
    SCOPED_TRACE(::testing::Message() << "backward, poison 0x" << std::hex << (int)poison);
    DeviceQkv in = make_qkv(c, 0);
    write_heads(in, in.q, q);
    write_heads(in, in.k, k);
    write_heads(in, in.v, v);
    DeviceQkv grad = make_qkv(c, poison);
    const Tensor dout_d = host_tensor({c.B, c.T, c.H, c.D}, DType::kBF16, dout).to(Device::kCuda);
    const Tensor out_d = host_tensor({c.B, c.T, c.H, c.D}, DType::kBF16, out_gpu).to(Device::kCuda);
    const Tensor lse_d = lse32.to(Device::kCuda);
    AttentionOptions options = options_of(c);
    attention_backward(dout_d, in.q, in.k, in.v, out_d, lse_d, grad.q, grad.k, grad.v, options);
    device_synchronize();
    if (c.fused) {
      ASSERT_EQ(grad.fused.damaged_guard_bytes(), 0) << "dqkv: write outside the fused buffer";
      ASSERT_TRUE(spare_slot_untouched(grad, c, poison));
    } else {
      ASSERT_EQ(grad.plain[0].damaged_guard_bytes(), 0) << "dq: write outside the tensor";
      ASSERT_EQ(grad.plain[1].damaged_guard_bytes(), 0) << "dk: write outside the tensor";
      ASSERT_EQ(grad.plain[2].damaged_guard_bytes(), 0) << "dv: write outside the tensor";
    }
    const std::vector<double> dq = read_heads(grad, grad.q), dk = read_heads(grad, grad.k),
                              dv = read_heads(grad, grad.v);
    ASSERT_TRUE(all_close(dq, dq_want, tol(bound.dq), "dq"));
    ASSERT_TRUE(all_close(dk, dk_want, tol(bound.dk), "dk"));
    ASSERT_TRUE(all_close(dv, dv_want, tol(bound.dv), "dv"));
    auto bits = [](const std::vector<double>& x) {
      std::vector<uint8_t> b(x.size() * sizeof(double));
      std::memcpy(b.data(), x.data(), b.size());
      return b;
    };
    if (dq_bits.empty()) {
      dq_bits = bits(dq);
      dk_bits = bits(dk);
      dv_bits = bits(dv);
    } else {
      ASSERT_TRUE(dq_bits == bits(dq)) << "backward not deterministic: dq differs between runs";
      ASSERT_TRUE(dk_bits == bits(dk)) << "backward not deterministic: dk differs between runs";
      ASSERT_TRUE(dv_bits == bits(dv)) << "backward not deterministic: dv differs between runs";
    }
  }
}

// check_case for each case with the given kernel shapes (seeds seed + 10, seed + 20, ...); stops
// at the first fatal failure.
void check_cases(Case::Tiles tiles, uint64_t seed, const std::vector<Case>& cases) {
  for (Case c : cases) {
    c.tiles = tiles;
    check_case(c, seed += 10);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST_F(OpsAttentionCuda, HeadDim64MatchesTheReference) {
  uint64_t seed = 1000;
  for (const Case& c : {Case{2, 1, 4, 2, 64}, Case{1, 7, 2, 2, 64}, Case{2, 65, 4, 1, 64},
                        Case{1, 128, 2, 2, 64}, Case{1, 200, 6, 2, 64}, Case{1, 333, 2, 1, 64}}) {
    check_case(c, seed += 10);
    if (HasFatalFailure()) return;
  }
}

TEST_F(OpsAttentionCuda, HeadDim128MatchesTheReference) {
  uint64_t seed = 2000;
  for (const Case& c : {Case{2, 1, 2, 1, 128}, Case{1, 63, 4, 2, 128}, Case{2, 129, 2, 2, 128},
                        Case{1, 257, 4, 4, 128}}) {
    check_case(c, seed += 10);
    if (HasFatalFailure()) return;
  }
}

// Many key blocks per query tile, GQA groups of 4 and 2, ragged last tiles, and more CTAs than fit
// on the GPU at once (B 12, T 512: 384 dk/dv CTAs, ~2 per SM).
TEST_F(OpsAttentionCuda, ManyKeyBlocksAndGqaGroups) {
  check_case(Case{12, 512, 4, 4, 64}, 5000);
  if (HasFatalFailure()) return;
  check_case(Case{2, 1000, 4, 1, 64}, 5010);
  if (HasFatalFailure()) return;
  check_case(Case{3, 777, 4, 2, 128}, 5020);
}

// The wide kernels (D = 64): the forward and dQ with 32 queries a warp and 128 a CTA, dK/dV with 32
// keys a warp and 128 a CTA: ragged blocks (T not a multiple of 128, 32 or 16), warps that skip a tile
// (all keys after all queries), GQA, strided views, large scores.
TEST_F(OpsAttentionCuda, WideTilesMatchTheReference) {
  check_cases(Case::Tiles::kWide, 7000,
              {{2, 1, 4, 2, 64}, {1, 7, 2, 2, 64}, {2, 65, 4, 1, 64}, {1, 128, 2, 2, 64}, {1, 200, 6, 2, 64},
               {1, 333, 2, 1, 64}, {2, 100, 4, 2, 64, 1.0, true}, {1, 150, 2, 1, 64, 4.0}, {2, 1000, 4, 1, 64}});
}

// The default D = 64 forward is wide; its narrow kernel (and the narrow backward) stays tested.
TEST_F(OpsAttentionCuda, NarrowTilesMatchTheReference) {
  check_cases(Case::Tiles::kNarrow, 7500,
              {{2, 1, 4, 2, 64}, {2, 65, 4, 1, 64}, {1, 333, 2, 1, 64}, {2, 100, 4, 2, 64, 1.0, true},
               {1, 150, 2, 1, 64, 4.0}, {2, 1000, 4, 1, 64}});
}

// The cases of every wgmma variant: D 64 and 128, ragged T (not a multiple of 64 or 32), one
// query tile, GQA groups, strided fused views, scores that saturate the softmax, many key blocks.
std::vector<Case> wgmma_cases() {
  return {{2, 1, 4, 2, 64}, {1, 7, 2, 2, 128}, {2, 65, 4, 1, 64}, {1, 128, 2, 2, 64}, {1, 200, 6, 2, 128},
          {1, 333, 2, 1, 64}, {2, 100, 4, 2, 64, 1.0, true}, {1, 77, 2, 1, 128, 1.0, true},
          {1, 150, 2, 1, 64, 4.0}, {1, 90, 2, 2, 128, 4.0}, {2, 1000, 4, 1, 64}, {3, 777, 4, 2, 128}};
}

// The warpgroup-MMA forward and backward (Hopper), the backward without the pipelining.
TEST_F(OpsAttentionCuda, WgmmaKernelsMatchTheReference) {
  if (!attention_wgmma_available()) GTEST_SKIP() << "needs an sm_90a build on a compute 9.0 GPU";
  check_cases(Case::Tiles::kWgmma, 8000, wgmma_cases());
}

// The software-pipelined warpgroup-MMA backward: the same cases against the reference, then the
// same bits as the backward without the overlap (the same products in the same order), with and
// without RoPE's backward in the epilogues.
TEST_F(OpsAttentionCuda, WgmmaOverlapBackwardMatchesTheReferenceAndTheUnpipelinedBits) {
  if (!attention_wgmma_available()) GTEST_SKIP() << "needs an sm_90a build on a compute 9.0 GPU";
  const std::vector<Case> cases = wgmma_cases();
  check_cases(Case::Tiles::kWgmmaOverlap, 8000, cases);
  if (HasFatalFailure()) return;
  uint64_t seed = 8500;
  for (Case c : cases) {
    for (const bool rope : {false, true}) {
      c.tiles = Case::Tiles::kWgmma;
      SCOPED_TRACE(describe(c) + (rope ? " with RoPE's backward" : ""));
      seed += 10;
      const int64_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.T * c.Hkv * c.D;
      DeviceQkv in = make_qkv(c, 0);
      write_heads(in, in.q, rounded(random_normal(nq, seed, c.input_scale), DType::kBF16));
      write_heads(in, in.k, rounded(random_normal(nk, seed + 1, c.input_scale), DType::kBF16));
      write_heads(in, in.v, rounded(random_normal(nk, seed + 2), DType::kBF16));
      const Tensor dout =
          host_tensor({c.B, c.T, c.H, c.D}, DType::kBF16, random_normal(nq, seed + 3)).to(Device::kCuda);
      const Tensor positions = host_ints({c.B * c.T}, random_ints(c.B * c.T, 0, 4000, seed + 4)).to(Device::kCuda);
      AttentionOptions o = options_of(c);
      if (rope) o.rope_backward = AttentionOptions::RopeBackward{positions, 10000.0f};
      Tensor out = Tensor::empty({c.B, c.T, c.H, c.D}, DType::kBF16, Device::kCuda);
      Tensor lse = Tensor::empty({c.B, c.H, c.T}, DType::kF32, Device::kCuda);
      attention_forward(in.q, in.k, in.v, out, lse, o);
      std::vector<std::vector<double>> results[2];
      for (const bool overlap : {false, true}) {
        o.wgmma_overlap = overlap;
        DeviceQkv grad = make_qkv(c, overlap ? 0x7F : 0xFF);
        attention_backward(dout, in.q, in.k, in.v, out, lse, grad.q, grad.k, grad.v, o);
        device_synchronize();
        results[overlap] = {read_heads(grad, grad.q), read_heads(grad, grad.k), read_heads(grad, grad.v)};
      }
      const char* names[3] = {"dq", "dk", "dv"};
      for (int i = 0; i < 3; ++i) {
        const std::vector<double>&w = results[0][(size_t)i], &g = results[1][(size_t)i];
        ASSERT_EQ(w.size(), g.size());
        int64_t differ = 0, first = -1;
        for (size_t j = 0; j < w.size(); ++j)
          if (!(w[j] == g[j] || (std::isnan(w[j]) && std::isnan(g[j]))) && differ++ == 0) first = (int64_t)j;
        EXPECT_EQ(differ, 0) << names[i] << ": " << differ << " of " << w.size()
                             << " elements differ from the backward without the overlap; first at " << first;
      }
    }
  }
}

// The wgmma kernels with ex2.approx.ftz exponentials: the same cases and tolerances as the others.
TEST_F(OpsAttentionCuda, WgmmaFastExpKernelsMatchTheReference) {
  if (!attention_wgmma_available()) GTEST_SKIP() << "needs an sm_90a build on a compute 9.0 GPU";
  check_cases(Case::Tiles::kWgmmaFastExp, 9000, wgmma_cases());
}

TEST_F(OpsAttentionCuda, FusedQkvStridedViews) {
  check_case(Case{2, 100, 4, 2, 64, 1.0, true}, 3000);
  if (HasFatalFailure()) return;
  check_case(Case{1, 77, 2, 1, 128, 1.0, true}, 3010);
}

TEST_F(OpsAttentionCuda, LargeScoresSaturatingTheSoftmax) {
  // q, k ~ N(0, 4^2): scores with standard deviation ~16, so every tile rescales the running max.
  check_case(Case{1, 150, 2, 1, 64, 4.0}, 4000);
  if (HasFatalFailure()) return;
  check_case(Case{1, 90, 2, 2, 128, 4.0}, 4010);
}

// [B, T, heads, D] with sb = T * st viewed as the [B * T, heads, D] that the RoPE ops take.
TensorView tokens_view(const TensorView& x) {
  TensorView v = x;
  v.shape = Shape{x.shape[0] * x.shape[1], x.shape[2], x.shape[3]};
  v.strides = Shape{x.strides[1], x.strides[2], x.strides[3]};
  return v;
}

// AttentionOptions::rope_backward: the kernels' epilogue rotation must give the bits of
// attention_backward followed by rope_backward_inplace on dq and dk (dv untouched), for every tile
// shape, GQA, ragged T, fused views and positions that include negative ones and ones past
// sincosf's fast range (|angle| > 105615: its slow path).
TEST_F(OpsAttentionCuda, RopeBackwardInTheEpiloguesEqualsTheSeparatePass) {
  const Case cases[] = {
      {2, 100, 4, 2, 64, 1.0, false, Case::Tiles::kDefault}, {1, 200, 4, 1, 64, 1.0, false, Case::Tiles::kWide},
      {2, 130, 2, 2, 64, 1.0, true, Case::Tiles::kNarrow},   {2, 90, 4, 2, 128, 1.0, false, Case::Tiles::kDefault},
      {1, 77, 2, 1, 128, 1.0, true, Case::Tiles::kDefault},
      {2, 100, 4, 2, 64, 1.0, false, Case::Tiles::kWgmma},  {1, 77, 2, 1, 128, 1.0, true, Case::Tiles::kWgmma},
      {2, 100, 4, 2, 64, 1.0, false, Case::Tiles::kWgmmaFastExp}, {1, 77, 2, 1, 128, 1.0, true, Case::Tiles::kWgmmaFastExp},
  };
  uint64_t seed = 7000;
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    seed += 10;
    if ((c.tiles == Case::Tiles::kWgmma || c.tiles == Case::Tiles::kWgmmaFastExp) && !attention_wgmma_available())
      continue;
    const int64_t nq = c.B * c.T * c.H * c.D, nk = c.B * c.T * c.Hkv * c.D, N = c.B * c.T;
    std::vector<int32_t> pos = random_ints(N, -50, 4000, seed + 4);
    pos[0] = 200000;  // angle up to 2e5 rad: sincosf's slow path
    if (N > 3) pos[3] = -123456;
    const Tensor positions = host_ints({N}, pos).to(Device::kCuda);
    DeviceQkv in = make_qkv(c, 0);
    write_heads(in, in.q, rounded(random_normal(nq, seed), DType::kBF16));
    write_heads(in, in.k, rounded(random_normal(nk, seed + 1), DType::kBF16));
    write_heads(in, in.v, rounded(random_normal(nk, seed + 2), DType::kBF16));
    const Tensor dout = host_tensor({c.B, c.T, c.H, c.D}, DType::kBF16, random_normal(nq, seed + 3)).to(Device::kCuda);
    Tensor out = Tensor::empty({c.B, c.T, c.H, c.D}, DType::kBF16, Device::kCuda);
    Tensor lse = Tensor::empty({c.B, c.H, c.T}, DType::kF32, Device::kCuda);
    AttentionOptions options = options_of(c);
    attention_forward(in.q, in.k, in.v, out, lse, options);
    const float theta = c.D == 64 ? 10000.0f : 500000.0f;

    DeviceQkv separate = make_qkv(c, 0xFF);
    attention_backward(dout, in.q, in.k, in.v, out, lse, separate.q, separate.k, separate.v, options);
    rope_backward_inplace(tokens_view(separate.q), tokens_view(separate.k), positions, theta);
    DeviceQkv fused = make_qkv(c, 0x7F);
    AttentionOptions rope_options = options;
    rope_options.rope_backward = AttentionOptions::RopeBackward{positions, theta};
    attention_backward(dout, in.q, in.k, in.v, out, lse, fused.q, fused.k, fused.v, rope_options);
    device_synchronize();
    if (c.fused) {
      ASSERT_EQ(fused.fused.damaged_guard_bytes(), 0) << "dqkv: write outside the fused buffer";
    } else {
      for (int i = 0; i < 3; ++i) ASSERT_EQ(fused.plain[(size_t)i].damaged_guard_bytes(), 0) << "gradient " << i;
    }
    const char* names[3] = {"dq", "dk", "dv"};
    const TensorView* want[3] = {&separate.q, &separate.k, &separate.v};
    const TensorView* got[3] = {&fused.q, &fused.k, &fused.v};
    for (int i = 0; i < 3; ++i) {
      const std::vector<double> w = read_heads(separate, *want[i]), g = read_heads(fused, *got[i]);
      int64_t differ = 0, first = -1;
      for (size_t j = 0; j < w.size(); ++j) {
        const bool same = w[j] == g[j] || (std::isnan(w[j]) && std::isnan(g[j]));
        if (!same && differ++ == 0) first = (int64_t)j;
      }
      EXPECT_EQ(differ, 0) << names[i] << ": " << differ << " of " << w.size()
                           << " elements differ from the separate pass; first at " << first << ": "
                           << (first >= 0 ? g[(size_t)first] : 0.0) << " vs " << (first >= 0 ? w[(size_t)first] : 0.0);
    }
  }
}

// A bad positions tensor is named in the error.
TEST_F(OpsAttentionCuda, RopeBackwardRejectsBadPositions) {
  const Tensor x = host_tensor({1, 4, 2, 64}, DType::kBF16, random_normal(512, 1)).to(Device::kCuda);
  Tensor lse = Tensor::empty({1, 2, 4}, DType::kF32, Device::kCuda);
  Tensor g = Tensor::empty({1, 4, 2, 64}, DType::kBF16, Device::kCuda);
  AttentionOptions options;
  options.rope_backward = AttentionOptions::RopeBackward{host_ints({3}, {0, 1, 2}).to(Device::kCuda), 10000.0f};
  try {
    attention_backward(x, x, x, x, x, lse, g, g, g, options);
    ADD_FAILURE() << "positions of 3 tokens for 4 were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rope_backward.positions must be a contiguous i32 [B * T] = (4)"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(OpsAttentionCuda, UnsupportedHeadDimIsRejected) {
  const Tensor x = host_tensor({1, 4, 2, 96}, DType::kBF16, random_normal(768, 1)).to(Device::kCuda);
  Tensor out = Tensor::empty({1, 4, 2, 96}, DType::kBF16, Device::kCuda);
  Tensor lse = Tensor::empty({1, 2, 4}, DType::kF32, Device::kCuda);
  try {
    attention_forward(x, x, x, out, lse);
    ADD_FAILURE() << "D = 96 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("support head dims D = 64 and 128, got D = 96"), std::string::npos)
        << e.what();
  }
  const Tensor f = host_tensor({1, 4, 2, 64}, DType::kF32, random_normal(512, 1)).to(Device::kCuda);
  Tensor fo = Tensor::empty({1, 4, 2, 64}, DType::kF32, Device::kCuda);
  try {
    attention_forward(f, f, f, fo, lse);
    ADD_FAILURE() << "f32 was accepted on CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("on CUDA q must be bf16"), std::string::npos) << e.what();
  }
}

void check_decode(int64_t B, int64_t Tmax, int64_t H, int64_t Hkv, int64_t D, int64_t Tq,
                  const std::vector<int32_t>& lengths, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "decode B " << B << " T_max " << Tmax << " H " << H << " Hkv "
                                    << Hkv << " D " << D << " Tq " << Tq);
  const std::vector<double> q = rounded(random_normal(B * Tq * H * D, seed), DType::kBF16);
  const std::vector<double> kc = rounded(random_normal(B * Tmax * Hkv * D, seed + 1), DType::kBF16);
  const std::vector<double> vc = rounded(random_normal(B * Tmax * Hkv * D, seed + 2), DType::kBF16);
  const Tensor len_h = host_ints({B}, lengths);
  const Tensor q32 = host_tensor({B, Tq, H, D}, DType::kF32, q);
  const Tensor k32 = host_tensor({B, Tmax, Hkv, D}, DType::kF32, kc);
  Tensor want = Tensor::empty({B, Tq, H, D}, DType::kF32, Device::kCpu);
  Tensor bound = Tensor::empty({B, Tq, H, D}, DType::kF32, Device::kCpu);
  attention_decode(q32, k32, host_tensor({B, Tmax, Hkv, D}, DType::kF32, vc), len_h, want);
  attention_decode(q32, k32, host_tensor({B, Tmax, Hkv, D}, DType::kF32, abs_of(vc)), len_h, bound);
  const std::vector<double> w = values_of(want), bnd = values_of(bound);
  const Tensor qd = host_tensor({B, Tq, H, D}, DType::kBF16, q).to(Device::kCuda);
  const Tensor kd = host_tensor({B, Tmax, Hkv, D}, DType::kBF16, kc).to(Device::kCuda);
  const Tensor vd = host_tensor({B, Tmax, Hkv, D}, DType::kBF16, vc).to(Device::kCuda);
  const Tensor ld = len_h.to(Device::kCuda);
  // Without a workspace: one CTA per (b, kv head, 16 rows). With one: the cache is split over
  // CTAs (every case below launches few enough CTAs to split) and merged by the last CTA; the
  // repeated calls on one workspace also check that its counters are left at zero.
  AttentionDecodeWorkspace ws(Device::kCuda);
  for (bool split : {false, true}) {
    SCOPED_TRACE(split ? "split-cache kernel (workspace)" : "one CTA per group (no workspace)");
    AttentionOptions o;
    if (split) o.decode_workspace = &ws;
    std::vector<uint8_t> first;
    for (uint8_t poison : kPoisons) {
      Guarded out = Guarded::make({B, Tq, H, D}, DType::kBF16, poison);
      attention_decode(qd, kd, vd, ld, out.view, o);
      device_synchronize();
      ASSERT_EQ(out.damaged_guard_bytes(), 0) << "decode out: write outside the tensor";
      ASSERT_TRUE(all_close(out.values(), w, [&](int64_t i) { return std::ldexp(bnd[(size_t)i], -7) + 1e-6; },
                            "decode out"));
      if (first.empty()) first = bytes_of(out.view);
      else ASSERT_TRUE(first == bytes_of(out.view)) << "decode not deterministic";
    }
  }
}

TEST_F(OpsAttentionCuda, DecodeMatchesTheReference) {
  check_decode(3, 300, 8, 2, 64, 1, {300, 77, 1}, 5000);
  if (HasFatalFailure()) return;
  check_decode(3, 300, 8, 2, 128, 3, {300, 65, 2}, 5010);  // sequence 2: one padding row
  if (HasFatalFailure()) return;
  check_decode(2, 130, 16, 1, 64, 2, {129, 64}, 5020);     // 32 query rows: two CTAs per head
  if (HasFatalFailure()) return;
  check_decode(2, 40, 4, 4, 128, 5, {0, 40}, 5030);        // sequence 0: empty, all padding
  if (HasFatalFailure()) return;
  // Llama-1.1B's attention at batch 1 (4 kv heads of 8 query heads): 16 splits of one tile.
  check_decode(1, 1000, 32, 4, 64, 1, {777}, 5040);
  if (HasFatalFailure()) return;
  // Splits past a short sequence's end (no key reaches those rows), and a padding row.
  check_decode(2, 600, 16, 2, 128, 2, {600, 1}, 5050);
  if (HasFatalFailure()) return;
  check_decode(1, 257, 4, 1, 64, 1, {0}, 5060);  // empty cache: zero output from every split
}

}  // namespace
}  // namespace fourbit::ops
