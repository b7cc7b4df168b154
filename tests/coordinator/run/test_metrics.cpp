// The Prometheus exposition (coordinator/run/metrics.h) against hand-computed text: cumulative
// buckets with inclusive upper bounds, label escaping, nearest-rank latency percentiles,
// and the counters a request's end moves.
#include <gtest/gtest.h>

#include "coordinator/run/coordinator.h"
#include "coordinator/run/metrics.h"

namespace strata {
namespace {

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

TEST(Histogram, CumulativeBucketsWithInclusiveBounds) {
  Histogram h({2.0, 1.0});  // given out of order: sorted
  for (double v : {0.5, 1.0, 1.5, 3.0}) h.observe(v);
  std::string out;
  h.render(out, "x_seconds", "help text");
  // By hand: <= 1: {0.5, 1.0}; <= 2: + 1.5; +Inf: + 3.0; sum 6.
  EXPECT_EQ(out,
            "# HELP x_seconds help text\n# TYPE x_seconds histogram\n"
            "x_seconds_bucket{le=\"1\"} 2\n"
            "x_seconds_bucket{le=\"2\"} 3\n"
            "x_seconds_bucket{le=\"+Inf\"} 4\n"
            "x_seconds_sum 6\n"
            "x_seconds_count 4\n");
}

TEST(Histogram, VllmBuckets) {
  // vLLM's (vllm/engine/metrics.py): 22 for time to first token, 19 inter-token, 21 latency.
  EXPECT_EQ(ttft_buckets().size(), 22u);
  EXPECT_EQ(ttft_buckets().front(), 0.001);
  EXPECT_EQ(ttft_buckets().back(), 2560.0);
  EXPECT_EQ(inter_token_buckets().size(), 19u);
  EXPECT_EQ(inter_token_buckets().back(), 80.0);
  EXPECT_EQ(request_latency_buckets().size(), 21u);
  EXPECT_EQ(request_latency_buckets().front(), 0.3);
  EXPECT_EQ(request_latency_buckets().back(), 7680.0);
}

TEST(PrometheusLabel, EscapesQuoteBackslashNewline) {
  EXPECT_EQ(prometheus_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

TEST(ServeMetrics, RequestEndsMoveTheirCounters) {
  ServeMetrics m;
  m.set_kv_slots(4);
  m.request_queued(5);
  m.request_queued(7);
  GenerationResult ok{"a", {1, 2, 3, 4, 5}, {9, 9, 9}, StopReason::kLength, {}};
  ok.times = RequestTimes{0.25, 0.5, 2.0};
  m.request_ended(ok, false);
  GenerationResult eos{"b", {1}, {9}, StopReason::kEos, {}};
  eos.times = RequestTimes{0.1, 0.3, 0.3};
  m.request_ended(eos, false);
  m.request_ended(GenerationResult{"c", {1}, {}, StopReason::kError, "bad"}, false);
  m.request_ended(GenerationResult{"d", {1}, {9, 9}, StopReason::kError, "stopped"}, true);
  m.token_gap(0.02);
  m.set_load(3, 2);
  m.set_schedule({{"policy", "RRA"}, {"micro_batches", "2"}});
  const std::string text = m.render();
  EXPECT_TRUE(has_line(text, "strata_prompt_tokens_total 12")) << text;
  EXPECT_TRUE(has_line(text, "strata_generation_tokens_total 6")) << text;  // 3 + 1 + 0 + 2
  EXPECT_TRUE(has_line(text, "strata_request_success_total{finished_reason=\"length\"} 1"));
  EXPECT_TRUE(has_line(text, "strata_request_success_total{finished_reason=\"eos\"} 1"));
  EXPECT_TRUE(has_line(text, "strata_request_success_total{finished_reason=\"stop\"} 0"));
  EXPECT_TRUE(has_line(text, "strata_request_failure_total{reason=\"refused\"} 1"));
  EXPECT_TRUE(has_line(text, "strata_request_failure_total{reason=\"unfinished\"} 1"));
  // Latencies of the finished requests only: TTFT 0.5 and 0.3, end to end 2.0 and 0.3.
  EXPECT_TRUE(has_line(text, "strata_time_to_first_token_seconds_sum 0.8"));
  EXPECT_TRUE(has_line(text, "strata_time_to_first_token_seconds_count 2"));
  EXPECT_TRUE(has_line(text, "strata_e2e_request_latency_seconds_bucket{le=\"0.3\"} 1"));
  EXPECT_TRUE(has_line(text, "strata_e2e_request_latency_seconds_bucket{le=\"1.5\"} 1"));
  EXPECT_TRUE(has_line(text, "strata_e2e_request_latency_seconds_bucket{le=\"2\"} 2"));
  EXPECT_TRUE(has_line(text, "strata_request_queue_time_seconds_sum 0.35"));
  EXPECT_TRUE(has_line(text, "strata_inter_token_latency_seconds_bucket{le=\"0.01\"} 0"));
  EXPECT_TRUE(has_line(text, "strata_inter_token_latency_seconds_bucket{le=\"0.025\"} 1"));
  EXPECT_TRUE(has_line(text, "strata_num_requests_running 3"));
  EXPECT_TRUE(has_line(text, "strata_num_requests_waiting 2"));
  EXPECT_TRUE(has_line(text, "strata_kv_cache_usage_perc 0.75"));  // 3 running of 4 slots
  EXPECT_TRUE(has_line(text, "strata_schedule_info{micro_batches=\"2\",policy=\"RRA\"} 1"));
  EXPECT_TRUE(has_line(text, "strata_run_finished 0"));
  m.set_finished();
  EXPECT_TRUE(has_line(m.render(), "strata_run_finished 1"));
}

TEST(ServeMetrics, StagesBusyAndBubble) {
  ServeMetrics m;
  StageStats s;
  s.steps = 10;
  s.busy_seconds = 3;
  s.idle_seconds = 1;
  s.window_seconds = 4;
  s.bytes_from_disk = 4096;
  StagePlan stage;
  stage.rank = 2;
  stage.layer_begin = 3;
  stage.layer_end = 5;
  m.set_stages({StageReport{stage, s}});
  const std::string text = m.render();
  EXPECT_TRUE(has_line(text, "strata_stage_busy_fraction{rank=\"2\",layers=\"3-5\"} 0.75")) << text;
  EXPECT_TRUE(has_line(text, "strata_stage_bubble_fraction{rank=\"2\",layers=\"3-5\"} 0.25"));
  EXPECT_TRUE(has_line(text, "strata_stage_steps_total{rank=\"2\",layers=\"3-5\"} 10"));
  EXPECT_TRUE(has_line(
      text, "strata_stage_bytes_moved_total{rank=\"2\",layers=\"3-5\",tier=\"disk\"} 4096"));
  EXPECT_TRUE(
      has_line(text, "strata_stage_bytes_moved_total{rank=\"2\",layers=\"3-5\",tier=\"cpu\"} 0"));
}

// S3's numbers: 3 of 4 predictions right, the wrong one 2 buckets off; 30 sequences over
// 10 decode steps.
TEST(ServeMetrics, PackingPreemptionsAndPredictorAccuracy) {
  ServeMetrics m;
  EXPECT_FALSE(has_line(m.render(), "strata_kv_preemptions_total 0"));  // no budget: absent
  PackingCounters c;
  c.preemptions = 5;
  c.recomputed_tokens = 240;
  c.extensions = 7;
  c.decode_steps = 10;
  c.decode_rows = 30;
  PredictionStats p;
  p.predicted = 4;
  p.correct = 3;
  p.distance_wrong = 2;
  m.set_packing(PackingStats{4096, "predicted", "reserved", c, p});
  const std::string text = m.render();
  EXPECT_TRUE(has_line(text, "strata_kv_budget_positions 4096")) << text;
  EXPECT_TRUE(has_line(text, "strata_kv_preemptions_total 5"));
  EXPECT_TRUE(has_line(text, "strata_kv_recomputed_tokens_total 240"));
  EXPECT_TRUE(has_line(text, "strata_kv_reservation_extensions_total 7"));
  EXPECT_TRUE(has_line(text, "strata_decode_batch_mean 3"));
  EXPECT_TRUE(has_line(text, "strata_length_prediction_accuracy 0.75"));
  EXPECT_TRUE(has_line(text, "strata_length_prediction_distance_wrong 2"));
}

// Pie's counters (a run with Pie on the KV cache): absent without it; as the swap stats say.
TEST(ServeMetrics, PieSwapsAndStalls) {
  ServeMetrics m;
  EXPECT_EQ(m.render().find("strata_pie_"), std::string::npos);
  KvSwapStats s;
  s.host_layers = 2;
  s.expansion = 1.6666667;
  s.swap_ins = 118;
  s.swap_outs = 119;
  s.early_swap_ins = 24;
  s.bytes_in = 845824;
  s.bytes_out = 852992;
  s.stall_seconds = 0.25;
  s.adjustments = 3;
  s.steps = 24;
  m.set_pie(s);
  const std::string text = m.render();
  EXPECT_TRUE(has_line(text, "strata_pie_host_layers 2")) << text;
  EXPECT_TRUE(has_line(text, "# TYPE strata_pie_expansion gauge"));
  EXPECT_NE(text.find("\nstrata_pie_expansion 1.666"), std::string::npos);
  EXPECT_TRUE(has_line(text, "# TYPE strata_pie_swap_ins_total counter"));
  EXPECT_TRUE(has_line(text, "strata_pie_swap_ins_total 118"));
  EXPECT_TRUE(has_line(text, "strata_pie_swap_outs_total 119"));
  EXPECT_TRUE(has_line(text, "strata_pie_early_swap_ins_total 24"));
  EXPECT_TRUE(has_line(text, "strata_pie_bytes_total{direction=\"in\"} 845824"));
  EXPECT_TRUE(has_line(text, "strata_pie_bytes_total{direction=\"out\"} 852992"));
  EXPECT_TRUE(has_line(text, "strata_pie_stall_seconds_total 0.25"));
  EXPECT_TRUE(has_line(text, "strata_pie_adjustments_total 3"));
  EXPECT_TRUE(has_line(text, "strata_pie_steps_total 24"));
}

TEST(LatencySummary, NearestRankPercentiles) {
  // 1..10 shuffled: mean 5.5; nearest rank: p50 = the 5th value, p90 the 9th, p99 the 10th.
  const LatencySummary s = LatencySummary::of({7, 3, 10, 1, 9, 2, 8, 4, 6, 5});
  EXPECT_EQ(s.count, 10);
  EXPECT_DOUBLE_EQ(s.mean, 5.5);
  EXPECT_EQ(s.p50, 5);
  EXPECT_EQ(s.p90, 9);
  EXPECT_EQ(s.p99, 10);
  EXPECT_EQ(s.max, 10);
  const LatencySummary one = LatencySummary::of({0.25});
  EXPECT_EQ(one.p50, 0.25);
  EXPECT_EQ(one.p99, 0.25);
  EXPECT_EQ(LatencySummary::of({}).count, 0);
}

}  // namespace
}  // namespace strata
