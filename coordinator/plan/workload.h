// Sequence-length distributions for ExeGPT's simulator (§6): P_E(S) over input lengths and
// P_D(S) over output lengths. From the truncated normals of the paper's Table 3 (tasks S, T,
// G, C1, C2), from a JSONL file of real requests (an empirical histogram), or learned online
// from the lengths a run observes. Lengths are in tokens; a distribution is a probability
// mass function over 0..max.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <vector>

namespace strata {

// The standard normal's distribution function.
double normal_cdf(double x);

class LengthDistribution {
 public:
  LengthDistribution() = default;
  // A normal of `mean` and `stddev` discretised to the integers (the mass of [s - 0.5,
  // s + 0.5) goes to s), truncated to [1, max] and renormalised. stddev 0: all at mean.
  static LengthDistribution truncated_normal(double mean, double stddev, int32_t max);
  // The truncated normal whose own mean and standard deviation (after truncation to [1, max])
  // are `mean` and `stddev`: how the paper's Table 3 states its tasks (its 99th-percentile
  // column follows from these, not from a normal of those parameters truncated afterwards).
  static LengthDistribution truncated_normal_with_moments(double mean, double stddev, int32_t max);
  // weights[s] is the (unnormalised) weight of length s; InputError when none is positive or
  // any is negative or not finite.
  static LengthDistribution from_weights(std::vector<double> weights, const std::string& what);
  static LengthDistribution from_samples(std::span<const int32_t> lengths, const std::string& what);
  // Every length scaled by `factor` (rounded, at least 1): a task shrunk to a small model's
  // context keeps its shape.
  LengthDistribution scaled(double factor) const;

  double p(int32_t s) const;  // 0 outside [0, max]
  int32_t max() const { return pmf_.empty() ? 0 : static_cast<int32_t>(pmf_.size()) - 1; }
  double mean() const;
  double stddev() const;
  // The smallest length s whose cumulative probability reaches q (0 < q <= 1).
  int32_t percentile(double q) const;
  bool empty() const { return pmf_.empty(); }
  const std::vector<double>& pmf() const { return pmf_; }
  std::string str() const;  // "mean 32.0, std 13.0, p99 63, max 80"

 private:
  std::vector<double> pmf_;
};

// A task: input and output lengths, uncorrelated (as the simulator assumes, §6).
struct TaskWorkload {
  std::string name;
  LengthDistribution input;
  LengthDistribution output;

  // The paper's Table 3: S (summarization), T (translation), G (code generation), C1 and C2
  // (conversational Q&A): (mean, std, max) of the input and output lengths.
  static const std::vector<std::string>& preset_names();
  static TaskWorkload preset(const std::string& name);
  // "S", "T", "G", "C1", "C2", or a JSONL file of requests (load_jsonl).
  static TaskWorkload parse(const std::string& spec);
  // One request a line. Input and output lengths come from the first pair of fields present:
  // (input_len, output_len), (prompt_tokens, completion_tokens), (prompt_ids, max_new_tokens),
  // (question, answer) or (instruction, output); a number is a length, an array its size, a
  // string counts its whitespace-separated words (a tokenizer-free estimate). Errors name
  // the file and line.
  static TaskWorkload load_jsonl(const std::string& path);
  TaskWorkload scaled(double factor) const;
  std::string str() const;
  nlohmann::json to_json() const;
};

// Lengths a run observes, to learn the distribution online and to notice when it drifts
// from the one a schedule was planned for.
class ObservedLengths {
 public:
  // Keeps the last `window` requests' lengths: what the run sees now.
  explicit ObservedLengths(size_t window = 1000) : window_(window) {}
  void add(int32_t input, int32_t output);
  int64_t count() const { return static_cast<int64_t>(outputs_.size()); }
  TaskWorkload workload(const std::string& name) const;
  // True once at least `min_samples` were seen and the observed outputs differ from
  // `planned`'s by more than `tolerance` (relative) in a way their number can tell: the mean
  // by more than three standard errors too, the 99th percentile only from 300 samples on
  // (fewer have too few lengths above it to place it).
  bool drifted(const TaskWorkload& planned, int64_t min_samples, double tolerance) const;

 private:
  size_t window_;
  std::vector<int32_t> inputs_, outputs_;
};

}  // namespace strata
