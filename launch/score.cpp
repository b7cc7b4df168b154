// strata score: teacher-forced log-likelihoods of given texts (what an evaluation suite
// asks for), optionally with every position's raw logits.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "launch/engine.h"
#include "worker/scoring.h"

namespace strata::cli {
namespace {

struct ScoreOptions {
  EngineOptions engine;
  std::vector<std::string> texts;
  std::vector<std::string> ids;  // token ids to score as they are ("1 403 407")
  std::string logits_out;
};

int run_score(const ScoreOptions& o) {
  if (o.texts.empty() == o.ids.empty())
    fail_input("give what to score as --prompt TEXT or --ids \"1 2 3\" (repeatable), not both");
  const InputLimits limits = input_limits(o.engine.limits);
  for (size_t i = 0; i < o.texts.size(); ++i)
    limits.check(&InputLimits::prompt_bytes, static_cast<int64_t>(o.texts[i].size()),
                 "command line", fmt::format("bytes of --prompt {}", i + 1));
  Engine e = make_engine(o.engine);
  std::ofstream logits_file;
  if (!o.logits_out.empty()) {
    logits_file.open(o.logits_out, std::ios::binary | std::ios::trunc);
    if (!logits_file) fail_input("cannot write --logits-out file '{}'", o.logits_out);
  }
  const int32_t vocab = e.config.vocab;
  const auto as_ids = Tokenizer::ids_only(e.config);
  const bool by_ids = !o.ids.empty();
  for (const std::string& text : by_ids ? o.ids : o.texts) {
    const std::vector<int32_t> ids = by_ids ? as_ids->encode(text) : e.tokenizer->encode(text);
    const std::vector<float> logits = teacher_forced_logits(*e.model, ids, e.model->max_rows());
    const std::vector<double> lp = next_token_logprobs(logits, ids, vocab);
    double total = 0.0;
    for (double v : lp) total += v;
    nlohmann::ordered_json j;
    j["prompt"] = text;
    j["ids"] = ids;
    j["logprobs"] = lp;
    j["sum_logprob"] = total;
    j["perplexity"] = lp.empty() ? 1.0 : std::exp(-total / static_cast<double>(lp.size()));
    std::printf("%s\n", j.dump().c_str());
    if (logits_file.is_open())
      logits_file.write(reinterpret_cast<const char*>(logits.data()),
                        static_cast<std::streamsize>(logits.size() * sizeof(float)));
  }
  if (logits_file.is_open() && !logits_file)
    fail(ErrorKind::kFailed, "writing '{}' failed", o.logits_out);
  return 0;
}

}  // namespace

Command add_score(CLI::App& app) {
  auto o = std::make_shared<ScoreOptions>();
  CLI::App* cmd = app.add_subcommand(
      "score", "Teacher-forced log-likelihood of texts (one JSON object per text)");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--prompt", o->texts,
                  "Text to score (repeatable); ids for models without a tokenizer");
  cmd->add_option("--ids", o->ids,
                  "Token ids to score as they are, space or comma separated (repeatable)");
  cmd->add_option(
      "--logits-out", o->logits_out,
      "Also write every position's logits: raw little-endian f32, [tokens, vocab] per text, "
      "texts one after another");
  return {cmd, [o] { return run_score(*o); }};
}

}  // namespace strata::cli
