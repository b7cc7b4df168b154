// The queue's delivery guarantees against a real redis-server (docs/QUEUE.md): entries
// queued before the consumer starts are served; a result, its done mark and the ack are
// one step; an id that has its result is not run again; own pending entries come back
// first, one at a time when they may be poison; idle entries of a dead consumer are taken
// over while live ones keep their lease; entries delivered too often are dead-lettered;
// backpressure; drained means nothing new and nothing pending; a Redis restart loses
// nothing; an unreachable server fails the run after the retry budget, saying so.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "coordinator/intake/redis_queue.h"
#include "kernels/clock.h"
#include "support/redis_server.h"
#include "worker/dummy.h"

namespace strata {
namespace {

using testing::RedisServer;
using namespace std::chrono_literals;

class RedisQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    server_ = std::make_unique<RedisServer>(
        std::string(STRATA_TEST_TMP) + "/queue_" + name,
        std::vector<std::string>{"--appendonly", "yes", "--appendfsync", "always",
                                 "--enable-debug-command", "local"});
    redis_ = std::make_unique<RedisConnection>(server_->connect());
    tokenizer_ = Tokenizer::ids_only(dummy_model_config("opt-125m"));
  }

  RedisQueueOptions options(const std::string& consumer = "c1") const {
    RedisQueueOptions o;
    o.endpoint = server_->endpoint();
    o.consumer = consumer;
    o.claim_idle_s = 30;
    o.prefetch = 8;
    o.retry_timeout_s = 20;
    o.command_timeout_s = 2;
    o.block_s = 0.05;
    return o;
  }

  RedisReply redis(const RedisArgs& args) {
    return redis_->command(args, Deadline::after_seconds(5));
  }

  std::string add(const FieldList& fields) {
    RedisArgs a{"XADD", "strata:requests", "*"};
    for (const auto& [k, v] : fields) {
      a.push_back(k);
      a.push_back(v);
    }
    return redis(a).str;
  }

  // Polls until `n` requests came or `seconds` passed.
  static std::vector<IncomingRequest> take(RedisQueue& q, size_t n, double seconds = 5) {
    std::vector<IncomingRequest> got;
    const Deadline d = Deadline::after_seconds(seconds);
    while (got.size() < n && !d.expired()) {
      for (IncomingRequest& r : q.poll(n - got.size())) got.push_back(std::move(r));
      std::this_thread::sleep_for(5ms);
    }
    return got;
  }

  GenerationResult finished(const IncomingRequest& r, std::vector<int32_t> output = {7}) const {
    return GenerationResult{r.request.id, {1}, std::move(output), StopReason::kLength, {}};
  }

  int64_t pending() { return redis({"XPENDING", "strata:requests", "strata"}).elements[0].integer; }
  int64_t results() { return redis({"XLEN", "strata:results"}).integer; }
  // (consumer, deliveries) of one pending entry.
  std::pair<std::string, int64_t> pending_entry(const std::string& id) {
    const RedisReply r = redis({"XPENDING", "strata:requests", "strata", id, id, "1"});
    if (r.size() == 0) return {"", 0};
    return {r.elements[0].elements[1].str, r.elements[0].elements[3].integer};
  }

  std::unique_ptr<RedisServer> server_;
  std::unique_ptr<RedisConnection> redis_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(RedisQueueTest, ServesEntriesQueuedBeforeItStartedAndStoresResultDoneMarkAndAckTogether) {
  const std::string e1 = add({{"id", "a"}, {"prompt", "1 2"}});
  const std::string e2 = add({{"prompt", "3"}, {"max_new_tokens", "4"}});
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].request.id, "a");
  EXPECT_EQ(got[1].request.id, e2);  // no id: the entry id names it
  EXPECT_EQ(got[1].request.max_new_tokens, 4);
  EXPECT_EQ(got[0].deliveries, 1);
  EXPECT_NEAR(got[0].arrival, wall_seconds(), 10.0);  // the entry's time
  EXPECT_EQ(pending(), 2);                            // delivered, not acknowledged
  q.write(finished(got[0], {5, 6}));
  ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
  EXPECT_EQ(pending(), 1);
  const RedisReply res = redis({"XRANGE", "strata:results", "-", "+"});
  ASSERT_EQ(res.size(), 1u);
  FieldList fields;
  const RedisReply& f = res.elements[0].elements[1];
  for (size_t i = 0; i + 1 < f.size(); i += 2)
    fields.emplace_back(f.elements[i].str, f.elements[i + 1].str);
  const auto r = result_from_fields(fields);
  EXPECT_EQ(r["id"], "a");
  EXPECT_EQ(r["status"], "ok");
  EXPECT_EQ(r["output_ids"], nlohmann::json::parse("[5, 6]"));
  EXPECT_EQ(r["entry"], e1);
  EXPECT_EQ(redis({"HGET", "strata:results:done", "a"}).str, res.elements[0].elements[0].str);
  EXPECT_EQ(q.stats().results, 1);
}

TEST_F(RedisQueueTest, AnIdThatHasItsResultIsAcknowledgedWithoutRunningAgain) {
  {
    add({{"id", "a"}, {"prompt", "1"}});
    RedisQueue q(options(), *tokenizer_);
    std::vector<IncomingRequest> got = take(q, 1);
    ASSERT_EQ(got.size(), 1u);
    q.write(finished(got[0]));
    ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
  }
  add({{"prompt", "1"}, {"id", "a"}});  // a producer resubmits the same request
  RedisQueue q(options(), *tokenizer_);
  EXPECT_TRUE(take(q, 1, 0.5).empty());
  EXPECT_EQ(pending(), 0);
  EXPECT_EQ(results(), 1);
  EXPECT_EQ(q.stats().duplicates, 1);
  EXPECT_EQ(q.stats().conflicts, 0);
  EXPECT_EQ(q.stats().results, 0);
}

// The fields of the results stream's entries, in order.
std::vector<FieldList> stored_results(RedisConnection& redis) {
  std::vector<FieldList> out;
  for (const RedisReply& e :
       redis.command({"XRANGE", "strata:results", "-", "+"}, Deadline::after_seconds(5)).elements) {
    FieldList fields;
    const RedisReply& f = e.elements[1];
    for (size_t i = 0; i + 1 < f.size(); i += 2)
      fields.emplace_back(f.elements[i].str, f.elements[i + 1].str);
    out.push_back(std::move(fields));
  }
  return out;
}

std::string field(const FieldList& fields, const std::string& name) {
  for (const auto& [k, v] : fields)
    if (k == name) return v;
  return "<none>";
}

// A reused id with other content is not the same request: the later entry gets an error
// result named by its own entry id (one result per id still), naming the id and the first
// entry; the first result stays the id's.
TEST_F(RedisQueueTest, AnIdReusedWithOtherContentGetsAnErrorResultNamingTheFirstEntry) {
  const std::string first = add({{"id", "a"}, {"prompt", "1"}});
  {
    RedisQueue q(options(), *tokenizer_);
    std::vector<IncomingRequest> got = take(q, 1);
    ASSERT_EQ(got.size(), 1u);
    q.write(finished(got[0]));
    ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
  }
  const std::string done = redis({"HGET", "strata:results:done", "a"}).str;
  const std::string later = add({{"id", "a"}, {"prompt", "2"}});
  RedisQueue q(options(), *tokenizer_);
  EXPECT_TRUE(take(q, 1, 0.5).empty()) << "not run";
  EXPECT_EQ(pending(), 0);
  const std::vector<FieldList> res = stored_results(*redis_);
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(field(res[1], "id"), later);
  EXPECT_EQ(field(res[1], "status"), "error");
  EXPECT_EQ(field(res[1], "error_type"), "invalid_request");
  EXPECT_EQ(field(res[1], "entry"), later);
  EXPECT_EQ(field(res[1], "reused_id"), "a");
  EXPECT_EQ(field(res[1], "first_entry"), first);
  EXPECT_NE(field(res[1], "error").find("field 'id': 'a' was used first by entry " + first),
            std::string::npos)
      << field(res[1], "error");
  EXPECT_EQ(redis({"HGET", "strata:results:done", "a"}).str, done) << "the first keeps the id";
  EXPECT_EQ(redis({"HGET", "strata:results:content", "a"}).str.substr(0, first.size() + 1),
            first + " ");
  EXPECT_EQ(q.stats().conflicts, 1);
  EXPECT_EQ(q.stats().duplicates, 0);
  EXPECT_EQ(q.stats().results, 1);
}

TEST_F(RedisQueueTest, AnIdReusedWithOtherContentWhileItRunsGetsAnErrorResultAtOnce) {
  const std::string first = add({{"id", "a"}, {"prompt", "1"}});
  const std::string later = add({{"id", "a"}, {"prompt", "1"}, {"max_new_tokens", "9"}});
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 2, 0.5);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].request.max_new_tokens, 64) << "the first entry runs";
  const Deadline d = Deadline::after_seconds(5);
  while (results() < 1 && !d.expired()) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(pending(), 1) << "the conflicting entry is acknowledged with its error";
  q.write(finished(got[0]));
  ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
  const std::vector<FieldList> res = stored_results(*redis_);
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(field(res[0], "id"), later);
  EXPECT_EQ(field(res[0], "first_entry"), first);
  EXPECT_EQ(field(res[1], "id"), "a");
  EXPECT_EQ(field(res[1], "status"), "ok");
  EXPECT_EQ(pending(), 0);
  EXPECT_EQ(q.stats().conflicts, 1);
  EXPECT_EQ(q.stats().results, 2);
}

// Two consumers running one id at once: the second to finish finds it answered. Same
// content: a duplicate, no second result (and not counted as one); other content: an error
// result for its entry. `results` counts what each added to the stream.
TEST_F(RedisQueueTest, ResultsCountWhatTheStreamGainedWhenTwoConsumersRunOneId) {
  for (const bool other_content : {false, true}) {
    SCOPED_TRACE(other_content);
    redis({"DEL", "strata:results", "strata:results:done", "strata:results:content"});
    add({{"id", "a"}, {"prompt", "1"}});
    RedisQueue q1(options("c1"), *tokenizer_);
    std::vector<IncomingRequest> got1 = take(q1, 1);
    ASSERT_EQ(got1.size(), 1u);
    EXPECT_TRUE(q1.stop().empty());  // reads nothing more: the next entry is q2's
    const std::string second = add({{"id", "a"}, {"prompt", other_content ? "2" : "1"}});
    RedisQueue q2(options("c2"), *tokenizer_);
    std::vector<IncomingRequest> got2 = take(q2, 1);
    ASSERT_EQ(got2.size(), 1u);
    q1.write(finished(got1[0]));
    ASSERT_TRUE(q1.flush(Deadline::after_seconds(5)));
    q2.write(finished(got2[0]));
    ASSERT_TRUE(q2.flush(Deadline::after_seconds(5)));
    EXPECT_EQ(pending(), 0);
    const std::vector<FieldList> res = stored_results(*redis_);
    ASSERT_EQ(res.size(), other_content ? 2u : 1u);
    EXPECT_EQ(q1.stats().results + q2.stats().results, static_cast<int64_t>(res.size()));
    EXPECT_EQ(q2.stats().duplicates, other_content ? 0 : 1);
    EXPECT_EQ(q2.stats().conflicts, other_content ? 1 : 0);
    if (other_content) {
      EXPECT_EQ(field(res[1], "id"), second);
      EXPECT_EQ(field(res[1], "reused_id"), "a");
    }
  }
}

// An id answered before content was recorded (its done mark alone) stays a duplicate.
TEST_F(RedisQueueTest, AnIdDoneWithoutAContentRecordIsADuplicate) {
  redis({"HSET", "strata:results:done", "a", "1-1"});
  add({{"id", "a"}, {"prompt", "2"}});
  RedisQueue q(options(), *tokenizer_);
  EXPECT_TRUE(take(q, 1, 0.5).empty());
  EXPECT_EQ(pending(), 0);
  EXPECT_EQ(results(), 0);
  EXPECT_EQ(q.stats().duplicates, 1);
  EXPECT_EQ(q.stats().conflicts, 0);
}

TEST_F(RedisQueueTest, TheSameIdTwiceInFlightIsAnsweredOnceAndBothAcknowledged) {
  add({{"id", "a"}, {"prompt", "1"}});
  add({{"id", "a"}, {"prompt", "1"}});
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 2, 0.5);
  ASSERT_EQ(got.size(), 1u);
  q.write(finished(got[0]));
  ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
  EXPECT_EQ(pending(), 0);
  EXPECT_EQ(results(), 1);
}

// A run that died leaves its entries pending under its name. The restarted consumer takes
// them back first (before new ones), one at a time, each only when nothing else is held,
// and says it is a redelivery, so the coordinator runs it alone.
TEST_F(RedisQueueTest, ARestartedConsumerTakesItsPendingEntriesBackOneAtATime) {
  const std::string e1 = add({{"id", "a"}, {"prompt", "1"}});
  const std::string e2 = add({{"id", "b"}, {"prompt", "2"}});
  {
    RedisQueue crashed(options(), *tokenizer_);
    ASSERT_EQ(take(crashed, 2).size(), 2u);
  }  // destroyed without results: as if the job was killed
  add({{"id", "new"}, {"prompt", "3"}});
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> first = take(q, 3, 1.0);
  ASSERT_EQ(first.size(), 1u) << "suspects come alone";
  EXPECT_EQ(first[0].request.id, "a");
  EXPECT_EQ(first[0].deliveries, 2);
  EXPECT_EQ(pending_entry(e2).second, 1) << "b's count must not grow while a runs";
  q.write(finished(first[0]));
  std::vector<IncomingRequest> second = take(q, 3, 2.0);
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].request.id, "b");
  EXPECT_EQ(second[0].deliveries, 2);
  q.write(finished(second[0]));
  std::vector<IncomingRequest> third = take(q, 3, 2.0);
  ASSERT_EQ(third.size(), 1u);
  EXPECT_EQ(third[0].request.id, "new");
  EXPECT_EQ(third[0].deliveries, 1);
}

// The run fails on a suspect while the reader's XPENDING is held up in the server (DEBUG
// SLEEP stands for a loaded machine): the reply shows the suspect pending and no longer
// held, and the reader must not claim it again, which would count a delivery no run made
// (the poison would reach the dead letters a run early). Nothing read after the failure
// keeps a count it did not earn.
TEST_F(RedisQueueTest, ASuspectThatFailsTheRunIsNotClaimedAgainByTheSameRun) {
  const std::string e1 = add({{"id", "a"}, {"prompt", "1"}});
  const std::string e2 = add({{"id", "b"}, {"prompt", "2"}});
  {
    RedisQueue crashed(options(), *tokenizer_);
    ASSERT_EQ(take(crashed, 2).size(), 2u);
  }
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 2, 1.0);
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(got[0].deliveries, 2);
  std::thread sleeper([this] {
    RedisConnection slow = server_->connect();
    slow.command({"DEBUG", "SLEEP", "0.5"}, Deadline::after_seconds(5));
  });
  std::this_thread::sleep_for(150ms);  // the reader's next XPENDING now waits on the server
  q.unfinished(finished(got[0]), /*suspect=*/true);
  sleeper.join();
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(pending_entry(e1).second, 2) << "a ran (and failed) in one run: one delivery";
  EXPECT_EQ(pending_entry(e2).second, 1) << "b never ran";
  EXPECT_TRUE(q.poll(2).empty());
}

// Stopped before finishing (not failed): the entry goes back with its count restored and
// its lease expired, so the next run takes it as fresh.
TEST_F(RedisQueueTest, AnUnfinishedRequestIsHandedBackAsFresh) {
  const std::string e = add({{"id", "a"}, {"prompt", "1"}});
  {
    RedisQueue q(options(), *tokenizer_);
    std::vector<IncomingRequest> got = take(q, 1);
    ASSERT_EQ(got.size(), 1u);
    q.unfinished(finished(got[0]), /*suspect=*/false);
    ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
    EXPECT_EQ(q.stats().handed_back, 1);
  }
  const RedisReply p =
      redis({"XPENDING", "strata:requests", "strata", "IDLE", "29000", "-", "+", "10"});
  ASSERT_EQ(p.size(), 1u) << "its idle time is past --claim-idle: any consumer may take it";
  EXPECT_EQ(p.elements[0].elements[3].integer, 0);
  RedisQueue again(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(again, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].deliveries, 1);
  // A suspect (running when the cluster failed) stays as it was.
  again.unfinished(finished(got[0]), /*suspect=*/true);
  EXPECT_TRUE(again.flush(Deadline::after_seconds(1)));
  EXPECT_EQ(pending_entry(e).second, 1);
}

// Every consumer of a group runs with the same --claim-idle (0.6 s here). A consumer that
// read an entry and died leaves it idle: a live one takes it over (and runs it alone,
// after what it holds). A live consumer renews its lease on what it holds, so nobody
// takes that.
TEST_F(RedisQueueTest, IdleEntriesOfADeadConsumerAreTakenOverAndLiveOnesKeepTheirLease) {
  redis({"XGROUP", "CREATE", "strata:requests", "strata", "0", "MKSTREAM"});
  const std::string orphan = add({{"id", "orphan"}, {"prompt", "2"}});
  redis({"XREADGROUP", "GROUP", "strata", "dead", "COUNT", "1", "STREAMS", "strata:requests", ">"});
  const std::string held = add({{"id", "held"}, {"prompt", "1"}});
  RedisQueueOptions fast = options("live");
  fast.claim_idle_s = 0.6;
  RedisQueue live(fast, *tokenizer_);
  std::vector<IncomingRequest> first = take(live, 1);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].request.id, "held");
  fast.consumer = "taker";
  RedisQueue taker(fast, *tokenizer_);
  std::this_thread::sleep_for(2000ms);  // held and orphan are both older than 0.6 s now
  EXPECT_EQ(pending_entry(held).first, "live") << "a live consumer's lease holds";
  EXPECT_NE(pending_entry(orphan).first, "dead") << "a dead consumer's entry is taken over";
  live.write(finished(first[0]));
  std::vector<IncomingRequest> got;
  const Deadline d = Deadline::after_seconds(5);
  while (got.empty() && !d.expired()) {
    for (RedisQueue* q : {&live, &taker})
      for (IncomingRequest& r : q->poll(1)) got.push_back(std::move(r));
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].request.id, "orphan");
  EXPECT_EQ(got[0].deliveries, 2);
}

// A consumer whose liveness mark ran out (or that ended: 0) is known dead: its entries are
// taken over at once, long before claim_idle, keeping their delivery count, and the dead
// consumer is removed from the group and the hash once it holds nothing. A consumer whose
// mark is still running keeps what it holds.
TEST_F(RedisQueueTest, TheEntriesOfAConsumerWhoseMarkRanOutAreTakenOverAtOnce) {
  redis({"XGROUP", "CREATE", "strata:requests", "strata", "0", "MKSTREAM"});
  const std::string orphan = add({{"id", "orphan"}, {"prompt", "2"}});
  redis({"XREADGROUP", "GROUP", "strata", "dead", "COUNT", "1", "STREAMS", "strata:requests", ">"});
  const std::string kept = add({{"id", "kept"}, {"prompt", "3"}});
  redis(
      {"XREADGROUP", "GROUP", "strata", "alive", "COUNT", "1", "STREAMS", "strata:requests", ">"});
  redis({"HSET", "strata:requests:consumers:strata", "dead", "1", "alive", "99999999999999"});
  RedisQueueOptions o = options("taker");
  o.claim_idle_s = 60;
  RedisQueue q(o, *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 1, 3.0);
  ASSERT_EQ(got.size(), 1u) << "the dead consumer's entry was not taken over within 3 s";
  EXPECT_EQ(got[0].request.id, "orphan");
  EXPECT_EQ(got[0].deliveries, 2) << "its one delivery kept: it may have failed a run";
  EXPECT_EQ(pending_entry(kept).first, "alive") << "a consumer with a running mark keeps it";
  bool listed = true;
  const Deadline d = Deadline::after_seconds(3);
  while (listed && !d.expired()) {
    listed = redis({"HEXISTS", "strata:requests:consumers:strata", "dead"}).integer != 0;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_FALSE(listed) << "the dead consumer's mark was not removed";
  for (const RedisReply& c : redis({"XINFO", "CONSUMERS", "strata:requests", "strata"}).elements)
    EXPECT_NE(c.elements[1].str, "dead") << "the dead consumer is still in the group";
  const std::string mark = redis({"HGET", "strata:requests:consumers:strata", "taker"}).str;
  EXPECT_GT(std::stoll(mark), 1'000'000'000'000LL) << "the live consumer's own mark: " << mark;
}

// The lease: what a live consumer holds is touched every claim_idle / 3, so its idle time
// (XPENDING) never reaches claim_idle and no other consumer may take it over.
TEST_F(RedisQueueTest, ALiveConsumerRenewsTheLeaseOfWhatItHolds) {
  const std::string held = add({{"id", "held"}, {"prompt", "1"}});
  RedisQueueOptions o = options("live");
  o.claim_idle_s = 0.9;
  RedisQueue live(o, *tokenizer_);
  ASSERT_EQ(take(live, 1).size(), 1u);
  int64_t most_idle_ms = 0;
  for (int i = 0; i < 50; ++i) {  // 2.5 s: well past claim_idle
    std::this_thread::sleep_for(50ms);
    const RedisReply r = redis({"XPENDING", "strata:requests", "strata", held, held, "1"});
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r.elements[0].elements[1].str, "live");
    most_idle_ms = std::max(most_idle_ms, r.elements[0].elements[2].integer);
  }
  EXPECT_LT(most_idle_ms, 900) << "renewed every 300 ms, the idle time must stay below 0.9 s";
}

TEST_F(RedisQueueTest, AnEntryDeliveredTooOftenGoesToTheDeadLetterStreamWithAnErrorResult) {
  RedisQueueOptions o = options();
  o.max_deliveries = 2;
  const std::string e = add({{"id", "poison"}, {"prompt", "1"}});
  for (int run = 0; run < 2; ++run) {  // two runs take it and die
    RedisQueue q(o, *tokenizer_);
    ASSERT_EQ(take(q, 1).size(), 1u) << run;
  }
  add({{"id", "fine"}, {"prompt", "2"}});
  RedisQueue q(o, *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 2, 2.0);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].request.id, "fine");
  EXPECT_EQ(q.stats().dead_lettered, 1);
  const RedisReply dead = redis({"XRANGE", "strata:requests:dead", "-", "+"});
  ASSERT_EQ(dead.size(), 1u);
  FieldList f;
  const RedisReply& df = dead.elements[0].elements[1];
  for (size_t i = 0; i + 1 < df.size(); i += 2)
    f.emplace_back(df.elements[i].str, df.elements[i + 1].str);
  EXPECT_EQ(f[0], (std::pair<std::string, std::string>{"id", "poison"}));  // the entry as it was
  EXPECT_NE(
      std::find(f.begin(), f.end(), std::pair<std::string, std::string>{"dead_letter_entry", e}),
      f.end());
  EXPECT_NE(std::find(f.begin(), f.end(),
                      std::pair<std::string, std::string>{"dead_letter_deliveries", "3"}),
            f.end());
  EXPECT_EQ(pending_entry(e).second, 0) << "acknowledged";
  EXPECT_FALSE(redis({"HGET", "strata:results:done", "poison"}).is_nil());
  const RedisReply res = redis({"XRANGE", "strata:results", "-", "+"});
  ASSERT_EQ(res.size(), 1u);
  const std::string fields = res.elements[0].elements[1].elements[3].str;  // status
  EXPECT_EQ(fields, "error");
}

TEST_F(RedisQueueTest, ReadsOnlyAsFarAheadAsThePrefetch) {
  for (int i = 0; i < 20; ++i) add({{"prompt", "1"}});
  RedisQueueOptions o = options();
  o.prefetch = 4;
  RedisQueue q(o, *tokenizer_);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(pending(), 0) << "nothing is read before the coordinator first asks";
  EXPECT_TRUE(q.poll(0).empty());
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(pending(), 4) << "the stream, not memory, holds the backlog";
  EXPECT_EQ(take(q, 3).size(), 3u);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(pending(), 7);  // 3 taken + 4 read ahead
}

TEST_F(RedisQueueTest, DrainedMeansNothingNewAndNothingPendingAnywhere) {
  RedisQueueOptions o = options();
  o.exit_when_drained = true;
  add({{"id", "a"}, {"prompt", "1"}});
  redis({"XGROUP", "CREATE", "strata:requests", "strata", "0"});
  add({{"id", "b"}, {"prompt", "2"}});
  redis({"XREADGROUP", "GROUP", "strata", "someone", "COUNT", "1", "STREAMS", "strata:requests",
         ">"});
  RedisQueue q(o, *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 2, 1.0);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_FALSE(q.exhausted()) << "a request is held";
  q.write(finished(got[0]));
  std::this_thread::sleep_for(500ms);
  EXPECT_FALSE(q.exhausted()) << "another consumer holds an entry";
  redis({"XACK", "strata:requests", "strata",
         redis({"XRANGE", "strata:requests", "-", "+"}).elements[0].elements[0].str});
  const Deadline d = Deadline::after_seconds(3);
  while (!q.exhausted() && !d.expired()) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(q.exhausted());
}

// Redis killed and restarted (AOF, appendfsync always): results finished meanwhile wait in
// memory, nothing is acknowledged without its result, and each request gets one result.
TEST_F(RedisQueueTest, ARedisRestartLosesNothingAndAnswersEachRequestOnce) {
  for (const char* id : {"a", "b", "c"}) add({{"id", id}, {"prompt", "1"}});
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 3);
  ASSERT_EQ(got.size(), 3u);
  q.write(finished(got[0]));
  ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
  server_->kill();
  q.write(finished(got[1]));
  EXPECT_FALSE(q.flush(Deadline::after_seconds(0.5))) << "no Redis: the result waits";
  server_->start();
  EXPECT_TRUE(q.flush(Deadline::after_seconds(10)));
  q.write(finished(got[2]));
  EXPECT_TRUE(q.flush(Deadline::after_seconds(10)));
  redis_ = std::make_unique<RedisConnection>(server_->connect());
  EXPECT_EQ(results(), 3);
  EXPECT_EQ(pending(), 0);
  EXPECT_GE(q.stats().reconnects, 1);
}

TEST_F(RedisQueueTest, AnUnreachableServerFailsTheStartAfterTheRetryBudgetNamingIt) {
  RedisQueueOptions o = options();
  o.endpoint.port = testing::free_port();
  o.retry_timeout_s = 0.5;
  const auto start = std::chrono::steady_clock::now();
  try {
    RedisQueue q(o, *tokenizer_);
    ADD_FAILURE() << "started without Redis";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unreachable for"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(o.endpoint.str()), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST_F(RedisQueueTest, MalformedEntriesComeAsErrorsToAnswer) {
  const std::string e = add({{"prompt", "1"}, {"max_new_tokens", "lots"}});
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].request.id, e);
  EXPECT_NE(got[0].error.find("max_new_tokens"), std::string::npos) << got[0].error;
  GenerationResult refused{e, {}, {}, StopReason::kError, got[0].error, ErrorKind::kInvalidInput};
  q.write(refused);
  ASSERT_TRUE(q.flush(Deadline::after_seconds(5)));
  EXPECT_EQ(pending(), 0);
}

TEST(RedisQueueOptions, RefusesWhatCannotWork) {
  RedisQueueOptions o;
  o.consumer = "c";
  o.result_stream = o.request_stream;
  EXPECT_THROW(o.validate(), InputError);
  o.result_stream = "r";
  o.max_deliveries = 0;
  EXPECT_THROW(o.validate(), InputError);
  o.max_deliveries = 3;
  o.consumer = "";
  EXPECT_THROW(o.validate(), InputError);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Tokenization off the coordinator's loop: once the run says how (prepare_with), the
// reader thread hands out requests already tokenized; before that, as read.
TEST_F(RedisQueueTest, TheReaderTokenizesOnceTheRunSaysHow) {
  add({{"id", "before"}, {"prompt", "5 6"}});
  RedisQueue q(options(), *tokenizer_);
  std::vector<IncomingRequest> got = take(q, 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].prompt.has_value());
  EXPECT_TRUE(got[0].request.prompt_ids.empty());
  q.prepare_with(PromptPrep{tokenizer_.get(), 2, 1});
  add({{"id", "after"}, {"prompt", "5 6"}});
  add({{"id", "long"}, {"prompt", "5 6 7"}});  // 3 printable bytes, 1 a token: over 2
  got = take(q, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_FALSE(got[0].prompt.has_value()) << "tokenized by the reader";
  EXPECT_EQ(got[0].request.prompt_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_NE(got[1].error.find("field 'prompt': at least 3 tokens exceed the context of 2"),
            std::string::npos)
      << got[1].error;
}

}  // namespace
}  // namespace strata
