// Control messages: every message type survives encode/decode unchanged, prints itself, and
// malformed bytes of every kind (empty, torn, truncated, corrupted, other version, unknown
// type or enum) become a clear Error instead of a crash. Plan validation names the fault.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>

#include "kernels/error.h"
#include "transport/messages.h"

namespace strata {
namespace {

ClusterPlan sample_plan() {
  ClusterPlan p;
  p.plan_id = 42;
  p.model_spec = "dummy:opt-125m";
  p.num_layers = 12;
  p.hidden_size = 768;
  p.max_batch_rows = 256;
  p.micro_batches = 2;
  p.kv_slots = 8;
  p.kv_capacity = 1024;
  p.stages = {{1, 0, 5, true, false, false}, {2, 5, 12, false, true, true}};
  p.stages[1].nccl = true;  // protocol 6
  // The second stage carries its placement (protocol 2): 7 layers' weight and cache tiers.
  StagePlan& s = p.stages[1];
  s.weight_tiers = {0, 1, 2, 0, 1, 2, 1};
  s.cache_tiers = {0, 0, 1, 1, 2, 2, 0};
  s.compress_weight = true;
  s.compress_cache = true;
  s.cache_f16 = true;  // (refused together by Policy; the wire carries each bit)
  s.gpu_batch_size = 4;
  s.placed_gpu_bytes = 15ull << 30;
  s.placed_cpu_bytes = (1ull << 30) + 7;
  s.placed_disk_bytes = 99ull << 30;
  return p;
}

// WAA (protocol 4): a prefill pipeline [0, 12) on rank 1, a decode pipeline [0, 5) [5, 12).
ClusterPlan waa_plan() {
  ClusterPlan p = sample_plan();
  p.stages = {{1, 0, 12, true, true}, {2, 0, 5, true, false}, {3, 5, 12, false, true}};
  p.encoder_stages = 1;
  p.encoder_kv_slots = 3;
  return p;
}

// Partial tensor parallelism (protocol 5): [0, 4) on rank 1, [4, 8) split over ranks 2 and
// 3, [8, 12) over ranks 4 to 7.
ClusterPlan tp_plan() {
  ClusterPlan p = sample_plan();
  p.stages = {{1, 0, 4, true, false}, {2, 4, 8, false, false}, {4, 8, 12, false, true}};
  p.stages[1].tp_ranks = {2, 3};
  p.stages[2].tp_ranks = {4, 5, 6, 7};
  return p;
}

std::vector<ControlMessage> every_message() {
  StepCommand step{7, Phase::kPrefill, 1, {{11, 0, 0, 3, {1, 2, 3}, false}, {12, 1, 5, 1, {}}}};
  SamplingParams sampling;
  sampling.temperature = 0.7f;
  sampling.top_k = 40;
  sampling.top_p = 0.9f;
  sampling.seed = 1234567890123ull;
  return {
      sample_plan(),
      step,
      StepCommand{8, Phase::kDecode, 0, {}},
      BatchUpdate{{{11, 0, sampling}, {12, 1, SamplingParams{}}}, {9, 10}},
      StepResult{7, 1, {{11, 500}, {12, -1}}},
      Shutdown{"all requests done"},
      ErrorReport{2, ErrorKind::kOverloaded, "out of memory: KV cache \xc3\xa9", 7},
      Heartbeat{3, 99, true, std::nullopt},
      // A worker's reply with its statistics so far (the live metrics).
      Heartbeat{3, 100, true, StageStats{3, 12, 96, 0.5, 0.25, 0.75, 1ull << 33, 4096}},
      StageStats{2, 40, 320, 1.25, 0.5, 1.75, 123456789012ull, 7, {1.5, 2.25, 3.0, 3.125}, 9},
      // With what it allocated and its resident memory (protocol 6).
      StageStats{2,
                 40,
                 320,
                 1.25,
                 0.5,
                 1.75,
                 1,
                 7,
                 {},
                 0,
                 11ull << 30,
                 5ull << 30,
                 3,
                 1234567,
                 7654321,
                 8765432},
      ProfileRequest{{16, 64}, {16, 64, 256}, {1, 4}, {16, 512}, {1, 16}, {1, 4}, 3, {1, 512}},
      ProfileReport{2,
                    "node-7",
                    6,
                    {1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3},
                    {1e-4, 2e-4, 3e-4, 4e-4},
                    {},
                    {2.5e-4, 9e-4},
                    {1.5e-5, 2.25e-4}},
      waa_plan(),
      tp_plan(),
      KvHandover{
          5, {{11, 2, 0, 17}, {12, 0, 3, 1}}, {{11, 0, sampling}, {12, 3, SamplingParams{}}}},
      KvHandoverDone{5, 2, 123456789012ull},
  };
}

TEST(Messages, EveryMessageRoundTrips) {
  for (const ControlMessage& m : every_message()) {
    const std::vector<std::byte> bytes = encode(m);
    EXPECT_EQ(bytes.size() % 8, 0u);
    const ControlMessage back = decode(bytes);
    EXPECT_EQ(back.index(), m.index()) << message_name(m);
    EXPECT_TRUE(back == m) << "sent " << str(m) << "\ngot  " << str(back);
  }
}

TEST(Messages, EveryMessagePrintsWhatMatters) {
  EXPECT_NE(str(sample_plan()).find("rank 2: layers [5, 12) +head on gpu"), std::string::npos)
      << str(sample_plan());
  const std::string step = str(every_message()[1]);
  EXPECT_NE(step.find("step 7 prefill micro_batch 1 rows 4"), std::string::npos) << step;
  EXPECT_NE(step.find("seq 11 slot 0 past 0 new 3 tokens 3 (no sample)"), std::string::npos)
      << step;
  for (const ControlMessage& m : every_message()) EXPECT_FALSE(str(m).empty()) << message_name(m);
  EXPECT_STREQ(message_name(Heartbeat{}), "heartbeat");
  EXPECT_STREQ(message_name(StageStats{}), "stats");
}

TEST(Messages, LongListsPrintBounded) {
  StepCommand step;
  for (int i = 0; i < 1000; ++i)
    step.seqs.push_back(SeqStep{static_cast<uint64_t>(i), i, 0, 1, {}});
  const std::string s = step.str();
  EXPECT_LT(s.size(), 600u);
  EXPECT_NE(s.find("992 more"), std::string::npos) << s;
}

void expect_malformed(std::span<const std::byte> bytes, const std::string& needle) {
  try {
    decode(bytes);
    ADD_FAILURE() << "decoded " << bytes.size() << " bad bytes";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailed);
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Messages, EmptyAndTornBytesAreErrors) {
  expect_malformed({}, "0 bytes is not a whole number");
  std::vector<std::byte> seven(7, std::byte{1});
  expect_malformed(seven, "7 bytes");
}

TEST(Messages, EveryTruncationIsAnError) {
  const std::vector<std::byte> full = encode(sample_plan());
  for (size_t n = 8; n < full.size(); n += 8) {
    expect_malformed(std::span(full).first(n), "malformed control message");
  }
}

TEST(Messages, OtherProtocolVersionIsRefused) {
  std::vector<std::byte> bytes = encode(Heartbeat{1, 2, false});
  bytes[16] =
      std::byte{6};  // the root struct's data: version at byte 0 (after 16 bytes of framing)
  expect_malformed(bytes, "protocol version 6, this binary speaks 7");
}

TEST(Messages, UnknownMessageTypeIsRefused) {
  std::vector<std::byte> bytes = encode(Heartbeat{1, 2, false});
  bytes[20] = std::byte{99};  // the union tag, bits [32, 48) of the root struct's data
  expect_malformed(bytes, "unknown message type 99");
}

// Protocol 1 said a sequence finished with its own message (union member 4); since 2 that is
// BatchUpdate.left, and the old message is refused, not misread.
TEST(Messages, TheFinishedMessageOfProtocolOneIsRefused) {
  std::vector<std::byte> bytes = encode(Heartbeat{1, 2, false});
  bytes[20] = std::byte{4};
  expect_malformed(bytes, "'finished' is not a message of this protocol version");
}

TEST(Messages, UnknownEnumValueIsRefused) {
  const std::vector<std::byte> good = encode(StepCommand{1, Phase::kDecode, 0, {}});
  // Find the phase (1 = decode) in the step struct's data and make it 9.
  std::vector<std::byte> bad = good;
  bool patched = false;
  for (size_t i = 24; i + 8 <= bad.size() && !patched; i += 8) {
    // StepCommand data: stepId (8 bytes) = 1, then phase (2 bytes) = 1 at the next word.
    uint64_t w0, w1;
    std::memcpy(&w0, bad.data() + i, 8);
    std::memcpy(&w1, bad.data() + i + 8, 8);
    if (w0 == 1 && (w1 & 0xffff) == 1) {
      bad[i + 8] = std::byte{9};
      patched = true;
    }
  }
  ASSERT_TRUE(patched);
  expect_malformed(bad, "step.phase = 9 is not a known value");
}

// Found by tests/fuzz/fuzz_messages: two sequences of 2^31 - 100 new rows each made rows()
// overflow. No step of a real plan holds negative sizes or more rows than an int32.
TEST(Messages, StepSizesNoStepCanHoldAreRefused) {
  const int32_t big = std::numeric_limits<int32_t>::max() - 100;
  expect_malformed(
      encode(StepCommand{1, Phase::kPrefill, 0, {{1, 0, 0, big, {}}, {2, 1, 0, big, {}}}}),
      "rows in all, more than any step holds");
  expect_malformed(encode(StepCommand{1, Phase::kDecode, 0, {{1, 0, 5, 1, {}}, {2, 1, 0, -3, {}}}}),
                   "step.seqs[1]: negative slot, past or new");
  expect_malformed(encode(StepCommand{1, Phase::kDecode, 0, {{1, -1, 0, 1, {}}}}),
                   "step.seqs[0]: negative");
  const StepCommand ok{1, Phase::kPrefill, 0, {{1, 0, 0, big, {}}, {2, 1, 0, 100, {}}}};
  EXPECT_EQ(std::get<StepCommand>(decode(encode(ok))).rows(), std::numeric_limits<int32_t>::max());
}

TEST(Messages, RandomAndCorruptedBytesNeverCrash) {
  std::mt19937_64 rng(7);
  int decoded = 0, refused = 0;
  for (const ControlMessage& m : every_message()) {
    const std::vector<std::byte> good = encode(m);
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<std::byte> bad = good;
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < flips; ++f) bad[rng() % bad.size()] = static_cast<std::byte>(rng());
      try {
        decode(bad);
        ++decoded;  // a flip in a value field still makes a valid message
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kFailed) << e.what();
        ++refused;
      }
    }
  }
  for (size_t words = 1; words < 64; ++words) {
    std::vector<std::byte> noise(words * 8);
    for (auto& b : noise) b = static_cast<std::byte>(rng());
    try {
      decode(noise);
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(decoded, 0);
}

TEST(Plan, ValidPlanPasses) {
  EXPECT_NO_THROW(sample_plan().validate());
  EXPECT_EQ(sample_plan().stage_of_rank(2)->layer_begin, 5);
  EXPECT_EQ(sample_plan().stage_of_rank(3), nullptr);
}

void expect_refused(const ClusterPlan& p, const std::string& needle) {
  try {
    p.validate();
    ADD_FAILURE() << "accepted " << p.str();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Plan, FaultsAreNamed) {
  ClusterPlan p = sample_plan();
  p.num_layers = 1;
  expect_refused(p, "2 stages but the model has only 1 layers");
  p = sample_plan();
  p.stages[1].layer_begin = 6;
  expect_refused(p, "stage 1 has layers [6, 12), expected [5, ...)");
  p = sample_plan();
  p.stages[1].rank = 1;
  expect_refused(p, "rank 1 holds two stages");
  p = sample_plan();
  p.stages[0].rank = 0;
  expect_refused(p, "rank 0 coordinates");
  p = sample_plan();
  p.stages[1].has_head = false;
  expect_refused(p, "head must be on the last stage");
  p = sample_plan();
  p.num_layers = 13;
  expect_refused(p, "stages cover 12 of 13 layers");
  p.stages.clear();
  expect_refused(p, "no stages");
  p = sample_plan();
  p.stages[1].cache_tiers.pop_back();
  expect_refused(p, "stage 1 places 7 weight and 6 cache layers of its 7");
  p = sample_plan();
  p.stages[1].weight_tiers[3] = 3;
  expect_refused(p, "stage 1 places a layer on tier 3");
}

TEST(Plan, WaaPlanHasTwoPipelines) {
  const ClusterPlan p = waa_plan();
  EXPECT_NO_THROW(p.validate());
  EXPECT_TRUE(p.waa());
  ASSERT_EQ(p.pipeline(Phase::kPrefill).size(), 1u);
  EXPECT_EQ(p.pipeline(Phase::kDecode).front().rank, 2);
  EXPECT_TRUE(p.encoder(*p.stage_of_rank(1)));
  EXPECT_FALSE(p.encoder(*p.stage_of_rank(3)));
  EXPECT_EQ(p.pipeline_of(*p.stage_of_rank(3)).size(), 2u);
  EXPECT_EQ(p.kv_slots_of(*p.stage_of_rank(1)), 3);
  EXPECT_EQ(p.kv_slots_of(*p.stage_of_rank(2)), 8);
  EXPECT_NE(p.str().find("WAA: 1 prefill stages with 3 KV slots"), std::string::npos) << p.str();
  EXPECT_EQ(sample_plan().pipeline(Phase::kPrefill).size(), 2u);  // RRA: one pipeline
  EXPECT_FALSE(sample_plan().encoder(sample_plan().stages[0]));
  EXPECT_EQ(message_name(KvHandover{}), std::string("kv hand-over"));
  EXPECT_NE(str(KvHandover{5, {{11, 2, 0, 17}}, {}}).find("seq 11 slot 2 -> 0 (17 positions)"),
            std::string::npos);
}

TEST(Plan, WaaFaultsAreNamed) {
  ClusterPlan p = waa_plan();
  p.encoder_stages = 3;
  expect_refused(p, "3 encoder stages of 3: WAA needs at least one stage on each side");
  p = waa_plan();
  p.encoder_kv_slots = 0;
  expect_refused(p, "WAA's encoder stages need KV slots");
  p = waa_plan();
  p.stages[2].layer_end = 11;
  expect_refused(p, "decode stages cover 11 of 12 layers");
  p = waa_plan();
  p.stages[0].layer_end = 6;
  expect_refused(p, "prefill stages cover 6 of 12 layers");
  p = waa_plan();
  p.stages[1].has_embedding = false;
  expect_refused(p, "the embedding must be on the first stage only (decode stages)");
  p = waa_plan();
  p.stages[2].rank = 1;
  expect_refused(p, "rank 1 holds two stages");
}

TEST(Plan, TensorParallelGroupsAreStagesOfSeveralRanks) {
  const ClusterPlan p = tp_plan();
  EXPECT_NO_THROW(p.validate());
  EXPECT_TRUE(p.tensor_parallel());
  EXPECT_FALSE(sample_plan().tensor_parallel());
  EXPECT_EQ(p.stage_of_rank(3), &p.stages[1]);
  EXPECT_EQ(p.stage_of_rank(6), &p.stages[2]);
  EXPECT_EQ(p.stage_of_rank(8), nullptr);
  EXPECT_EQ(p.stages[2].tp_index(6), 2);
  EXPECT_EQ(p.stages[2].tp_index(3), -1);
  EXPECT_EQ(p.stages[0].tp_index(1), 0);
  EXPECT_EQ(p.stages[2].tp_degree(), 4);
  EXPECT_EQ(p.stages[0].ranks(), std::vector<int32_t>{1});
  EXPECT_NE(p.stages[1].str().find("ranks 2+3 (TP 2): layers [4, 8)"), std::string::npos)
      << p.stages[1].str();
}

TEST(Plan, TensorParallelFaultsAreNamed) {
  ClusterPlan p = tp_plan();
  p.stages[1].tp_ranks = {3, 2};
  expect_refused(p,
                 "stage 1's tensor-parallel group [3, 2] must hold two or more ranks led by "
                 "the stage's rank 2");
  p = tp_plan();
  p.stages[1].tp_ranks = {2};
  expect_refused(p, "group [2] must hold two or more ranks");
  p = tp_plan();
  p.stages[2].tp_ranks = {4, 3};
  p.stages[2].rank = 4;
  expect_refused(p, "rank 3 holds two stages");
  p = tp_plan();
  p.stages[1].tp_ranks = {2, 0};
  expect_refused(p, "stage 1 on rank 0 (rank 0 coordinates)");
  p = waa_plan();
  p.stages[2].tp_ranks = {3, 4};
  expect_refused(p, "stage 2 is tensor-parallel in a WAA plan");
}

TEST(Plan, PlacementPrints) {
  const std::string s = sample_plan().stages[1].str();
  EXPECT_NE(s.find("placed: weights gcdgcdc cache ggccddg"), std::string::npos) << s;
  EXPECT_EQ(sample_plan().stages[0].str().find("placed"), std::string::npos);
}

TEST(Messages, ErrorReportCarriesKindAndRank) {
  const ErrorReport r = ErrorReport::from(Error(ErrorKind::kOverloaded, "KV full"), 3, 9);
  try {
    r.raise();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOverloaded);
    EXPECT_STREQ(e.what(), "rank 3: KV full");
  }
}

}  // namespace
}  // namespace strata
