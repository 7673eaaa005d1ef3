// ops attention (cpu): the shared-memory layout of the warpgroup-MMA attention kernels. For every
// operand the kernels hand to wgmma (attention_kernels.cu), each element that the instruction reads
// through its descriptor, by the PTX ISA's canonical 128-byte-swizzle layouts ("Shared Memory Matrix
// Layout": K-major ((8,m),(T,2k)):((8T,SBO),(1,T)), MN-major ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)),
// T = 8 bf16 elements, then Swizzle<3,4,3> on the byte address), must be the element that
// the swizzled load_tile stored at that address. A wrong stride, a swapped LBO/SBO or a wrong k-step
// offset reads another element and fails here without a GPU.
#include "core/wgmma.cuh"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace fourbit::wgmma {
namespace {

constexpr uint32_t kTileBase = 17 * 1024;  // any 1024-byte-aligned shared address

struct Decoded {
  uint32_t start, lbo, sbo, base_offset, swizzle_mode;
};

Decoded decode(uint64_t d) {
  return {(uint32_t)(d & 0x3FFF) << 4, (uint32_t)((d >> 16) & 0x3FFF) << 4, (uint32_t)((d >> 32) & 0x3FFF) << 4,
          (uint32_t)((d >> 49) & 7), (uint32_t)(d >> 62)};
}

uint32_t swizzle128(uint32_t byte_address) { return byte_address ^ (((byte_address >> 7) & 7) << 4); }

// Where wgmma reads element (mn, k) of the k-step (k < 16) described by d.
uint32_t k_major_address(const Decoded& d, int mn, int k) {
  const uint32_t elems = (uint32_t)((mn % 8) * 64 + (k % 8) + (k / 8) * 8);
  return swizzle128(d.start + 2 * elems + (uint32_t)(mn / 8) * d.sbo);
}
uint32_t mn_major_address(const Decoded& d, int mn, int k) {
  const uint32_t elems = (uint32_t)((mn % 8) + ((mn / 8) % 8) * 8 + (k % 8) * 64);
  return swizzle128(d.start + 2 * elems + (uint32_t)(mn / 64) * d.lbo + (uint32_t)(k / 8) * d.sbo);
}

// Where the swizzled load_tile (attention_kernels.cu) put element (row, col) of a [kRows, D] tile.
template <int kRows>
uint32_t stored_address(int row, int col) {
  return kTileBase + swizzled_offset<kRows>(row, col / 8) + 2 * (uint32_t)(col % 8);
}

// Mismatching elements when a [kRows, D] tile is read through the descriptors make(tile, kk):
// K-major (rows = M or N, the D columns = the reduction: D / 16 k-steps) or MN-major (the kRows
// rows = the reduction: kRows / 16 k-steps, the D columns = N).
enum class Major { kK, kMN };
template <int kRows, int D>
int mismatches(Major major, uint64_t (*make)(uint32_t, int)) {
  const bool k = major == Major::kK;
  const int k_steps = k ? D / 16 : kRows / 16, mn_extent = k ? kRows : D;
  int bad = 0;
  for (int kk = 0; kk < k_steps; ++kk) {
    const Decoded d = decode(make(kTileBase, kk));
    EXPECT_EQ(d.swizzle_mode, 1u);
    EXPECT_EQ(d.base_offset, 0u);
    for (int mn = 0; mn < mn_extent; ++mn)
      for (int e = 0; e < 16; ++e)
        bad += k ? k_major_address(d, mn, e) != stored_address<kRows>(mn, 16 * kk + e)
                 : mn_major_address(d, mn, e) != stored_address<kRows>(16 * kk + e, mn);
  }
  return bad;
}

// dK/dV, D 64: K and V (A, 64 keys), Q and dO (B of S^T and dP^T, 64 queries) K-major; dO and Q
// (B of dV and dK, N = D) MN-major.
TEST(OpsAttentionWgmmaLayout, DkdvHeadDim64) {
  EXPECT_EQ((mismatches<64, 64>(Major::kK, k_major<64>)), 0);
  EXPECT_EQ((mismatches<64, 64>(Major::kMN, mn_major<64>)), 0);
}

// dK/dV, D 128: two 64-column panels; 32-query tiles.
TEST(OpsAttentionWgmmaLayout, DkdvHeadDim128) {
  EXPECT_EQ((mismatches<64, 128>(Major::kK, k_major<64>)), 0);
  EXPECT_EQ((mismatches<32, 128>(Major::kK, k_major<32>)), 0);
  EXPECT_EQ((mismatches<32, 128>(Major::kMN, mn_major<32>)), 0);
}

// dQ and the forward: Q, dO (A) and K, V (B of S and dP) K-major over 64 rows; K (B of dQ) and V
// (B of O) MN-major with N = D.
TEST(OpsAttentionWgmmaLayout, DqAndForward) {
  EXPECT_EQ((mismatches<64, 64>(Major::kK, k_major<64>)), 0);
  EXPECT_EQ((mismatches<64, 64>(Major::kMN, mn_major<64>)), 0);
  EXPECT_EQ((mismatches<64, 128>(Major::kK, k_major<64>)), 0);
  EXPECT_EQ((mismatches<64, 128>(Major::kMN, mn_major<64>)), 0);
}

// The check can fail: LBO and SBO swapped, or a k-step offset of one 16-byte chunk instead of two,
// address other elements.
uint64_t swapped_strides(uint32_t tile, int kk) { return descriptor(tile + (uint32_t)(kk * 2048), 1024, 64 * 128); }
uint64_t short_k_step(uint32_t tile, int kk) {
  return descriptor(tile + (uint32_t)((kk >> 2) * 64 * 128 + (kk & 3) * 16), 16, 1024);
}
TEST(OpsAttentionWgmmaLayout, WrongDescriptorsAreCaught) {
  EXPECT_GT((mismatches<64, 128>(Major::kMN, swapped_strides)), 0);
  EXPECT_GT((mismatches<64, 64>(Major::kK, short_k_step)), 0);
}

// k_major and mn_major build one descriptor a tile and advance it per k-step (wgmma::advance): the
// same 64 bits as the descriptor of each k-step's own address, for every tile shape the kernels use
// at every 1024-aligned address where the tile fits in an SM's 228 KB of shared memory. Past 2^18
// bytes the address field would carry into the next one: the check sees that.
template <int kRows, int D>
int advanced_mismatches(uint32_t tile) {
  int bad = 0;
  for (int kk = 0; kk < D / 16; ++kk)
    bad += k_major<kRows>(tile, kk) !=
           descriptor(tile + (uint32_t)((kk >> 2) * kRows * 128 + (kk & 3) * 32), 16, 1024);
  for (int kk = 0; kk < kRows / 16; ++kk)
    bad += mn_major<kRows>(tile, kk) != descriptor(tile + (uint32_t)(kk * 2048), kRows * 128, 1024);
  return bad;
}
template <int kRows, int D>
int advanced_mismatches_everywhere() {
  constexpr uint32_t kSmem = 228 * 1024, kTileBytes = kRows * D * 2;
  int bad = 0;
  for (uint32_t tile = 0; tile + kTileBytes <= kSmem; tile += 1024) bad += advanced_mismatches<kRows, D>(tile);
  return bad;
}
TEST(OpsAttentionWgmmaLayout, AdvancedDescriptorsEqualTheDirectOnes) {
  EXPECT_EQ((advanced_mismatches_everywhere<64, 64>()), 0);
  EXPECT_EQ((advanced_mismatches_everywhere<64, 128>()), 0);
  EXPECT_EQ((advanced_mismatches_everywhere<32, 128>()), 0);
  EXPECT_GT((advanced_mismatches<64, 128>((1u << 18) - 1024)), 0);
}

}  // namespace
}  // namespace fourbit::wgmma
