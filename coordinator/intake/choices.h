// A request for n completions (OpenAI's `n`) runs as n sequences and is answered once: the
// source side hands the scheduler n copies, choice i sampling with seed + i, and the sink side
// gathers their n results into one (GenerationResult::choices) before the real sink sees it.
// Nothing else in the coordinator knows about n.
#pragma once

#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordinator/intake/intake.h"

namespace strata {

class ChoiceSource final : public RequestSource {
 public:
  explicit ChoiceSource(RequestSource& inner) : inner_(inner) {}
  std::vector<IncomingRequest> poll(size_t max) override;
  bool exhausted() const override { return pending_.empty() && inner_.exhausted(); }
  std::vector<IncomingRequest> stop() override;

 private:
  void expand(IncomingRequest r);

  RequestSource& inner_;
  std::deque<IncomingRequest> pending_;  // copies the scheduler has not taken yet
};

class ChoiceSink final : public ResultSink {
 public:
  explicit ChoiceSink(ResultSink& inner) : inner_(inner) {}
  void write(const GenerationResult& result) override;
  void unfinished(const GenerationResult& partial, bool suspect) override;
  bool flush(const Deadline& deadline) override { return inner_.flush(deadline); }
  // Requests with some of their n results still to come.
  size_t incomplete() const { return groups_.size(); }

 private:
  struct Group {
    std::vector<GenerationResult> results;
    std::vector<bool> filled, unfinished;
    int32_t missing = 0;
    bool suspect = false;
  };
  void add(const GenerationResult& result, bool unfinished, bool suspect);
  void finish(Group& g);

  ResultSink& inner_;
  // By request id; the same id queued twice while both run gets a group each.
  std::unordered_map<std::string, std::deque<Group>> groups_;
};

// One request's n results (in choice order) as its one result: choice 0's fields with all n
// under `choices`; an error result when any of them is an error (the first one's).
GenerationResult merge_choices(std::vector<GenerationResult> results);

}  // namespace strata
