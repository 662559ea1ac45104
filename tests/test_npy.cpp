// .npy reading against the Keras fixtures, round trips for every writable dtype, and the errors a
// damaged or unsupported file gives.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/npy.h"
#include "core/file_util.h"
#include "test_util.h"

namespace meshtune {
namespace {

using nlohmann::json;
using testing::fixture;
using testing::make_temp_dir;
using testing::read_text_file;
using testing::load_json;

Shape json_shape(const json& j) {
  Shape s;
  for (const auto& d : j) s.push_back(d.get<int64_t>());
  return s;
}

// Runs f and expects an Error whose message names `path` and contains `fragment`.
template <typename F>
void expect_error(F f, const std::string& path, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an Error for " << path;
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << "wanted '" << fragment << "' in: " << msg;
  }
}

// Writes a hand-made .npy file: magic, version, header length, header text as given, then data.
void write_raw_npy(const std::string& path, int major, const std::string& header, const std::string& data) {
  std::string bytes = "\x93NUMPY";
  bytes.push_back(char(major));
  bytes.push_back(0);
  uint32_t len = uint32_t(header.size());
  int len_bytes = major == 1 ? 2 : 4;
  for (int i = 0; i < len_bytes; ++i) bytes.push_back(char((len >> (8 * i)) & 0xff));
  bytes += header;
  bytes += data;
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// Reads every fixture array, checks it against index.json, and writes it back: numpy's own writer
// made these files, so ours must reproduce them byte for byte.
TEST(Npy, KerasFixturesMatchIndex) {
  const std::string dir = fixture("keras/outputs-gemma-tiny");
  const std::string out_dir = make_temp_dir("npy");
  json index = load_json(dir + "/index.json");
  int arrays = 0;
  for (const auto& [name, entry] : index.items()) {
    if (!entry.is_object() || !entry.contains("file")) continue;  // "_inputs", "_outputs" are notes
    SCOPED_TRACE(name);
    const std::string file = entry["file"].get<std::string>();
    HostTensor t = read_npy(dir + "/" + file);
    EXPECT_EQ(t.shape, json_shape(entry["shape"]));
    EXPECT_EQ(std::string(dtype_name(t.dtype)), entry["dtype"].get<std::string>());
    EXPECT_NE(t.data, nullptr);
    EXPECT_TRUE(t.owner);
    write_npy(out_dir + "/" + file, t);
    EXPECT_TRUE(read_text_file(out_dir + "/" + file) == read_text_file(dir + "/" + file)) << file;
    ++arrays;
  }
  EXPECT_GE(arrays, 12);
}

TEST(Npy, KerasFixtureValues) {
  const std::string dir = fixture("keras/outputs-gemma-tiny");
  json index = load_json(dir + "/index.json");
  json tokenization = load_json(fixture("keras/summary-gemma-tiny.json"))["tokenization"];

  HostTensor ids = read_npy(dir + "/token_ids.npy");
  HostTensor mask = read_npy(dir + "/padding_mask.npy");
  ASSERT_EQ(ids.dtype, DType::I32);
  ASSERT_EQ(ids.shape.size(), 2u);
  const int64_t rows = ids.shape[0], cols = ids.shape[1];
  ASSERT_EQ(rows, int64_t(tokenization.size()));
  // Per index.json's note: row r = [bos] + tokens of text r (+ tokens of text 0 as filler), cut to
  // the sequence length; row 1 keeps row1_right_padded_real_len tokens then <pad> = 0.
  const int64_t row1_len = index["_inputs"]["row1_right_padded_real_len"].get<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int> expected = {2};
    for (const auto& id : tokenization[r]["keras_tokenizer_ids"]) expected.push_back(id.get<int>());
    for (const auto& id : tokenization[0]["keras_tokenizer_ids"]) expected.push_back(id.get<int>());
    for (int64_t c = 0; c < cols; ++c) {
      bool padded = r == 1 && c >= row1_len;
      EXPECT_EQ(ids.as<int32_t>()[r * cols + c], padded ? 0 : expected[c]) << r << "," << c;
      EXPECT_EQ(mask.as<int32_t>()[r * cols + c], padded ? 0 : 1) << r << "," << c;
    }
  }

  HostTensor logits = read_npy(dir + "/logits.npy");
  ASSERT_EQ(logits.dtype, DType::F32);
  size_t n = size_t(num_elements(logits.shape));
  double sum_abs = 0;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(logits.as<float>()[i])) << i;
    sum_abs += std::fabs(logits.as<float>()[i]);
  }
  EXPECT_GT(sum_abs, 0.0);

  HostTensor greedy_mask = read_npy(dir + "/generate_greedy_padding_mask.npy");
  ASSERT_EQ(greedy_mask.dtype, DType::BOOL);
  int ones = 0;
  for (int64_t i = 0; i < num_elements(greedy_mask.shape); ++i) {
    uint8_t b = greedy_mask.as<uint8_t>()[i];
    EXPECT_TRUE(b == 0 || b == 1);
    ones += b;
  }
  EXPECT_GT(ones, 0);
}

// Fills a tensor's bytes with a pattern that is valid for its dtype.
HostTensor make_tensor(DType dt, Shape shape) {
  HostTensor t = HostTensor::allocate(dt, shape);
  size_t n = size_t(num_elements(t.shape));
  for (size_t i = 0; i < n; ++i) {
    switch (dt) {
      case DType::F32: t.mutable_as<float>()[i] = float(i) * 0.5f - 3.25f; break;
      case DType::F16: t.mutable_as<uint16_t>()[i] = uint16_t(0x3c00 + i); break;
      case DType::I32: t.mutable_as<int32_t>()[i] = int32_t(i * 7919) - 100000; break;
      case DType::I64: t.mutable_as<int64_t>()[i] = (int64_t(1) << 40) * int64_t(i) - 5; break;
      case DType::U8: t.mutable_as<uint8_t>()[i] = uint8_t(i * 37); break;
      case DType::BOOL: t.mutable_as<uint8_t>()[i] = uint8_t(i % 3 == 0); break;
      case DType::BF16: break;
    }
  }
  return t;
}

TEST(Npy, RoundTripEveryDtypeAndShape) {
  const std::string dir = make_temp_dir("npy");
  const std::vector<DType> dtypes = {DType::F32, DType::F16, DType::I32, DType::I64, DType::U8, DType::BOOL};
  const std::vector<Shape> shapes = {{2, 3}, {}, {2, 0}, {5}, {3, 1, 4}, {0}};
  for (DType dt : dtypes) {
    for (const Shape& shape : shapes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + shape_str(shape));
      const std::string path = dir + "/a.npy";
      HostTensor t = make_tensor(dt, shape);
      write_npy(path, t);
      EXPECT_TRUE(temp_files_of(path).empty()) << temp_files_of(path)[0];

      // Format 1.0 with the header padded to a multiple of 64 bytes and ending in '\n'.
      std::string bytes = read_text_file(path);
      ASSERT_GE(bytes.size(), 10u);
      EXPECT_EQ(bytes.substr(0, 6), "\x93NUMPY");
      EXPECT_EQ(bytes[6], 1);
      EXPECT_EQ(bytes[7], 0);
      size_t header_len = uint8_t(bytes[8]) | size_t(uint8_t(bytes[9])) << 8;
      EXPECT_EQ((10 + header_len) % 64, 0u);
      ASSERT_EQ(bytes.size(), 10 + header_len + t.nbytes());
      EXPECT_EQ(bytes[10 + header_len - 1], '\n');
      std::string header = bytes.substr(10, header_len);
      EXPECT_NE(header.find("'shape': " + shape_str(shape)), std::string::npos) << header;

      HostTensor back = read_npy(path);
      EXPECT_EQ(back.dtype, dt);
      EXPECT_EQ(back.shape, shape);
      ASSERT_EQ(back.nbytes(), t.nbytes());
      if (t.nbytes() > 0) {
        EXPECT_EQ(std::memcmp(back.data, t.data, t.nbytes()), 0);
      }
    }
  }
}

TEST(Npy, ZeroDimHeaderAndOneDimHeader) {
  const std::string dir = make_temp_dir("npy");
  write_npy(dir + "/scalar.npy", make_tensor(DType::F32, {}));
  EXPECT_NE(read_text_file(dir + "/scalar.npy").find("'shape': ()"), std::string::npos);
  write_npy(dir + "/vec.npy", make_tensor(DType::I32, {3}));
  EXPECT_NE(read_text_file(dir + "/vec.npy").find("'shape': (3,)"), std::string::npos);
}

TEST(Npy, OverwritesExistingFile) {
  const std::string dir = make_temp_dir("npy");
  const std::string path = dir + "/a.npy";
  write_npy(path, make_tensor(DType::F32, {100}));
  write_npy(path, make_tensor(DType::I32, {2}));
  HostTensor back = read_npy(path);
  EXPECT_EQ(back.dtype, DType::I32);
  EXPECT_EQ(back.shape, Shape({2}));
}

TEST(Npy, ReadsVersion2And3AndVariantHeaders) {
  const std::string dir = make_temp_dir("npy");
  std::string data(6 * 4, '\0');
  for (int i = 0; i < 6; ++i) {
    int32_t v = i * 11;
    std::memcpy(&data[4 * i], &v, 4);
  }
  for (int major : {2, 3}) {
    const std::string path = dir + "/v" + std::to_string(major) + ".npy";
    write_raw_npy(path, major, "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }   \n", data);
    HostTensor t = read_npy(path);
    EXPECT_EQ(t.dtype, DType::I32);
    EXPECT_EQ(t.shape, Shape({2, 3}));
    EXPECT_EQ(t.as<int32_t>()[5], 55);
  }
  // Keys in another order, double quotes, no trailing comma, no padding, trailing data ignored.
  const std::string path = dir + "/variant.npy";
  write_raw_npy(path, 1, "{\"shape\": (6,), \"fortran_order\": False, \"descr\": \"<i4\"}", data + "xx");
  HostTensor t = read_npy(path);
  EXPECT_EQ(t.shape, Shape({6}));
  EXPECT_EQ(t.as<int32_t>()[3], 33);
}

TEST(Npy, ErrorsNameTheFile) {
  const std::string dir = make_temp_dir("npy");
  const std::string ok_header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }\n";
  const std::string data(24, '\0');

  const std::string missing = dir + "/missing.npy";
  expect_error([&] { read_npy(missing); }, missing, "not found");

  const std::string bad_magic = dir + "/bad_magic.npy";
  {
    std::ofstream out(bad_magic, std::ios::binary);
    out << "PK\x03\x04 this is not an npy file at all";
  }
  expect_error([&] { read_npy(bad_magic); }, bad_magic, "bad magic");

  const std::string empty = dir + "/empty.npy";
  { std::ofstream out(empty, std::ios::binary); }
  expect_error([&] { read_npy(empty); }, empty, "bad magic");

  const std::string truncated = dir + "/truncated.npy";
  write_raw_npy(truncated, 1, ok_header, data.substr(0, 20));
  expect_error([&] { read_npy(truncated); }, truncated, "data shorter");

  // An absurd shape must be rejected from the file size, not by trying to allocate it.
  const std::string huge = dir + "/huge.npy";
  write_raw_npy(huge, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4000000000, 4000000000, 7), }\n", data);
  expect_error([&] { read_npy(huge); }, huge, "data shorter");

  const std::string header_cut = dir + "/header_cut.npy";
  write_raw_npy(header_cut, 1, ok_header, "");
  {
    std::string bytes = read_text_file(header_cut);
    std::ofstream out(header_cut, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), 30);
  }
  expect_error([&] { read_npy(header_cut); }, header_cut, "truncated");

  const std::string fortran = dir + "/fortran.npy";
  write_raw_npy(fortran, 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }\n", data);
  expect_error([&] { read_npy(fortran); }, fortran, "Fortran");

  for (const std::string descr : {">f4", "<f8", "<U3", "|O"}) {
    const std::string path = dir + "/descr.npy";
    write_raw_npy(path, 1, "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (2, 3), }\n", data + data);
    expect_error([&] { read_npy(path); }, path, "unsupported .npy dtype '" + descr + "'");
  }

  const std::string version = dir + "/version.npy";
  write_raw_npy(version, 1, ok_header, data);
  {
    std::string bytes = read_text_file(version);
    bytes[6] = 9;
    std::ofstream out(version, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), std::streamsize(bytes.size()));
  }
  expect_error([&] { read_npy(version); }, version, "version");

  const std::string garbled = dir + "/garbled.npy";
  write_raw_npy(garbled, 1, "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2, 3), }\n", data);
  expect_error([&] { read_npy(garbled); }, garbled, "malformed");

  const std::string negative = dir + "/negative.npy";
  write_raw_npy(negative, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }\n", data);
  expect_error([&] { read_npy(negative); }, negative, "malformed");
}

TEST(Npy, WriteErrorsNameTheFile) {
  const std::string dir = make_temp_dir("npy");
  const std::string path = dir + "/bf16.npy";
  expect_error([&] { write_npy(path, HostTensor::allocate(DType::BF16, {2})); }, path, "bfloat16");
  EXPECT_FALSE(std::filesystem::exists(path));

  const std::string no_dir = dir + "/no/such/dir/a.npy";
  expect_error([&] { write_npy(no_dir, HostTensor::allocate(DType::F32, {2})); }, no_dir, "cannot open");
}

}  // namespace
}  // namespace meshtune
