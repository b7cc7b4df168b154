#include "coordinator/s3/length_predictor.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/error.h"
#include "worker/input_limits.h"
#include "worker/tokenizer.h"

namespace strata {
namespace {

// The dense features after the 2^hash_bits hashed ones: a bias, the prompt length as a
// number, its one-hot length bin, and max_new_tokens' bin when the request gives it.
constexpr int32_t kLengthBinsPerOctave = 2;  // half-octave bins: 64..90, 91..127, ...
constexpr int32_t kLengthBins = 2 + kLengthBinsPerOctave * 20;  // 0, 1, ... past 2^20 shared
constexpr int32_t kMaxNewBins = 2 + 31;                         // log2 bins of an int32
constexpr double kAdagradEpsilon = 1e-8;

// splitmix64's finaliser: every input bit reaches every output bit, so n-gram hashes of
// neighbouring token ids do not collide in the low bits that pick the feature.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

int32_t length_bin(size_t len) {
  if (len == 0) return 0;
  const double b = std::floor(kLengthBinsPerOctave * std::log2(static_cast<double>(len)));
  return static_cast<int32_t>(std::min<double>(1 + b, kLengthBins - 1));
}

int32_t max_new_bin(int32_t max_new) {
  return std::min<int32_t>(std::bit_width(static_cast<uint32_t>(max_new)), kMaxNewBins - 1);
}

void check_confidence(double confidence) {
  if (!(confidence > 0 && confidence <= 1))
    fail_input("confidence must be in (0, 1], got {}", confidence);
}

}  // namespace

// ---- buckets and options ----

int32_t LengthBuckets::bucket_of(int32_t output_len) const {
  STRATA_CHECK(output_len >= 0, "output length {} < 0", output_len);
  if (output_len == 0) return 0;
  return std::min((output_len - 1) / width, count - 1);
}

int32_t LengthBuckets::upper(int32_t bucket) const {
  STRATA_CHECK(bucket >= 0 && bucket < count, "bucket {} outside [0, {})", bucket, count);
  return (bucket + 1) * width;
}

void LengthBuckets::validate() const {
  if (count < 2 || count > 256) fail_input("bucket count must be in [2, 256], got {}", count);
  if (width < 1 || width > (1 << 24))
    fail_input("bucket width must be in [1, 2^24] tokens, got {}", width);
  // upper() of the last bucket must fit an int32.
  if (int64_t{count} * width > (int64_t{1} << 30))
    fail_input("bucket count x width must be at most 2^30 tokens, got {} x {}", count, width);
}

std::string LengthBuckets::str() const {
  return fmt::format("{} buckets of {} tokens (last: >= {})", count, width,
                     (count - 1) * width + 1);
}

void LengthPredictorOptions::validate() const {
  buckets.validate();
  if (hash_bits < 4 || hash_bits > 24)
    fail_input("hash_bits must be in [4, 24], got {}", hash_bits);
  if (ngram_order < 1 || ngram_order > 3)
    fail_input("ngram_order must be 1, 2 or 3, got {}", ngram_order);
  if (!(learning_rate > 0 && learning_rate <= 100))
    fail_input("learning_rate must be in (0, 100], got {}", learning_rate);
  if (!(l2 >= 0 && l2 <= 1)) fail_input("l2 must be in [0, 1], got {}", l2);
  if (!(adagrad_init >= 0 && adagrad_init <= 1e6))
    fail_input("adagrad_init must be in [0, 1e6], got {}", adagrad_init);
}

std::string LengthPredictorOptions::str() const {
  return fmt::format(
      "{}, hash_bits {}, n-grams up to {}, learning_rate {}, l2 {}, adagrad_init {}, seed {}",
      buckets.str(), hash_bits, ngram_order, learning_rate, l2, adagrad_init, seed);
}

int32_t reservation_from(std::span<const double> distribution, const LengthBuckets& buckets,
                         double confidence) {
  check_confidence(confidence);
  STRATA_CHECK(distribution.size() == static_cast<size_t>(buckets.count),
               "distribution of {} values for {} buckets", distribution.size(), buckets.count);
  double cumulative = 0;
  for (int32_t b = 0; b < buckets.count; ++b) {
    cumulative += distribution[static_cast<size_t>(b)];
    if (cumulative >= confidence) return buckets.upper(b);
  }
  return buckets.upper(buckets.count - 1);
}

// ---- the model ----

LengthPredictor::LengthPredictor(const LengthPredictorOptions& options) : options_(options) {
  options_.validate();
  weights_.assign(dims() * static_cast<size_t>(options_.buckets.count), 0.0f);
  adagrad_.assign(dims(), static_cast<float>(options_.adagrad_init));
  learned_buckets_.assign(static_cast<size_t>(options_.buckets.count), 0);
}

size_t LengthPredictor::dims() const {
  return (size_t{1} << options_.hash_bits) + 2 + kLengthBins + kMaxNewBins;
}

// Hashed n-grams, signed so that collisions cancel on average instead of adding up; each
// order scaled to unit norm so a long prompt does not outweigh the length features.
void LengthPredictor::add_ngrams(std::span<const int32_t> ids, std::vector<Feature>& x) const {
  const uint32_t mask = (uint32_t{1} << options_.hash_bits) - 1;
  for (int32_t order = 1; order <= options_.ngram_order; ++order) {
    if (ids.size() < static_cast<size_t>(order)) break;
    const size_t n = ids.size() - static_cast<size_t>(order) + 1;
    const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
    for (size_t i = 0; i < n; ++i) {
      uint64_t h = mix(static_cast<uint64_t>(order));
      for (int32_t k = 0; k < order; ++k)
        h = mix(h ^ static_cast<uint32_t>(ids[i + static_cast<size_t>(k)]));
      x.push_back({static_cast<uint32_t>(h) & mask, (h >> 63) != 0 ? -scale : scale});
    }
  }
}

// Repeated indices (an n-gram twice, a collision) summed, so an update sees each once.
void LengthPredictor::merge_repeats(std::vector<Feature>& x) {
  std::sort(x.begin(), x.end(),
            [](const Feature& a, const Feature& b) { return a.index < b.index; });
  size_t out = 0;
  for (const Feature& f : x) {
    if (out > 0 && x[out - 1].index == f.index) {
      x[out - 1].value += f.value;
    } else {
      x[out++] = f;
    }
  }
  x.resize(out);
}

// The n-grams, then the dense features after the 2^hash_bits hashed ones.
std::vector<LengthPredictor::Feature> LengthPredictor::features(const LengthQuery& q) const {
  std::vector<Feature> x;
  add_ngrams(q.prompt_ids, x);
  const size_t len = q.prompt_ids.size();
  const uint32_t bias = uint32_t{1} << options_.hash_bits, numeric = bias + 1, bins = bias + 2;
  x.push_back({bias, 1.0f});
  x.push_back({numeric, static_cast<float>(std::log2(1.0 + static_cast<double>(len)) / 8)});
  x.push_back({bins + static_cast<uint32_t>(length_bin(len)), 1.0f});
  if (q.max_new_tokens > 0)
    x.push_back({bins + kLengthBins + static_cast<uint32_t>(max_new_bin(q.max_new_tokens)), 1.0f});
  merge_repeats(x);
  return x;
}

std::vector<double> LengthPredictor::scores(const std::vector<Feature>& x) const {
  const size_t c = static_cast<size_t>(options_.buckets.count);
  std::vector<double> s(c, 0.0);
  for (const Feature& f : x) {
    const float* w = &weights_[f.index * c];
    for (size_t k = 0; k < c; ++k) s[k] += static_cast<double>(w[k]) * f.value;
  }
  return s;
}

namespace {
// Softmax, shifted by the largest score so exp() never overflows.
void softmax(std::vector<double>& s) {
  const double top = *std::max_element(s.begin(), s.end());
  double sum = 0;
  for (double& v : s) sum += (v = std::exp(v - top));
  for (double& v : s) v /= sum;
}
}  // namespace

std::vector<double> LengthPredictor::distribution(const LengthQuery& q) const {
  std::vector<double> p = scores(features(q));
  softmax(p);
  return p;
}

int32_t LengthPredictor::predict_bucket(const LengthQuery& q) const {
  const auto p = distribution(q);
  return static_cast<int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
}

int32_t LengthPredictor::reservation(const LengthQuery& q, double confidence) const {
  return reservation_from(distribution(q), options_.buckets, confidence);
}

// One SGD step on the cross-entropy of the true bucket plus L2 on the touched weights, with
// AdaGrad's per-feature step (rare n-grams keep large steps, the bias and length bins that
// every prompt has settle quickly).
void LengthPredictor::learn(const LengthQuery& q, int32_t output_len) {
  const int32_t truth = options_.buckets.bucket_of(output_len);
  const size_t c = static_cast<size_t>(options_.buckets.count);
  const auto x = features(q);
  std::vector<double> g = scores(x);
  softmax(g);
  g[static_cast<size_t>(truth)] -= 1.0;  // d(cross-entropy)/d(score) = p - onehot(truth)
  std::vector<double> grad(c);
  for (const Feature& f : x) {
    float* w = &weights_[f.index * c];
    double norm2 = 0;
    for (size_t k = 0; k < c; ++k) {
      grad[k] = g[k] * f.value + options_.l2 * w[k];
      norm2 += grad[k] * grad[k];
    }
    adagrad_[f.index] += static_cast<float>(norm2);
    const double step = options_.learning_rate / std::sqrt(adagrad_[f.index] + kAdagradEpsilon);
    for (size_t k = 0; k < c; ++k) w[k] -= static_cast<float>(step * grad[k]);
  }
  ++learned_buckets_[static_cast<size_t>(truth)];
  ++examples_learned_;
}

void LengthPredictor::train(std::span<const LengthExample> examples, int32_t epochs) {
  STRATA_CHECK(epochs >= 0, "epochs {} < 0", epochs);
  std::vector<size_t> order(examples.size());
  uint64_t state = mix(options_.seed);
  for (int32_t e = 0; e < epochs; ++e) {
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    // Fisher-Yates with our own generator: std::shuffle's draws differ between libraries.
    for (size_t i = order.size(); i > 1; --i) {
      state = mix(state);
      std::swap(order[i - 1], order[state % i]);
    }
    for (size_t i : order) learn(examples[i].query(), examples[i].output_len);
  }
}

// ---- evaluation ----

LengthEval LengthPredictor::evaluate(std::span<const LengthExample> examples,
                                     double confidence) const {
  check_confidence(confidence);
  const LengthBuckets& bk = options_.buckets;
  LengthEval ev;
  ev.n = static_cast<int64_t>(examples.size());
  ev.buckets = bk.count;
  ev.confidence = confidence;
  ev.confusion.assign(static_cast<size_t>(bk.count) * static_cast<size_t>(bk.count), 0);
  ev.reservations = ev.confusion;
  if (examples.empty()) return ev;

  // The prompt-blind baselines: the learned bucket frequencies (uniform before any).
  std::vector<double> prior(static_cast<size_t>(bk.count), 1.0 / bk.count);
  if (examples_learned_ > 0)
    for (size_t b = 0; b < prior.size(); ++b)
      prior[b] = static_cast<double>(learned_buckets_[b]) / static_cast<double>(examples_learned_);
  const auto majority =
      static_cast<int32_t>(std::max_element(prior.begin(), prior.end()) - prior.begin());
  const int32_t prior_reserve = reservation_from(prior, bk, confidence);

  int64_t right = 0, distance = 0, covered = 0, majority_right = 0, prior_covered = 0;
  double reserved = 0, length = 0;
  for (const LengthExample& e : examples) {
    const auto p = distribution(e.query());
    const auto predicted = static_cast<int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
    const int32_t truth = bk.bucket_of(e.output_len);
    const int32_t d = std::abs(predicted - truth);
    right += d == 0;
    distance += d;  // the right ones add 0, so this is also the wrong ones' sum
    ++ev.confusion[static_cast<size_t>(truth) * static_cast<size_t>(bk.count) +
                   static_cast<size_t>(predicted)];
    const int32_t r = reservation_from(p, bk, confidence);
    ++ev.reservations[static_cast<size_t>(truth) * static_cast<size_t>(bk.count) +
                      static_cast<size_t>(bk.bucket_of(r))];
    covered += r >= e.output_len;
    reserved += r;
    length += e.output_len;
    majority_right += truth == majority;
    prior_covered += prior_reserve >= e.output_len;
  }
  const auto n = static_cast<double>(ev.n);
  ev.accuracy = static_cast<double>(right) / n;
  ev.mean_distance = static_cast<double>(distance) / n;
  ev.mean_distance_wrong =
      right == ev.n ? 0.0 : static_cast<double>(distance) / static_cast<double>(ev.n - right);
  ev.reservation_cover = static_cast<double>(covered) / n;
  ev.mean_reservation = reserved / n;
  ev.mean_length = length / n;
  ev.majority_accuracy = static_cast<double>(majority_right) / n;
  ev.prior_reservation_cover = static_cast<double>(prior_covered) / n;
  ev.prior_mean_reservation = prior_reserve;
  return ev;
}

std::string LengthEval::json() const {
  nlohmann::ordered_json j;
  j["n"] = n;
  j["buckets"] = buckets;
  j["accuracy"] = accuracy;
  j["mean_distance_wrong"] = mean_distance_wrong;
  j["mean_distance"] = mean_distance;
  j["confidence"] = confidence;
  j["reservation_cover"] = reservation_cover;
  j["mean_reservation"] = mean_reservation;
  j["mean_length"] = mean_length;
  j["majority_accuracy"] = majority_accuracy;
  j["prior_reservation_cover"] = prior_reservation_cover;
  j["prior_mean_reservation"] = prior_mean_reservation;
  auto matrix = [&](const std::vector<int64_t>& m) {
    auto rows = nlohmann::ordered_json::array();
    for (int32_t t = 0; t < buckets; ++t)
      rows.push_back(std::vector<int64_t>(m.begin() + t * buckets, m.begin() + (t + 1) * buckets));
    return rows;
  };
  j["confusion"] = matrix(confusion);              // rows: true bucket, columns: predicted
  j["reservation_matrix"] = matrix(reservations);  // columns: the bucket reserved
  return j.dump();
}

std::string LengthEval::str() const {
  std::string s = fmt::format(
      "examples {}\naccuracy {:.2f}% (always the majority learned bucket: {:.2f}%)\n"
      "mean distance in buckets: {:.3f} over wrong predictions, {:.3f} over all\n"
      "reservation at confidence {}: covers {:.2f}% with {:.1f} tokens on average (prompt-blind "
      "prior: {:.2f}% with {:.0f}); true length {:.1f} on average\n"
      "confusion (rows: true bucket, columns: predicted):\n",
      n, 100 * accuracy, 100 * majority_accuracy, mean_distance_wrong, mean_distance, confidence,
      100 * reservation_cover, mean_reservation, 100 * prior_reservation_cover,
      prior_mean_reservation, mean_length);
  for (int32_t t = 0; t < buckets; ++t) {
    s += fmt::format("{:>3}:", t);
    for (int32_t p = 0; p < buckets; ++p)
      s += fmt::format(" {:>5}", confusion[static_cast<size_t>(t * buckets + p)]);
    s += '\n';
  }
  return s;
}

// ---- persistence ----
// Little-endian, in this order: magic "STRLENP\n", u32 version, i32 bucket count, i32 bucket
// width, i32 hash_bits, i32 ngram_order, f64 learning_rate, f64 l2, f64 adagrad_init, u64
// seed, i64 examples learned, i64 x count learned buckets, f32 x dims x count weights, f32 x
// dims AdaGrad sums.
// The dense feature layout is part of the version: changing it means a new version.

namespace {

static_assert(std::endian::native == std::endian::little, "the model file is little-endian");
constexpr char kMagic[8] = {'S', 'T', 'R', 'L', 'E', 'N', 'P', '\n'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 8 + 4 + 4 * 4 + 8 * 3 + 8 + 8;

template <typename T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
void put_all(std::string& out, const std::vector<T>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

struct Reader {
  const std::string& bytes;
  size_t at = 0;
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, bytes.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  template <typename T>
  void get_all(std::vector<T>& v) {
    std::memcpy(v.data(), bytes.data() + at, v.size() * sizeof(T));
    at += v.size() * sizeof(T);
  }
};

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_input("{}: cannot open length predictor: {}", path, std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) fail_input("{}: cannot read length predictor", path);
  return s.str();
}

}  // namespace

void LengthPredictor::save(const std::string& path) const {
  std::string out;
  out.append(kMagic, sizeof(kMagic));
  put(out, kVersion);
  put(out, options_.buckets.count);
  put(out, options_.buckets.width);
  put(out, options_.hash_bits);
  put(out, options_.ngram_order);
  put(out, options_.learning_rate);
  put(out, options_.l2);
  put(out, options_.adagrad_init);
  put(out, options_.seed);
  put(out, examples_learned_);
  put_all(out, learned_buckets_);
  put_all(out, weights_);
  put_all(out, adagrad_);
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) fail_input("{}: cannot write length predictor: {}", tmp, std::strerror(errno));
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    f.close();
    if (!f) fail_input("{}: cannot write length predictor: {}", tmp, std::strerror(errno));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    fail_input("{}: cannot rename {} to it: {}", path, tmp, ec.message());
  }
}

LengthPredictor LengthPredictor::load(const std::string& path) {
  const std::string bytes = read_whole(path);
  if (bytes.size() < kHeaderBytes)
    fail_input("{}: truncated length predictor: {} bytes, the header alone is {}", path,
               bytes.size(), kHeaderBytes);
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    fail_input(
        "{}: not a length predictor (wrong magic; expected a file from strata predict "
        "train)",
        path);
  Reader r{bytes, sizeof(kMagic)};
  const auto version = r.get<uint32_t>();
  if (version != kVersion)
    fail_input("{}: length predictor version {}, this build reads version {}", path, version,
               kVersion);
  LengthPredictorOptions o;
  o.buckets.count = r.get<int32_t>();
  o.buckets.width = r.get<int32_t>();
  o.hash_bits = r.get<int32_t>();
  o.ngram_order = r.get<int32_t>();
  o.learning_rate = r.get<double>();
  o.l2 = r.get<double>();
  o.adagrad_init = r.get<double>();
  o.seed = r.get<uint64_t>();
  try {
    o.validate();
  } catch (const InputError& e) {
    fail_input("{}: bad length predictor header: {}", path, e.what());
  }
  LengthPredictor p(o);
  const size_t expected =
      kHeaderBytes + p.learned_buckets_.size() * 8 + p.weights_.size() * 4 + p.adagrad_.size() * 4;
  if (bytes.size() != expected)
    fail_input("{}: length predictor has {} bytes, its header ({}) needs {}{}", path, bytes.size(),
               o.str(), expected, bytes.size() < expected ? " (truncated)" : "");
  p.examples_learned_ = r.get<int64_t>();
  r.get_all(p.learned_buckets_);
  r.get_all(p.weights_);
  r.get_all(p.adagrad_);
  int64_t total = 0;
  for (int64_t c : p.learned_buckets_) {
    // Each count within [0, learned - total]: the sum cannot overflow.
    if (c < 0 || p.examples_learned_ < 0 || c > p.examples_learned_ - total) {
      total = -1;
      break;
    }
    total += c;
  }
  if (total != p.examples_learned_)
    fail_input(
        "{}: length predictor counts {} examples learned but its bucket counts do not sum "
        "to that",
        path, p.examples_learned_);
  for (size_t i = 0; i < p.weights_.size(); ++i)
    if (!std::isfinite(p.weights_[i]))
      fail_input("{}: length predictor weight {} is {}", path, i, p.weights_[i]);
  for (size_t i = 0; i < p.adagrad_.size(); ++i)
    if (!(p.adagrad_[i] >= 0 && std::isfinite(p.adagrad_[i])))
      fail_input("{}: length predictor AdaGrad sum {} is {}", path, i, p.adagrad_[i]);
  return p;
}

// ---- data ----

namespace {

constexpr const char* kPromptFields[] = {"question", "instruction", "prompt", "prompt_ids"};
constexpr const char* kOutputFields[] = {"answer", "output", "completion", "output_len",
                                         "output_tokens"};

template <size_t N>
std::string pick(const nlohmann::json& row, const std::string& given, const char* const (&names)[N],
                 const char* what, const std::string& where) {
  if (!given.empty()) {
    if (!row.contains(given)) fail_input("{}: no {} field '{}'", where, what, given);
    return given;
  }
  for (const char* name : names)
    if (row.contains(name)) return name;
  fail_input("{}: no {} field (looked for {})", where, what,
             fmt::join(std::begin(names), std::end(names), ", "));
}

std::vector<int32_t> prompt_of(const nlohmann::json& v, const Tokenizer& tok,
                               const std::string& where, const std::string& field) {
  if (v.is_string()) {
    try {
      return tok.encode(v.get<std::string>());
    } catch (const InputError& e) {
      fail_input("{}: field '{}': {}", where, field, e.what());
    }
  }
  if (!v.is_array())
    fail_input("{}: field '{}' must be text or an array of token ids, got {}", where, field,
               v.type_name());
  std::vector<int32_t> ids;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_number_integer() || v[i].get<int64_t>() < 0 || v[i].get<int64_t>() > INT32_MAX)
      fail_input("{}: {}[{}] must be a token id in [0, 2^31), got {}", where, field, i,
                 v[i].dump().substr(0, 40));
    ids.push_back(v[i].get<int32_t>());
  }
  return ids;
}

int32_t output_len_of(const nlohmann::json& v, const Tokenizer& tok, size_t bos,
                      const std::string& where, const std::string& field) {
  if (v.is_string()) {
    try {
      return static_cast<int32_t>(tok.encode(v.get<std::string>()).size() - bos);
    } catch (const InputError& e) {
      fail_input("{}: field '{}': {}", where, field, e.what());
    }
  }
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
    fail_input("{}: field '{}' must be text or a token count in [0, 2^31), got {}", where, field,
               v.dump().substr(0, 40));
  return v.get<int32_t>();
}

}  // namespace

std::vector<LengthExample> read_length_examples(const std::string& path, const Tokenizer& tok,
                                                const LengthFields& fields, int64_t skip,
                                                int64_t limit) {
  const std::string text = read_file_bounded(path, InputLimits::from_env(),
                                             &InputLimits::prompt_file_bytes, "data file");
  // What encode() puts before any text (BOS, or nothing): not part of an answer's length.
  const size_t bos = tok.encode("").size();
  std::vector<LengthExample> out;
  std::istringstream lines(text);
  int64_t line_no = 0, row = -1;
  for (std::string line; std::getline(lines, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (++row < skip) continue;
    if (limit >= 0 && row >= skip + limit) break;
    const std::string where = fmt::format("{}:{}", path, line_no);
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) fail_input("{}: not a JSON object", where);
    const std::string pf = pick(j, fields.prompt, kPromptFields, "prompt", where);
    const std::string of = pick(j, fields.output, kOutputFields, "output", where);
    LengthExample e;
    e.prompt_ids = prompt_of(j[pf], tok, where, pf);
    e.output_len = output_len_of(j[of], tok, bos, where, of);
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace strata
