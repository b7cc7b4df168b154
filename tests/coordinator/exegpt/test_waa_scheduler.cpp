// ExeGPT's WAA as the coordinator runs it (§4.1, Fig. 4c, §5.2): encoder batches of B_E on
// the prefill side, each prefilled sequence's KV handed to a free decode slot, the decode
// batch in B_m micro-batches that never pause; early termination frees a decode slot that
// the next hand-over fills; the encoder batch kept within the threshold of its planned
// workload, and B_E moved by a step when the decode batch leaves its band. Expected values
// are worked by hand from those rules.
#include <gtest/gtest.h>

#include "coordinator/exegpt/waa_scheduler.h"
#include "kernels/error.h"

namespace strata {
namespace {

GenerationRequest req(const std::string& id, int32_t prompt_len, int32_t max_new) {
  GenerationRequest r;
  r.id = id;
  r.prompt_ids.assign(static_cast<size_t>(prompt_len), 5);
  r.max_new_tokens = max_new;
  return r;
}

WaaOptions options(int32_t b_e, int32_t b_m, int32_t prefill_slots, int32_t decode_slots) {
  WaaOptions o;
  o.common.micro_batches = b_m;
  o.common.kv_slots = decode_slots;
  o.common.kv_capacity = 256;
  o.common.max_step_tokens = 256;
  o.common.eos_token_ids = {2};
  o.common.encode_batch = b_e;
  o.prefill_slots = prefill_slots;
  return o;
}

StepResult answer(const ScheduledStep& s, int32_t token = 7) {
  StepResult r{s.command.step_id, s.command.micro_batch, {}};
  for (const SeqStep& q : s.command.seqs)
    if (q.sample) r.tokens.push_back(SeqToken{q.seq_id, token});
  return r;
}

std::vector<uint64_t> ids(const ScheduledStep& s) {
  std::vector<uint64_t> out;
  for (const SeqStep& q : s.command.seqs) out.push_back(q.seq_id);
  return out;
}

// Lane 0 prefills, lanes 1 and 2 are the decoder micro-batches.
TEST(WaaScheduler, PrefillHandOverThenDecodeInMicroBatches) {
  WaaScheduler s(options(2, 2, 2, 4));
  s.submit(req("a", 5, 4), 0, 0);
  s.submit(req("b", 3, 4), 1, 0);
  s.submit(req("c", 4, 4), 2, 0);
  auto p = s.next_step(0);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->command.phase, Phase::kPrefill);
  EXPECT_EQ(ids(*p), (std::vector<uint64_t>{0, 1}));  // B_E = 2
  EXPECT_EQ(p->command.seqs[0].slot, 0);
  EXPECT_EQ(p->command.seqs[1].slot, 1);
  EXPECT_EQ(p->joins.size(), 2u);
  EXPECT_FALSE(s.next_step(1));  // nothing decodes yet
  EXPECT_FALSE(s.next_handover());
  EXPECT_TRUE(s.apply(answer(*p, 40)).empty());
  // Both sampled their first token: their KV goes to decode slots 0 and 1, one to each
  // decoder micro-batch.
  auto h = s.next_handover();
  ASSERT_TRUE(h);
  ASSERT_EQ(h->moves.size(), 2u);
  EXPECT_EQ(h->moves[0], (KvMove{0, 0, 0, 5}));
  EXPECT_EQ(h->moves[1], (KvMove{1, 1, 1, 3}));
  EXPECT_EQ(h->joins[1].slot, 1);
  EXPECT_FALSE(s.next_handover());
  // The prefill slots are held until the hand-over ends: c waits.
  EXPECT_FALSE(s.next_step(0));
  EXPECT_FALSE(s.next_step(1));
  EXPECT_FALSE(s.idle());
  s.handed_over(h->handover_id);
  auto d1 = s.next_step(1), d2 = s.next_step(2);
  ASSERT_TRUE(d1 && d2);
  EXPECT_EQ(d1->command.phase, Phase::kDecode);
  EXPECT_EQ(ids(*d1), (std::vector<uint64_t>{0}));
  EXPECT_EQ(ids(*d2), (std::vector<uint64_t>{1}));
  EXPECT_EQ(d1->command.seqs[0], (SeqStep{0, 0, 5, 1, {40}, true}));  // the first token at 5
  EXPECT_EQ(d2->command.seqs[0], (SeqStep{1, 1, 3, 1, {40}, true}));
  // Meanwhile the prefill side takes c into a freed prefill slot.
  auto p2 = s.next_step(0);
  ASSERT_TRUE(p2);
  EXPECT_EQ(ids(*p2), (std::vector<uint64_t>{2}));
  EXPECT_EQ(p2->command.seqs[0].slot, 0);
  EXPECT_THROW(s.handed_over(h->handover_id), Error);  // done once
}

// Early termination: a finished sequence frees its decode slot at once, and the next
// hand-over fills exactly that slot; one that ends at its first token is never handed over.
TEST(WaaScheduler, FinishedSlotIsFilledByTheNextHandOver) {
  WaaScheduler s(options(1, 1, 2, 1));
  s.submit(req("a", 4, 2), 0, 0);
  s.submit(req("b", 6, 3), 1, 0);
  s.submit(req("one", 2, 1), 2, 0);
  auto p = s.next_step(0);
  s.apply(answer(*p));
  auto h = s.next_handover();
  ASSERT_TRUE(h);
  s.handed_over(h->handover_id);
  p = s.next_step(0);  // b
  ASSERT_EQ(ids(*p), (std::vector<uint64_t>{1}));
  s.apply(answer(*p));
  EXPECT_FALSE(s.next_handover());  // the one decode slot is a's
  auto d = s.next_step(1);
  auto done = s.apply(answer(*d));  // a's second token: done
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].result.output_ids, (std::vector<int32_t>{7, 7}));
  h = s.next_handover();
  ASSERT_TRUE(h);
  // b took prefill slot 0, which a gave back at its hand-over; it gets a's decode slot 0.
  EXPECT_EQ(h->moves, (std::vector<KvMove>{KvMove{1, 0, 0, 6}}));
  s.handed_over(h->handover_id);
  p = s.next_step(0);  // "one": finishes at its first token
  done = s.apply(answer(*p));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].result.id, "one");
  EXPECT_FALSE(s.next_handover());
  for (int i = 0; i < 2; ++i) {
    d = s.next_step(1);
    done = s.apply(answer(*d));
  }
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].result.id, "b");
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(s.counters().handovers, 2);
  EXPECT_EQ(s.counters().handed_sequences, 2);
}

// §5.2, encoder side: B_E 4, planned mean input 10, threshold 0.25: the batch's workload
// stays within [30, 50]. Prompts 30, 30, 5, 5: 30 + 30 = 60 > 50, so the batch is cut
// to one. Prompts of 5: four make 20 < 30, so it grows to six (30).
TEST(WaaScheduler, EncoderBatchIsCutOrGrownToItsWorkloadBand) {
  WaaOptions o = options(4, 1, 8, 8);
  o.planned_input = 10;
  o.threshold = 0.25;
  WaaScheduler s(o);
  for (int32_t len : {30, 30, 5, 5})
    s.submit(req("x", len, 4), static_cast<uint64_t>(s.waiting()), 0);
  auto p = s.next_step(0);
  EXPECT_EQ(ids(*p), (std::vector<uint64_t>{0}));
  EXPECT_EQ(s.counters().encoder_adjustments, 1);
  WaaScheduler g(o);
  for (uint64_t i = 0; i < 8; ++i) g.submit(req("y", 5, 4), i, 0);
  p = g.next_step(0);
  EXPECT_EQ(ids(*p).size(), 6u);
  EXPECT_EQ(g.counters().encoder_adjustments, 1);
  EXPECT_EQ(g.counters().encoder_batches, 1);
}

// §5.2, decoder side: B_E 4, planned B_D 8, threshold 0.25 (band [6, 10], step
// round(0.25 x 4) = 1): an empty decode batch raises B_E to 5; one of 11 lowers it to 3.
TEST(WaaScheduler, EncoderBatchFollowsTheDecodeBatch) {
  WaaOptions o = options(4, 1, 16, 16);
  o.planned_decode_batch = 8;
  WaaScheduler s(o);
  for (uint64_t i = 0; i < 16; ++i) s.submit(req("z", 3, 50), i, 0);
  auto p = s.next_step(0);
  EXPECT_EQ(ids(*p).size(), 5u);
  EXPECT_EQ(s.counters().decoder_adjustments, 1);
  s.apply(answer(*p));
  s.handed_over(s.next_handover()->handover_id);
  p = s.next_step(0);  // 5 decoding: below 6, still raised
  EXPECT_EQ(ids(*p).size(), 5u);
  s.apply(answer(*p));
  s.handed_over(s.next_handover()->handover_id);
  p = s.next_step(0);  // 10 decoding: in band, B_E itself
  EXPECT_EQ(ids(*p).size(), 4u);
  EXPECT_EQ(s.counters().decoder_adjustments, 2);
  s.apply(answer(*p));
  s.handed_over(s.next_handover()->handover_id);
  s.submit(req("late", 3, 50), 98, 0);
  s.submit(req("late", 3, 50), 99, 0);
  p = s.next_step(0);  // 14 decoding: above 10, B_E lowered to 3 of the 4 waiting
  EXPECT_EQ(ids(*p).size(), 3u);
  EXPECT_EQ(s.counters().decoder_adjustments, 3);
}

TEST(WaaScheduler, DrainEndsEveryRequestWhereverItIs) {
  WaaScheduler s(options(1, 1, 2, 1));
  s.submit(req("run", 3, 9), 0, 0);
  s.submit(req("ready", 3, 9), 1, 0);
  s.submit(req("ready too", 3, 9), 2, 0);
  s.submit(req("waiting", 3, 9), 3, 0);
  auto p = s.next_step(0);
  s.apply(answer(*p));
  s.handed_over(s.next_handover()->handover_id);  // run decodes
  p = s.next_step(0);
  s.apply(answer(*p));  // ready: no decode slot
  p = s.next_step(0);
  s.apply(answer(*p));  // ready too; waiting has no prefill slot
  auto out = s.drain("cluster failed");
  ASSERT_EQ(out.size(), 4u);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].seq_id, i);
    EXPECT_EQ(out[i].result.stop_reason, StopReason::kError);
    EXPECT_EQ(out[i].result.error, "cluster failed");
  }
  EXPECT_EQ(out[0].result.output_ids.size(), 1u);
  EXPECT_FALSE(out[3].started);
  EXPECT_TRUE(s.idle());
}

TEST(WaaScheduler, RefusesTooFewPrefillSlots) {
  WaaOptions o = options(2, 1, 1, 4);
  o.prefill_micro_batches = 2;
  EXPECT_THROW(WaaScheduler{o}, InputError);
  o.prefill_slots = 2;
  o.threshold = 1.5;
  EXPECT_THROW(WaaScheduler{o}, InputError);
}

}  // namespace
}  // namespace strata
