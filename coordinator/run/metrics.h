// A serve run's live numbers for Prometheus (`strata serve --metrics-port`, docs/METRICS.md),
// rendered in the text exposition format 0.0.4. The names follow what vLLM and
// TensorRT-LLM share (time to first token, inter-token latency, end-to-end latency and
// queue time histograms with vLLM's buckets; running / waiting gauges; prompt and
// generation token counters; KV cache usage), prefixed `strata_`. The coordinator writes,
// the HTTP thread reads: every call takes one lock, and nothing here blocks on I/O.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "coordinator/intake/request.h"
#include "coordinator/plan/stages.h"
#include "coordinator/s3/kv_packing.h"
#include "worker/kv_swap.h"

namespace strata {

// A cumulative histogram over fixed upper bounds (plus +Inf), as Prometheus has it.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }
  // `name`_bucket{le=...}, _sum and _count lines, with TYPE and HELP.
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;    // ascending
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// vLLM's buckets (vllm/engine/metrics.py), so dashboards built for it read these as well.
const std::vector<double>& ttft_buckets();
const std::vector<double>& inter_token_buckets();
const std::vector<double>& request_latency_buckets();  // end-to-end and queue time

class ServeMetrics {
 public:
  ServeMetrics();

  // The schedule in force, as labels of strata_schedule_info (policy, micro-batches, ...).
  void set_schedule(std::map<std::string, std::string> labels);
  void set_kv_slots(int32_t slots);
  // A request passed validation and waits for a prefill; `prompt_tokens` of it.
  void request_queued(int64_t prompt_tokens);
  void step_sent(bool prefill);
  // Seconds since the sequence's previous token (the inter-token latency of one token).
  void token_gap(double seconds);
  // A request ended with a result (finished, refused or unfinished): its latencies and
  // tokens. `unfinished`: the run stopped or failed before it finished.
  void request_ended(const GenerationResult& result, bool unfinished);
  void set_load(int64_t running, int64_t waiting);
  void set_stages(std::vector<StageReport> stages);  // their statistics so far
  void set_finished();                               // the run is over: the numbers are final
  // S3's packing so far (a run with --kv-budget): preemptions and what they cost, the
  // predictor's accuracy.
  void set_packing(const PackingStats& packing);
  // Pie's swapping so far (a run with Pie on the KV cache): strata_pie_*.
  void set_pie(const KvSwapStats& pie);

  // The whole exposition, ready for GET /metrics.
  std::string render() const;

 private:
  void render_packing(std::string& out) const;
  void render_pie(std::string& out) const;

  mutable std::mutex mu_;
  std::map<std::string, std::string> schedule_;
  int32_t kv_slots_ = 0;
  int64_t running_ = 0, waiting_ = 0;
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  int64_t prefill_steps_ = 0, decode_steps_ = 0;
  std::map<std::string, int64_t> success_;  // by finished reason
  std::map<std::string, int64_t> failure_;  // refused / unfinished
  Histogram ttft_, inter_token_, e2e_, queue_;
  std::vector<StageReport> stages_;
  std::optional<PackingStats> packing_;
  std::optional<KvSwapStats> pie_;
  bool finished_ = false;
};

// A label value as the text format wants it: backslash, quote and newline escaped.
std::string prometheus_label(const std::string& value);

}  // namespace strata
