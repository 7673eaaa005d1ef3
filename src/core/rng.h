// Counter-based random numbers: Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC'11), identical on the CPU and the GPU.
//
// A draw is a pure function of (seed, stream, counter): no state advances, so any element's random
// bits can be recomputed anywhere. fourbit keys streams by what is being randomized (for
// stochastic rounding: step, tensor id and orientation; see quant/quantize.h) and counters by the
// element index, so the CPU reference replays the GPU's exact draws.
#pragma once

#include "core/hd.h"

#include <cstdint>

namespace fourbit {

struct Philox4x32Result {
  uint32_t v[4];
};

FOURBIT_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  hi = (uint32_t)(p >> 32);
  lo = (uint32_t)p;
}

// Philox-4x32 with 10 rounds. counter = (c0, c1, c2, c3), key = (k0, k1).
FOURBIT_HD Philox4x32Result philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                          uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, hi0, lo0);
    philox_mulhilo(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n1 = lo1;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    const uint32_t n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// A named source of random bits: seed and stream pick the sequence, the counter indexes it.
struct RandomStream {
  uint64_t seed = 0;
  uint64_t stream = 0;

  // 128 random bits at position `counter` of this stream.
  FOURBIT_HD Philox4x32Result block(uint64_t counter) const {
    return philox4x32_10((uint32_t)counter, (uint32_t)(counter >> 32), (uint32_t)stream,
                         (uint32_t)(stream >> 32), (uint32_t)seed, (uint32_t)(seed >> 32));
  }
  // Random byte number `index` of the stream (16 bytes per Philox block, byte j of the block is
  // bits 8*(j%4) .. 8*(j%4)+7 of word j/4).
  FOURBIT_HD uint32_t byte_at(uint64_t index) const {
    const Philox4x32Result r = block(index >> 4);
    const uint32_t j = (uint32_t)(index & 15);
    return (r.v[j >> 2] >> (8 * (j & 3))) & 0xFFu;
  }
  // A uniform float in [0, 1) from word `index` (24 random bits).
  FOURBIT_HD float uniform_at(uint64_t index) const {
    const Philox4x32Result r = block(index >> 2);
    return (float)(r.v[index & 3] >> 8) * (1.0f / 16777216.0f);
  }
};

// Deterministic stream ids: mixes a (step, tensor id, purpose) triple into 64 bits.
FOURBIT_HD uint64_t make_stream_id(uint64_t step, uint32_t tensor_id, uint32_t purpose) {
  return (step << 24) ^ ((uint64_t)tensor_id << 4) ^ (uint64_t)(purpose & 0xF);
}

}  // namespace fourbit
