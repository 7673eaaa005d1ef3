// Subcommand registry for the fourbit CLI.
#include "cli/commands.h"

#include <vector>

namespace fourbit::cli {

namespace {
std::vector<Command>& registry() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace

void register_commands(CLI::App& app) {
  registry().push_back(add_run_command(app));
  registry().push_back(add_quant_report_command(app));
  registry().push_back(add_bench_command(app));
  registry().push_back(add_recipe_command(app));
  registry().push_back(add_prepare_command(app));
  registry().push_back(add_model_command(app));
  registry().push_back(add_model_dump_command(app));
  registry().push_back(add_tasks_command(app));
  registry().push_back(add_corpus_command(app));
  registry().push_back(add_pretrain_command(app));
  registry().push_back(add_plot_command(app));
  registry().push_back(add_compare_command(app));
  registry().push_back(add_audit_command(app));
  registry().push_back(add_export_command(app));
  registry().push_back(add_import_command(app));
  registry().push_back(add_rl_command(app));
  registry().push_back(add_sample_command(app));
  registry().push_back(add_launch_command(app));
  // `bench train` lives under `bench`: ahead of it in the registry so that run_selected picks it.
  registry().insert(registry().begin(), add_bench_train_command(app));
  registry().insert(registry().begin(), add_bench_comm_command(app));
}

void run_selected(CLI::App& /*app*/) {
  for (Command& c : registry()) {
    if (c.sub->parsed()) {
      c.run();
      return;
    }
  }
}

}  // namespace fourbit::cli
