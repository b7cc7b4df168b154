// strata serve: requests from a Redis stream (docs/QUEUE.md) or a JSONL file, results to a
// results stream or another file, on one process or on a cluster under mpirun (rank 0
// coordinates, ranks 1..N-1 are pipeline stages; see docs/CLUSTER.md). Every rank runs
// this same command line.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

#include "coordinator/exegpt/profiler.h"
#include "coordinator/intake/intake.h"
#include "coordinator/intake/redis_queue.h"
#include "coordinator/run/coordinator.h"
#include "coordinator/run/local_stages.h"
#include "coordinator/run/mpi_stages.h"
#include "kernels/accelerator.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "kernels/tunables.h"
#include "launch/engine.h"
#include "launch/job_control.h"
#include "launch/metrics_server.h"
#include "launch/node_setup.h"
#include "launch/plan_schedule.h"
#include "launch/slurm_env.h"
#include "transport/liveness.h"
#include "transport/mpi_session.h"
#include "worker/dummy.h"
#include "worker/model_path.h"
#include "worker/node_probe.h"
#include "worker/stage_worker.h"

namespace strata::cli {
namespace {

struct ServeOptions {
  EngineOptions engine;
  std::string requests;
  std::string results;
  std::string redis;  // redis://... : the queue instead of files
  std::string redis_password_file;
  RedisQueueOptions queue;
  double grace_period = 30.0;
  double flush_timeout = 30.0;
  std::string stats_out;
  // Prometheus (docs/METRICS.md): -1 off, 0 any free port.
  int metrics_port = -1;
  std::string metrics_host = "0.0.0.0";
  double metrics_linger = 0;
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
  int debug_crash_token = -1;
  int debug_die_in_handover = -1;
  // ExeGPT's WAA (docs/SCHEDULING.md): prefill workers, the rest decode (0: RRA).
  int waa_encoders = 0;
  std::string tensor_parallel;  // --tensor-parallel: per-stage degrees
  WaaRun waa;
  // ExeGPT's scheduler (docs/SCHEDULING.md).
  std::string latency_bound;  // seconds or inf; with --workload, the run plans its schedule
  std::string workload;
  double length_scale = 1.0;
  std::string profile;  // the layer profile's file (default: one per key in the cache dir)
  double replan_tolerance = 0.15;
  std::vector<std::string> schedule_policies;  // rra, waa-c, waa-m; empty: all
  std::string predict_eval;  // the predictor's evaluation: packing planned under the bound
  std::string profile_out;   // profile-layers: where the profile goes
  // docs/CLUSTER.md "Unequal nodes": per-rank or per-host budgets, and measuring the nodes'
  // rates again instead of reading them from the cache.
  std::string nodes_file;
  bool remeasure_nodes = false;
};

// Host name and job id: a restarted job under Slurm keeps its name (and takes its own
// pending entries back at once); elsewhere each job is new and takes over the entries of
// a dead one after --claim-idle.
std::string default_consumer() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  for (const char* var : {"SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"})
    if (const auto v = foreign_variable(var); v && !v->empty())
      return fmt::format("{}:{}", host, *v);
  return fmt::format("{}:{}", host, getpid());
}

int exit_code(const ClusterStats& stats) {
  // Stopped with requests left unfinished: the job did not do all its work.
  return stats.stop_signal != 0 && stats.unfinished > 0 ? 128 + stats.stop_signal : 0;
}

void write_stats(const std::string& path, const std::string& json) {
  if (path.empty()) return;
  std::ofstream out(path);
  out << json << "\n";
  if (!out) fail_input("cannot write --stats-out file '{}'", path);
}

// Where a run keeps its layer profile: --profile, or a file per key (model, dtype,
// placement, hosts) under $STRATA_PROFILE_DIR or ~/.cache/strata/profiles.
std::string profile_path(const ServeOptions& o, const ProfileKey& key) {
  if (!o.profile.empty()) return o.profile;
  const std::string dir = profile_dir();
  std::string name = key.model;
  for (char& c : name)
    if (c == '/' || c == ':' || c == ' ') c = '_';
  return fmt::format("{}/{}-{:08x}.json", dir, name, static_cast<uint32_t>(name_key(key.str())));
}

// --latency-bound with --workload: the schedule the run plans, keyed by the workers' hosts.
std::optional<ScheduleTarget> schedule_target(const ServeOptions& o, const CoordinatorOptions& c,
                                              const ModelConfig& config,
                                              std::vector<std::string> hosts) {
  if (o.latency_bound.empty() && o.workload.empty()) return std::nullopt;
  if (o.latency_bound.empty() || o.workload.empty())
    fail_input("--latency-bound and --workload go together: the schedule is planned for both");
  ScheduleTarget t;
  t.workload = TaskWorkload::parse(o.workload).scaled(o.length_scale);
  t.latency_bound = parse_latency_bound(o.latency_bound);
  t.hosts = std::move(hosts);
  t.replan_tolerance = o.replan_tolerance;
  for (const std::string& p : o.schedule_policies)
    t.policies.push_back(p == "rra"     ? SchedulePolicy::kRra
                         : p == "waa-c" ? SchedulePolicy::kWaaC
                                        : SchedulePolicy::kWaaM);
  if (c.packing.budget_from_schedule) t.packing = reservation_model(c.packing, o.predict_eval);
  t.profile_path =
      profile_path(o, profile_key(o.engine.model, config.dtype, c.placement.policy, t.hosts));
  return t;
}

CoordinatorOptions coordinator_options(const ServeOptions& o, std::vector<StageNode> nodes) {
  CoordinatorOptions c =
      planned_run(o.engine, o.micro_batches, o.max_context, o.stage_mem, std::move(nodes));
  c.decode_iters = o.decode_iters;
  c.stop_signal = &stop_signal();
  c.grace_period_s = o.grace_period;
  c.flush_timeout_s = o.flush_timeout;
  c.tensor_parallel = o.tensor_parallel;
  if (o.waa_encoders > 0) {
    c.waa = o.waa;
    c.waa->encoder_stages = o.waa_encoders;
  }
  return c;
}

// --metrics-linger: the final numbers stay up for a last scrape (a stop signal ends it).
void linger(const ServeOptions& o, const MetricsServer* server) {
  if (server == nullptr || o.metrics_linger <= 0) return;
  log::get("launch")->info("run over; metrics stay on port {} for {} s", server->port(),
                           o.metrics_linger);
  const Deadline deadline = Deadline::after_seconds(o.metrics_linger);
  while (!deadline.expired() && stop_signal().load() == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// The coordinator's loop over `stages`: the worker ranks of a cluster, or this process.
int serve_requests(const ServeOptions& o, Stages& stages, const ModelConfig& config,
                   const Tokenizer& tokenizer, std::vector<std::string> hosts,
                   std::vector<StageNode> nodes = {}) {
  CoordinatorOptions c = coordinator_options(o, std::move(nodes));
  c.schedule = schedule_target(o, c, config, std::move(hosts));
  std::unique_ptr<RequestSource> source;
  std::unique_ptr<ResultSink> file_sink;
  ResultSink* sink = nullptr;
  std::unique_ptr<RedisQueue> queue;
  if (!o.redis.empty()) {
    RedisQueueOptions q = o.queue;
    q.endpoint = RedisEndpoint::resolve(o.redis, o.redis_password_file);
    if (q.consumer.empty()) q.consumer = default_consumer();
    q.prefetch = static_cast<size_t>(c.kv_slots);
    q.limits = input_limits(o.engine.limits);
    queue = std::make_unique<RedisQueue>(q, tokenizer);
    sink = queue.get();
  } else {
    source = std::make_unique<JsonlRequestSource>(o.requests, input_limits(o.engine.limits));
    file_sink = std::make_unique<JsonlResultSink>(o.results, tokenizer);
    sink = file_sink.get();
  }
  RequestSource& from = queue ? static_cast<RequestSource&>(*queue) : *source;
  ServeMetrics metrics;
  std::unique_ptr<MetricsServer> metrics_server;
  std::atomic<bool> ready{false};
  if (o.metrics_port >= 0) {
    metrics_server = std::make_unique<MetricsServer>(
        o.metrics_host, o.metrics_port, [&metrics] { return metrics.render(); },
        MetricsServerLimits{}, [&ready] { return ready.load(); });
    c.metrics = &metrics;
  }
  // Readiness an operator can wait on: this line, /health turning 200, and READY=1 to
  // systemd when it runs the service (Type=notify, NotifyAccess=all under mpirun).
  c.on_ready = [&ready, &o] {
    ready = true;
    const bool told = notify_service_manager("READY=1");
    log::get("launch")->info("ready: every stage loaded, serving requests from {}{}",
                             o.redis.empty() ? o.requests : redact_redis_url(o.redis),
                             told ? " (READY=1 sent to the service manager)" : "");
  };
  const ClusterStats stats = run_coordinator(stages, c, config, &tokenizer, from, *sink);
  std::string table = stats.table();
  std::string queue_json;
  if (queue) {
    const QueueStats q = queue->stats();
    queue_json = ", \"queue\": " + q.json();
    table += fmt::format(
        "  queue       {} delivered, {} results stored, {} dead-lettered, {} handed back, {} "
        "duplicates, {} conflicting ids, {} reconnects\n",
        q.delivered, q.results, q.dead_lettered, q.handed_back, q.duplicates, q.conflicts,
        q.reconnects);
  }
  if (stats.pie) log::get("launch")->info("{}", stats.pie->str());
  std::fprintf(stderr, "%s", table.c_str());
  std::fprintf(stderr, "%s\n", (R"({"summary": )" + stats.json() + queue_json + "}").c_str());
  write_stats(o.stats_out, stats.json(/*timeline=*/true));
  linger(o, metrics_server.get());
  return exit_code(stats);
}

// One process: a one-stage cluster over the engine's model, through the same loop.
int serve_single(const ServeOptions& o) {
  Engine e = make_engine(o.engine);
  LocalStages stages(*e.model);
  return serve_requests(o, stages, e.config, *e.tokenizer, {processor_name()});
}

MpiStagesOptions stages_options(const ServeOptions& o, LivenessLinks& links) {
  MpiStagesOptions m{o.heartbeat_interval, o.heartbeat_timeout, o.load_timeout, o.step_timeout};
  m.links = &links;
  m.stop_signal = &stop_signal();
  return m;
}

int serve_coordinator(const ServeOptions& o, const Communicator& world, LivenessLinks& links,
                      std::vector<std::string> hosts, std::vector<StageNode> nodes) {
  const ModelConfig config =
      load_spec_config(o.engine.model, parse_dtype(o.engine.dtype).value_or(DType::kF32));
  const std::unique_ptr<Tokenizer> tokenizer =
      is_dummy_model(o.engine.model) ? Tokenizer::ids_only(config)
                                     : Tokenizer::load(resolve_model_path(o.engine.model), config);
  MpiStages stages(world, stages_options(o, links));
  return serve_requests(o, stages, config, *tokenizer, std::move(hosts), std::move(nodes));
}

// A worker rank's place: its host, its index among the workers there (its GPU under
// --device auto), how many share the host, and its budget.
struct RankNode {
  std::string host;
  int local_index = 0;
  int ranks_on_host = 1;
  NodeBudget budget;
};

// A pipeline stage: the engine's compute setup (device, threads, disk folder) under its
// node's budget, its inventory sent to rank 0 before any plan, then the stage's layers as the
// plan places them.
int serve_worker(const ServeOptions& o, const MpiSession& session, const RankNode& node) {
  const Communicator& world = session.world();
  const EngineOptions engine = engine_for(o.engine, node.budget);
  ComputeSetup c = make_compute(engine, node.local_index);
  log::set_identity(session.rank(), c.device >= 0 ? fmt::format("cuda:{}", c.device) : "cpu");
  const NodeInventory inventory =
      probe_node(probe_request(engine, session.rank(), node.host, node.ranks_on_host, node.budget,
                               c.device, c.device >= 0 ? c.backend : nullptr, o.remeasure_nodes));
  log::get("worker")->info("node: {}", inventory.str());
  exchange_inventories(world, inventory, Deadline::after_seconds(o.load_timeout));
  StageWorkerOptions w;
  w.stage.load = c.load;
  w.stage.cache = c.cache;
  w.stage.gpu_batch_size = c.gpu_batch_size;
  w.device = c.device;
  w.plan_timeout_s = o.load_timeout;
  w.coordinator_timeout_s = o.heartbeat_timeout;
  w.step_timeout_s = o.step_timeout;
  w.debug_step_delay_s = o.debug_step_delay;
  if (world.rank() == o.debug_kill_rank) {
    if (o.debug_die_in_handover > 0) {
      w.debug_die_in_handover = o.debug_die_in_handover;
    } else {
      w.debug_exit_after_steps = o.debug_kill_after_steps;
    }
  }
  w.debug_crash_token = o.debug_crash_token;
  const int rc = run_stage_worker(world, *c.backend, w);
  // MPI_Finalize would wait for a lost rank; a step that never ended still uses the backend.
  if (rc == kStageLostPeer) session.abort(1);
  return rc;
}

// What rank 0 of a cluster, or a single process, does in a cluster command (serve,
// profile-layers); the workers are the same stage workers for both.
struct ClusterRoles {
  std::function<int(const ServeOptions&)> single;
  std::function<int(const ServeOptions&, const Communicator&, LivenessLinks&,
                    std::vector<std::string>, std::vector<StageNode>)>
      coordinator;
  // The command's own option checks, run at every rank where a refusal ends the job with
  // its status (optional).
  std::function<void(const ServeOptions&)> check;
};

// Until rank 0's run loop watches the links itself (MpiStages, once every stage has
// loaded), a lost peer ends the job at once: nothing has been read from the queue yet, and
// the start's collectives would wait for the dead rank to their deadline. A worker keeps
// this to the end: without rank 0 it has nothing to do.
void end_job_on_lost_peer(LivenessLinks& links, const MpiSession& session) {
  links.on_lost([&session](int rank) {
    if (rank == 0) {
      log::get("launch")->error(
          "rank 0 (the coordinator) is gone: its liveness link closed; this worker ends the job");
      session.abort(leave_status(1));
    }
    // A worker that refused the job's options left its status before it ended.
    const int left = status_left_by(rank);
    log::get("launch")->error(
        "worker rank {} {} while the job started (its liveness link to rank 0 closed); rank 0 "
        "ends the job",
        rank, left != 0 ? fmt::format("ended with status {}", left) : std::string("died"));
    session.abort(leave_status(left != 0 ? left : 1));
  });
}

int run_cluster(const ServeOptions& o, const ClusterRoles& roles) {
  std::optional<StartWatchdog> watchdog(std::in_place, o.load_timeout);
  MpiSession session(nullptr, nullptr);
  check_slurm_world_size(session.size());  // srun without --mpi=pmix: worlds of one
  log::set_identity(session.rank(), "cpu");
  if (session.size() == 1) {
    watchdog.reset();
    // Started as a cluster of one: launch/local-cluster.sh must not take this rank's end
    // (when mpirun is slow to follow it) for a death while starting.
    say_started();
    if (roles.check) roles.check(o);
    if (!o.nodes_file.empty())
      fail_input(
          "--nodes is for a cluster (mpirun -np 2 or more): one process takes its budgets from "
          "--gpu-mem, --cpu-mem and --disk-mem");
    return roles.single(o);
  }
  log::get("launch")->info("{}", session.str());
  const std::unique_ptr<LivenessLinks> links =
      LivenessLinks::create(session.world(), Deadline::after_seconds(o.load_timeout));
  watchdog.reset();
  say_started();
  log::get("launch")->info("{}", links->str());
  end_job_on_lost_peer(*links, session);
  const int local_index =
      host_local_index(session.world(), 1, Deadline::after_seconds(o.load_timeout));
  std::vector<std::string> hosts =
      host_names(session.world(), Deadline::after_seconds(o.load_timeout));
  try {
    if (roles.check) roles.check(o);
    // A cluster's plan places Pie and HeteGen as its policy names them (pie=, hetegen=), for
    // every device stage; the flags' forms (an adaptive m, a per-slot or measured alpha) are
    // the single-process engine's. Refused at every rank alike rather than run unplanned.
    if (o.engine.hetegen_alpha != 0 || o.engine.hetegen_alpha_auto)
      fail_input(
          "--hetegen-alpha is for single-process engine commands (generate, bench, score, serve "
          "without ranks); in a cluster give the policy's hetegen=PERCENT, which the plan places "
          "on every device stage");
    if (o.engine.pie_adaptive || o.engine.pie_host_layers > 0)
      fail_input(
          "--pie-host-layers and --pie-adaptive are for single-process engine commands "
          "(generate, bench, score, serve without ranks); in a cluster give the policy's pie=M, "
          "which the plan places on every device stage");
    const std::optional<NodeFile> nodes =
        o.nodes_file.empty() ? std::nullopt : std::optional(NodeFile::load(o.nodes_file));
    if (nodes && nodes->max_rank() >= session.size())
      fail_input("{}: an entry for rank {} but the job's worker ranks are 1 to {}", nodes->path,
                 nodes->max_rank(), session.size() - 1);
    if (session.rank() != 0) {
      const int rank = session.rank();
      const std::string& host = hosts[static_cast<size_t>(rank)];
      const auto on_host = static_cast<int>(std::count(hosts.begin() + 1, hosts.end(), host));
      const RankNode node{host, local_index, on_host,
                          resolve_budget(o.engine, nodes, rank, host, on_host)};
      return serve_worker(o, session, node);
    }
    std::vector<StageNode> stages = stage_nodes(exchange_inventories(
        session.world(), std::nullopt, Deadline::after_seconds(o.load_timeout)));
    hosts.erase(hosts.begin());  // the workers'
    const int rc =
        roles.coordinator(o, session.world(), *links, std::move(hosts), std::move(stages));
    // Under `--mca orte_abort_on_non_zero_status 0` (launch/*.sh) mpirun exits 0 whatever
    // a rank returns: a job that did not finish its work says so through MPI_Abort.
    if (rc != 0) {
      log::get("launch")->warn("stopped with requests unfinished: exit status {}", rc);
      session.abort(leave_status(rc));
    }
    return rc;
  } catch (const std::exception& e) {
    // End the whole job with this rank's status and message. Rank 0 told the workers to
    // stop; a worker that cannot start (no such device, a bad policy) would leave rank 0
    // waiting in the plan's collectives. Under `--mca orte_abort_on_non_zero_status 0`
    // (launch/*.sh) mpirun would otherwise exit 0, and after a lost rank MPI_Finalize would
    // wait for it forever.
    // A stop signal that ended the start (the stages were still loading) is the status.
    log::get("launch")->error("rank {} ends the job", session.rank());
    const int code = report_error(e);
    const int signal = stop_signal().load();
    session.abort(leave_status(session.rank() == 0 && signal != 0 ? 128 + signal : code));
  }
}

// Refused inside the job (run_cluster), where a refusal's status reaches mpirun.
void check_serve_options(const ServeOptions& o) {
  if (o.redis.empty() == o.requests.empty())
    fail_input("give either --redis URL (the queue) or --requests FILE (a JSONL file)");
  if (!o.requests.empty() && o.results.empty())
    fail_input("--requests needs --results FILE for the results");
  if (!o.redis.empty() && !o.results.empty())
    fail_input("--results is for --requests; with --redis results go to --result-stream");
  if (!o.latency_bound.empty() && o.engine.packing.budget > 0)
    fail_input(
        "--kv-budget {} with --latency-bound: the schedule search sizes the KV budget (its packed "
        "plan's positions, within --stage-mem); give --kv-reserve alone",
        o.engine.packing.budget);
  if (!o.predict_eval.empty() && o.latency_bound.empty())
    fail_input("--predict-eval plans packing under --latency-bound; without one it has no use");
}

int run_serve(const ServeOptions& options) {
  ServeOptions o = options;
  // Under a latency bound, packing's budget is the schedule search's to size.
  const EngineOptions& e = o.engine;
  o.engine.packing.budget_from_schedule =
      !o.latency_bound.empty() && (!e.kv_reserve.empty() || !e.packing.predictor_path.empty());
  return run_cluster(o, ClusterRoles{serve_single, serve_coordinator, check_serve_options});
}

// strata profile-layers: the stages of the uniform plan time their parts (ExeGPT's
// XProfiler; coordinator/exegpt/profiler.h) and the profile goes to --out.
int profile_stages(const ServeOptions& o, Stages& stages, const ModelConfig& config,
                   std::vector<std::string> hosts, std::vector<StageNode> nodes = {}) {
  const CoordinatorOptions c = coordinator_options(o, std::move(nodes));
  const int32_t capacity =
      c.max_context > 0 ? std::min(c.max_context, config.max_positions) : config.max_positions;
  const int32_t max_rows = std::max(c.max_step_tokens, c.kv_slots);
  PlanOptions po{c.model_spec, stages.count(), 1,           c.kv_slots,
                 capacity,     max_rows,       c.stage_mem, c.placement};
  po.nodes = c.nodes;
  const ClusterPlan plan = make_uniform_plan(config, po);
  stages.start(plan);
  const ProfileKey key =
      profile_key(o.engine.model, config.dtype, c.placement.policy, std::move(hosts));
  const ProfileGrid grid = ProfileGrid::for_limits(max_rows, c.kv_slots, capacity);
  ClusterProfile profile = measure_profile(stages, plan, key, grid);
  profile.save(o.profile_out);
  stages.finish("profiled");
  std::printf("%s\n", profile.str().c_str());
  for (size_t i = 0; i < profile.ranks.size(); ++i) {
    const RankProfile& r = profile.ranks[i];
    std::printf(
        "rank %d on %s, layers [%d, %d): a layer takes %.3f ms to decode 1 sequence, "
        "%.3f ms for %d; %.3f ms to prefill %d rows\n",
        r.rank, r.host.c_str(), plan.stages[i].layer_begin, plan.stages[i].layer_end,
        1e3 * r.decode.at(1, 64), 1e3 * r.decode.at(c.kv_slots, 64), c.kv_slots,
        1e3 * r.prefill.at(max_rows, std::min(capacity, 256)), max_rows);
  }
  std::printf("link: %.1f us + %.3f ns a byte; the coordinator's turn: %.1f us + %.2f us a row\n",
              1e6 * profile.link.latency_s, 1e9 * profile.link.seconds_per_byte,
              1e6 * profile.step_overhead_s, 1e6 * profile.step_overhead_per_row_s);
  std::printf("saved to %s\n", o.profile_out.c_str());
  return 0;
}

int run_profile_layers(const ServeOptions& o) {
  const ClusterRoles roles{
      [](const ServeOptions& opts) {
        Engine e = make_engine(opts.engine);
        LocalStages stages(*e.model);
        return profile_stages(opts, stages, e.config, {processor_name()});
      },
      [](const ServeOptions& opts, const Communicator& world, LivenessLinks& links,
         std::vector<std::string> hosts, std::vector<StageNode> nodes) {
        const ModelConfig config = load_spec_config(
            opts.engine.model, parse_dtype(opts.engine.dtype).value_or(DType::kF32));
        MpiStages stages(world, stages_options(opts, links));
        return profile_stages(opts, stages, config, std::move(hosts), std::move(nodes));
      },
      [](const ServeOptions& opts) {
        if (opts.profile_out.empty()) fail_input("give --out FILE for the layer profile");
      }};
  return run_cluster(o, roles);
}

void add_queue_options(CLI::App& cmd, std::string& url, std::string& password_file,
                       RedisQueueOptions& q) {
  cmd.add_option("--redis", url,
                 "Read requests from a Redis stream: redis://[user:password@]host:port/db");
  add_password_file_option(cmd, password_file);
  cmd.add_option("--request-stream", q.request_stream, "Stream of requests")->capture_default_str();
  cmd.add_option("--result-stream", q.result_stream, "Stream results are written to")
      ->capture_default_str();
  cmd.add_option("--dead-letter-stream", q.dead_letter_stream,
                 "Stream of entries delivered too often (default: <request-stream>:dead)");
  cmd.add_option("--group", q.group, "Consumer group")->capture_default_str();
  cmd.add_option("--consumer", q.consumer,
                 "This job's consumer name (default: host name and job id); a job restarted "
                 "under the same name takes its own pending entries back at once");
  cmd.add_option("--claim-idle", q.claim_idle_s,
                 "Seconds an entry may sit idle on another consumer before it is taken over")
      ->check(positive())
      ->capture_default_str();
  cmd.add_option("--consumer-ttl", q.consumer_ttl_s,
                 "Seconds this job's liveness mark in Redis lasts unless renewed; the entries of "
                 "a consumer whose mark ran out (or that ended) are taken over at once")
      ->check(positive())
      ->capture_default_str();
  cmd.add_option("--max-deliveries", q.max_deliveries,
                 "Deliveries of one entry before it goes to the dead-letter stream")
      ->check(positive())
      ->capture_default_str();
  cmd.add_flag("--exit-when-drained", q.exit_when_drained,
               "End once the stream has no new and no pending entries (batch jobs)");
  cmd.add_option("--redis-timeout", q.retry_timeout_s,
                 "Seconds Redis may be unreachable before the run fails (0: retry forever)")
      ->check(non_negative())
      ->capture_default_str();
}

void add_schedule_serve_options(CLI::App& cmd, ServeOptions& o) {
  cmd.add_option("--latency-bound", o.latency_bound,
                 "Plan the schedule (ExeGPT): the best throughput whose p99-length output "
                 "finishes within this many seconds from its prefill (inf: unbounded); with "
                 "--workload");
  cmd.add_option("--workload", o.workload,
                 "The lengths to plan for: S, T, G, C1, C2 (the paper's Table 3) or a JSONL file");
  cmd.add_option("--length-scale", o.length_scale, "Scale the workload's lengths")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--layer-profile", o.profile,
                 "The layer profile: reused when it matches the run, else measured and saved "
                 "here (default: one per model, placement and hosts in $STRATA_PROFILE_DIR or "
                 "~/.cache/strata/profiles)");
  cmd.add_option("--replan-tolerance", o.replan_tolerance,
                 "Relative drift of the observed output lengths (mean or p99) that re-plans")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--predict-eval", o.predict_eval,
                 "With --latency-bound and --kv-reserve predicted: the predictor's evaluation "
                 "(strata predict eval --json), whose reservations the schedule search packs");
  cmd.add_option("--schedule-policy", o.schedule_policies,
                 "The allocation policies the schedule is searched over: rra, waa-c, waa-m "
                 "(default: all three)")
      ->check(CLI::IsMember({"rra", "waa-c", "waa-m"}))
      ->delimiter(',');
}

}  // namespace

// The options a cluster's shape and timeouts take, shared by serve and profile-layers.
void add_cluster_options(CLI::App& cmd, ServeOptions& o) {
  cmd.add_option("--max-context", o.max_context,
                 "KV positions per sequence, the run's context (0: the model's)")
      ->check(non_negative());
  cmd.add_option("--stage-mem", o.stage_mem,
                 "Memory per stage for weights, KV cache and buffers on its compute tier (e.g. "
                 "2GiB); --gpu-mem, --cpu-mem and --disk-mem bound each tier of every stage");
  cmd.add_option("--nodes", o.nodes_file,
                 "Node file (JSON or YAML): per rank or host its device, gpu-mem, cpu-mem, "
                 "disk-mem, disk-dir, threads, over the flags (docs/CLUSTER.md)");
  cmd.add_flag("--remeasure-nodes", o.remeasure_nodes,
               "Measure every node's rates again (memory, disk, host-device) instead of reading "
               "them from the cache");
  cmd.add_option("--heartbeat-interval", o.heartbeat_interval,
                 "Seconds between pings of the workers")
      ->check(positive());
  cmd.add_option("--heartbeat-timeout", o.heartbeat_timeout,
                 "Seconds of silence before a worker is declared dead")
      ->check(positive());
  cmd.add_option("--load-timeout", o.load_timeout,
                 "Seconds for every stage to load its layers (and to profile them)")
      ->check(positive());
  cmd.add_option("--step-timeout", o.step_timeout,
                 "Seconds a stage waits for one step's activations, and computes one step")
      ->check(positive());
}

Command add_profile_layers(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "profile-layers",
      "Time every stage's layers under its placement, and the links (ExeGPT's XProfiler): a "
      "layer profile for strata plan --profile and serve --layer-profile");
  add_engine_options(*cmd, o->engine);
  add_cluster_options(*cmd, *o);
  cmd->add_option("--out", o->profile_out, "The layer profile's JSON file")->required();
  return {cmd, [o] { return run_profile_layers(*o); }, /*graceful_stop=*/true};
}

void add_waa_options(CLI::App& cmd, ServeOptions& o) {
  cmd.add_option("--waa-encoders", o.waa_encoders,
                 "ExeGPT's WAA: the first N worker ranks prefill, the rest decode, each side a "
                 "pipeline over all the layers; the KV cache moves after prefill (0: RRA)")
      ->check(non_negative())
      ->group("WAA");
  cmd.add_option("--waa-encode-batch", o.waa.encode_batch,
                 "B_E: sequences per encoder batch (0: as many as the prefill slots hold)")
      ->check(non_negative())
      ->group("WAA");
  cmd.add_option("--waa-encoder-slots", o.waa.encoder_slots,
                 "KV slots of the prefill side (0: B_E x its micro-batches, or --max-batch)")
      ->check(non_negative())
      ->group("WAA");
  cmd.add_option("--waa-encoder-micro-batches", o.waa.encoder_micro_batches,
                 "Encoder batches in flight through the prefill pipeline")
      ->check(positive())
      ->group("WAA");
  cmd.add_option("--waa-planned-input", o.waa.planned_input,
                 "Dynamic workload adjustment: the planned mean input length (0: off)")
      ->check(non_negative())
      ->group("WAA");
  cmd.add_option("--waa-planned-decode-batch", o.waa.planned_decode_batch,
                 "Dynamic workload adjustment: the planned decode batch B_D (0: off)")
      ->check(non_negative())
      ->group("WAA");
  cmd.add_option("--waa-threshold", o.waa.threshold,
                 "Dynamic workload adjustment: the band around the planned workloads")
      ->capture_default_str()
      ->group("WAA");
}

Command add_serve(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Serve requests from a Redis stream or a JSONL file: a cluster under mpirun, or one "
      "process");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--requests", o->requests, "JSONL file, one request per line");
  cmd->add_option("--results", o->results, "JSONL file the results are written to");
  add_queue_options(*cmd, o->redis, o->redis_password_file, o->queue);
  cmd->add_option("--grace-period", o->grace_period,
                  "Seconds the running requests get to finish after SIGTERM / SIGINT")
      ->check(non_negative());
  cmd->add_option("--flush-timeout", o->flush_timeout,
                  "Seconds at the end for every result to be stored")
      ->check(positive());
  cmd->add_option("--stats-out", o->stats_out, "Write the run's statistics (JSON) to this file");
  cmd->add_option("--metrics-port", o->metrics_port,
                  "Serve Prometheus metrics on this port at /metrics while the run lasts (0: any "
                  "free port, logged; rank 0 of a cluster serves them)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--metrics-host", o->metrics_host, "The address /metrics listens on")
      ->capture_default_str();
  cmd->add_option("--metrics-linger", o->metrics_linger,
                  "Seconds /metrics stays up after the run, for a last scrape")
      ->check(non_negative());
  cmd->add_option("--micro-batches", o->micro_batches,
                  "Micro-batches in flight through the pipeline")
      ->check(positive());
  cmd->add_option("--decode-iters", o->decode_iters,
                  "Decode iterations between prefill phases (ExeGPT's N_D)")
      ->check(positive());
  cmd->add_option("--tensor-parallel", o->tensor_parallel,
                  "ExeGPT's partial tensor parallelism: each pipeline stage's degree, e.g. 1,2,1 "
                  "(a stage's heads and MLP columns split over that many consecutive worker "
                  "ranks), or one degree for every stage");
  add_cluster_options(*cmd, *o);
  add_schedule_serve_options(*cmd, *o);
  add_waa_options(*cmd, *o);
  cmd->add_option("--debug-kill-rank", o->debug_kill_rank,
                  "Tests: this rank dies (SIGKILL) mid-run")
      ->group("");
  cmd->add_option("--debug-kill-after-steps", o->debug_kill_after_steps,
                  "Tests: ... after this many steps")
      ->group("");
  cmd->add_option("--debug-step-delay", o->debug_step_delay,
                  "Tests: every worker step computes this many seconds longer")
      ->group("");
  cmd->add_option("--debug-crash-token", o->debug_crash_token,
                  "Tests: the first stage dies (SIGKILL) on a prompt holding this token id")
      ->group("");
  cmd->add_option("--debug-die-in-handover", o->debug_die_in_handover,
                  "Tests: --debug-kill-rank dies in its n-th KV hand-over, transfers posted")
      ->group("");
  return {cmd, [o] { return run_serve(*o); }, /*graceful_stop=*/true};
}

}  // namespace strata::cli
