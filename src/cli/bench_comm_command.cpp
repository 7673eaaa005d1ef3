// `fourbit bench comm`: the collectives' bus bandwidth (dist/comm_bench.h). Under `fourbit launch
// -n N -- bench comm` (or torchrun / mpirun) it measures NCCL between the N GPUs; with --ranks N
// in one process it runs N in-process ranks on CPU buffers (threads: what the CPU tests check,
// not a network figure). Rank 0 prints the table. Like `bench train`, it hangs under `bench`.
#include "cli/commands.h"
#include "core/check.h"
#include "core/dtype.h"
#include "core/log.h"
#include "dist/comm_bench.h"
#include "dist/data_parallel.h"
#include "dist/in_process_communicator.h"

#include <cstdio>
#include <fstream>
#include <mutex>

namespace fourbit::cli {

Command add_bench_comm_command(CLI::App& app) {
  CLI::App* bench = app.get_subcommand("bench");
  struct Args {
    dist::CommBenchOptions o;
    std::vector<double> sizes_mib = {1, 8, 64, 256};
    std::string dtype = "bf16";
    int ranks = 0;
    std::string csv;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = bench->add_subcommand(
      "comm", "Bus bandwidth of all-reduce, reduce-scatter, all-gather and all-to-all between the "
              "ranks of `fourbit launch -n N -- bench comm` (NCCL), as nccl-tests defines it");
  sub->add_option("--sizes-mib", a->sizes_mib, "buffer sizes S in MiB (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--dtype", a->dtype, "bf16, f32 or f64")->capture_default_str();
  sub->add_option("--rounds", a->o.rounds, "timed rounds (median reported)")->capture_default_str();
  sub->add_option("--reps", a->o.reps, "collectives per round")->capture_default_str();
  sub->add_option("--warmup", a->o.warmup, "untimed collectives per case")->capture_default_str();
  sub->add_option("--only", a->o.only, "only the collectives whose name contains this text");
  sub->add_option("--ceiling-gbs", a->o.ceiling_gbs,
                  "the link bandwidth to print busbw against, in GB/s (e.g. a measured NVLink "
                  "figure); none by default");
  sub->add_option("--ranks", a->ranks,
                  "run this many in-process ranks on CPU buffers (threads) instead of the launched "
                  "processes: checks the benchmark itself, not a network");
  sub->add_option("--csv", a->csv, "also write the rows as CSV (rank 0)");
  return {sub, [a] {
            Args& x = *a;
            x.o.sizes.clear();
            for (double mib : x.sizes_mib) {
              FOURBIT_CHECK(mib > 0, "bench comm: --sizes-mib must be positive, got {}", mib);
              x.o.sizes.push_back((int64_t)(mib * 1024 * 1024));
            }
            FOURBIT_CHECK(x.dtype == "bf16" || x.dtype == "f32" || x.dtype == "f64",
                          "bench comm: --dtype '{}' is not bf16, f32 or f64", x.dtype);
            x.o.dtype = x.dtype == "bf16" ? DType::kBF16 : x.dtype == "f32" ? DType::kF32 : DType::kF64;
            auto report = [&x](dist::Communicator& comm, const std::vector<dist::CommBenchRow>& rows) {
              if (comm.rank() != 0) return;
              std::printf("%s", dist::format_comm_bench(rows, x.o, comm.size(), comm.device()).c_str());
              std::fflush(stdout);
              if (x.csv.empty()) return;
              std::ofstream f(x.csv);
              FOURBIT_CHECK(f.good(), "bench comm: cannot write --csv '{}'", x.csv);
              f << "collective,bytes,ranks,dtype,us,algbw_gbs,busbw_gbs,correct\n";
              for (const dist::CommBenchRow& r : rows)
                f << r.collective << ',' << r.bytes << ',' << comm.size() << ',' << dtype_name(x.o.dtype)
                  << ',' << r.us << ',' << r.algbw_gbs << ',' << r.busbw_gbs << ',' << (r.correct ? 1 : 0)
                  << '\n';
            };
            if (x.ranks > 0) {
              std::mutex mu;
              dist::run_ranks(x.ranks, [&](dist::Communicator& comm) {
                const std::vector<dist::CommBenchRow> rows = dist::run_comm_bench(comm, x.o);
                std::lock_guard<std::mutex> lk(mu);
                report(comm, rows);
              });
              return;
            }
            const std::unique_ptr<dist::Communicator> comm =
                dist::communicator_from_environment(Device::kCuda);
            FOURBIT_CHECK(comm != nullptr,
                          "bench comm needs several ranks: run it as `fourbit launch -n N -- bench "
                          "comm` on a machine with N GPUs, or give --ranks N for in-process CPU ranks");
            dist::quiet_unless_rank0(comm->rank());
            report(*comm, dist::run_comm_bench(*comm, x.o));
          }};
}

}  // namespace fourbit::cli
