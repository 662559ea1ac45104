#include "io/keras_h5.h"

#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "core/error.h"
#include "core/file_util.h"
#include "core/tensor.h"
#include "test_util.h"

using namespace meshtune;
using meshtune::testing::fixture;
using meshtune::testing::make_temp_dir;
using meshtune::testing::read_text_file;

namespace {

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// Runs `f`, expecting a meshtune::Error whose message contains `needle`.
template <typename F>
void expect_error_containing(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an Error mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

HostTensor f32_tensor(Shape shape, float start) {
  HostTensor t = HostTensor::allocate(DType::F32, std::move(shape));
  float* p = t.mutable_as<float>();
  for (int64_t i = 0; i < num_elements(t.shape); ++i) p[i] = start + 0.25f * float(i);
  return t;
}

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

}  // namespace

TEST(KerasH5, ReadsGemmaTinyPreset) {
  auto ds = read_h5_datasets(fixture("keras/preset-gemma-tiny/model.weights.h5"));
  std::cout << "gemma-tiny datasets:\n";
  for (const auto& [name, t] : ds) std::cout << "  " << name << " " << dtype_name(t.dtype) << shape_str(t.shape) << "\n";
  EXPECT_EQ(ds.size(), 20u);

  const HostTensor& emb = ds.at("layers/reversible_embedding/vars/0");
  EXPECT_EQ(emb.dtype, DType::F32);
  EXPECT_EQ(emb.shape, (Shape{1000, 64}));
  const HostTensor& q = ds.at("layers/gemma_decoder_block_1/attention/query_dense/vars/0");
  EXPECT_EQ(q.dtype, DType::F32);
  EXPECT_EQ(q.shape, (Shape{4, 64, 16}));
  // Random weights: not all zero.
  bool nonzero = false;
  for (float v : to_f32(q)) nonzero = nonzero || v != 0.0f;
  EXPECT_TRUE(nonzero);
}

// Contiguous datasets already in their memory type are memory-mapped rather than read through
// libhdf5; a whole-dataset box forces libhdf5's read. Both must give the same bytes, for float32
// (real Keras) and bf16 (our bf16 export) files alike.
TEST(KerasH5, MappedDatasetsEqualLibhdf5Reads) {
  const std::string dir = make_temp_dir("h5_mapped");
  HostTensor bf16 = HostTensor::allocate(DType::BF16, {3, 5, 7});
  for (int64_t i = 0; i < num_elements(bf16.shape); ++i) bf16.mutable_as<uint16_t>()[i] = uint16_t(0x3f80 + 3 * i);
  // 3 bytes of int8 first: HDF5 packs the small datasets after them at odd offsets, as h5py's files
  // have them.
  write_h5_datasets(dir + "/bf16.h5", {{"0/vars/0", HostTensor::allocate(DType::I8, {3})}, {"a/vars/0", bf16},
                                       {"b/vars/0", f32_tensor({4, 6}, -1.0f)}, {"c/vars/0", f32_tensor({64, 33}, 0.5f)}});
  const DatasetSelection whole = [](const std::string&, const Shape& shape) {
    return std::optional<DatasetBox>(DatasetBox{std::vector<int64_t>(shape.size(), 0), shape});
  };
  int mapped = 0;
  for (const std::string& file : {fixture("keras/preset-gemma-tiny/model.weights.h5"), dir + "/bf16.h5"}) {
    const auto views = read_h5_datasets(file), reads = read_h5_datasets(file, whole);
    ASSERT_EQ(views.size(), reads.size());
    for (const auto& [name, view] : views) {
      EXPECT_TRUE(same_bytes(view, reads.at(name))) << file << " " << name;
      EXPECT_FALSE(reads.at(name).mapped) << name;
      if (view.mapped) EXPECT_EQ(reinterpret_cast<uintptr_t>(view.data) % dtype_size(view.dtype), 0u) << name;
      mapped += view.mapped;
    }
  }
  EXPECT_GT(mapped, 0);  // those stored aligned for their type; HDF5 places the rest anywhere
  EXPECT_TRUE(read_h5_datasets(dir + "/bf16.h5").at("c/vars/0").mapped);  // we align datasets of 4 KiB or more

  // The loader's reader maps misaligned datasets too (h5py aligns nothing); permuting such a view
  // into our layout must give what permuting the libhdf5 read gives (the sanitizer leg checks the
  // reads are aligned ones).
  std::filesystem::create_directories(dir + "/preset");
  std::filesystem::copy_file(dir + "/bf16.h5", dir + "/preset/model.weights.h5");
  int misaligned = 0;
  for (const std::string& preset : {fixture("keras/preset-gemma-tiny"), dir + "/preset"}) {
    const KerasWeightsReader reader(preset);
    for (const auto& [name, read] : read_keras_weights_dir(preset, whole)) {
      const HostTensor view = reader.read(name);
      EXPECT_TRUE(view.mapped) << preset << " " << name;
      EXPECT_TRUE(same_bytes(view, read)) << preset << " " << name;
      misaligned += reinterpret_cast<uintptr_t>(view.data) % dtype_size(view.dtype) != 0;
      if (view.shape.size() != 3) continue;
      const std::array<int64_t, 3> dims = {view.shape[0], view.shape[1], view.shape[2]};
      const Shape permuted = {view.shape[2], view.shape[0], view.shape[1]};
      EXPECT_TRUE(same_bytes(permute3(view, dims, {2, 0, 1}, permuted), permute3(read, dims, {2, 0, 1}, permuted)))
          << preset << " " << name;
    }
  }
  EXPECT_GT(misaligned, 0);
}

TEST(KerasH5, ReadsGemma2TinyPresetAndMergedLoraWeights) {
  auto g2 = read_h5_datasets(fixture("keras/preset-gemma2-tiny/model.weights.h5"));
  EXPECT_EQ(g2.at("layers/gemma_decoder_block_1/attention/query_dense/vars/0").shape, (Shape{4, 64, 32}));
  auto merged = read_h5_datasets(fixture("keras/lora-gemma-tiny/model_with_lora.weights.h5"));
  auto base = read_h5_datasets(fixture("keras/preset-gemma-tiny/model.weights.h5"));
  EXPECT_EQ(merged.size(), base.size());
  for (const auto& [name, t] : base) EXPECT_TRUE(merged.count(name)) << name;
}

TEST(KerasH5, ReadsLoraAdapter) {
  auto ds = read_h5_datasets(fixture("keras/lora-gemma-tiny/adapter.lora.h5"));
  std::cout << "adapter datasets:\n";
  for (const auto& [name, t] : ds) std::cout << "  " << name << " " << dtype_name(t.dtype) << shape_str(t.shape) << "\n";
  const HostTensor& rank = ds.at("lora/vars/rank");
  EXPECT_EQ(rank.dtype, DType::I64);
  EXPECT_TRUE(rank.shape.empty());
  EXPECT_EQ(rank.as<int64_t>()[0], 2);
  EXPECT_EQ(ds.at("lora/8/vars/lora_kernel_a").shape, (Shape{1, 64, 2}));
  EXPECT_EQ(ds.at("lora/8/vars/lora_kernel_b").shape, (Shape{2, 16}));
  EXPECT_EQ(ds.at("lora/10/vars/lora_kernel_a").shape, (Shape{4, 64, 2}));
  EXPECT_EQ(ds.size(), 9u);  // rank + A/B for 4 layers
}

TEST(KerasH5, RoundTrip) {
  std::string path = make_temp_dir("h5rt") + "/out.weights.h5";

  HostTensor bf = HostTensor::allocate(DType::BF16, {2, 3});
  for (int i = 0; i < 6; ++i) bf.mutable_as<uint16_t>()[i] = f32_to_bf16(1.5f * float(i) - 2.0f);
  HostTensor i32 = HostTensor::allocate(DType::I32, {4});
  for (int i = 0; i < 4; ++i) i32.mutable_as<int32_t>()[i] = -7 + 1000000 * i;
  HostTensor i64 = HostTensor::allocate(DType::I64, {});
  i64.mutable_as<int64_t>()[0] = (int64_t(1) << 40) + 3;
  HostTensor f32_scalar = HostTensor::allocate(DType::F32, {});
  f32_scalar.mutable_as<float>()[0] = 0.125f;
  HostTensor f16 = HostTensor::allocate(DType::F16, {3});
  f16.mutable_as<uint16_t>()[0] = 0x3c00;  // 1.0
  f16.mutable_as<uint16_t>()[1] = 0xc000;  // -2.0
  f16.mutable_as<uint16_t>()[2] = 0x0001;  // smallest subnormal
  HostTensor u8 = HostTensor::allocate(DType::U8, {2});
  u8.mutable_as<uint8_t>()[0] = 200;
  HostTensor empty = HostTensor::allocate(DType::F32, {0, 4});

  std::vector<std::pair<std::string, HostTensor>> in = {
      {"layers/gemma_decoder_block/attention/query_dense/vars/0", f32_tensor({4, 8, 2}, -3.0f)},
      {"layers/reversible_embedding/vars/0", bf},
      {"optimizer/vars/0", i32},
      {"lora/vars/rank", i64},
      {"deep/a/b/c/d/scalar", f32_scalar},
      {"misc/f16", f16},
      {"misc/u8", u8},
      {"misc/empty", empty},
  };
  write_h5_datasets(path, in, {"vars", "layers/gemma_decoder_block/attention/rope_layer/vars", "layers/reversible_embedding/vars"});
  EXPECT_TRUE(temp_files_of(path).empty()) << temp_files_of(path)[0];

  auto out = read_h5_datasets(path);
  EXPECT_EQ(out.size(), in.size());
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(out.count(name)) << name;
    EXPECT_TRUE(same_bytes(out.at(name), t)) << name;
  }
  EXPECT_EQ(out.at("layers/reversible_embedding/vars/0").dtype, DType::BF16);
  EXPECT_EQ(out.at("lora/vars/rank").as<int64_t>()[0], (int64_t(1) << 40) + 3);

  // What Keras expects in the file: empty groups, bf16's dtype attribute, contiguous fp32 LE.
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  EXPECT_GT(H5Lexists(file, "vars", H5P_DEFAULT), 0);
  EXPECT_GT(H5Lexists(file, "layers/gemma_decoder_block/attention/rope_layer", H5P_DEFAULT), 0);
  EXPECT_GT(H5Lexists(file, "layers/gemma_decoder_block/attention/rope_layer/vars", H5P_DEFAULT), 0);
  hid_t attr = H5Aopen_by_name(file, "layers/reversible_embedding/vars/0", "dtype", H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(attr, 0);
  hid_t str_type = H5Tcopy(H5T_C_S1);
  H5Tset_size(str_type, H5T_VARIABLE);
  H5Tset_cset(str_type, H5T_CSET_UTF8);  // libhdf5 does not convert between ASCII and UTF-8
  char* value = nullptr;
  ASSERT_GE(H5Aread(attr, str_type, &value), 0);
  EXPECT_STREQ(value, "bfloat16");
  H5free_memory(value);
  H5Tclose(str_type);
  H5Aclose(attr);
  hid_t dset = H5Dopen2(file, "layers/gemma_decoder_block/attention/query_dense/vars/0", H5P_DEFAULT);
  hid_t type = H5Dget_type(dset);
  EXPECT_GT(H5Tequal(type, H5T_IEEE_F32LE), 0);
  hid_t dcpl = H5Dget_create_plist(dset);
  EXPECT_EQ(H5Pget_layout(dcpl), H5D_CONTIGUOUS);
  EXPECT_EQ(H5Pget_nfilters(dcpl), 0);
  H5Pclose(dcpl);
  H5Tclose(type);
  H5Dclose(dset);
  H5Fclose(file);

  // Overwriting an existing file replaces it.
  write_h5_datasets(path, {{"x", f32_tensor({2}, 1.0f)}});
  auto again = read_h5_datasets(path);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(to_f32(again.at("x")), (std::vector<float>{1.0f, 1.25f}));
}

TEST(KerasH5, WriteErrorsRemoveTempFile) {
  std::string dir = make_temp_dir("h5werr");
  std::string path = dir + "/dup.h5";
  // The same dataset twice cannot be created.
  expect_error_containing([&] { write_h5_datasets(path, {{"a/b", f32_tensor({2}, 0)}, {"a/b", f32_tensor({2}, 0)}}); },
                          "a/b");
  EXPECT_TRUE(temp_files_of(path).empty()) << temp_files_of(path)[0];
  EXPECT_FALSE(std::filesystem::exists(path));
  // A missing directory names the file.
  expect_error_containing([&] { write_h5_datasets(dir + "/no/such/dir/x.h5", {{"a", f32_tensor({1}, 0)}}); }, "x.h5");
}

// The streaming form makes each dataset just before writing it: in order, one at a time, and
// a tensor that is not what was declared is an error naming the dataset (no file is left).
TEST(KerasH5, StreamedWriteMakesEachDatasetInTurn) {
  std::string dir = make_temp_dir("h5stream");
  const std::string path = dir + "/s.h5";
  const std::vector<TensorSpec> specs = {{"a/vars/0", DType::F32, {2, 3}}, {"b/vars/0", DType::F32, {4}}};
  std::vector<size_t> made;
  write_h5_datasets(path, specs, [&](size_t i) {
    made.push_back(i);
    return f32_tensor(specs[i].shape, float(i));
  });
  EXPECT_EQ(made, (std::vector<size_t>{0, 1}));
  auto out = read_h5_datasets(path);
  EXPECT_EQ(to_f32(out.at("b/vars/0")), (std::vector<float>{1.0f, 1.25f, 1.5f, 1.75f}));

  const std::string bad = dir + "/bad.h5";
  expect_error_containing([&] { write_h5_datasets(bad, specs, [&](size_t i) { return f32_tensor({5}, 0); }); },
                          "a/vars/0");
  EXPECT_FALSE(std::filesystem::exists(bad));
  EXPECT_TRUE(temp_files_of(bad).empty()) << temp_files_of(bad)[0];
}

TEST(KerasH5, ShardedDirectoryMerges) {
  std::string dir = make_temp_dir("h5shard");
  write_h5_datasets(dir + "/model_00000.weights.h5",
                    {{"layers/reversible_embedding/vars/0", f32_tensor({5, 4}, 0.0f)},
                     {"layers/gemma_decoder_block/attention/query_dense/vars/0", f32_tensor({2, 4, 3}, 1.0f)}});
  write_h5_datasets(dir + "/model_00001.weights.h5",
                    {{"layers/gemma_decoder_block/attention/key_dense/vars/0", f32_tensor({1, 4, 3}, 2.0f)},
                     {"layers/rms_normalization/vars/0", f32_tensor({4}, 3.0f)}});
  write_text_file(dir + "/model.weights.json", R"({
    "metadata": {"total_size": 400},
    "weight_map": {
      "/layers/reversible_embedding/vars": "model_00000.weights.h5",
      "/layers/gemma_decoder_block/attention/query_dense/vars": ["model_00000.weights.h5"],
      "/layers/gemma_decoder_block/attention/key_dense/vars": ["model_00000.weights.h5", "model_00001.weights.h5"],
      "/layers/rms_normalization/vars": "model_00001.weights.h5"
    }})");
  auto ds = read_keras_weights_dir(dir);
  ASSERT_EQ(ds.size(), 4u);
  EXPECT_EQ(ds.at("layers/rms_normalization/vars/0").shape, (Shape{4}));
  EXPECT_EQ(to_f32(ds.at("layers/rms_normalization/vars/0"))[1], 3.25f);
  EXPECT_EQ(ds.at("layers/gemma_decoder_block/attention/key_dense/vars/0").shape, (Shape{1, 4, 3}));
}

TEST(KerasH5, PresetDirectoryWithSingleFile) {
  auto ds = read_keras_weights_dir(fixture("keras/preset-gemma-tiny"));
  EXPECT_EQ(ds.size(), 20u);
}

TEST(KerasH5, Errors) {
  std::string dir = make_temp_dir("h5err");

  expect_error_containing([&] { read_h5_datasets(dir + "/missing.h5"); }, "missing.h5");

  write_text_file(dir + "/text.h5", "this is not an HDF5 file at all, just some text\n");
  expect_error_containing([&] { read_h5_datasets(dir + "/text.h5"); }, "text.h5");

  std::string whole = read_text_file(fixture("keras/preset-gemma-tiny/model.weights.h5"));
  write_text_file(dir + "/half.h5", whole.substr(0, whole.size() / 2));
  expect_error_containing([&] { read_h5_datasets(dir + "/half.h5"); }, "half.h5");
  // Truncated almost at the end too (the superblock's end-of-file address no longer matches).
  write_text_file(dir + "/short.h5", whole.substr(0, whole.size() - 100));
  expect_error_containing([&] { read_h5_datasets(dir + "/short.h5"); }, "short.h5");

  // Missing shard named by the json: the error names the json.
  std::string sharded = dir + "/sharded";
  std::filesystem::create_directories(sharded);
  write_text_file(sharded + "/model.weights.json",
                  R"({"weight_map": {"/layers/reversible_embedding/vars": "model_00000.weights.h5"}})");
  expect_error_containing([&] { read_keras_weights_dir(sharded); }, "model.weights.json");
  expect_error_containing([&] { read_keras_weights_dir(sharded); }, "model_00000.weights.h5");

  // A shard name that escapes the directory is refused.
  write_text_file(sharded + "/model.weights.json", R"({"weight_map": {"/x/vars": "../x.h5"}})");
  expect_error_containing([&] { read_keras_weights_dir(sharded); }, "model.weights.json");

  // Neither file: names the directory and both file names.
  std::string empty = dir + "/empty";
  std::filesystem::create_directories(empty);
  try {
    read_keras_weights_dir(empty);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(empty), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.weights.h5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.weights.json"), std::string::npos) << msg;
  }
}

// Bytes overwritten in the middle: libhdf5 may notice (Error) or read garbage, but must not crash.
TEST(KerasH5, CorruptedMiddleDoesNotCrash) {
  std::string dir = make_temp_dir("h5corrupt");
  std::string whole = read_text_file(fixture("keras/preset-gemma-tiny/model.weights.h5"));
  for (size_t offset : {size_t(1000), whole.size() / 3, whole.size() / 2}) {
    std::string bad = whole;
    for (size_t i = offset; i < offset + 4096 && i < bad.size(); ++i) bad[i] = char(0xA5 ^ (i * 31));
    std::string path = dir + "/bad_" + std::to_string(offset) + ".h5";
    write_text_file(path, bad);
    try {
      auto ds = read_h5_datasets(path);
      std::cout << "offset " << offset << ": read " << ds.size() << " datasets\n";
    } catch (const Error& e) {
      std::cout << "offset " << offset << ": " << e.what() << "\n";
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
    }
  }
}

// A tiny file that declares a huge dataset (never written, so no storage) is refused before allocation.
TEST(KerasH5, RejectsShapeBomb) {
  std::string path = make_temp_dir("h5bomb") + "/bomb.h5";
  {
    // Written directly with libhdf5: our writer always writes the data.
    hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(file, 0);
    hsize_t dims[2] = {1u << 20, 1u << 16};  // 2^36 floats = 256 GiB
    hid_t space = H5Screate_simple(2, dims, nullptr);
    hid_t dset = H5Dcreate2(file, "big", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(dset, 0);
    H5Dclose(dset);
    H5Sclose(space);
    H5Fclose(file);
  }
  expect_error_containing([&] { read_h5_datasets(path); }, "declares");
}

// Sharded loading: a box (HDF5 hyperslab) reads exactly that part of a dataset, also for bf16;
// other datasets are read whole; a box outside the dataset is an error naming it.
TEST(KerasH5, ReadsOnlyTheSelectedBlock) {
  const std::string path = fixture("keras/preset-gemma-tiny/model.weights.h5");
  const std::string query = "layers/gemma_decoder_block/attention/query_dense/vars/0";  // (4, 64, 16)
  auto whole = read_h5_datasets(path);
  auto part = read_h5_datasets(path, [&](const std::string& name, const Shape& shape) -> std::optional<DatasetBox> {
    if (name != query) return std::nullopt;
    EXPECT_EQ(shape, Shape({4, 64, 16}));
    return DatasetBox{{2, 8, 0}, {2, 32, 16}};
  });
  ASSERT_EQ(part.at(query).shape, Shape({2, 32, 16}));
  const float* all = whole.at(query).as<float>();
  const float* got = part.at(query).as<float>();
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t d = 0; d < 32; ++d)
      for (int64_t h = 0; h < 16; ++h)
        ASSERT_EQ(got[(n * 32 + d) * 16 + h], all[((n + 2) * 64 + d + 8) * 16 + h]) << n << " " << d << " " << h;
  for (const auto& [name, t] : whole)
    if (name != query) EXPECT_EQ(part.at(name).shape, t.shape) << name;

  // bf16 (2-byte opaque) datasets are cut the same way.
  const std::string dir = make_temp_dir("h5box");
  std::vector<uint16_t> bits(6 * 4);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = uint16_t(0x3f80 + i);
  HostTensor t = HostTensor::allocate(DType::BF16, {6, 4});
  std::memcpy(t.mutable_as<std::byte>(), bits.data(), bits.size() * 2);
  write_h5_datasets(dir + "/w.h5", {{"x", t}});
  auto box = read_h5_datasets(dir + "/w.h5", [](const std::string&, const Shape&) {
    return std::optional<DatasetBox>(DatasetBox{{3, 1}, {3, 2}});
  });
  ASSERT_EQ(box.at("x").dtype, DType::BF16);
  ASSERT_EQ(box.at("x").shape, Shape({3, 2}));
  const uint16_t* b = box.at("x").as<uint16_t>();
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 2; ++c) EXPECT_EQ(b[r * 2 + c], bits[size_t((r + 3) * 4 + c + 1)]);

  try {
    read_h5_datasets(dir + "/w.h5", [](const std::string&, const Shape&) {
      return std::optional<DatasetBox>(DatasetBox{{4, 0}, {3, 4}});
    });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dataset x"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("outside"), std::string::npos) << e.what();
  }
}
