// Bits that the CUDA ops OR into a caller's device error flag (an `int` in device memory).
//
// A kernel cannot throw, so an op that can meet invalid data on the device (an out-of-range token
// id or target, a NaN) sets a bit instead and carries on with a defined result (documented per
// op). Ops that take `int* error_flag`:
//   - null: the op uses a process-wide internal flag, waits for the stream and throws
//     fourbit::Error naming the op and the problem (one synchronization per call);
//   - a device int: the op only ORs bits into it, asynchronously; the caller reads it once per
//     step (e.g. with read_and_clear_error_flag, ops/elementwise.h) and reports.
// The same int can also serve the quantizers: bit 0 means the same thing there
// (quant::kDeviceErrNonFinite). Plain constants, so that .cu files can include this header.
#pragma once

namespace fourbit::ops {

inline constexpr int kErrNonFinite = 1;             // a NaN or Inf was found (== quant's bit 0)
inline constexpr int kErrIndexOutOfRange = 1 << 4;  // a token id / target outside [0, V)

}  // namespace fourbit::ops
