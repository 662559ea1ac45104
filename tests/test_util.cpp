#include "test_util.h"

#include "backend/cpu_backend.h"
#include "backend/cuda_devices.h"
#include "backend/reference_backend.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <gtest/gtest.h>

#include "io/npy.h"

namespace meshtune::testing {

// The fixtures' directory: $MESHTUNE_FIXTURES_DIR when set (another machine's copy, e.g. on the GPU
// machine), else ../shared/fixtures as found at build time.
std::string fixture(const std::string& relative) {
  const char* dir = std::getenv("MESHTUNE_FIXTURES_DIR");
  return std::string(dir && *dir ? dir : MESHTUNE_FIXTURES_DIR) + "/" + relative;
}

std::string make_temp_dir(const std::string& tag) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() /
             ("meshtune-test-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json load_json(const std::string& path) { return nlohmann::json::parse(read_text_file(path)); }

std::vector<float> npy_floats(const std::string& path) { return to_f32(read_npy(path)); }

std::vector<int32_t> npy_ints(const std::string& path) {
  HostTensor t = read_npy(path);
  std::vector<int32_t> out(size_t(num_elements(t.shape)));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = t.dtype == DType::I32 ? t.as<int32_t>()[i] : int32_t(t.as<uint8_t>()[i]);
  return out;
}

PromptRows read_prompt_rows(const std::string& ids_path, const std::string& mask_path) {
  const HostTensor ids_t = read_npy(ids_path);
  PromptRows p;
  p.batch = ids_t.shape[0];
  p.length = ids_t.shape[1];
  const std::vector<int32_t> ids = npy_ints(ids_path), mask = npy_ints(mask_path);
  for (int64_t b = 0; b < p.batch; ++b) {
    p.rows.emplace_back(ids.begin() + b * p.length, ids.begin() + (b + 1) * p.length);
    p.masks.emplace_back(mask.begin() + b * p.length, mask.begin() + (b + 1) * p.length);
  }
  return p;
}

double max_diff_valid(const std::vector<float>& a, const std::vector<float>& b, const std::vector<int32_t>& mask,
                      size_t width) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t pos = 0; pos < mask.size(); ++pos) {
    if (!mask[pos]) continue;
    for (size_t i = 0; i < width; ++i) worst = std::max(worst, double(std::fabs(a[pos * width + i] - b[pos * width + i])));
  }
  return worst;
}

std::vector<float> random_vector(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

CommandResult run_meshtune(const std::string& args, const std::string& env, const std::string& launcher) {
  std::string dir = make_temp_dir("cmd");
  std::string out_path = dir + "/out", err_path = dir + "/err";
  std::string cmd = env + " " + launcher + std::string("'") + MESHTUNE_BINARY + "' " + args + " >'" + out_path + "' 2>'" + err_path + "' </dev/null";
  int status = std::system(cmd.c_str());
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = read_text_file(out_path);
  result.err = read_text_file(err_path);
  std::filesystem::remove_all(dir);
  return result;
}

std::vector<float> fixture_logits(const GemmaModel& model, MatmulPrecision precision) {
  const std::string in = fixture("keras/outputs-gemma-tiny/");
  const HostTensor ids_t = read_npy(in + "token_ids.npy");
  const int64_t B = ids_t.shape[0], T = ids_t.shape[1];
  const std::vector<int32_t> ids = npy_ints(in + "token_ids.npy"), mask = npy_ints(in + "padding_mask.npy");
  KVCache cache(model.config, B, T, cpu_backend());
  cache.set_key_valid(cpu_backend(), std::vector<uint8_t>(mask.begin(), mask.end()));
  const FloatBuffer hidden = backbone_forward(cpu_context(precision), model, ids.data(), B, T, 0, cache);
  std::vector<float> logits(size_t(B * T * model.config.vocab_size));
  lm_head(cpu_context(precision), model, hidden, B * T, logits);
  return logits;
}

NextTokenBatch fixture_next_token_batch() {
  const std::string in = fixture("keras/outputs-gemma-tiny/");
  const HostTensor ids_t = read_npy(in + "token_ids.npy");
  NextTokenBatch b;
  b.batch = ids_t.shape[0];
  b.length = ids_t.shape[1] - 1;
  const std::vector<int32_t> all = npy_ints(in + "token_ids.npy"), all_mask = npy_ints(in + "padding_mask.npy");
  for (int64_t r = 0; r < b.batch; ++r)
    for (int64_t t = 0; t < b.length; ++t) {
      const size_t i = size_t(r * (b.length + 1) + t);
      b.ids.push_back(all[i]);
      b.targets.push_back(all[i + 1]);
      b.mask.push_back(uint8_t(all_mask[i]));
      b.weights.push_back(float(all_mask[i + 1]));
    }
  return b;
}

double cosine_similarity(const std::vector<float>& a, const std::vector<float>& b) {
  double dot = 0, aa = 0, bb = 0;
  for (size_t k = 0; k < a.size() && k < b.size(); ++k) {
    dot += double(a[k]) * b[k];
    aa += double(a[k]) * a[k];
    bb += double(b[k]) * b[k];
  }
  return dot / std::sqrt(aa * bb);
}

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

Context cpu_context(MatmulPrecision precision) { return Context{cpu_backend(), precision}; }

std::vector<float> to_host(const FloatBuffer& values) {
  std::vector<float> host(values.size());
  cpu_backend().download(values, host);
  return host;
}

void reference_linear(const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision) {
  ReferenceBackend reference;
  reference.linear(ConstFloats(x, size_t(M * W.cols)), M, W, Floats(y, size_t(M * W.rows)), precision);
}

double max_relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(double(got[i]) - double(want[i])) / std::max(1.0, std::abs(double(want[i])));
    worst = std::max(worst, std::isnan(e) ? INFINITY : e);
  }
  return worst;
}

int run_gpu_tests(int argc, char** argv) {
  const CudaSystem system = cuda_system();
  if (system.gpus.empty()) {
    std::printf("skipped: no GPU to test on (%s)\n", system.unavailable.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

}  // namespace meshtune::testing
