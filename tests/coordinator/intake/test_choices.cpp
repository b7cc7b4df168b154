// n completions per request (choices.h): n copies with seeds seed + i go to the scheduler,
// one merged result in choice order comes out, whatever order the copies finish in.
#include <gtest/gtest.h>

#include <deque>

#include "coordinator/intake/choices.h"

namespace strata {
namespace {

class ListSource final : public RequestSource {
 public:
  std::deque<IncomingRequest> items;
  std::vector<IncomingRequest> poll(size_t max) override {
    std::vector<IncomingRequest> out;
    while (!items.empty() && out.size() < max) {
      out.push_back(items.front());
      items.pop_front();
    }
    return out;
  }
  bool exhausted() const override { return items.empty(); }
  std::vector<IncomingRequest> stop() override { return poll(items.size()); }
};

class ListSink final : public ResultSink {
 public:
  std::vector<GenerationResult> written, unfinished_results;
  std::vector<bool> suspects;
  void write(const GenerationResult& r) override { written.push_back(r); }
  void unfinished(const GenerationResult& r, bool suspect) override {
    unfinished_results.push_back(r);
    suspects.push_back(suspect);
  }
  bool flush(const Deadline&) override { return true; }
};

IncomingRequest request(const std::string& id, int32_t n, uint64_t seed) {
  IncomingRequest r;
  r.request.id = id;
  r.request.n = n;
  r.request.sampling.seed = seed;
  r.request.prompt_ids = {1, 2};
  return r;
}

GenerationResult result_of(const IncomingRequest& r, std::vector<int32_t> out) {
  GenerationResult g{r.request.id, r.request.prompt_ids, std::move(out), StopReason::kLength, {}};
  g.choice = r.request.choice;
  g.n = r.request.n;
  return g;
}

TEST(Choices, NCopiesWithConsecutiveSeedsAndTheBatchLimitHeld) {
  ListSource in;
  in.items = {request("a", 3, 10), request("b", 1, 4)};
  ChoiceSource src(in);
  std::vector<IncomingRequest> first = src.poll(2);
  ASSERT_EQ(first.size(), 2u);  // the limit holds though "a" alone makes three
  EXPECT_FALSE(src.exhausted());
  std::vector<IncomingRequest> rest = src.poll(10);
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_TRUE(src.exhausted());
  first.insert(first.end(), rest.begin(), rest.end());
  const std::vector<std::pair<std::string, int32_t>> order{{"a", 0}, {"a", 1}, {"a", 2}, {"b", 0}};
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(first[i].request.id, order[i].first);
    EXPECT_EQ(first[i].request.choice, order[i].second);
  }
  EXPECT_EQ(first[0].request.sampling.seed, 10u);
  EXPECT_EQ(first[1].request.sampling.seed, 11u);
  EXPECT_EQ(first[2].request.sampling.seed, 12u);
  EXPECT_EQ(first[3].request.sampling.seed, 4u);
}

TEST(Choices, OneResultInChoiceOrderWhateverOrderTheyFinishIn) {
  ListSink out;
  ChoiceSink sink(out);
  IncomingRequest a = request("a", 3, 0);
  std::vector<GenerationResult> parts;
  for (int32_t c = 0; c < 3; ++c) {
    a.request.choice = c;
    parts.push_back(result_of(a, {100 + c}));
  }
  sink.write(parts[2]);
  sink.write(parts[0]);
  EXPECT_TRUE(out.written.empty());
  EXPECT_EQ(sink.incomplete(), 1u);
  sink.write(parts[1]);
  ASSERT_EQ(out.written.size(), 1u);
  EXPECT_EQ(sink.incomplete(), 0u);
  const GenerationResult& m = out.written[0];
  EXPECT_EQ(m.output_ids, (std::vector<int32_t>{100}));  // choice 0 at the top level
  ASSERT_EQ(m.choices.size(), 3u);
  for (int32_t c = 0; c < 3; ++c) {
    EXPECT_EQ(m.choices[static_cast<size_t>(c)].choice, c);
    EXPECT_EQ(m.choices[static_cast<size_t>(c)].output_ids, (std::vector<int32_t>{100 + c}));
  }
  // n = 1 goes straight through.
  sink.write(result_of(request("b", 1, 0), {5}));
  ASSERT_EQ(out.written.size(), 2u);
  EXPECT_TRUE(out.written[1].choices.empty());
}

TEST(Choices, AnyUnfinishedChoiceLeavesTheRequestUnfinished) {
  ListSink out;
  ChoiceSink sink(out);
  IncomingRequest a = request("a", 2, 0);
  GenerationResult done = result_of(a, {1});
  a.request.choice = 1;
  GenerationResult cut = result_of(a, {2});
  cut.stop_reason = StopReason::kError;
  cut.error = "stopped";
  sink.write(done);
  sink.unfinished(cut, true);
  EXPECT_TRUE(out.written.empty());
  ASSERT_EQ(out.unfinished_results.size(), 1u);
  EXPECT_TRUE(out.suspects[0]);
  EXPECT_EQ(out.unfinished_results[0].error, "stopped");
}

TEST(Choices, AnErrorChoiceMakesAnErrorResult) {
  IncomingRequest a = request("a", 2, 0);
  GenerationResult ok = result_of(a, {1});
  a.request.choice = 1;
  GenerationResult bad = result_of(a, {});
  bad.stop_reason = StopReason::kError;
  bad.error = "refused";
  const GenerationResult m = merge_choices({ok, bad});
  EXPECT_EQ(m.stop_reason, StopReason::kError);
  EXPECT_EQ(m.error, "refused");
  EXPECT_TRUE(m.choices.empty());
}

TEST(Choices, TheSameIdTwiceGetsTwoResults) {
  ListSink out;
  ChoiceSink sink(out);
  IncomingRequest a = request("a", 2, 0);
  GenerationResult c0 = result_of(a, {1});
  a.request.choice = 1;
  GenerationResult c1 = result_of(a, {2});
  sink.write(c0);
  sink.write(c0);  // the second request's choice 0
  sink.write(c1);
  sink.write(c1);
  EXPECT_EQ(out.written.size(), 2u);
  EXPECT_EQ(sink.incomplete(), 0u);
}

}  // namespace
}  // namespace strata
