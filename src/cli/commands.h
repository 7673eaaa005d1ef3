// Registration of the fourbit subcommands (one file each under src/cli).
#pragma once

#include <CLI/CLI.hpp>

namespace fourbit::cli {

void register_commands(CLI::App& app);
// Runs the subcommand that the parsed command line selected.
void run_selected(CLI::App& app);

// Individual subcommands: each adds itself to `app` and returns the callback to run.
struct Command {
  CLI::App* sub = nullptr;
  std::function<void()> run;
};
Command add_quant_report_command(CLI::App& app);
Command add_run_command(CLI::App& app);
Command add_bench_command(CLI::App& app);
Command add_recipe_command(CLI::App& app);
Command add_prepare_command(CLI::App& app);
Command add_model_command(CLI::App& app);
Command add_model_dump_command(CLI::App& app);
Command add_tasks_command(CLI::App& app);
Command add_corpus_command(CLI::App& app);
Command add_pretrain_command(CLI::App& app);
Command add_plot_command(CLI::App& app);
Command add_compare_command(CLI::App& app);
Command add_bench_train_command(CLI::App& app);  // after add_bench_command: adds `bench train`
Command add_bench_comm_command(CLI::App& app);   // after add_bench_command: adds `bench comm`
Command add_audit_command(CLI::App& app);
Command add_export_command(CLI::App& app);
Command add_import_command(CLI::App& app);
Command add_rl_command(CLI::App& app);
Command add_sample_command(CLI::App& app);
Command add_launch_command(CLI::App& app);

}  // namespace fourbit::cli
