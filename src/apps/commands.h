// Registration of the CLI's subcommands. Each register_* adds one subcommand whose callback does
// the work (errors propagate as exceptions to main, which prints one line and exits non-zero).
#pragma once
#include <CLI/CLI.hpp>

namespace fasttree {

void register_plan_command(CLI::App& app);
void register_attention_command(CLI::App& app);
void register_gen_tree_command(CLI::App& app);
void register_bench_command(CLI::App& app);
void register_calibrate_command(CLI::App& app);
void register_generate_command(CLI::App& app);
void register_bench_e2e_command(CLI::App& app);

inline void register_commands(CLI::App& app) {
  register_plan_command(app);
  register_attention_command(app);
  register_gen_tree_command(app);
  register_bench_command(app);
  register_calibrate_command(app);
  register_generate_command(app);
  register_bench_e2e_command(app);
}

}  // namespace fasttree
