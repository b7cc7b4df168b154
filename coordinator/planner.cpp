#include "coordinator/planner.h"

#include <algorithm>

#include "kernels/error.h"

namespace strata {
namespace {

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 20);
}

void check_fit(const ModelConfig& config, const ClusterPlan& plan, int64_t budget) {
  if (budget < 0) return;
  for (const StagePlan& s : plan.stages) {
    const StageMemory need = stage_memory(config, s, plan);
    if (need.total() <= budget) continue;
    fail_input(
        "{} does not fit: the stage on rank {} (layers [{}, {}){}{}) needs {:.1f} MiB ({}) but "
        "--stage-mem is "
        "{:.1f} MiB; run more ranks (mpirun -np), fewer KV slots (--max-batch) or a larger "
        "--stage-mem",
        plan.model_spec, s.rank, s.layer_begin, s.layer_end, s.has_embedding ? " + embedding" : "",
        s.has_head ? " + head" : "", mib(need.total()), need.str(), mib(budget));
  }
}

}  // namespace

std::string StageMemory::str() const {
  return fmt::format("weights {:.1f} MiB, KV cache {:.1f} MiB, activations {:.1f} MiB",
                     mib(weights), mib(kv_cache), mib(activations));
}

StageMemory stage_memory(const ModelConfig& config, const StagePlan& stage,
                         const ClusterPlan& plan) {
  const ModelShape shape = config.shape();
  const int64_t elem = shape.weight_bytes_per_elem;
  StageMemory m;
  m.weights = stage.n_layers() * shape.params_per_layer() * elem;
  if (stage.has_embedding) m.weights += shape.embedding_params() * elem;
  if (stage.has_head)
    m.weights +=
        (shape.tied_head && !stage.has_embedding ? shape.embedding_params() : shape.head_params()) *
        elem;
  m.kv_cache = int64_t{2} * stage.n_layers() * plan.kv_slots * plan.kv_capacity *
               config.kv_width() * static_cast<int64_t>(sizeof(float));
  // The model's step buffers (model.cpp): about 8 of [rows, max(hidden, q width)] plus 2 of
  // [rows, intermediate], and the two send buffers of a stage.
  const int64_t wide = std::max<int64_t>(config.hidden, config.q_width());
  m.activations = int64_t{plan.max_batch_rows} * (10 * wide + 2 * config.intermediate) * 4;
  return m;
}

ClusterPlan make_uniform_plan(const ModelConfig& config, const PlanOptions& o) {
  const int32_t n = config.n_layers, s = o.workers;
  if (s < 1)
    fail_input(
        "a cluster needs at least one worker rank besides the coordinator (mpirun -np 2 or more)");
  if (s > n)
    fail_input(
        "{} worker ranks but {} has only {} layers: each pipeline stage needs at least one layer; "
        "run at most mpirun -np {}",
        s, o.model_spec, n, n + 1);
  ClusterPlan plan;
  plan.plan_id = 1;
  plan.model_spec = o.model_spec;
  plan.num_layers = n;
  plan.hidden_size = config.hidden;
  plan.max_batch_rows = o.max_batch_rows;
  plan.micro_batches = o.micro_batches;
  plan.kv_slots = o.kv_slots;
  plan.kv_capacity = o.kv_capacity;
  int32_t begin = 0;
  for (int32_t i = 0; i < s; ++i) {
    StagePlan st;
    st.rank = i + 1;
    st.layer_begin = begin;
    st.layer_end = begin + n / s + (i < n % s ? 1 : 0);
    st.has_embedding = i == 0;
    st.has_head = i == s - 1;
    st.cpu_mem_bytes = o.stage_mem > 0 ? static_cast<uint64_t>(o.stage_mem) : 0;
    begin = st.layer_end;
    plan.stages.push_back(st);
  }
  plan.validate();
  check_fit(config, plan, o.stage_mem);
  return plan;
}

}  // namespace strata
