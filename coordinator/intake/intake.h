// Where requests come from and results go. The coordinator reads through these interfaces
// only: a JSONL file here, the Redis stream in redis_queue.h. The request and result
// format is request_format.h (docs/QUEUE.md).
#pragma once

#include <cstddef>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/intake/request.h"
#include "coordinator/intake/request_format.h"
#include "transport/deadline.h"
#include "worker/tokenizer.h"

namespace strata {

class RequestSource {
 public:
  virtual ~RequestSource() = default;
  // Up to `max` requests that have arrived; never waits. Throws when the source has failed
  // for good (a queue unreachable past its retry budget).
  virtual std::vector<IncomingRequest> poll(size_t max) = 0;
  // True once no request will come any more: a file read to its end, a queue drained.
  virtual bool exhausted() const = 0;
  // Hands out nothing more (the job was asked to stop); returns what the source had read
  // and not handed out yet, for the caller to answer as unfinished.
  virtual std::vector<IncomingRequest> stop() = 0;
  // How requests are tokenized and bounded (prepare_prompt), once the run's context is
  // known. A source that reads on a thread of its own prepares them there, so the
  // coordinator's loop never tokenizes; the coordinator prepares whatever comes unprepared.
  virtual void prepare_with(const PromptPrep& /*prep*/) {}
};

class ResultSink {
 public:
  virtual ~ResultSink() = default;
  // One finished request (or a refused one: stop_reason kError, error set).
  virtual void write(const GenerationResult& result) = 0;
  // A request this run takes and will not finish (stopped, or the cluster failed), with
  // the tokens it had and why (`partial.error`). `suspect`: it was running when the
  // cluster failed, so it may be what failed it. A file writes it as an error result; a
  // queue keeps the request for a later run instead.
  virtual void unfinished(const GenerationResult& partial, bool suspect) = 0;
  // Waits until every result handed over is stored, up to the deadline; false if not.
  virtual bool flush(const Deadline& deadline) = 0;
};

// One request per line, read as the coordinator takes them (the file, not memory, holds
// the backlog); blank lines are skipped. A line longer than the request limit becomes an
// error request; a file with no line end within 16 times that limit (not a JSONL file:
// /dev/zero, a binary) ends with an error request saying so. A missing file is InputError.
class JsonlRequestSource final : public RequestSource {
 public:
  explicit JsonlRequestSource(const std::string& path, const InputLimits& limits = {});
  std::vector<IncomingRequest> poll(size_t max) override;
  bool exhausted() const override { return done_; }
  // Reads the rest of the file: every line gets an answer, finished or not.
  std::vector<IncomingRequest> stop() override;
  size_t lines_read() const { return line_; }

 private:
  std::optional<IncomingRequest> next();  // nullopt at the end of the file

  std::ifstream in_;
  std::string path_;
  InputLimits limits_;
  double opened_ = 0;  // the arrival time of every request of the file
  size_t line_ = 0;
  bool done_ = false;
};

// One JSON object per line (request_format.h's result_object), flushed per result.
class JsonlResultSink final : public ResultSink {
 public:
  JsonlResultSink(const std::string& path, const Tokenizer& tokenizer);
  ~JsonlResultSink() override;
  JsonlResultSink(const JsonlResultSink&) = delete;
  JsonlResultSink& operator=(const JsonlResultSink&) = delete;
  void write(const GenerationResult& result) override;
  void unfinished(const GenerationResult& partial, bool suspect) override;
  bool flush(const Deadline&) override { return true; }  // every write is flushed
  size_t written() const { return written_; }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
  const Tokenizer& tokenizer_;
  size_t written_ = 0;
};

// The JSON line a result is written as (JsonlResultSink; tests).
std::string result_line(const GenerationResult& result, const Tokenizer& tokenizer);

// The system clock in seconds since 1970: request arrival and result times.
double wall_seconds();

}  // namespace strata
