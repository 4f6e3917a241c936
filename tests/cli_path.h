// Running the fasttree CLI from tests.
//   cli_path()   the binary under test: $FASTTREE_CLI when set (binaries carried to another machine,
//                e.g. the GPU machine's copy of build-gpu), else the build tree's binary.
//   CliFixture   a GoogleTest fixture with a fresh folder per test (removed afterwards) in which
//                the CLI runs with stdout and stderr captured.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>

inline std::string cli_path() {
  const char* env = std::getenv("FASTTREE_CLI");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string(FASTTREE_CLI_PATH);
}

struct CliRun {
  int exit_code;    // -1 when killed by a signal
  std::string err;  // stderr
  std::string out;  // stdout
};

class CliFixture : public ::testing::Test {
 protected:
  explicit CliFixture(std::string folder_prefix) : prefix_(std::move(folder_prefix)) {}
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           (prefix_ + std::to_string(::getpid()) + "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path(name), std::ios::binary) << text; }
  std::string slurp(const std::string& name) const {
    std::ifstream f(path(name), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  // Runs `before` (e.g. "timeout 120 ", or empty) + the CLI + " " + args in the test folder.
  CliRun run_cli(const std::string& before, const std::string& args) const {
    const std::string cmd =
        "cd '" + dir_.string() + "' && " + before + cli_path() + " " + args + " >stdout.txt 2>stderr.txt";
    const int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp("stderr.txt"), slurp("stdout.txt")};
  }

  std::filesystem::path dir_;

 private:
  std::string prefix_;
};
