#include "worker/stage.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "placement/tier.h"

namespace strata {

PipelineStage::PipelineStage(const ClusterPlan& plan, const StagePlan& stage, Backend& backend,
                             StageOptions so)
    : stage_(stage), kv_slots_(plan.kv_slots_of(stage)), encoder_(plan.encoder(stage)) {
  STRATA_CHECK(kv_slots_ > 0 && plan.kv_capacity > 0 && plan.max_batch_rows > 0,
               "plan {}: kv slots {}, capacity {}, rows {}", plan.plan_id, kv_slots_,
               plan.kv_capacity, plan.max_batch_rows);
  LoadOptions& options = so.load;
  if (stage.placed()) {  // the plan decided: execute it
    // The plan placed the stage for the compute this rank reported (its node inventory).
    if (stage.use_gpu != (options.device != nullptr))
      fail(ErrorKind::kFailed,
           "stage {}: the plan placed it for {} compute but this rank computes on {}, as its "
           "node inventory said",
           stage.str(), stage.use_gpu ? "device" : "host", backend.name());
    const std::string what = fmt::format("stage {}", stage.str());
    options.weight_tiers = tiers_from_wire(stage.weight_tiers, what);
    options.compress_weight = stage.compress_weight;
    options.gpu_mem = options.cpu_mem = options.disk_mem = -1;  // the planner checked them
    options.w_gpu_percent = options.w_cpu_percent = -1;
    so.cache.placement.tiers = tiers_from_wire(stage.cache_tiers, what);
    so.cache.placement.compress = stage.compress_cache;
    so.cache.placement.dtype = stage.cache_f16 ? DType::kF16 : DType::kF32;
    so.cache.cpu_attention = stage.cpu_attention;
    so.gpu_batch_size = stage.gpu_batch_size;
    so.cache.placement.pie = PieOptions{};
    so.cache.placement.pie.host_layers = stage.pie_host_layers;
    if (stage.hetegen_alpha > 0 && options.hetegen_cpu == nullptr)
      fail(ErrorKind::kFailed,
           "stage {}: the plan splits its layers (HeteGen) but this rank "
           "has no CPU backend for the CPU's shares",
           stage.str());
    options.hetegen_alpha = stage.hetegen_alpha;
    options.hetegen_slot_alpha.clear();
    options.hetegen_whole.clear();
  }
  options.tp_degree = stage.tp_degree();
  options.tp_index = so.tp_index;
  if (stage.tp_degree() > 1) {
    STRATA_CHECK(so.tp_reduce != nullptr && so.tp_index >= 0 && so.tp_index < stage.tp_degree(),
                 "stage {}: shard {} without its group", stage.str(), so.tp_index);
    // Every member keeps the whole residual stream; the leader alone samples from it.
    if (so.tp_index > 0) stage_.has_head = false;
  }
  options.layer_begin = stage.layer_begin;
  options.layer_end = stage.layer_end;
  options.embedding = stage.has_embedding;
  options.head = stage_.has_head;
  LoadedModel m = load_model(plan.model_spec, options);
  if (m.config.hidden != plan.hidden_size)
    fail_input("{}: hidden size {} but the plan says {}", plan.model_spec, m.config.hidden,
               plan.hidden_size);
  owned_ = std::make_unique<Model>(m.config, std::move(m.weights), backend, plan.max_batch_rows,
                                   std::move(m.streamer), std::move(m.feeder));
  model_ = owned_.get();
  model_->set_experts(std::move(m.experts));
  model_->set_cache_options(so.cache);
  model_->set_gpu_batch_size(so.gpu_batch_size);
  if (stage.tp_degree() > 1) model_->set_block_reduce(so.tp_reduce);
  allocate(plan);
  log::get("worker")->info(
      "stage {} on {}: {} layers, KV cache {:.1f} MiB ({}), weights {}, allocated {}", stage.str(),
      backend.name(), m.config.n_layers, static_cast<double>(cache_->bytes()) / (1 << 20),
      so.cache.placement.str(), m.placement.str(), memory().str());
}

TierBytes PipelineStage::memory() const {
  TierBytes m = model_->memory();
  m += cache_->memory();
  m.cpu += static_cast<int64_t>(logits_.size() * sizeof(float) + zeros_.size() * sizeof(int32_t));
  return m;
}

void check_allocation(const StagePlan& stage, const TierBytes& allocated) {
  if (!stage.placed()) return;
  const TierBytes planned{static_cast<int64_t>(stage.placed_gpu_bytes),
                          static_cast<int64_t>(stage.placed_cpu_bytes),
                          static_cast<int64_t>(stage.placed_disk_bytes)};
  std::string diff;
  for (Tier t : kTiers)
    if (planned[t] != allocated[t])
      diff += fmt::format("{}{}: the plan placed {} bytes, the worker allocated {} bytes",
                          diff.empty() ? "" : "; ", tier_name(t), planned[t], allocated[t]);
  if (!diff.empty())
    fail(ErrorKind::kFailed, "stage on rank {} (layers [{}, {})): placement mismatch: {}",
         stage.rank, stage.layer_begin, stage.layer_end, diff);
}

PipelineStage::PipelineStage(const ClusterPlan& plan, const StagePlan& stage, Model& model)
    : stage_(stage),
      kv_slots_(plan.kv_slots_of(stage)),
      encoder_(plan.encoder(stage)),
      model_(&model) {
  const ModelConfig& c = model.config();
  STRATA_CHECK(c.n_layers == stage.n_layers() && c.hidden == plan.hidden_size &&
                   model.max_rows() >= plan.max_batch_rows,
               "stage {}: a model of {} layers, hidden {}, {} rows (plan: hidden {}, {} rows)",
               stage.str(), c.n_layers, c.hidden, model.max_rows(), plan.hidden_size,
               plan.max_batch_rows);
  allocate(plan);
}

// The KV cache (the stage's KV slots x plan.kv_capacity) and the step's buffers, once.
void PipelineStage::allocate(const ClusterPlan& plan) {
  STRATA_CHECK(kv_slots_ > 0 && plan.kv_capacity > 0 && plan.max_batch_rows > 0,
               "plan {}: kv slots {}, capacity {}, rows {}", plan.plan_id, kv_slots_,
               plan.kv_capacity, plan.max_batch_rows);
  cache_ = model_->make_cache(kv_slots_, plan.kv_capacity);
  zeros_.assign(static_cast<size_t>(plan.max_batch_rows), 0);
  if (last())
    logits_.resize(static_cast<size_t>(kv_slots_) * static_cast<size_t>(model_->config().vocab));
}

void PipelineStage::join(const SeqJoin& seq) {
  seq.sampling.validate();
  SeqSampling s{seq.sampling, Rng(seq.sampling.seed), std::nullopt};
  if (seq.sampling.uses_history()) {
    s.history.emplace();
    s.history->add_prompt(seq.prompt_ids);
    for (int32_t t : seq.output_ids) s.history->add_output(t);
  }
  sampling_[seq.seq_id] = std::move(s);
}

void PipelineStage::leave(uint64_t seq_id) {
  sampling_.erase(seq_id);
}

void PipelineStage::join_after_prefill(const SeqJoin& seq) {
  join(seq);
  SeqSampling& s = sampling_.at(seq.seq_id);
  if (s.params.temperature != 0.0f) (void)s.rng.uniform();  // Sampler::sample's one draw
}

void PipelineStage::check_kv_range(std::span<const KvMove> moves, int32_t begin, int32_t end,
                                   bool to_slots) const {
  if (begin < stage_.layer_begin || end > stage_.layer_end || begin >= end)
    fail(ErrorKind::kFailed, "KV hand-over of layers [{}, {}) to stage {}, which holds [{}, {})",
         begin, end, stage_.rank, stage_.layer_begin, stage_.layer_end);
  for (const KvMove& m : moves) {
    const int32_t slot = to_slots ? m.to_slot : m.from_slot;
    if (slot < 0 || slot >= kv_slots_ || m.positions <= 0 || m.positions > cache_->positions())
      fail(ErrorKind::kFailed,
           "KV hand-over on stage {}: {} does not fit {} KV slots of {} positions", stage_.rank,
           m.str(), kv_slots_, cache_->positions());
  }
}

size_t PipelineStage::kv_bytes(std::span<const KvMove> moves, int32_t begin, int32_t end) const {
  size_t total = 0;
  for (const KvMove& m : moves)
    total += static_cast<size_t>(end - begin) * cache_->slot_bytes(m.positions);
  return total;
}

void PipelineStage::export_kv(std::span<const KvMove> moves, int32_t begin, int32_t end,
                              std::byte* out) {
  check_kv_range(moves, begin, end, false);
  for (const KvMove& m : moves)
    for (int32_t layer = begin; layer < end; ++layer) {
      cache_->read_slot(model_->backend(), layer - stage_.layer_begin, m.from_slot, m.positions,
                        out);
      out += cache_->slot_bytes(m.positions);
    }
}

void PipelineStage::import_kv(std::span<const KvMove> moves, int32_t begin, int32_t end,
                              const std::byte* in) {
  check_kv_range(moves, begin, end, true);
  for (const KvMove& m : moves)
    for (int32_t layer = begin; layer < end; ++layer) {
      cache_->write_slot(model_->backend(), layer - stage_.layer_begin, m.to_slot, m.positions, in);
      in += cache_->slot_bytes(m.positions);
    }
}

void PipelineStage::build_batch(const StepCommand& c) {
  batch_.clear();
  if (c.seqs.empty() || c.seqs.size() > static_cast<size_t>(kv_slots_) ||
      c.rows() > model_->max_rows())
    fail(ErrorKind::kFailed, "step {}: {} sequences, {} rows (plan: up to {} sequences, {} rows)",
         c.step_id, c.seqs.size(), c.rows(), kv_slots_, model_->max_rows());
  for (const SeqStep& s : c.seqs) {
    if (s.slot < 0 || s.slot >= kv_slots_ || s.n_past < 0 || s.n_new <= 0 ||
        s.n_past + s.n_new > cache_->positions())
      fail(ErrorKind::kFailed, "step {}: {} does not fit {} KV slots of {} positions", c.step_id,
           s.str(), kv_slots_, cache_->positions());
    if (s.n_past == 0) cache_->discard_slot(model_->backend(), s.slot);  // a new occupant
    std::span<const int32_t> ids(zeros_.data(), static_cast<size_t>(s.n_new));
    if (first()) {
      if (s.token_ids.size() != static_cast<size_t>(s.n_new))
        fail(ErrorKind::kFailed, "step {}: {} carries {} token ids for {} new positions", c.step_id,
             s.str(), s.token_ids.size(), s.n_new);
      ids = s.token_ids;
    }
    batch_.add(s.slot, s.n_past, ids, s.sample);
  }
}

std::vector<SeqToken> PipelineStage::run(const StepCommand& c, std::span<const float> in,
                                         std::span<float> out, bool in_device, bool out_device) {
  build_batch(c);
  const size_t act = static_cast<size_t>(c.rows()) * static_cast<size_t>(hidden());
  STRATA_CHECK(first() || in.size() == act, "step {}: {} input floats for {} rows", c.step_id,
               in.size(), c.rows());
  STRATA_CHECK(last() || out.size() == act, "step {}: {} output floats for {} rows", c.step_id,
               out.size(), c.rows());
  model_->forward_stage(batch_, *cache_,
                        StepIo{first() ? nullptr : in.data(), last() ? logits_.data() : out.data(),
                               last(), in_device, out_device});
  return last() ? sample(c) : std::vector<SeqToken>{};
}

std::vector<SeqToken> PipelineStage::sample(const StepCommand& c) {
  std::vector<SeqToken> tokens;
  tokens.reserve(c.seqs.size());
  const auto vocab = static_cast<size_t>(model_->config().vocab);
  size_t row = 0;  // logits come for the sequences that sample, in the step's order
  for (const SeqStep& seq : c.seqs) {
    if (!seq.sample) continue;
    auto it = sampling_.find(seq.seq_id);
    if (it == sampling_.end())
      fail(ErrorKind::kFailed,
           "step {}: sequence {} never joined the batch (no sampling parameters)", c.step_id,
           seq.seq_id);
    tokens.push_back(sample_one(logits_.data() + row++ * vocab, seq.seq_id, it->second));
    if (encoder_) sampling_.erase(it);  // its next tokens are the decode side's
  }
  return tokens;
}

// Log-probabilities come from the raw logits, kept aside before the penalties change them.
SeqToken PipelineStage::sample_one(float* logits, uint64_t seq_id, SeqSampling& s) {
  const int32_t vocab = model_->config().vocab;
  const bool want_logprobs = s.params.logprobs >= 0;
  const float* raw = logits;
  if (s.history) {
    if (want_logprobs) {
      raw_logits_.assign(logits, logits + vocab);
      raw = raw_logits_.data();
    }
    s.history->apply_penalties(logits, vocab, s.params);
  }
  const int32_t token = sampler_.sample(logits, vocab, s.params, s.rng);
  if (s.history) s.history->add_output(token);
  if (!want_logprobs) return SeqToken{seq_id, token, std::nullopt};
  return SeqToken{seq_id, token,
                  token_logprobs(raw, vocab, s.params.temperature, token, s.params.logprobs)};
}

double PipelineStage::time_step(int32_t seqs, int32_t n_new, int32_t n_past, bool embed, bool head,
                                int32_t repeats) {
  const int32_t rows = seqs * n_new;
  if (seqs <= 0 || n_new <= 0 || n_past < 0 || seqs > kv_slots_ ||
      n_past + n_new > cache_->positions() || rows > model_->max_rows() || (embed && !first()) ||
      (head && !last()))
    fail(ErrorKind::kFailed,
         "stage {}: a profile step of {} sequences x {} new rows after {} does not fit its {} "
         "slots of {} positions and {} rows{}",
         stage_.str(), seqs, n_new, n_past, kv_slots_, cache_->positions(), model_->max_rows(),
         embed || head ? " (or asks for an embedding or head it does not hold)" : "");
  StepBatch batch;
  const std::vector<int32_t> ids(static_cast<size_t>(n_new), 0);
  for (int32_t s = 0; s < seqs; ++s) batch.add(s, n_past, ids, head);
  const size_t act = static_cast<size_t>(rows) * static_cast<size_t>(hidden());
  std::vector<float> in(act, 0.0f), out(act);
  const StepIo io{embed ? nullptr : in.data(), head ? logits_.data() : out.data(), head, false,
                  false};
  const auto vocab = static_cast<size_t>(model_->config().vocab);
  std::vector<double> times;
  for (int32_t r = 0; r < std::max(repeats, 1); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    model_->forward_stage(batch, *cache_, io);
    model_->backend().synchronize();
    // The last stage samples every row it computed logits for, as a step does.
    for (int32_t s = 0; head && s < seqs; ++s)
      (void)argmax(logits_.data() + static_cast<size_t>(s) * vocab, model_->config().vocab);
    times.push_back(seconds_since(t0));
  }
  // The median: what a step of this size typically takes on this machine (the fastest run
  // would promise a throughput that a loaded host does not keep).
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2),
                   times.end());
  return times[times.size() / 2];
}

namespace {

// A prefill point of `rows` rows of sequences `length` long, as a step can hold it: whole
// sequences when a row budget holds several (as many as the slots allow), else one chunk of
// `rows` rows ending at `length`.
struct PrefillShape {
  int32_t seqs, n_new, n_past;
};
PrefillShape prefill_shape(int32_t rows, int32_t length, int32_t slots) {
  if (rows >= length) return {std::clamp(rows / length, 1, slots), length, 0};
  return {1, rows, length - rows};
}

}  // namespace

ProfileReport PipelineStage::profile(const ProfileRequest& r) {
  ProfileReport rep;
  rep.rank = stage_.rank;
  rep.layers = stage_.n_layers();
  const int32_t reps = std::max(r.repeats, 1);
  const double layers = stage_.n_layers();
  for (int32_t rows : r.prefill_rows)
    for (int32_t len : r.prefill_lengths) {
      const PrefillShape p = prefill_shape(rows, len, kv_slots_);
      // Scaled to the asked-for rows when the slots held fewer sequences (linear in rows).
      const double scale = static_cast<double>(rows) / (p.seqs * p.n_new);
      rep.prefill_seconds.push_back(time_step(p.seqs, p.n_new, p.n_past, false, false, reps) *
                                    scale / layers);
    }
  for (int32_t seqs : r.decode_seqs)
    for (int32_t ctx : r.decode_contexts)
      rep.decode_seconds.push_back(time_step(seqs, 1, ctx - 1, false, false, reps) / layers);
  // The embedding and head: a step with them less the same step without, the two run in
  // turn (so a noisy moment hits both) and the fastest of each kept.
  auto difference = [&](int32_t seqs, int32_t n_new, bool embed, bool head) {
    double with = std::numeric_limits<double>::infinity(), without = with;
    for (int32_t i = 0; i < 2 * reps; ++i) {
      with = std::min(with, time_step(seqs, n_new, 0, embed, head, 1));
      without = std::min(without, time_step(seqs, n_new, 0, false, false, 1));
    }
    return std::max(with - without, 0.0);
  };
  if (first())
    for (int32_t rows : r.embed_rows) {
      const int32_t seqs = static_cast<int32_t>(
          std::min<int64_t>(kv_slots_, (rows + cache_->positions() - 1) / cache_->positions()));
      rep.embed_seconds.push_back(difference(seqs, std::max(rows / seqs, 1), true, false));
    }
  if (last())
    for (int32_t seqs : r.head_rows) rep.head_seconds.push_back(difference(seqs, 1, false, true));
  return rep;
}

}  // namespace strata
