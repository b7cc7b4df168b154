#include "coordinator/s3/kv_packing.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "coordinator/plan/workload.h"
#include "coordinator/s3/length_predictor.h"
#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {

const char* kv_reserve_name(KvReserve r) {
  switch (r) {
    case KvReserve::kContext:
      return "context";
    case KvReserve::kMaxNew:
      return "max-new";
    case KvReserve::kPredicted:
      return "predicted";
  }
  return "?";
}

KvReserve parse_kv_reserve(const std::string& name) {
  for (KvReserve r : {KvReserve::kContext, KvReserve::kMaxNew, KvReserve::kPredicted})
    if (name == kv_reserve_name(r)) return r;
  fail_input("--kv-reserve '{}' is none of context, max-new, predicted", name);
}

const char* kv_admission_name(KvAdmission a) {
  return a == KvAdmission::kPooled ? "pooled" : "reserved";
}

KvAdmission parse_kv_admission(const std::string& name) {
  for (KvAdmission a : {KvAdmission::kReserved, KvAdmission::kPooled})
    if (name == kv_admission_name(a)) return a;
  fail_input("--kv-admission '{}' is none of reserved, pooled", name);
}

double LengthOutlook::survival(int32_t made, double x) const {
  if (bucket_probs.empty()) return std::max(point, made + 1) > x ? 1.0 : 0.0;
  // Mass above `made` and above x, piece by piece: (lo, hi] uniform, a point where lo == hi.
  auto above = [](double p, double lo, double hi, double at) {
    if (hi <= at) return 0.0;
    return hi > lo ? p * (hi - std::max(lo, at)) / (hi - lo) : p;
  };
  const auto buckets = static_cast<int32_t>(bucket_probs.size());
  double alive = 0, beyond = 0;
  for (int32_t b = 0; b < buckets; ++b) {
    const double hi =
        std::min<double>(cap, b + 1 == buckets ? cap : static_cast<double>(b + 1) * bucket_width);
    const double lo = std::min<double>(cap, static_cast<double>(b) * bucket_width);
    const double p = bucket_probs[static_cast<size_t>(b)];
    alive += above(p, lo, hi, made);
    beyond += above(p, lo, hi, std::max<double>(x, made));
  }
  if (alive <= 1e-12) {
    const double hi = std::max(std::min(cap, 2 * made), made + 1);
    return above(1.0, made, hi, std::max<double>(x, made));
  }
  return beyond / alive;
}

UsageProfile::UsageProfile(int32_t points, int32_t stride_)
    : stride(stride_), mean(static_cast<size_t>(points)), var(static_cast<size_t>(points)) {
  STRATA_CHECK(points > 0 && stride > 0, "a usage profile of {} points {} apart", points, stride);
}

UsageProfile UsageProfile::over_context(int32_t context) {
  constexpr int32_t kPoints = 64;
  return UsageProfile(kPoints, std::max(1, (context + kPoints - 1) / kPoints));
}

void UsageProfile::add(const LengthOutlook& outlook, int32_t made, int64_t next) {
  add_alike(
      1.0, static_cast<double>(next),
      [&](int32_t t) { return outlook.survival(made, made + static_cast<double>(t)); }, false);
  used += next;
}

void UsageProfile::add(const UsageProfile& other) {
  STRATA_CHECK(other.mean.size() == mean.size() && other.stride == stride,
               "usage profiles of {} and {} points", mean.size(), other.mean.size());
  for (size_t k = 0; k < mean.size(); ++k) {
    mean[k] += other.mean[k];
    var[k] += other.var[k];
  }
  used += other.used;
}

double UsageProfile::need(double z) const {
  double most = 0;
  for (size_t k = 0; k < mean.size(); ++k)
    most = std::max(most, mean[k] + z * std::sqrt(std::max(0.0, var[k])));
  return most;
}

double pooled_margin(double confidence) {
  return normal_quantile(std::min(confidence, 1 - 1e-6));
}

double normal_quantile(double p) {
  STRATA_CHECK(p > 0 && p < 1, "a normal quantile of {}", p);
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                                 -2.759285104469687e+02, 1.383577518672690e+02,
                                 -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                                 -1.556989798598866e+02, 6.680131188771972e+01,
                                 -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                                 -2.400758277161838e+00, -2.549732539343734e+00,
                                 4.374664141464968e+00,  2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01,
                                 2.445134137142996e+00, 3.754408661907416e+00};
  constexpr double kLow = 0.02425;
  auto tail = [&](double q) {
    return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  };
  if (p < kLow) return tail(std::sqrt(-2 * std::log(p)));
  if (p > 1 - kLow) return -tail(std::sqrt(-2 * std::log(1 - p)));
  const double q = p - 0.5, r = q * q;
  return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
         (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

ReservationModel ReservationModel::from_eval_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail_input("--predict-eval {}: cannot open the file", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail_input("--predict-eval {}: not JSON ({})", path, e.what());
  }
  const char* field = j.contains("reservation_matrix") ? "reservation_matrix" : "confusion";
  if (!j.is_object() || !j.contains(field) || !j[field].is_array())
    fail_input(
        "--predict-eval {}: no \"reservation_matrix\" (write it with strata predict eval "
        "--json)",
        path);
  const nlohmann::json& rows = j[field];
  ReservationModel m;
  m.reserve = KvReserve::kPredicted;
  m.source = path;
  m.buckets = static_cast<int32_t>(rows.size());
  if (m.buckets < 2 || m.buckets > 256)
    fail_input("--predict-eval {}: \"{}\" has {} rows, need 2 to 256 buckets", path, field,
               m.buckets);
  const auto B = static_cast<size_t>(m.buckets);
  m.reserved_given_true.assign(B * B, 0.0);
  for (size_t t = 0; t < B; ++t) {
    if (!rows[t].is_array() || rows[t].size() != B)
      fail_input("--predict-eval {}: \"{}\" row {} is not {} counts", path, field, t, B);
    double sum = 0;
    for (size_t b = 0; b < B; ++b) {
      if (!rows[t][b].is_number() || rows[t][b].get<double>() < 0)
        fail_input("--predict-eval {}: \"{}\"[{}][{}] is not a count", path, field, t, b);
      sum += rows[t][b].get<double>();
    }
    for (size_t b = 0; b < B; ++b)
      m.reserved_given_true[t * B + b] = sum > 0 ? rows[t][b].get<double>() / sum : b == t;
  }
  return m;
}

std::optional<ReservationModel> reservation_model(const KvPackingOptions& packing,
                                                  const std::string& predict_eval) {
  const KvReserve rule = packing.reserve;
  if (rule != KvReserve::kPredicted && !predict_eval.empty())
    fail_input("--predict-eval needs --kv-reserve predicted (got {})", kv_reserve_name(rule));
  if (rule == KvReserve::kContext) return std::nullopt;
  if (rule == KvReserve::kPredicted && predict_eval.empty())
    fail_input("--kv-reserve predicted needs --predict-eval (strata predict eval --json's file)");
  ReservationModel m = rule == KvReserve::kMaxNew ? ReservationModel{rule, 0, {}, ""}
                                                  : ReservationModel::from_eval_json(predict_eval);
  m.admission = packing.admission;
  m.confidence = packing.confidence;
  return m;
}

std::string ReservationModel::str() const {
  const std::string pooled =
      admission == KvAdmission::kPooled ? fmt::format(", pooled at {}", confidence) : "";
  if (reserve != KvReserve::kPredicted) return kv_reserve_name(reserve) + pooled;
  return fmt::format("predicted ({} buckets, measured in {}){}", buckets, source, pooled);
}

namespace {

// One first reservation's held mean for every D (a running mean over the iterations) and
// whether D outgrows it.
void add_held(double first, double input, int32_t max_d, double capacity, std::vector<double>& held,
              std::vector<double>& exceeded) {
  double reserved = std::min(first, capacity), sum = 0;
  held[0] = reserved;
  for (int32_t d = 1; d <= max_d; ++d) {
    while (input + d > reserved && reserved < capacity) reserved = std::min(capacity, 2 * reserved);
    sum += reserved;
    held[static_cast<size_t>(d)] = sum / d;
    exceeded[static_cast<size_t>(d)] = input + d > std::min(first, capacity) ? 1.0 : 0.0;
  }
}

}  // namespace

std::vector<double> held_positions(const ReservationModel& model, double input,
                                   const LengthDistribution& output, int32_t capacity,
                                   std::vector<double>* exceeded) {
  const int32_t max_d = std::max(output.max() - 1, 0);
  const auto n = static_cast<size_t>(max_d) + 1;
  const auto cap = static_cast<double>(capacity);
  std::vector<double> held(n, 0.0);
  if (exceeded != nullptr) exceeded->assign(n, 0.0);
  switch (model.reserve) {
    case KvReserve::kContext:
      held.assign(n, cap);
      return held;
    case KvReserve::kMaxNew:  // the prompt and exactly the S = D + 1 tokens asked for
      for (size_t d = 0; d < n; ++d) held[d] = std::min(cap, input + static_cast<double>(d) + 1);
      return held;
    case KvReserve::kPredicted:
      break;
  }
  if (model.buckets < 2 ||
      model.reserved_given_true.size() !=
          static_cast<size_t>(model.buckets) * static_cast<size_t>(model.buckets))
    fail_input("the packing model has no reservation matrix ({} buckets)", model.buckets);
  const LengthBuckets bk{model.buckets,
                         std::max(1, (output.max() + model.buckets - 1) / model.buckets)};
  // Each first reservation the matrix gives a true bucket, run once over every D; a D takes
  // the row of its own bucket (S = D + 1).
  const auto B = static_cast<size_t>(model.buckets);
  std::vector<std::vector<double>> by_first(B, std::vector<double>(n, 0.0));
  std::vector<std::vector<double>> exceeded_by(B, std::vector<double>(n, 0.0));
  for (size_t b = 0; b < B; ++b)
    add_held(input + bk.upper(static_cast<int32_t>(b)), input, max_d, cap, by_first[b],
             exceeded_by[b]);
  for (size_t d = 0; d < n; ++d) {
    const auto t = static_cast<size_t>(bk.bucket_of(static_cast<int32_t>(d) + 1));
    for (size_t b = 0; b < B; ++b) {
      const double p = model.reserved_given_true[t * B + b];
      held[d] += p * by_first[b][d];
      if (exceeded != nullptr) (*exceeded)[d] += p * exceeded_by[b][d];
    }
  }
  return held;
}

UsageProfile pooled_usage(KvReserve rule, double input, const LengthDistribution& output,
                          const LengthDistribution& held, double members, double prefill_only,
                          int32_t context) {
  STRATA_CHECK(rule != KvReserve::kContext, "the context rule packs nothing to profile");
  UsageProfile profile = UsageProfile::over_context(context);
  const int32_t max_d = held.max();
  // T(j) for j = 0 .. max_d + 1 (T(0) unused), and P(S > x) for x = 0 .. output.max().
  std::vector<double> made(static_cast<size_t>(max_d) + 2, 0.0);
  for (int32_t j = max_d; j >= 1; --j)
    made[static_cast<size_t>(j)] = made[static_cast<size_t>(j) + 1] + held.p(j) / j;
  std::vector<double> longer(static_cast<size_t>(output.max()) + 1, 0.0);
  for (int32_t x = output.max() - 1; x >= 0; --x)
    longer[static_cast<size_t>(x)] = longer[static_cast<size_t>(x) + 1] + output.p(x + 1);
  auto tail = [](const std::vector<double>& v, int32_t x) {
    return x < static_cast<int32_t>(v.size()) ? v[static_cast<size_t>(x)] : 0.0;
  };
  const bool known = rule == KvReserve::kMaxNew;
  for (int32_t j = 1; j <= max_d; ++j) {
    const double share = made[static_cast<size_t>(j)];
    if (share <= 0) continue;
    const double from = known ? share : tail(longer, j);
    if (from <= 0) continue;
    profile.add_alike(
        members * share, input + j,
        [&](int32_t t) { return tail(known ? made : longer, j + t) / from; }, known);
  }
  if (prefill_only > 0) {  // S = 1: known, alive at point 0 only; predicted, P(S > t)
    const double from = tail(longer, 0);
    profile.add_alike(
        prefill_only, input + 1,
        [&](int32_t t) { return known ? (t == 0 ? 1.0 : 0.0) : tail(longer, t) / from; }, known);
  }
  return profile;
}

void KvPackingOptions::validate() const {
  if (budget < 0) fail_input("--kv-budget must not be negative, got {}", budget);
  if (budget == 1)
    fail_input("--kv-budget 1 holds fewer than 2 KV positions (a prompt and a token)");
  if (!(confidence > 0.0 && confidence <= 1.0))
    fail_input("--predict-confidence must be in (0, 1], got {}", confidence);
  if (budget_from_schedule) return;  // sized once the schedule is chosen
  if (budget == 0 && reserve != KvReserve::kContext)
    fail_input("--kv-reserve {} needs a --kv-budget to pack into", kv_reserve_name(reserve));
  if (budget == 0 && admission != KvAdmission::kReserved)
    fail_input("--kv-admission {} needs a --kv-budget to pack into", kv_admission_name(admission));
}

std::string KvPackingOptions::str() const {
  if (budget == 0) return "KvPacking(off: one whole slot per sequence)";
  return fmt::format("KvPacking(budget {} positions, {} admission, reserve {}{}{})", budget,
                     kv_admission_name(admission), kv_reserve_name(reserve),
                     reserve == KvReserve::kPredicted
                         ? fmt::format(" at confidence {}, predictor {}{}", confidence,
                                       predictor_path.empty() ? "(untrained)" : predictor_path,
                                       learn ? ", learning online" : "")
                         : "",
                     length_hint ? "" : ", max_new_tokens not a length hint");
}

namespace {

// First-fit decreasing over items ordered by `sizes`, the bin's rule in `take` (true: the
// item fits and is now in the bin).
template <class Take>
std::vector<size_t> ffd(std::span<const int64_t> sizes, size_t max_items,
                        std::optional<size_t> first, Take&& take) {
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  std::vector<size_t> chosen;
  if (first) {
    STRATA_CHECK(*first < sizes.size(), "first item {} of {}", *first, sizes.size());
    if (max_items == 0 || !take(*first)) return chosen;
    chosen.push_back(*first);
  }
  for (size_t i : order) {
    if (chosen.size() >= max_items) break;
    if ((first && i == *first) || !take(i)) continue;
    chosen.push_back(i);
  }
  return chosen;
}

}  // namespace

std::vector<size_t> first_fit_decreasing(std::span<const int64_t> sizes, int64_t capacity,
                                         size_t max_items, std::optional<size_t> first) {
  return ffd(sizes, max_items, first, [&](size_t i) {
    if (sizes[i] > capacity) return false;
    capacity -= sizes[i];
    return true;
  });
}

std::vector<size_t> pooled_first_fit_decreasing(std::span<const int64_t> sizes,
                                                std::span<const UsageProfile> items,
                                                UsageProfile load, double z, int64_t capacity,
                                                size_t max_items, std::optional<size_t> first) {
  STRATA_CHECK(sizes.size() == items.size(), "{} sizes for {} items", sizes.size(), items.size());
  bool empty = load.used == 0;
  return ffd(sizes, max_items, first, [&](size_t i) {
    UsageProfile with = load;
    with.add(items[i]);
    // Point 0 is the positions filled at once, exactly: they always bind.
    if (!empty && with.need(z) > static_cast<double>(capacity)) return false;
    load = std::move(with);
    empty = false;
    return true;
  });
}

double PackingCounters::mean_decode_batch() const {
  return decode_steps > 0 ? static_cast<double>(decode_rows) / static_cast<double>(decode_steps)
                          : 0.0;
}

std::string PackingCounters::json() const {
  nlohmann::json j{{"admitted", admitted},
                   {"preemptions", preemptions},
                   {"preempted_sequences", preempted_seqs},
                   {"extensions", extensions},
                   {"recomputed_tokens", recomputed_tokens},
                   {"decode_steps", decode_steps},
                   {"mean_decode_batch", mean_decode_batch()},
                   {"mean_reserved_positions",
                    decode_steps > 0 ? static_cast<double>(reserved_sum) / decode_steps : 0.0},
                   {"mean_used_positions",
                    decode_steps > 0 ? static_cast<double>(used_sum) / decode_steps : 0.0}};
  return j.dump();
}

double PredictionStats::accuracy() const {
  return predicted > 0 ? static_cast<double>(correct) / static_cast<double>(predicted) : 0.0;
}

double PredictionStats::mean_distance_wrong() const {
  const int64_t wrong = predicted - correct;
  return wrong > 0 ? static_cast<double>(distance_wrong) / static_cast<double>(wrong) : 0.0;
}

std::string PredictionStats::json() const {
  return nlohmann::json{{"predicted", predicted},
                        {"accuracy", accuracy()},
                        {"mean_distance_wrong", mean_distance_wrong()},
                        {"under_reserved", under_reserved},
                        {"learned", learned}}
      .dump();
}

KvReserver::KvReserver(const KvPackingOptions& options, int32_t context)
    : options_(options), context_(context) {
  options_.validate();
  if (options_.reserve != KvReserve::kPredicted) return;
  const std::string& path = options_.predictor_path;
  if (!path.empty() && std::filesystem::exists(path)) {
    predictor_ = std::make_unique<LengthPredictor>(LengthPredictor::load(path));
    log::get("coordinator")
        ->info("length predictor {}: {} ({} examples learned)", path, predictor_->options().str(),
               predictor_->examples_learned());
  } else {
    LengthPredictorOptions po;
    po.buckets = LengthBuckets{options_.buckets, options_.bucket_width};
    po.validate();
    predictor_ = std::make_unique<LengthPredictor>(po);
    log::get("coordinator")
        ->warn("length predictor: {}; starting untrained ({}), learning online",
               path.empty() ? "no --predictor file" : "no file " + path,
               predictor_->options().str());
  }
}

KvReserver::~KvReserver() = default;

int32_t KvReserver::reserve(const GenerationRequest& r) {
  const auto prompt = static_cast<int32_t>(r.prompt_ids.size());
  switch (options_.reserve) {
    case KvReserve::kContext:
      return context_;
    case KvReserve::kMaxNew:  // never past the context (a chat's default is "until the end")
      return static_cast<int32_t>(
          std::min<int64_t>(int64_t{prompt} + r.max_new_tokens, int64_t{context_}));
    case KvReserve::kPredicted:
      break;
  }
  const int32_t hint = options_.length_hint ? r.max_new_tokens : 0;
  const LengthQuery q{r.prompt_ids, hint};
  const int32_t tokens = predictor_->reservation(q, options_.confidence);
  pending_[r.id] = Pending{predictor_->predict_bucket(q), hint, tokens};
  return prompt + tokens;
}

LengthOutlook KvReserver::outlook(const GenerationRequest& r) const {
  LengthOutlook o;
  const auto prompt = static_cast<int32_t>(r.prompt_ids.size());
  o.cap = std::max(0, context_ - prompt);
  if (options_.length_hint || options_.reserve == KvReserve::kMaxNew)
    o.cap = std::min(o.cap, r.max_new_tokens);
  switch (options_.reserve) {
    case KvReserve::kContext:
      o.point = std::max(0, context_ - prompt);
      return o;
    case KvReserve::kMaxNew:
      o.point = o.cap;
      return o;
    case KvReserve::kPredicted:
      break;
  }
  const int32_t hint = options_.length_hint ? r.max_new_tokens : 0;
  o.bucket_width = predictor_->options().buckets.width;
  o.bucket_probs = predictor_->distribution(LengthQuery{r.prompt_ids, hint});
  return o;
}

void KvReserver::finished(const GenerationResult& result) {
  auto it = pending_.find(result.id);
  if (it == pending_.end()) return;
  const Pending p = it->second;
  pending_.erase(it);
  if (result.stop_reason == StopReason::kError) return;
  const auto produced = static_cast<int32_t>(result.output_ids.size());
  const int32_t truth = predictor_->options().buckets.bucket_of(produced);
  ++stats_.predicted;
  if (truth == p.bucket) {
    ++stats_.correct;
  } else {
    stats_.distance_wrong += std::abs(truth - p.bucket);
  }
  if (produced > p.reserved_tokens) ++stats_.under_reserved;
  if (!options_.learn) return;
  predictor_->learn(LengthQuery{result.prompt_ids, p.max_new_tokens}, produced);
  ++stats_.learned;
}

void KvReserver::save() const {
  if (predictor_ == nullptr || !options_.learn || options_.predictor_path.empty()) return;
  predictor_->save(options_.predictor_path);
  log::get("coordinator")
      ->info("length predictor saved to {} ({} examples learned)", options_.predictor_path,
             predictor_->examples_learned());
}

PackingStats KvReserver::report(const PackingCounters& counters) const {
  PackingStats p{options_.budget,
                 kv_reserve_name(options_.reserve),
                 kv_admission_name(options_.admission),
                 counters,
                 {}};
  if (predictor_) p.prediction = stats_;
  return p;
}

std::string PackingStats::json() const {
  return fmt::format(R"({{"budget": {}, "reserve": "{}", "admission": "{}", "counters": {}{}}})",
                     budget, reserve, admission, counters.json(),
                     prediction ? ", \"prediction\": " + prediction->json() : std::string());
}

std::string PackingStats::table() const {
  const PackingCounters& c = counters;
  std::string out = fmt::format(
      "  S3 packing: budget {} positions, reserve {}, {} admission; mean decode batch {:.1f}, {} "
      "admissions, {} preemptions ({} sequences, {} positions recomputed), {} grown in place\n",
      budget, reserve, admission, c.mean_decode_batch(), c.admitted, c.preemptions,
      c.preempted_seqs, c.recomputed_tokens, c.extensions);
  if (prediction)
    out += fmt::format(
        "  length predictor: {:.1f}% of {} in the right bucket, wrong ones {:.2f} buckets off, "
        "{} longer than reserved, {} learned online\n",
        100 * prediction->accuracy(), prediction->predicted, prediction->mean_distance_wrong(),
        prediction->under_reserved, prediction->learned);
  return out;
}

}  // namespace strata
