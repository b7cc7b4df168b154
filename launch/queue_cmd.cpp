// strata submit / strata collect: the producer's side of the Redis queue (docs/QUEUE.md).
// submit adds requests to the request stream (prompts from the command line, or a JSONL
// file of Strata or OpenAI batch lines stored whole) and can wait for their results with
// a progress bar; collect writes the results stream out as JSONL, in Strata's result
// format or shaped like OpenAI Batch API output lines.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "coordinator/intake/redis_queue.h"
#include "coordinator/intake/request_format.h"
#include "kernels/error.h"
#include "launch/commands.h"
#include "launch/progress.h"
#include "transport/redis_client.h"
#include "worker/text.h"

namespace strata::cli {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr double kCommandSeconds = 10;
constexpr size_t kBatch = 512;  // XADDs per round trip

struct SubmitOptions {
  std::string redis;
  std::string redis_password_file;
  std::string request_stream = "strata:requests";
  std::string result_stream = "strata:results";
  std::vector<std::string> prompts;
  std::string file;
  int max_new_tokens = 64;
  float temperature = 0;
  float top_p = 1;
  int top_k = 0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool wait = false;
  double timeout = 3600;
};

struct Submission {
  FieldList fields;
  std::string id;  // the request's own id; empty: its entry id names it
};

Deadline command_deadline() {
  return Deadline::after_seconds(kCommandSeconds);
}

RedisConnection connect(const std::string& url, const std::string& password_file) {
  if (url.empty()) fail_input("--redis URL is required (redis://host:port)");
  return RedisConnection::open(RedisEndpoint::resolve(url, password_file), command_deadline());
}

// A file line goes whole into one field: `openai` for an OpenAI batch line, `json` for a
// Strata request. Its id is read here only to wait for its result; the server validates
// the rest (and answers a line it refuses with an error result under the line's id).
Submission from_line(const std::string& line, const json& j) {
  Submission s;
  const bool openai = j.is_object() && (j.contains("custom_id") || j.contains("body"));
  s.fields = {{openai ? "openai" : "json", line}};
  const char* key = openai ? "custom_id" : "id";
  if (j.is_object() && j.contains(key)) {
    if (j[key].is_string()) s.id = j[key].get<std::string>();
    if (j[key].is_number_integer()) s.id = j[key].dump();
  }
  return s;
}

struct FileRequests {
  std::vector<Submission> good;
  std::vector<std::string> refused;  // "FILE:LINE: what is wrong", one per line not queued
};

// Every line that can be a request is queued; a line the server could never answer under
// its producer's id (above request_bytes, not UTF-8, not JSON, nested too deep) is refused
// here, named by its line number, and the others still go.
FileRequests read_file(const std::string& path, const InputLimits& limits) {
  const std::string text =
      read_file_bounded(path, limits, &InputLimits::prompt_file_bytes, "request file");
  FileRequests out;
  size_t n = 0;
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    std::string_view line(text.data() + at, end - at);
    at = end + 1;
    ++n;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    const std::string where = fmt::format("{}:{}", path, n);
    try {
      limits.check(&InputLimits::request_bytes, static_cast<int64_t>(line.size()),
                   where + ": request", "bytes");
      if (const int64_t bad = first_invalid_utf8(line); bad >= 0)
        fail_input("{}: not valid UTF-8 (byte {} is 0x{:02x})", where, bad,
                   static_cast<unsigned char>(line[static_cast<size_t>(bad)]));
      json j;
      try {
        j = parse_request_json(line, limits);
      } catch (const json::exception& e) {
        fail_input("{}: not valid JSON: {}", where, e.what());
      } catch (const InputError& e) {
        fail_input("{}: {}", where, e.what());
      }
      out.good.push_back(from_line(std::string(line), j));
    } catch (const InputError& e) {
      out.refused.emplace_back(e.what());
    }
  }
  for (const std::string& r : out.refused) std::fprintf(stderr, "strata submit: %s\n", r.c_str());
  if (out.good.empty() && out.refused.empty())
    fail_input("request file '{}' holds no request", path);
  if (out.good.empty())
    fail_input("request file '{}' holds no valid request: all {} lines refused (above)", path,
               out.refused.size());
  return out;
}

std::vector<Submission> from_prompts(const SubmitOptions& o) {
  std::vector<Submission> out;
  for (const std::string& p : o.prompts) {
    Submission s;
    s.fields = {{"prompt", p},
                {"max_new_tokens", std::to_string(o.max_new_tokens)},
                {"temperature", fmt::format("{}", o.temperature)},
                {"top_p", fmt::format("{}", o.top_p)},
                {"top_k", std::to_string(o.top_k)},
                {"seed", std::to_string(o.seed)}};
    if (!o.stop.empty()) s.fields.emplace_back("stop", json(o.stop).dump());
    if (o.ignore_eos) s.fields.emplace_back("ignore_eos", "true");
    out.push_back(std::move(s));
  }
  return out;
}

// The results stream's last entry id before anything is submitted: results after it are
// the ones to wait for.
std::string last_result_id(RedisConnection& c, const std::string& stream) {
  const RedisReply r = c.command({"XREVRANGE", stream, "+", "-", "COUNT", "1"}, command_deadline());
  return r.size() == 0 ? "0-0" : r.at(0, "XREVRANGE").at(0, "entry id").as_string("entry id");
}

// XADDs in pipelined batches; fills in each request's name (its id, or its entry id).
void add_all(RedisConnection& c, const std::string& stream, std::vector<Submission>& subs) {
  for (size_t i = 0; i < subs.size(); i += kBatch) {
    std::vector<RedisArgs> commands;
    const size_t end = std::min(subs.size(), i + kBatch);
    for (size_t k = i; k < end; ++k) {
      RedisArgs a{"XADD", stream, "*"};
      for (const auto& [name, value] : subs[k].fields) {
        a.push_back(name);
        a.push_back(value);
      }
      commands.push_back(std::move(a));
    }
    const std::vector<RedisReply> replies = c.pipeline(commands, command_deadline());
    for (size_t k = i; k < end; ++k) {
      const RedisReply& r = replies[k - i];
      if (r.type == RedisReply::Type::kError) throw RedisError(r.str);
      if (subs[k].id.empty()) subs[k].id = r.str;
    }
  }
}

struct Tally {
  size_t done = 0, ok = 0, errors = 0;
  size_t earlier = 0;  // ids that had their result before this submission (not run again)
};

// Waits for one result per submitted id: results already stored (a resubmitted id) count
// at once; the others as they appear after `from` on the results stream.
Tally wait_for_results(RedisConnection& c, const SubmitOptions& o,
                       const std::vector<Submission>& subs, std::string from) {
  std::set<std::string> waiting;
  for (const Submission& s : subs) waiting.insert(s.id);
  Tally t;
  Progress progress("results", waiting.size());
  RedisArgs lookup{"HMGET", RedisQueueOptions{.result_stream = o.result_stream}.done_hash()};
  lookup.insert(lookup.end(), waiting.begin(), waiting.end());
  const RedisReply done = c.command(lookup, command_deadline());
  size_t i = 0;
  for (auto it = waiting.begin(); it != waiting.end(); ++i) {
    if (done.at(i, "HMGET").is_nil()) {
      ++it;
      continue;
    }
    it = waiting.erase(it);
    ++t.done;
    ++t.earlier;
  }
  const Deadline deadline = Deadline::after_seconds(o.timeout > 0 ? o.timeout : 1e9);
  while (!waiting.empty()) {
    if (deadline.expired())
      fail(ErrorKind::kOverloaded, "{} of {} results still missing after {} s (--timeout)",
           waiting.size(), subs.size(), o.timeout);
    const RedisReply r =
        c.command({"XREAD", "COUNT", "1000", "BLOCK", "1000", "STREAMS", o.result_stream, from},
                  Deadline::after_seconds(kCommandSeconds + 1));
    if (!r.is_nil() && r.size() > 0) {
      for (const RedisReply& e : r.at(0, "XREAD stream").at(1, "XREAD entries").elements) {
        from = e.at(0, "entry id").str;
        const RedisReply& f = e.at(1, "fields");
        std::string id, status;
        for (size_t k = 0; k + 1 < f.size(); k += 2) {
          if (f.elements[k].str == "id") id = f.elements[k + 1].str;
          if (f.elements[k].str == "status") status = f.elements[k + 1].str;
        }
        if (waiting.erase(id) == 0) continue;
        ++t.done;
        ++(status == "ok" ? t.ok : t.errors);
      }
    }
    progress.update(t.done);
  }
  progress.finish(t.done);
  return t;
}

int run_submit(SubmitOptions o) {
  if (o.prompts.empty() == o.file.empty())
    fail_input("give either --prompt TEXT (one or more) or --file FILE.jsonl");
  FileRequests file;
  if (!o.file.empty()) file = read_file(o.file, InputLimits::from_env());
  std::vector<Submission> subs = o.file.empty() ? from_prompts(o) : std::move(file.good);
  RedisConnection c = connect(o.redis, o.redis_password_file);
  const std::string from = o.wait ? last_result_id(c, o.result_stream) : "";
  add_all(c, o.request_stream, subs);
  if (file.refused.empty()) {
    std::fprintf(stderr, "strata submit: %zu requests added to '%s'\n", subs.size(),
                 o.request_stream.c_str());
  } else {
    std::fprintf(stderr, "strata submit: %zu requests added to '%s', %zu lines of '%s' refused\n",
                 subs.size(), o.request_stream.c_str(), file.refused.size(), o.file.c_str());
  }
  // A file with refused lines exits 2 once the good ones are queued (and answered).
  const int status = file.refused.empty() ? 0 : 2;
  if (!o.wait) {
    for (const Submission& s : subs) std::printf("%s\n", s.id.c_str());
    return status;
  }
  const Tally t = wait_for_results(c, o, subs, from);
  std::fprintf(stderr, "strata submit: %zu results: %zu ok, %zu errors, %zu answered earlier\n",
               t.done, t.ok, t.errors, t.earlier);
  return status;
}

// ---- collect -----------------------------------------------------------------------------

struct CollectOptions {
  std::string redis;
  std::string redis_password_file;
  std::string result_stream = "strata:results";
  std::string out;
  std::string format = "strata";
  std::string from = "-";
  std::string model_name = "strata";
};

// An OpenAI Batch API output line for one result
// (https://platform.openai.com/docs/api-reference/batch).
using ojson = nlohmann::ordered_json;

const char* finish_reason(const ojson& choice) {
  const std::string stop = choice.value("stop_reason", "");
  return stop == "eos" || stop == "stop" ? "stop" : "length";
}

// Log-probabilities as each endpoint reports them: completions' parallel lists, chat's
// `content` entries with bytes.
ojson completion_logprobs(const ojson& lp) {
  ojson out{{"tokens", ojson::array()},
            {"token_logprobs", ojson::array()},
            {"top_logprobs", ojson::array()},
            {"text_offset", ojson::array()}};
  int64_t offset = 0;
  for (const ojson& t : lp) {
    out["tokens"].push_back(t.value("text", ""));
    out["token_logprobs"].push_back(t.value("logprob", 0.0));
    ojson top = ojson::object();
    for (const ojson& a : t.value("top_logprobs", ojson::array()))
      top[a.value("text", "")] = a.value("logprob", 0.0);
    out["top_logprobs"].push_back(std::move(top));
    out["text_offset"].push_back(offset);
    offset += static_cast<int64_t>(t.value("text", "").size());
  }
  return out;
}

ojson bytes_of(const std::string& s) {
  ojson b = ojson::array();
  for (unsigned char c : s) b.push_back(c);
  return b;
}

ojson chat_logprobs(const ojson& lp) {
  ojson content = ojson::array();
  for (const ojson& t : lp) {
    ojson top = ojson::array();
    for (const ojson& a : t.value("top_logprobs", ojson::array()))
      top.push_back({{"token", a.value("text", "")},
                     {"logprob", a.value("logprob", 0.0)},
                     {"bytes", bytes_of(a.value("text", ""))}});
    content.push_back({{"token", t.value("text", "")},
                       {"logprob", t.value("logprob", 0.0)},
                       {"bytes", t.value("bytes", ojson::array())},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

ojson openai_choice(const ojson& c, int64_t index, bool chat) {
  const bool has_lp = c.contains("logprobs") && c.at("logprobs").is_array();
  ojson out{{"index", index}};
  if (chat) {
    out["message"] = {{"role", "assistant"}, {"content", c.value("text", "")}};
    out["logprobs"] = has_lp ? chat_logprobs(c.at("logprobs")) : ojson(nullptr);
  } else {
    out["text"] = c.value("text", "");
    out["logprobs"] = has_lp ? completion_logprobs(c.at("logprobs")) : ojson(nullptr);
  }
  out["finish_reason"] = finish_reason(c);
  return out;
}

ojson openai_line(const ojson& r, const std::string& entry, const std::string& model) {
  const std::string id = r.value("id", entry);
  const int64_t created = std::stoll(entry.substr(0, entry.find('-'))) / 1000;
  ojson line{{"id", "batch_req_" + entry}, {"custom_id", id}};
  if (r.value("status", "") == "ok") {
    const bool chat = r.value("chat", false);
    const int64_t prompt = r.value("prompt_tokens", int64_t{0});
    const int64_t completion = r.value("completion_tokens", int64_t{0});
    ojson choices = ojson::array();
    if (r.contains("choices") && r.at("choices").is_array()) {
      for (const ojson& c : r.at("choices"))
        choices.push_back(openai_choice(c, c.value("index", int64_t{0}), chat));
    } else {
      choices.push_back(openai_choice(r, 0, chat));
    }
    line["response"] = {{"status_code", 200},
                        {"request_id", entry},
                        {"body",
                         {{"id", (chat ? "chatcmpl-" : "cmpl-") + entry},
                          {"object", chat ? "chat.completion" : "text_completion"},
                          {"created", created},
                          {"model", model},
                          {"choices", std::move(choices)},
                          {"usage",
                           {{"prompt_tokens", prompt},
                            {"completion_tokens", completion},
                            {"total_tokens", prompt + completion}}}}}};
    line["error"] = nullptr;
    return line;
  }
  const bool invalid = r.value("error_type", "") == "invalid_request";
  line["response"] = {{"status_code", invalid ? 400 : 500},
                      {"request_id", entry},
                      {"body",
                       {{"error",
                         {{"message", r.value("error", "")},
                          {"type", invalid ? "invalid_request_error" : "server_error"},
                          {"param", nullptr},
                          {"code", nullptr}}}}}};
  line["error"] = nullptr;  // the request got an HTTP answer, as the Batch API reports it
  return line;
}

int run_collect(const CollectOptions& o) {
  if (o.format != "strata" && o.format != "openai")
    fail_input("--format must be strata or openai, got '{}'", o.format);
  RedisConnection c = connect(o.redis, o.redis_password_file);
  std::FILE* out = o.out == "-" ? stdout : std::fopen(o.out.c_str(), "wb");
  if (out == nullptr) fail_input("cannot open '{}' for writing", o.out);
  std::string start = o.from;
  size_t n = 0;
  while (true) {
    const RedisReply page =
        c.command({"XRANGE", o.result_stream, start, "+", "COUNT", "1000"}, command_deadline());
    for (const RedisReply& e : page.elements) {
      const std::string& entry = e.at(0, "entry id").as_string("entry id");
      FieldList fields;
      const RedisReply& f = e.at(1, "fields");
      for (size_t k = 0; k + 1 < f.size(); k += 2)
        fields.emplace_back(f.elements[k].str, f.elements[k + 1].str);
      const nlohmann::ordered_json r = result_from_fields(fields);
      const ojson shaped = o.format == "openai" ? openai_line(r, entry, o.model_name) : r;
      const std::string line = shaped.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
      if (std::fwrite(line.data(), 1, line.size(), out) != line.size())
        fail(ErrorKind::kFailed, "cannot write to '{}'", o.out);
      ++n;
    }
    if (page.size() < 1000) break;
    start = "(" + page.elements.back().elements[0].str;
  }
  if (out != stdout && std::fclose(out) != 0) fail(ErrorKind::kFailed, "cannot write '{}'", o.out);
  std::fprintf(stderr, "strata collect: %zu results from '%s' to %s\n", n, o.result_stream.c_str(),
               o.out.c_str());
  return 0;
}

}  // namespace

void add_password_file_option(CLI::App& cmd, std::string& path) {
  cmd.add_option("--redis-password-file", path,
                 "Read the Redis password from this file's first line (else the URL's, "
                 "STRATA_REDIS_PASSWORD or REDISCLI_AUTH)");
}

Command add_submit(CLI::App& app) {
  auto o = std::make_shared<SubmitOptions>();
  CLI::App* cmd = app.add_subcommand(
      "submit", "Add requests to a Redis request stream (and wait for their results)");
  cmd->add_option("--redis", o->redis, "redis://[user:password@]host:port/db")->required();
  add_password_file_option(*cmd, o->redis_password_file);
  cmd->add_option("--prompt", o->prompts, "A prompt (repeat for several)");
  cmd->add_option("--file", o->file, "JSONL file of Strata requests or OpenAI batch lines");
  cmd->add_option("--request-stream", o->request_stream, "Stream of requests")
      ->capture_default_str();
  cmd->add_option("--result-stream", o->result_stream, "Stream of results (--wait)")
      ->capture_default_str();
  cmd->add_option("--max-new-tokens", o->max_new_tokens, "Tokens to generate (--prompt)")
      ->check(non_negative());
  cmd->add_option("--temperature", o->temperature, "Sampling temperature (--prompt)")
      ->check(non_negative());
  cmd->add_option("--top-p", o->top_p, "Nucleus sampling (--prompt)")->check(positive());
  cmd->add_option("--top-k", o->top_k, "Top-k sampling, 0: off (--prompt)")->check(non_negative());
  cmd->add_option("--seed", o->seed, "Sampling seed (--prompt)");
  cmd->add_option("--stop", o->stop, "A stop string (repeat for several; --prompt)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "Generate --max-new-tokens whatever comes");
  cmd->add_flag("--wait", o->wait, "Wait for every result, with progress on a terminal");
  cmd->add_option("--timeout", o->timeout, "Seconds --wait waits at most (0: no limit)")
      ->check(non_negative());
  return {cmd, [o] { return run_submit(*o); }};
}

Command add_collect(CLI::App& app) {
  auto o = std::make_shared<CollectOptions>();
  CLI::App* cmd =
      app.add_subcommand("collect", "Write the results of a Redis result stream as JSONL");
  cmd->add_option("--redis", o->redis, "redis://[user:password@]host:port/db")->required();
  add_password_file_option(*cmd, o->redis_password_file);
  cmd->add_option("--out", o->out, "JSONL file to write (- for stdout)")->required();
  cmd->add_option("--format", o->format,
                  "strata (Strata's result lines) or openai (Batch API output lines)")
      ->capture_default_str();
  cmd->add_option("--result-stream", o->result_stream, "Stream of results")->capture_default_str();
  cmd->add_option("--from", o->from, "First result entry id to write (default: all)");
  cmd->add_option("--model-name", o->model_name, "The model name OpenAI lines report")
      ->capture_default_str();
  return {cmd, [o] { return run_collect(*o); }};
}

}  // namespace strata::cli
