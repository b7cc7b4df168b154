// ExeGPT's RRA schedule as the coordinator runs it: one prefill phase admits waiting
// requests, then N_D decode iterations; finished sequences leave at once and free their
// slots; new requests join only at the next prefill phase; micro-batches stay balanced.
#include <gtest/gtest.h>

#include "coordinator/exegpt/rra_scheduler.h"

namespace strata {
namespace {

GenerationRequest req(const std::string& id, int32_t prompt_len, int32_t max_new) {
  GenerationRequest r;
  r.id = id;
  r.prompt_ids.assign(static_cast<size_t>(prompt_len), 5);
  r.max_new_tokens = max_new;
  return r;
}

SchedulerOptions options(int32_t k, int32_t nd, int32_t slots) {
  SchedulerOptions o;
  o.micro_batches = k;
  o.decode_iters = nd;
  o.kv_slots = slots;
  o.kv_capacity = 64;
  o.max_step_tokens = 64;
  o.eos_token_ids = {2};
  return o;
}

// Answers a step as the last stage does: token 7 for every sequence that samples (or
// `eos_for` gets 2).
StepResult answer(const ScheduledStep& s, uint64_t eos_for = UINT64_MAX) {
  StepResult r{s.command.step_id, s.command.micro_batch, {}};
  for (const SeqStep& q : s.command.seqs)
    if (q.sample) r.tokens.push_back(SeqToken{q.seq_id, q.seq_id == eos_for ? 2 : 7});
  return r;
}

// A prompt longer than a step's rows (64) is prefilled in chunks 64 + 64 + 22 = 150; only
// the last chunk samples, the sampler learns of it with the first, and its first decode
// feeds position 150.
TEST(RraScheduler, LongPromptIsPrefilledInChunksAndOnlyTheLastSamples) {
  SchedulerOptions o = options(1, 4, 2);
  o.kv_capacity = 256;
  RraScheduler s(o);
  GenerationRequest r = req("long", 150, 3);
  for (size_t i = 0; i < r.prompt_ids.size(); ++i) r.prompt_ids[i] = static_cast<int32_t>(i);
  s.submit(r, 0, 0.0);
  const int32_t chunks[] = {64, 64, 22};
  int32_t past = 0;
  for (int i = 0; i < 3; ++i) {
    auto p = s.next_step(0);
    ASSERT_TRUE(p);
    EXPECT_EQ(p->command.phase, Phase::kPrefill) << i;
    ASSERT_EQ(p->command.seqs.size(), 1u);
    const SeqStep& q = p->command.seqs[0];
    EXPECT_EQ(q.n_past, past) << i;
    EXPECT_EQ(q.n_new, chunks[i]) << i;
    ASSERT_EQ(q.token_ids.size(), static_cast<size_t>(chunks[i]));
    EXPECT_EQ(q.token_ids.front(), past) << i;  // the prompt's ids from `past` on
    EXPECT_EQ(q.sample, i == 2) << i;
    EXPECT_EQ(p->joins.size(), i == 0 ? 1u : 0u) << i;
    EXPECT_TRUE(s.apply(answer(*p)).empty());
    past += chunks[i];
  }
  auto d = s.next_step(0);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->command.phase, Phase::kDecode);
  EXPECT_EQ(d->command.seqs[0].n_past, 150);
  EXPECT_THROW(s.apply(StepResult{d->command.step_id, 0, {}}), Error);  // one token is due
}

// Two prompts of 40 in steps of 64 rows: the first whole and 24 of the second, then the
// second's last 16; each samples once, at its last chunk.
TEST(RraScheduler, ChunksPackSeveralPromptsIntoTheStepRows) {
  RraScheduler s(options(1, 4, 2));
  s.submit(req("a", 40, 3), 0, 0.0);
  s.submit(req("b", 40, 3), 1, 0.0);
  auto p1 = s.next_step(0);
  ASSERT_EQ(p1->command.seqs.size(), 2u);
  EXPECT_EQ(p1->command.rows(), 64);
  EXPECT_TRUE(p1->command.seqs[0].sample);
  EXPECT_FALSE(p1->command.seqs[1].sample);
  EXPECT_EQ(p1->command.seqs[1].n_new, 24);
  EXPECT_EQ(p1->joins.size(), 2u);
  s.apply(answer(*p1));
  auto p2 = s.next_step(0);
  EXPECT_EQ(p2->command.phase, Phase::kPrefill);
  ASSERT_EQ(p2->command.seqs.size(), 1u);
  EXPECT_EQ(p2->command.seqs[0].seq_id, 1u);
  EXPECT_EQ(p2->command.seqs[0].n_past, 24);
  EXPECT_EQ(p2->command.seqs[0].n_new, 16);
  EXPECT_TRUE(p2->command.seqs[0].sample);
  EXPECT_TRUE(p2->joins.empty());
  s.apply(answer(*p2));
  auto d = s.next_step(0);
  EXPECT_EQ(d->command.phase, Phase::kDecode);
  EXPECT_EQ(d->command.seqs.size(), 2u);
}

TEST(RraScheduler, PrefillThenNdDecodesThenNextPrefill) {
  RraScheduler s(options(1, 3, 4));
  s.submit(req("a", 4, 10), 0, 0.0);
  s.submit(req("b", 2, 10), 1, 0.0);
  auto p = s.next_step(0);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->command.phase, Phase::kPrefill);
  EXPECT_EQ(p->command.rows(), 6);
  EXPECT_EQ(p->joins.size(), 2u);
  EXPECT_TRUE(s.apply(answer(*p)).empty());
  s.submit(req("c", 3, 10), 2, 0.0);  // arrives during the decode phase: waits for the next prefill
  for (int i = 0; i < 3; ++i) {
    auto d = s.next_step(0);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->command.phase, Phase::kDecode) << i;
    EXPECT_EQ(d->command.seqs.size(), 2u);
    EXPECT_EQ(d->command.seqs[0].n_past, 4 + i);
    EXPECT_EQ(d->command.seqs[0].token_ids, std::vector<int32_t>{7});
    s.apply(answer(*d));
  }
  auto p2 = s.next_step(0);
  ASSERT_TRUE(p2);
  EXPECT_EQ(p2->command.phase, Phase::kPrefill);
  ASSERT_EQ(p2->command.seqs.size(), 1u);
  EXPECT_EQ(p2->command.seqs[0].seq_id, 2u);
  EXPECT_EQ(s.waiting(), 0u);
}

TEST(RraScheduler, FinishedLeaveAtOnceAndFreeTheirSlot) {
  RraScheduler s(options(1, 100, 2));
  s.submit(req("a", 3, 2), 0, 0.0);
  s.submit(req("b", 3, 50), 1, 0.0);
  s.submit(req("c", 3, 50), 2, 0.0);
  auto p = s.next_step(0);
  ASSERT_EQ(p->command.seqs.size(), 2u);  // two slots
  const int32_t slot_a = p->command.seqs[0].slot;
  s.apply(answer(*p));
  auto d = s.next_step(0);
  auto done = s.apply(answer(*d));
  ASSERT_EQ(done.size(), 1u);  // a: 2 tokens = its budget
  EXPECT_EQ(done[0].result.id, "a");
  EXPECT_EQ(done[0].result.stop_reason, StopReason::kLength);
  EXPECT_EQ(done[0].result.output_ids, (std::vector<int32_t>{7, 7}));
  auto d2 = s.next_step(0);  // N_D not over: c waits although a slot is free
  EXPECT_EQ(d2->command.phase, Phase::kDecode);
  ASSERT_EQ(d2->command.seqs.size(), 1u);
  auto eos = s.apply(answer(*d2, 1));
  ASSERT_EQ(eos.size(), 1u);
  EXPECT_EQ(eos[0].result.stop_reason, StopReason::kEos);
  auto p2 = s.next_step(0);  // nothing runs: the next prefill phase starts now
  ASSERT_TRUE(p2);
  EXPECT_EQ(p2->command.phase, Phase::kPrefill);
  EXPECT_EQ(p2->command.seqs[0].slot, slot_a);
}

TEST(RraScheduler, MicroBatchesShareTheWorkAndOwnDisjointSlots) {
  RraScheduler s(options(2, 4, 8));
  for (uint64_t i = 0; i < 4; ++i) s.submit(req(std::to_string(i), 2, 5), i, 0.0);
  auto a = s.next_step(0);
  auto b = s.next_step(1);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->command.seqs.size(), 2u);
  EXPECT_EQ(b->command.seqs.size(), 2u);
  for (const SeqStep& x : a->command.seqs)
    for (const SeqStep& y : b->command.seqs) EXPECT_NE(x.slot, y.slot);
  EXPECT_TRUE(s.in_flight(0));
  EXPECT_THROW(s.apply(StepResult{b->command.step_id, 0, {}}), Error);  // wrong micro-batch
}

// B_E = 5 over two micro-batches: each prefill phase admits its share (3 and 2) although
// both have free slots and requests wait; a re-plan changes B_E from the next phase on.
TEST(RraScheduler, APrefillPhaseAdmitsItsShareOfTheEncodeBatch) {
  SchedulerOptions o = options(2, 1, 16);
  o.encode_batch = 5;
  RraScheduler s(o);
  for (uint64_t i = 0; i < 12; ++i) s.submit(req(std::to_string(i), 2, 1), i, 0.0);
  auto a = s.next_step(0);
  auto b = s.next_step(1);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->command.seqs.size(), 3u);
  EXPECT_EQ(b->command.seqs.size(), 2u);
  EXPECT_EQ(s.waiting(), 7u);
  EXPECT_EQ(s.apply(answer(*a)).size(), 3u);  // one token each: done at the prefill
  s.reschedule(1, 2, 16);
  auto a2 = s.next_step(0);
  ASSERT_TRUE(a2);
  EXPECT_EQ(a2->command.seqs.size(), 1u);
  EXPECT_THROW(s.reschedule(1, -1, 16), Error);
}

TEST(RraScheduler, ContextLimitStopsAsTheRequestRulesSay) {
  SchedulerOptions o = options(1, 8, 1);
  o.kv_capacity = 5;
  RraScheduler s(o);
  s.submit(req("a", 3, 100), 0, 0.0);
  std::vector<FinishedRequest> done;
  while (done.empty()) done = s.apply(answer(*s.next_step(0)));
  EXPECT_EQ(done[0].result.stop_reason, StopReason::kContext);
  EXPECT_EQ(done[0].result.output_ids.size(), 3u);  // positions 3, 4 fed back, then full
  EXPECT_TRUE(s.idle());
}

TEST(RraScheduler, RefusesOptionsThatCannotWork) {
  EXPECT_THROW(RraScheduler(options(4, 8, 2)), InputError);  // fewer slots than micro-batches
  EXPECT_THROW(RraScheduler(options(1, 0, 2)), InputError);
}

TEST(RraScheduler, DrainEndsEveryUnfinishedRequestWithItsTokens) {
  RraScheduler s(options(2, 4, 2));
  s.submit(req("a", 3, 10), 0, 0.0);
  s.submit(req("b", 2, 10), 1, 0.0);
  s.submit(req("c", 2, 10), 2, 0.0);  // no free slot: still waiting when the cluster fails
  auto p0 = s.next_step(0);
  auto p1 = s.next_step(1);
  ASSERT_TRUE(p0 && p1);
  s.apply(answer(*p0));  // a has one token; b's step is still in flight
  const std::vector<FinishedRequest> out = s.drain("worker rank 2 is dead");
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].result.id, "a");
  EXPECT_EQ(out[0].result.output_ids, std::vector<int32_t>{7});
  EXPECT_EQ(out[1].result.id, "b");
  EXPECT_TRUE(out[1].result.output_ids.empty());
  EXPECT_EQ(out[2].result.id, "c");
  EXPECT_TRUE(out[0].started);   // ran: a suspect if the cluster failed
  EXPECT_TRUE(out[1].started);   // admitted, its prefill in flight
  EXPECT_FALSE(out[2].started);  // never admitted
  for (const FinishedRequest& f : out) {
    EXPECT_EQ(f.result.stop_reason, StopReason::kError) << f.result.id;
    EXPECT_EQ(f.result.error, "worker rank 2 is dead") << f.result.id;
  }
  EXPECT_TRUE(s.idle());
  EXPECT_FALSE(s.in_flight(0));
  EXPECT_FALSE(s.in_flight(1));
  EXPECT_TRUE(s.drain("again").empty());
}

// The result's times count from the request's arrival on the queue: admission into a
// prefill, the first token, the end (hand-set clock: arrival 100, prefill at 103, first
// token back at 104, second at 106).
TEST(RraScheduler, TimesCountFromArrival) {
  double now = 103;
  SchedulerOptions o = options(1, 8, 2);
  o.clock = [&] { return now; };
  RraScheduler s(o);
  s.submit(req("a", 2, 2), 0, 100.0);
  auto p = s.next_step(0);
  now = 104;
  EXPECT_TRUE(s.apply(answer(*p)).empty());
  auto d = s.next_step(0);
  now = 106;
  const std::vector<FinishedRequest> done = s.apply(answer(*d));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_DOUBLE_EQ(done[0].result.times.queue_wait_s, 3.0);
  EXPECT_DOUBLE_EQ(done[0].result.times.first_token_s, 4.0);
  EXPECT_DOUBLE_EQ(done[0].result.times.total_s, 6.0);
}

// A stop string ends the sequence at the token that completes it, by the request rules'
// finish_if_done (coordinator/intake/request_rules.h), and the text is cut before it. With the
// id-only tokenizer the completion of tokens 7, 8, 9 reads "7 8 9", so the stop string "8 9" ends
// it after the third token.
TEST(RraScheduler, StopStringEndsTheSequenceAndCutsTheText) {
  const ModelConfig config = [] {
    ModelConfig c;
    c.vocab = 16;
    return c;
  }();
  const std::unique_ptr<Tokenizer> tok = Tokenizer::ids_only(config);
  SchedulerOptions o = options(1, 8, 1);
  o.tokenizer = tok.get();
  RraScheduler s(o);
  GenerationRequest r = req("a", 2, 10);
  r.stop = {"8 9"};
  s.submit(r, 0, 0.0);
  std::vector<FinishedRequest> done;
  for (int32_t token = 7; done.empty() && token < 12; ++token) {
    auto step = s.next_step(0);
    ASSERT_TRUE(step);
    StepResult answer_with{step->command.step_id, 0, {SeqToken{0, token}}};
    done = s.apply(answer_with);
  }
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].result.stop_reason, StopReason::kStop);
  EXPECT_EQ(done[0].result.output_ids, (std::vector<int32_t>{7, 8, 9}));
  ASSERT_TRUE(done[0].result.text.has_value());
  EXPECT_EQ(*done[0].result.text, "7 ");
}

}  // namespace
}  // namespace strata
