// The wire format (docs/QUEUE.md): Strata request lines, OpenAI batch lines, flat queue
// fields; bad input of every kind becomes an error naming the field and the problem,
// inputs past their limits are refused before they are parsed; results print in the
// documented order and read back typed.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "coordinator/intake/request_format.h"
#include "worker/config.h"
#include "worker/dummy.h"

namespace strata {
namespace {

void expect_error(const IncomingRequest& r, const std::string& want, const std::string& what) {
  EXPECT_NE(r.error.find(want), std::string::npos) << what << " -> '" << r.error << "'";
}

TEST(RequestFormat, StrataLineWithEveryField) {
  const IncomingRequest r = parse_request_line(
      R"({"id": "q1", "prompt": "hi", "max_new_tokens": 9, "temperature": 0.5, "top_k": 4,)"
      R"( "top_p": 0.9, "seed": 11, "ignore_eos": true, "stop": ["\n\n", "END"],)"
      R"( "latency_class": "interactive"})",
      "f:1");
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.request.id, "q1");
  EXPECT_EQ(*r.prompt, "hi");
  EXPECT_EQ(r.request.max_new_tokens, 9);
  EXPECT_FLOAT_EQ(r.request.sampling.temperature, 0.5f);
  EXPECT_EQ(r.request.sampling.top_k, 4);
  EXPECT_FLOAT_EQ(r.request.sampling.top_p, 0.9f);
  EXPECT_EQ(r.request.sampling.seed, 11u);
  EXPECT_TRUE(r.request.ignore_eos);
  EXPECT_EQ(r.request.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(r.request.latency_class, "interactive");
  EXPECT_EQ(parse_request_line(R"({"prompt": "a", "stop": "."})", "f:2").request.stop,
            std::vector<std::string>{"."});
}

// The OpenAI Batch API's input line: custom_id names it, body.max_tokens defaults to 16
// and body.temperature to 1 as the completions API does.
TEST(RequestFormat, OpenAiBatchLine) {
  const IncomingRequest r = parse_request_line(
      R"({"custom_id": "req-7", "method": "POST", "url": "/v1/completions", "body": {"model": "m",)"
      R"( "prompt": "Say hi", "max_tokens": 12, "temperature": 0, "top_p": 0.5, "seed": 3,)"
      R"( "stop": ["\n"], "n": 1, "stream": false, "user": "u"}})",
      "b:1");
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.request.id, "req-7");
  EXPECT_EQ(*r.prompt, "Say hi");
  EXPECT_EQ(r.request.max_new_tokens, 12);
  EXPECT_FLOAT_EQ(r.request.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(r.request.sampling.top_p, 0.5f);
  EXPECT_EQ(r.request.sampling.seed, 3u);
  EXPECT_EQ(r.request.stop, std::vector<std::string>{"\n"});
  const IncomingRequest d =
      parse_request_line(R"({"custom_id": "d", "body": {"prompt": [[1, 2, 3]]}})", "b:2");
  ASSERT_TRUE(d.error.empty()) << d.error;
  EXPECT_EQ(d.request.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(d.request.max_new_tokens, 16);
  EXPECT_FLOAT_EQ(d.request.sampling.temperature, 1.0f);
}

TEST(RequestFormat, SamplingExtrasPenaltiesLogprobsAndChoices) {
  const IncomingRequest r = parse_request_line(
      R"({"prompt": "hi", "n": 4, "min_p": 0.05, "presence_penalty": 0.5,)"
      R"( "frequency_penalty": -0.25, "repetition_penalty": 1.3, "logprobs": true,)"
      R"( "top_logprobs": 5, "stop_token_ids": [7, 9], "top_k": -1})",
      "f:1");
  ASSERT_TRUE(r.error.empty()) << r.error;
  const SamplingParams& s = r.request.sampling;
  EXPECT_EQ(r.request.n, 4);
  EXPECT_FLOAT_EQ(s.min_p, 0.05f);
  EXPECT_FLOAT_EQ(s.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty, -0.25f);
  EXPECT_FLOAT_EQ(s.repetition_penalty, 1.3f);
  EXPECT_EQ(s.logprobs, 5);
  EXPECT_EQ(s.top_k, 0);  // vLLM's -1: off
  EXPECT_EQ(r.request.stop_token_ids, (std::vector<int32_t>{7, 9}));
  EXPECT_EQ(r.sampling_set, kSetMinP | kSetRepetitionPenalty | kSetTopK);
  // logprobs as the completions API's integer: the sampled token's and that many more.
  EXPECT_EQ(
      parse_request_line(R"({"prompt": "a", "logprobs": 0})", "f:2").request.sampling.logprobs, 0);
  EXPECT_EQ(
      parse_request_line(R"({"prompt": "a", "logprobs": false})", "f:3").request.sampling.logprobs,
      -1);
}

// An OpenAI chat batch line: messages for the chat template, the chat API's logprobs.
TEST(RequestFormat, OpenAiChatBatchLine) {
  const IncomingRequest r = parse_request_line(
      R"({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": {)"
      R"("model": "m", "messages": [{"role": "system", "content": "Be brief."},)"
      R"( {"role": "user", "content": "Hi"}], "max_completion_tokens": 20, "n": 2,)"
      R"( "logprobs": true, "top_logprobs": 2, "seed": 5, "chat_template_kwargs":)"
      R"( {"enable_thinking": false}}})",
      "b:1");
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.request.id, "c1");
  EXPECT_TRUE(r.request.chat);
  EXPECT_FALSE(r.prompt.has_value());
  ASSERT_TRUE(r.messages.has_value());
  EXPECT_EQ((*r.messages)[1]["content"], "Hi");
  EXPECT_TRUE(r.add_generation_prompt);
  EXPECT_EQ(r.chat_variables, nlohmann::json::parse(R"({"enable_thinking": false})"));
  EXPECT_EQ(r.request.max_new_tokens, 20);
  EXPECT_EQ(r.request.n, 2);
  EXPECT_EQ(r.request.sampling.logprobs, 2);
  EXPECT_FLOAT_EQ(r.request.sampling.temperature, 1.0f);  // the API's default
  EXPECT_EQ(r.sampling_set, kSetMaxNewTokens);
}

// generation_config.json fills what the request left unset, and nothing it set.
TEST(RequestFormat, GenerationDefaultsFillOnlyUnsetFields) {
  GenerationDefaults d;
  d.temperature = 0.6f;
  d.top_p = 0.9f;
  d.top_k = 50;
  d.repetition_penalty = 1.1f;
  d.max_new_tokens = 99;
  IncomingRequest r = parse_request_line(R"({"prompt": "a", "temperature": 0, "top_k": 3})", "f");
  apply_generation_defaults(r, d);
  EXPECT_FLOAT_EQ(r.request.sampling.temperature, 0.0f);
  EXPECT_EQ(r.request.sampling.top_k, 3);
  EXPECT_FLOAT_EQ(r.request.sampling.top_p, 0.9f);
  EXPECT_FLOAT_EQ(r.request.sampling.repetition_penalty, 1.1f);
  EXPECT_FLOAT_EQ(r.request.sampling.min_p, 0.0f);  // the file has none
  EXPECT_EQ(r.request.max_new_tokens, 99);
}

TEST(RequestFormat, MalformedLinesNameTheFieldAndTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"not json", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},
      {R"({"id": "x"})", "exactly one of 'prompt'"},
      {R"({"prompt": "a", "prompt_ids": [1]})", "exactly one of 'prompt'"},
      {R"({"prompt": 5})", "field 'prompt' must be a string"},
      {R"({"prompt_ids": [1, "b"]})", "prompt_ids[1]"},
      {R"({"prompt_ids": [1, 4294967296]})", "prompt_ids[1] must be a 32-bit integer"},
      {R"({"prompt_ids": [1], "max_new_tokens": -3})", "max_new_tokens"},
      {R"({"prompt_ids": [1], "max_new_tokens": 1e12})", "max_new_tokens"},
      {R"({"prompt_ids": [1], "max_new_tokens": "5"})", "max_new_tokens"},
      {R"({"prompt_ids": [1], "max_tokens": 5})", "unknown field 'max_tokens'"},
      {R"({"prompt_ids": [1], "top_p": 0})", "top_p"},
      {R"({"prompt_ids": [1], "temperature": "hot"})", "field 'temperature' must be a number"},
      {R"({"prompt_ids": [1], "seed": -1})", "seed"},
      {R"({"prompt_ids": [1], "id": [1]})", "'id'"},
      {R"({"prompt_ids": [1], "id": ""})", "'id' must have 1 to"},
      {R"({"prompt_ids": [1], "stop": [1]})", "stop[0] must be a string"},
      {R"({"prompt_ids": [1], "ignore_eos": 1})", "ignore_eos"},
      {"{\"prompt\": \"\xff\xfe\"}", "not valid JSON"},  // invalid UTF-8
      {R"({"custom_id": "c", "body": {"prompt": "a", "logprobs": 21}})", "top_logprobs"},
      {R"({"custom_id": "c", "body": {"prompt": "a", "n": 17}})", "field 'n' must be in [1, 16]"},
      {R"({"custom_id": "c", "body": {"prompt": ["a", "b"]}})", "exactly one"},
      {R"({"custom_id": "c", "body": {"prompt": "a", "tools": []}})",
       "body.tools is not supported"},
      {R"({"custom_id": "c", "body": {"prompt": "a", "frequency_penalty": 3}})",
       "frequency_penalty must be in [-2, 2]"},
      {R"({"custom_id": "c", "url": "/v1/embeddings", "body": {"prompt": "a"}})", "url must be"},
      {R"({"custom_id": "c", "url": "/v1/chat/completions", "body": {"prompt": "a"}})",
       "body.prompt is not supported"},
      {R"({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": "hi"}})",
       "field 'messages' must be a non-empty array"},
      {R"({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [1]}})",
       "messages[0] must be an object"},
      {R"({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [{}],)"
       R"( "top_logprobs": 3}})",
       "'top_logprobs' needs 'logprobs': true"},
      {R"({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})", "exactly one of"},
      {R"({"prompt": "a", "add_generation_prompt": false})", "go with 'messages'"},
      {R"({"prompt": "a", "logprobs": 3, "top_logprobs": 2})", "once"},
      {R"({"prompt": "a", "min_p": 2})", "min_p must be in [0, 1]"},
      {R"({"prompt": "a", "repetition_penalty": 0})", "repetition_penalty must be > 0"},
      {R"({"prompt": "a", "stop_token_ids": [1, "x"]})", "stop_token_ids[1]"},
      {R"({"custom_id": "c"})", "'body' must be the request object"},
      {R"({"body": {"prompt": "a"}})", "'custom_id' is missing"},
  };
  for (const auto& [line, want] : cases) {
    const IncomingRequest r = parse_request_line(line, "req.jsonl:3");
    expect_error(r, want, line);
    expect_error(r, "req.jsonl:3", line);
  }
}

// The id is known even when the rest is wrong, so the error result carries it.
TEST(RequestFormat, ErrorResultsKeepTheRequestsId) {
  EXPECT_EQ(parse_request_line(R"({"id": "k", "max_tokens": 1})", "f:1").request.id, "k");
  EXPECT_EQ(parse_request_line(R"({"custom_id": "c", "body": 3})", "f:1").request.id, "c");
  EXPECT_EQ(parse_request_line("nonsense", "f:9").request.id, "f:9");
}

// Nesting and size are refused before the parser runs: a line of 100,000 nested arrays
// (which took rank 0 down with a stack overflow) is one error like any other.
TEST(RequestFormat, NestingAndSizeLimitsComeBeforeParsing) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_error(parse_request_line(deep, "f:1"), "nested deeper than 16 levels", "deep");
  const std::string deep_field =
      R"({"prompt": "a", "stop": )" + std::string(50, '[') + std::string(50, ']') + "}";
  expect_error(parse_request_line(deep_field, "f:2"), "nested deeper", "deep field");
  // Brackets inside strings do not count.
  EXPECT_TRUE(
      parse_request_line(R"({"prompt": "[[[[[[[[[[[[[[[[[[[[[[[[["})", "f:3").error.empty());
  InputLimits small;
  small.request_bytes = 64;
  const std::string big = R"({"prompt": ")" + std::string(100, 'a') + "\"}";
  expect_error(parse_request_line(big, "f:4", small),
               "request: bytes = 114 is above the limit of 64", "big");
  expect_error(parse_request_fields({{"prompt", std::string(100, 'a')}}, "e", "s e", small),
               "request: bytes = 106 is above the limit of 64", "big fields");
}

TEST(RequestFormat, FlatQueueFields) {
  const IncomingRequest r = parse_request_fields({{"prompt", "Once"},
                                                  {"max_new_tokens", "7"},
                                                  {"temperature", "0.25"},
                                                  {"top_k", "3"},
                                                  {"top_p", "0.5"},
                                                  {"seed", "18446744073709551615"},
                                                  {"ignore_eos", "1"},
                                                  {"stop", R"([".", "!"])"},
                                                  {"latency_class", "batch"}},
                                                 "1-0", "s 1-0");
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.request.id, "1-0");  // no id field: the entry id names it
  EXPECT_EQ(r.request.max_new_tokens, 7);
  EXPECT_FLOAT_EQ(r.request.sampling.temperature, 0.25f);
  EXPECT_EQ(r.request.sampling.top_k, 3);
  EXPECT_EQ(r.request.sampling.seed, UINT64_MAX);
  EXPECT_TRUE(r.request.ignore_eos);
  EXPECT_EQ(r.request.stop, (std::vector<std::string>{".", "!"}));
  EXPECT_EQ(r.request.latency_class, "batch");
  // prompt_ids as JSON or as space/comma separated ids; stop not starting with '[' is one
  // string, brackets and all.
  EXPECT_EQ(parse_request_fields({{"prompt_ids", "1 2,3"}}, "e", "w").request.prompt_ids,
            (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(parse_request_fields({{"prompt_ids", "[4, 5]"}}, "e", "w").request.prompt_ids,
            (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(parse_request_fields({{"prompt", "a"}, {"stop", "end]"}}, "e", "w").request.stop,
            std::vector<std::string>{"end]"});
  // A whole line in one field.
  const IncomingRequest j =
      parse_request_fields({{"json", R"({"id": "x", "prompt": "p"})"}}, "e", "w");
  EXPECT_TRUE(j.error.empty()) << j.error;
  EXPECT_EQ(j.request.id, "x");
  const IncomingRequest o = parse_request_fields(
      {{"openai", R"({"custom_id": "y", "body": {"prompt": "p", "max_tokens": 2}})"}}, "e", "w");
  EXPECT_TRUE(o.error.empty()) << o.error;
  EXPECT_EQ(o.request.id, "y");
  EXPECT_EQ(o.request.max_new_tokens, 2);
}

TEST(RequestFormat, BadFlatFieldsNameTheFieldAndTheProblem) {
  const std::pair<FieldList, const char*> cases[] = {
      {{{"prompt", "a"}, {"max_new_tokens", "lots"}},
       "field 'max_new_tokens' must be an integer, got 'lots'"},
      {{{"prompt", "a"}, {"max_new_tokens", "1e3"}}, "must be an integer"},
      {{{"prompt", "a"}, {"temperature", "nan"}}, "field 'temperature' must be a number"},
      {{{"prompt", "a"}, {"seed", "-1"}}, "field 'seed'"},
      {{{"prompt", "a"}, {"ignore_eos", "yes"}}, "ignore_eos"},
      {{{"prompt", "a"}, {"colour", "red"}}, "unknown field 'colour'"},
      {{{"prompt", "a"}, {"prompt", "b"}}, "field 'prompt' appears twice"},
      {{{"prompt", "\xc3\x28"}}, "field 'prompt' is not valid UTF-8"},
      {{{"prompt_ids", "1 two"}}, "field 'prompt_ids' must be an integer, got 'two'"},
      {{{"prompt", "a"}, {"stop", "[1"}}, "field 'stop' is not valid JSON"},
      {{{"json", "{}"}, {"prompt", "a"}}, "comes alone"},
      {{{"openai", R"({"id": "x", "prompt": "p"})"}},
       "field 'openai' must hold an OpenAI batch line"},
      {{}, "exactly one of 'prompt'"},
  };
  for (const auto& [fields, want] : cases) {
    const IncomingRequest r = parse_request_fields(fields, "9-0", "strata:requests entry 9-0");
    expect_error(r, want, fields.empty() ? "(no fields)" : fields[0].first);
    expect_error(r, "strata:requests entry 9-0", want);
  }
}

// The UTF-8 rules themselves are worker/text's (tests/worker/test_text.cpp); here, that a
// request's text fields and a result's text go through them.
TEST(RequestFormat, InvalidUtf8IsRefusedInFieldsAndReplacedInResults) {
  const IncomingRequest r = parse_request_fields({{"prompt", "caf\xc3\x28"}}, "u", "s 1-0");
  EXPECT_NE(r.error.find("field 'prompt' is not valid UTF-8"), std::string::npos) << r.error;
  const IncomingRequest overlong = parse_request_fields({{"id", "\xc0\xaf"}}, "u", "s 1-0");
  EXPECT_NE(overlong.error.find("field 'id' is not valid UTF-8"), std::string::npos);
  const auto tok = Tokenizer::ids_only(dummy_model_config("opt-125m"));
  GenerationResult bad{"id\xed\xa0\x80", {}, {}, StopReason::kError, "bad \xff byte"};
  const auto j = result_object(bad, *tok);
  EXPECT_EQ(j["id"], "id\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");  // a surrogate: 3 maximal subparts
  EXPECT_EQ(j["error"], "bad \xef\xbf\xbd byte");
  EXPECT_NO_THROW((void)j.dump());
}

TEST(RequestFormat, FlatFieldsCarryTheSamplingExtrasAndMessages) {
  const IncomingRequest r =
      parse_request_fields({{"messages", R"([{"role": "user", "content": "hi"}])"},
                            {"add_generation_prompt", "false"},
                            {"n", "3"},
                            {"logprobs", "2"},
                            {"min_p", "0.1"},
                            {"repetition_penalty", "1.2"},
                            {"stop_token_ids", "4 5"}},
                           "e-1", "strata:requests e-1");
  ASSERT_TRUE(r.error.empty()) << r.error;
  ASSERT_TRUE(r.messages.has_value());
  EXPECT_EQ((*r.messages)[0]["role"], "user");
  EXPECT_FALSE(r.add_generation_prompt);
  EXPECT_EQ(r.request.n, 3);
  EXPECT_EQ(r.request.sampling.logprobs, 2);
  EXPECT_FLOAT_EQ(r.request.sampling.min_p, 0.1f);
  EXPECT_EQ(r.request.stop_token_ids, (std::vector<int32_t>{4, 5}));
  expect_error(parse_request_fields({{"prompt", "a"}, {"logprobs", "maybe"}}, "e", "w"),
               "field 'logprobs' must be an integer", "logprobs maybe");
  expect_error(parse_request_fields({{"messages", "[{"}}, "e", "w"),
               "field 'messages' is not valid", "messages [{");
}

// Log-probabilities and choices print per token and per choice; the texts of an id-only
// tokenizer are the ids.
TEST(RequestFormat, ResultsCarryLogprobsAndChoices) {
  const auto tok = Tokenizer::ids_only(dummy_model_config("opt-125m"));
  GenerationResult a{"a", {2}, {9, 10}, StopReason::kLength, {}};
  a.logprobs = {Logprobs{-0.5f, {{9, -0.5f}, {4, -1.5f}}}, Logprobs{-0.25f, {}}};
  GenerationResult b{"a", {2}, {11}, StopReason::kEos, {}};
  b.choice = 1;
  GenerationResult merged = a;
  merged.choices = {a, b};
  const auto j = result_object(merged, *tok);
  ASSERT_TRUE(j.contains("logprobs"));
  EXPECT_EQ(j["logprobs"][0]["token"], 9);
  EXPECT_EQ(j["logprobs"][0]["text"], "9");
  EXPECT_FLOAT_EQ(j["logprobs"][0]["logprob"].get<float>(), -0.5f);
  EXPECT_EQ(j["logprobs"][0]["top_logprobs"][1]["token"], 4);
  EXPECT_EQ(j["logprobs"][1]["top_logprobs"].size(), 0u);
  EXPECT_EQ(j["completion_tokens"], 3);  // every choice's tokens, as OpenAI's usage counts
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][1]["output_ids"], nlohmann::json::parse("[11]"));
  EXPECT_EQ(j["choices"][1]["stop_reason"], "eos");
  EXPECT_FALSE(j.contains("chat"));
  FieldList flat;
  for (const auto& [k, v] : j.items())
    flat.emplace_back(k, v.is_string() ? v.get<std::string>() : v.dump());
  const auto back = result_from_fields(flat);
  EXPECT_EQ(back["choices"][1]["index"], 1);  // typed again
  EXPECT_EQ(back["logprobs"][0]["token"], 9);
}

TEST(RequestFormat, ResultsPrintInTheDocumentedOrderAndReadBackTyped) {
  const auto tok = Tokenizer::ids_only(dummy_model_config("opt-125m"));
  GenerationResult ok{"a", {2, 3}, {9, 10}, StopReason::kLength, {}};
  ok.times = RequestTimes{0.5, 0.75, 1.25};
  EXPECT_EQ(result_object(ok, *tok).dump(),
            R"({"id":"a","status":"ok","text":"9 10","output_ids":[9,10],"stop_reason":"length",)"
            R"("prompt_tokens":2,"completion_tokens":2,"queue_wait_s":0.5,"first_token_s":0.75,)"
            R"("total_s":1.25,"prompt_ids":[2,3]})");
  GenerationResult bad{"b", {}, {}, StopReason::kError, "field 'x'", ErrorKind::kInvalidInput};
  const auto e = result_object(bad, *tok);
  EXPECT_EQ(e["status"], "error");
  EXPECT_EQ(e["error"], "field 'x'");
  EXPECT_EQ(e["error_type"], "invalid_request");
  EXPECT_FALSE(e.contains("queue_wait_s"));  // unknown times are left out
  GenerationResult cut{"c", {2}, {1}, StopReason::kError, "the cluster failed"};
  EXPECT_EQ(result_object(cut, *tok)["error_type"], "server_error");
  GenerationResult stopped{"d", {2}, {5, 6}, StopReason::kStop, {}};
  stopped.text = "cut";
  EXPECT_EQ(result_object(stopped, *tok)["text"], "cut");
  EXPECT_EQ(result_object(stopped, *tok)["stop_reason"], "stop");

  FieldList flat;
  const nlohmann::ordered_json object = result_object(ok, *tok);
  for (const auto& [k, v] : object.items())
    flat.emplace_back(k, v.is_string() ? v.get<std::string>() : v.dump());
  flat.emplace_back("entry", "5-0");
  const auto back = result_from_fields(flat);
  EXPECT_EQ(back["output_ids"], nlohmann::json::parse("[9, 10]"));
  EXPECT_EQ(back["completion_tokens"], 2);
  EXPECT_DOUBLE_EQ(back["total_s"].get<double>(), 1.25);
  EXPECT_EQ(back["text"], "9 10");
  EXPECT_EQ(back["entry"], "5-0");
}

TEST(RequestFormat, RefusalsCarryTheProducersId) {
  InputLimits small;
  small.request_bytes = 64;
  const std::string pad(100, 'a');
  // Over the limit: the id is read by a scan, not the parse that never happens.
  const IncomingRequest big =
      parse_request_fields({{"json", R"({"id": "mine-1", "prompt": ")" + pad + "\"}"}}, "9-0",
                           "stream entry 9-0", small);
  EXPECT_EQ(big.request.id, "mine-1");
  EXPECT_NE(big.error.find("above the limit"), std::string::npos) << big.error;
  const IncomingRequest flat =
      parse_request_fields({{"id", "mine-2"}, {"prompt", pad}}, "9-1", "stream entry 9-1", small);
  EXPECT_EQ(flat.request.id, "mine-2");
  // Not JSON, an OpenAI line's custom_id.
  const IncomingRequest broken = parse_request_fields(
      {{"openai", R"({"custom_id" : "batch-7", "body": {"model": )"}}, "9-2", "stream entry 9-2");
  EXPECT_EQ(broken.request.id, "batch-7");
  EXPECT_FALSE(broken.error.empty());
  const IncomingRequest line = parse_request_line(R"({"id": "line-3", "prompt": )", "f:3");
  EXPECT_EQ(line.request.id, "line-3");
  // No id to read: the entry id, and the error says so.
  const IncomingRequest none =
      parse_request_fields({{"json", R"({"prompt": )"}}, "9-3", "stream entry 9-3");
  EXPECT_EQ(none.request.id, "9-3");
  EXPECT_NE(none.error.find("answered under the entry id"), std::string::npos) << none.error;
  // An id that is not a plain short string is not taken.
  const IncomingRequest escaped =
      parse_request_fields({{"json", R"({"id": "a\"b", "prompt": )"}}, "9-4", "stream entry 9-4");
  EXPECT_EQ(escaped.request.id, "9-4");
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// The bound before tokenizing (issue 46): a prompt whose printable ASCII bytes alone make
// more tokens than the context is refused naming the field and the limit, and is never
// tokenized; the bound holds for every text (no text is fewer tokens than it says).
class PromptBoundTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = load_model_config(STRATA_MODEL_DIR);
    tok_ = Tokenizer::load(STRATA_MODEL_DIR, config_);
  }
  ModelConfig config_;
  std::unique_ptr<Tokenizer> tok_;
};

// llama2.c's tok512.bin (an independent export of the same vocabulary: int32 max length,
// then per token a float score, an int32 length and the bytes, '▁' written as ' ').
size_t longest_llama2c_piece(const std::string& path, size_t* longest_as_sentencepiece) {
  std::ifstream in(path, std::ios::binary);
  int32_t max_len = 0;
  in.read(reinterpret_cast<char*>(&max_len), 4);
  *longest_as_sentencepiece = 0;
  for (int i = 0; i < 512; ++i) {
    float score = 0;
    int32_t len = 0;
    in.read(reinterpret_cast<char*>(&score), 4);
    in.read(reinterpret_cast<char*>(&len), 4);
    std::string bytes(static_cast<size_t>(len), '\0');
    in.read(bytes.data(), len);
    // sentencepiece writes each space as U+2581 (3 bytes); llama2.c's special pieces
    // ("\n<s>\n") carry newlines sentencepiece's "<s>" does not.
    const size_t spaces = static_cast<size_t>(std::count(bytes.begin(), bytes.end(), ' '));
    const size_t newlines = static_cast<size_t>(std::count(bytes.begin(), bytes.end(), '\n'));
    *longest_as_sentencepiece =
        std::max(*longest_as_sentencepiece, bytes.size() + 2 * spaces - newlines);
  }
  EXPECT_TRUE(in.good()) << path;
  return static_cast<size_t>(max_len);
}

TEST_F(PromptBoundTest, TheLongestTokenIsTheVocabularysAsLlama2cExportedIt) {
  size_t as_sentencepiece = 0;
  const size_t llama2c = longest_llama2c_piece(
      std::string(STRATA_MODEL_DIR) + "/llama2c/tok512.bin", &as_sentencepiece);
  EXPECT_GE(tok_->max_token_bytes(), llama2c);
  EXPECT_EQ(tok_->max_token_bytes(), as_sentencepiece);
  EXPECT_EQ(Tokenizer::ids_only(config_)->max_token_bytes(), 0u) << "ids: no bound";
}

TEST_F(PromptBoundTest, NoTextIsFewerTokensThanTheBoundSays) {
  const size_t L = tok_->max_token_bytes();
  ASSERT_GT(L, 0u);
  std::string longest;  // the text of the longest piece: the fewest tokens per byte
  for (int32_t id = 3; id < config_.vocab; ++id) {
    std::string text = tok_->decode({id});
    if (text.size() > longest.size()) longest = text;
  }
  std::vector<std::string> texts{"Once upon a time, there was a little girl named Lily.",
                                 "!!!!!!!!!!", "a  b   c    d", "<s></s><unk>",
                                 "caf\xc3\xa9 na\xc3\xafve"};
  for (int k = 1; k <= 64; k *= 4) {
    std::string repeated;
    for (int i = 0; i < k; ++i) repeated += longest;
    texts.push_back(repeated);
  }
  for (const std::string& text : texts) {
    const auto ascii = static_cast<size_t>(
        std::count_if(text.begin(), text.end(), [](char c) { return c > 0x20 && c < 0x7f; }));
    EXPECT_GE(tok_->encode(text, false).size() * L, ascii) << text;
  }
}

TEST_F(PromptBoundTest, APromptThatCannotFitIsRefusedBeforeTokenizingNamingFieldAndLimit) {
  const size_t L = tok_->max_token_bytes();
  const PromptPrep prep{tok_.get(), 512, L};
  // 512 * L + 1 printable bytes are at least 513 tokens, whatever the tokenizer does.
  IncomingRequest r = parse_request_line(
      R"({"id": "big", "prompt": ")" + std::string(512 * L + 1, 'x') + R"("})", "f:1");
  ASSERT_EQ(r.error, "");
  prepare_prompt(r, prep);
  EXPECT_EQ(r.error,
            fmt::format("field 'prompt': at least 513 tokens exceed the context of 512 positions "
                        "(--max-context, at most the model's): its {} printable ASCII bytes "
                        "make that many, since no token covers more than {} bytes; refused "
                        "before tokenizing",
                        512 * L + 1, L));
  EXPECT_TRUE(r.request.prompt_ids.empty()) << "not tokenized";
  EXPECT_EQ(r.request.id, "big");
  // One byte less fits the bound and is tokenized (then judged by its real length).
  IncomingRequest fits =
      parse_request_line(R"({"prompt": ")" + std::string(512 * L, 'x') + R"("})", "f:2");
  prepare_prompt(fits, prep);
  EXPECT_EQ(fits.error, "");
  EXPECT_FALSE(fits.request.prompt_ids.empty());
  EXPECT_FALSE(fits.prompt.has_value());
  // Spaces are not counted: whitespace may be collapsed away.
  IncomingRequest spaces =
      parse_request_line(R"({"prompt": "a)" + std::string(512 * L * 4, ' ') + R"("})", "f:3");
  prepare_prompt(spaces, prep);
  EXPECT_EQ(spaces.error, "");
  // Without a context no bound is applied; without a tokenizer, text is refused as before.
  IncomingRequest unbounded =
      parse_request_line(R"({"prompt": ")" + std::string(512 * L + 1, 'x') + R"("})", "f:4");
  prepare_prompt(unbounded, PromptPrep{tok_.get()});
  EXPECT_EQ(unbounded.error, "");
  IncomingRequest no_tok = parse_request_line(R"({"prompt": "x"})", "f:5");
  prepare_prompt(no_tok, PromptPrep{});
  EXPECT_EQ(no_tok.error, "field 'prompt': this run has no tokenizer; send prompt_ids");
}

}  // namespace
}  // namespace strata
