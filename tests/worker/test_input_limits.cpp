// Input limits (issue 10, failure 3): every size a file or option controls is bounded before
// anything of that size is allocated, the defaults admit the largest real models, and each
// refusal names the file, the field, the value and the limit.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "worker/config.h"
#include "worker/input_limits.h"

namespace strata {
namespace {

using json = nlohmann::json;

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  return "<no InputError>";
}

void expect_mentions(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << p << " not in: " << msg;
}

// meta-llama/Llama-3.1-405B's config.json, as published.
json llama_405b() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
    "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16"})");
}

// OPT-175B's shape (Zhang et al. 2022, table 1) in an OPT config.json.
json opt_175b() {
  return json::parse(R"({
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 12288,
    "ffn_dim": 49152, "num_hidden_layers": 96, "num_attention_heads": 96, "vocab_size": 50272,
    "max_position_embeddings": 2048, "word_embed_proj_dim": 12288, "do_layer_norm_before": true,
    "activation_function": "relu", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
    "torch_dtype": "float16"})");
}

TEST(InputLimits, DefaultsAdmitTheLargestRealModels) {
  const ModelConfig llama = parse_model_config(llama_405b(), "405b/config.json");
  EXPECT_EQ(llama.n_layers, 126);
  EXPECT_EQ(llama.max_positions, 131072);
  const ModelConfig opt = parse_model_config(opt_175b(), "175b/config.json");
  EXPECT_EQ(opt.hidden, 12288);
  EXPECT_EQ(opt.pad_token_id, 1);
}

// Each size one past its default limit is refused by name, before any allocation.
TEST(InputLimits, EveryConfigSizeHasALimit) {
  const InputLimits d;
  struct Case {
    const char* field;
    int64_t limit;
    const char* name;
  };
  const Case cases[] = {
      {"num_hidden_layers", d.layers, "layers"},
      {"num_attention_heads", d.heads, "heads"},
      {"num_key_value_heads", d.heads, "heads"},
      {"head_dim", d.head_dim, "head_dim"},
      {"hidden_size", d.hidden, "hidden"},
      {"intermediate_size", d.intermediate, "intermediate"},
      {"vocab_size", d.vocab, "vocab"},
      {"max_position_embeddings", d.context, "context"},
  };
  for (const Case& c : cases) {
    json j = llama_405b();
    j[c.field] = c.limit + 1;
    expect_mentions(error_of([&] { parse_model_config(j, "big/config.json"); }),
                    {"big/config.json", fmt::format("{} = {}", c.field, c.limit + 1),
                     fmt::format("limit of {}", c.limit), fmt::format("input limit {};", c.name)});
  }
  json o = opt_175b();
  o["word_embed_proj_dim"] = d.hidden + 1;
  expect_mentions(error_of([&] { parse_model_config(o, "o.json"); }),
                  {"word_embed_proj_dim = 131073", "input limit hidden;"});
}

// The two configs of the report: 2^31 - 1 layers and 2e8 positions, refused at parse.
TEST(InputLimits, ReportedHugeConfigsAreRefused) {
  json j = llama_405b();
  j["num_hidden_layers"] = 2147483647;
  expect_mentions(error_of([&] { parse_model_config(j, "c.json"); }),
                  {"c.json", "num_hidden_layers = 2147483647", "limit of 1024", "--limit layers=N",
                   "STRATA_LIMIT_LAYERS"});
  j = llama_405b();
  j["max_position_embeddings"] = 200000000;
  expect_mentions(error_of([&] { parse_model_config(j, "c.json"); }),
                  {"max_position_embeddings = 200000000", "limit of 1048576"});
  // Raised, the same value passes the limit (and meets the next rule).
  InputLimits raised;
  raised.set("context", 200000000, "test");
  EXPECT_EQ(parse_model_config(j, "c.json", raised).max_positions, 200000000);
}

TEST(InputLimits, SetByNameRefusesUnknownNamesAndValuesOutsideTheirRange) {
  InputLimits l;
  l.set_from_text("layers=7", "--limit");
  EXPECT_EQ(l.layers, 7);
  expect_mentions(error_of([&] { l.set_from_text("bogus=3", "--limit"); }),
                  {"--limit", "unknown input limit 'bogus'", "layers"});
  expect_mentions(error_of([&] { l.set_from_text("layers", "--limit"); }), {"NAME=N"});
  expect_mentions(error_of([&] { l.set_from_text("layers=1e3", "--limit"); }), {"NAME=N"});
  expect_mentions(error_of([&] { l.set("layers", 0, "--limit"); }), {"outside [1, 2147483647]"});
  // A rank beyond what Shape holds cannot be allowed.
  expect_mentions(error_of([&] { l.set("tensor_rank", 5, "--limit"); }), {"outside [1, 4]"});
}

TEST(InputLimits, EnvironmentOverridesDefaults) {
  ::setenv("STRATA_LIMIT_VOCAB", "1000", 1);
  ::setenv("STRATA_LIMIT_PROMPTS", "12", 1);
  const InputLimits l = InputLimits::from_env();
  EXPECT_EQ(l.vocab, 1000);
  EXPECT_EQ(l.prompts, 12);
  EXPECT_EQ(l.layers, InputLimits{}.layers);
  ::setenv("STRATA_LIMIT_VOCAB", "lots", 1);
  expect_mentions(error_of([] { InputLimits::from_env(); }), {"STRATA_LIMIT_VOCAB", "'lots'"});
  ::unsetenv("STRATA_LIMIT_VOCAB");
  ::unsetenv("STRATA_LIMIT_PROMPTS");
}

TEST(InputLimits, JsonListsEveryLimitWithItsDefault) {
  InputLimits l;
  l.layers = 5;
  const json j = json::parse(l.json());
  ASSERT_EQ(j.size(), InputLimits::fields().size());
  EXPECT_EQ(j.size(), 20u);  // the limits declared in STRATA_INPUT_LIMITS
  bool seen = false;
  for (const json& f : j) {
    EXPECT_TRUE(f.contains("bounds") && f.contains("max") && f.contains("env")) << f.dump();
    if (f["name"] == "layers") {
      seen = true;
      EXPECT_EQ(f["value"], 5);
      EXPECT_EQ(f["default"], 1024);
      EXPECT_EQ(f["env"], "STRATA_LIMIT_LAYERS");
    }
  }
  EXPECT_TRUE(seen);
}

TEST(InputLimits, BoundedReadRefusesLargeFilesAndEndlessDevices) {
  const std::string path = std::string(STRATA_TEST_TMP) + "/bounded.txt";
  std::filesystem::create_directories(STRATA_TEST_TMP);
  std::ofstream(path) << std::string(100, 'x');
  InputLimits l;
  l.json_file_bytes = 100;
  EXPECT_EQ(read_file_bounded(path, l, &InputLimits::json_file_bytes, "config.json").size(), 100u);
  l.json_file_bytes = 99;
  expect_mentions(error_of([&] { read_file_bounded(path, l, &InputLimits::json_file_bytes, "x"); }),
                  {path, "= 100", "limit of 99", "json_file_bytes"});
  // /dev/zero never ends and has no size: the read stops one chunk past the limit.
  l.json_file_bytes = 1000;
  expect_mentions(
      error_of([&] { read_file_bounded("/dev/zero", l, &InputLimits::json_file_bytes, "x"); }),
      {"/dev/zero", "(at least)", "limit of 1000"});
  expect_mentions(error_of([&] { read_file_bounded("/", l, &InputLimits::json_file_bytes, "x"); }),
                  {"is a directory"});
}

}  // namespace
}  // namespace strata
