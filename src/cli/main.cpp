// The `fourbit` command: one subcommand per capability. Each subcommand's options are declared
// once with CLI11, which generates --help from them.
#include "cli/commands.h"
#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "core/version.h"

#include <CLI/CLI.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{
      "fourbit: train language models in 4-bit precision (NVFP4, MXFP8, FP8, BF16) on CPUs and "
      "NVIDIA GPUs.\nStart with `fourbit run` (the main job on its built-in default)."};
  app.set_version_flag("--version", std::string("fourbit ") + FOURBIT_VERSION + " (commit " +
                                        FOURBIT_GIT_COMMIT + ", " +
                                        (fourbit::built_with_cuda() ? "CUDA" : "CPU-only") + ")");
  app.require_subcommand(1);
  fourbit::cli::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    fourbit::cli::run_selected(app);
  } catch (const fourbit::Error& e) {
    std::fprintf(stderr, "fourbit: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
