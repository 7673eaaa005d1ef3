#!/usr/bin/env python3
"""Write element-codec test vectors computed with ml_dtypes (the independent reference of
../shared/docs/NUMERICS.md section 8) for tests/test_formats_ml_dtypes.cpp.

Usage:  python3 tools/ml_dtypes_vectors.py OUTPUT_PATH
Needs:  pip install ml_dtypes numpy

ctest runs this as the fixture `gen_ml_dtypes_vectors` (tests/CMakeLists.txt), writing
<build dir>/ml_dtypes_vectors.bin. The file records ml_dtypes' raw answers, quirks included; the
C++ test decides how each documented quirk is compared (NUMERICS.md sections 1.3 and 8).

File layout (all integers little-endian):
  magic      8 bytes  b"FBMLDV01"
  meta_len   u32      length of the ASCII meta string that follows (library versions)
  meta       meta_len bytes
  n_sections u32
  n_sections times:
    name      16 bytes, ASCII, NUL-padded
    count     u32      number of records
    in_bytes  u32      bytes per input
    out_bytes u32      bytes per output
    inputs    count * in_bytes bytes
    outputs   count * out_bytes bytes
Sections:
  decode_e2m1 / decode_e4m3 / decode_e5m2 / decode_e8m0:
      input u8 code (every code: 16 for E2M1, 256 otherwise), output u32 = float32 bits of
      code.astype(float32).
  encode:
      input u32 = float32 bits x, output 8 bytes:
        [0] u8  x.astype(float4_e2m1fn)                  (one code per byte, bits 3..0)
        [1] u8  x.astype(float8_e4m3fn)                  (non-saturating)
        [2] u8  clip(x, -448, 448).astype(float8_e4m3fn) (pre-clamped = saturating)
        [3] u8  x.astype(float8_e5m2)                    (non-saturating)
        [4] u8  clip(x, -57344, 57344).astype(float8_e5m2)
        [5] u8  x.astype(float8_e8m0fnu)
        [6] u16 x.astype(bfloat16)
"""
import struct
import sys

MAGIC = b"FBMLDV01"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_path = sys.argv[1]
    try:
        import numpy as np
        import ml_dtypes as md
    except ImportError as e:  # the C++ test fails on the missing file and says the same
        print(f"ml_dtypes_vectors.py: {e}; install the reference with: "
              f"pip install ml_dtypes numpy", file=sys.stderr)
        return 1

    f32, u32, u16, u8 = np.float32, np.uint32, np.uint16, np.uint8
    rng = np.random.default_rng(0x4B17)

    def from_bits(b):
        return np.asarray(b, dtype=u32).view(f32)

    def bits_of(x):
        return np.asarray(x, dtype=f32).view(u32)

    def decode_all(dtype, ncodes):
        codes = np.arange(ncodes, dtype=u8)
        return codes, codes.view(dtype).astype(f32).view(u32)

    formats = {
        "e2m1": (md.float4_e2m1fn, 16),
        "e4m3": (md.float8_e4m3fn, 256),
        "e5m2": (md.float8_e5m2, 256),
        "e8m0": (md.float8_e8m0fnu, 256),
    }

    # ---------------------------------------------------------------- encode inputs (float32 bits)
    parts = []
    # 1. Every BF16 bit pattern widened to FP32 (includes +-0, +-Inf, NaNs, FP32/BF16 subnormals).
    all_bf16 = np.arange(1 << 16, dtype=u32) << 16
    parts.append(all_bf16)
    # 2. BF16 midpoints: between adjacent positive BF16 codes c and c+1 the FP32 midpoint has bits
    #    (c << 16) | 0x8000 (c = 0x7F7F gives max + half ulp, the overflow threshold); plus both
    #    FP32 neighbours, both signs.
    c = np.arange(0, 0x7F80, dtype=u32)
    mid = (c << 16) | 0x8000
    bf16_mid = np.concatenate([mid, mid - 1, mid + 1])
    parts += [bf16_mid, bf16_mid | 0x80000000]

    # 3. Midpoints between adjacent values of each narrow format (including max and the next value
    #    the format would have above it: the overflow threshold) and their FP32 neighbours.
    def midpoint_set(values):
        v = np.unique(values[np.isfinite(values)].astype(np.float64))
        v = v[v >= 0]
        ulp_top = v[-1] - v[-2]
        v = np.append(v, v[-1] + ulp_top)  # virtual next value above max
        mids = ((v[:-1] + v[1:]) / 2).astype(f32)  # exact: one more significand bit
        assert np.all(mids.astype(np.float64) == (v[:-1] + v[1:]) / 2)
        m = np.concatenate([mids, v.astype(f32)])
        return np.concatenate([
            bits_of(m), bits_of(np.nextafter(m, f32(np.inf))), bits_of(np.nextafter(m, f32(0)))])

    for name in ("e2m1", "e4m3", "e5m2"):
        dt, n = formats[name]
        vals = np.arange(n, dtype=u8).view(dt).astype(np.float64)
        s = midpoint_set(vals)
        parts += [s, s | 0x80000000]
    # E8M0: powers of two 2^-127..2^127 and the significand midpoints 1.5 * 2^k (ml_dtypes rounds
    # on the significand, NUMERICS 1.3), plus neighbours, both signs (negatives are a quirk too).
    k = np.arange(-127, 128, dtype=np.float64)
    e8 = np.concatenate([np.exp2(k), 1.5 * np.exp2(k), [1.5 * 2.0**-128, 2.0**-128]]).astype(f32)
    e8 = np.concatenate([bits_of(e8), bits_of(np.nextafter(e8, f32(np.inf))),
                         bits_of(np.nextafter(e8, f32(0)))])
    parts += [e8, e8 | 0x80000000]

    # 4. Dense sweeps around saturation: e2m1 6..8, e4m3 448..480, e5m2 57344..61440 (and a bit
    #    beyond), BF16 near FLT_MAX; both signs.
    dense = np.concatenate([
        np.linspace(5.0, 8.5, 2048), np.linspace(440.0, 500.0, 2048),
        np.linspace(57000.0, 66000.0, 2048)]).astype(f32)
    dense = np.concatenate([bits_of(dense), np.arange(0x7F7F0000, 0x7F7F0000 + 2048, 7, dtype=u32),
                            np.arange(0x7F7F7F00, 0x7F7F8100, dtype=u32)])
    parts += [dense, dense | 0x80000000]

    # 5. Random FP32 values across the relevant exponent ranges of each format (random sign and
    #    mantissa), FP32 subnormals, and fully random bit patterns.
    def random_in_exponents(lo, hi, n):
        e = rng.integers(lo + 127, hi + 127 + 1, size=n, dtype=np.int64).astype(u32)
        m = rng.integers(0, 1 << 23, size=n, dtype=np.int64).astype(u32)
        s = rng.integers(0, 2, size=n, dtype=np.int64).astype(u32)
        return (s << 31) | (e << 23) | m

    parts += [
        random_in_exponents(-5, 4, 12000),     # e2m1: subnormal 0.5 = 2^-1, max 6
        random_in_exponents(-13, 10, 12000),   # e4m3: 2^-9 .. 448
        random_in_exponents(-20, 17, 12000),   # e5m2: 2^-16 .. 57344
        random_in_exponents(-126, 127, 12000),  # e8m0 and bf16: whole FP32 normal range
        (rng.integers(0, 2, 4000, dtype=np.int64).astype(u32) << 31)
        | rng.integers(1, 1 << 23, 4000, dtype=np.int64).astype(u32),  # FP32 subnormals
        rng.integers(0, 1 << 32, 12000, dtype=np.int64).astype(u32),   # anything
    ]
    # 6. Specials: signed zeros, infinities, NaNs of both signs with several payloads.
    parts.append(np.array([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
        0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000, 0xFFA00000, 0x00000001, 0x80000001,
        0x007FFFFF, 0x807FFFFF, 0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF], dtype=u32))

    inputs = np.unique(np.concatenate(parts).astype(u32))
    x = from_bits(inputs)

    # ---------------------------------------------------------------- ml_dtypes answers
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.zeros((inputs.size, 8), dtype=u8)
        out[:, 0] = x.astype(md.float4_e2m1fn).view(u8)
        out[:, 1] = x.astype(md.float8_e4m3fn).view(u8)
        out[:, 2] = np.clip(x, f32(-448), f32(448)).astype(md.float8_e4m3fn).view(u8)
        out[:, 3] = x.astype(md.float8_e5m2).view(u8)
        out[:, 4] = np.clip(x, f32(-57344), f32(57344)).astype(md.float8_e5m2).view(u8)
        out[:, 5] = x.astype(md.float8_e8m0fnu).view(u8)
        out[:, 6:8] = x.astype(md.bfloat16).view(u16).astype("<u2").view(u8).reshape(-1, 2)

    sections = []
    for name, (dt, n) in formats.items():
        codes, dec = decode_all(dt, n)
        sections.append(("decode_" + name, codes.tobytes(), 1, dec.astype("<u4").tobytes(), 4,
                         n))
    sections.append(("encode", inputs.astype("<u4").tobytes(), 4, out.tobytes(), 8,
                     inputs.size))

    meta = f"ml_dtypes={md.__version__} numpy={np.__version__}".encode("ascii")
    with open(out_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(meta)))
        f.write(meta)
        f.write(struct.pack("<I", len(sections)))
        for name, inb, in_bytes, outb, out_bytes, count in sections:
            f.write(name.encode("ascii").ljust(16, b"\0"))
            f.write(struct.pack("<III", count, in_bytes, out_bytes))
            f.write(inb)
            f.write(outb)
    print(f"ml_dtypes_vectors.py: wrote {out_path}: {inputs.size} encode inputs, "
          f"{sum(n for _, (_, n) in formats.items())} decode codes ({meta.decode()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
