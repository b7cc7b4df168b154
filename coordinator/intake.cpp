#include "coordinator/intake.h"

#include <chrono>
#include <fstream>

#include "kernels/error.h"

namespace strata {

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

JsonlRequestSource::JsonlRequestSource(const std::string& path, const RequestLimits& limits) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_input("cannot open request file '{}'", path);
  const double arrival = wall_seconds();
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    requests_.push_back(parse_request_line(line, fmt::format("{}:{}", path, n), limits));
    requests_.back().arrival = arrival;
  }
}

std::vector<IncomingRequest> JsonlRequestSource::poll(size_t max) {
  std::vector<IncomingRequest> out;
  while (next_ < requests_.size() && out.size() < max) out.push_back(std::move(requests_[next_++]));
  return out;
}

std::vector<IncomingRequest> JsonlRequestSource::stop() {
  std::vector<IncomingRequest> rest = poll(SIZE_MAX);
  return rest;
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
