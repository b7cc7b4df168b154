#include "worker/stage.h"

#include <algorithm>

#include "kernels/error.h"
#include "kernels/log.h"

namespace strata {

PipelineStage::PipelineStage(const ClusterPlan& plan, const StagePlan& stage, Backend& backend,
                             StageOptions so)
    : stage_(stage), kv_slots_(plan.kv_slots) {
  STRATA_CHECK(plan.kv_slots > 0 && plan.kv_capacity > 0 && plan.max_batch_rows > 0,
               "plan {}: kv slots {}, capacity {}, rows {}", plan.plan_id, plan.kv_slots,
               plan.kv_capacity, plan.max_batch_rows);
  LoadOptions& options = so.load;
  if (stage.placed()) {  // the plan decided: execute it
    if (stage.use_gpu != (options.device != nullptr))
      fail_input(
          "stage {}: the plan placed it for {} compute but this rank computes on {}; give every "
          "rank the same --device",
          stage.str(), stage.use_gpu ? "device" : "host", backend.name());
    auto tiers = [&](const std::vector<uint8_t>& wire) {
      std::vector<Tier> out;
      for (uint8_t t : wire) {
        if (t > static_cast<uint8_t>(Tier::kDisk))
          fail(ErrorKind::kFailed, "stage {}: tier {} is not 0-2", stage.str(), t);
        out.push_back(static_cast<Tier>(t));
      }
      return out;
    };
    options.weight_tiers = tiers(stage.weight_tiers);
    options.compress_weight = stage.compress_weight;
    options.gpu_mem = options.cpu_mem = options.disk_mem = -1;  // the planner checked them
    options.w_gpu_percent = options.w_cpu_percent = -1;
    so.cache.placement.tiers = tiers(stage.cache_tiers);
    so.cache.placement.compress = stage.compress_cache;
    so.cache.cpu_attention = stage.cpu_attention;
    so.gpu_batch_size = stage.gpu_batch_size;
  }
  options.layer_begin = stage.layer_begin;
  options.layer_end = stage.layer_end;
  options.embedding = stage.has_embedding;
  options.head = stage.has_head;
  LoadedModel m = load_model(plan.model_spec, options);
  if (m.config.hidden != plan.hidden_size)
    fail_input("{}: hidden size {} but the plan says {}", plan.model_spec, m.config.hidden,
               plan.hidden_size);
  owned_ = std::make_unique<Model>(m.config, std::move(m.weights), backend, plan.max_batch_rows,
                                   std::move(m.streamer), std::move(m.feeder));
  model_ = owned_.get();
  model_->set_cache_options(so.cache);
  model_->set_gpu_batch_size(so.gpu_batch_size);
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
    : stage_(stage), kv_slots_(plan.kv_slots), model_(&model) {
  const ModelConfig& c = model.config();
  STRATA_CHECK(c.n_layers == stage.n_layers() && c.hidden == plan.hidden_size &&
                   model.max_rows() >= plan.max_batch_rows,
               "stage {}: a model of {} layers, hidden {}, {} rows (plan: hidden {}, {} rows)",
               stage.str(), c.n_layers, c.hidden, model.max_rows(), plan.hidden_size,
               plan.max_batch_rows);
  allocate(plan);
}

// The KV cache (plan.kv_slots x plan.kv_capacity) and the step's buffers, once.
void PipelineStage::allocate(const ClusterPlan& plan) {
  STRATA_CHECK(plan.kv_slots > 0 && plan.kv_capacity > 0 && plan.max_batch_rows > 0,
               "plan {}: kv slots {}, capacity {}, rows {}", plan.plan_id, plan.kv_slots,
               plan.kv_capacity, plan.max_batch_rows);
  cache_ = model_->make_cache(plan.kv_slots, plan.kv_capacity);
  zeros_.assign(static_cast<size_t>(plan.max_batch_rows), 0);
  if (last())
    logits_.resize(static_cast<size_t>(plan.kv_slots) *
                   static_cast<size_t>(model_->config().vocab));
}

void PipelineStage::join(const SeqJoin& seq) {
  seq.sampling.validate();
  sampling_[seq.seq_id] = SeqSampling{seq.sampling, Rng(seq.sampling.seed)};
}

void PipelineStage::leave(uint64_t seq_id) {
  sampling_.erase(seq_id);
}

void PipelineStage::build_batch(const StepCommand& c) {
  batch_.clear();
  if (c.seqs.empty() || c.seqs.size() > static_cast<size_t>(kv_slots_) ||
      c.rows() > model_->max_rows())
    fail(ErrorKind::kFailed, "step {}: {} sequences, {} rows (plan: up to {} sequences, {} rows)",
         c.step_id, c.seqs.size(), c.rows(), kv_slots_, model_->max_rows());
  for (const SeqStep& s : c.seqs) {
    if (s.slot < 0 || s.slot >= kv_slots_ || s.n_past < 0 || s.n_new <= 0 ||
        s.n_past + s.n_new > cache_->capacity())
      fail(ErrorKind::kFailed, "step {}: {} does not fit {} KV slots of {} positions", c.step_id,
           s.str(), kv_slots_, cache_->capacity());
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
    SeqSampling& s = it->second;
    const int32_t token =
        sampler_.sample(logits_.data() + row++ * vocab, model_->config().vocab, s.params, s.rng);
    tokens.push_back(SeqToken{seq.seq_id, token});
  }
  return tokens;
}

}  // namespace strata
