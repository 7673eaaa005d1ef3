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

// One collective of the benchmark: prepares its buffers for S bytes, runs it, checks its output.
struct Case {
  std::string name;
  double bus_factor = 1;  // busbw / algbw
  std::function<void()> run;
  std::function<std::string()> check;  // empty when correct
};

Case make_case(Communicator& comm, const std::string& name, int64_t bytes, DType dtype) {
  const int R = comm.size(), r = comm.rank();
  const Device dev = comm.device();
  const int64_t esize = dtype_bytes(dtype, 1);
  // Elements: all_reduce count = S / e; the others R blocks of `block` elements (S = R blocks).
  const int64_t total = std::max<int64_t>(bytes / esize / R, 1) * R;
  const int64_t block = total / R;
  const double tol = dtype == DType::kBF16 ? std::ldexp((double)R, -8) : 1e-12;
  auto close = [tol](double got, double want) { return std::abs(got - want) <= tol * std::abs(want); };
  auto shared = [](Tensor t) { return std::make_shared<Tensor>(std::move(t)); };
  Case c;
  c.name = name;
  if (name == "all_reduce") {
    c.bus_factor = 2.0 * (R - 1) / R;
    std::vector<double> x((size_t)total);
    for (int64_t i = 0; i < total; ++i) x[(size_t)i] = value(r, 0, i);
    auto init = std::make_shared<std::vector<double>>(std::move(x));
    auto buf = shared(upload(*init, dtype, dev));
    // In place: after the check the buffer holds zeros, which the timed sums keep.
    c.run = [&comm, buf] { comm.all_reduce_sum(buf->view()); };
    c.check = [&comm, buf, init, dtype, dev, total, R, close]() -> std::string {
      comm.all_reduce_sum(buf->view());
      const std::vector<double> got = download(*buf);
      *buf = Tensor::zeros({total}, dtype, dev);
      for (int64_t i = 0; i < total; ++i) {
        double want = 0;
        for (int p = 0; p < R; ++p) want += value(p, 0, i);
        if (!close(got[(size_t)i], want)) return fmt::format("element {}: {} instead of {}", i, got[(size_t)i], want);
      }
      return "";
    };
  } else if (name == "reduce_scatter") {
    c.bus_factor = (double)(R - 1) / R;
    std::vector<double> x((size_t)total);
    for (int64_t i = 0; i < total; ++i) x[(size_t)i] = value(r, 0, i);
    auto send = shared(upload(x, dtype, dev));
    auto recv = shared(Tensor::empty({block}, dtype, dev));
    auto counts = std::make_shared<std::vector<int64_t>>((size_t)R, block);
    c.run = [&comm, send, recv, counts] { comm.reduce_scatter_sum(send->view(), recv->view(), *counts); };
    c.check = [&comm, send, recv, counts, block, r, R, close]() -> std::string {
      comm.reduce_scatter_sum(send->view(), recv->view(), *counts);
      const std::vector<double> got = download(*recv);
      for (int64_t i = 0; i < block; ++i) {
        double want = 0;
        for (int p = 0; p < R; ++p) want += value(p, 0, r * block + i);
        if (!close(got[(size_t)i], want)) return fmt::format("element {}: {} instead of {}", i, got[(size_t)i], want);
      }
      return "";
    };
  } else if (name == "all_gather") {
    c.bus_factor = (double)(R - 1) / R;
    std::vector<double> x((size_t)block);
    for (int64_t i = 0; i < block; ++i) x[(size_t)i] = value(r, 0, i);
    auto send = shared(upload(x, dtype, dev));
    auto recv = shared(Tensor::empty({total}, dtype, dev));
    auto counts = std::make_shared<std::vector<int64_t>>((size_t)R, block);
    c.run = [&comm, send, recv, counts] { comm.all_gather(send->view(), recv->view(), *counts); };
    c.check = [&comm, send, recv, counts, block, R, close]() -> std::string {
      comm.all_gather(send->view(), recv->view(), *counts);
      const std::vector<double> got = download(*recv);
      for (int p = 0; p < R; ++p)
        for (int64_t i = 0; i < block; ++i) {
          const double g = got[(size_t)(p * block + i)], want = value(p, 0, i);
          if (!close(g, want)) return fmt::format("block {} element {}: {} instead of {}", p, i, g, want);
        }
      return "";
    };
  } else if (name == "all_to_all") {
    c.bus_factor = (double)(R - 1) / R;
    std::vector<double> x((size_t)total);
    for (int d = 0; d < R; ++d)
      for (int64_t i = 0; i < block; ++i) x[(size_t)(d * block + i)] = value(r, d, i);
    auto send = shared(upload(x, dtype, dev));
    auto recv = shared(Tensor::empty({total}, dtype, dev));
    auto counts = std::make_shared<std::vector<int64_t>>((size_t)R, block);
    c.run = [&comm, send, recv, counts] { comm.all_to_allv(send->view(), *counts, recv->view(), *counts); };
    c.check = [&comm, send, recv, counts, block, r, R, close]() -> std::string {
      comm.all_to_allv(send->view(), *counts, recv->view(), *counts);
      const std::vector<double> got = download(*recv);
      for (int p = 0; p < R; ++p)
        for (int64_t i = 0; i < block; ++i) {
          const double g = got[(size_t)(p * block + i)], want = value(p, r, i);
          if (!close(g, want)) return fmt::format("block from rank {} element {}: {} instead of {}", p, i, g, want);
        }
      return "";
    };
  } else {
    FOURBIT_CHECK(false, "bench comm: unknown collective '{}'", name);
  }
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
      const int64_t esize = dtype_bytes(o.dtype, 1);
      row.bytes = std::max<int64_t>(bytes / esize / comm.size(), 1) * comm.size() * esize;
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
