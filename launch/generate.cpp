// strata generate: prompts in, completions out (text or one JSON object per prompt).
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "kernels/error.h"
#include "kernels/log.h"
#include "launch/engine.h"
#include "worker/text.h"

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
  float min_p = 0.0f;
  float presence_penalty = 0.0f, frequency_penalty = 0.0f, repetition_penalty = 1.0f;
  std::string format = "text";
};

// One prompt per line; a trailing newline does not make an extra (empty) prompt. Bounded as
// it is read, before it costs anything: the file by limits.prompt_file_bytes, each line by
// prompt_bytes (so /dev/zero is refused after one line's worth), the lines by prompts.
class PromptLines {
 public:
  PromptLines(const std::string& path, const InputLimits& limits) : path_(path), limits_(limits) {}

  void add(std::string_view chunk) {
    for (size_t nl; (nl = chunk.find('\n')) != std::string_view::npos;
         chunk.remove_prefix(nl + 1)) {
      append(chunk.substr(0, nl));
      finish_line();
    }
    append(chunk);
  }
  std::vector<std::string> finish() {
    if (!line_.empty()) finish_line();  // the last line had no newline
    if (lines_.empty())
      fail_input("prompt file '{}' is empty: it needs one prompt per line", path_);
    return std::move(lines_);
  }

 private:
  void append(std::string_view part) {
    limits_.check(&InputLimits::prompt_bytes, static_cast<int64_t>(line_.size() + part.size()),
                  path_,
                  fmt::format("bytes of the prompt on line {} (at least)", lines_.size() + 1));
    line_.append(part);
  }
  void finish_line() {
    limits_.check(&InputLimits::prompts, static_cast<int64_t>(lines_.size()) + 1, path_,
                  "number of prompts");
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    lines_.push_back(std::move(line_));
    line_.clear();
  }

  const std::string& path_;
  const InputLimits& limits_;
  std::string line_;
  std::vector<std::string> lines_;
};

std::vector<std::string> read_prompt_file(const std::string& path, const InputLimits& limits) {
  PromptLines lines(path, limits);
  read_bounded(path, limits, &InputLimits::prompt_file_bytes, "prompt file",
               [&](std::string_view chunk) { lines.add(chunk); });
  return lines.finish();
}

std::vector<std::string> gather_prompts(const GenerateOptions& o, const InputLimits& limits) {
  for (size_t i = 0; i < o.prompts.size(); ++i)
    limits.check(&InputLimits::prompt_bytes, static_cast<int64_t>(o.prompts[i].size()),
                 "command line", fmt::format("bytes of --prompt {}", i + 1));
  std::vector<std::string> prompts = o.prompts;
  if (!o.prompt_file.empty()) {
    auto more = read_prompt_file(o.prompt_file, limits);
    limits.check(&InputLimits::prompts, static_cast<int64_t>(prompts.size() + more.size()),
                 "command line", "number of prompts (--prompt and --prompt-file)");
    prompts.insert(prompts.end(), std::make_move_iterator(more.begin()),
                   std::make_move_iterator(more.end()));
  }
  if (prompts.empty()) fail_input("no prompts: pass --prompt TEXT or --prompt-file FILE");
  return prompts;
}

nlohmann::ordered_json result_json(const std::string& prompt, const GenerationResult& r,
                                   const Tokenizer& tok) {
  nlohmann::ordered_json j;  // fields in the documented order
  j["prompt"] = to_valid_utf8(prompt);
  j["prompt_ids"] = r.prompt_ids;
  j["output_ids"] = r.output_ids;
  std::vector<int32_t> all = r.prompt_ids;
  all.insert(all.end(), r.output_ids.begin(), r.output_ids.end());
  const std::string full = tok.decode(all);
  const std::string prompt_text = tok.decode(r.prompt_ids);
  // A completion may end inside a multi-byte character: printed with U+FFFD, never refused.
  j["text"] = to_valid_utf8(full);
  j["completion"] = to_valid_utf8(full.rfind(prompt_text, 0) == 0 ? full.substr(prompt_text.size())
                                                                  : tok.decode(r.output_ids));
  j["stop_reason"] = stop_reason_name(r.stop_reason);
  if (!r.error.empty()) j["error"] = to_valid_utf8(r.error);
  return j;
}

// An error result for prompt `i`, for what cannot be generated or printed.
GenerationResult error_result(size_t i, const std::string& why) {
  GenerationResult r;
  r.id = std::to_string(i);
  r.stop_reason = StopReason::kError;
  r.error = fmt::format("prompt {}: {}", i, why);
  return r;
}

// Writes results in prompt order as soon as each and all before it are final, so output
// starts before the last prompt finishes and nothing computed is lost to a later failure.
class OrderedPrinter {
 public:
  OrderedPrinter(const std::vector<std::string>& prompts, const Tokenizer& tok, bool json)
      : prompts_(prompts), tok_(tok), json_(json), done_(prompts.size()) {}

  void take(size_t i, const GenerationResult& r) {
    done_[i] = r;
    while (next_ < done_.size() && done_[next_]) {
      print(next_, *done_[next_]);
      done_[next_].reset();  // printed: free it
      ++next_;
    }
  }
  int failures() const { return failures_; }

 private:
  void print(size_t i, const GenerationResult& r) {
    nlohmann::ordered_json j;
    try {
      j = result_json(prompts_[i], r, tok_);
    } catch (const InputError& e) {  // e.g. an id the tokenizer cannot decode
      j = result_json(prompts_[i], error_result(i, e.what()), tok_);
    }
    if (j.contains("error")) {
      ++failures_;
      std::fprintf(stderr, "strata: prompt %zu refused: %s\n", i,
                   j["error"].get<std::string>().c_str());
    }
    const std::string line = json_ ? j.dump() : j["text"].get<std::string>();
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  const std::vector<std::string>& prompts_;
  const Tokenizer& tok_;
  bool json_;
  std::vector<std::optional<GenerationResult>> done_;
  size_t next_ = 0;
  int failures_ = 0;
};

int run_generate(const GenerateOptions& o) {
  const InputLimits limits = input_limits(o.engine.limits);
  const std::vector<std::string> prompts = gather_prompts(o, limits);
  SamplingParams sampling{o.temperature, o.top_k, o.top_p, o.seed};
  sampling.min_p = o.min_p;
  sampling.presence_penalty = o.presence_penalty;
  sampling.frequency_penalty = o.frequency_penalty;
  sampling.repetition_penalty = o.repetition_penalty;
  sampling.validate();

  Engine e = make_engine(o.engine);
  OrderedPrinter printer(prompts, *e.tokenizer, o.format == "json");
  std::vector<GenerationRequest> requests;
  std::vector<size_t> index;  // request -> prompt
  for (size_t i = 0; i < prompts.size(); ++i) {
    // A prompt that is not UTF-8 could not be printed back: its own error, the rest run.
    if (const auto bad = first_invalid_utf8(prompts[i]); bad >= 0) {
      printer.take(i, error_result(i, fmt::format("not valid UTF-8 (byte {} is 0x{:02x})", bad,
                                                  static_cast<uint8_t>(prompts[i][bad]))));
      continue;
    }
    GenerationRequest r;
    r.id = std::to_string(i);
    try {
      r.prompt_ids = e.tokenizer->encode(prompts[i]);
    } catch (const InputError& err) {
      fail_input("prompt {}: {}", i, err.what());
    }
    r.max_new_tokens = o.max_new_tokens;
    r.sampling = sampling;
    r.sampling.seed = o.seed + i;  // each prompt its own stream, independent of batching
    requests.push_back(std::move(r));
    index.push_back(i);
  }
  LocalCluster gen(*e.model, e.local, e.tokenizer.get());
  GenerationStats stats;
  gen.run(requests, &stats,
          [&](size_t r, const GenerationResult& result) { printer.take(index[r], result); });
  if (stats.pie) log::get("launch")->info("{}", stats.pie->str());
  std::fprintf(stderr, "%s\n", (R"({"summary": )" + stats.json() + "}").c_str());
  return printer.failures() == 0 ? 0 : 1;
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
  cmd->add_option("--min-p", o->min_p, "Drop tokens below min-p x the top one's probability");
  cmd->add_option("--presence-penalty", o->presence_penalty, "OpenAI's, in [-2, 2]");
  cmd->add_option("--frequency-penalty", o->frequency_penalty, "OpenAI's, in [-2, 2]");
  cmd->add_option("--repetition-penalty", o->repetition_penalty, "CTRL's, > 0 (1 = off)");
  cmd->add_option("--format", o->format, "Output format")->check(CLI::IsMember({"text", "json"}));
  return {cmd, [o] { return run_generate(*o); }};
}

}  // namespace strata::cli
