#include "io/safetensors.h"

#include "io/mapped_files.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/file_util.h"
#include "test_util.h"

using namespace meshtune;
using meshtune::testing::fixture;
using meshtune::testing::make_temp_dir;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file built by hand: length prefix, header text, raw data.
std::string st_file(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

// Runs fn, expecting an Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
    return;
  }
  ADD_FAILURE() << "expected meshtune::Error";
}

template <typename T>
HostTensor make_tensor(DType dt, Shape shape, const std::vector<T>& values) {
  HostTensor t = HostTensor::allocate(dt, std::move(shape));
  EXPECT_EQ(t.nbytes(), values.size() * sizeof(T));
  std::memcpy(t.mutable_as<T>(), values.data(), t.nbytes());
  return t;
}

}  // namespace

TEST(Safetensors, RoundTripF32Bf16I32) {
  std::string dir = make_temp_dir("st");
  std::string path = dir + "/a.safetensors";
  std::vector<float> f = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, 7.0f};
  std::vector<uint16_t> b = {f32_to_bf16(1.0f), f32_to_bf16(-0.5f), f32_to_bf16(3.0f)};
  std::vector<int32_t> i = {1, -2, 2147483647, -2147483647 - 1};
  std::vector<std::pair<std::string, HostTensor>> tensors = {
      {"w.f32", make_tensor(DType::F32, {2, 3}, f)},
      {"w.bf16", make_tensor(DType::BF16, {3}, b)},
      {"ids", make_tensor(DType::I32, {2, 1, 2}, i)},
      {"empty", HostTensor::allocate(DType::F32, {0, 5})},
      {"scalar", make_tensor(DType::F32, {}, std::vector<float>{42.0f})},
  };
  write_safetensors(path, tensors, {{"format", "pt"}});
  EXPECT_TRUE(temp_files_of(path).empty()) << temp_files_of(path)[0];

  auto got = read_safetensors(path);
  ASSERT_EQ(got.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(got.count(name)) << name;
    const HostTensor& g = got.at(name);
    EXPECT_EQ(g.dtype, t.dtype) << name;
    EXPECT_EQ(g.shape, t.shape) << name;
    ASSERT_EQ(g.nbytes(), t.nbytes()) << name;
    EXPECT_EQ(std::memcmp(g.data, t.data, t.nbytes()), 0) << name;
  }
  EXPECT_EQ(to_f32(got.at("w.bf16")), (std::vector<float>{1.0f, -0.5f, 3.0f}));
  EXPECT_EQ(to_f32(got.at("scalar")), (std::vector<float>{42.0f}));
}

TEST(Safetensors, WrittenLayoutIsAlignedAndOrdered) {
  std::string dir = make_temp_dir("st");
  std::string path = dir + "/a.safetensors";
  // Names of odd lengths so the unpadded header would not be a multiple of 8.
  write_safetensors(path, {{"zz", make_tensor(DType::U8, {3}, std::vector<uint8_t>{1, 2, 3})},
                           {"a", make_tensor(DType::F32, {1}, std::vector<float>{5.0f})}});
  std::string bytes = meshtune::testing::read_text_file(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u);
  std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.find("__metadata__"), std::string::npos);  // no metadata given
  EXPECT_LT(header.find("\"zz\""), header.find("\"a\""));      // given order kept
  EXPECT_EQ(bytes.size(), 8 + n + 3 + 4);
  EXPECT_EQ(bytes.substr(8 + n, 3), std::string("\x01\x02\x03", 3));  // data in the given order

  // Tensor data pointers of a read file are aligned when the header is padded.
  auto got = read_safetensors(path);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(got.at("zz").data) % 8, 0u);
}

// The streaming form: the header from the declared specs, then each tensor made in turn; a tensor
// that is not what was declared is an error naming it (no file is left).
TEST(Safetensors, StreamedWriteMakesEachTensorInTurn) {
  std::string dir = make_temp_dir("st");
  const std::string path = dir + "/s.safetensors";
  const std::vector<TensorSpec> specs = {{"w", DType::BF16, {2}}, {"x", DType::F32, {1}}};
  std::vector<size_t> made;
  write_safetensors(path, specs, [&](size_t i) {
    made.push_back(i);
    return i == 0 ? make_tensor(DType::BF16, {2}, std::vector<uint16_t>{f32_to_bf16(1.0f), f32_to_bf16(-2.0f)})
                  : make_tensor(DType::F32, {1}, std::vector<float>{3.0f});
  }, {{"format", "pt"}});
  EXPECT_EQ(made, (std::vector<size_t>{0, 1}));
  auto got = read_safetensors(path);
  EXPECT_EQ(to_f32(got.at("w")), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(to_f32(got.at("x")), (std::vector<float>{3.0f}));
  EXPECT_EQ(read_safetensors_metadata(path).at("format"), "pt");

  const std::string bad = dir + "/bad.safetensors";
  expect_error([&] { write_safetensors(bad, specs, [&](size_t) { return HostTensor::allocate(DType::F32, {2}); }); },
               {bad, "\"w\"", "float32", "bfloat16"});
  EXPECT_FALSE(std::filesystem::exists(bad));
  EXPECT_TRUE(temp_files_of(bad).empty()) << temp_files_of(bad)[0];
}

TEST(Safetensors, OverwriteFileThatTensorsAlias) {
  // Rewriting the file whose map we still hold must not disturb the tensors (temp + rename).
  std::string dir = make_temp_dir("st");
  std::string path = dir + "/a.safetensors";
  write_safetensors(path, {{"x", make_tensor(DType::F32, {2}, std::vector<float>{1.0f, 2.0f})}});
  auto first = read_safetensors(path);
  write_safetensors(path, {{"x", first.at("x")}, {"y", first.at("x")}});
  EXPECT_EQ(to_f32(first.at("x")), (std::vector<float>{1.0f, 2.0f}));
  auto second = read_safetensors(path);
  EXPECT_EQ(to_f32(second.at("y")), (std::vector<float>{1.0f, 2.0f}));
}

TEST(Safetensors, ReadsTinyGemmaFixture) {
  auto t = read_safetensors(fixture("hf/tiny-gemma/checkpoint/model.safetensors"));
  static bool printed = false;
  if (!printed) {
    printed = true;
    std::string keys;
    for (const auto& [name, v] : t) keys += name + " " + shape_str(v.shape) + "\n";
    std::printf("tiny-gemma tensors:\n%s", keys.c_str());
  }
  ASSERT_TRUE(t.count("model.embed_tokens.weight"));
  const HostTensor& emb = t.at("model.embed_tokens.weight");
  EXPECT_EQ(emb.dtype, DType::F32);
  EXPECT_EQ(emb.shape, (Shape{1000, 64}));
  EXPECT_EQ(t.at("model.layers.0.self_attn.k_proj.weight").shape, (Shape{16, 64}));
  // All tensors of the file share one mapping.
  EXPECT_EQ(emb.owner.get(), t.at("model.layers.0.input_layernorm.weight").owner.get());
  // Values are finite floats (a sanity check that offsets point at real data).
  for (float v : to_f32(emb)) ASSERT_TRUE(std::isfinite(v));
  // The dir reader finds the same file.
  auto d = read_safetensors_dir(fixture("hf/tiny-gemma/checkpoint"));
  EXPECT_EQ(d.size(), t.size());
}

TEST(Safetensors, ShardedDirectory) {
  std::string dir = make_temp_dir("st");
  write_safetensors(dir + "/model-00001-of-00002.safetensors",
                    {{"a", make_tensor(DType::F32, {2}, std::vector<float>{1.0f, 2.0f})},
                     {"unlisted", make_tensor(DType::F32, {1}, std::vector<float>{9.0f})}});
  write_safetensors(dir + "/model-00002-of-00002.safetensors",
                    {{"b", make_tensor(DType::I32, {3}, std::vector<int32_t>{4, 5, 6})},
                     {"c", make_tensor(DType::F32, {1}, std::vector<float>{3.0f})}});
  write_bytes(dir + "/model.safetensors.index.json",
              R"({"metadata": {"total_size": 24}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                  "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}})");
  auto t = read_safetensors_dir(dir);
  ASSERT_EQ(t.size(), 3u);  // exactly the tensors the weight map names
  EXPECT_EQ(to_f32(t.at("a")), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(t.at("b").as<int32_t>()[2], 6);
  EXPECT_EQ(to_f32(t.at("c")), (std::vector<float>{3.0f}));
  EXPECT_EQ(t.at("b").owner.get(), t.at("c").owner.get());  // one read per shard
}

TEST(Safetensors, EmptyFileWithNoTensors) {
  std::string dir = make_temp_dir("st");
  write_safetensors(dir + "/e.safetensors", {});
  EXPECT_TRUE(read_safetensors(dir + "/e.safetensors").empty());
  write_bytes(dir + "/m.safetensors", st_file(R"({"__metadata__":{"format":"pt"}})", ""));
  EXPECT_TRUE(read_safetensors(dir + "/m.safetensors").empty());
}

// ---- corrupt inputs ----

TEST(SafetensorsErrors, MissingFile) {
  std::string path = make_temp_dir("st") + "/nope.safetensors";
  expect_error([&] { read_safetensors(path); }, {path});
}

TEST(SafetensorsErrors, MissingDirContents) {
  std::string dir = make_temp_dir("st");
  expect_error([&] { read_safetensors_dir(dir); }, {"no model.safetensors or model.safetensors.index.json in " + dir});
}

TEST(SafetensorsErrors, ShorterThan8Bytes) {
  std::string path = make_temp_dir("st") + "/short.safetensors";
  write_bytes(path, "abc");
  expect_error([&] { read_safetensors(path); }, {path});
  write_bytes(path, "");
  expect_error([&] { read_safetensors(path); }, {path});
}

TEST(SafetensorsErrors, HeaderLengthPastEnd) {
  std::string path = make_temp_dir("st") + "/len.safetensors";
  write_bytes(path, le64(100) + "{}");
  expect_error([&] { read_safetensors(path); },
               {path, "header length 100 runs past the end of the file (size 10)"});
  write_bytes(path, le64(UINT64_MAX) + "{}");  // 8 + N overflows
  expect_error([&] { read_safetensors(path); }, {path, "runs past the end of the file"});
}

TEST(SafetensorsErrors, HeaderNotJson) {
  std::string path = make_temp_dir("st") + "/json.safetensors";
  write_bytes(path, st_file("{\"a\": [1, 2", ""));
  expect_error([&] { read_safetensors(path); }, {path, "JSON"});
  write_bytes(path, st_file("[1, 2]", ""));
  expect_error([&] { read_safetensors(path); }, {path, "JSON object"});
}

TEST(SafetensorsErrors, UnknownDtype) {
  std::string path = make_temp_dir("st") + "/dtype.safetensors";
  write_bytes(path, st_file(R"({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", "ab"));
  expect_error([&] { read_safetensors(path); }, {path, "\"w\"", "F8_E4M3"});
}

TEST(SafetensorsErrors, ShapeOffsetMismatch) {
  std::string path = make_temp_dir("st") + "/size.safetensors";
  write_bytes(path, st_file(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})",
                            std::string(24, '\0')));
  expect_error([&] { read_safetensors(path); }, {path, "\"w\"", "24 bytes"});
}

TEST(SafetensorsErrors, AbsurdShape) {
  // A shape whose element count overflows 64 bits must be rejected without allocating.
  std::string path = make_temp_dir("st") + "/bomb.safetensors";
  write_bytes(path, st_file(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}})",
                            ""));
  expect_error([&] { read_safetensors(path); }, {path, "\"w\""});
  write_bytes(path, st_file(R"({"w": {"dtype": "I64", "shape": [1152921504606846976, 2], "data_offsets": [0, 0]}})",
                            ""));
  expect_error([&] { read_safetensors(path); }, {path, "\"w\""});
  write_bytes(path, st_file(R"({"w": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 0]}})", ""));
  expect_error([&] { read_safetensors(path); }, {path, "\"w\"", "non-negative"});
}

TEST(SafetensorsErrors, OffsetsOutsideData) {
  std::string path = make_temp_dir("st") + "/off.safetensors";
  write_bytes(path, st_file(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                            std::string(8, '\0')));
  expect_error([&] { read_safetensors(path); }, {path, "\"w\"", "past the end of the data"});
  write_bytes(path, st_file(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})",
                            std::string(8, '\0')));
  expect_error([&] { read_safetensors(path); }, {path, "\"w\"", "begin > end"});
}

TEST(SafetensorsErrors, OverlappingTensors) {
  std::string path = make_temp_dir("st") + "/overlap.safetensors";
  write_bytes(path, st_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                            R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                            std::string(12, '\0')));
  expect_error([&] { read_safetensors(path); }, {path, "\"a\"", "\"b\"", "overlap"});
}

TEST(SafetensorsErrors, IndexTensorMissingFromShard) {
  std::string dir = make_temp_dir("st");
  write_safetensors(dir + "/shard1.safetensors", {{"a", make_tensor(DType::F32, {1}, std::vector<float>{1.0f})}});
  std::string index = dir + "/model.safetensors.index.json";
  write_bytes(index, R"({"weight_map": {"a": "shard1.safetensors", "ghost": "shard1.safetensors"}})");
  expect_error([&] { read_safetensors_dir(dir); }, {index, "\"ghost\"", "shard1.safetensors"});
}

TEST(SafetensorsErrors, IndexShardFileMissing) {
  std::string dir = make_temp_dir("st");
  std::string index = dir + "/model.safetensors.index.json";
  write_bytes(index, R"({"weight_map": {"a": "absent.safetensors"}})");
  expect_error([&] { read_safetensors_dir(dir); }, {index, "absent.safetensors"});
}

TEST(SafetensorsErrors, WriteFailureNamesPathAndLeavesNoTemp) {
  std::string dir = make_temp_dir("st");
  std::string path = dir + "/no-such-dir/x.safetensors";
  expect_error([&] { write_safetensors(path, {{"a", HostTensor::allocate(DType::F32, {1})}}); }, {path});
  // Writing over a directory fails at rename; the temp file must be gone.
  std::string target = dir + "/is-a-dir";
  std::filesystem::create_directories(target + "/child");
  expect_error([&] { write_safetensors(target, {{"a", HostTensor::allocate(DType::F32, {1})}}); }, {target});
  EXPECT_TRUE(temp_files_of(target).empty()) << temp_files_of(target)[0];
}

// A mapped checkpoint truncated under a running process: reading its vanished pages is one line
// naming the file and exit code 1 (the command line installs the handler), not a silent SIGBUS.
TEST(SafetensorsDeathTest, ATruncatedMappedFileIsOneLineNotSigbus) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string path = make_temp_dir("sttrunc") + "/model.safetensors";
  write_safetensors(path, {{"x", make_tensor(DType::F32, {65536}, std::vector<float>(65536, 1.f))}});
  EXPECT_EXIT(
      {
        exit_on_fault_in_mapped_file();
        const auto tensors = read_safetensors(path);
        std::filesystem::resize_file(path, 4096);
        volatile float v = tensors.at("x").as<float>()[60000];  // far beyond the first page
        (void)v;
        std::exit(0);
      },
      ::testing::ExitedWithCode(1), "model.safetensors: the file changed while it was in use");
}
