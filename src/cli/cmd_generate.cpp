// meshtune generate MODEL --prompt TEXT [--prompt TEXT ...] [--max-length N] [--sampler ...] [--json]
#include <optional>
#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/mesh_options.h"
#include "core/error.h"
#include "text/chat.h"

namespace meshtune::cli {

Runner add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate text from one or more prompts (Keras generate semantics)");
  struct Options {
    ModelOptions model;
    std::vector<std::string> prompts;
    std::optional<int> max_length;  // unset: the preset's sequence_length
    SamplerOptions sampler;
    int64_t seed = -1;
    std::vector<int> stop_ids;
    bool no_stop = false, json = false, chat = false;
    MeshOptions mesh;
  };
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd);
  o->model.add_dtype_policy(*cmd);
  cmd->add_option("--prompt", o->prompts, "A prompt (repeat for several, generated together)")->required();
  cmd->add_option("--max-length", o->max_length,
                  "Total length: BOS + prompt + new tokens (default: the preset's sequence_length)");
  cmd->add_option("--sampler", o->sampler.name, "greedy (default), top_k, top_p or random")
      ->check(CLI::IsMember({"greedy", "top_k", "top_p", "random"}));
  cmd->add_option("--top-k", o->sampler.top_k, "k for top_k (default 5)");
  cmd->add_option("--top-p", o->sampler.top_p, "p for top_p (default 0.1)");
  cmd->add_option("--temperature", o->sampler.temperature, "Softmax temperature (default 1.0)");
  cmd->add_option("--seed", o->seed, "Seed for the random samplers (default: nondeterministic)");
  cmd->add_option("--stop-token-id", o->stop_ids, "Stop token ids (default: <eos>, and <end_of_turn> on Gemma 3)");
  cmd->add_flag("--no-stop", o->no_stop, "Never stop early: always generate up to --max-length");
  cmd->add_flag("--chat", o->chat,
                "Each prompt is a user turn in Gemma's chat template, answered by the model; stops at <end_of_turn>");
  cmd->add_flag("--json", o->json, "Print one JSON object per prompt: prompt, text (the completion), token_ids");
  o->mesh.add_to(*cmd);
  return [o] {
    // Under a mesh each process reads and keeps only its blocks of the weights the layout splits; it
    // computes its share of the heads, FFN width and vocabulary where the layout allows (tensor
    // parallel), and the other split weights are all-gathered. Every process generates the same tokens.
    api::PresetOptions preset = o->model.preset();
    preset.distribution = o->mesh.distribution();
    const api::GemmaCausalLM lm = api::GemmaCausalLM::from_preset(o->model.model, preset);
    if (lm.mesh() && lm.is_main_process()) std::cerr << "meshtune: " << lm.distribution_summary() << "\n";
    GenerateOptions options = lm.default_generate_options();
    check(!o->max_length || *o->max_length >= 1, "--max-length must be at least 1, got ", o->max_length.value_or(0));
    if (o->max_length) options.max_length = *o->max_length;
    options.sampler = o->sampler;
    if (o->seed >= 0) {
      options.sampler.seeded = true;
      options.sampler.seed = uint64_t(o->seed);
    }
    if (!o->stop_ids.empty()) options.stop_token_ids = o->stop_ids;
    std::vector<std::string> prompts = o->prompts;
    if (o->chat) {
      for (std::string& p : prompts) p = render_gemma_chat({{"user", p}}, /*add_generation_prompt=*/true);
      const int end_of_turn = lm.tokenizer().piece_to_id("<end_of_turn>");
      check(end_of_turn >= 0, lm.directory().tokenizer_path, ": --chat needs <end_of_turn> in the vocabulary");
      if (o->stop_ids.empty() && std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), end_of_turn) ==
                                     options.stop_token_ids.end())
        options.stop_token_ids.push_back(end_of_turn);
    }
    if (o->no_stop) options.stop_token_ids.clear();
    const std::vector<GeneratedText> results = lm.generate(prompts, options);
    for (size_t i = 0; i < results.size() && lm.is_main_process(); ++i) {
      const GeneratedText& r = results[i];
      if (o->json) {
        nlohmann::json j = {{"prompt", o->prompts[i]}, {"text", r.completion}, {"token_ids", r.token_ids}};
        std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
      } else {
        std::cout << (o->chat ? o->prompts[i] + "\n" + r.completion : r.text) << "\n";  // chat: the question, the answer
      }
    }
    return 0;
  };
}

}  // namespace meshtune::cli
