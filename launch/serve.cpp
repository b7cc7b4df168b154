// strata serve: requests from a JSONL file, results to another, on one process or on a
// cluster under mpirun (rank 0 coordinates, ranks 1..N-1 are pipeline stages; see
// docs/CLUSTER.md). Every rank runs this same command line.
#include <cstdio>
#include <fstream>

#include "coordinator/coordinator.h"
#include "coordinator/intake.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "launch/engine.h"
#include "transport/mpi_session.h"
#include "worker/dummy.h"
#include "worker/stage_worker.h"

namespace strata::cli {
namespace {

struct ServeOptions {
  EngineOptions engine;
  std::string requests;
  std::string results;
  std::string stats_out;
  int micro_batches = 1;
  int decode_iters = 8;
  int max_context = 0;
  std::string stage_mem;
  double heartbeat_interval = 1.0;
  double heartbeat_timeout = 30.0;
  double load_timeout = 300.0;
  double step_timeout = 60.0;
  int debug_kill_rank = -1;
  int debug_kill_after_steps = 1;
  double debug_step_delay = 0;
};

void write_stats(const std::string& path, const std::string& json) {
  if (path.empty()) return;
  std::ofstream out(path);
  out << json << "\n";
  if (!out) fail_input("cannot write --stats-out file '{}'", path);
}

// One rank: the single-process generator over every request.
int serve_single(const ServeOptions& o) {
  Engine e = make_engine(o.engine);
  JsonlRequestSource source(o.requests);
  JsonlResultSink sink(o.results, *e.tokenizer);
  std::vector<GenerationRequest> requests;
  int64_t refused = 0;
  for (IncomingRequest& r : source.poll(SIZE_MAX)) {
    tokenize(r, *e.tokenizer);
    if (r.error.empty()) {
      requests.push_back(std::move(r.request));
      continue;
    }
    ++refused;
    sink.write(
        GenerationResult{r.request.id, r.request.prompt_ids, {}, StopReason::kError, r.error});
  }
  if (o.max_context > 0) e.generator.max_context = o.max_context;
  Generator gen(*e.model, e.generator);
  GenerationStats stats;
  for (const GenerationResult& r : gen.run(requests, &stats)) {
    refused += r.stop_reason == StopReason::kError ? 1 : 0;
    sink.write(r);
  }
  const std::string json = fmt::format(
      R"({{"model": "{}", "ranks": 1, "requests": {}, "errors": {}, "generated_tokens": {}, )"
      R"("tokens_per_s": {:.3f}, "generator": {}}})",
      o.engine.model, source.size(), refused, stats.generated_tokens, stats.generation_throughput(),
      stats.json());
  std::fprintf(stderr, "%s\n", json.c_str());
  write_stats(o.stats_out, json);
  return 0;
}

int serve_coordinator(const ServeOptions& o, const Communicator& world) {
  const ModelConfig config =
      load_plan_config(o.engine.model, parse_dtype(o.engine.dtype).value_or(DType::kF32));
  const std::unique_ptr<Tokenizer> tokenizer = is_dummy_model(o.engine.model)
                                                   ? Tokenizer::ids_only(config)
                                                   : Tokenizer::load(o.engine.model, config);
  JsonlRequestSource source(o.requests);
  JsonlResultSink sink(o.results, *tokenizer);
  CoordinatorOptions c;
  c.model_spec = o.engine.model;
  c.micro_batches = o.micro_batches;
  c.decode_iters = o.decode_iters;
  // A policy's block (gbs x ngb) is the batch, as in the single-process engine.
  const int block = policy_block_size(o.engine.policy);
  c.kv_slots = block > 0 ? block : o.engine.max_batch;
  c.max_step_tokens = o.engine.max_step_tokens;
  c.max_context = o.max_context;
  c.stage_mem = o.stage_mem.empty() ? -1 : parse_size(o.stage_mem, "--stage-mem");
  c.heartbeat_interval_s = o.heartbeat_interval;
  c.heartbeat_timeout_s = o.heartbeat_timeout;
  c.load_timeout_s = o.load_timeout;
  c.step_timeout_s = o.step_timeout;
  const ClusterStats stats = run_coordinator(world, c, config, *tokenizer, source, sink);
  std::fprintf(stderr, "%s", stats.table().c_str());
  std::fprintf(stderr, "%s\n", (R"({"summary": )" + stats.json() + "}").c_str());
  write_stats(o.stats_out, stats.json());
  return 0;
}

// A pipeline stage: the engine's compute setup (device, weight tiers, cache placement,
// block) for its own layers; `local_index` (its place among the workers on its host)
// picks its GPU under --device auto.
int serve_worker(const ServeOptions& o, const MpiSession& session, int local_index) {
  const Communicator& world = session.world();
  ComputeSetup c = make_compute(o.engine, local_index);
  log::set_identity(session.rank(), c.device >= 0 ? fmt::format("cuda:{}", c.device) : "cpu");
  StageWorkerOptions w;
  w.stage.load = c.load;
  w.stage.cache = c.cache;
  w.stage.gpu_batch_size = c.gpu_batch_size;
  w.device = c.device;
  w.plan_timeout_s = o.load_timeout;
  w.idle_timeout_s = std::max(o.step_timeout, 10 * o.heartbeat_interval);
  w.step_timeout_s = o.step_timeout;
  w.debug_step_delay_s = o.debug_step_delay;
  if (world.rank() == o.debug_kill_rank) w.debug_exit_after_steps = o.debug_kill_after_steps;
  const int rc = run_stage_worker(world, *c.backend, w);
  // MPI_Finalize would wait for a lost rank; a step that never ended still uses the backend.
  if (rc == kStageLostPeer) session.abort(1);
  return rc;
}

int run_serve(const ServeOptions& o) {
  MpiSession session(nullptr, nullptr);
  log::set_identity(session.rank(), "cpu");
  if (session.size() == 1) return serve_single(o);
  log::get("launch")->info("{}", session.str());
  const int local_index =
      host_local_index(session.world(), 1, Deadline::after_seconds(o.load_timeout));
  try {
    if (session.rank() != 0) return serve_worker(o, session, local_index);
    return serve_coordinator(o, session.world());
  } catch (const std::exception& e) {
    // End the whole job with this rank's status and message. Rank 0 told the workers to
    // stop; a worker that cannot start (no such device, a bad policy) would leave rank 0
    // waiting in the plan's collectives. Under `--mca orte_abort_on_non_zero_status 0`
    // (launch/*.sh) mpirun would otherwise exit 0, and after a lost rank MPI_Finalize would
    // wait for it forever.
    log::get("launch")->error("rank {} ends the job", session.rank());
    session.abort(report_error(e));
  }
}

}  // namespace

Command add_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "serve", "Serve requests from a JSONL file: one process, or a cluster under mpirun");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--requests", o->requests, "JSONL file, one request per line")->required();
  cmd->add_option("--results", o->results, "JSONL file the results are written to")->required();
  cmd->add_option("--stats-out", o->stats_out, "Write the run's statistics (JSON) to this file");
  cmd->add_option("--micro-batches", o->micro_batches,
                  "Micro-batches in flight through the pipeline")
      ->check(positive());
  cmd->add_option("--decode-iters", o->decode_iters,
                  "Decode iterations between prefill phases (ExeGPT's N_D)")
      ->check(positive());
  cmd->add_option("--max-context", o->max_context, "KV positions per sequence (0: longest request)")
      ->check(non_negative());
  cmd->add_option("--stage-mem", o->stage_mem,
                  "Memory per stage for weights, KV cache and buffers (e.g. 2GiB)");
  cmd->add_option("--heartbeat-interval", o->heartbeat_interval,
                  "Seconds between pings of the workers")
      ->check(positive());
  cmd->add_option("--heartbeat-timeout", o->heartbeat_timeout,
                  "Seconds of silence before a worker is declared dead")
      ->check(positive());
  cmd->add_option("--load-timeout", o->load_timeout, "Seconds for every stage to load its layers")
      ->check(positive());
  cmd->add_option("--step-timeout", o->step_timeout,
                  "Seconds a stage waits for one step's activations, and computes one step")
      ->check(positive());
  cmd->add_option("--debug-kill-rank", o->debug_kill_rank,
                  "Tests: this rank dies (SIGKILL) mid-run")
      ->group("");
  cmd->add_option("--debug-kill-after-steps", o->debug_kill_after_steps,
                  "Tests: ... after this many steps")
      ->group("");
  cmd->add_option("--debug-step-delay", o->debug_step_delay,
                  "Tests: every worker step computes this many seconds longer")
      ->group("");
  return {cmd, [o] { return run_serve(*o); }};
}

}  // namespace strata::cli
