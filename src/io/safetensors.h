// safetensors (https://github.com/huggingface/safetensors): the tensor file format of checkpoints
// and of Hugging Face exports.
//
// Layout: an 8-byte little-endian header length N; N bytes of UTF-8 JSON, an object mapping each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} plus an optional "__metadata__"
// string->string map; then the data section, row-major little-endian tensors, offsets relative
// to its start.
//
// The writer follows the reference implementation: tensors sorted by element size (largest first),
// then by name, packed without gaps; the header padded with spaces so that the data section starts
// at a multiple of 8 bytes, which aligns every tensor to its element size (the format allows no
// padding between tensors). It writes atomically (io/atomic_file.h).
//
// The reader trusts nothing: it checks the file length, the header length (at most 100 MB, as the
// reference), UTF-8, that the header is one JSON object starting with '{' (no duplicate keys, no
// nesting beyond what the format has), every entry's dtype, shape (non-negative integers whose
// product times the element size does not overflow), data_offsets (begin <= end, end - begin =
// the tensor's byte size), and that the tensors tile the data section exactly (no overlap, no
// hole, nothing after the last tensor: the spec's rule against polyglot files). Every rejection
// is a fourbit::Error naming the file, the tensor and what is wrong. Nothing is read from the
// data section before the header has been validated.
#pragma once

#include "core/dtype.h"
#include "core/tensor.h"
#include "io/atomic_file.h"

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fourbit::io {

// Element types of the safetensors format (its names: "F32", "F8_E4M3", ...). Sub-byte types
// (F4, F6_*) are packed: a tensor's element count times the bit width must be a whole number of
// bytes.
enum class StDType : uint8_t {
  kBool, kU8, kI8, kF8E5M2, kF8E4M3, kF8E8M0, kF4, kF6E2M3, kF6E3M2,
  kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64, kC64,
};

std::string_view st_dtype_name(StDType t);  // "F32"
int st_dtype_bits(StDType t);              // 32
std::optional<StDType> st_dtype_from_name(std::string_view name);
// The fourbit element type of a safetensors type, if fourbit tensors hold it (BOOL, I8, I16,
// U64, C64 and F6 do not); F4 is fourbit's packed kE2M1x2 (low nibble first).
std::optional<DType> to_fourbit_dtype(StDType t);
StDType from_fourbit_dtype(DType t);  // every fourbit dtype has one

constexpr int64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// ------------------------------------------------------------------------------------------------
// Writer

class SafetensorsWriter {
 public:
  // Adds a tensor whose bytes stay owned by the caller until write()/serialize() returns.
  // `bytes` must hold exactly the tensor's size (numel * bits / 8).
  void add(std::string name, StDType dtype, std::vector<int64_t> shape,
           std::span<const uint8_t> bytes);
  // Adds a contiguous CPU tensor (borrowed, as above).
  void add(std::string name, const TensorView& tensor);
  void set_metadata(std::string key, std::string value);

  // Writes the file atomically; on any error the previous file at `path` is untouched.
  void write(const std::string& path, const AtomicWriteOptions& options = {}) const;
  // The whole file in memory (tests, the fuzz corpus).
  std::vector<uint8_t> serialize() const;
  // The 8-byte length plus the padded JSON header; the data section follows it.
  std::string header_bytes() const;

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    std::span<const uint8_t> bytes;
  };
  std::vector<const Entry*> ordered() const;

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// ------------------------------------------------------------------------------------------------
// Reader

// One tensor of a file: its type, shape and bytes (a view into the file's mapping).
struct StTensor {
  std::string name;
  StDType dtype = StDType::kU8;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;

  int64_t numel() const;
  std::string shape_str() const;  // "[2, 3]"
};

class SafetensorsFile {
 public:
  // Memory-maps and validates a file.
  static SafetensorsFile open(const std::string& path);
  // Validates bytes already in memory; `bytes` must outlive the returned object and its views.
  // `name` stands for the file in error messages.
  static SafetensorsFile from_bytes(std::span<const uint8_t> bytes, std::string name = "<memory>");

  const std::string& path() const { return path_; }
  // All tensors, in the order of their data offsets.
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(std::string_view name) const { return find(name) != nullptr; }
  const StTensor* find(std::string_view name) const;
  // Throws an Error naming the file and the tensor when absent.
  const StTensor& get(std::string_view name) const;

  // A new CPU tensor holding a copy of the named tensor (its fourbit dtype, same shape).
  Tensor to_tensor(std::string_view name) const;
  // Copies the named tensor into `dst` (contiguous, on any device), which must have the same
  // fourbit dtype and shape; the error says which differs.
  void copy_into(std::string_view name, const TensorView& dst) const;

 private:
  void parse();

  std::string path_;
  std::shared_ptr<const uint8_t> keep_alive_;  // the mapping, when opened from a file
  std::span<const uint8_t> bytes_;             // the whole file
  std::vector<StTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace fourbit::io
