// strata generate: prompts in, completions out (text or one JSON object per prompt).
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/error.h"
#include "launch/engine.h"

namespace strata::cli {
namespace {

struct GenerateOptions {
  EngineOptions engine;
  std::vector<std::string> prompts;
  std::string prompt_file;
  int max_new_tokens = 64;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  std::string format = "text";
};

// One prompt per line; a trailing newline does not make an extra (empty) prompt.
std::vector<std::string> read_prompt_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_input("cannot open prompt file '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.empty()) fail_input("prompt file '{}' is empty: it needs one prompt per line", path);
  if (text.back() == '\n') text.pop_back();
  std::vector<std::string> prompts;
  size_t start = 0;
  while (true) {
    const size_t nl = text.find('\n', start);
    std::string line = text.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    prompts.push_back(line);
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  return prompts;
}

nlohmann::ordered_json result_json(const std::string& prompt, const GenerationResult& r,
                                   const Tokenizer& tok) {
  nlohmann::ordered_json j;  // fields in the documented order
  j["prompt"] = prompt;
  j["prompt_ids"] = r.prompt_ids;
  j["output_ids"] = r.output_ids;
  std::vector<int32_t> all = r.prompt_ids;
  all.insert(all.end(), r.output_ids.begin(), r.output_ids.end());
  const std::string full = tok.decode(all);
  const std::string prompt_text = tok.decode(r.prompt_ids);
  j["text"] = full;
  j["completion"] =
      full.rfind(prompt_text, 0) == 0 ? full.substr(prompt_text.size()) : tok.decode(r.output_ids);
  j["stop_reason"] = stop_reason_name(r.stop_reason);
  if (!r.error.empty()) j["error"] = r.error;
  return j;
}

int run_generate(const GenerateOptions& o) {
  std::vector<std::string> prompts = o.prompts;
  if (!o.prompt_file.empty()) {
    auto more = read_prompt_file(o.prompt_file);
    prompts.insert(prompts.end(), more.begin(), more.end());
  }
  if (prompts.empty()) fail_input("no prompts: pass --prompt TEXT or --prompt-file FILE");
  SamplingParams sampling{o.temperature, o.top_k, o.top_p, o.seed};
  sampling.validate();

  Engine e = make_engine(o.engine);
  std::vector<GenerationRequest> requests;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r;
    r.id = std::to_string(i);
    r.prompt_ids = e.tokenizer->encode(prompts[i]);
    r.max_new_tokens = o.max_new_tokens;
    r.sampling = sampling;
    r.sampling.seed = o.seed + i;  // each prompt its own stream, independent of batching
    requests.push_back(std::move(r));
  }
  Generator gen(*e.model, e.generator);
  GenerationStats stats;
  const auto results = gen.run(requests, &stats);
  int failures = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const nlohmann::ordered_json j = result_json(prompts[i], results[i], *e.tokenizer);
    if (results[i].stop_reason == StopReason::kError) {
      ++failures;
      std::fprintf(stderr, "strata: prompt %zu refused: %s\n", i, results[i].error.c_str());
    }
    if (o.format == "json") {
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("%s\n", j["text"].get<std::string>().c_str());
    }
  }
  std::fflush(stdout);
  std::fprintf(stderr, "%s\n", (R"({"summary": )" + stats.json() + "}").c_str());
  return failures == 0 ? 0 : 1;
}

}  // namespace

Command add_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text for prompts on one node");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--prompt", o->prompts,
                  "Prompt text (repeatable); token ids for models without a tokenizer");
  cmd->add_option("--prompt-file", o->prompt_file, "File with one prompt per line");
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "Tokens to generate per prompt")
      ->check(non_negative());
  cmd->add_option("--temperature", o->temperature, "0 = greedy")->check(non_negative());
  cmd->add_option("--top-p", o->top_p, "Nucleus sampling threshold in (0, 1]");
  cmd->add_option("--top-k", o->top_k, "Keep the k most likely tokens (0 = off)")
      ->check(non_negative());
  cmd->add_option("--seed", o->seed, "Sampling seed (prompt i uses seed + i)");
  cmd->add_option("--format", o->format, "Output format")->check(CLI::IsMember({"text", "json"}));
  return {cmd, [o] { return run_generate(*o); }};
}

}  // namespace strata::cli
