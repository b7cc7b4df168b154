// strata tokenize: what the model's tokenizer makes of text, one JSON line per input, for
// checking prompt lengths and for comparing with Hugging Face's tokenizers (docs/TEXT.md).
// --decode turns ids back into text instead; lines with "messages" are rendered by the
// model's chat template first.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "launch/commands.h"
#include "worker/input_limits.h"
#include "worker/text.h"
#include "worker/tokenizer.h"

namespace strata::cli {
namespace {

using ojson = nlohmann::ordered_json;

struct TokenizeOptions {
  std::string tokenizer;
  std::string text;
  std::string file;
  bool add_special = false;
  bool decode = false;
  bool keep_special = false;
  bool timing = false;
};

// One input line: {"text": ...}, {"messages": [...], "add_generation_prompt": true} or, with
// --decode, {"ids": [...]}.
ojson process(const nlohmann::json& in, const Tokenizer& tok, const TokenizeOptions& o) {
  if (!in.is_object()) fail_input("a line must be a JSON object");
  ojson out;
  if (o.decode) {
    if (!in.contains("ids") || !in.at("ids").is_array())
      fail_input("--decode reads lines with an \"ids\" array");
    std::vector<int32_t> ids;
    for (const auto& v : in.at("ids")) {
      if (!v.is_number_integer()) fail_input("ids must be integers, got {}", v.dump());
      ids.push_back(v.get<int32_t>());
    }
    out["text"] = to_valid_utf8(tok.decode(ids, !o.keep_special));
    return out;
  }
  std::string text;
  bool add_special = o.add_special;
  if (in.contains("messages")) {
    const bool gen = in.value("add_generation_prompt", true);
    text = tok.render_chat(in.at("messages"), gen,
                           in.value("chat_template_kwargs", nlohmann::json::object()));
    add_special = false;  // the template writes the special tokens itself
    out["text"] = text;
  } else if (in.contains("text") && in.at("text").is_string()) {
    text = in.at("text").get<std::string>();
  } else {
    fail_input("a line needs a \"text\" string or \"messages\"");
  }
  const std::vector<int32_t> ids = tok.encode(text, add_special);
  out["ids"] = ids;
  ojson pieces = ojson::array();
  for (int32_t id : ids) pieces.push_back(to_valid_utf8(tok.piece(id)));
  out["tokens"] = std::move(pieces);
  return out;
}

void print(const ojson& j) {
  const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::printf("%s\n", line.c_str());
}

int run_tokenize(const TokenizeOptions& o) {
  if (o.text.empty() == o.file.empty()) fail_input("give exactly one of --text and --file");
  const InputLimits limits = InputLimits::from_env();
  const auto tok = Tokenizer::open(o.tokenizer, limits);
  if (!o.text.empty()) {
    nlohmann::json in =
        o.decode ? nlohmann::json::parse(o.text, nullptr, false) : nlohmann::json{{"text", o.text}};
    if (o.decode && (in.is_discarded() || !in.is_array()))
      fail_input("--text with --decode must be a JSON array of ids, got '{}'", o.text);
    if (o.decode) in = nlohmann::json{{"ids", in}};
    print(process(in, *tok, o));
    return 0;
  }
  std::ifstream f(o.file);
  if (!f) fail_input("--file {}: cannot open", o.file);
  std::string line;
  int64_t n = 0, tokens = 0;
  double seconds = 0;
  for (int64_t lineno = 1; std::getline(f, line); ++lineno) {
    if (line.empty()) continue;
    const std::string where = fmt::format("{}:{}", o.file, lineno);
    const auto in = nlohmann::json::parse(line, nullptr, false);
    if (in.is_discarded()) fail_input("{}: not valid JSON", where);
    const auto t0 = std::chrono::steady_clock::now();
    ojson out;
    try {
      out = process(in, *tok, o);
    } catch (const InputError& e) {
      fail_input("{}: {}", where, e.what());
    }
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++n;
    if (out.contains("ids")) tokens += static_cast<int64_t>(out.at("ids").size());
    print(out);
  }
  if (o.timing)
    std::fprintf(stderr,
                 "{\"tokenizer\": \"%s\", \"lines\": %lld, \"tokens\": %lld, "
                 "\"seconds\": %.6f, \"tokens_per_s\": %.1f}\n",
                 tok->kind().c_str(), static_cast<long long>(n), static_cast<long long>(tokens),
                 seconds, seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0);
  return 0;
}

}  // namespace

Command add_tokenize(CLI::App& app) {
  auto o = std::make_shared<TokenizeOptions>();
  CLI::App* cmd =
      app.add_subcommand("tokenize", "Text to token ids (or back) with a model's tokenizer");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "tokenizer.json, tokenizer.model, or a model folder (vocab.json + merges.txt "
                  "too)")
      ->required();
  cmd->add_option("--text", o->text, "One text (with --decode: a JSON array of ids)");
  cmd->add_option("--file", o->file,
                  "JSONL: lines with \"text\" (or \"messages\", rendered by the chat template; "
                  "with --decode, \"ids\")");
  cmd->add_flag("--add-special", o->add_special,
                "Add the special tokens the model's files add (BOS/EOS); off by default");
  cmd->add_flag("--decode", o->decode, "Ids to text");
  cmd->add_flag("--keep-special", o->keep_special,
                "With --decode: print special tokens instead of skipping them");
  cmd->add_flag("--timing", o->timing,
                "Print the encode time and tokens/s of --file (one thread) as JSON on stderr");
  return {cmd, [o] { return run_tokenize(*o); }};
}

}  // namespace strata::cli
