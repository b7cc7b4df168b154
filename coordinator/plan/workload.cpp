#include "coordinator/plan/workload.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "kernels/error.h"
#include "worker/input_limits.h"

namespace strata {
double normal_cdf(double x) {
  return 0.5 * std::erfc(-x / std::sqrt(2.0));
}

namespace {

// Table 3 of the paper: input (mean, std, max), output (mean, std, max).
struct Preset {
  const char* name;
  double in_mean, in_std;
  int32_t in_max;
  double out_mean, out_std;
  int32_t out_max;
};
constexpr Preset kPresets[] = {
    {"S", 256, 252, 512, 32, 13, 80},      {"T", 128, 81, 256, 128, 68, 320},
    {"G", 64, 23, 128, 192, 93, 480},      {"C1", 256, 115, 512, 64, 30, 160},
    {"C2", 512, 252, 1024, 256, 134, 640},
};

// A row of Table 3 as a distribution. Its (mean, std) are the truncated distribution's own
// (its p99 column follows from them); a few input rows give a std no distribution truncated
// to [1, max] reaches (S's 252 on [1, 512]: a uniform has 148), and those are taken as the
// normal's parameters, truncated afterwards.
LengthDistribution table3_lengths(double mean, double stddev, int32_t max) {
  try {
    return LengthDistribution::truncated_normal_with_moments(mean, stddev, max);
  } catch (const InputError&) {
    return LengthDistribution::truncated_normal(mean, stddev, max);
  }
}

// A field's length: a number, an array's size, or a string's word count.
std::optional<int64_t> field_length(const nlohmann::json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) return v.get<int64_t>();
  if (v.is_number_float()) return static_cast<int64_t>(std::llround(v.get<double>()));
  if (v.is_array()) return static_cast<int64_t>(v.size());
  if (v.is_string()) {
    std::istringstream in(v.get<std::string>());
    int64_t words = 0;
    for (std::string w; in >> w;) ++words;
    return words;
  }
  return std::nullopt;
}

}  // namespace

LengthDistribution LengthDistribution::truncated_normal(double mean, double stddev, int32_t max) {
  if (!(max >= 1) || !std::isfinite(mean) || !(stddev >= 0) || !std::isfinite(stddev))
    fail_input("truncated normal: mean {}, std {}, max {}: need a finite mean, std >= 0, max >= 1",
               mean, stddev, max);
  std::vector<double> w(static_cast<size_t>(max) + 1, 0.0);
  if (stddev == 0) {
    w[static_cast<size_t>(std::clamp<int64_t>(std::llround(mean), 1, max))] = 1;
  } else {
    for (int32_t s = 1; s <= max; ++s)
      w[static_cast<size_t>(s)] =
          normal_cdf((s + 0.5 - mean) / stddev) - normal_cdf((s - 0.5 - mean) / stddev);
  }
  return from_weights(std::move(w), "truncated normal");
}

LengthDistribution LengthDistribution::truncated_normal_with_moments(double mean, double stddev,
                                                                     int32_t max) {
  if (!(mean >= 1 && mean <= max) || !(stddev > 0))
    fail_input("truncated normal: mean {} must lie in [1, max {}] and std {} be positive", mean,
               max, stddev);
  // Truncation pulls the mean towards the middle and narrows the spread: move the normal's
  // parameters until the truncated moments are the wanted ones (a fixed point; it converges
  // for the shapes of Table 3 within a few dozen steps).
  double mu = mean, sigma = stddev;
  for (int it = 0; it < 500; ++it) {
    const LengthDistribution d = truncated_normal(mu, sigma, max);
    const double dm = mean - d.mean(), ds = stddev - d.stddev();
    if (std::abs(dm) < 1e-7 && std::abs(ds) < 1e-7) return d;
    mu += 0.8 * dm;
    sigma = std::max(sigma + 0.8 * ds, 1e-3);
  }
  fail_input("no normal truncated to [1, {}] has mean {} and std {}", max, mean, stddev);
}

LengthDistribution LengthDistribution::from_weights(std::vector<double> weights,
                                                    const std::string& what) {
  double total = 0;
  for (size_t s = 0; s < weights.size(); ++s) {
    if (!(weights[s] >= 0) || !std::isfinite(weights[s]))
      fail_input("{}: weight {} of length {} is not a finite non-negative number", what, weights[s],
                 s);
    total += weights[s];
  }
  if (!(total > 0)) fail_input("{}: no length has a positive weight", what);
  while (!weights.empty() && weights.back() == 0) weights.pop_back();
  LengthDistribution d;
  d.pmf_ = std::move(weights);
  for (double& p : d.pmf_) p /= total;
  return d;
}

LengthDistribution LengthDistribution::from_samples(std::span<const int32_t> lengths,
                                                    const std::string& what) {
  if (lengths.empty()) fail_input("{}: no lengths", what);
  std::vector<double> w;
  for (int32_t s : lengths) {
    if (s < 0) fail_input("{}: negative length {}", what, s);
    if (static_cast<size_t>(s) >= w.size()) w.resize(static_cast<size_t>(s) + 1, 0.0);
    w[static_cast<size_t>(s)] += 1;
  }
  return from_weights(std::move(w), what);
}

LengthDistribution LengthDistribution::scaled(double factor) const {
  if (!(factor > 0) || !std::isfinite(factor))
    fail_input("length scale {} is not a positive number", factor);
  std::vector<double> w;
  for (size_t s = 0; s < pmf_.size(); ++s) {
    if (pmf_[s] == 0) continue;
    const auto t =
        static_cast<size_t>(std::max<int64_t>(1, std::llround(static_cast<double>(s) * factor)));
    if (t >= w.size()) w.resize(t + 1, 0.0);
    w[t] += pmf_[s];
  }
  return from_weights(std::move(w), "scaled lengths");
}

double LengthDistribution::p(int32_t s) const {
  return s < 0 || s > max() ? 0.0 : pmf_[static_cast<size_t>(s)];
}

double LengthDistribution::mean() const {
  double m = 0;
  for (size_t s = 0; s < pmf_.size(); ++s) m += static_cast<double>(s) * pmf_[s];
  return m;
}

double LengthDistribution::stddev() const {
  const double m = mean();
  double v = 0;
  for (size_t s = 0; s < pmf_.size(); ++s)
    v += pmf_[s] * (static_cast<double>(s) - m) * (static_cast<double>(s) - m);
  return std::sqrt(v);
}

int32_t LengthDistribution::percentile(double q) const {
  STRATA_CHECK(q > 0 && q <= 1, "percentile {}", q);
  STRATA_CHECK(!pmf_.empty(), "percentile of an empty distribution");
  double c = 0;
  for (size_t s = 0; s < pmf_.size(); ++s) {
    c += pmf_[s];
    if (c >= q - 1e-12) return static_cast<int32_t>(s);
  }
  return max();
}

std::string LengthDistribution::str() const {
  if (pmf_.empty()) return "(empty)";
  return fmt::format("mean {:.1f}, std {:.1f}, p99 {}, max {}", mean(), stddev(), percentile(0.99),
                     max());
}

const std::vector<std::string>& TaskWorkload::preset_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const Preset& p : kPresets) n.emplace_back(p.name);
    return n;
  }();
  return names;
}

TaskWorkload TaskWorkload::preset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name != p.name) continue;
    return TaskWorkload{name, table3_lengths(p.in_mean, p.in_std, p.in_max),
                        table3_lengths(p.out_mean, p.out_std, p.out_max)};
  }
  fail_input("--workload {}: not a task of the paper's Table 3 ({}) nor a file", name,
             fmt::join(preset_names(), ", "));
}

TaskWorkload TaskWorkload::parse(const std::string& spec) {
  const auto& names = preset_names();
  if (std::find(names.begin(), names.end(), spec) != names.end()) return preset(spec);
  if (spec.find('/') != std::string::npos || spec.find('.') != std::string::npos)
    return load_jsonl(spec);
  return preset(spec);  // the error lists the tasks
}

TaskWorkload TaskWorkload::load_jsonl(const std::string& path) {
  static constexpr const char* kPairs[][2] = {{"input_len", "output_len"},
                                              {"prompt_tokens", "completion_tokens"},
                                              {"prompt_ids", "max_new_tokens"},
                                              {"question", "answer"},
                                              {"instruction", "output"}};
  const std::string text =
      read_file_bounded(path, InputLimits{}, &InputLimits::prompt_file_bytes, "workload file");
  std::vector<int32_t> in, out;
  std::istringstream lines(text);
  int64_t line_no = 0;
  for (std::string line; std::getline(lines, line);) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) fail_input("{}:{}: not a JSON object", path, line_no);
    bool found = false;
    for (const auto& pair : kPairs) {
      if (!j.contains(pair[0]) || !j.contains(pair[1])) continue;
      const auto a = field_length(j[pair[0]]), b = field_length(j[pair[1]]);
      if (!a || !b || *a < 0 || *b < 0 || *a > INT32_MAX || *b > INT32_MAX)
        fail_input("{}:{}: fields '{}' and '{}' are not lengths", path, line_no, pair[0], pair[1]);
      in.push_back(static_cast<int32_t>(*a));
      out.push_back(static_cast<int32_t>(std::max<int64_t>(*b, 1)));
      found = true;
      break;
    }
    if (!found)
      fail_input(
          "{}:{}: no input/output length fields (input_len/output_len, "
          "prompt_tokens/completion_tokens, prompt_ids/max_new_tokens, question/answer, "
          "instruction/output)",
          path, line_no);
  }
  if (in.empty()) fail_input("{}: no requests", path);
  return TaskWorkload{path, LengthDistribution::from_samples(in, path + " (inputs)"),
                      LengthDistribution::from_samples(out, path + " (outputs)")};
}

TaskWorkload TaskWorkload::scaled(double factor) const {
  if (factor == 1.0) return *this;
  return TaskWorkload{fmt::format("{} x{}", name, factor), input.scaled(factor),
                      output.scaled(factor)};
}

std::string TaskWorkload::str() const {
  return fmt::format("{}: input {}; output {}", name, input.str(), output.str());
}

nlohmann::json TaskWorkload::to_json() const {
  auto dist = [](const LengthDistribution& d) {
    return nlohmann::json{
        {"mean", d.mean()}, {"std", d.stddev()}, {"p99", d.percentile(0.99)}, {"max", d.max()}};
  };
  return {{"name", name}, {"input", dist(input)}, {"output", dist(output)}};
}

void ObservedLengths::add(int32_t input, int32_t output) {
  inputs_.push_back(std::max(input, 0));
  outputs_.push_back(std::max(output, 1));
  if (outputs_.size() > window_) {
    inputs_.erase(inputs_.begin());
    outputs_.erase(outputs_.begin());
  }
}

TaskWorkload ObservedLengths::workload(const std::string& name) const {
  return TaskWorkload{name, LengthDistribution::from_samples(inputs_, name + " (inputs)"),
                      LengthDistribution::from_samples(outputs_, name + " (outputs)")};
}

bool ObservedLengths::drifted(const TaskWorkload& planned, int64_t min_samples,
                              double tolerance) const {
  if (count() < std::max<int64_t>(min_samples, 1)) return false;
  const LengthDistribution seen = LengthDistribution::from_samples(outputs_, "observed outputs");
  const double n = static_cast<double>(count());
  const double mean = planned.output.mean();
  const double error = planned.output.stddev() / std::sqrt(n);
  const double off = std::abs(seen.mean() - mean);
  if (off > tolerance * std::max(mean, 1.0) && off > 3 * error) return true;
  constexpr int64_t kTail = 300;
  if (count() < kTail) return false;
  const double p99 = planned.output.percentile(0.99);
  return std::abs(seen.percentile(0.99) - p99) > tolerance * std::max(p99, 1.0);
}

}  // namespace strata
