// LayoutMap (spec §10): exact key first, then the one full-matching regex, else replicated; resolve()
// errors name the variable, dimension, axis and rule; the KerasHub and tutorial maps on the tiny
// presets; and `meshtune info --mesh/--layout/--layout-rule` as a dry run.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/error.h"
#include "distribution/layout.h"
#include "model/gemma_layouts.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/variables.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
using json = nlohmann::json;

namespace {

const std::string kTiny = fixture("keras/preset-gemma-tiny");    // N=4, K=1, H=16
const std::string kTiny2 = fixture("keras/preset-gemma2-tiny");  // N=4, K=2, H=32

const std::optional<std::string> None;
const std::vector<std::string> kAxes = {"batch", "model"};

std::string quote(const std::string& s) { return "'" + s + "'"; }

GemmaConfig load_config(const std::string& preset) {
  return GemmaConfig::from_keras_json(json::parse(read_text_file(preset + "/config.json")), preset);
}

// The message of the Error `f` throws ("" and a test failure if it does not throw).
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an Error";
  return "";
}

void expect_mentions(const std::string& message, const std::vector<std::string>& needles) {
  for (const auto& needle : needles)
    EXPECT_NE(message.find(needle), std::string::npos) << "missing '" << needle << "' in: " << message;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Spec §10, current KerasHub GemmaBackbone.get_layout_map, written out by variable kind.
std::optional<PartitionSpec> expected_keras_hub(const std::string& path) {
  if (path == "token_embedding/embeddings") return PartitionSpec{"model", "batch"};
  for (const char* qkv : {"/attention/query/kernel", "/attention/key/kernel", "/attention/value/kernel"})
    if (ends_with(path, qkv)) return PartitionSpec{"model", "batch", None};
  if (ends_with(path, "/attention/attention_output/kernel")) return PartitionSpec{"model", None, "batch"};
  if (ends_with(path, "/ffw_gating/kernel") || ends_with(path, "/ffw_gating_2/kernel"))
    return PartitionSpec{"batch", "model"};
  if (ends_with(path, "/ffw_linear/kernel")) return PartitionSpec{"model", "batch"};
  return std::nullopt;
}

// Spec §10, the new tutorial's code.
std::optional<PartitionSpec> expected_tutorial(const std::string& path) {
  if (path == "token_embedding/embeddings") return PartitionSpec{"model", None};
  for (const char* k : {"/attention/query/kernel", "/attention/key/kernel", "/attention/value/kernel",
                        "/attention/attention_output/kernel"})
    if (ends_with(path, k)) return PartitionSpec{"model", None, None};
  if (ends_with(path, "/ffw_gating/kernel") || ends_with(path, "/ffw_gating_2/kernel")) return PartitionSpec{None, "model"};
  if (ends_with(path, "/ffw_linear/kernel")) return PartitionSpec{"model", None};
  return std::nullopt;
}

// The first resolve() error over every variable of `c` on `mesh_shape` (batch, model); "" if none.
std::string first_resolve_error(const LayoutMap& map, const GemmaConfig& c, const std::vector<int>& mesh_shape) {
  try {
    for (const auto& v : gemma_variables(c)) map.resolve(v.keras_path, v.keras_shape, mesh_shape, kAxes);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string write_file(const std::string& name, const std::string& text) {
  std::string path = make_temp_dir("layout") + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST(LayoutMap, PartitionSpecPrintsLikeJax) {
  EXPECT_EQ(partition_spec_str({None, "model", None}), "PartitionSpec(None, 'model', None)");
  EXPECT_EQ(partition_spec_str({}), "PartitionSpec()");
}

TEST(LayoutMap, ExactKeyBeatsRegex) {
  LayoutMap map;
  map.add("decoder_block.*kernel", {None, "model", None});
  map.add("decoder_block_0/attention/query/kernel", {"model", None, None});
  EXPECT_EQ(*map.lookup("decoder_block_0/attention/query/kernel"), (PartitionSpec{"model", None, None}));
  EXPECT_EQ(*map.lookup("decoder_block_1/attention/query/kernel"), (PartitionSpec{None, "model", None}));
  EXPECT_EQ(map.lookup_rule("decoder_block_0/attention/query/kernel")->first, "decoder_block_0/attention/query/kernel");
}

TEST(LayoutMap, RegexMustMatchTheWholePath) {
  LayoutMap map;
  map.add("attention/query", {"model", None, None});      // a substring only
  map.add("decoder_block.*query", {"model", None, None});  // a prefix only
  EXPECT_FALSE(map.lookup("decoder_block_0/attention/query/kernel"));
  EXPECT_TRUE(map.lookup("decoder_block_0/attention/query"));  // full match of the second key
  // re.search (Keras < 3.14) would have matched the first key.
  EXPECT_TRUE(std::regex_search("decoder_block_0/attention/query/kernel", std::regex("attention/query")));
}

TEST(LayoutMap, TwoMatchingRegexesIsAnErrorNamingBoth) {
  LayoutMap map;
  map.add("decoder_block.*kernel", {"model", None, None});
  map.add(".*query.*", {"model", None, None});
  std::string msg = error_of([&] { map.lookup("decoder_block_0/attention/query/kernel"); });
  expect_mentions(msg, {"decoder_block_0/attention/query/kernel", "'decoder_block.*kernel'", "'.*query.*'"});
  // resolve() reports the same.
  msg = error_of([&] { map.resolve("decoder_block_0/attention/query/kernel", {4, 64, 16}, {1, 2}, kAxes); });
  expect_mentions(msg, {"'decoder_block.*kernel'", "'.*query.*'"});
}

TEST(LayoutMap, NoMatchIsReplicated) {
  LayoutMap map = tutorial_gemma_layout();
  EXPECT_FALSE(map.lookup("decoder_block_0/pre_attention_norm/scale"));
  EXPECT_EQ(map.resolve("decoder_block_0/pre_attention_norm/scale", {64}, {1, 2}, kAxes), (PartitionSpec{None}));
  EXPECT_EQ(LayoutMap().resolve("x", {3, 4}, {2}, {"batch"}), (PartitionSpec{None, None}));
}

TEST(LayoutMap, RankMismatchNamesRuleVariableAndShape) {
  LayoutMap map;
  map.add("decoder_block.*query.kernel", {"model", None});
  std::string msg = error_of([&] { map.resolve("decoder_block_0/attention/query/kernel", {4, 64, 16}, {1, 2}, kAxes); });
  EXPECT_EQ(msg, "layout rule 'decoder_block.*query.kernel' gives 2 entries for decoder_block_0/attention/query/kernel "
                 "of shape (4, 64, 16) (rank 3)");
}

TEST(LayoutMap, UnknownAxisNamesTheMeshAxes) {
  LayoutMap map;
  map.add("decoder_block.*query.kernel", {None, "modle", None});
  std::string msg = error_of([&] { map.resolve("decoder_block_0/attention/query/kernel", {4, 64, 16}, {1, 2}, kAxes); });
  expect_mentions(msg, {"'decoder_block.*query.kernel'", "dimension 1", "decoder_block_0/attention/query/kernel",
                        "axis 'modle' is not a mesh axis", "(mesh axes: batch, model)"});
}

TEST(LayoutMap, AxisUsedTwiceIsAnError) {
  LayoutMap map;
  map.add("decoder_block.*query.kernel", {"model", None, "model"});
  std::string msg = error_of([&] { map.resolve("decoder_block_0/attention/query/kernel", {4, 64, 16}, {1, 2}, kAxes); });
  expect_mentions(msg, {"'decoder_block.*query.kernel'", "axis 'model'", "dimension 0", "dimension 2",
                        "decoder_block_0/attention/query/kernel"});
}

TEST(LayoutMap, NonDivisibleDimensionNamesDimensionAndAxis) {
  // Gemma-tiny is MQA (K=1): the tutorial's (model, None, None) cannot split the key kernel two ways.
  GemmaConfig c = load_config(kTiny);
  LayoutMap map = tutorial_gemma_layout();
  const std::string path = "decoder_block_0/attention/key/kernel";
  Shape shape;
  for (const auto& v : gemma_variables(c))
    if (v.keras_path == path) shape = v.keras_shape;
  ASSERT_EQ(shape, (Shape{1, 64, 16}));
  std::string msg = error_of([&] { map.resolve(path, shape, {1, 2}, kAxes); });
  EXPECT_EQ(msg, "layout rule 'decoder_block.*attention.*(query|key|value).*kernel': dimension 0 (size 1) of "
                 "decoder_block_0/attention/key/kernel is not divisible by axis 'model' of size 2");
  // A 1-wide model axis divides everything.
  EXPECT_EQ(map.resolve(path, shape, {2, 1}, kAxes), (PartitionSpec{"model", None, None}));
}

TEST(LayoutMap, BrokenRegexAndDuplicateKeyAreErrorsNamingTheKey) {
  LayoutMap map;
  expect_mentions(error_of([&] { map.add("decoder_block.*(query", {"model"}); }), {"'decoder_block.*(query'", "regex"});
  map.add("a.*", {"model"});
  expect_mentions(error_of([&] { map.add("a.*", {None}); }), {"'a.*'", "twice"});
  EXPECT_EQ(map.rules().size(), 1u);
}

TEST(LayoutMap, JsonFile) {
  std::string good = write_file("good.json", R"({"token_embedding/embeddings": ["model", null],
                                                  "decoder_block.*ffw_linear.kernel": [null, "model"]})");
  LayoutMap map = LayoutMap::from_json_file(good);
  EXPECT_EQ(map.rules().size(), 2u);
  EXPECT_EQ(*map.lookup("token_embedding/embeddings"), (PartitionSpec{"model", None}));
  EXPECT_EQ(*map.lookup("decoder_block_1/ffw_linear/kernel"), (PartitionSpec{None, "model"}));

  std::string not_object = write_file("list.json", R"([["a", null]])");
  expect_mentions(error_of([&] { LayoutMap::from_json_file(not_object); }), {not_object, "object"});
  std::string not_array = write_file("str.json", R"({"a.*kernel": "model"})");
  expect_mentions(error_of([&] { LayoutMap::from_json_file(not_array); }), {not_array, "'a.*kernel'"});
  std::string number = write_file("num.json", R"({"a.*kernel": [1, null]})");
  expect_mentions(error_of([&] { LayoutMap::from_json_file(number); }), {number, "'a.*kernel'"});
  std::string bad_regex = write_file("regex.json", R"({"(query": ["model"]})");
  expect_mentions(error_of([&] { LayoutMap::from_json_file(bad_regex); }), {bad_regex, "'(query'"});
  std::string broken = write_file("broken.json", R"({"a": [null)");
  expect_mentions(error_of([&] { LayoutMap::from_json_file(broken); }), {broken, "JSON"});
  expect_mentions(error_of([&] { LayoutMap::from_json_file("/nonexistent/layout.json"); }), {"/nonexistent/layout.json"});
}

TEST(LayoutMap, RuleText) {
  LayoutMap map;
  map.add_rule_text("decoder_block.*ffw_linear.kernel=model,None");
  map.add_rule_text("decoder_block.*ffw_gating.kernel=,model");
  map.add_rule_text("token_embedding/embeddings= model , null");
  map.add_rule_text("decoder_block.*ffw_gating_2.kernel=model,");
  map.add_rule_text(".*query=?/kernel=model,None,None");  // '=' inside the regex: split at the last one
  ASSERT_EQ(map.rules().size(), 5u);
  EXPECT_EQ(map.rules()[0].second, (PartitionSpec{"model", None}));
  EXPECT_EQ(map.rules()[1].second, (PartitionSpec{None, "model"}));
  EXPECT_EQ(map.rules()[2].second, (PartitionSpec{"model", None}));
  EXPECT_EQ(map.rules()[3].second, (PartitionSpec{"model", None}));
  EXPECT_EQ(map.rules()[4].first, ".*query=?/kernel");
  EXPECT_EQ(*map.lookup("decoder_block_0/attention/query/kernel"), (PartitionSpec{"model", None, None}));

  expect_mentions(error_of([&] { map.add_rule_text("no equals sign"); }), {"'no equals sign'", "'='"});
  expect_mentions(error_of([&] { map.add_rule_text("=model"); }), {"'=model'"});
  expect_mentions(error_of([&] { map.add_rule_text("x.*="); }), {"'x.*='"});
  expect_mentions(error_of([&] { map.add_rule_text("(x=model"); }), {"'(x'"});
  // RE2 syntax: lookaround (which would need backtracking) is refused, naming the rule.
  expect_mentions(error_of([&] { map.add_rule_text("(?!x).*=model"); }), {"'(?!x).*'", "not a valid regex"});
}

TEST(LayoutMap, HostileRegexesFailFastOrRunInLinearTime) {
  LayoutMap map;
  // Catastrophic backtracking for std::regex / Python re; linear for RE2.
  map.add("(.*.*.*.*.*.*.*.*.*.*.*.*)*Z", {None});
  const std::string long_path(200000, 'a');
  EXPECT_FALSE(map.lookup(long_path).has_value());
  // Deep nesting: compiled without recursion; too long a pattern is refused with the limit.
  map.add(std::string(1000, '(') + "q" + std::string(1000, ')'), {None});
  EXPECT_TRUE(map.lookup("q").has_value());
  expect_mentions(error_of([&] { map.add(std::string(5000, 'a'), {None}); }), {"at most 4096"});
  expect_mentions(error_of([&] { map.add("a{1001}", {None}); }), {"not a valid regex"});
}

TEST(LayoutMap, KerasHubMapOnGemmaTiny) {
  LayoutMap map = keras_hub_gemma_layout();
  GemmaConfig c = load_config(kTiny);
  int sharded = 0;
  for (const auto& v : gemma_variables(c)) {
    EXPECT_EQ(map.lookup(v.keras_path), expected_keras_hub(v.keras_path)) << v.keras_path;
    if (expected_keras_hub(v.keras_path)) ++sharded;
  }
  EXPECT_EQ(sharded, 1 + 2 * 7);  // the embedding and 7 kernels per block
  EXPECT_EQ(map.lookup_rule("decoder_block_1/ffw_gating_2/kernel")->first, "decoder_block.*ffw_gating_2.kernel");

  // On a (2, 2) mesh the MQA key kernel (K=1) cannot be split on 'model' (keras-hub#1613) ...
  std::string msg = first_resolve_error(map, c, {2, 2});
  expect_mentions(msg, {"decoder_block_0/attention/key/kernel", "dimension 0 (size 1)", "axis 'model' of size 2",
                        "'decoder_block.*attention.*(query|key|value).kernel'"});
  // ... while on (2, 1) everything resolves.
  for (const auto& v : gemma_variables(c))
    EXPECT_EQ(map.resolve(v.keras_path, v.keras_shape, {2, 1}, kAxes),
              expected_keras_hub(v.keras_path).value_or(PartitionSpec(v.keras_shape.size(), None)));
}

TEST(LayoutMap, KerasHubMapOnGemma2TinyOverTwoByTwo) {
  // K=2 divides: every variable resolves on (2, 2) to the KerasHub table's spec.
  LayoutMap map = keras_hub_gemma_layout();
  GemmaConfig c = load_config(kTiny2);
  for (const auto& v : gemma_variables(c))
    EXPECT_EQ(map.resolve(v.keras_path, v.keras_shape, {2, 2}, kAxes),
              expected_keras_hub(v.keras_path).value_or(PartitionSpec(v.keras_shape.size(), None)))
        << v.keras_path;
  // Other axis names are honoured; a mesh without them fails naming the axis.
  LayoutMap renamed = keras_hub_gemma_layout("mp", "dp");
  EXPECT_EQ(renamed.resolve("token_embedding/embeddings", {1000, 64}, {2, 2}, {"dp", "mp"}), (PartitionSpec{"mp", "dp"}));
  expect_mentions(first_resolve_error(renamed, c, {2, 2}), {"axis 'mp' is not a mesh axis", "token_embedding/embeddings"});
}

TEST(LayoutMap, TutorialMapOnGemmaTiny) {
  LayoutMap map = tutorial_gemma_layout();
  GemmaConfig c = load_config(kTiny);
  for (const auto& v : gemma_variables(c)) EXPECT_EQ(map.lookup(v.keras_path), expected_tutorial(v.keras_path)) << v.keras_path;
  // "ffw_gating.*kernel" covers ffw_gating_2 too (intended: both are split on F).
  EXPECT_EQ(map.lookup_rule("decoder_block_0/ffw_gating_2/kernel")->first, "decoder_block.*ffw_gating.*kernel");
  // gemma2-tiny (K=2) resolves on (1, 2); gemma-tiny (K=1) does not.
  GemmaConfig c2 = load_config(kTiny2);
  EXPECT_EQ(first_resolve_error(map, c2, {1, 2}), "");
  expect_mentions(first_resolve_error(map, c, {1, 2}), {"decoder_block_0/attention/key/kernel"});
}

TEST(LayoutMap, LoraVariablesAreReplicatedByBothMaps) {
  GemmaConfig c = load_config(kTiny);
  LoraWeights lora = enable_lora(c, 2, {Slot::Query, Slot::Value}, 0);
  ASSERT_FALSE(lora.adapters.empty());
  for (const LayoutMap& map : {keras_hub_gemma_layout(), tutorial_gemma_layout()}) {
    for (const LoraAdapter& a : lora.adapters) {
      for (const auto& [path, shape] : {std::pair{a.keras_path(c) + "/lora_kernel_a", a.a_shape},
                                        std::pair{a.keras_path(c) + "/lora_kernel_b", a.b_shape}}) {
        EXPECT_FALSE(map.lookup(path)) << path;
        EXPECT_EQ(map.resolve(path, shape, {2, 2}, kAxes), PartitionSpec(shape.size(), None)) << path;
      }
    }
  }
  // Under re.search (Keras 3.2-3.13) the tutorial's key did match lora_kernel_b (keras#19496).
  EXPECT_TRUE(std::regex_search("decoder_block_0/attention/query/lora_kernel_b",
                                std::regex("decoder_block.*attention.*(query|key|value).*kernel")));
}

TEST(LayoutMap, WarnsOnlyForLargeReplicatedVariablesOnSeveralDevices) {
  Shape big = {1024, 256};  // exactly 1 MiB as fp32
  auto w = LayoutMap::warnings_for("token_embedding/embeddings", big, {None, None}, {1, 2});
  ASSERT_EQ(w.size(), 1u);
  expect_mentions(w[0], {"token_embedding/embeddings", "(1024, 256)", "replicated"});
  EXPECT_TRUE(LayoutMap::warnings_for("e", big, {None, None}, {1, 1}).empty());       // one device
  EXPECT_TRUE(LayoutMap::warnings_for("e", big, {"model", None}, {1, 2}).empty());    // split
  EXPECT_TRUE(LayoutMap::warnings_for("e", {1023, 256}, {None, None}, {1, 2}).empty());  // under 1 MiB
}

// ---- meshtune info --mesh ----------------------------------------------------------------------

std::string with_commas(long long n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Per-device fp32 bytes of `c`'s variables when `expected` gives the spec and 'model' is `model`-wide.
long long device_bytes(const GemmaConfig& c, std::optional<PartitionSpec> (*expected)(const std::string&), int model) {
  long long bytes = 0;
  for (const auto& v : gemma_variables(c)) {
    long long n = num_elements(v.keras_shape) * 4;
    auto spec = expected(v.keras_path);
    if (spec)
      for (const auto& axis : *spec)
        if (axis == "model") n /= model;
    bytes += n;
  }
  return bytes;
}

TEST(LayoutCli, InfoTutorialLayoutPrintsSpecsAndDeviceBytes) {
  CommandResult r = run_meshtune("info " + quote(kTiny2) + " --mesh 1x2 --layout tutorial");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_0/attention/query/kernel +\\(4, 64, 32\\) +"
                                                  "PartitionSpec\\('model', None, None\\)\\n")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_1/ffw_gating_2/kernel +\\(64, 128\\) +"
                                                  "PartitionSpec\\(None, 'model'\\)\\n")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\nfinal_normalization/scale +\\(64,\\) +PartitionSpec\\(None\\)\\n")))
      << r.out;
  GemmaConfig c = load_config(kTiny2);
  long long total = 0;
  for (const auto& v : gemma_variables(c)) total += num_elements(v.keras_shape) * 4;
  std::string line = "Per-device parameter bytes: " + with_commas(device_bytes(c, expected_tutorial, 2)) + " (";
  EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  EXPECT_NE(r.out.find("of " + with_commas(total) + " ("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Largest replicated variables: "), std::string::npos) << r.out;
  // The existing summary is still there, above the table.
  EXPECT_NE(r.out.find("Total params:"), std::string::npos);
}

TEST(LayoutCli, InfoAutoLayoutReplicatesMqaKeyValueOnTheModelAxis) {
  // KerasHub's own map fails here (keras-hub#1613); `auto` replicates key/value over the model axis
  // with a warning, and the plain KerasHub map through a rule still gives the clear error.
  CommandResult r = run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --layout auto");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  expect_mentions(r.err, {"KV head", "replicated"});
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_0/attention/key/kernel +\\(1, 64, 16\\) +"
                                                  "PartitionSpec\\(None, 'batch', None\\)\\n")))
      << r.out;
  r = run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --layout-rule 'decoder_block.*attention.*(query|key|value).kernel=model,batch,'");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  expect_mentions(r.err, {"decoder_block_0/attention/key/kernel", "dimension 0 (size 1)", "axis 'model' of size 2"});

  r = run_meshtune("info " + quote(kTiny) + " --mesh 2x1 --layout auto");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_0/attention/key/kernel +\\(1, 64, 16\\) +"
                                                  "PartitionSpec\\('model', 'batch', None\\)\\n")))
      << r.out;
  EXPECT_NE(r.out.find("mesh (2, 1) ('batch', 'model')"), std::string::npos) << r.out;
}

TEST(LayoutCli, InfoLayoutRulesFilesAndLora) {
  CommandResult r = run_meshtune("info " + quote(kTiny) +
                                 " --mesh 1x2 --layout-rule 'decoder_block.*ffw_linear.kernel=model,None' "
                                 "--layout-rule 'decoder_block.*(ffw_gating|ffw_gating_2).kernel=,model' --lora-rank 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_0/ffw_linear/kernel +\\(128, 64\\) +PartitionSpec\\('model', None\\)\\n")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_0/ffw_gating_2/kernel +\\(64, 128\\) +PartitionSpec\\(None, 'model'\\)\\n")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_0/attention/query/kernel +\\(4, 64, 16\\) +PartitionSpec\\(None, None, None\\)\\n")))
      << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ndecoder_block_0/attention/query/lora_kernel_a +\\(4, 64, 2\\) +PartitionSpec\\(None, None, None\\)\\n")))
      << r.out;

  r = run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --layout-rule 'decoder_block.*ffw_linear.kernel=modle,None'");
  EXPECT_EQ(r.exit_code, 1);
  expect_mentions(r.err, {"axis 'modle' is not a mesh axis", "(mesh axes: batch, model)", "decoder_block_0/ffw_linear/kernel",
                          "'decoder_block.*ffw_linear.kernel'"});

  std::string file = write_file("layout.json", R"({"token_embedding/embeddings": ["model", null]})");
  r = run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --layout " + quote(file));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\\ntoken_embedding/embeddings +\\(1000, 64\\) +PartitionSpec\\('model', None\\)\\n")))
      << r.out;

  std::string bad = write_file("bad.json", R"({"token_embedding/embeddings": "model"})");
  r = run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --layout " + quote(bad));
  EXPECT_EQ(r.exit_code, 1);
  expect_mentions(r.err, {bad, "'token_embedding/embeddings'"});
}

TEST(LayoutCli, InfoMeshFlags) {
  // 1-D mesh: the axis is "batch", so every variable is replicated.
  CommandResult r = run_meshtune("info " + quote(kTiny) + " --mesh 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("mesh (2,) ('batch',)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Largest replicated variables: token_embedding/embeddings (256,000 B)"), std::string::npos) << r.out;

  r = run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --mesh-axes data,mp --layout-rule 'token_embedding/embeddings=mp,data'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("PartitionSpec('mp', 'data')"), std::string::npos) << r.out;

  expect_mentions(run_meshtune("info " + quote(kTiny) + " --layout tutorial").err, {"--mesh"});
  expect_mentions(run_meshtune("info " + quote(kTiny) + " --mesh 1x0").err, {"'1x0'"});
  expect_mentions(run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --mesh-axes batch").err, {"--mesh-axes"});
  expect_mentions(run_meshtune("info " + quote(kTiny) + " --mesh 2x1x1").err, {"--mesh-axes"});
  EXPECT_EQ(run_meshtune("info " + quote(kTiny) + " --mesh 1x2 --layout-rule 'broken'").exit_code, 1);
}

}  // namespace
