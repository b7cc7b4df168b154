// strata bench: synthetic prompts through the local cluster (the coordinator's one request
// path), reported as JSON together with this machine's limits measured in the same run and the
// achieved fraction of each bound.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "kernels/accelerator.h"
#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/limits.h"
#include "kernels/log.h"
#include "kernels/quant.h"
#include "launch/engine.h"
#include "launch/openmp_wait.h"
#include "launch/progress.h"
#include "placement/policy_search.h"
#include "worker/direct_file.h"
#include "worker/dummy.h"
#include "worker/expert_store.h"

namespace strata::cli {
namespace {

struct BenchOptions {
  EngineOptions engine;
  int prompt_len = 128;
  int gen_len = 64;
  int batch = 1;
  uint64_t seed = 1;
  bool measure_limits = true;
  int warmup = 1;
  std::string hardware;  // HardwareSpec JSON for --policy auto (default: FlexGen's T4 figures)
  // What the search of --policy auto may use (as `strata plan`'s flags): fixed for the whole
  // search, like FlexGen's --compress-w.
  bool compress_weight = false, compress_cache = false, cache_f16 = false, cpu_attention = true;
};

// --policy auto: FlexGen's LP search (placement/policy_search.h) over this model, workload
// and the --gpu-mem / --cpu-mem budgets, with the hardware figures of --hardware (a
// HardwareSpec file) or, without one, the T4 machine's. Activations stay on the
// compute tier (the engine keeps them there). FlexGen's cost model is a GPU node's: on an
// engine computing on the CPU its GPU and CPU tiers would both be host memory, and its
// choice could need twice --cpu-mem, so there it is refused.
nlohmann::json choose_policy(BenchOptions& o, bool device_compute) {
  if (!device_compute)
    fail_input(
        "--policy auto: FlexGen's search places weights and KV cache for a GPU node, and this "
        "run computes on the CPU (--device {}). On a CPU-only node give --cpu-mem (the weights "
        "fill it, the rest stream from --disk-dir) or a policy; --device host runs the search's "
        "choice with the CPU standing in for the GPU",
        o.engine.device);
  const ModelConfig c =
      load_spec_config(o.engine.model, parse_dtype(o.engine.dtype).value_or(DType::kF32));
  HardwareSpec hw =
      o.hardware.empty() ? HardwareSpec::flexgen_t4() : HardwareSpec::load(o.hardware);
  if (!o.engine.gpu_mem.empty())
    hw.gpu_mem = static_cast<double>(parse_size(o.engine.gpu_mem, "--gpu-mem"));
  if (!o.engine.cpu_mem.empty())
    hw.cpu_mem = static_cast<double>(parse_size(o.engine.cpu_mem, "--cpu-mem"));
  hw.validate(o.hardware.empty() ? "the T4 preset with the given budgets" : o.hardware);
  SearchOptions so;
  so.overlap = o.engine.overlap;
  so.compress_weight = o.compress_weight;
  so.compress_cache = o.compress_cache;
  so.cache_f16 = o.cache_f16;
  so.cpu_attention = o.cpu_attention;
  so.pie = so.hetegen = true;  // the engine computes on a device: they have one to use
  so.on_progress = progress_callback("policy search: GPU batch sizes");
  const SearchResult r = search_policy(c.shape(), Workload{o.prompt_len, o.gen_len}, hw, so);
  const Policy p = with_engine_activations(r.policy, true);  // on the device's compute tier
  o.engine.policy = p;
  o.engine.policy_auto = false;
  o.batch = static_cast<int>(p.block_size());
  nlohmann::json j = r.to_json();
  j["running"] = p.compact();
  return j;
}

std::vector<GenerationRequest> synthetic_requests(const ModelConfig& c, const BenchOptions& o) {
  Rng rng(o.seed);
  std::vector<GenerationRequest> reqs(static_cast<size_t>(o.batch));
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].id = std::to_string(i);
    for (int t = 0; t < o.prompt_len; ++t)
      reqs[i].prompt_ids.push_back(
          3 + static_cast<int32_t>(rng.next() % static_cast<uint64_t>(c.vocab - 3)));
    reqs[i].max_new_tokens = o.gen_len;
    reqs[i].ignore_eos = true;  // every sequence produces exactly gen_len tokens
  }
  return reqs;
}

// A bench reports only what it ran: a workload the model's context cannot hold is refused,
// not cut short and reported as asked. The last generated token is never fed back, so a
// sequence needs prompt_len + gen_len - 1 positions.
void check_workload(const BenchOptions& o, const ModelConfig& c) {
  const int64_t need = int64_t{o.prompt_len} + o.gen_len - 1;
  if (need > c.max_positions)
    fail_input(
        "--prompt-len {} + --gen-len {} need {} positions but {} has a context of {} "
        "(max_position_embeddings)",
        o.prompt_len, o.gen_len, need, c.source, c.max_positions);
}

// `strata limits` in a child process, so its large buffers never count in this process's
// peak RSS.
MachineLimits measure_limits_in_child(int threads) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);  // the shell has its own
  if (ec) fail(ErrorKind::kFailed, "cannot find this executable: {}", ec.message());
  const std::string cmd =
      fmt::format("'{}' limits --threads {} 2>/dev/null", self.string(), threads);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) fail(ErrorKind::kFailed, "cannot run '{}'", cmd);
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) out += buf;
  const int rc = pclose(pipe);
  const auto j = nlohmann::json::parse(out, nullptr, false);
  if (rc != 0 || j.is_discarded() || !j.contains("gemm_gflops"))
    fail(ErrorKind::kFailed, "'{}' failed (exit {}): {}", cmd, rc, out);
  MachineLimits m;
  m.threads = threads;
  m.memory_bandwidth_gbs = j["memory_bandwidth_gbs"];
  m.memory_read_gbs = j["memory_read_gbs"];
  m.gemm_gflops = j["gemm_gflops"];
  m.gemm_n = j["gemm_n"];
  return m;
}

// Bytes per tier and what streaming them costs at the measured rates (FlexGen's I/O terms).
nlohmann::json feed_report(const LayerFeeder& f, const WeightPlacement& p, double h2d_gbs,
                           double total_s) {
  const FeedStats s = f.stats();
  const double to_device = static_cast<double>(s.bytes_from_cpu + s.bytes_from_disk);
  const double io_bound_s = h2d_gbs > 0 ? to_device / (h2d_gbs * 1e9) : 0;
  return {{"layers_gpu_cpu_disk", {p.count(Tier::kGpu), p.count(Tier::kCpu), p.count(Tier::kDisk)}},
          {"bytes_on_gpu", p.gpu_bytes()},
          {"bytes_on_cpu", p.cpu_bytes()},
          {"bytes_on_disk", p.count(Tier::kDisk) * p.layer_bytes},
          // HeteGen: CPU-tier layers split (computed in place) rather than streamed.
          {"hetegen_alpha", p.hetegen_alpha},
          {"layers_split", p.split_layers()},
          // Their alpha shares streamed host -> device (alpha_share_bytes_per_pass a pass),
          // and the CPU's (1 - alpha) shares: linears computed and host seconds in them.
          {"alpha_shares_streamed", s.shares_streamed},
          {"bytes_alpha_shares_to_gpu", s.bytes_of_shares},
          {"alpha_share_bytes_per_pass", p.split_stream_total()},
          {"cpu_share_linears", f.splits() != nullptr ? f.splits()->scratch().cpu_calls() : 0},
          {"cpu_share_seconds", f.splits() != nullptr ? f.splits()->scratch().cpu_seconds() : 0.0},
          {"bytes_cpu_to_gpu", s.bytes_from_cpu},
          {"bytes_disk_to_gpu", s.bytes_from_disk},
          {"host_wait_for_disk_seconds", s.wait_seconds},
          {"host_to_device_bound_seconds", io_bound_s},
          {"fraction_of_host_to_device_bound", total_s > 0 ? io_bound_s / total_s : 0}};
}

// Pie's swapping over the measured run, with its buffers (placement/pie.h PieBuffers) and
// what it cost: bytes a step moved, and the share of the steps' time compute waited.
nlohmann::json pie_report(const KvSwapStats& s, const PieOptions& options,
                          const GenerationStats& stats) {
  nlohmann::json j = nlohmann::json::parse(s.json());
  j["options"] = options.str();
  const PieBuffers& b = s.buffers;
  j["layer_bytes"] = s.layer_bytes;
  j["swap_bytes"] = b.swap_bytes;
  j["device_buffers"] = b.device;
  j["host_buffers"] = b.host;
  j["device_bytes"] = b.device_bytes();
  j["host_bytes"] = b.host_bytes();
  j["swapped_bytes_per_step"] =
      s.steps > 0 ? static_cast<double>(s.bytes_in + s.bytes_out) / static_cast<double>(s.steps)
                  : 0.0;
  const double step_s = stats.total_seconds();
  j["stall_fraction"] = step_s > 0 ? s.stall_seconds / step_s : 0.0;
  return j;
}

// The run again with a pass of the read stream after every step, so each decode step has
// its read bound measured just before and just after it (kernels/limits.h StepPairing). A
// step's bytes are its weights and the KV cache it attends over (every sequence's
// positions, K and V of every layer). The probe reads the step's weight bytes, at most
// 512 MiB (a model that barely fits in memory must not need twice that; the bound scales
// with the bytes). Its allocation comes after the measured run's peak RSS is read.
nlohmann::json paired_decode_read_bound(Model& model, LocalOptions options,
                                        const std::vector<GenerationRequest>& requests,
                                        double weight_bytes) {
  constexpr size_t kMaxProbeBytes = size_t{512} << 20;
  StepPairing pairing(std::min(static_cast<size_t>(weight_bytes), kMaxProbeBytes));
  std::vector<int64_t> positions;  // a step's, to count its KV bytes once the run says their size
  options.after_step = [&](const StepCommand& step, double seconds) {
    const bool decode = step.phase == Phase::kDecode;
    pairing.after_step(seconds, weight_bytes, decode);
    if (!decode) return;
    int64_t read = 0;
    for (const SeqStep& s : step.seqs) read += s.n_past + s.n_new;
    positions.push_back(read);
  };
  GenerationStats stats;
  LocalCluster(model, options).run(requests, &stats);
  const PairedReadBound weights_only = pairing.summary();
  std::vector<PairedStep>& steps = pairing.steps();
  double kv_bytes = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const double kv =
        static_cast<double>(positions[i]) * static_cast<double>(stats.kv_position_bytes);
    steps[i].step_bytes += kv;
    kv_bytes += kv;
  }
  nlohmann::json j = nlohmann::json::parse(pairing.summary().json());
  j["weights_only"] = nlohmann::json::parse(weights_only.json());
  j["weight_bytes_per_step"] = weight_bytes;
  j["kv_bytes_per_step"] = steps.empty() ? 0.0 : kv_bytes / static_cast<double>(steps.size());
  j["probe_bytes"] = pairing.probe_bytes();
  return j;
}

// A decode step's floor on an accelerator: its weights and the KV rows in device memory it
// attends over, each read once at the copy rate (bytes read plus written by a device copy).
// Decode step j of a sequence (1 .. gen - 1) attends over prompt + j positions, prompt +
// gen / 2 on average; the cache's GPU share of them is in device memory.
nlohmann::json device_decode_bound(const BenchOptions& o, const GenerationStats& stats,
                                   const CacheOptions& cache, double weight_bytes,
                                   double device_gbs, double step_s) {
  const double positions = static_cast<double>(o.batch) * (o.prompt_len + o.gen_len / 2.0);
  const double kv_bytes = positions * static_cast<double>(stats.kv_position_bytes) *
                          cache.placement.gpu_percent / 100.0;
  const double bound_s = device_gbs > 0 ? (weight_bytes + kv_bytes) / (device_gbs * 1e9) : 0;
  const double weights_s = device_gbs > 0 ? weight_bytes / (device_gbs * 1e9) : 0;
  return {{"weight_bytes_per_step", weight_bytes},
          {"kv_bytes_per_step", kv_bytes},
          {"device_memory_gbs", device_gbs},
          {"bound_step_seconds", bound_s},
          {"fraction", step_s > 0 ? bound_s / step_s : 0.0},
          {"fraction_weights_only", step_s > 0 ? weights_s / step_s : 0.0}};
}

long peak_rss_bytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss * 1024L;
}

// The flags that shape --policy auto's search belong to it alone.
void check_bench_options(const BenchOptions& o) {
  if (o.batch <= 0 || o.prompt_len <= 0 || o.gen_len <= 0)
    fail_input("--batch, --prompt-len and --gen-len must be positive");
  const bool search_flags =
      o.compress_weight || o.compress_cache || o.cache_f16 || !o.cpu_attention;
  if (search_flags && !o.engine.policy_auto)
    fail_input(
        "--compress-weight, --compress-cache, --cache-f16 and --no-cpu-attention shape the search "
        "of --policy auto; a given policy says them itself (cw=1, cc=1, cf16=1, cpu_attn=0)");
}

// Touches weights and scratch once per --warmup with a short run.
void warm_up(const Engine& e, const BenchOptions& o) {
  LocalCluster gen(*e.model, e.local);
  for (int w = 0; w < o.warmup; ++w) {
    BenchOptions small = o;
    small.batch = 1;
    small.prompt_len = std::min(o.prompt_len, 8);
    small.gen_len = 2;
    gen.run(synthetic_requests(e.config, small));
  }
}

// The measured run: what it produced, its statistics, and the FLOPs it executed.
struct MeasuredRun {
  GenerationStats stats;
  double flops = 0;
  double decode_step_s = 0;  // the mean decode step
};

MeasuredRun measured_run(const Engine& e, const BenchOptions& o) {
  MeasuredRun run;
  LocalOptions options = e.local;
  const auto total = static_cast<size_t>(o.batch) * static_cast<size_t>(o.gen_len);
  auto progress = std::make_shared<Progress>("generating tokens", total);
  options.on_tokens = [progress](int64_t tokens) { progress->update(static_cast<size_t>(tokens)); };
  LocalCluster measured(*e.model, options);
  const std::vector<GenerationResult> results =
      measured.run(synthetic_requests(e.config, o), &run.stats);
  progress->finish(total);
  const ModelShape shape = e.config.shape();
  for (const GenerationResult& r : results)
    run.flops += shape.sequence_flops(o.prompt_len, static_cast<int64_t>(r.output_ids.size()));
  const GenerationStats& st = run.stats;
  run.decode_step_s =
      st.decode_steps > 0 ? st.decode_seconds / static_cast<double>(st.decode_steps) : 0;
  return run;
}

// What ran, next to what was asked: every sequence should have produced gen_len tokens.
nlohmann::json run_json(const Engine& e, const BenchOptions& o, const MeasuredRun& run) {
  const ModelShape shape = e.config.shape();
  const GenerationStats& stats = run.stats;
  nlohmann::json j;
  j["model"] = o.engine.model;
  j["shape"] = shape.str();
  j["params"] = shape.total_params();
  j["weight_dtype"] = dtype_name(e.config.dtype);
  j["batch"] = o.batch;
  j["prompt_len"] = o.prompt_len;
  j["gen_len"] = o.gen_len;
  j["threads"] = e.cpu->threads();
  j["openmp_wait"] = openmp_wait_json();
  j["backend"] = e.backend->name();
  j["weight_placement"] = e.placement.str();
  if (o.engine.policy) j["policy"] = o.engine.policy->compact();
  if (e.profiler) j["profile"] = nlohmann::json::parse(e.profiler->json());
  j["result"] = nlohmann::json::parse(stats.json());
  if (stats.pie) {
    j["pie"] = pie_report(*stats.pie, e.model->cache_options().placement.pie, stats);
    log::get("launch")->info("{}", stats.pie->str());
  }
  j["generated_tokens"] = stats.generated_tokens;
  j["generated_tokens_expected"] = int64_t{o.batch} * o.gen_len;
  j["executed_gflop"] = run.flops / 1e9;
  j["decode_step_seconds"] = run.decode_step_s;
  j["achieved_gflops"] = run.flops / stats.total_seconds() / 1e9;
  return j;
}

// A MoE model's disk experts: what the steps read, and the rate against what the disk gives
// O_DIRECT reads of the same size in the same run (time_direct_io, after the measured run).
nlohmann::json expert_stream_json(const ExpertStore& store, const std::string& disk_dir) {
  const ExpertStreamStats s = store.stats();
  const size_t blob = store.expert_bytes();
  const size_t probe = std::max<size_t>(blob, std::min<size_t>(size_t{1} << 30, 16 * blob));
  const DirectIoTimes bound = time_direct_io(disk_dir, probe, blob);
  const double bound_gbs =
      bound.read_s > 0 ? static_cast<double>(bound.bytes) / bound.read_s / 1e9 : 0;
  const double read_gbs = s.read_rate() / 1e9;
  return {{"disk_experts", store.disk_experts()},
          {"cache_slots", store.cache_slots()},
          {"expert_bytes", blob},
          {"requested", s.requested},
          {"cache_hits", s.hits},
          {"reads", s.reads},
          {"bytes_read", s.bytes_read},
          {"read_seconds", s.read_seconds},
          {"compute_wait_seconds", s.wait_seconds},
          {"read_gbs", read_gbs},
          {"o_direct_bound_gbs", bound_gbs},
          {"o_direct", bound.o_direct},
          {"fraction_of_bound", bound_gbs > 0 ? read_gbs / bound_gbs : 0.0}};
}

nlohmann::json disk_stream_json(const StreamStats& ss, bool overlap) {
  return {{"layers_read", ss.layers_read},
          {"bytes_read", ss.bytes_read},
          {"read_seconds", ss.read_seconds},
          {"compute_wait_seconds", ss.wait_seconds},
          {"read_gbs",
           ss.read_seconds > 0 ? static_cast<double>(ss.bytes_read) / ss.read_seconds / 1e9 : 0.0},
          {"overlap", overlap}};
}

// What a decode step of `rows` sequences streams (a MoE layer: the experts they are expected
// to pick between them, all 8 of 8 at batch 32 and top-2): under cw=1 each weight as the
// 4-bit layout stores it (kernels/quant.h; a matrix whose rows are not whole groups stays as
// stored and reads more, so there the fractions of its bound are understated).
double decode_weight_bytes(const ModelShape& shape, const std::optional<Policy>& policy,
                           int64_t rows) {
  const bool compressed = policy && policy->compress_weight;
  return static_cast<double>(shape.decode_weight_bytes(rows)) *
         (compressed
              ? quantized_bytes_per_element() / static_cast<double>(shape.weight_bytes_per_elem)
              : 1.0);
}

// On an accelerator: its limits measured after the run, the feeder's I/O against them and
// the floors of compute and of a decode step.
void add_device_bounds(nlohmann::json& j, const Engine& e, const BenchOptions& o,
                       const MeasuredRun& run, double decode_bytes) {
  const DeviceLimits dev = measure_device_limits(*e.backend);
  j["device_limits"] = {{"host_to_device_gbs", dev.host_to_device_gbs},
                        {"device_memory_gbs", dev.device_memory_gbs},
                        {"linear_f16_tflops", dev.linear_f16_tflops}};
  j["feed"] = feed_report(*e.model->feeder(), e.placement, dev.host_to_device_gbs,
                          run.stats.total_seconds());
  const double peak = dev.linear_f16_tflops;
  j["compute_bound_seconds"] = peak > 0 ? run.flops / (peak * 1e12) : 0;
  j["decode_device_bound"] =
      device_decode_bound(o, run.stats, e.model->cache_options(), decode_bytes,
                          dev.device_memory_gbs, run.decode_step_s);
}

// On the host: its limits measured again after the run (shared machines are noisy: the
// better of the two, so a slow moment never makes the achieved fraction look better than it
// is), and the run's fractions of the bandwidth and GEMM bounds.
void add_host_bounds(nlohmann::json& j, const Engine& e, const BenchOptions& o,
                     const MeasuredRun& run, const MachineLimits& before, double decode_bytes) {
  MachineLimits lim = measure_limits_in_child(e.cpu->threads());
  lim.memory_bandwidth_gbs = std::max(lim.memory_bandwidth_gbs, before.memory_bandwidth_gbs);
  lim.memory_read_gbs = std::max(lim.memory_read_gbs, before.memory_read_gbs);
  lim.gemm_gflops = std::max(lim.gemm_gflops, before.gemm_gflops);
  j["limits"] = nlohmann::json::parse(lim.json());
  // A decode step must read every weight once: bytes / bandwidth is its floor. Triad is
  // the conventional figure; the read-only stream is the pattern a GEMV actually has.
  const double step_s = run.decode_step_s;
  const double triad_bound_s = decode_bytes / (lim.memory_bandwidth_gbs * 1e9);
  const double read_bound_s = decode_bytes / (lim.memory_read_gbs * 1e9);
  j["decode_bandwidth_bound_step_seconds"] = triad_bound_s;
  j["decode_fraction_of_bandwidth_bound"] = step_s > 0 ? triad_bound_s / step_s : 0;
  j["decode_read_bound_step_seconds"] = read_bound_s;
  j["decode_fraction_of_read_bound"] = step_s > 0 ? read_bound_s / step_s : 0;
  j["decode_read_bound_paired"] =
      paired_decode_read_bound(*e.model, e.local, synthetic_requests(e.config, o), decode_bytes);
  const double total_s = run.stats.total_seconds();
  j["generation_fraction_of_gemm_peak"] = run.flops / total_s / 1e9 / lim.gemm_gflops;
  j["compute_bound_seconds"] = run.flops / (lim.gemm_gflops * 1e9);
}

int run_bench(BenchOptions o) {
  check_bench_options(o);
  nlohmann::json searched;
  if (o.engine.policy_auto)
    searched = choose_policy(o, o.engine.device == "host" ||
                                    (o.engine.device != "cpu" && probe_accelerators().available()));
  o.engine.max_batch = o.batch;
  const Engine e = make_engine(o.engine);
  check_workload(o, e.config);
  warm_up(e, o);
  const bool on_device = e.model->feeder() != nullptr;
  const bool host_limits = o.measure_limits && !on_device;
  MachineLimits before;
  if (host_limits) before = measure_limits_in_child(e.cpu->threads());
  const MeasuredRun run = measured_run(e, o);
  nlohmann::json j = run_json(e, o, run);
  if (!searched.is_null()) j["policy_search"] = searched;
  j["peak_rss_bytes"] = peak_rss_bytes();  // before the probes below allocate
  if (const LayerStreamer* st = e.model->streamer())
    j["disk_stream"] = disk_stream_json(st->stats(), o.engine.overlap);
  if (const ExpertStore* xs = e.model->expert_store())
    j["expert_stream"] = expert_stream_json(*xs, o.engine.disk_dir);
  const double decode_bytes = decode_weight_bytes(e.config.shape(), o.engine.policy, o.batch);
  j["decode_weight_bytes_per_step"] = decode_bytes;
  if (on_device) add_device_bounds(j, e, o, run, decode_bytes);
  if (host_limits) add_host_bounds(j, e, o, run, before, decode_bytes);
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}

}  // namespace

Command add_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd =
      app.add_subcommand("bench", "Measure generation throughput on synthetic prompts (JSON)");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--prompt-len", o->prompt_len, "Prompt tokens per sequence")->check(positive());
  cmd->add_option("--gen-len", o->gen_len, "Generated tokens per sequence")->check(positive());
  cmd->add_option("--batch", o->batch, "Sequences")->check(positive());
  cmd->add_option("--seed", o->seed, "Seed of the synthetic prompts");
  cmd->add_option("--warmup", o->warmup, "Warm-up runs before the measured one")
      ->check(non_negative());
  cmd->add_flag("!--no-limits", o->measure_limits,
                "Skip measuring memory bandwidth and GEMM peak, and the second run that times each "
                "decode step between passes of the read stream");
  cmd->add_option(
      "--hardware", o->hardware,
      "HardwareSpec JSON for --policy auto (the fields of `strata plan --format json`'s "
      "\"hardware\"; default: FlexGen's T4 figures)");
  cmd->add_flag("--compress-weight", o->compress_weight,
                "--policy auto: search with 4-bit weights");
  cmd->add_flag("--compress-cache", o->compress_cache,
                "--policy auto: search with a 4-bit KV cache (attended on the GPU)");
  cmd->add_flag("--cache-f16", o->cache_f16, "--policy auto: search with an f16 KV cache");
  cmd->add_flag("!--no-cpu-attention", o->cpu_attention,
                "--policy auto: search without CPU attention");
  return {cmd, [o] { return run_bench(*o); }};
}

}  // namespace strata::cli
