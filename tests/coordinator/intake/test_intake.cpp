// JSONL intake: every field, and malformed lines that become error results, never crashes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "coordinator/intake/intake.h"
#include "kernels/error.h"
#include "worker/dummy.h"

namespace strata {
namespace {

TEST(Intake, ParsesEveryField) {
  const IncomingRequest r = parse_request_line(
      R"({"id": "q1", "prompt_ids": [2, 5], "max_new_tokens": 9, "temperature": 0.5, "top_k": 4,)"
      R"( "top_p": 0.9, "seed": 11, "ignore_eos": true, "stop": ["The end", "!"],)"
      R"( "latency_class": "interactive"})",
      "f:1");
  EXPECT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.request.id, "q1");
  EXPECT_EQ(r.where, "f:1");
  EXPECT_FALSE(r.prompt.has_value());
  EXPECT_EQ(r.request.prompt_ids, (std::vector<int32_t>{2, 5}));
  EXPECT_EQ(r.request.max_new_tokens, 9);
  EXPECT_FLOAT_EQ(r.request.sampling.temperature, 0.5f);
  EXPECT_EQ(r.request.sampling.top_k, 4);
  EXPECT_FLOAT_EQ(r.request.sampling.top_p, 0.9f);
  EXPECT_EQ(r.request.sampling.seed, 11u);
  EXPECT_TRUE(r.request.ignore_eos);
  EXPECT_EQ(r.request.stop, (std::vector<std::string>{"The end", "!"}));
  EXPECT_EQ(r.request.latency_class, "interactive");
  // Everything left out takes the documented default: greedy, 64 tokens, no stop strings.
  const IncomingRequest t = parse_request_line(R"({"id": 7, "prompt": "hi"})", "f:2");
  EXPECT_TRUE(t.error.empty()) << t.error;
  EXPECT_EQ(t.request.id, "7");
  EXPECT_EQ(*t.prompt, "hi");
  EXPECT_TRUE(t.request.prompt_ids.empty());
  EXPECT_EQ(t.request.max_new_tokens, 64);
  EXPECT_FLOAT_EQ(t.request.sampling.temperature, 0.0f);
  EXPECT_EQ(t.request.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(t.request.sampling.top_p, 1.0f);
  EXPECT_EQ(t.request.sampling.seed, 0u);
  EXPECT_FALSE(t.request.ignore_eos);
  EXPECT_TRUE(t.request.stop.empty());
  EXPECT_TRUE(t.request.latency_class.empty());
}

TEST(Intake, MalformedLinesBecomeErrorsNamingTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"not json", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},
      {R"({"id": "x"})", "exactly one of 'prompt'"},
      {R"({"prompt": "a", "prompt_ids": [1]})", "exactly one of 'prompt'"},
      {R"({"prompt_ids": [1, "b"]})", "prompt_ids[1]"},
      {R"({"prompt_ids": [1], "max_new_tokens": -3})", "max_new_tokens"},
      {R"({"prompt_ids": [1], "max_new_tokens": "5"})", "max_new_tokens"},
      {R"({"prompt_ids": [1], "max_tokens": 5})", "unknown field 'max_tokens'"},
      {R"({"prompt_ids": [1], "top_p": 0})", "top_p"},
      {R"({"prompt_ids": [1], "seed": -1})", "seed"},
      {R"({"prompt_ids": [1], "id": [1]})", "'id'"},
  };
  for (const auto& [line, want] : cases) {
    const IncomingRequest r = parse_request_line(line, "req.jsonl:3");
    EXPECT_NE(r.error.find(want), std::string::npos) << line << " -> " << r.error;
    EXPECT_NE(r.error.find("req.jsonl:3"), std::string::npos) << r.error;
  }
  EXPECT_EQ(parse_request_line(R"({"id": "k", "max_tokens": 1})", "f:1").request.id, "k");
}

TEST(Intake, FileSourceAndSinkRoundTrip) {
  const std::string dir = STRATA_TEST_TMP;
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/req.jsonl");
    f << R"({"id": "a", "prompt": "2 3 4", "max_new_tokens": 2})"
      << "\n\n{oops\n";
  }
  JsonlRequestSource source(dir + "/req.jsonl");
  auto got = source.poll(10);
  EXPECT_TRUE(source.exhausted());
  ASSERT_EQ(got.size(), 2u);
  const auto tok = Tokenizer::ids_only(dummy_model_config("opt-125m"));
  tokenize(got[0], *tok);
  EXPECT_EQ(got[0].request.prompt_ids, (std::vector<int32_t>{2, 3, 4}));
  EXPECT_NE(got[1].error.find("req.jsonl:3"), std::string::npos);
  GenerationResult r{"a", {2, 3, 4}, {9}, StopReason::kLength, {}};
  EXPECT_EQ(
      result_line(r, *tok),
      R"({"id":"a","status":"ok","text":"9","output_ids":[9],"stop_reason":"length","prompt_tokens":3,"completion_tokens":1,"prompt_ids":[2,3,4]})");
  EXPECT_THROW(JsonlRequestSource{dir + "/missing.jsonl"}, InputError);
}

// Requests are read as they are taken; a line past the limit is one error, and a file
// with no line end (here 2 KiB of zeros with a 64-byte limit) stops being read after 16
// times the limit instead of filling memory (as `--requests /dev/zero` did).
TEST(Intake, FileReadsAreBounded) {
  const std::string dir = STRATA_TEST_TMP;
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir + "/long.jsonl", std::ios::binary);
    f << R"({"prompt": "a"})"
      << "\n"
      << R"({"prompt": ")" << std::string(100, 'x') << "\"}\n"
      << R"({"prompt": "b"})"
      << "\n"
      << std::string(2048, '\0');
  }
  InputLimits limits;
  limits.request_bytes = 64;
  JsonlRequestSource source(dir + "/long.jsonl", limits);
  auto first = source.poll(1);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_TRUE(first[0].error.empty()) << first[0].error;
  EXPECT_FALSE(source.exhausted());
  auto rest = source.stop();
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_NE(
      rest[0].error.find(
          "long.jsonl:2: request: bytes = 114 is above the limit of 64 (input limit request_bytes"),
      std::string::npos)
      << rest[0].error;
  EXPECT_TRUE(rest[1].error.empty()) << rest[1].error;
  EXPECT_NE(rest[2].error.find("long.jsonl:4: no line end within 1024 bytes"), std::string::npos)
      << rest[2].error;
  EXPECT_TRUE(source.exhausted());
}

}  // namespace
}  // namespace strata
