#include "transport/messages.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "transport/schema/control.capnp.h"

namespace strata {

// Enum values cross the wire as numbers: the C++ and schema enums must agree, or the
// protocol changes without its version (docs/TRANSPORT.md, "Messages").
static_assert(static_cast<int>(wire::Phase::PREFILL) == static_cast<int>(Phase::kPrefill));
static_assert(static_cast<int>(wire::Phase::DECODE) == static_cast<int>(Phase::kDecode));
static_assert(static_cast<int>(wire::ErrorKind::FAILED) == static_cast<int>(ErrorKind::kFailed));
static_assert(static_cast<int>(wire::ErrorKind::OVERLOADED) ==
              static_cast<int>(ErrorKind::kOverloaded));
static_assert(static_cast<int>(wire::ErrorKind::DISCONNECTED) ==
              static_cast<int>(ErrorKind::kDisconnected));
static_assert(static_cast<int>(wire::ErrorKind::UNIMPLEMENTED) ==
              static_cast<int>(ErrorKind::kUnimplemented));
static_assert(static_cast<int>(wire::ErrorKind::INVALID_INPUT) ==
              static_cast<int>(ErrorKind::kInvalidInput));

namespace {

constexpr size_t kMaxListedItems = 8;  // str() of long lists shows the first few

template <typename T, typename F>
std::string list_str(const std::vector<T>& items, F&& item_str) {
  std::string out = "[";
  for (size_t i = 0; i < items.size() && i < kMaxListedItems; ++i) {
    out += (i ? ", " : "") + item_str(items[i]);
  }
  if (items.size() > kMaxListedItems)
    out += fmt::format(", ... {} more", items.size() - kMaxListedItems);
  return out + "]";
}

std::string mib(uint64_t bytes) {
  return fmt::format("{:.0f} MiB", bytes / 1048576.0);
}

[[noreturn]] void fail_malformed(const std::string& why) {
  fail(ErrorKind::kFailed, "malformed control message: {}", why);
}

// A wire enum value outside the known range (a corrupt message or a newer peer).
template <typename To, typename From>
To enum_from_wire(From value, To last, const char* field) {
  const auto raw = static_cast<uint16_t>(value);
  if (raw > static_cast<uint16_t>(last))
    fail_malformed(fmt::format("{} = {} is not a known value", field, raw));
  return static_cast<To>(raw);
}

capnp::Text::Reader text(const std::string& s) {
  return capnp::Text::Reader(s.c_str(), s.size());
}
std::string text(capnp::Text::Reader r) {
  return std::string(r.cStr(), r.size());
}

}  // namespace

const char* phase_name(Phase phase) {
  return phase == Phase::kPrefill ? "prefill" : "decode";
}

// ---- printing ----

namespace {
// "ggcd": one letter per layer (g gpu, c cpu, d disk).
std::string tiers_str(const std::vector<uint8_t>& tiers) {
  std::string out;
  for (uint8_t t : tiers) out += t == 0 ? 'g' : t == 1 ? 'c' : t == 2 ? 'd' : '?';
  return out;
}
}  // namespace

int32_t StagePlan::tp_index(int32_t world_rank) const {
  const std::vector<int32_t> all = ranks();
  const auto it = std::find(all.begin(), all.end(), world_rank);
  return it == all.end() ? -1 : static_cast<int32_t>(it - all.begin());
}

std::string StagePlan::str() const {
  return (tp_ranks.empty()
              ? fmt::format("rank {}", rank)
              : fmt::format("ranks {} (TP {})", fmt::join(tp_ranks, "+"), tp_ranks.size())) +
         fmt::format(": layers [{}, {}){}{} {}", layer_begin, layer_end,
                     has_embedding ? " +embedding" : "", has_head ? " +head" : "",
                     use_gpu ? "on gpu" : "on cpu") +
         (placed()
              ? fmt::format(" placed: weights {} cache {} gpu {} cpu {} disk {}{}{}{}{}{}{}",
                            tiers_str(weight_tiers), tiers_str(cache_tiers), mib(placed_gpu_bytes),
                            mib(placed_cpu_bytes), mib(placed_disk_bytes),
                            compress_weight ? " cw" : "", compress_cache ? " cc" : "",
                            cache_f16 ? " cf16" : "", cpu_attention ? " cpu_attn" : "",
                            pie_host_layers > 0 ? fmt::format(" pie={}", pie_host_layers) : "",
                            hetegen_alpha > 0 ? fmt::format(" hetegen={}", hetegen_alpha) : "")
              : "");
}

std::string ClusterPlan::str() const {
  return fmt::format(
      "plan {} model={} layers={} hidden={} max_rows={} micro_batches={} kv={}x{}{} stages={}",
      plan_id, model_spec, num_layers, hidden_size, max_batch_rows, micro_batches, kv_slots,
      kv_capacity,
      waa() ? fmt::format(" WAA: {} prefill stages with {} KV slots", encoder_stages,
                          encoder_kv_slots)
            : "",
      list_str(stages, [](const StagePlan& s) { return s.str(); }));
}

std::string SeqStep::str() const {
  return fmt::format("seq {} slot {} past {} new {}{}{}", seq_id, slot, n_past, n_new,
                     token_ids.empty() ? "" : fmt::format(" tokens {}", token_ids.size()),
                     sample ? "" : " (no sample)");
}

int32_t StepCommand::rows() const {
  int32_t rows = 0;
  for (const SeqStep& s : seqs) rows += s.n_new;
  return rows;
}

std::string StepCommand::str() const {
  return fmt::format("step {} {} micro_batch {} rows {} seqs {}", step_id, phase_name(phase),
                     micro_batch, rows(), list_str(seqs, [](const SeqStep& s) { return s.str(); }));
}

std::string SeqJoin::str() const {
  return fmt::format("seq {} slot {} {}", seq_id, slot, sampling.str());
}

bool SeqJoin::operator==(const SeqJoin& o) const {
  return seq_id == o.seq_id && slot == o.slot && sampling == o.sampling &&
         prompt_ids == o.prompt_ids && output_ids == o.output_ids;
}

std::string BatchUpdate::str() const {
  return fmt::format("batch joined {} left {}",
                     list_str(joined, [](const SeqJoin& j) { return j.str(); }),
                     list_str(left, [](uint64_t id) { return fmt::format("{}", id); }));
}

std::string StepResult::str() const {
  return fmt::format(
      "result of step {} micro_batch {} tokens {}", step_id, micro_batch,
      list_str(tokens, [](const SeqToken& t) { return fmt::format("{}:{}", t.seq_id, t.token); }));
}

std::string Shutdown::str() const {
  return fmt::format("shutdown ({})", reason);
}

ErrorReport ErrorReport::from(const Error& error, int32_t rank, uint64_t step_id) {
  return ErrorReport{rank, error.kind(), error.what(), step_id};
}

void ErrorReport::raise() const {
  throw Error(kind, fmt::format("rank {}: {}", rank, message));
}

std::string ErrorReport::str() const {
  return fmt::format("error on rank {} at step {} ({}): {}", rank, step_id, error_kind_name(kind),
                     message);
}

std::string Heartbeat::str() const {
  return fmt::format("heartbeat {} {} rank {}", reply ? "reply" : "ping", sequence, rank);
}

void StageStats::add_span(double start, double end) {
  if (step_spans.size() >= 2 * kMaxStepSpans) {
    ++step_spans_dropped;
    return;
  }
  step_spans.push_back(start);
  step_spans.push_back(end);
}

std::string StageStats::str() const {
  return fmt::format(
      "stats of rank {}: {} steps, {} rows, busy {:.3f} s, idle {:.3f} s of {:.3f} s, {} bytes "
      "from cpu, {} from disk",
      rank, steps, rows, busy_seconds, idle_seconds, window_seconds, bytes_from_cpu,
      bytes_from_disk);
}

std::string ProfileRequest::str() const {
  return fmt::format(
      "profile request: prefill {} x {}, decode {} x {}, embedding {}, head {}, transfers {}, "
      "{} repeats",
      prefill_rows.size(), prefill_lengths.size(), decode_seqs.size(), decode_contexts.size(),
      embed_rows.size(), head_rows.size(), transfer_rows.size(), repeats);
}

std::string ProfileReport::str() const {
  return fmt::format("profile of rank {} on {} ({} layers): {} prefill, {} decode points", rank,
                     host, layers, prefill_seconds.size(), decode_seconds.size());
}

std::string KvMove::str() const {
  return fmt::format("seq {} slot {} -> {} ({} positions)", seq_id, from_slot, to_slot, positions);
}

std::string KvHandover::str() const {
  return fmt::format("kv hand-over {} of {}", handover_id,
                     list_str(moves, [](const KvMove& m) { return m.str(); }));
}

std::string KvHandoverDone::str() const {
  return fmt::format("kv hand-over {} done on rank {} ({} bytes)", handover_id, rank, bytes);
}

const char* message_name(const ControlMessage& message) {
  static constexpr const char* kNames[] = {
      "plan",      "step",  "batch",   "result",         "shutdown",     "error",
      "heartbeat", "stats", "profile", "profile report", "kv hand-over", "kv hand-over done"};
  static_assert(std::size(kNames) == std::variant_size_v<ControlMessage>);
  return kNames[message.index()];
}

std::string str(const ControlMessage& message) {
  return std::visit([](const auto& m) { return m.str(); }, message);
}

// ---- validation ----

namespace {

// One pipeline's stages (all of an RRA plan, one side of a WAA plan) cover the layers in
// order, embedding first and head last.
void validate_pipeline(const ClusterPlan& p, std::span<const StagePlan> stages, const char* which) {
  if (stages.empty()) fail_input("plan {}: no {} stages", p.plan_id, which);
  if (p.num_layers < static_cast<int32_t>(stages.size())) {
    fail_input("plan {}: {} stages but the model has only {} layers; each stage needs one ({})",
               p.plan_id, stages.size(), p.num_layers, which);
  }
  int32_t next = 0;
  for (size_t i = 0; i < stages.size(); ++i) {
    const StagePlan& s = stages[i];
    if (s.layer_begin != next || s.layer_end <= s.layer_begin) {
      fail_input("plan {}: {} stage {} has layers [{}, {}), expected [{}, ...) with at least one",
                 p.plan_id, which, i, s.layer_begin, s.layer_end, next);
    }
    if (s.has_embedding != (i == 0))
      fail_input("plan {}: the embedding must be on the first stage only ({} stages)", p.plan_id,
                 which);
    if (s.has_head != (i + 1 == stages.size()))
      fail_input("plan {}: the head must be on the last stage only ({} stages)", p.plan_id, which);
    next = s.layer_end;
  }
  if (next != p.num_layers)
    fail_input("plan {}: {} stages cover {} of {} layers", p.plan_id, which, next, p.num_layers);
}

}  // namespace

std::span<const StagePlan> ClusterPlan::pipeline(Phase phase) const {
  const std::span<const StagePlan> all(stages);
  if (!waa()) return all;
  const auto e = static_cast<size_t>(encoder_stages);
  return phase == Phase::kPrefill ? all.first(e) : all.subspan(e);
}

bool ClusterPlan::encoder(const StagePlan& stage) const {
  if (!waa()) return false;
  const std::span<const StagePlan> prefill = pipeline(Phase::kPrefill);
  return std::any_of(prefill.begin(), prefill.end(),
                     [&](const StagePlan& s) { return s.rank == stage.rank; });
}

std::span<const StagePlan> ClusterPlan::pipeline_of(const StagePlan& stage) const {
  return pipeline(encoder(stage) ? Phase::kPrefill : Phase::kDecode);
}

int32_t ClusterPlan::kv_slots_of(const StagePlan& stage) const {
  return encoder(stage) ? encoder_kv_slots : kv_slots;
}

void ClusterPlan::validate() const {
  if (stages.empty()) fail_input("plan {}: no stages", plan_id);
  if (encoder_stages < 0 || encoder_stages >= static_cast<int32_t>(stages.size()))
    fail_input("plan {}: {} encoder stages of {}: WAA needs at least one stage on each side",
               plan_id, encoder_stages, stages.size());
  if (waa() && encoder_kv_slots <= 0)
    fail_input("plan {}: WAA's encoder stages need KV slots, got {}", plan_id, encoder_kv_slots);
  if (waa()) {
    validate_pipeline(*this, pipeline(Phase::kPrefill), "prefill");
    validate_pipeline(*this, pipeline(Phase::kDecode), "decode");
  } else {
    validate_pipeline(*this, stages, "pipeline");
  }
  std::set<int32_t> ranks;
  for (size_t i = 0; i < stages.size(); ++i) {
    const StagePlan& s = stages[i];
    if (!s.tp_ranks.empty() && (s.tp_ranks.size() < 2 || s.tp_ranks[0] != s.rank))
      fail_input(
          "plan {}: stage {}'s tensor-parallel group [{}] must hold two or more ranks led "
          "by the stage's rank {}",
          plan_id, i, fmt::join(s.tp_ranks, ", "), s.rank);
    if (!s.tp_ranks.empty() && waa())
      fail_input(
          "plan {}: stage {} is tensor-parallel in a WAA plan (KV hand-over between "
          "tensor-parallel groups is not built)",
          plan_id, i);
    for (int32_t r : s.ranks()) {
      if (r <= 0) fail_input("plan {}: stage {} on rank {} (rank 0 coordinates)", plan_id, i, r);
      if (!ranks.insert(r).second) fail_input("plan {}: rank {} holds two stages", plan_id, r);
    }
    if (s.placed() || !s.cache_tiers.empty()) {
      const auto n = static_cast<size_t>(s.n_layers());
      if (s.weight_tiers.size() != n || s.cache_tiers.size() != n)
        fail_input("plan {}: stage {} places {} weight and {} cache layers of its {}", plan_id, i,
                   s.weight_tiers.size(), s.cache_tiers.size(), n);
      for (const auto* tiers : {&s.weight_tiers, &s.cache_tiers})
        for (uint8_t t : *tiers)
          if (t > 2) fail_input("plan {}: stage {} places a layer on tier {} (0-2)", plan_id, i, t);
      if (s.gpu_batch_size < 0)
        fail_input("plan {}: stage {} has GPU batch size {}", plan_id, i, s.gpu_batch_size);
    }
  }
}

const StagePlan* ClusterPlan::stage_of_rank(int32_t r) const {
  for (const StagePlan& s : stages) {
    if (s.tp_index(r) >= 0) return &s;
  }
  return nullptr;
}

bool ClusterPlan::tensor_parallel() const {
  return std::any_of(stages.begin(), stages.end(),
                     [](const StagePlan& s) { return s.tp_degree() > 1; });
}

// ---- encoding ----

namespace {

void write_stage(wire::Stage::Builder b, const StagePlan& s) {
  b.setRank(s.rank);
  b.setLayerBegin(s.layer_begin);
  b.setLayerEnd(s.layer_end);
  b.setHasEmbedding(s.has_embedding);
  b.setHasHead(s.has_head);
  b.setUseGpu(s.use_gpu);
  b.setNccl(s.nccl);
  auto wt = b.initWeightTiers(static_cast<unsigned>(s.weight_tiers.size()));
  for (unsigned i = 0; i < wt.size(); ++i) wt.set(i, s.weight_tiers[i]);
  auto ct = b.initCacheTiers(static_cast<unsigned>(s.cache_tiers.size()));
  for (unsigned i = 0; i < ct.size(); ++i) ct.set(i, s.cache_tiers[i]);
  b.setCompressWeight(s.compress_weight);
  b.setCompressCache(s.compress_cache);
  b.setCacheF16(s.cache_f16);
  b.setCpuAttention(s.cpu_attention);
  b.setGpuBatchSize(s.gpu_batch_size);
  b.setPieHostLayers(s.pie_host_layers);
  b.setHetegenAlpha(s.hetegen_alpha);
  b.setPlacedGpuBytes(s.placed_gpu_bytes);
  b.setPlacedCpuBytes(s.placed_cpu_bytes);
  b.setPlacedDiskBytes(s.placed_disk_bytes);
  b.setTpRanks(kj::ArrayPtr<const int32_t>(s.tp_ranks.data(), s.tp_ranks.size()));
}

void write(wire::Plan::Builder b, const ClusterPlan& p) {
  b.setPlanId(p.plan_id);
  b.setModelSpec(text(p.model_spec));
  auto stages = b.initStages(static_cast<unsigned>(p.stages.size()));
  for (size_t i = 0; i < p.stages.size(); ++i) write_stage(stages[i], p.stages[i]);
  b.setNumLayers(p.num_layers);
  b.setHiddenSize(p.hidden_size);
  b.setMaxBatchRows(p.max_batch_rows);
  b.setMicroBatches(p.micro_batches);
  b.setKvSlots(p.kv_slots);
  b.setKvCapacity(p.kv_capacity);
  b.setEncoderStages(p.encoder_stages);
  b.setEncoderKvSlots(p.encoder_kv_slots);
}

void write(wire::StepCommand::Builder b, const StepCommand& c) {
  b.setStepId(c.step_id);
  b.setPhase(static_cast<wire::Phase>(c.phase));
  b.setMicroBatch(c.micro_batch);
  auto seqs = b.initSeqs(static_cast<unsigned>(c.seqs.size()));
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    const SeqStep& s = c.seqs[i];
    seqs[i].setSeqId(s.seq_id);
    seqs[i].setSlot(s.slot);
    seqs[i].setNPast(s.n_past);
    seqs[i].setNNew(s.n_new);
    seqs[i].setSample(s.sample);
    seqs[i].setTokenIds(kj::ArrayPtr<const int32_t>(s.token_ids.data(), s.token_ids.size()));
  }
}

template <typename Joins>
void write_joins(Joins&& joined, const std::vector<SeqJoin>& joins) {
  for (size_t i = 0; i < joins.size(); ++i) {
    const SeqJoin& j = joins[i];
    joined[static_cast<unsigned>(i)].setSeqId(j.seq_id);
    joined[static_cast<unsigned>(i)].setSlot(j.slot);
    auto s = joined[static_cast<unsigned>(i)].initSampling();
    s.setTemperature(j.sampling.temperature);
    s.setTopK(j.sampling.top_k);
    s.setTopP(j.sampling.top_p);
    s.setSeed(j.sampling.seed);
    s.setMinP(j.sampling.min_p);
    s.setPresencePenalty(j.sampling.presence_penalty);
    s.setFrequencyPenalty(j.sampling.frequency_penalty);
    s.setRepetitionPenalty(j.sampling.repetition_penalty);
    s.setLogprobs(j.sampling.logprobs);
    joined[static_cast<unsigned>(i)].setPromptIds(
        kj::ArrayPtr<const int32_t>(j.prompt_ids.data(), j.prompt_ids.size()));
    joined[static_cast<unsigned>(i)].setOutputIds(
        kj::ArrayPtr<const int32_t>(j.output_ids.data(), j.output_ids.size()));
  }
}

void write(wire::BatchUpdate::Builder b, const BatchUpdate& u) {
  write_joins(b.initJoined(static_cast<unsigned>(u.joined.size())), u.joined);
  b.setLeft(kj::ArrayPtr<const uint64_t>(u.left.data(), u.left.size()));
}

void write(wire::KvHandover::Builder b, const KvHandover& h) {
  b.setHandoverId(h.handover_id);
  auto moves = b.initMoves(static_cast<unsigned>(h.moves.size()));
  for (size_t i = 0; i < h.moves.size(); ++i) {
    const KvMove& m = h.moves[i];
    moves[static_cast<unsigned>(i)].setSeqId(m.seq_id);
    moves[static_cast<unsigned>(i)].setFromSlot(m.from_slot);
    moves[static_cast<unsigned>(i)].setToSlot(m.to_slot);
    moves[static_cast<unsigned>(i)].setPositions(m.positions);
  }
  write_joins(b.initJoins(static_cast<unsigned>(h.joins.size())), h.joins);
}

void write(wire::KvHandoverDone::Builder b, const KvHandoverDone& d) {
  b.setHandoverId(d.handover_id);
  b.setRank(d.rank);
  b.setBytes(d.bytes);
}

void write(wire::StepResult::Builder b, const StepResult& r) {
  b.setStepId(r.step_id);
  b.setMicroBatch(r.micro_batch);
  auto tokens = b.initTokens(static_cast<unsigned>(r.tokens.size()));
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    const auto k = static_cast<unsigned>(i);
    tokens[k].setSeqId(r.tokens[i].seq_id);
    tokens[k].setToken(r.tokens[i].token);
    if (!r.tokens[i].logprobs) continue;
    const Logprobs& l = *r.tokens[i].logprobs;
    tokens[k].setHasLogprob(true);
    tokens[k].setLogprob(l.logprob);
    auto top = tokens[k].initTop(static_cast<unsigned>(l.top.size()));
    for (size_t t = 0; t < l.top.size(); ++t) {
      top[static_cast<unsigned>(t)].setToken(l.top[t].token);
      top[static_cast<unsigned>(t)].setLogprob(l.top[t].logprob);
    }
  }
}

void write(wire::ErrorReport::Builder b, const ErrorReport& e) {
  b.setRank(e.rank);
  b.setKind(static_cast<wire::ErrorKind>(e.kind));
  b.setMessage(text(e.message));
  b.setStepId(e.step_id);
}

void write(wire::StageStats::Builder b, const StageStats& s) {
  b.setRank(s.rank);
  b.setSteps(s.steps);
  b.setRows(s.rows);
  b.setBusySeconds(s.busy_seconds);
  b.setIdleSeconds(s.idle_seconds);
  b.setWindowSeconds(s.window_seconds);
  b.setBytesFromCpu(s.bytes_from_cpu);
  b.setBytesFromDisk(s.bytes_from_disk);
  auto spans = b.initStepSpans(static_cast<unsigned>(s.step_spans.size()));
  for (size_t i = 0; i < s.step_spans.size(); ++i)
    spans.set(static_cast<unsigned>(i), s.step_spans[i]);
  b.setStepSpansDropped(s.step_spans_dropped);
  b.setAllocatedGpuBytes(s.allocated_gpu_bytes);
  b.setAllocatedCpuBytes(s.allocated_cpu_bytes);
  b.setAllocatedDiskBytes(s.allocated_disk_bytes);
  b.setRssBeforeLoadBytes(s.rss_before_load_bytes);
  b.setLoadPeakRssBytes(s.load_peak_rss_bytes);
  b.setPeakRssBytes(s.peak_rss_bytes);
}

void write(wire::Heartbeat::Builder b, const Heartbeat& h) {
  b.setRank(h.rank);
  b.setSequence(h.sequence);
  b.setReply(h.reply);
  if (h.stats) write(b.initStats(), *h.stats);
}

StageStats read(wire::StageStats::Reader s) {
  StageStats out{s.getRank(),
                 s.getSteps(),
                 s.getRows(),
                 s.getBusySeconds(),
                 s.getIdleSeconds(),
                 s.getWindowSeconds(),
                 s.getBytesFromCpu(),
                 s.getBytesFromDisk(),
                 {},
                 s.getStepSpansDropped(),
                 s.getAllocatedGpuBytes(),
                 s.getAllocatedCpuBytes(),
                 s.getAllocatedDiskBytes(),
                 s.getRssBeforeLoadBytes(),
                 s.getLoadPeakRssBytes(),
                 s.getPeakRssBytes()};
  if (s.getStepSpans().size() % 2 != 0)
    fail(ErrorKind::kFailed, "stats of rank {}: {} step span values, not [start, end] pairs",
         s.getRank(), s.getStepSpans().size());
  for (double v : s.getStepSpans()) out.step_spans.push_back(v);
  return out;
}

template <typename T, typename Builder>
void set_list(Builder&& list, const std::vector<T>& v) {
  for (size_t i = 0; i < v.size(); ++i) list.set(static_cast<unsigned>(i), v[i]);
}

void write(wire::ProfileRequest::Builder b, const ProfileRequest& r) {
  set_list(b.initPrefillRows(static_cast<unsigned>(r.prefill_rows.size())), r.prefill_rows);
  set_list(b.initPrefillLengths(static_cast<unsigned>(r.prefill_lengths.size())),
           r.prefill_lengths);
  set_list(b.initDecodeSeqs(static_cast<unsigned>(r.decode_seqs.size())), r.decode_seqs);
  set_list(b.initDecodeContexts(static_cast<unsigned>(r.decode_contexts.size())),
           r.decode_contexts);
  set_list(b.initEmbedRows(static_cast<unsigned>(r.embed_rows.size())), r.embed_rows);
  set_list(b.initHeadRows(static_cast<unsigned>(r.head_rows.size())), r.head_rows);
  b.setRepeats(r.repeats);
  set_list(b.initTransferRows(static_cast<unsigned>(r.transfer_rows.size())), r.transfer_rows);
}

void write(wire::ProfileReport::Builder b, const ProfileReport& r) {
  b.setRank(r.rank);
  b.setHost(text(r.host));
  b.setLayers(r.layers);
  set_list(b.initPrefillSeconds(static_cast<unsigned>(r.prefill_seconds.size())),
           r.prefill_seconds);
  set_list(b.initDecodeSeconds(static_cast<unsigned>(r.decode_seconds.size())), r.decode_seconds);
  set_list(b.initEmbedSeconds(static_cast<unsigned>(r.embed_seconds.size())), r.embed_seconds);
  set_list(b.initHeadSeconds(static_cast<unsigned>(r.head_seconds.size())), r.head_seconds);
  set_list(b.initTransferSeconds(static_cast<unsigned>(r.transfer_seconds.size())),
           r.transfer_seconds);
}

void write_body(wire::ControlMessage::Body::Builder body, const ControlMessage& message) {
  std::visit(
      [&](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, ClusterPlan>) write(body.initPlan(), m);
        if constexpr (std::is_same_v<T, StepCommand>) write(body.initStep(), m);
        if constexpr (std::is_same_v<T, BatchUpdate>) write(body.initBatch(), m);
        if constexpr (std::is_same_v<T, StepResult>) write(body.initResult(), m);
        if constexpr (std::is_same_v<T, Shutdown>) body.initShutdown().setReason(text(m.reason));
        if constexpr (std::is_same_v<T, ErrorReport>) write(body.initError(), m);
        if constexpr (std::is_same_v<T, Heartbeat>) write(body.initHeartbeat(), m);
        if constexpr (std::is_same_v<T, StageStats>) write(body.initStats(), m);
        if constexpr (std::is_same_v<T, ProfileRequest>) write(body.initProfile(), m);
        if constexpr (std::is_same_v<T, ProfileReport>) write(body.initProfileReport(), m);
        if constexpr (std::is_same_v<T, KvHandover>) write(body.initKvHandover(), m);
        if constexpr (std::is_same_v<T, KvHandoverDone>) write(body.initKvHandoverDone(), m);
      },
      message);
}

}  // namespace

std::vector<std::byte> encode(const ControlMessage& message) {
  capnp::MallocMessageBuilder builder;
  auto root = builder.initRoot<wire::ControlMessage>();
  root.setVersion(kControlProtocolVersion);
  write_body(root.initBody(), message);
  kj::Array<capnp::word> words = capnp::messageToFlatArray(builder);
  auto bytes = words.asBytes();
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.begin(), bytes.size());
  return out;
}

// ---- decoding ----

namespace {

StagePlan read_stage(wire::Stage::Reader r) {
  StagePlan s;
  s.rank = r.getRank();
  s.layer_begin = r.getLayerBegin();
  s.layer_end = r.getLayerEnd();
  s.has_embedding = r.getHasEmbedding();
  s.has_head = r.getHasHead();
  s.use_gpu = r.getUseGpu();
  s.nccl = r.getNccl();
  for (uint8_t t : r.getWeightTiers()) s.weight_tiers.push_back(t);
  for (uint8_t t : r.getCacheTiers()) s.cache_tiers.push_back(t);
  s.compress_weight = r.getCompressWeight();
  s.compress_cache = r.getCompressCache();
  s.cache_f16 = r.getCacheF16();
  s.cpu_attention = r.getCpuAttention();
  s.gpu_batch_size = r.getGpuBatchSize();
  s.pie_host_layers = r.getPieHostLayers();
  s.hetegen_alpha = r.getHetegenAlpha();
  s.placed_gpu_bytes = r.getPlacedGpuBytes();
  s.placed_cpu_bytes = r.getPlacedCpuBytes();
  s.placed_disk_bytes = r.getPlacedDiskBytes();
  for (int32_t rank : r.getTpRanks()) s.tp_ranks.push_back(rank);
  return s;
}

ClusterPlan read(wire::Plan::Reader r) {
  ClusterPlan p;
  p.plan_id = r.getPlanId();
  p.model_spec = text(r.getModelSpec());
  for (auto s : r.getStages()) p.stages.push_back(read_stage(s));
  p.num_layers = r.getNumLayers();
  p.hidden_size = r.getHiddenSize();
  p.max_batch_rows = r.getMaxBatchRows();
  p.micro_batches = r.getMicroBatches();
  p.kv_slots = r.getKvSlots();
  p.kv_capacity = r.getKvCapacity();
  p.encoder_stages = r.getEncoderStages();
  p.encoder_kv_slots = r.getEncoderKvSlots();
  return p;
}

StepCommand read(wire::StepCommand::Reader r) {
  StepCommand c;
  c.step_id = r.getStepId();
  c.phase = enum_from_wire(r.getPhase(), Phase::kDecode, "step.phase");
  c.micro_batch = r.getMicroBatch();
  int64_t rows = 0;  // must fit rows()'s int32, as a real step's always does
  for (auto s : r.getSeqs()) {
    SeqStep step{s.getSeqId(), s.getSlot(), s.getNPast(), s.getNNew(), {}, s.getSample()};
    if (step.slot < 0 || step.n_past < 0 || step.n_new < 0)
      fail_malformed(
          fmt::format("step.seqs[{}]: negative slot, past or new ({})", c.seqs.size(), step.str()));
    rows += step.n_new;
    if (rows > std::numeric_limits<int32_t>::max())
      fail_malformed(fmt::format("step: {} rows in all, more than any step holds", rows));
    for (int32_t id : s.getTokenIds()) step.token_ids.push_back(id);
    c.seqs.push_back(std::move(step));
  }
  return c;
}

template <typename List>
std::vector<int32_t> get_ids(List list) {
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  for (int32_t id : list) ids.push_back(id);
  return ids;
}

template <typename Joins>
std::vector<SeqJoin> read_joins(Joins joins) {
  std::vector<SeqJoin> out;
  for (auto j : joins) {
    auto s = j.getSampling();
    SamplingParams sampling;
    sampling.temperature = s.getTemperature();
    sampling.top_k = s.getTopK();
    sampling.top_p = s.getTopP();
    sampling.seed = s.getSeed();
    sampling.min_p = s.getMinP();
    sampling.presence_penalty = s.getPresencePenalty();
    sampling.frequency_penalty = s.getFrequencyPenalty();
    sampling.repetition_penalty = s.getRepetitionPenalty();
    sampling.logprobs = s.getLogprobs();
    out.push_back(SeqJoin{j.getSeqId(), j.getSlot(), sampling, get_ids(j.getPromptIds()),
                          get_ids(j.getOutputIds())});
  }
  return out;
}

BatchUpdate read(wire::BatchUpdate::Reader r) {
  BatchUpdate u;
  u.joined = read_joins(r.getJoined());
  for (uint64_t id : r.getLeft()) u.left.push_back(id);
  return u;
}

KvHandover read(wire::KvHandover::Reader r) {
  KvHandover h;
  h.handover_id = r.getHandoverId();
  for (auto m : r.getMoves()) {
    KvMove move{m.getSeqId(), m.getFromSlot(), m.getToSlot(), m.getPositions()};
    if (move.from_slot < 0 || move.to_slot < 0 || move.positions <= 0)
      fail_malformed(
          fmt::format("kv hand-over {}: moves[{}] has a negative slot or no positions "
                      "({})",
                      h.handover_id, h.moves.size(), move.str()));
    h.moves.push_back(move);
  }
  h.joins = read_joins(r.getJoins());
  return h;
}

StepResult read(wire::StepResult::Reader r) {
  StepResult result{r.getStepId(), r.getMicroBatch(), {}};
  for (auto t : r.getTokens()) {
    SeqToken token{t.getSeqId(), t.getToken(), std::nullopt};
    if (t.getHasLogprob()) {
      Logprobs l{t.getLogprob(), {}};
      for (auto x : t.getTop()) l.top.push_back(TokenLogprob{x.getToken(), x.getLogprob()});
      token.logprobs = std::move(l);
    }
    result.tokens.push_back(std::move(token));
  }
  return result;
}

ErrorReport read(wire::ErrorReport::Reader r) {
  return ErrorReport{r.getRank(),
                     enum_from_wire(r.getKind(), ErrorKind::kInvalidInput, "error.kind"),
                     text(r.getMessage()), r.getStepId()};
}

template <typename T, typename List>
std::vector<T> get_list(List list) {
  std::vector<T> v;
  v.reserve(list.size());
  for (auto x : list) v.push_back(x);
  return v;
}

ProfileRequest read(wire::ProfileRequest::Reader r) {
  ProfileRequest p;
  p.prefill_rows = get_list<int32_t>(r.getPrefillRows());
  p.prefill_lengths = get_list<int32_t>(r.getPrefillLengths());
  p.decode_seqs = get_list<int32_t>(r.getDecodeSeqs());
  p.decode_contexts = get_list<int32_t>(r.getDecodeContexts());
  p.embed_rows = get_list<int32_t>(r.getEmbedRows());
  p.head_rows = get_list<int32_t>(r.getHeadRows());
  p.repeats = r.getRepeats();
  p.transfer_rows = get_list<int32_t>(r.getTransferRows());
  return p;
}

ProfileReport read(wire::ProfileReport::Reader r) {
  ProfileReport p;
  p.rank = r.getRank();
  p.host = text(r.getHost());
  p.layers = r.getLayers();
  p.prefill_seconds = get_list<double>(r.getPrefillSeconds());
  p.decode_seconds = get_list<double>(r.getDecodeSeconds());
  p.embed_seconds = get_list<double>(r.getEmbedSeconds());
  p.head_seconds = get_list<double>(r.getHeadSeconds());
  p.transfer_seconds = get_list<double>(r.getTransferSeconds());
  return p;
}

ControlMessage read_body(wire::ControlMessage::Body::Reader body) {
  using W = wire::ControlMessage::Body;
  switch (body.which()) {
    case W::PLAN:
      return read(body.getPlan());
    case W::STEP:
      return read(body.getStep());
    case W::BATCH:
      return read(body.getBatch());
    case W::RESULT:
      return read(body.getResult());
    case W::FINISHED:  // protocol 1: departures travel in BatchUpdate.left since 2
      fail_malformed("'finished' is not a message of this protocol version");
    case W::SHUTDOWN:
      return Shutdown{text(body.getShutdown().getReason())};
    case W::ERROR:
      return read(body.getError());
    case W::HEARTBEAT: {
      auto h = body.getHeartbeat();
      Heartbeat beat{h.getRank(), h.getSequence(), h.getReply(), std::nullopt};
      if (h.hasStats()) beat.stats = read(h.getStats());
      return beat;
    }
    case W::STATS:
      return read(body.getStats());
    case W::PROFILE:
      return read(body.getProfile());
    case W::PROFILE_REPORT:
      return read(body.getProfileReport());
    case W::KV_HANDOVER:
      return read(body.getKvHandover());
    case W::KV_HANDOVER_DONE: {
      auto d = body.getKvHandoverDone();
      return KvHandoverDone{d.getHandoverId(), d.getRank(), d.getBytes()};
    }
  }
  fail_malformed(fmt::format("unknown message type {}", static_cast<int>(body.which())));
}

}  // namespace

ControlMessage decode(std::span<const std::byte> bytes) {
  constexpr size_t kWord = sizeof(capnp::word);
  if (bytes.empty() || bytes.size() % kWord != 0) {
    fail_malformed(
        fmt::format("{} bytes is not a whole number of {}-byte words", bytes.size(), kWord));
  }
  if (bytes.size() > kMaxControlMessageBytes) {
    fail_malformed(
        fmt::format("{} bytes exceeds the limit of {}", bytes.size(), kMaxControlMessageBytes));
  }
  // Copy into words: the bytes may come from any buffer, capnp needs 8-byte alignment.
  auto words = kj::heapArray<capnp::word>(bytes.size() / kWord);
  std::memcpy(words.begin(), bytes.data(), bytes.size());
  capnp::ReaderOptions options;
  // A valid message is read once, so the traversal never exceeds its size; the margin
  // covers list headers. This refuses pointer loops built to amplify reads.
  options.traversalLimitInWords = 2 * words.size() + 64;
  options.nestingLimit = 16;
  try {
    capnp::FlatArrayMessageReader reader(words, options);
    auto root = reader.getRoot<wire::ControlMessage>();
    if (root.getVersion() != kControlProtocolVersion) {
      fail(ErrorKind::kFailed, "control message of protocol version {}, this binary speaks {}",
           root.getVersion(), kControlProtocolVersion);
    }
    return read_body(root.getBody());
  } catch (const kj::Exception& e) {
    fail_malformed(e.getDescription().cStr());
  }
}

}  // namespace strata
