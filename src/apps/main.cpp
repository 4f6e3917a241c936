// fasttree: command-line entry point. Subcommands live in cmd_*.cpp files.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "apps/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"FastTree: tree-structured decode attention (planner, CPU reference, CUDA kernels)"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for all subcommands");
  fasttree::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const fasttree::Error& e) {
    std::fprintf(stderr, "fasttree: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fasttree: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
