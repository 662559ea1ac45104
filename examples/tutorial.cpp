// The Keras "distributed tuning with Gemma" tutorial through the library, cell by cell:
//   tutorial MODEL [DATA] [--mesh 1x2] — run it alone, or under `mpirun -np 2 … --mesh 1x2`.
// MODEL is a preset directory or name; DATA a data spec (default: the built-in sample reviews).
#include <cstring>
#include <iostream>

#include "api/causal_lm.h"
#include "core/error.h"
#include "distribution/communicator.h"

using namespace meshtune;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: tutorial MODEL [DATA] [--mesh 1x2]\n";
    return 2;
  }
  try {
    api::PresetOptions preset;
    const std::string data = argc > 2 && std::strcmp(argv[2], "--mesh") != 0 ? argv[2] : "sample";
    for (int i = 2; i + 1 < argc; ++i)
      if (std::strcmp(argv[i], "--mesh") == 0) {
        preset.distribution.mesh_shape = DeviceMesh::parse_shape(argv[i + 1]);  // ("batch", "model")
        preset.distribution.layout = "auto";  // KerasHub's map (the tutorial's: "tutorial"; it needs KV heads the axis divides)
      }
    api::GemmaCausalLM gemma_lm = api::GemmaCausalLM::from_preset(argv[1], preset);
    const bool main = gemma_lm.is_main_process();
    // Every variable's path, shape and sharding.
    for (const api::VariableInfo& v : gemma_lm.variables())
      if (main) std::cout << v.path << " " << shape_str(v.shape) << " " << partition_spec_str(v.sharding) << "\n";
    GenerateOptions generate = gemma_lm.default_generate_options();
    generate.max_length = 16;
    for (const GeneratedText& t : gemma_lm.generate({"Best comedy movies in the 90s "}, generate))
      if (main) std::cout << "before: " << t.text << "\n";
    api::LoraOptions lora;
    lora.rank = 4;
    gemma_lm.enable_lora(lora);
    gemma_lm.set_sequence_length(32);  // the tutorial: 128
    api::CompileOptions adamw;  // AdamW(learning_rate=5e-5, weight_decay=0.01), no decay on bias/scale
    adamw.learning_rate = 5e-5;
    adamw.weight_decay = 0.01;
    adamw.exclude_from_weight_decay = {"bias", "scale"};
    gemma_lm.compile(adamw);
    ProgressLog bar(stderr);
    std::vector<api::Callback*> callbacks;
    if (main) callbacks.push_back(&bar);
    api::FitRunOptions run;  // batch 2, by steps here (the tutorial: one epoch of 2,000 reviews)
    run.epochs = 0;
    run.steps = 4;
    run.batch_size = 2;
    const api::History history = gemma_lm.fit(load_dataset(data), run, callbacks);
    for (const GeneratedText& t : gemma_lm.generate({"Best comedy movies in the 90s "}, generate))
      if (main) std::cout << "after: " << t.text << "\n";
    if (main) std::cout << "steps " << history.steps << " loss " << history.loss.back() << "\n";
    return 0;
  } catch (const std::exception& e) {
    // Under mpirun the whole job ends, so that no rank waits in a collective for this one.
    if (launched_by_mpirun()) abort_job(std::string("tutorial: error: ") + e.what(), 1);
    std::cerr << "tutorial: error: " << e.what() << "\n";
    return 1;
  }
}
