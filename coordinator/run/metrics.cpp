#include "coordinator/run/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace strata {
namespace {

// Numbers as Prometheus parses them (Go's ParseFloat): shortest exact form, +Inf.
std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  return fmt::format("{}", v);
}

void family(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void sample(std::string& out, const std::string& name, const std::string& labels, double v) {
  out += labels.empty() ? fmt::format("{} {}\n", name, number(v))
                        : fmt::format("{}{{{}}} {}\n", name, labels, number(v));
}

void gauge(std::string& out, const std::string& name, const std::string& help, double v) {
  family(out, name, "gauge", help);
  sample(out, name, "", v);
}

void counter(std::string& out, const std::string& name, const std::string& help, double v) {
  family(out, name, "counter", help);
  sample(out, name, "", v);
}

// A counter family with one label; every value of `fixed` shows, 0 until it happens, so a
// rate() over the series works from the first scrape.
void labelled_counter(std::string& out, const std::string& name, const std::string& help,
                      const char* label, const std::vector<std::string>& fixed,
                      const std::map<std::string, int64_t>& values) {
  family(out, name, "counter", help);
  std::map<std::string, int64_t> all = values;
  for (const std::string& f : fixed) all.emplace(f, 0);
  for (const auto& [key, v] : all)
    sample(out, name, fmt::format("{}=\"{}\"", label, prometheus_label(key)),
           static_cast<double>(v));
}

std::string stage_labels(const StageReport& s) {
  return fmt::format("rank=\"{}\",layers=\"{}-{}\"", s.rank(), s.stage.layer_begin,
                     s.stage.layer_end);
}

// A gauge per stage: `seconds` of it over its window (first step to now), at most 1.
void stage_fraction(std::string& out, const std::vector<StageReport>& stages,
                    const std::string& name, const std::string& help,
                    double (*seconds)(const StageStats&)) {
  family(out, name, "gauge", help);
  for (const StageReport& s : stages) {
    const double window = s.stats.window_seconds;
    sample(out, name, stage_labels(s), window > 0 ? std::min(1.0, seconds(s.stats) / window) : 0);
  }
}

void render_stages(std::string& out, const std::vector<StageReport>& stages) {
  stage_fraction(out, stages, "strata_stage_busy_fraction",
                 "Fraction of the stage's time since its first step spent computing and sending",
                 [](const StageStats& s) { return s.busy_seconds; });
  stage_fraction(
      out, stages, "strata_stage_bubble_fraction",
      "Fraction of the stage's time since its first step spent idle (the pipeline bubble)",
      [](const StageStats& s) { return s.idle_seconds; });
  family(out, "strata_stage_steps_total", "counter", "Steps the stage computed");
  for (const StageReport& s : stages)
    sample(out, "strata_stage_steps_total", stage_labels(s), static_cast<double>(s.stats.steps));
  family(out, "strata_stage_bytes_moved_total", "counter",
         "Weight bytes the stage moved to its compute device, by the tier they came from");
  for (const StageReport& s : stages) {
    sample(out, "strata_stage_bytes_moved_total", stage_labels(s) + ",tier=\"cpu\"",
           static_cast<double>(s.stats.bytes_from_cpu));
    sample(out, "strata_stage_bytes_moved_total", stage_labels(s) + ",tier=\"disk\"",
           static_cast<double>(s.stats.bytes_from_disk));
  }
}

}  // namespace

std::string prometheus_label(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  std::sort(bounds_.begin(), bounds_.end());
}

void Histogram::observe(double value) {
  // Prometheus' buckets are upper bounds, inclusive: le="0.5" counts 0.5.
  const auto at = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[static_cast<size_t>(at)];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  family(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    cumulative += counts_[i];
    const double le = i < bounds_.size() ? bounds_[i] : INFINITY;
    sample(out, name + "_bucket", fmt::format("le=\"{}\"", number(le)),
           static_cast<double>(cumulative));
  }
  sample(out, name + "_sum", "", sum_);
  sample(out, name + "_count", "", static_cast<double>(count_));
}

const std::vector<double>& ttft_buckets() {
  static const std::vector<double> b{0.001, 0.005, 0.01, 0.02, 0.04, 0.06,  0.08, 0.1,
                                     0.25,  0.5,   0.75, 1.0,  2.5,  5.0,   7.5,  10.0,
                                     20.0,  40.0,  80.0, 160., 640., 2560.0};
  return b;
}

const std::vector<double>& inter_token_buckets() {
  static const std::vector<double> b{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                     0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
  return b;
}

const std::vector<double>& request_latency_buckets() {
  static const std::vector<double> b{0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,
                                     5.0,  10.0, 15.0, 20.0, 30.0,  40.0,  50.0,
                                     60.0, 120., 240., 480., 960.0, 1920., 7680.0};
  return b;
}

ServeMetrics::ServeMetrics()
    : ttft_(ttft_buckets()),
      inter_token_(inter_token_buckets()),
      e2e_(request_latency_buckets()),
      queue_(request_latency_buckets()) {}

void ServeMetrics::set_schedule(std::map<std::string, std::string> labels) {
  std::lock_guard lock(mu_);
  schedule_ = std::move(labels);
}

void ServeMetrics::set_packing(const PackingStats& packing) {
  std::lock_guard lock(mu_);
  packing_ = packing;
}

// Called with mu_ held.
void ServeMetrics::render_packing(std::string& out) const {
  const PackingCounters& c = packing_->counters;
  const std::optional<PredictionStats>& prediction = packing_->prediction;
  gauge(out, "strata_kv_budget_positions", "S3: KV positions the running sequences may reserve",
        static_cast<double>(packing_->budget));
  counter(out, "strata_kv_preemptions_total",
          "S3: sequences preempted at their reservation (cache dropped, recomputed later)",
          static_cast<double>(c.preemptions));
  counter(out, "strata_kv_recomputed_tokens_total",
          "S3: positions prefilled again after preemptions (their cost)",
          static_cast<double>(c.recomputed_tokens));
  counter(out, "strata_kv_reservation_extensions_total",
          "S3: reservations doubled in place while the budget had room",
          static_cast<double>(c.extensions));
  gauge(out, "strata_decode_batch_mean", "Sequences per decode step, averaged over the run",
        c.mean_decode_batch());
  if (!prediction) return;
  counter(out, "strata_length_predictions_total",
          "S3: finished requests scored against the "
          "predictor's bucket",
          static_cast<double>(prediction->predicted));
  gauge(out, "strata_length_prediction_accuracy",
        "S3: share of finished requests whose output fell in the predicted bucket",
        prediction->accuracy());
  gauge(out, "strata_length_prediction_distance_wrong",
        "S3: mean buckets between a wrong prediction and the true bucket",
        prediction->mean_distance_wrong());
}

void ServeMetrics::set_pie(const KvSwapStats& pie) {
  std::lock_guard lock(mu_);
  pie_ = pie;
}

// Called with mu_ held.
void ServeMetrics::render_pie(std::string& out) const {
  const KvSwapStats& p = *pie_;
  gauge(out, "strata_pie_host_layers", "Pie: KV-cache layers kept in host memory now (m)",
        p.host_layers);
  gauge(out, "strata_pie_expansion", "Pie: the device's KV memory expansion now, n / (n - m)",
        p.expansion);
  counter(out, "strata_pie_swap_ins_total", "Pie: KV-cache layers swapped in to the device",
          static_cast<double>(p.swap_ins));
  counter(out, "strata_pie_swap_outs_total", "Pie: KV-cache layers swapped out to the host",
          static_cast<double>(p.swap_outs));
  counter(out, "strata_pie_early_swap_ins_total",
          "Pie: swap-ins of the next step's layers (section 3.4.2's rule violations)",
          static_cast<double>(p.early_swap_ins));
  family(out, "strata_pie_bytes_total", "counter",
         "Pie: KV-cache bytes swapped, by direction (in: host to device)");
  sample(out, "strata_pie_bytes_total", "direction=\"in\"", static_cast<double>(p.bytes_in));
  sample(out, "strata_pie_bytes_total", "direction=\"out\"", static_cast<double>(p.bytes_out));
  counter(out, "strata_pie_stall_seconds_total",
          "Pie: seconds compute waited for a layer's swap-in", p.stall_seconds);
  counter(out, "strata_pie_adjustments_total", "Pie: changes of m by the adaptive controller",
          static_cast<double>(p.adjustments));
  counter(out, "strata_pie_steps_total", "Pie: steps run over the swapped cache",
          static_cast<double>(p.steps));
}

void ServeMetrics::set_kv_slots(int32_t slots) {
  std::lock_guard lock(mu_);
  kv_slots_ = slots;
}

void ServeMetrics::request_queued(int64_t prompt_tokens) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += prompt_tokens;
}

void ServeMetrics::step_sent(bool prefill) {
  std::lock_guard lock(mu_);
  ++(prefill ? prefill_steps_ : decode_steps_);
}

void ServeMetrics::token_gap(double seconds) {
  std::lock_guard lock(mu_);
  inter_token_.observe(seconds);
}

void ServeMetrics::request_ended(const GenerationResult& r, bool unfinished) {
  std::lock_guard lock(mu_);
  generation_tokens_ += static_cast<int64_t>(r.output_ids.size());
  if (r.stop_reason == StopReason::kError) {
    ++failure_[unfinished ? "unfinished" : "refused"];
    return;
  }
  ++success_[stop_reason_name(r.stop_reason)];
  if (r.times.first_token_s >= 0) ttft_.observe(r.times.first_token_s);
  if (r.times.total_s >= 0) e2e_.observe(r.times.total_s);
  if (r.times.queue_wait_s >= 0) queue_.observe(r.times.queue_wait_s);
}

void ServeMetrics::set_load(int64_t running, int64_t waiting) {
  std::lock_guard lock(mu_);
  running_ = running;
  waiting_ = waiting;
}

void ServeMetrics::set_stages(std::vector<StageReport> stages) {
  std::lock_guard lock(mu_);
  stages_ = std::move(stages);
}

void ServeMetrics::set_finished() {
  std::lock_guard lock(mu_);
  finished_ = true;
}

std::string ServeMetrics::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  ttft_.render(out, "strata_time_to_first_token_seconds",
               "Seconds from a request's arrival in the queue to its first token");
  inter_token_.render(out, "strata_inter_token_latency_seconds",
                      "Seconds between two consecutive tokens of a sequence");
  e2e_.render(out, "strata_e2e_request_latency_seconds",
              "Seconds from a request's arrival in the queue to its result");
  queue_.render(out, "strata_request_queue_time_seconds",
                "Seconds a request waited from its arrival to its prefill");
  gauge(out, "strata_num_requests_running", "Requests admitted to the cluster and not ended",
        static_cast<double>(running_));
  gauge(out, "strata_num_requests_waiting", "Requests taken from the source, waiting for a slot",
        static_cast<double>(waiting_));
  gauge(out, "strata_kv_cache_usage_perc",
        "Fraction of the KV cache's sequence slots in use (0 to 1)",
        kv_slots_ > 0 ? std::min(1.0, static_cast<double>(running_) / kv_slots_) : 0.0);
  counter(out, "strata_prompt_tokens_total", "Prompt tokens of the requests admitted",
          static_cast<double>(prompt_tokens_));
  counter(out, "strata_generation_tokens_total", "Tokens generated, counted as requests end",
          static_cast<double>(generation_tokens_));
  labelled_counter(out, "strata_request_success_total", "Requests finished, by why they ended",
                   "finished_reason", {"eos", "length", "stop"}, success_);
  labelled_counter(out, "strata_request_failure_total",
                   "Requests ended with an error: refused (the request was at fault) or "
                   "unfinished (the run stopped or failed first)",
                   "reason", {"refused", "unfinished"}, failure_);
  family(out, "strata_steps_total", "counter", "Steps sent to the pipeline, by phase");
  sample(out, "strata_steps_total", "phase=\"prefill\"", static_cast<double>(prefill_steps_));
  sample(out, "strata_steps_total", "phase=\"decode\"", static_cast<double>(decode_steps_));
  render_stages(out, stages_);
  if (packing_) render_packing(out);
  if (pie_) render_pie(out);
  family(out, "strata_schedule_info", "gauge", "The schedule in force, as labels");
  std::string labels;
  for (const auto& [k, v] : schedule_)
    labels += fmt::format("{}{}=\"{}\"", labels.empty() ? "" : ",", k, prometheus_label(v));
  sample(out, "strata_schedule_info", labels, 1);
  gauge(out, "strata_run_finished", "1 once the run has ended and these numbers are final",
        finished_ ? 1 : 0);
  return out;
}

}  // namespace strata
