// The collectives' bus-bandwidth benchmark (comm_bench.h).
#include "dist/comm_bench.h"

#include "core/check.h"
#include "formats/element.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <span>

namespace fourbit::dist {

namespace {

// Host values <-> a buffer of `dtype` on `device` (the values are small integers or their sums).
Tensor upload(const std::vector<double>& v, DType dtype, Device device) {
  const int64_t n = (int64_t)v.size();
  Tensor t = Tensor::empty({n}, dtype, device);
  if (n == 0) return t;
  if (dtype == DType::kF64) {
    copy_tensor(t.view(), TensorView::contiguous(const_cast<double*>(v.data()), dtype, {n}, Device::kCpu));
  } else if (dtype == DType::kF32) {
    std::vector<float> f(v.begin(), v.end());
    copy_tensor(t.view(), TensorView::contiguous(f.data(), dtype, {n}, Device::kCpu));
  } else {
    std::vector<uint16_t> b((size_t)n);
    for (size_t i = 0; i < b.size(); ++i) b[i] = formats::encode_bf16_rn((float)v[i]);
    copy_tensor(t.view(), TensorView::contiguous(b.data(), dtype, {n}, Device::kCpu));
  }
  return t;
}

std::vector<double> download(const Tensor& t) {
  const int64_t n = t.numel();
  std::vector<double> v((size_t)n);
  if (n == 0) return v;
  if (t.dtype() == DType::kF64) {
    copy_tensor(TensorView::contiguous(v.data(), t.dtype(), {n}, Device::kCpu), t.view());
  } else if (t.dtype() == DType::kF32) {
    std::vector<float> f((size_t)n);
    copy_tensor(TensorView::contiguous(f.data(), t.dtype(), {n}, Device::kCpu), t.view());
    std::copy(f.begin(), f.end(), v.begin());
  } else {
    std::vector<uint16_t> b((size_t)n);
    copy_tensor(TensorView::contiguous(b.data(), t.dtype(), {n}, Device::kCpu), t.view());
    for (size_t i = 0; i < b.size(); ++i) v[i] = formats::decode_bf16(b[i]);
  }
  return v;
}

// Element i of rank `src`'s buffer (for all_to_all: of its block for rank `dst`): small integers,
// exact in BF16, that tell sources and destinations apart.
double value(int src, int dst, int64_t i) {
  return 1.0 + (double)(src % 8) + 8.0 * (double)(dst % 8) + 64.0 * (double)(i % 3);
}

// One collective of the benchmark: its buffers for S bytes (`bytes`, S rounded down to whole
// blocks of R), one call (`run`), and `check`, which runs it once more and compares the received
// elements with what they must be (empty when all are right).
struct Case {
  double bus_factor = 1;  // busbw / algbw
  int64_t bytes = 0;
  std::function<void()> run;
  std::function<std::string()> check;
};

Case make_case(Communicator& comm, const std::string& name, int64_t bytes, DType dtype) {
  const int R = comm.size(), r = comm.rank();
  const Device dev = comm.device();
  const int64_t esize = dtype_bytes(dtype, 1);
  // all_reduce: one buffer of `total` elements; the others R blocks of `block` (S = R blocks).
  const int64_t block = std::max<int64_t>(bytes / esize / R, 1), total = block * R;
  auto rank_sum = [R](int64_t i) {  // what a sum over the ranks of element i gives
    double s = 0;
    for (int p = 0; p < R; ++p) s += value(p, 0, i);
    return s;
  };
  auto counts = std::make_shared<std::vector<int64_t>>((size_t)R, block);
  // The sent elements, the received count (0: in place), what element i of the output must be,
  // and the call.
  std::vector<double> send((size_t)(name == "all_gather" ? block : total));
  int64_t recv_count = total;
  std::function<double(int64_t)> want;
  std::function<void(const TensorView&, const TensorView&)> op;
  Case c;
  c.bus_factor = (double)(R - 1) / R;
  c.bytes = total * esize;
  if (name == "all_reduce") {
    c.bus_factor *= 2;
    for (int64_t i = 0; i < total; ++i) send[(size_t)i] = value(r, 0, i);
    recv_count = 0;
    want = rank_sum;
    op = [&comm](const TensorView& x, const TensorView&) { comm.all_reduce_sum(x); };
  } else if (name == "reduce_scatter") {
    for (int64_t i = 0; i < total; ++i) send[(size_t)i] = value(r, 0, i);
    recv_count = block;
    want = [rank_sum, r, block](int64_t i) { return rank_sum(r * block + i); };
    op = [&comm, counts](const TensorView& x, const TensorView& y) { comm.reduce_scatter_sum(x, y, *counts); };
  } else if (name == "all_gather") {
    for (int64_t i = 0; i < block; ++i) send[(size_t)i] = value(r, 0, i);
    want = [block](int64_t i) { return value((int)(i / block), 0, i % block); };
    op = [&comm, counts](const TensorView& x, const TensorView& y) { comm.all_gather(x, y, *counts); };
  } else if (name == "all_to_all") {
    for (int64_t i = 0; i < total; ++i) send[(size_t)i] = value(r, (int)(i / block), i % block);
    want = [block, r](int64_t i) { return value((int)(i / block), r, i % block); };
    op = [&comm, counts](const TensorView& x, const TensorView& y) { comm.all_to_allv(x, *counts, y, *counts); };
  } else {
    FOURBIT_CHECK(false, "bench comm: unknown collective '{}'", name);
  }
  auto in = std::make_shared<Tensor>(upload(send, dtype, dev));
  auto out = recv_count > 0 ? std::make_shared<Tensor>(Tensor::empty({recv_count}, dtype, dev)) : in;
  c.run = [op, in, out] { op(in->view(), out->view()); };
  const double tol = dtype == DType::kBF16 ? std::ldexp((double)R, -8) : 1e-12;
  c.check = [op, in, out, want, tol, dtype, dev]() -> std::string {
    op(in->view(), out->view());
    const std::vector<double> got = download(*out);
    // In place (all_reduce): zeros from now on, which the timed sums keep.
    if (in == out) *in = Tensor::zeros(in->shape(), dtype, dev);
    for (size_t i = 0; i < got.size(); ++i) {
      const double w = want((int64_t)i);
      if (std::abs(got[i] - w) > tol * std::abs(w)) return fmt::format("element {}: {} instead of {}", i, got[i], w);
    }
    return "";
  };
  return c;
}

// The largest of every rank's value (through a sum of one slot per rank).
double max_over_ranks(Communicator& comm, double v) {
  std::vector<double> slots((size_t)comm.size(), 0.0);
  slots[(size_t)comm.rank()] = v;
  all_reduce_sum_host(comm, slots);
  return *std::max_element(slots.begin(), slots.end());
}

}  // namespace

std::vector<CommBenchRow> run_comm_bench(Communicator& comm, const CommBenchOptions& o) {
  FOURBIT_CHECK(o.dtype == DType::kBF16 || o.dtype == DType::kF32 || o.dtype == DType::kF64,
                "bench comm: --dtype must be bf16, f32 or f64");
  FOURBIT_CHECK(o.rounds >= 1 && o.reps >= 1 && o.warmup >= 0,
                "bench comm: --rounds and --reps must be >= 1 and --warmup >= 0");
  std::vector<CommBenchRow> rows;
  for (const char* name : {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}) {
    if (!o.only.empty() && std::string(name).find(o.only) == std::string::npos) continue;
    for (int64_t bytes : o.sizes) {
      FOURBIT_CHECK(bytes > 0, "bench comm: sizes must be positive, got {}", bytes);
      Case c = make_case(comm, name, bytes, o.dtype);
      CommBenchRow row;
      row.collective = name;
      row.bytes = c.bytes;
      row.error = c.check();
      // Every rank must agree before timing (a wrong rank skips the timing with the others).
      row.correct = max_over_ranks(comm, row.error.empty() ? 0.0 : 1.0) == 0.0;
      if (row.correct) {
        for (int i = 0; i < o.warmup; ++i) c.run();
        std::vector<double> samples;
        for (int round = 0; round < o.rounds; ++round) {
          comm.barrier();
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < o.reps; ++i) c.run();
          comm.barrier();
          const auto t1 = std::chrono::steady_clock::now();
          samples.push_back(std::chrono::duration<double>(t1 - t0).count() / o.reps);
        }
        std::nth_element(samples.begin(), samples.begin() + (long)samples.size() / 2, samples.end());
        const double t = max_over_ranks(comm, samples[samples.size() / 2]);
        row.us = t * 1e6;
        row.algbw_gbs = (double)row.bytes / t * 1e-9;
        row.busbw_gbs = row.algbw_gbs * c.bus_factor;
      } else if (row.error.empty()) {
        row.error = "wrong on another rank";
      }
      rows.push_back(row);
    }
  }
  return rows;
}

std::string format_comm_bench(const std::vector<CommBenchRow>& rows, const CommBenchOptions& o,
                              int world, Device device) {
  std::string out = fmt::format(
      "bench comm: {} ranks, {} buffers, {}; time = slowest rank's median, busbw as nccl-tests{}\n",
      world, device_name(device), dtype_name(o.dtype),
      o.ceiling_gbs > 0 ? fmt::format(" (ceiling {:.1f} GB/s)", o.ceiling_gbs) : std::string());
  out += fmt::format("{:<16} {:>12} {:>11} {:>11} {:>11} {:>9}\n", "collective", "bytes", "us",
                     "algbw GB/s", "busbw GB/s", "ceiling");
  for (const CommBenchRow& r : rows) {
    if (!r.correct) {
      out += fmt::format("{:<16} {:>12} WRONG RESULT: {}\n", r.collective, r.bytes, r.error);
      continue;
    }
    out += fmt::format("{:<16} {:>12} {:>11.1f} {:>11.2f} {:>11.2f} {:>9}\n", r.collective, r.bytes,
                       r.us, r.algbw_gbs, r.busbw_gbs,
                       o.ceiling_gbs > 0 ? fmt::format("{:.1f}%", 100.0 * r.busbw_gbs / o.ceiling_gbs) : "-");
  }
  return out;
}

}  // namespace fourbit::dist
