// Data sources (TFRecord, aclImdb, JSONL, text, .npy), CRC-32C, and BatchStream's order and contents.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/file_util.h"
#include "io/npy.h"
#include "data/batches.h"
#include "data/crc32c.h"
#include "data/dataset.h"
#include "test_util.h"
#include "text/preprocessor.h"
#include "text/tokenizer.h"

namespace meshtune {
namespace {

namespace fs = std::filesystem;
using testing::fixture;
using testing::make_temp_dir;

const std::string kKerasModel = "keras/preset-gemma-tiny/assets/tokenizer/vocabulary.spm";

template <typename F>
void expect_error(F f, const std::vector<std::string>& fragments) {
  try {
    f();
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const auto& fragment : fragments) {
      EXPECT_NE(msg.find(fragment), std::string::npos) << "wanted '" << fragment << "' in: " << msg;
    }
  }
}

void write_text(const std::string& path, const std::string& contents) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << contents;
}

// Frames arbitrary payloads as TFRecord records (to build records that are not Examples).
std::string frame_records(const std::vector<std::string>& payloads) {
  std::string out;
  for (const auto& data : payloads) {
    uint64_t n = data.size();
    std::string len(reinterpret_cast<const char*>(&n), 8);
    uint32_t len_crc = masked_crc32c(len.data(), 8), data_crc = masked_crc32c(data.data(), data.size());
    out += len;
    out.append(reinterpret_cast<const char*>(&len_crc), 4);
    out += data;
    out.append(reinterpret_cast<const char*>(&data_crc), 4);
  }
  return out;
}

// ---- CRC-32C and TFRecord ----

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  // 32 zero bytes: the iSCSI (RFC 3720) test vector.
  std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TFRecord, WriteAndReadBack) {
  std::string dir = make_temp_dir("tfrecord");
  std::string path = dir + "/reviews.tfrecord";
  std::vector<std::string> texts = {"A fine film.<br /><br />Really.", "", std::string("bytes\0inside", 12),
                                    "naïve café ☕"};
  write_tfrecord_texts(path, texts);
  Dataset a = load_dataset("tfrecord:" + path);
  EXPECT_EQ(a.texts, texts);
  EXPECT_FALSE(a.pretokenized());
  EXPECT_EQ(a.source, "tfrecord:" + path);
  // Detected by name without the prefix.
  EXPECT_EQ(load_dataset(path).texts, texts);
}

// The record bytes are tf.train.Example's public wire format, built here by hand.
TEST(TFRecord, WireFormat) {
  std::string dir = make_temp_dir("tfwire");
  std::string path = dir + "/one.tfrecord";
  write_tfrecord_texts(path, {"hi"});
  const std::string expected_example =
      std::string("\x0a\x10")                  // Example.features, 16 bytes
      + "\x0a\x0e"                             // Features.feature map entry, 14 bytes
      + "\x0a\x04text"                         // entry key
      + "\x12\x06"                             // entry value: Feature, 6 bytes
      + "\x0a\x04"                             // Feature.bytes_list, 4 bytes
      + "\x0a\x02hi";                          // BytesList.value
  EXPECT_EQ(testing::read_text_file(path), frame_records({expected_example}));
}

// Example { features { feature { key: "label" value { int64_list { value: 3 } } } } }
const std::string kLabelEntry = std::string("\x0a\x05label\x12\x05\x1a\x03\x0a\x01\x03", 14);
const std::string kLabelOnly = std::string("\x0a\x10\x0a\x0e") + kLabelEntry;

// A record as tfds writes imdb_reviews (label and text features), plus an unknown varint field.
TEST(TFRecord, ReadsImdbStyleExample) {
  const std::string text_entry = std::string("\x0a\x04text\x12\x06\x0a\x04\x0a\x02hi", 14);
  const std::string features = "\x0a\x0e" + kLabelEntry + "\x0a\x0e" + text_entry;
  ASSERT_EQ(features.size(), 32u);
  const std::string example = "\x28\x07\x0a\x20" + features;
  std::string dir = make_temp_dir("tfimdb");
  write_text(dir + "/imdb_reviews-train.tfrecord-00000-of-00001", frame_records({example, example}));
  EXPECT_EQ(load_dataset(dir + "/imdb_reviews-train.tfrecord-00000-of-00001").texts,
            (std::vector<std::string>{"hi", "hi"}));
}

TEST(TFRecord, DirectoryInNameOrder) {
  std::string dir = make_temp_dir("tfdir");
  write_tfrecord_texts(dir + "/imdb_reviews-train.tfrecord-00001-of-00002", {"c", "d"});
  write_tfrecord_texts(dir + "/imdb_reviews-train.tfrecord-00000-of-00002", {"a", "b"});
  write_text(dir + "/dataset_info.json", "{}");  // not a record file: ignored
  EXPECT_EQ(load_dataset("tfrecord:" + dir).texts, (std::vector<std::string>{"a", "b", "c", "d"}));
}

TEST(TFRecord, FlippedByteFailsCrc) {
  std::string dir = make_temp_dir("tfcrc");
  std::string path = dir + "/bad.tfrecord";
  write_tfrecord_texts(path, {"first review", "second review"});
  std::string bytes = testing::read_text_file(path);
  bytes[bytes.size() - 8] ^= 0x01;  // inside the second record's data
  write_text(path, bytes);
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "CRC", "record 1"});

  // A corrupt length is caught by the length CRC.
  write_tfrecord_texts(path, {"x"});
  bytes = testing::read_text_file(path);
  bytes[0] ^= 0x40;
  write_text(path, bytes);
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "length CRC", "record 0"});

  // A cut-off file.
  write_tfrecord_texts(path, {"some text"});
  bytes = testing::read_text_file(path);
  write_text(path, bytes.substr(0, bytes.size() - 2));
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "truncated"});
}

TEST(TFRecord, NotAnExampleOrNoText) {
  std::string dir = make_temp_dir("tfbad");
  std::string path = dir + "/bad.tfrecord";
  write_text(path, frame_records({"\xff\xff\xff\xff"}));
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "record 0", "not a tf.train.Example"});

  // A valid Example whose only feature is int64 `label` (= 3).
  write_tfrecord_texts(dir + "/ok.tfrecord", {"ok"});
  write_text(path, testing::read_text_file(dir + "/ok.tfrecord") + frame_records({kLabelOnly}));
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "record 1", "no feature 'text'"});
  // An empty record is an empty Example.
  write_text(path, frame_records({""}));
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "record 0", "no feature 'text'"});

  // A `text` feature that is not bytes: an int64 list.
  const std::string int_text = std::string("\x0a\x0f\x0a\x0d\x0a\x04text\x12\x05\x1a\x03\x0a\x01\x03", 17);
  write_text(path, frame_records({int_text}));
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "record 0", "not a single bytes value"});

  // A length that runs past the end of the record.
  write_text(path, frame_records({"\x0a\x7f\x0a"}));
  expect_error([&] { load_dataset("tfrecord:" + path); }, {path, "record 0", "not a tf.train.Example"});

  // A custom field name that the records lack.
  expect_error([&] { load_dataset("tfrecord:" + dir + "/ok.tfrecord", DataFields{"body"}); }, {"ok.tfrecord", "body"});
}

// ---- aclImdb ----

TEST(AclImdb, TrainFolders) {
  std::string root = make_temp_dir("aclimdb") + "/aclImdb";
  write_text(root + "/train/pos/2_9.txt", "Great.<br /><br />Loved it.\n");
  write_text(root + "/train/pos/10_8.txt", "Good.");
  write_text(root + "/train/neg/0_1.txt", "  Bad. ");
  write_text(root + "/train/unsup/5_0.txt", "Unlabelled.");
  write_text(root + "/train/urls_pos.txt", "http://example");  // not in a label folder
  write_text(root + "/train/pos/notes.md", "ignored");
  write_text(root + "/test/pos/0_10.txt", "test split, not read");
  const std::vector<std::string> want = {"Good.", "Great.<br /><br />Loved it.", "Bad.", "Unlabelled."};
  EXPECT_EQ(load_dataset("aclimdb:" + root).texts, want);
  EXPECT_EQ(load_dataset(root).texts, want);                       // detected: has train/
  EXPECT_EQ(load_dataset("aclimdb:" + root + "/train").texts, want);  // the split folder itself

  std::string empty = make_temp_dir("aclempty");
  expect_error([&] { load_dataset("aclimdb:" + empty); }, {empty, "pos/neg/unsup"});
  fs::create_directories(empty + "/train/pos");
  expect_error([&] { load_dataset("aclimdb:" + empty); }, {"no examples in", empty});
}

// ---- JSONL ----

TEST(Jsonl, Good) {
  std::string dir = make_temp_dir("jsonl");
  std::string path = dir + "/data.jsonl";
  write_text(path, "{\"text\": \"first\", \"label\": 1}\n\n  \r\n{\"text\": \"caf\\u00e9 \\\"q\\\"\", \"body\": \"b\"}\r\n");
  Dataset d = load_dataset(path);
  EXPECT_EQ(d.texts, (std::vector<std::string>{"first", "café \"q\""}));
  write_text(path, "{\"body\": \"x\"}\n{\"body\": \"y\", \"text\": 3}");
  EXPECT_EQ(load_dataset("jsonl:" + path, DataFields{"body"}).texts, (std::vector<std::string>{"x", "y"}));
}

// Prompt/response pairs (Keras' {"prompts", "responses"}, also the singular names), for the
// answer-only loss; the first example decides whether the file holds pairs or texts.
TEST(Jsonl, PromptResponsePairs) {
  std::string dir = make_temp_dir("jsonlpairs");
  std::string path = dir + "/pairs.jsonl";
  write_text(path, "{\"prompts\": \"Say hi\", \"responses\": \"hi\"}\n{\"prompt\": \"Who?\", \"response\": \"Us.\"}\n");
  Dataset d = load_dataset(path);
  EXPECT_EQ(d.texts, (std::vector<std::string>{"Say hi", "Who?"}));
  EXPECT_EQ(d.responses, (std::vector<std::string>{"hi", "Us."}));
  write_text(path, "{\"q\": \"a\", \"a\": \"b\"}\n");
  DataFields fields;
  fields.prompt = "q";
  fields.response = "a";
  EXPECT_EQ(load_dataset("jsonl:" + path, fields).responses, (std::vector<std::string>{"b"}));
  write_text(path, "{\"prompts\": \"a\", \"responses\": \"b\"}\n{\"prompts\": \"c\"}\n");
  expect_error([&] { load_dataset(path); }, {path, "line 2", "responses"});
  write_text(path, "{\"prompts\": \"a\", \"responses\": \"\"}\n");
  expect_error([&] { load_dataset(path); }, {path, "line 1", "empty response"});
  write_text(path, "{\"prompts\": \"a\", \"responses\": 4}\n");
  expect_error([&] { load_dataset(path); }, {path, "line 1", "strings"});
}

TEST(Jsonl, Errors) {
  std::string dir = make_temp_dir("jsonlbad");
  std::string path = dir + "/data.jsonl";
  write_text(path, "{\"text\": \"a\"}\n\n{\"text\": \"b\"\n");
  expect_error([&] { load_dataset(path); }, {path, "line 3", "JSON"});
  write_text(path, "{\"text\": \"a\"}\n{\"other\": \"b\"}\n");
  expect_error([&] { load_dataset(path); }, {path, "line 2", "text"});
  write_text(path, "{\"text\": 5}\n");
  expect_error([&] { load_dataset(path); }, {path, "line 1", "not a string"});
  write_text(path, "[\"text\"]\n");
  expect_error([&] { load_dataset(path); }, {path, "line 1", "object"});
}

// ---- text ----

TEST(Text, LinesAndDirectory) {
  std::string dir = make_temp_dir("text");
  write_text(dir + "/lines.txt", "first line\n\nsecond line\r\n   \nthird");
  EXPECT_EQ(load_dataset(dir + "/lines.txt").texts,
            (std::vector<std::string>{"first line", "second line", "third"}));
  EXPECT_EQ(load_dataset("text:" + dir + "/lines.txt").texts.size(), 3u);

  std::string docs = dir + "/docs";
  write_text(docs + "/b.txt", "Second document.\nTwo lines.\n");
  write_text(docs + "/a.txt", "First document.");
  write_text(docs + "/c.md", "not a .txt");
  EXPECT_EQ(load_dataset(docs).texts,
            (std::vector<std::string>{"First document.", "Second document.\nTwo lines."}));
}

TEST(Text, EmptyAndMissing) {
  std::string dir = make_temp_dir("textempty");
  write_text(dir + "/empty.txt", "");
  expect_error([&] { load_dataset(dir + "/empty.txt"); }, {"no examples in", dir + "/empty.txt"});
  write_text(dir + "/blank.txt", "\n  \n\n");
  expect_error([&] { load_dataset("text:" + dir + "/blank.txt"); }, {"no examples in", "blank.txt"});
  write_text(dir + "/empty.jsonl", "\n");
  expect_error([&] { load_dataset(dir + "/empty.jsonl"); }, {"no examples in", "empty.jsonl"});
  write_tfrecord_texts(dir + "/empty.tfrecord", {});
  expect_error([&] { load_dataset(dir + "/empty.tfrecord"); }, {"no examples in", "empty.tfrecord"});
  expect_error([&] { load_dataset(dir + "/missing.txt"); }, {dir + "/missing.txt", "does not exist"});
  expect_error([&] { load_dataset("jsonl:" + dir + "/missing.jsonl"); }, {"missing.jsonl"});
}

// ---- npy ----

HostTensor int_tensor(DType dtype, Shape shape, const std::vector<int64_t>& values) {
  HostTensor t = HostTensor::allocate(dtype, shape);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::I32) t.mutable_as<int32_t>()[i] = int32_t(values[i]);
    if (dtype == DType::I64) t.mutable_as<int64_t>()[i] = values[i];
  }
  return t;
}

TEST(Npy, Rows) {
  std::string dir = make_temp_dir("npy");
  std::vector<int64_t> v = {2, 10, 11, 1, 0, 2, 12, 1, 0, 0};
  write_npy(dir + "/ids.npy", int_tensor(DType::I32, {2, 5}, v));
  Dataset d = load_dataset(dir + "/ids.npy");
  ASSERT_TRUE(d.pretokenized());
  EXPECT_EQ(d.size(), 2u);
  EXPECT_EQ(d.token_rows[0], (std::vector<int32_t>{2, 10, 11, 1, 0}));
  EXPECT_EQ(d.token_rows[1], (std::vector<int32_t>{2, 12, 1, 0, 0}));
  write_npy(dir + "/ids64.npy", int_tensor(DType::I64, {2, 5}, v));
  EXPECT_EQ(load_dataset("npy:" + dir + "/ids64.npy").token_rows, d.token_rows);
}

TEST(Npy, Errors) {
  std::string dir = make_temp_dir("npybad");
  write_npy(dir + "/flat.npy", int_tensor(DType::I32, {4}, {2, 1, 0, 0}));
  expect_error([&] { load_dataset(dir + "/flat.npy"); }, {"flat.npy", "2-D"});
  write_npy(dir + "/narrow.npy", int_tensor(DType::I32, {3, 1}, {2, 2, 2}));
  expect_error([&] { load_dataset(dir + "/narrow.npy"); }, {"narrow.npy", "T+1"});
  write_npy(dir + "/float.npy", HostTensor::allocate(DType::F32, {2, 3}));
  expect_error([&] { load_dataset(dir + "/float.npy"); }, {"float.npy", "int32"});
  write_npy(dir + "/none.npy", int_tensor(DType::I32, {0, 4}, {}));
  expect_error([&] { load_dataset(dir + "/none.npy"); }, {"no examples in", "none.npy"});
}

// ---- BatchStream ----

// Pre-tokenized rows [2, 100+i, 1, 0]: row i's identity is its second id.
Dataset numbered_rows(size_t n) {
  Dataset d;
  d.source = "numbered";
  for (size_t i = 0; i < n; ++i) d.token_rows.push_back({2, int32_t(100 + i), 1, 0});
  return d;
}

// The example indices of one epoch, read back from the batches' second column.
std::vector<int> epoch_indices(const BatchStream& s, size_t epoch) {
  std::vector<int> out;
  for (size_t step = 0; step < s.steps_per_epoch(); ++step) {
    Batch b = s.batch(epoch, step);
    for (int64_t r = 0; r < b.batch_size; ++r) out.push_back(b.token_ids[size_t(r * b.seq_len + 1)] - 100);
  }
  return out;
}

// A batch of prompt/response pairs is the preprocessor's packing: weight 0 on every prompt target.
TEST(BatchStream, PromptResponsePairsWeighOnlyTheResponse) {
  const Tokenizer tok(fixture("keras/preset-gemma-tiny/assets/tokenizer/vocabulary.spm"));
  Dataset d;
  d.source = "pairs";
  d.texts = {"What does the license allow?", "Say hi"};
  d.responses = {"You may copy it.", "hi"};
  BatchOptions o;
  o.sequence_length = 24;
  o.batch_size = 2;
  o.shuffle = false;
  const Batch batch = BatchStream(d, &tok, o).batch(0, 0);
  for (size_t b = 0; b < 2; ++b) {
    const PackedExample p = pack_prompt_response(tok.encode(d.texts[b]), tok.encode(d.responses[b]), 24, tok.bos_id(),
                                                 tok.eos_id(), tok.pad_id());
    EXPECT_EQ(std::vector<int32_t>(batch.token_ids.begin() + long(b * 24), batch.token_ids.begin() + long(b * 24 + 24)),
              p.token_ids);
    EXPECT_EQ(std::vector<float>(batch.sample_weight.begin() + long(b * 24), batch.sample_weight.begin() + long(b * 24 + 24)),
              p.sample_weight);
    const size_t prompt_tokens = tok.encode(d.texts[b]).size();
    for (size_t t = 0; t < prompt_tokens; ++t) EXPECT_EQ(batch.sample_weight[b * 24 + t], 0.f) << "prompt target " << t;
    EXPECT_EQ(batch.sample_weight[b * 24 + prompt_tokens], 1.f) << "first response target";
  }
}

TEST(BatchStream, StepsAndPartialLastBatch) {
  BatchOptions o;
  o.sequence_length = 3;
  o.batch_size = 4;
  BatchStream s(numbered_rows(10), nullptr, o);
  EXPECT_EQ(s.num_examples(), 10u);
  EXPECT_EQ(s.steps_per_epoch(), 3u);
  EXPECT_EQ(s.batch(0, 0).batch_size, 4);
  Batch last = s.batch(0, 2);
  EXPECT_EQ(last.batch_size, 2);
  EXPECT_EQ(last.seq_len, 3);
  EXPECT_EQ(last.token_ids.size(), 6u);
  EXPECT_EQ(last.padding_mask.size(), 6u);
  EXPECT_EQ(last.targets.size(), 6u);
  EXPECT_EQ(last.sample_weight.size(), 6u);
  EXPECT_THROW(s.batch(0, 3), Error);
}

TEST(BatchStream, OrderIsDeterministicPerSeedAndEpoch) {
  BatchOptions o;
  o.sequence_length = 3;
  o.batch_size = 3;
  o.shuffle_seed = 1234;
  const Dataset d = numbered_rows(20);
  BatchStream a(d, nullptr, o), b(d, nullptr, o);
  std::vector<int> e0 = epoch_indices(a, 0), e1 = epoch_indices(a, 1);
  EXPECT_EQ(e0, epoch_indices(b, 0));
  EXPECT_EQ(e1, epoch_indices(b, 1));
  EXPECT_EQ(e0, epoch_indices(a, 0));  // a pure function: asking again gives the same
  EXPECT_NE(e0, e1);
  std::vector<int> sorted = e0, identity(20);
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 20; ++i) identity[size_t(i)] = i;
  EXPECT_EQ(sorted, identity);   // a permutation
  EXPECT_NE(e0, identity);       // actually shuffled

  o.shuffle_seed = 1235;
  EXPECT_NE(epoch_indices(BatchStream(d, nullptr, o), 0), e0);
  o.shuffle = false;
  EXPECT_EQ(epoch_indices(BatchStream(d, nullptr, o), 0), identity);
  EXPECT_EQ(epoch_indices(BatchStream(d, nullptr, o), 5), identity);
}

TEST(BatchStream, TakeBeforeShuffle) {
  BatchOptions o;
  o.sequence_length = 3;
  o.batch_size = 2;
  o.take = 7;
  BatchStream s(numbered_rows(20), nullptr, o);
  EXPECT_EQ(s.num_examples(), 7u);
  EXPECT_EQ(s.steps_per_epoch(), 4u);
  for (size_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int> idx = epoch_indices(s, epoch);
    std::sort(idx.begin(), idx.end());
    EXPECT_EQ(idx, (std::vector<int>{0, 1, 2, 3, 4, 5, 6}));  // the first 7 in file order
  }
  o.take = 100;  // more than there are: all
  EXPECT_EQ(BatchStream(numbered_rows(5), nullptr, o).num_examples(), 5u);
}

// Each batch row is pack_for_training of the example it stands for.
TEST(BatchStream, ContentsArePackedExamples) {
  Tokenizer tok(fixture(kKerasModel));
  Dataset d;
  d.source = "texts";
  d.texts = {"The licenses for most software are designed to take away your freedom.", "Copyright 2024",
             "You may obtain a copy of the License", "Hello", "a b c d e f g h i j k l m n o p"};
  for (bool shuffle : {false, true}) {
    BatchOptions o;
    o.sequence_length = 12;
    o.batch_size = 2;
    o.shuffle = shuffle;
    o.shuffle_seed = 7;
    BatchStream s(d, &tok, o);
    std::vector<PackedExample> packed;
    for (const auto& t : d.texts) packed.push_back(pack_for_training(tok.encode(t), 12, 2, 1, 0));
    std::set<size_t> seen;
    size_t k = 0;
    for (size_t step = 0; step < s.steps_per_epoch(); ++step) {
      Batch b = s.batch(3, step);
      for (int64_t r = 0; r < b.batch_size; ++r, ++k) {
        auto row = [&](const auto& v) {
          using T = typename std::decay_t<decltype(v)>::value_type;
          return std::vector<T>(v.begin() + r * 12, v.begin() + (r + 1) * 12);
        };
        // Find the example this row is (texts here pack to distinct ids).
        size_t i = 0;
        while (i < packed.size() && packed[i].token_ids != row(b.token_ids)) ++i;
        ASSERT_LT(i, packed.size());
        if (!shuffle) {
          EXPECT_EQ(i, k);
        }
        seen.insert(i);
        EXPECT_EQ(row(b.padding_mask), packed[i].padding_mask);
        EXPECT_EQ(row(b.targets), packed[i].targets);
        EXPECT_EQ(row(b.sample_weight), packed[i].sample_weight);
      }
    }
    EXPECT_EQ(seen.size(), d.texts.size());
  }
}

TEST(BatchStream, Errors) {
  BatchOptions o;
  o.sequence_length = 4;  // rows need 5 ids; numbered rows have 4
  expect_error([&] { BatchStream(numbered_rows(3), nullptr, o); }, {"numbered", "row 0", "sequence_length"});
  Dataset d = numbered_rows(3);
  d.token_rows[2].push_back(0);
  o.sequence_length = 3;
  expect_error([&] { BatchStream(d, nullptr, o); }, {"numbered", "row 2"});

  o.sequence_length = 0;
  EXPECT_THROW(BatchStream(numbered_rows(3), nullptr, o), Error);
  o.sequence_length = 3;
  o.batch_size = 0;
  EXPECT_THROW(BatchStream(numbered_rows(3), nullptr, o), Error);
  o.batch_size = 2;
  Dataset empty;
  empty.source = "nothing.txt";
  expect_error([&] { BatchStream(empty, nullptr, o); }, {"nothing.txt"});
  Dataset texts;
  texts.source = "t";
  texts.texts = {"hello"};
  EXPECT_THROW(BatchStream(texts, nullptr, o), Error);  // text needs a tokenizer
}

}  // namespace
}  // namespace meshtune
