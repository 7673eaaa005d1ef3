// What the safetensors fuzz target does with one input, shared with the cpu test that replays the
// corpus (test_io_safetensors_corpus.cpp), so that a crash found by the fuzzer also fails the
// ordinary test suite once its input is in the corpus.
//
// The reader must either accept the bytes or throw fourbit::Error. An accepted file is then used
// the way a caller would, and nothing of that may fail: every tensor's bytes read, looked up by
// name, copied into a fourbit Tensor where the dtype and rank allow; the file written back with
// the writer must read back identically. Any exception there (std::logic_error for a broken
// invariant), a crash, an out-of-bounds read (ASan) or undefined behaviour (UBSan) is a bug.
#pragma once

#include "core/error.h"
#include "io/safetensors.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>

namespace fourbit::io::fuzz {

// Returns true when the reader accepted the bytes; throws on a bug.
inline bool exercise_safetensors(std::span<const uint8_t> bytes) {
  std::optional<SafetensorsFile> parsed;
  try {
    parsed.emplace(SafetensorsFile::from_bytes(bytes, "<fuzz input>"));
  } catch (const Error&) {
    return false;  // rejected, with a message
  }
  const SafetensorsFile& f = *parsed;
  SafetensorsWriter again;
  for (const auto& [k, v] : f.metadata()) again.set_metadata(k, v);
  volatile uint64_t checksum = 0;
  for (const StTensor& t : f.tensors()) {
    uint64_t sum = 0;
    for (uint8_t b : t.bytes) sum += b;  // every byte of every tensor is readable
    checksum = checksum + sum;
    if (f.find(t.name) != &t) throw std::logic_error("lookup by name found another tensor");
    if (to_fourbit_dtype(t.dtype) && t.shape.size() <= (size_t)kMaxDims &&
        t.bytes.size() <= (size_t{1} << 20)) {
      const Tensor copy = f.to_tensor(t.name);
      if (copy.nbytes() != (int64_t)t.bytes.size() ||
          (copy.nbytes() > 0 && std::memcmp(copy.data(), t.bytes.data(), t.bytes.size()) != 0)) {
        throw std::logic_error("to_tensor changed the bytes");
      }
    }
    if (!t.name.empty()) again.add(t.name, t.dtype, t.shape, t.bytes);  // the writer refuses ""
  }
  // Round trip: what the writer makes of an accepted file must read back the same.
  const std::vector<uint8_t> rewritten = again.serialize();
  const SafetensorsFile g = SafetensorsFile::from_bytes(rewritten, "<rewritten>");
  if (g.metadata() != f.metadata()) throw std::logic_error("the rewritten metadata differs");
  for (const StTensor& t : g.tensors()) {
    const StTensor& o = f.get(t.name);
    if (o.dtype != t.dtype || o.shape != t.shape || o.bytes.size() != t.bytes.size() ||
        (!t.bytes.empty() && std::memcmp(o.bytes.data(), t.bytes.data(), t.bytes.size()) != 0)) {
      throw std::logic_error("the rewritten tensor " + t.name + " differs");
    }
  }
  return true;
}

}  // namespace fourbit::io::fuzz
