// S3's output-length predictor (coordinator/s3/length_predictor.h): buckets and reservations
// on hand-worked values, the first AdaGrad step computed by hand, a separable task learned
// to 100%, evaluate() on a set whose answers are known, the model file's round trip and its
// refusals, and the JSONL reader's rows and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "coordinator/s3/length_predictor.h"
#include "kernels/error.h"
#include "support/test_device.h"
#include "worker/tokenizer.h"

namespace strata {
namespace {

template <typename F>
std::string input_error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InputError";
  return "";
}

#define EXPECT_MENTIONS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << (text) << " lacks " << (part)

TEST(LengthBuckets, BucketOfAndUpperByHand) {
  const LengthBuckets b{10, 50};  // [1,50] -> 0, [51,100] -> 1, ..., >= 451 -> 9
  EXPECT_EQ(b.bucket_of(0), 0);
  EXPECT_EQ(b.bucket_of(1), 0);
  EXPECT_EQ(b.bucket_of(50), 0);
  EXPECT_EQ(b.bucket_of(51), 1);
  EXPECT_EQ(b.bucket_of(100), 1);
  EXPECT_EQ(b.bucket_of(101), 2);
  EXPECT_EQ(b.bucket_of(450), 8);
  EXPECT_EQ(b.bucket_of(451), 9);
  EXPECT_EQ(b.bucket_of(500), 9);
  EXPECT_EQ(b.bucket_of(501), 9);
  EXPECT_EQ(b.bucket_of(INT32_MAX), 9);
  EXPECT_EQ(b.upper(0), 50);
  EXPECT_EQ(b.upper(2), 150);
  EXPECT_EQ(b.upper(9), 500);
  const LengthBuckets one{3, 1};  // 0,1 -> 0; 2 -> 1; 3.. -> 2
  EXPECT_EQ(one.bucket_of(1), 0);
  EXPECT_EQ(one.bucket_of(2), 1);
  EXPECT_EQ(one.bucket_of(3), 2);
  EXPECT_EQ(one.bucket_of(1000), 2);
  EXPECT_EQ(b.str(), "10 buckets of 50 tokens (last: >= 451)");
}

TEST(LengthBuckets, OptionsAreValidated) {
  LengthPredictorOptions o;
  o.buckets.count = 1;
  EXPECT_MENTIONS(input_error_of([&] { o.validate(); }), "bucket count");
  o = {};
  o.hash_bits = 30;
  EXPECT_MENTIONS(input_error_of([&] { o.validate(); }), "hash_bits");
  o = {};
  o.buckets = {256, 1 << 24};  // upper() would overflow int32
  EXPECT_MENTIONS(input_error_of([&] { o.validate(); }), "2^30");
}

TEST(LengthReservation, FromAHandSetDistribution) {
  const LengthBuckets b{4, 10};
  const std::vector<double> d{0.1, 0.2, 0.3, 0.4};  // cumulative 0.1, 0.3, 0.6, 1.0
  EXPECT_EQ(reservation_from(d, b, 0.05), 10);
  EXPECT_EQ(reservation_from(d, b, 0.25), 20);
  EXPECT_EQ(reservation_from(d, b, 0.55), 30);
  EXPECT_EQ(reservation_from(d, b, 0.65), 40);
  EXPECT_EQ(reservation_from(d, b, 1.0), 40);
  // No single bucket reaches 0.75; the first two together do.
  const std::vector<double> flat{0.4, 0.4, 0.2, 0.0};
  EXPECT_EQ(reservation_from(flat, b, 0.75), 20);
  // A total short of 1 by rounding still reserves the last bucket at confidence 1.
  const std::vector<double> short_sum{0.3, 0.3, 0.3, 0.0999999};
  EXPECT_EQ(reservation_from(short_sum, b, 1.0), 40);
  for (double bad : {0.0, -0.5, 1.5, std::nan("")})
    EXPECT_MENTIONS(input_error_of([&] { reservation_from(d, b, bad); }), "confidence");
}

// An empty prompt has exactly two features of value 1 (the bias and length bin 0; the
// numeric length log2(1 + 0) is 0). Starting from zero weights the distribution is uniform,
// g = p - onehot(truth) is 0.1 everywhere but -0.9 at the truth, and AdaGrad's sum becomes
// init + 9 * 0.01 + 0.81 = 0.1 + 0.9 = 1, so each feature moves bucket k's score by
// -lr * g_k / sqrt(1). With lr 0.5 and two features: s_truth = 0.9, s_other = -0.1, and
// p_truth = e^0.9 / (e^0.9 + 9 e^-0.1) = 0.231969, p_other = e^-0.1 / (...) = 0.085337.
TEST(LengthPredictor, FirstUpdateByHand) {
  LengthPredictorOptions o;
  o.learning_rate = 0.5;
  o.l2 = 0;
  o.adagrad_init = 0.1;
  LengthPredictor p(o);
  const LengthQuery empty{};
  for (double v : p.distribution(empty)) EXPECT_DOUBLE_EQ(v, 0.1);
  p.learn(empty, 130);  // bucket 2
  const auto d = p.distribution(empty);
  EXPECT_NEAR(d[2], 0.231969, 1e-6);
  for (size_t k = 0; k < d.size(); ++k) {
    if (k != 2) {
      EXPECT_NEAR(d[k], 0.085337, 1e-6) << k;
    }
  }
  EXPECT_EQ(p.examples_learned(), 1);
  EXPECT_EQ(p.learned_buckets()[2], 1);
}

TEST(LengthPredictor, LearnMovesProbabilityTowardTheTrueBucket) {
  LengthPredictor p;
  const std::vector<int32_t> ids{1, 450, 23, 99, 7};
  const LengthQuery q{ids};
  const auto before = p.distribution(q);
  p.learn(q, 333);  // bucket 6
  const auto after = p.distribution(q);
  EXPECT_GT(after[6], before[6] + 0.02);
  for (size_t k = 0; k < after.size(); ++k)
    if (k != 6) {
      EXPECT_LT(after[k], before[k]) << k;
    }
  EXPECT_EQ(p.predict_bucket(q), 6);
}

// Prompts of random filler (ids 100..999, 5 to 40 of them) with a marker: 7 -> an answer in
// bucket 0 (lengths 1..50), 9 -> bucket 5 (251..300). `share7` of them carry 7.
std::vector<LengthExample> separable(int n, uint32_t seed, double share7 = 0.5) {
  std::mt19937 rng(seed);
  std::vector<LengthExample> out;
  for (int i = 0; i < n; ++i) {
    LengthExample e;
    const bool seven = static_cast<double>(rng() % 1000) < share7 * 1000;
    const auto len = static_cast<size_t>(5 + rng() % 36);
    e.prompt_ids.push_back(1);
    for (size_t k = 0; k < len; ++k)
      e.prompt_ids.push_back(static_cast<int32_t>(100 + rng() % 900));
    e.prompt_ids.insert(e.prompt_ids.begin() + static_cast<ptrdiff_t>(1 + rng() % len),
                        seven ? 7 : 9);
    e.output_len = static_cast<int32_t>(seven ? 1 + rng() % 50 : 251 + rng() % 50);
    out.push_back(std::move(e));
  }
  return out;
}

LengthPredictor trained_separable() {
  LengthPredictorOptions o;
  o.hash_bits = 14;
  o.learning_rate = 2;
  LengthPredictor p(o);
  const auto train = separable(300, 1, 0.6);
  p.train(train, 30);
  return p;
}

TEST(LengthPredictor, LearnsASeparableTaskToFullAccuracy) {
  const LengthPredictor p = trained_separable();
  const auto test = separable(200, 2);
  const LengthEval ev = p.evaluate(test, 0.9);
  EXPECT_EQ(ev.accuracy, 1.0);
  EXPECT_EQ(ev.mean_distance, 0.0);
  for (const LengthExample& e : test) {
    const auto d = p.distribution(e.query());
    EXPECT_GT(d[static_cast<size_t>(p.options().buckets.bucket_of(e.output_len))], 0.9);
  }
}

// The trained predictor says bucket 0 for a 7 and bucket 5 for a 9 (checked), so on these
// four the truths give: right, wrong by 2, right, wrong by 1. Reservations at 0.9 are the
// predicted bucket's upper edge: 50, 50, 300, 300 against lengths 30, 120, 280, 220.
TEST(LengthPredictor, EvaluateByHand) {
  const LengthPredictor p = trained_separable();
  const std::vector<int32_t> with7{1, 300, 7, 400}, with9{1, 500, 9, 600};
  ASSERT_GT(p.distribution({with7})[0], 0.9);
  ASSERT_GT(p.distribution({with9})[5], 0.9);
  const std::vector<LengthExample> set{{with7, 30}, {with7, 120}, {with9, 280}, {with9, 220}};
  const LengthEval ev = p.evaluate(set, 0.9);
  EXPECT_EQ(ev.n, 4);
  EXPECT_DOUBLE_EQ(ev.accuracy, 0.5);
  EXPECT_DOUBLE_EQ(ev.mean_distance_wrong, 1.5);  // (2 + 1) / 2
  EXPECT_DOUBLE_EQ(ev.mean_distance, 0.75);       // (0 + 2 + 0 + 1) / 4
  EXPECT_DOUBLE_EQ(ev.reservation_cover, 0.75);   // 120 > 50
  EXPECT_DOUBLE_EQ(ev.mean_reservation, 175.0);   // (50 + 50 + 300 + 300) / 4
  EXPECT_DOUBLE_EQ(ev.mean_length, 162.5);
  ASSERT_EQ(ev.confusion.size(), 100u);
  EXPECT_EQ(ev.confusion[0 * 10 + 0], 1);  // true 0, said 0
  EXPECT_EQ(ev.confusion[2 * 10 + 0], 1);  // true 2, said 0
  EXPECT_EQ(ev.confusion[5 * 10 + 5], 1);
  EXPECT_EQ(ev.confusion[4 * 10 + 5], 1);
  // Reserved 50 -> bucket 0 (twice, true 0 and 2); reserved 300 -> bucket 5 (true 5 and 4).
  ASSERT_EQ(ev.reservations.size(), 100u);
  EXPECT_EQ(ev.reservations[0 * 10 + 0], 1);
  EXPECT_EQ(ev.reservations[2 * 10 + 0], 1);
  EXPECT_EQ(ev.reservations[5 * 10 + 5], 1);
  EXPECT_EQ(ev.reservations[4 * 10 + 5], 1);
  EXPECT_MENTIONS(ev.json(), "\"reservation_matrix\"");
  // Baselines: 60% of the training rows were bucket 0, so the majority is right once; the
  // prior reaches 0.9 only at bucket 5 (0.6 + 0.4), reserving 300, which covers all four.
  EXPECT_DOUBLE_EQ(ev.majority_accuracy, 0.25);
  EXPECT_DOUBLE_EQ(ev.prior_mean_reservation, 300.0);
  EXPECT_DOUBLE_EQ(ev.prior_reservation_cover, 1.0);
  EXPECT_MENTIONS(ev.json(), "\"accuracy\":0.5");
  EXPECT_MENTIONS(input_error_of([&] { p.evaluate(set, 0); }), "confidence");
}

std::string tmp_file(const std::string& name) {
  return testing::test_tmp_dir("length_predictor") + "/" + name;
}

TEST(LengthPredictor, SaveLoadRoundTripIsExact) {
  LengthPredictor a = trained_separable();
  const std::string path = tmp_file("model.bin");
  a.save(path);
  LengthPredictor b = LengthPredictor::load(path);
  EXPECT_EQ(b.examples_learned(), a.examples_learned());
  EXPECT_EQ(b.learned_buckets(), a.learned_buckets());
  EXPECT_EQ(b.options().str(), a.options().str());
  const auto probe = separable(20, 3);
  for (const LengthExample& e : probe)
    EXPECT_EQ(a.distribution(e.query()), b.distribution(e.query()));
  // The AdaGrad state came along: one more update leaves them equal too.
  a.learn(probe[0].query(), 480);
  b.learn(probe[0].query(), 480);
  for (const LengthExample& e : probe)
    EXPECT_EQ(a.distribution(e.query()), b.distribution(e.query()));
}

std::string bytes_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(LengthPredictor, BadFilesAreRefusedByName) {
  LengthPredictorOptions o;
  o.hash_bits = 6;
  const std::string good = tmp_file("small.bin");
  LengthPredictor(o).save(good);
  const std::string bytes = bytes_of(good);

  const std::string cut = tmp_file("cut.bin");
  write_bytes(cut, bytes.substr(0, bytes.size() - 1));
  std::string e = input_error_of([&] { LengthPredictor::load(cut); });
  EXPECT_MENTIONS(e, cut);
  EXPECT_MENTIONS(e, "truncated");

  write_bytes(cut, bytes.substr(0, 20));
  e = input_error_of([&] { LengthPredictor::load(cut); });
  EXPECT_MENTIONS(e, cut);
  EXPECT_MENTIONS(e, "truncated");

  write_bytes(cut, bytes + "x");
  EXPECT_MENTIONS(input_error_of([&] { LengthPredictor::load(cut); }), "bytes");

  std::string magic = bytes;
  magic[0] = 'X';
  const std::string wrong = tmp_file("wrong_magic.bin");
  write_bytes(wrong, magic);
  e = input_error_of([&] { LengthPredictor::load(wrong); });
  EXPECT_MENTIONS(e, wrong);
  EXPECT_MENTIONS(e, "magic");

  std::string bits = bytes;
  bits[8 + 4 + 8] = 99;  // hash_bits, after magic, version, count, width
  write_bytes(wrong, bits);
  EXPECT_MENTIONS(input_error_of([&] { LengthPredictor::load(wrong); }), "hash_bits");

  EXPECT_MENTIONS(input_error_of([&] { LengthPredictor::load(tmp_file("none.bin")); }),
                  "cannot open");
}

std::string write_jsonl(const std::string& name, const std::string& text) {
  const std::string path = tmp_file(name);
  write_bytes(path, text);
  return path;
}

TEST(LengthExamples, ReadsRowsFieldsAndRanges) {
  ModelConfig c;
  c.vocab = 1000;
  const auto ids = Tokenizer::ids_only(c);  // "1 5 9" -> [1, 5, 9], no BOS added
  const std::string path = write_jsonl("rows.jsonl",
                                       "{\"prompt\": \"1 5 9\", \"output\": \"4 4 4 4\"}\n"
                                       "{\"prompt_ids\": [1, 2], \"output_len\": 7}\n"
                                       "\n"
                                       "{\"question\": \"3\", \"answer\": \"\", \"extra\": 1}\n");
  const auto all = read_length_examples(path, *ids);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].prompt_ids, (std::vector<int32_t>{1, 5, 9}));
  EXPECT_EQ(all[0].output_len, 4);
  EXPECT_EQ(all[1].prompt_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(all[1].output_len, 7);
  EXPECT_EQ(all[2].prompt_ids, (std::vector<int32_t>{3}));
  EXPECT_EQ(all[2].output_len, 0);
  const auto middle = read_length_examples(path, *ids, {}, 1, 1);
  ASSERT_EQ(middle.size(), 1u);
  EXPECT_EQ(middle[0].output_len, 7);
  // The blank line is no row: the third row is the question, and three rows are all.
  const auto last = read_length_examples(path, *ids, {}, 2);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_EQ(last[0].prompt_ids, (std::vector<int32_t>{3}));
  EXPECT_EQ(read_length_examples(path, *ids, {}, 0, 3).size(), 3u);
  EXPECT_TRUE(read_length_examples(path, *ids, {}, 3).empty());
}

TEST(LengthExamples, BadRowsNameFileLineAndField) {
  ModelConfig c;
  c.vocab = 1000;
  const auto ids = Tokenizer::ids_only(c);
  const std::string path = write_jsonl("bad.jsonl",
                                       "{\"prompt\": \"1\", \"output_len\": 3}\n"
                                       "\n"
                                       "{\"prompt\": \"1 2\"}\n");
  std::string e = input_error_of([&] { read_length_examples(path, *ids); });
  EXPECT_MENTIONS(e, path + ":3");
  EXPECT_MENTIONS(e, "output");
  write_jsonl("bad.jsonl", "{\"prompt\": \"1\", \"output_len\": -3}\n");
  e = input_error_of([&] { read_length_examples(path, *ids); });
  EXPECT_MENTIONS(e, path + ":1");
  EXPECT_MENTIONS(e, "'output_len'");
  write_jsonl("bad.jsonl", "{\"prompt\": \"1\", \"output_len\": 3}\nnot json\n");
  EXPECT_MENTIONS(input_error_of([&] { read_length_examples(path, *ids); }), path + ":2");
  write_jsonl("bad.jsonl", "{\"prompt\": \"hello\", \"output_len\": 3}\n");
  e = input_error_of([&] { read_length_examples(path, *ids); });
  EXPECT_MENTIONS(e, path + ":1");
  EXPECT_MENTIONS(e, "'prompt'");
  write_jsonl("bad.jsonl", "{\"prompt\": \"1\", \"output_len\": 3}\n");
  EXPECT_MENTIONS(input_error_of([&] {
                    read_length_examples(path, *ids, {"text", ""});
                  }),
                  "'text'");
}

// stories260K's tokenizer: "Once upon a time" is [1, 403, 407, 261, 378] with BOS (the same
// ids as tests/launch/test_cli.sh's reference), so as an answer it counts 4 tokens.
TEST(LengthExamples, SentencepiecePromptsIncludeBosAnswersDoNot) {
  const std::string dir = STRATA_MODEL_DIR;
  if (!std::filesystem::exists(dir + "/tokenizer.model")) GTEST_SKIP() << "no " << dir;
  ModelConfig c;
  c.vocab = 512;
  const auto tok = Tokenizer::load(dir, c);
  const std::string path = write_jsonl(
      "sp.jsonl", "{\"question\": \"Once upon a time\", \"answer\": \"Once upon a time\"}\n");
  const auto rows = read_length_examples(path, *tok);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].prompt_ids, (std::vector<int32_t>{1, 403, 407, 261, 378}));
  EXPECT_EQ(rows[0].output_len, 4);
}

}  // namespace
}  // namespace strata
