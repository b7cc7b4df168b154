# The control plane between the coordinator (rank 0) and the pipeline-stage workers.
# Rules (a versioned protocol, docs/TRANSPORT.md): this schema only grows -- a new field takes
# the next ordinal, no field is renumbered or removed -- and bulk tensors never go here (they
# go through TensorChannel).
# Enums crossing the wire are mirrored in transport/messages.h and checked there with
# static_assert, so a reordering breaks the build instead of the protocol.
@0xfdb15e4bf9359fd1;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("strata::wire");

enum Phase {
  prefill @0;
  decode @1;
}

enum ErrorKind {
  failed @0;
  overloaded @1;
  disconnected @2;
  unimplemented @3;
  invalidInput @4;
}

enum FinishReason {
  eos @0;
  length @1;
  context @2;
  error @3;
  cancelled @4;
  preempted @5;
  stop @6;
}

# One pipeline stage: the layers [layerBegin, layerEnd) run on `rank`.
struct Stage {
  rank @0 :Int32;
  layerBegin @1 :Int32;
  layerEnd @2 :Int32;
  hasEmbedding @3 :Bool;
  hasHead @4 :Bool;
  # @5-@7 were per-tier budgets no rank read (protocol 6: the placement below is checked
  # against them by the planner, which alone knows them).
  unusedGpuMemBytes @5 :UInt64;
  unusedCpuMemBytes @6 :UInt64;
  unusedDiskMemBytes @7 :UInt64;
  useGpu @8 :Bool;
  # The placement (protocol 2): per-layer tiers (0 gpu, 1 cpu, 2 disk) of the weights and
  # the KV cache, how the stage runs, and the bytes per tier the worker must allocate.
  weightTiers @9 :List(UInt8);
  cacheTiers @10 :List(UInt8);
  compressWeight @11 :Bool;
  compressCache @12 :Bool;
  cpuAttention @13 :Bool;
  gpuBatchSize @14 :Int32;
  placedGpuBytes @15 :UInt64;
  placedCpuBytes @16 :UInt64;
  placedDiskBytes @17 :UInt64;
  # Partial tensor parallelism (protocol 5): the ranks that split this stage's layers, in
  # shard order, the first being `rank`; empty: the stage is one rank.
  tpRanks @18 :List(Int32);
  # The KV cache's elements in f16 (policy cf16; protocol 6).
  cacheF16 @19 :Bool;
  # The stage's activations go over NCCL (protocol 6).
  nccl @20 :Bool;
  # Pie's host layers and HeteGen's alpha (protocol 6; 0: off).
  pieHostLayers @21 :Int32;
  hetegenAlpha @22 :Float64;
}

struct Plan {
  planId @0 :UInt64;
  modelSpec @1 :Text;
  stages @2 :List(Stage);
  numLayers @3 :Int32;
  hiddenSize @4 :Int32;
  maxBatchRows @5 :Int32;
  microBatches @6 :Int32;
  kvSlots @7 :Int32;
  kvCapacity @8 :Int32;
  # WAA (protocol 4): the first encoderStages stages are the prefill pipeline.
  encoderStages @9 :Int32;
  encoderKvSlots @10 :Int32;
}

struct SeqStep {
  seqId @0 :UInt64;
  slot @1 :Int32;
  nPast @2 :Int32;
  nNew @3 :Int32;
  tokenIds @4 :List(Int32);
  # The step samples this sequence's next token (false: a prompt chunk before its last).
  sample @5 :Bool = true;
}

struct StepCommand {
  stepId @0 :UInt64;
  phase @1 :Phase;
  microBatch @2 :Int32;
  seqs @3 :List(SeqStep);
}

struct Sampling {
  temperature @0 :Float32;
  topK @1 :Int32;
  topP @2 :Float32;
  seed @3 :UInt64;
  minP @4 :Float32;
  presencePenalty @5 :Float32;
  frequencyPenalty @6 :Float32;
  repetitionPenalty @7 :Float32 = 1.0;
  logprobs @8 :Int32 = -1;
}

struct SeqJoin {
  seqId @0 :UInt64;
  slot @1 :Int32;
  sampling @2 :Sampling;
  # The tokens the penalties count (only when the sampling has penalties): the prompt, and
  # what the sequence generated before it joined this stage (a WAA hand-over).
  promptIds @3 :List(Int32);
  outputIds @4 :List(Int32);
}

struct BatchUpdate {
  joined @0 :List(SeqJoin);
  left @1 :List(UInt64);
}

struct TokenLogprob {
  token @0 :Int32;
  logprob @1 :Float32;
}

struct SeqToken {
  seqId @0 :UInt64;
  token @1 :Int32;
  # With Sampling.logprobs >= 0: the token's log-probability and the top alternatives.
  hasLogprob @2 :Bool;
  logprob @3 :Float32;
  top @4 :List(TokenLogprob);
}

struct StepResult {
  stepId @0 :UInt64;
  microBatch @1 :Int32;
  tokens @2 :List(SeqToken);
}

struct Finished {
  seqId @0 :UInt64;
  reason @1 :FinishReason;
}

struct FinishedSequences {
  seqs @0 :List(Finished);
}

struct Shutdown {
  reason @0 :Text;
}

struct ErrorReport {
  rank @0 :Int32;
  kind @1 :ErrorKind;
  message @2 :Text;
  stepId @3 :UInt64;
}

struct Heartbeat {
  rank @0 :Int32;
  sequence @1 :UInt64;
  reply @2 :Bool;
  # A worker's reply: its account of its time and traffic so far (live metrics).
  stats @3 :StageStats;
}

# A stage's own account of its time, sent once when it shuts down (observability).
struct StageStats {
  rank @0 :Int32;
  steps @1 :UInt64;
  rows @2 :UInt64;
  busySeconds @3 :Float64;
  idleSeconds @4 :Float64;
  windowSeconds @5 :Float64;
  bytesFromCpu @6 :UInt64;
  bytesFromDisk @7 :UInt64;
  stepSpans @8 :List(Float64);
  stepSpansDropped @9 :UInt64;
  # What the stage allocated per tier, and the process's resident memory before it loaded,
  # its peak while loading and its peak since (protocol 6).
  allocatedGpuBytes @10 :UInt64;
  allocatedCpuBytes @11 :UInt64;
  allocatedDiskBytes @12 :UInt64;
  rssBeforeLoadBytes @13 :UInt64;
  peakRssBytes @14 :UInt64;
  loadPeakRssBytes @15 :UInt64;
}

# The coordinator asks every stage to time its part (protocol 3): its layers on synthetic
# prefill steps (rows x sequence length) and decode steps (sequences x context), its
# embedding and head where it holds them, and sending activations to the next stage.
struct ProfileRequest {
  prefillRows @0 :List(Int32);
  prefillLengths @1 :List(Int32);
  decodeSeqs @2 :List(Int32);
  decodeContexts @3 :List(Int32);
  embedRows @4 :List(Int32);
  headRows @5 :List(Int32);
  repeats @6 :Int32;
  transferRows @7 :List(Int32);
}

# A stage's answer: seconds of one of its layers at every prefill and decode point
# (row-major), of its embedding and head at every point (empty where it has none), and of
# sending each transfer size to the next stage (empty on the last).
struct ProfileReport {
  rank @0 :Int32;
  host @1 :Text;
  layers @2 :Int32;
  prefillSeconds @3 :List(Float64);
  decodeSeconds @4 :List(Float64);
  embedSeconds @5 :List(Float64);
  headSeconds @6 :List(Float64);
  transferSeconds @7 :List(Float64);
}

# WAA's KV hand-over (protocol 4): the bytes go over the tensor channel, not here.
struct KvMove {
  seqId @0 :UInt64;
  fromSlot @1 :Int32;
  toSlot @2 :Int32;
  positions @3 :Int32;
}

struct KvHandover {
  handoverId @0 :UInt64;
  moves @1 :List(KvMove);
  joins @2 :List(SeqJoin);
}

struct KvHandoverDone {
  handoverId @0 :UInt64;
  rank @1 :Int32;
  bytes @2 :UInt64;
}

struct ControlMessage {
  version @0 :UInt32;
  body :union {
    plan @1 :Plan;
    step @2 :StepCommand;
    batch @3 :BatchUpdate;
    result @4 :StepResult;
    finished @5 :FinishedSequences;  # protocol 1 only; since 2 BatchUpdate.left says it
    shutdown @6 :Shutdown;
    error @7 :ErrorReport;
    heartbeat @8 :Heartbeat;
    stats @9 :StageStats;
    profile @10 :ProfileRequest;
    profileReport @11 :ProfileReport;
    kvHandover @12 :KvHandover;
    kvHandoverDone @13 :KvHandoverDone;
  }
}
