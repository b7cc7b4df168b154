#include "coordinator/intake/choices.h"

#include <algorithm>

#include "coordinator/intake/request_rules.h"

namespace strata {

void ChoiceSource::expand(IncomingRequest r) {
  // An error result is one result, whatever n said (request_format.cpp refuses a bad n).
  const int32_t n = r.error.empty() ? std::clamp(r.request.n, 1, kMaxChoices) : 1;
  r.request.n = n;
  const uint64_t seed = r.request.sampling.seed;
  for (int32_t i = 0; i < n; ++i) {
    IncomingRequest copy = i + 1 < n ? r : std::move(r);
    copy.request.choice = i;
    copy.request.sampling.seed = seed + static_cast<uint64_t>(i);  // wraps, as seeds may
    pending_.push_back(std::move(copy));
  }
}

std::vector<IncomingRequest> ChoiceSource::poll(size_t max) {
  if (pending_.size() < max)
    for (IncomingRequest& r : inner_.poll(max - pending_.size())) expand(std::move(r));
  std::vector<IncomingRequest> out;
  while (!pending_.empty() && out.size() < max) {
    out.push_back(std::move(pending_.front()));
    pending_.pop_front();
  }
  return out;
}

std::vector<IncomingRequest> ChoiceSource::stop() {
  for (IncomingRequest& r : inner_.stop()) expand(std::move(r));
  std::vector<IncomingRequest> out(std::make_move_iterator(pending_.begin()),
                                   std::make_move_iterator(pending_.end()));
  pending_.clear();
  return out;
}

GenerationResult merge_choices(std::vector<GenerationResult> results) {
  STRATA_CHECK(!results.empty(), "no choices to merge");
  const auto error = std::find_if(results.begin(), results.end(), [](const GenerationResult& r) {
    return r.stop_reason == StopReason::kError;
  });
  GenerationResult merged = error != results.end() ? *error : results.front();
  merged.choice = 0;
  if (results.size() > 1 && error == results.end()) merged.choices = std::move(results);
  return merged;
}

void ChoiceSink::write(const GenerationResult& result) {
  add(result, false, false);
}

void ChoiceSink::unfinished(const GenerationResult& partial, bool suspect) {
  add(partial, true, suspect);
}

void ChoiceSink::add(const GenerationResult& r, bool unfinished, bool suspect) {
  if (r.n <= 1) {
    if (unfinished) return inner_.unfinished(r, suspect);
    return inner_.write(r);
  }
  STRATA_CHECK(r.choice >= 0 && r.choice < r.n, "request {}: choice {} of {}", r.id, r.choice, r.n);
  std::deque<Group>& groups = groups_[r.id];
  const auto c = static_cast<size_t>(r.choice);
  auto it =
      std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return !g.filled[c]; });
  if (it == groups.end()) {
    const auto n = static_cast<size_t>(r.n);
    it = groups.insert(groups.end(), Group{std::vector<GenerationResult>(n), std::vector<bool>(n),
                                           std::vector<bool>(n), r.n, false});
  }
  it->results[c] = r;
  it->filled[c] = true;
  it->unfinished[c] = unfinished;
  it->suspect = it->suspect || suspect;
  if (--it->missing > 0) return;
  Group done = std::move(*it);
  groups.erase(it);
  if (groups.empty()) groups_.erase(r.id);
  finish(done);
}

// A request is unfinished (a queue keeps it for a later run) when any of its choices is.
void ChoiceSink::finish(Group& g) {
  const auto first_unfinished = std::find(g.unfinished.begin(), g.unfinished.end(), true);
  if (first_unfinished != g.unfinished.end()) {
    GenerationResult partial =
        g.results[static_cast<size_t>(first_unfinished - g.unfinished.begin())];
    partial.choice = 0;
    return inner_.unfinished(partial, g.suspect);
  }
  inner_.write(merge_choices(std::move(g.results)));
}

}  // namespace strata
