#include "generate/generate.h"

#include <algorithm>
#include <functional>

#include "core/error.h"

namespace meshtune {

// max_length bounds the KV cache and every row: it may not exceed what the model was made for.
static void check_options(const GemmaConfig& config, const GenerateOptions& options) {
  check(options.max_length >= 1 && options.max_length <= config.max_sequence_length, "max_length ",
        options.max_length, " is outside [1, ", config.max_sequence_length,
        "] (the model's maximum sequence length; set it with --max-length)");
  for (int id : options.stop_token_ids)
    check(id >= 0 && id < config.vocab_size, "stop token id ", id, " is outside the vocabulary [0, ", config.vocab_size,
          ")");
}

// Greedy decoding (the default) chooses each step's tokens where the logits are (softmax_row_max,
// the first index on ties as the sampler's max_element; greedy_tokens keeps a row's prompt token
// while it is inside its prompt) and feeds them to the next step from there, so the host never
// waits for a step before queuing the next: it collects each step's tokens (B ints) a few steps
// behind (start_download), to see the stop tokens. Steps queued after the one where every row had
// stopped are computed but dropped: the rows come out as a one-step-at-a-time loop makes them. On
// a GPU the host's launches then overlap the GPU's work instead of alternating with it.
static void greedy_steps(const Context& ctx, const GemmaModel& model, int64_t start,
                         std::vector<std::vector<int32_t>>& ids, const std::vector<std::vector<uint8_t>>& mask,
                         const std::function<bool(int32_t)>& is_stop, std::vector<uint8_t>& stopped,
                         const std::function<bool()>& all_stopped, KVCache& cache, ForwardWorkspace& ws,
                         FloatBuffer& step_logits) {
  Backend& backend = ctx.backend;
  const int64_t B = int64_t(ids.size()), L = int64_t(ids[0].size()), V = model.config.vocab_size;
  // The rows as the backend holds them, position-major ([L, B]: a step's tokens are contiguous),
  // with 1 where a row's prompt keeps its token, and each position's index for every row.
  std::vector<int32_t> by_position(size_t(L * B));
  std::vector<uint8_t> keep(size_t(L * B));
  std::vector<int64_t> positions(size_t(L * B));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t b = 0; b < B; ++b) {
      by_position[size_t(i * B + b)] = ids[b][i];
      keep[size_t(i * B + b)] = mask[b][i];
      positions[size_t(i * B + b)] = i;
    }
  // Every token a step may be fed that no step chose is checked here, as the host-ids pass checks its
  // own: position start − 1 (the first step's) and the prompt tokens after it.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = start - 1; i < L - 1; ++i)
      if ((i == start - 1 || mask[b][i]) && (ids[b][i] < 0 || ids[b][i] >= V))
        fail("token id ", ids[b][i], " at [", b, ", ", i, "] is outside the vocabulary (size ", V, ")");
  Buffer<int32_t> device_ids;
  Buffer<uint8_t> device_keep;
  Buffer<int64_t> device_positions;
  backend.resize(device_ids, by_position.size());
  backend.resize(device_keep, keep.size());
  backend.resize(device_positions, positions.size());
  backend.upload(Span<const int32_t>(by_position), device_ids);
  backend.upload(Span<const uint8_t>(keep), device_keep);
  backend.upload(Span<const int64_t>(positions), device_positions);

  // Two steps in flight are enough for the host to stay ahead; each holds a download of B tokens.
  constexpr int64_t kAhead = 2;
  static_assert(kAhead < Backend::kDownloadsInFlight);
  std::vector<Backend::PendingDownload> pending(static_cast<size_t>(L));
  bool done = false;  // every row has stopped (with stop tokens given)
  int64_t collected = start;  // steps start … collected − 1 have reached the rows
  auto collect = [&](int64_t index) {
    backend.finish_download(pending[size_t(index)]);
    collected = index + 1;
    if (done) return;  // a step after the one that stopped every row: dropped
    for (int64_t b = 0; b < B; ++b) {
      if (mask[b][index]) continue;
      ids[b][index] = by_position[size_t(index * B + b)];
      if (is_stop(ids[b][index])) stopped[b] = 1;
    }
    done = all_stopped();
  };
  SoftmaxRows row_max;
  int64_t queued = start;  // steps start … queued − 1 are queued
  for (int64_t index = start; index < L && !done; ++index, ++queued) {
    const Span<int32_t> chosen = device_ids.span().part(size_t(index * B), size_t(B));
    // One unit of backend work (a GPU launches it as one CUDA graph): nothing in it crosses to the
    // host. Under a model-parallel mesh the step's collectives stay out of graphs: a rank whose
    // capture fell through would run them as they come while the others queue theirs in a graph.
    const auto step = [&] {
      const FloatBuffer& hidden = backbone_forward(ctx, model, device_ids.span().part(size_t((index - 1) * B), size_t(B)),
                                                   device_positions.span().part(size_t((index - 1) * B), size_t(B)),
                                                   B, 1, index - 1, cache, ws);
      lm_head(ctx, model, hidden, B, step_logits);
      backend.softmax_row_max(step_logits, B, V, 0, row_max);
      backend.greedy_tokens(row_max, B, device_keep.span().part(size_t(index * B), size_t(B)), chosen);
    };
    if (ctx.tensor_parallel.active()) step();
    else backend.run_step(step);
    pending[size_t(index)] = backend.start_download(chosen, Span<int32_t>(by_position).part(size_t(index * B), size_t(B)));
    if (index - kAhead >= collected) collect(index - kAhead);
  }
  while (collected < queued) collect(collected);
}

GeneratedIds generate_ids(const Context& ctx, const GemmaModel& model, std::vector<std::vector<int32_t>> ids,
                          std::vector<std::vector<uint8_t>> mask, const GenerateOptions& options) {
  check_options(model.config, options);
  const int64_t B = int64_t(ids.size()), L = options.max_length, V = model.config.vocab_size;
  check(B > 0, "generate: no prompts");
  std::vector<int64_t> prompt_length(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    check(int64_t(ids[b].size()) == L && int64_t(mask[b].size()) == L, "generate: row ", b, " is not ", L, " long");
    prompt_length[b] = std::count(mask[b].begin(), mask[b].end(), uint8_t(1));
    check(prompt_length[b] >= 1, "generate: row ", b, " has an empty prompt (it needs at least BOS)");
  }
  const int64_t start = *std::min_element(prompt_length.begin(), prompt_length.end());
  auto is_stop = [&](int32_t id) {
    return std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), id) != options.stop_token_ids.end();
  };
  std::vector<uint8_t> stopped(size_t(B), 0);
  auto all_stopped = [&] { return !options.stop_token_ids.empty() && std::all_of(stopped.begin(), stopped.end(), [](uint8_t s) { return s; }); };

  Backend& backend = ctx.backend;
  KVCache cache(model.config, B, L, backend);  // every cached key is a real token: padding never gets cached
  ForwardWorkspace ws;                         // reused by every step
  Sampler sampler(options.sampler);            // its options checked whichever samples
  // Prefill positions 0 .. start−2; each step then feeds the token at index−1.
  if (start >= 2) {
    std::vector<int32_t> prefix(size_t(B * (start - 1)));
    for (int64_t b = 0; b < B; ++b) std::copy(ids[b].begin(), ids[b].begin() + start - 1, prefix.begin() + b * (start - 1));
    backbone_forward(ctx, model, prefix.data(), B, start - 1, 0, cache, ws);
  }
  FloatBuffer step_logits;
  backend.resize(step_logits, size_t(B * V));
  if (options.sampler.name == "greedy") {
    greedy_steps(ctx, model, start, ids, mask, is_stop, stopped, all_stopped, cache, ws, step_logits);
  } else {
    // The other samplers bring the step's logits to the host (1 MB per row for a 256k vocabulary)
    // and choose there, one step at a time.
    std::vector<int32_t> step_tokens(static_cast<size_t>(B));
    std::vector<float> logits(size_t(B * V));
    for (int64_t index = start; index < L && !all_stopped(); ++index) {
      for (int64_t b = 0; b < B; ++b) step_tokens[b] = ids[b][index - 1];
      const FloatBuffer& hidden = backbone_forward(ctx, model, step_tokens.data(), B, 1, index - 1, cache, ws);
      lm_head(ctx, model, hidden, B, step_logits);
      backend.download(step_logits, logits);
      for (int64_t b = 0; b < B; ++b) {
        if (mask[b][index]) continue;  // still inside this row's prompt: keep the prompt token
        ids[b][index] = sampler.sample(logits.data() + b * V, int(V));
        if (is_stop(ids[b][index])) stopped[b] = 1;
      }
    }
  }

  // The output mask: everything up to and including the first stop token after the prompt.
  GeneratedIds out;
  out.token_ids = ids;
  out.padding_mask.assign(size_t(B), std::vector<uint8_t>(size_t(L), 1));
  if (!options.stop_token_ids.empty()) {
    for (int64_t b = 0; b < B; ++b) {
      bool ended = false;
      for (int64_t i = 0; i < L; ++i) {
        out.padding_mask[b][i] = !ended;
        if (!mask[b][i] && is_stop(ids[b][i])) ended = true;
      }
    }
  }
  return out;
}

std::vector<int> default_stop_token_ids(const GemmaModel& model, const Tokenizer& tokenizer) {
  std::vector<int> stops = {tokenizer.eos_id()};
  for (const std::string& piece : model.config.stop_tokens)
    if (const int id = tokenizer.piece_to_id(piece); id >= 0) stops.push_back(id);
  return stops;
}

std::vector<GeneratedText> generate_text(const Context& ctx, const GemmaModel& model, const Tokenizer& tokenizer,
                                         const std::vector<std::string>& prompts, const GenerateOptions& options) {
  check_options(model.config, options);
  const int64_t L = options.max_length;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<uint8_t>> mask;
  for (const std::string& prompt : prompts) {
    // Only the first L − 1 tokens are used: a huge prompt is not tokenized whole.
    std::vector<int> tokens = tokenizer.encode(tokenizable_prefix(prompt, int(std::min<int64_t>(L, 1 << 24))));
    if (int64_t(tokens.size()) > L - 1) tokens.resize(size_t(std::max<int64_t>(0, L - 1)));
    std::vector<int32_t> row(size_t(L), tokenizer.pad_id());
    std::vector<uint8_t> row_mask(size_t(L), 0);
    row[0] = tokenizer.bos_id();
    row_mask[0] = 1;
    for (size_t i = 0; i < tokens.size(); ++i) {
      row[i + 1] = tokens[i];
      row_mask[i + 1] = 1;
    }
    ids.push_back(row);
    mask.push_back(row_mask);
  }
  GeneratedIds generated = generate_ids(ctx, model, ids, mask, options);

  const std::vector<int> specials = {tokenizer.bos_id(), tokenizer.eos_id(), tokenizer.pad_id()};
  auto is_special = [&](int id) { return std::find(specials.begin(), specials.end(), id) != specials.end(); };
  std::vector<GeneratedText> results;
  for (size_t b = 0; b < prompts.size(); ++b) {
    GeneratedText r;
    r.prompt = prompts[b];
    r.prompt_length = int(std::count(mask[b].begin(), mask[b].end(), uint8_t(1)));
    std::vector<int> all, completion;
    for (int64_t i = 0; i < L; ++i) {
      if (!generated.padding_mask[b][i]) continue;
      const int id = generated.token_ids[b][i];
      r.token_ids.push_back(id);
      if (is_special(id)) continue;
      all.push_back(id);
      if (i >= r.prompt_length) completion.push_back(id);
    }
    r.text = tokenizer.decode(all);
    r.completion = tokenizer.decode(completion);
    results.push_back(std::move(r));
  }
  return results;
}

}  // namespace meshtune
