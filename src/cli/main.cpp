// meshtune: fine-tune and run Gemma models. Entry point: parses the subcommand and runs it; every
// meshtune::Error becomes one line on stderr and exit code 1.
#include <omp.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <thread>

#include "cli/commands.h"
#include "core/error.h"
#include "distribution/communicator.h"
#include "io/mapped_files.h"
#include "backend/cpu/blas_kernels.h"
#include "backend/cpu_backend.h"

// Reports an error and ends the run. Under mpirun the whole job is aborted, so that no other rank
// is left waiting in a collective for this one.
[[noreturn]] static void fail_run(const std::string& message) {
  const std::string line = "meshtune: error: " + message;
  if (meshtune::launched_by_mpirun()) meshtune::abort_job(line, 1);
  std::cerr << line << "\n";
  // End without the libraries' exit handlers: after a failed write libhdf5's at-exit clean-up of
  // the file it could not close crashes. Results already written are flushed first.
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(1);
}

int main(int argc, char** argv) {
  if (meshtune::time_sgemm_if_asked()) return 0;  // a child timing OpenBLAS' kernels for choose_blas_kernels
  meshtune::choose_blas_kernels(argv);
  meshtune::exit_on_fault_in_mapped_file();  // a checkpoint truncated under us: one line, not SIGBUS
  CLI::App app{"meshtune: fine-tune and run Gemma 1/2/3 models (Keras presets and Hugging Face checkpoints)"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads for kernels (default: all cores)");
  // A bad command line is reported as every other error is: one line with the prefix, exit code 1.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "meshtune: error: " + std::string(e.what()) + " (run with --help for the options)\n";
  });

  std::map<CLI::App*, meshtune::cli::Runner> runners;
  auto all = [](const CLI::App*) { return true; };
  auto add = [&](meshtune::cli::Runner (*adder)(CLI::App&)) {
    meshtune::cli::Runner run = adder(app);
    runners[app.get_subcommands(all).back()] = run;  // the subcommand the adder just created
  };
  add(meshtune::cli::add_info_command);
  add(meshtune::cli::add_generate_command);
  add(meshtune::cli::add_logits_command);
  add(meshtune::cli::add_init_command);
  add(meshtune::cli::add_export_command);
  add(meshtune::cli::add_finetune_command);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is not an error; every bad command line is exit code 1
  }
  // More threads than the machine can start end in libgomp's own abort: refused up front.
  const int max_threads = 8 * int(std::max(1u, std::thread::hardware_concurrency()));
  if (app.count("--threads") && (threads < 1 || threads > max_threads))
    fail_run("--threads must be between 1 and " + std::to_string(max_threads) + " (8 × this machine's " +
             std::to_string(max_threads / 8) + " hardware threads), got " + std::to_string(threads));
  if (threads > 0) omp_set_num_threads(threads);
  try {
    meshtune::CpuBackendOptions::from_environment();  // a bad MESHTUNE_CPU is one clear error before any work
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const std::bad_alloc&) {
    fail_run("out of memory");
  } catch (const std::exception& e) {
    fail_run(e.what());
  }
  return 1;
}
