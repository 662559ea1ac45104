// meshtune: fine-tune and run Gemma models. Entry point: parses the subcommand and runs it; every
// meshtune::Error becomes one line on stderr and exit code 1.
#include <omp.h>

#include <iostream>
#include <map>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"meshtune: fine-tune and run Gemma 1/2/3 models (Keras presets and Hugging Face checkpoints)"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads for kernels (default: all cores)")->check(CLI::NonNegativeNumber);

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
    return app.exit(e);
  }
  if (threads > 0) omp_set_num_threads(threads);
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const meshtune::Error& e) {
    std::cerr << "meshtune: error: " << e.what() << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "meshtune: error: out of memory\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "meshtune: error: " << e.what() << "\n";
    return 1;
  }
  return 1;
}
