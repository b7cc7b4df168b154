// Where requests come from and results go. The coordinator reads through these interfaces
// only, so the Redis stream of the queue issue plugs in beside the JSONL files here.
//
// A request line (JSON object): {"id": "a" | 7, "prompt": "text" | "prompt_ids": [1, 2],
// "max_new_tokens": 64, "temperature": 0, "top_k": 0, "top_p": 1, "seed": 0,
// "ignore_eos": false}. A line that is not such an object (bad JSON, a wrong type, an
// unknown field, both or neither of prompt / prompt_ids) becomes a request with `error`
// set; it gets an error result and never reaches the workers.
#pragma once

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "worker/generator.h"
#include "worker/tokenizer.h"

namespace strata {

struct IncomingRequest {
  GenerationRequest request;          // prompt_ids empty when the prompt is text
  std::optional<std::string> prompt;  // text to tokenize
  std::string error;                  // non-empty: malformed, answered with an error result
  std::string where;                  // "requests.jsonl:3", for messages
};

class RequestSource {
 public:
  virtual ~RequestSource() = default;
  // Up to `max` requests that have arrived; never waits.
  virtual std::vector<IncomingRequest> poll(size_t max) = 0;
  // True once no request will come any more (a file read to its end).
  virtual bool exhausted() const = 0;
};

class ResultSink {
 public:
  virtual ~ResultSink() = default;
  // One finished request (or a refused one: stop_reason kError, error set). Written at once.
  virtual void write(const GenerationResult& result) = 0;
};

// Parses one request line; `where` names it in error messages. Never throws.
IncomingRequest parse_request_line(const std::string& line, const std::string& where);

// Fills prompt_ids from the prompt text; a prompt the tokenizer refuses sets `error`.
void tokenize(IncomingRequest& r, const Tokenizer& tokenizer);

// One request per line; blank lines are skipped. The whole file is read when opened (a
// missing file is InputError); poll hands the requests out in file order.
class JsonlRequestSource final : public RequestSource {
 public:
  explicit JsonlRequestSource(const std::string& path);
  std::vector<IncomingRequest> poll(size_t max) override;
  bool exhausted() const override { return next_ >= requests_.size(); }
  size_t size() const { return requests_.size(); }

 private:
  std::vector<IncomingRequest> requests_;
  size_t next_ = 0;
};

// One JSON object per line, flushed per result: {"id", "prompt_ids", "output_ids", "text",
// "completion", "stop_reason"[, "error"]} (text and completion decoded by `tokenizer`).
class JsonlResultSink final : public ResultSink {
 public:
  JsonlResultSink(const std::string& path, const Tokenizer& tokenizer);
  ~JsonlResultSink() override;
  JsonlResultSink(const JsonlResultSink&) = delete;
  JsonlResultSink& operator=(const JsonlResultSink&) = delete;
  void write(const GenerationResult& result) override;
  size_t written() const { return written_; }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
  const Tokenizer& tokenizer_;
  size_t written_ = 0;
};

// The JSON line a result is written as (JsonlResultSink; tests).
std::string result_line(const GenerationResult& result, const Tokenizer& tokenizer);

}  // namespace strata
