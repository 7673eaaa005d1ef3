// `fourbit bench quant`: every CUDA quantize kernel on an LLM-sized BF16 tensor, against the
// device-to-device copy bandwidth measured in the same run (../shared/docs/BENCHMARKS.md).
//
// Bytes are what the kernel sequence must move at least: the source read once per pass (the
// NVFP4 and FP8-tensor global-amax pass reads it a second time, and is counted), every output
// written once. Times are medians over `reps` runs, each timed with CUDA events; the source
// (16384 x 8192 BF16 = 256 MiB by default) is four times the L2 cache.
#include "quant/bench.h"

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "quant/quantize.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <vector>

namespace fourbit::quant {

namespace {

class EventTimer {
 public:
  EventTimer() {
    FOURBIT_CUDA_CHECK(cudaEventCreate(&start_));
    FOURBIT_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Median milliseconds of `reps` timed runs of fn, after 3 warm-up runs.
  double median_ms(int reps, const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();
    FOURBIT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<double> ms;
    for (int i = 0; i < reps; ++i) {
      FOURBIT_CUDA_CHECK(cudaEventRecord(start_));
      fn();
      FOURBIT_CUDA_CHECK(cudaEventRecord(stop_));
      FOURBIT_CUDA_CHECK(cudaEventSynchronize(stop_));
      float t = 0;
      FOURBIT_CUDA_CHECK(cudaEventElapsedTime(&t, start_, stop_));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

 private:
  cudaEvent_t start_, stop_;
};

struct BenchCase {
  std::string name;
  QuantConfig config;
  Orientations orientations;
  bool packed = true;
  bool bf16_scaled = false;
  bool amax_given = false;
  // The training Fprop's X pass (gemm::linear_fprop_saving_x): the row-wise copy as scaled-domain
  // BF16 only, the column-wise one packed only (packed and bf16_scaled are ignored).
  bool row_bf16_col_packed = false;
};

double output_bytes(const QuantConfig& c, int64_t rows, int64_t cols, const BenchCase& bc) {
  const double n = (double)rows * cols;
  const int orientations = (bc.orientations.rowwise ? 1 : 0) + (bc.orientations.colwise ? 1 : 0);
  double packed = 0;
  switch (c.format) {
    case Format::kNvfp4: packed = n / 2 + n / 16; break;
    case Format::kMxfp8: packed = n + n / 32; break;
    case Format::kFp8Block: packed = n + (c.block_2d ? 4.0 * n / (128 * 128) : 4.0 * n / 128); break;
    case Format::kFp8Tensor: packed = n; break;
  }
  if (bc.row_bf16_col_packed) return 2 * n + packed;
  double per = 0;
  if (bc.packed) per += packed;
  if (bc.bf16_scaled) per += 2 * n;
  return per * orientations;
}

std::vector<BenchCase> bench_cases() {
  std::vector<BenchCase> v;
  QuantConfig c;
  v.push_back({"nvfp4 1x16 row+col", c, {true, true}});
  v.push_back({"nvfp4 1x16 row+col (amax given)", c, {true, true}, true, false, true});
  v.push_back({"nvfp4 1x16 row", c, {true, false}});
  QuantConfig grad = c;
  grad.rounding = Rounding::kStochastic;
  grad.rht = true;
  v.push_back({"nvfp4 grad: row sr + col rht sr", grad, {true, true}});
  v.push_back({"nvfp4 grad: row sr + col rht sr (amax given)", grad, {true, true}, true, false, true});
  // What a training step runs for each NVFP4 linear (one orientation a call, scaled-domain BF16
  // for the emulated GEMM): Dgrad's dY, Wgrad's dY and Wgrad's X.
  v.push_back({"nvfp4 dgrad dy: row sr -> bf16", grad, {true, false}, false, true});
  v.push_back({"nvfp4 wgrad dy: col rht sr -> bf16", grad, {false, true}, false, true});
  QuantConfig rht = c;
  rht.rht = true;
  v.push_back({"nvfp4 wgrad x: col rht -> bf16", rht, {false, true}, false, true});
  // The same operands as one training step now quantizes them (gemm/linear.h): dY once for Dgrad
  // and Wgrad (both copies BF16), X once in the Fprop (row-wise BF16, column-wise packed and kept).
  v.push_back({"nvfp4 train dy: row sr + col rht sr -> bf16", grad, {true, true}, false, true});
  v.push_back({"nvfp4 train dy (amax given)", grad, {true, true}, false, true, true});
  v.push_back({"nvfp4 train x: row -> bf16, col rht packed", rht, {true, true}, true, false, false, true});
  v.push_back({"nvfp4 train x (amax given)", rht, {true, true}, true, false, true, true});
  QuantConfig w = c;
  w.block_2d = true;
  v.push_back({"nvfp4 16x16 weight row+col", w, {true, true}});
  QuantConfig c46 = c;
  c46.nvfp4_scale_rule = Nvfp4ScaleRule::kFourOverSix;
  v.push_back({"nvfp4 4/6 row", c46, {true, false}});
  v.push_back({"nvfp4 qdq -> bf16 row", c, {true, false}, false, true});
  v.push_back({"nvfp4 qdq -> bf16 row (amax given)", c, {true, false}, false, true, true});
  v.push_back({"nvfp4 16x16 qdq -> bf16 row", w, {true, false}, false, true});
  v.push_back({"nvfp4 packed + bf16 row+col", c, {true, true}, true, true});
  QuantConfig mx;
  mx.format = Format::kMxfp8;
  v.push_back({"mxfp8 row+col", mx, {true, true}});
  v.push_back({"mxfp8 qdq -> bf16 row", mx, {true, false}, false, true});
  QuantConfig f8;
  f8.format = Format::kFp8Block;
  v.push_back({"fp8 1x128 row+col", f8, {true, true}});
  QuantConfig f82 = f8;
  f82.block_2d = true;
  v.push_back({"fp8 128x128 row+col", f82, {true, true}});
  QuantConfig ft;
  ft.format = Format::kFp8Tensor;
  v.push_back({"fp8 tensor row+col", ft, {true, true}});
  return v;
}

}  // namespace

std::vector<QuantBenchRow> run_quant_bench(const QuantBenchOptions& o) {
  const DeviceProperties props = current_device_properties();
  log_info("bench quant on {} ({} SMs, L2 {} MB): source {} x {} bf16, median of {} runs",
           props.name, props.multiprocessors, props.l2_bytes >> 20, o.rows, o.cols, o.reps);
  FOURBIT_CHECK(o.rows % 128 == 0 && o.cols % 128 == 0,
                "bench quant: --rows and --cols must be multiples of 128, got {} x {}", o.rows,
                o.cols);
  EventTimer timer;
  std::vector<QuantBenchRow> rows;
  const std::string shape = fmt::format("{}x{}", o.rows, o.cols);

  // Ceiling: device-to-device copy of a 1 GiB buffer (bytes read + written).
  const int64_t copy_bytes = 1ll << 30;
  Tensor a = Tensor::empty({copy_bytes}, DType::kU8, Device::kCuda);
  Tensor b = Tensor::empty({copy_bytes}, DType::kU8, Device::kCuda);
  fill_normal_cuda(TensorView::contiguous(a.data(), DType::kF32, {copy_bytes / 4}, Device::kCuda), 1, nullptr);
  const double copy_ms = timer.median_ms(o.reps, [&] {
    FOURBIT_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), copy_bytes, cudaMemcpyDeviceToDevice));
  });
  const double copy_gbps = 2.0 * copy_bytes / (copy_ms * 1e6);
  rows.push_back({"device-to-device copy (ceiling)", "1 GiB", copy_ms, 2.0 * copy_bytes, copy_gbps, 1.0});
  a = Tensor();
  b = Tensor();

  Tensor src = Tensor::empty({o.rows, o.cols}, DType::kBF16, Device::kCuda);
  fill_normal_cuda(src.view(), 7, nullptr);
  Tensor bf16_row = Tensor::empty({o.rows, o.cols}, DType::kBF16, Device::kCuda);
  Tensor bf16_col = Tensor::empty({o.cols, o.rows}, DType::kBF16, Device::kCuda);
  Tensor flag = Tensor::zeros({1}, DType::kI32, Device::kCuda);
  Tensor amax = Tensor::empty({2}, DType::kF32, Device::kCuda);
  amax_cuda(src.view(), amax.ptr<float>(), amax.ptr<float>() + 1, true, kRhtFixedSignMask,
            flag.ptr<int>(), nullptr);

  const double src_bytes = 2.0 * (double)o.rows * o.cols;
  for (const BenchCase& bc : bench_cases()) {
    if (!o.only.empty() && bc.name.find(o.only) == std::string::npos) continue;
    QuantizedTensor q = allocate_quantized(bc.config, o.rows, o.cols, bc.orientations, Device::kCuda);
    if (bc.row_bf16_col_packed) {  // no packed row-wise output (see quantize.h)
      q.rowwise->data = Tensor();
      q.rowwise->scales = Tensor();
    }
    CudaQuantizeOptions co;
    co.tensor_name = bc.name;
    co.sr = RandomStream{1, 2};
    co.nonfinite_flag = flag.ptr<int>();
    co.write_packed = bc.packed || bc.row_bf16_col_packed;
    co.write_bf16_scaled = bc.bf16_scaled || bc.row_bf16_col_packed;
    if (bc.amax_given) {
      co.given_rowwise_amax = amax.ptr<float>();
      co.given_colwise_amax = amax.ptr<float>() + 1;
    }
    const TensorView row_view = bf16_row.view(), col_view = bf16_col.view();
    const double ms = timer.median_ms(o.reps, [&] {
      quantize_cuda(src.view(), q, co, &row_view, bc.row_bf16_col_packed ? nullptr : &col_view);
    });
    const bool amax_pass = !bc.amax_given && (bc.config.format == Format::kNvfp4 ||
                                              bc.config.format == Format::kFp8Tensor);
    const double bytes = src_bytes * (amax_pass ? 2 : 1) + output_bytes(bc.config, o.rows, o.cols, bc);
    const double gbps = bytes / (ms * 1e6);
    rows.push_back({bc.name, shape, ms, bytes, gbps, gbps / copy_gbps});
  }
  // The global amax pass alone (no RHT), which the NVFP4 rows above without "(amax given)" include.
  Tensor amax_out = Tensor::empty({1}, DType::kF32, Device::kCuda);
  const double amax_ms = timer.median_ms(o.reps, [&] {
    amax_cuda(src.view(), amax_out.ptr<float>(), nullptr, false, 0, flag.ptr<int>(), nullptr);
  });
  rows.push_back({"global amax pass (read only)", shape, amax_ms, src_bytes, src_bytes / (amax_ms * 1e6),
                  src_bytes / (amax_ms * 1e6) / copy_gbps});
  // With RHT: the plain and the post-RHT column-wise amax in one read (what the RHT rows include).
  Tensor amax2_out = Tensor::empty({2}, DType::kF32, Device::kCuda);
  const double rht_amax_ms = timer.median_ms(o.reps, [&] {
    amax_cuda(src.view(), amax2_out.ptr<float>(), amax2_out.ptr<float>() + 1, true, kRhtFixedSignMask,
              flag.ptr<int>(), nullptr);
  });
  rows.push_back({"global amax pass with rht (read only)", shape, rht_amax_ms, src_bytes,
                  src_bytes / (rht_amax_ms * 1e6), src_bytes / (rht_amax_ms * 1e6) / copy_gbps});
  int host_flag = 0;
  FOURBIT_CUDA_CHECK(cudaMemcpy(&host_flag, flag.data(), sizeof(int), cudaMemcpyDeviceToHost));
  FOURBIT_CHECK(host_flag == 0, "bench quant: the kernels flagged errors ({}) on random data", host_flag);

  std::printf("%-40s %-12s %9s %10s %9s %8s\n", "kernel", "shape", "ms", "MB moved", "GB/s", "of copy");
  for (const QuantBenchRow& r : rows) {
    std::printf("%-40s %-12s %9.4f %10.1f %9.1f %7.1f%%\n", r.name.c_str(), r.shape.c_str(), r.ms,
                r.bytes / 1e6, r.gbps, 100 * r.fraction_of_copy);
  }
  std::printf("(torch.compile NVFP4 quantize+dequantize anchor, BENCHMARKS.md: 0.98 ms; target: "
              ">= 5x faster, i.e. <= 0.196 ms at 16384x8192)\n");
  if (!o.csv_path.empty()) {
    std::ofstream f(o.csv_path);
    FOURBIT_CHECK(f.good(), "bench quant: cannot write '{}'", o.csv_path);
    f << "kernel,shape,ms,bytes,gbps,fraction_of_copy\n";
    for (const QuantBenchRow& r : rows) {
      f << '"' << r.name << "\"," << r.shape << ',' << r.ms << ',' << r.bytes << ',' << r.gbps
        << ',' << r.fraction_of_copy << '\n';
    }
  }
  return rows;
}

}  // namespace fourbit::quant
