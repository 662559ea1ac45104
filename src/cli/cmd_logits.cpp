// meshtune logits MODEL --token-ids ids.npy [--padding-mask mask.npy] --out logits.npy
//                       [--hidden-states hidden.npy]
// Scores whole sequences ([B, T] int32 in, [B, T, V] float32 out) for comparison with other
// implementations. Padding keys are masked as Keras masks them.
#include <iostream>

#include <algorithm>

#include "cli/commands.h"
#include "core/error.h"
#include "io/npy.h"

namespace meshtune::cli {

// Reads an integer or bool .npy of shape [B, T] into int32 values.
static std::vector<int32_t> read_int_matrix(const std::string& path, int64_t& B, int64_t& T) {
  HostTensor t = read_npy(path);
  check(t.shape.size() == 2, path, ": expected a 2-D array [batch, length], got shape ", shape_str(t.shape));
  B = t.shape[0];
  T = t.shape[1];
  std::vector<int32_t> out(size_t(B * T));
  for (size_t i = 0; i < out.size(); ++i) {
    switch (t.dtype) {
      case DType::I32: out[i] = t.as<int32_t>()[i]; break;
      case DType::I64: {
        int64_t v = t.as<int64_t>()[i];
        check(v >= INT32_MIN && v <= INT32_MAX, path, ": value ", v, " at flat index ", i, " does not fit int32");
        out[i] = int32_t(v);
        break;
      }
      case DType::BOOL: case DType::U8: out[i] = t.as<uint8_t>()[i]; break;
      default: fail(path, ": expected integer or bool values, got ", dtype_name(t.dtype));
    }
  }
  return out;
}

Runner add_logits_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "Compute logits (and hidden states) for token ids in a .npy file");
  struct Options {
    ModelOptions model;
    std::string token_ids, padding_mask, out, hidden_states;
  };
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd);
  o->model.add_dtype_policy(*cmd);
  cmd->add_option("--token-ids", o->token_ids, "int32 [B, T] token ids (.npy)")->required();
  cmd->add_option("--padding-mask", o->padding_mask, "[B, T] 1 = token, 0 = padding (.npy; default all 1)");
  cmd->add_option("--out", o->out, "Where to write float32 [B, T, V] logits (.npy)");
  cmd->add_option("--hidden-states", o->hidden_states, "Where to write float32 [B, T, D] final hidden states (.npy)");
  return [o] {
    check(!o->out.empty() || !o->hidden_states.empty(), "logits: give --out and/or --hidden-states");
    int64_t B = 0, T = 0;
    std::vector<int32_t> ids = read_int_matrix(o->token_ids, B, T);
    check(B > 0 && T > 0, o->token_ids, ": empty array");
    std::vector<int32_t> mask(ids.size(), 1);
    if (!o->padding_mask.empty()) {
      int64_t mb = 0, mt = 0;
      mask = read_int_matrix(o->padding_mask, mb, mt);
      check(mb == B && mt == T, o->padding_mask, ": shape (", mb, ", ", mt, ") differs from the token ids' (", B, ", ",
            T, ")");
    }
    const api::GemmaCausalLM lm = o->model.load(/*need_tokenizer=*/false);
    const GemmaConfig& c = lm.config();
    for (size_t i = 0; i < ids.size(); ++i)
      check(ids[i] >= 0 && ids[i] < c.vocab_size, o->token_ids, ": token id ", ids[i], " at [", int64_t(i) / T, ", ",
            int64_t(i) % T, "] is outside the vocabulary (size ", c.vocab_size, ")");
    std::vector<float> hidden;
    HostTensor logits = HostTensor::allocate(DType::F32, {B, T, o->out.empty() ? 0 : c.vocab_size});
    lm.logits(ids, mask, B, T, o->hidden_states.empty() ? nullptr : &hidden,
              o->out.empty() ? nullptr : logits.mutable_as<float>());
    if (!o->hidden_states.empty()) {
      HostTensor h = HostTensor::allocate(DType::F32, {B, T, c.hidden_dim});
      std::copy(hidden.begin(), hidden.end(), h.mutable_as<float>());
      write_npy(o->hidden_states, h);
    }
    if (!o->out.empty()) write_npy(o->out, logits);
    return 0;
  };
}

}  // namespace meshtune::cli
