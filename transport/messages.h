// The control plane's messages as plain C++ structs, and their Cap'n Proto encoding
// (schema/control.capnp). The rest of Strata builds and reads these structs and never
// touches a capnp builder; bulk tensors never travel here (TensorChannel carries them).
//
// Who sends what:
//   coordinator -> workers : ClusterPlan (again to re-deploy), BatchUpdate, StepCommand,
//                            ProfileRequest, Shutdown, Heartbeat (ping)
//   last stage -> coordinator : StepResult (one sampled token per sequence)
//   any worker -> coordinator : ErrorReport, Heartbeat (reply), StageStats (at shutdown),
//                               ProfileReport
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "kernels/error.h"
#include "kernels/sampling.h"

namespace strata {

// Bumped when a change is not a pure addition; a peer with another version is refused.
// 2: StagePlan carries the placement, SeqStep.sample, BatchUpdate.left; 3: profiling
// (ProfileRequest / ProfileReport) and a second plan to a running worker (re-deployment);
// 4: WAA plans (encoder stages, their KV slots) and KV hand-overs (KvHandover / KvHandoverDone);
// 5: tensor-parallel stages (StagePlan::tp_ranks); 6: node inventories and budgets in the
// plan; 7: penalties, min-p and log-probabilities (Sampling, SeqJoin's tokens, SeqToken).
inline constexpr uint32_t kControlProtocolVersion = 7;
// Largest encoded control message accepted (a prefill step of many long prompts is the
// biggest); anything larger is refused before it is read.
inline constexpr size_t kMaxControlMessageBytes = size_t{64} << 20;

enum class Phase : uint8_t { kPrefill = 0, kDecode = 1 };
const char* phase_name(Phase phase);

// One pipeline stage: layers [layer_begin, layer_end) on world rank `rank`, or split over a
// tensor-parallel group (ExeGPT's partial tensor parallelism, Megatron's split of heads and
// MLP columns): `tp_ranks` in shard order, tp_ranks[0] == rank, the leader, which alone
// talks to the pipeline's other stages and to the coordinator and holds the head.
struct StagePlan {
  int32_t rank = 0;
  int32_t layer_begin = 0;
  int32_t layer_end = 0;
  bool has_embedding = false;  // the first stage embeds token ids
  bool has_head = false;       // the last stage holds the final norm, head and sampler
  bool use_gpu = false;        // the stage computes on a device (or its stand-in): its node's tier
  // Its activations go over NCCL to and from stages that do too (each on its own CUDA
  // device): those link buffers live on the device, the others in host memory.
  bool nccl = false;
  // The stage's placement (placement/stage_placement.h), decided by the planner and executed
  // by the worker: per-layer tiers of the weights and of the KV cache (values of
  // placement/tier.h's Tier: 0 gpu, 1 cpu, 2 disk; empty: no placement, the worker decides),
  // how the engine runs the stage, and the bytes per tier it allocates -- the worker checks
  // what it allocated against these.
  std::vector<uint8_t> weight_tiers;
  std::vector<uint8_t> cache_tiers;
  bool compress_weight = false;
  bool compress_cache = false;
  bool cache_f16 = false;  // the cache's elements f16 (policy cf16)
  bool cpu_attention = false;
  int32_t gpu_batch_size = 0;
  // Pie's host layers m of the stage's KV cache (its GPU-tier layers swapping through the
  // device's buffers; 0: off) and HeteGen's alpha for its CPU-tier layers (0: streamed
  // whole), both on a device stage only.
  int32_t pie_host_layers = 0;
  double hetegen_alpha = 0;
  uint64_t placed_gpu_bytes = 0;
  uint64_t placed_cpu_bytes = 0;
  uint64_t placed_disk_bytes = 0;
  std::vector<int32_t> tp_ranks;  // empty: one rank (degree 1)

  int32_t n_layers() const { return layer_end - layer_begin; }
  int32_t tp_degree() const { return tp_ranks.empty() ? 1 : static_cast<int32_t>(tp_ranks.size()); }
  // Every rank that computes this stage: the group, or `rank` alone.
  std::vector<int32_t> ranks() const { return tp_ranks.empty() ? std::vector{rank} : tp_ranks; }
  // This rank's shard index in the group; -1 when it is not a member.
  int32_t tp_index(int32_t world_rank) const;
  bool placed() const { return !weight_tiers.empty(); }
  std::string str() const;
  bool operator==(const StagePlan&) const = default;
};

struct ClusterPlan {
  uint64_t plan_id = 0;
  std::string model_spec;  // a model folder or "dummy:NAME", as `strata generate --model`
  std::vector<StagePlan> stages;
  int32_t num_layers = 0;
  int32_t hidden_size = 0;     // activation width between stages
  int32_t max_batch_rows = 0;  // rows of the largest activation buffer (fixed up front)
  int32_t micro_batches = 1;
  int32_t kv_slots = 0;
  int32_t kv_capacity = 0;
  // ExeGPT's WAA (§4.1): the first `encoder_stages` stages are a prefill (encoder) pipeline
  // over all the layers with `encoder_kv_slots` KV slots each, the rest a decode pipeline
  // over all the layers again with `kv_slots`; a sequence's KV cache moves from the one to
  // the other after its prefill (KvHandover). 0: RRA, one pipeline running both phases.
  int32_t encoder_stages = 0;
  int32_t encoder_kv_slots = 0;

  // Throws InputError when a pipeline's stages do not cover [0, num_layers) in order with
  // at least one layer each, when ranks repeat or are 0 (the coordinator), when the
  // embedding is not on a pipeline's first stage or the head not on its last, or when a
  // tensor-parallel group is malformed (fewer than two ranks, not led by the stage's rank)
  // or part of a WAA plan.
  void validate() const;
  // The stage `rank` computes (as its rank or a member of its group); nullptr: none.
  const StagePlan* stage_of_rank(int32_t rank) const;
  bool tensor_parallel() const;  // any stage split over a group
  bool waa() const { return encoder_stages > 0; }
  // The stages that run `phase`, in pipeline order: every stage (RRA), or one side (WAA).
  std::span<const StagePlan> pipeline(Phase phase) const;
  // The pipeline `stage` is part of (its neighbours are there), and its KV slots.
  std::span<const StagePlan> pipeline_of(const StagePlan& stage) const;
  bool encoder(const StagePlan& stage) const;  // a WAA prefill stage
  int32_t kv_slots_of(const StagePlan& stage) const;
  std::string str() const;
  bool operator==(const ClusterPlan&) const = default;
};

// One sequence's share of a step: n_new positions after n_past cached ones in KV `slot`.
struct SeqStep {
  uint64_t seq_id = 0;
  int32_t slot = 0;
  int32_t n_past = 0;
  int32_t n_new = 0;
  std::vector<int32_t> token_ids;  // only in the first stage's copy (n_new of them)
  // The step samples the sequence's next token: a decode, or a prompt's last chunk (a
  // prompt longer than a step's rows is prefilled in chunks; only the last one samples).
  bool sample = true;

  std::string str() const;
  bool operator==(const SeqStep&) const = default;
};

struct StepCommand {
  uint64_t step_id = 0;
  Phase phase = Phase::kDecode;
  int32_t micro_batch = 0;
  std::vector<SeqStep> seqs;

  int32_t rows() const;  // activation rows this step moves between stages (sum of n_new)
  std::string str() const;
  bool operator==(const StepCommand&) const = default;
};

struct SeqJoin {
  uint64_t seq_id = 0;
  int32_t slot = 0;
  SamplingParams sampling;  // used by the last stage
  // What its penalties count, when it has any (SamplingParams::uses_history): the prompt and
  // the tokens generated before this join (the first token, after a WAA hand-over).
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> output_ids;

  std::string str() const;
  bool operator==(const SeqJoin& o) const;
};

// Batch membership at the last stage, which samples: sequences that join (before their
// first step) and leave (finished, preempted or evicted: their sampling state goes).
struct BatchUpdate {
  std::vector<SeqJoin> joined;
  std::vector<uint64_t> left;

  std::string str() const;
  bool operator==(const BatchUpdate&) const = default;
};

struct SeqToken {
  uint64_t seq_id = 0;
  int32_t token = 0;
  // Set when the sequence asked for log-probabilities (SamplingParams::logprobs >= 0).
  std::optional<Logprobs> logprobs;
  bool operator==(const SeqToken&) const = default;
};

// The last stage's answer to a step: the token sampled for each sequence that samples
// (SeqStep::sample), in the step's order.
struct StepResult {
  uint64_t step_id = 0;
  int32_t micro_batch = 0;
  std::vector<SeqToken> tokens;

  std::string str() const;
  bool operator==(const StepResult&) const = default;
};

struct Shutdown {
  std::string reason;

  std::string str() const;
  bool operator==(const Shutdown&) const = default;
};

// A failure on a rank, sent to the coordinator so it can say which rank failed and how.
struct ErrorReport {
  int32_t rank = 0;
  ErrorKind kind = ErrorKind::kFailed;
  std::string message;
  uint64_t step_id = 0;

  static ErrorReport from(const Error& error, int32_t rank, uint64_t step_id = 0);
  [[noreturn]] void raise() const;  // throws Error(kind, "rank R: message")
  std::string str() const;
  bool operator==(const ErrorReport&) const = default;
};

// A stage's time from its first step to its last: busy (computing and sending), idle
// (waiting for a command or for activations). Sent once, in answer to Shutdown.
struct StageStats {
  int32_t rank = 0;
  uint64_t steps = 0;
  uint64_t rows = 0;
  double busy_seconds = 0;
  double idle_seconds = 0;
  double window_seconds = 0;  // first step start to last step end
  // Weight bytes brought to the compute device from the host (FlexGen's CPU tier) and read
  // from disk (its disk tier), over the steps so far.
  uint64_t bytes_from_cpu = 0;
  uint64_t bytes_from_disk = 0;
  // Each step's [start, end], pairs of system-clock seconds (ranks on one host, or on hosts
  // kept in step by NTP, line up: a per-stage timeline), up to kMaxStepSpans steps; the
  // steps after those are counted. Sent with the final statistics, not in heartbeats.
  std::vector<double> step_spans;
  uint64_t step_spans_dropped = 0;
  // What the stage allocated per tier (its placement, link buffers included), and the
  // process's resident memory just before it loaded (VmRSS), its peak while it loaded and
  // its peak since (VmHWM): the budget a node was given, as the kernel counts it.
  uint64_t allocated_gpu_bytes = 0;
  uint64_t allocated_cpu_bytes = 0;
  uint64_t allocated_disk_bytes = 0;
  uint64_t rss_before_load_bytes = 0;
  uint64_t load_peak_rss_bytes = 0;
  uint64_t peak_rss_bytes = 0;
  static constexpr size_t kMaxStepSpans = 20000;
  void add_span(double start, double end);  // or count it, past kMaxStepSpans

  std::string str() const;
  bool operator==(const StageStats&) const = default;
};

// Liveness: the coordinator pings (reply = false), a worker answers (reply = true) with
// its statistics so far (the live metrics of `serve --metrics-port`).
struct Heartbeat {
  int32_t rank = 0;
  uint64_t sequence = 0;
  bool reply = false;
  std::optional<StageStats> stats;

  std::string str() const;
  bool operator==(const Heartbeat&) const = default;
};

// The coordinator asks every stage to time its part (ExeGPT's XProfiler,
// coordinator/exegpt/profiler.h): its layers on synthetic prefill steps (each of prefill_rows x
// prefill_lengths) and decode steps (decode_seqs x decode_contexts), its embedding
// (embed_rows) and head (head_rows) where it holds them, and sending transfer_rows rows of
// activations to the next stage; the fastest of `repeats` runs each.
struct ProfileRequest {
  std::vector<int32_t> prefill_rows, prefill_lengths;
  std::vector<int32_t> decode_seqs, decode_contexts;
  std::vector<int32_t> embed_rows, head_rows;
  int32_t repeats = 3;
  std::vector<int32_t> transfer_rows;

  std::string str() const;
  bool operator==(const ProfileRequest&) const = default;
};

// A stage's answer: seconds per layer at every prefill and decode point (row-major over
// the request's grids), of its embedding and head per point (empty where it has none),
// of sending each transfer size to the next stage (empty on the last).
struct ProfileReport {
  int32_t rank = 0;
  std::string host;
  int32_t layers = 0;
  std::vector<double> prefill_seconds, decode_seconds;
  std::vector<double> embed_seconds, head_seconds;
  std::vector<double> transfer_seconds;

  std::string str() const;
  bool operator==(const ProfileReport&) const = default;
};

// One sequence's KV cache handed from a prefill stage's slot to a decode stage's (WAA): its
// first `positions` positions, every layer the two stages share.
struct KvMove {
  uint64_t seq_id = 0;
  int32_t from_slot = 0;  // on the prefill (encoder) stages
  int32_t to_slot = 0;    // on the decode stages
  int32_t positions = 0;

  std::string str() const;
  bool operator==(const KvMove&) const = default;
};

// WAA's hand-over (§3, §4.1): sent to every stage of both pipelines once the prefill of
// `moves` has sampled their first tokens. Each prefill stage sends the KV of its layers to
// every decode stage that holds some of them (transport/tensor_channel.h, its own tag), in
// handover_id order; each decode stage stores what it receives between its steps and says
// KvHandoverDone, as does each prefill stage once its sends are delivered. `joins` (the
// decode pipeline's last stage) carry the sampling of the sequences, which have sampled
// one token already.
struct KvHandover {
  uint64_t handover_id = 0;
  std::vector<KvMove> moves;
  std::vector<SeqJoin> joins;

  std::string str() const;
  bool operator==(const KvHandover&) const = default;
};

struct KvHandoverDone {
  uint64_t handover_id = 0;
  int32_t rank = 0;
  uint64_t bytes = 0;  // KV bytes this stage sent or received for the hand-over

  std::string str() const;
  bool operator==(const KvHandoverDone&) const = default;
};

using ControlMessage =
    std::variant<ClusterPlan, StepCommand, BatchUpdate, StepResult, Shutdown, ErrorReport,
                 Heartbeat, StageStats, ProfileRequest, ProfileReport, KvHandover, KvHandoverDone>;

const char* message_name(const ControlMessage& message);  // "plan", "step", ...
std::string str(const ControlMessage& message);

// Cap'n Proto flat-array encoding (8-byte aligned words), prefixed by the version field.
std::vector<std::byte> encode(const ControlMessage& message);
// Throws Error(kFailed) on bytes that are not a valid message of this protocol version
// (truncated, corrupt, unknown type or enum value); never crashes on any input.
ControlMessage decode(std::span<const std::byte> bytes);

}  // namespace strata
