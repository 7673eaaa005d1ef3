// Tensors: a non-owning view (data, dtype, shape, strides, device) and an owning Tensor.
//
// Shapes are row-major, outermost first (as in PyTorch); strides count elements. Views are cheap
// values passed to kernels and ops; Tensor owns its storage through a shared pointer and converts
// to a view. Host storage is 64-byte aligned; device storage comes from the stream-ordered pool (256-byte
// aligned). Quantized formats are bundles of several tensors (see quant/quantized_tensor.h).
#pragma once

#include "core/check.h"
#include "core/dtype.h"

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

namespace fourbit {

enum class Device : uint8_t { kCpu, kCuda };
constexpr std::string_view device_name(Device d) { return d == Device::kCpu ? "cpu" : "cuda"; }

constexpr int kMaxDims = 6;

struct Shape {
  std::array<int64_t, kMaxDims> dims{};
  int ndim = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  int64_t operator[](int i) const { return dims[i < 0 ? i + ndim : i]; }
  int64_t& operator[](int i) { return dims[i < 0 ? i + ndim : i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "(4, 16)"
};

Shape contiguous_strides(const Shape& shape);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Shape strides;  // in elements
  Device device = Device::kCpu;

  static TensorView contiguous(void* data, DType dtype, Shape shape, Device device);

  int64_t numel() const { return shape.numel(); }
  int64_t nbytes() const { return dtype_bytes(dtype, numel()); }  // of a contiguous tensor
  bool is_contiguous() const;
  // The tensor viewed as a matrix [rows, cols] with cols = the last dimension.
  int64_t cols() const { return shape.ndim == 0 ? 1 : shape[-1]; }
  int64_t rows() const { return shape.ndim == 0 ? 1 : numel() / shape[-1]; }

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  std::string describe() const;  // "bf16 (4, 16) on cuda"
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, Device device);
  static Tensor zeros(Shape shape, DType dtype, Device device);
  // A tensor over memory owned by `storage` (e.g. a region of a larger allocation).
  static Tensor alias(const TensorView& view, std::shared_ptr<void> storage);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  void* data() const { return view_.data; }
  template <typename T>
  T* ptr() const { return view_.ptr<T>(); }
  DType dtype() const { return view_.dtype; }
  const Shape& shape() const { return view_.shape; }
  Device device() const { return view_.device; }
  int64_t numel() const { return view_.numel(); }
  int64_t nbytes() const { return view_.nbytes(); }
  // False for a default-constructed Tensor (an absent optional output such as MXFP8's amax).
  bool defined() const { return storage_ != nullptr; }

  // A contiguous copy on `device`.
  Tensor to(Device device) const;

 private:
  TensorView view_;
  std::shared_ptr<void> storage_;
};

// Copies a contiguous tensor into another of the same dtype and size; any pair of devices.
void copy_tensor(const TensorView& dst, const TensorView& src);
// Fills the bytes of a contiguous tensor with `byte` (used to poison outputs in tests).
void fill_bytes(const TensorView& dst, uint8_t byte);

// Raw allocation helpers (used by Tensor and Arena).
std::shared_ptr<void> allocate_bytes(int64_t bytes, Device device);

}  // namespace fourbit
