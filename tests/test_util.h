// Helpers shared by the tests: fixture paths, temp dirs, running the CLI.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/backward.h"
#include "model/gemma.h"

namespace meshtune::testing {

// Absolute path of a file under ../shared/fixtures, e.g. fixture("keras/preset-gemma-tiny").
std::string fixture(const std::string& relative);

// A fresh empty directory under the system temp dir, removed by the OS eventually.
std::string make_temp_dir(const std::string& tag);

struct CommandResult {
  int exit_code = 0;
  std::string out;  // stdout
  std::string err;  // stderr
};
// Runs the meshtune binary with the given argument string (shell-quoted by the caller).
// `env` is prepended to the command line, e.g. "VAR=1"; `launcher` goes before the binary (e.g.
// "mpirun -np 2 ").
CommandResult run_meshtune(const std::string& args, const std::string& env = "", const std::string& launcher = "");

std::string read_text_file(const std::string& path);
nlohmann::json load_json(const std::string& path);

// An .npy file's values: as fp32, or as int32 (int32 or uint8 files: token ids and masks).
std::vector<float> npy_floats(const std::string& path);
std::vector<int32_t> npy_ints(const std::string& path);

// A [B, L] prompt batch and its padding mask (.npy files) as the rows generate_ids takes.
struct PromptRows {
  int64_t batch = 0, length = 0;
  std::vector<std::vector<int32_t>> rows;
  std::vector<std::vector<uint8_t>> masks;
};
PromptRows read_prompt_rows(const std::string& ids_path, const std::string& mask_path);

// Max |a − b| over the valid (mask ≠ 0) token positions; a and b are [B, T, width].
double max_diff_valid(const std::vector<float>& a, const std::vector<float>& b, const std::vector<int32_t>& mask,
                      size_t width);

// The backend the model tests run on (a CpuBackend on the CPU path in use), a Context over it, and
// a backend buffer's values copied to the host.
Backend& cpu_backend();
Context cpu_context(MatmulPrecision precision = MatmulPrecision::F32);
std::vector<float> to_host(const FloatBuffer& values);

// y[M, W.rows] = x·Wᵀ as ReferenceBackend computes it (plain loops: the oracle of the kernel tests).
void reference_linear(const float* x, int64_t M, const WeightMatrix& W, float* y,
                      MatmulPrecision precision = MatmulPrecision::F32);

// n values ~ N(0, scale²), reproducible from `seed`.
std::vector<float> random_vector(size_t n, uint32_t seed, float scale = 1.f);

// The Keras tiny fixture's token batch (keras/outputs-gemma-tiny): its logits under `model`
// ([B, T, V]), and as a next-token training batch (T − 1 inputs per row, the next ids as targets,
// padding weighted 0). The batch points into the struct.
std::vector<float> fixture_logits(const GemmaModel& model, MatmulPrecision precision = MatmulPrecision::F32);
struct NextTokenBatch {
  int64_t batch = 0, length = 0;
  std::vector<int32_t> ids, targets;
  std::vector<uint8_t> mask;
  std::vector<float> weights;
  TokenBatch view() const { return {batch, length, ids.data(), mask.data(), targets.data(), weights.data()}; }
};
NextTokenBatch fixture_next_token_batch();

// max over i of |got − want| / max(1, |want|) (infinite for a NaN or a size mismatch).
double max_relative_error(const std::vector<float>& got, const std::vector<float>& want);
// main() of a GPU test executable (ctest label gpu): runs its tests when a GPU is usable, else says
// why and returns 77, which ctest reports as skipped.
int run_gpu_tests(int argc, char** argv);
double cosine_similarity(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace meshtune::testing
