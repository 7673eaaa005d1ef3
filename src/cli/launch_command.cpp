// `fourbit launch -n N -- <subcommand ...>`: runs `fourbit <subcommand ...>` as N processes, one
// per GPU of this host, with RANK / WORLD_SIZE / LOCAL_RANK set (dist/launcher.h). A subcommand
// that understands them (`pretrain`: data parallel with ZeRO-1, dist/data_parallel.h) then runs as
// one rank of the group; rank 0 prints and writes.
#include "cli/commands.h"
#include "dist/launcher.h"

#include <cstdlib>
#include <string>
#include <vector>

namespace fourbit::cli {

namespace {

struct LaunchArgs {
  int n = 1;
  std::vector<std::string> command;
};

}  // namespace

Command add_launch_command(CLI::App& app) {
  auto args = std::make_shared<LaunchArgs>();
  CLI::App* sub = app.add_subcommand(
      "launch", "Run a fourbit subcommand as N processes, one per GPU (e.g. `fourbit launch -n 8 "
                "-- pretrain --preset gpt2-124m`); torchrun and mpirun work too");
  sub->add_option("-n,--nproc", args->n, "processes (GPUs) on this host")->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("command", args->command, "the fourbit subcommand and its options, after --")
      ->required();
  return {sub, [args] {
            const int rc = dist::launch(args->n, "/proc/self/exe", args->command);
            if (rc != 0) std::exit(rc);
          }};
}

}  // namespace fourbit::cli
