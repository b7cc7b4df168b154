// strata plan's ExeGPT mode (--workload): options and the run (launch/plan_schedule.cpp).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "kernels/dtype.h"

namespace strata::cli {

struct ScheduleCliOptions {
  std::string workload;  // empty: FlexGen's policy search instead
  double length_scale = 1.0;
  std::string latency_bound = "inf";
  int32_t nodes = 1;
  // --nodes FILE rather than a count: the cluster plan serve starts with on those nodes
  // (launch/plan.cpp), which reads --max-batch and --stage-mem as serve does.
  std::string node_file;
  std::string profile;
  int32_t max_batch = 0;  // 0: not given (the largest B_E: 256; with a node file: 32 KV slots)
  int32_t max_encode_batch() const { return max_batch > 0 ? max_batch : 256; }
  std::string stage_mem;  // a size (parse_size); empty: the node's memory
  bool exhaustive = false;
  bool rra_only = false;
  bool paper_bounds = false;
  // S3 (issue 16): plan again with RRA's KV memory packed by this rule, beside the plan
  // without; `predict_eval` is `strata predict eval --json`'s output for "predicted".
  std::string kv_reserve = "context";
  std::string predict_eval;
  // How the run would fit them (serve's --kv-admission, --predict-confidence).
  std::string kv_admission = "reserved";
  double confidence = 0.9;
};

// What plan's other options say.
struct ScheduleCliInputs {
  std::string model;
  DType dtype = DType::kF16;
  std::string hardware;  // a node: preset name or JSON (empty: this machine)
  std::string policy;
  bool host_compute = false;
  int32_t max_step_tokens = 512;
  std::string format = "text";
};

void add_schedule_options(CLI::App* cmd, ScheduleCliOptions& o);
// Seconds, or inf.
double parse_latency_bound(const std::string& text);
// Exit code 1 when the bound cannot be met (after printing the fastest latency).
int run_schedule_plan(const ScheduleCliInputs& in, const ScheduleCliOptions& o);

}  // namespace strata::cli
