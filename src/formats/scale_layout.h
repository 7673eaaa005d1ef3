// Scale-factor layouts that GEMM libraries expect, as index functions (host and device).
//
// Blackwell block-scaled GEMMs (cuBLASLt VEC16_UE4M3 / VEC32_UE8M0) read scales in a "swizzled
// 128x4" layout (NUMERICS 7.3): the logical scale matrix S[R][C] (R = rows of the operand, C =
// K / block) is padded to Rp = roundup(R, 128), Cp = roundup(C, 4), cut into 128x4 tiles stored
// row-major by (tile_row, tile_col), 512 bytes each, entry (i, j) of a tile at byte
// (i % 32) * 16 + (i / 32) * 4 + j. No Blackwell path exists yet: this index is the layout
// contract, tested on the CPU against NUMERICS 9.10.
#pragma once

#include "core/hd.h"

#include <cstdint>

namespace fourbit::formats {

FOURBIT_HD int64_t swizzled_scale_index(int64_t r, int64_t c, int64_t padded_cols) {
  return ((r / 128) * (padded_cols / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
         (c % 4);
}

FOURBIT_HD int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace fourbit::formats
