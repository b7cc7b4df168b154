#include "coordinator/intake/intake.h"

#include <chrono>
#include <fstream>

#include "kernels/error.h"

namespace strata {

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

JsonlRequestSource::JsonlRequestSource(const std::string& path, const InputLimits& limits)
    : in_(path, std::ios::binary), path_(path), limits_(limits), opened_(wall_seconds()) {
  if (!in_) fail_input("cannot open request file '{}'", path);
}

std::optional<IncomingRequest> JsonlRequestSource::next() {
  const auto limit = static_cast<size_t>(limits_.request_bytes);
  std::string line;
  while (!done_) {
    line.clear();
    ++line_;
    size_t length = 0;  // the whole line's, kept only up to the limit
    int c = 0;
    while ((c = in_.get()) != EOF && c != '\n') {
      if (++length <= limit) line.push_back(static_cast<char>(c));
      if (length > 16 * limit) {
        done_ = true;
        IncomingRequest r = parse_request_line("", fmt::format("{}:{}", path_, line_), limits_);
        r.error = fmt::format(
            "{}:{}: no line end within {} bytes: not a JSONL file of requests; reading stopped",
            path_, line_, 16 * limit);
        return r;
      }
    }
    if (c == EOF) done_ = true;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (length == 0 || line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path_, line_);
    IncomingRequest r =
        length > limit ? IncomingRequest{} : parse_request_line(line, where, limits_);
    if (length > limit) {  // refused unread, as parse_request_line would refuse it
      r.where = r.request.id = where;
      try {
        limits_.check(&InputLimits::request_bytes, static_cast<int64_t>(length),
                      where + ": request", "bytes");
      } catch (const std::exception& e) {
        r.error = e.what();
      }
    }
    r.arrival = opened_;
    return r;
  }
  return std::nullopt;
}

std::vector<IncomingRequest> JsonlRequestSource::poll(size_t max) {
  std::vector<IncomingRequest> out;
  while (out.size() < max) {
    std::optional<IncomingRequest> r = next();
    if (!r) break;
    out.push_back(std::move(*r));
  }
  return out;
}

std::vector<IncomingRequest> JsonlRequestSource::stop() {
  return poll(SIZE_MAX);
}

std::string result_line(const GenerationResult& r, const Tokenizer& tok) {
  return result_object(r, tok).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

JsonlResultSink::JsonlResultSink(const std::string& path, const Tokenizer& tokenizer)
    : path_(path), tokenizer_(tokenizer) {
  file_ = std::fopen(path.c_str(), "wb");
  if (file_ == nullptr) fail_input("cannot open result file '{}' for writing", path);
}

JsonlResultSink::~JsonlResultSink() {
  if (file_ != nullptr) std::fclose(file_);
}

void JsonlResultSink::write(const GenerationResult& r) {
  const std::string line = result_line(r, tokenizer_) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    fail(ErrorKind::kFailed, "cannot write to result file '{}'", path_);
  ++written_;
}

void JsonlResultSink::unfinished(const GenerationResult& partial, bool) {
  GenerationResult r = partial;
  r.stop_reason = StopReason::kError;
  write(r);
}

}  // namespace strata
