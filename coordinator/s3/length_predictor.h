// S3's output-sequence-length predictor (Jin et al., "S3: Increasing GPU Utilization during
// Generative Inference for Higher Throughput", section 3; docs/S3.md): a prompt goes in, a
// probability distribution over output-length buckets comes out, and the scheduler reserves
// KV cache for the upper edge of a bucket. S3 fine-tunes DistilBERT; this is a light
// stand-in with the same interface: multinomial logistic regression (softmax over the
// buckets, L2, AdaGrad) on hashed token-id n-grams and prompt-length features. It reads
// the served model's token ids, never text, because requests may arrive as ids only.
//
// Buckets (S3: "each bucket is allocated the range of max sequence length / number of
// buckets", 10 buckets): bucket b holds output lengths [b*width + 1, (b+1)*width], length 0
// falls in bucket 0, and the last bucket is open-ended (every length >= (count-1)*width + 1).
// The default 10 x 50 tokens is S3's definition for answers of at most 500 tokens.
//
// Held out on GSM8K (10 x 50 tokens) it is right 46.9% of the time against 33.7% for the
// majority bucket, 1.27 buckets off when wrong; at confidence 0.9 its reservations cover
// 96.1% of requests with 12% fewer tokens than a prompt-blind prior (docs/S3.md).
//
// The supervisor retrains it online from each completed request (learn()); nothing here is
// thread-safe, the coordinator calls it from one thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata {

class Tokenizer;

struct LengthBuckets {
  int32_t count = 10;
  int32_t width = 50;  // output tokens per bucket

  // The bucket of an output length (>= 0): 0 and 1..width -> 0, width+1..2*width -> 1, ...,
  // everything past the second-to-last bucket -> count - 1.
  int32_t bucket_of(int32_t output_len) const;
  // Output tokens a caller reserves for `bucket`: its upper edge (b+1)*width, for the open
  // last bucket too (the caller caps it at its own max_new_tokens).
  int32_t upper(int32_t bucket) const;
  // InputError unless count in [2, 256], width in [1, 2^24] and count x width <= 2^30.
  void validate() const;
  std::string str() const;
};

struct LengthQuery {
  std::span<const int32_t> prompt_ids;  // the served model's token ids, BOS included
  int32_t max_new_tokens = 0;           // the request's cap; 0: unknown
};

// One training or evaluation row: a prompt and the length its answer had.
struct LengthExample {
  std::vector<int32_t> prompt_ids;
  int32_t output_len = 0;
  int32_t max_new_tokens = 0;  // 0: unknown
  LengthQuery query() const { return {prompt_ids, max_new_tokens}; }
};

struct LengthPredictorOptions {
  LengthBuckets buckets;
  // Hashed n-gram features: 2^hash_bits of them. 16 keeps the file near 3 MB; 18 and 20 were
  // no more accurate on GSM8K (docs/S3.md, "Tuning").
  int32_t hash_bits = 16;
  int32_t ngram_order = 2;     // 1: unigrams; 2: and bigrams; 3: and trigrams
  double learning_rate = 0.2;  // AdaGrad's base step
  // L2 penalty, applied lazily to the weights an update touches (a dense decay of every
  // weight per update would cost 2^hash_bits x count operations).
  double l2 = 1e-5;
  // AdaGrad's squared-gradient sums start here instead of 0 (TensorFlow's
  // initial_accumulator_value): a feature's first step is lr / sqrt(init), not a full lr, so
  // an n-gram seen once cannot memorise its row. Plain AdaGrad fits the training rows through
  // rare bigrams and generalises worse (docs/S3.md, "Tuning").
  double adagrad_init = 10;
  uint64_t seed = 0;  // train()'s shuffle order

  void validate() const;  // InputError naming the option and its range
  std::string str() const;
};

// The output tokens to reserve for a distribution over `buckets`: the upper edge of the
// first bucket whose cumulative probability reaches `confidence` (in (0, 1]; InputError
// naming it otherwise). If rounding leaves the total short of `confidence`, the last bucket.
int32_t reservation_from(std::span<const double> distribution, const LengthBuckets& buckets,
                         double confidence);

// How well a predictor does on examples it is given (evaluate()).
struct LengthEval {
  int64_t n = 0;
  int32_t buckets = 0;
  double confidence = 0;           // of the reservations below
  double accuracy = 0;             // share whose argmax bucket is the true bucket
  double mean_distance_wrong = 0;  // S3's "average distance between the wrong predictions and
                                   // the correct bucket", in buckets (0 when none is wrong)
  double mean_distance = 0;        // the same over every example
  std::vector<int64_t> confusion;  // buckets x buckets, row = true bucket, column = predicted
  // buckets x buckets, row = true bucket, column = the bucket whose upper edge was reserved
  // at `confidence`: what the simulator's packing model reads (kv_packing.h ReservationModel)
  std::vector<int64_t> reservations;
  double reservation_cover = 0;  // share whose reservation at `confidence` >= the true length
  double mean_reservation = 0;   // output tokens reserved, mean
  double mean_length = 0;        // true output tokens, mean
  // Baselines from what the predictor has learned so far, without the prompt: always the
  // most frequent learned bucket, and the reservation of the learned bucket frequencies.
  double majority_accuracy = 0;
  double prior_reservation_cover = 0;
  double prior_mean_reservation = 0;

  std::string json() const;
  std::string str() const;  // a few lines with the confusion matrix
};

class LengthPredictor {
 public:
  explicit LengthPredictor(const LengthPredictorOptions& options = {});

  const LengthPredictorOptions& options() const { return options_; }
  int64_t examples_learned() const { return examples_learned_; }
  // How often each bucket was the true one among the updates so far.
  const std::vector<int64_t>& learned_buckets() const { return learned_buckets_; }

  // P(bucket | query), `count` values summing to 1.
  std::vector<double> distribution(const LengthQuery& q) const;
  int32_t predict_bucket(const LengthQuery& q) const;  // the argmax (lowest on a tie)
  int32_t reservation(const LengthQuery& q, double confidence) const;

  // One online update (S3's supervisor retraining from a completed request).
  void learn(const LengthQuery& q, int32_t output_len);
  // `epochs` passes over `examples`, each in a fresh order drawn from options.seed.
  void train(std::span<const LengthExample> examples, int32_t epochs);

  LengthEval evaluate(std::span<const LengthExample> examples, double confidence) const;

  // A binary file: magic, version, options, counts, float32 weights and AdaGrad state (so a
  // loaded model learns on exactly as the saved one would). Written to a temporary file and
  // renamed, so a reader never sees half a model. Errors are InputErrors naming the file.
  void save(const std::string& path) const;
  static LengthPredictor load(const std::string& path);

 private:
  struct Feature {
    uint32_t index;
    float value;
  };
  std::vector<Feature> features(const LengthQuery& q) const;
  void add_ngrams(std::span<const int32_t> ids, std::vector<Feature>& x) const;
  static void merge_repeats(std::vector<Feature>& x);
  std::vector<double> scores(const std::vector<Feature>& x) const;
  size_t dims() const;

  LengthPredictorOptions options_;
  std::vector<float> weights_;  // dims() x count, a feature's weights adjacent
  std::vector<float> adagrad_;  // per feature: summed squared gradients
  std::vector<int64_t> learned_buckets_;
  int64_t examples_learned_ = 0;
};

// Which JSON fields hold a row's prompt and output; empty: detected per row.
struct LengthFields {
  std::string prompt;  // text (tokenized) or an array of token ids
  std::string output;  // text (its token count, without BOS) or a number of tokens
};

// Rows [skip, skip + limit) of a JSONL file (blank lines are not rows; limit < 0: all) as
// examples. The prompt is the first of question, instruction, prompt, prompt_ids present;
// the output the first of answer, output, completion, output_len, output_tokens. A prompt
// is tokenized as Tokenizer::encode does (BOS included); an output text counts its tokens
// without BOS. A bad row is an InputError naming the file, the line and the field.
std::vector<LengthExample> read_length_examples(const std::string& path, const Tokenizer& tok,
                                                const LengthFields& fields = {}, int64_t skip = 0,
                                                int64_t limit = -1);

}  // namespace strata
