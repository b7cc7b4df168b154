// Iteration-level scheduling of the cluster, as ExeGPT's RRA (round-robin allocation)
// runs it: the KV slots are split over `micro_batches` micro-batches that flow through the
// pipeline one behind the other, so every stage has work while the others compute. Each
// micro-batch alternates one prefill (encode) phase, which admits waiting requests into its
// free slots, with `decode_iters` decode iterations (N_D) over its running sequences. A
// prefill phase is as many steps as its prompts need at `max_step_tokens` rows a step (a
// long prompt is prefilled in chunks; only its last chunk samples). A sequence that
// finishes (EOS, its token budget, the context) leaves at once and frees its slot;
// requests join only at the next prefill phase. One micro-batch with N_D = 1 is
// continuous batching: `strata generate` runs it so.
//
// This is the one scheduler of every request path: the coordinator's loop (coordinator.h)
// turns steps into work for the stages (stages.h: other ranks, or this process) and
// StepResults back into apply(); tests drive it directly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordinator/intake/request.h"
#include "coordinator/plan/scheduled_step.h"
#include "coordinator/s3/kv_packing.h"
#include "transport/messages.h"
#include "worker/tokenizer.h"

namespace strata {

struct SchedulerOptions {
  int32_t micro_batches = 1;
  int32_t decode_iters = 8;       // N_D: decode iterations between prefill phases
  int32_t kv_slots = 32;          // sequences in flight over all micro-batches
  int32_t kv_capacity = 0;        // positions per slot (the context)
  int32_t max_step_tokens = 512;  // prompt rows of one prefill step (longer prompts: chunks)
  std::vector<int32_t> eos_token_ids;
  const Tokenizer* tokenizer = nullptr;  // decodes completions for stop strings
  std::function<double()> clock;         // seconds (request times); default: the system clock
  // B_E: the most sequences the prefill phases of all micro-batches admit together (micro-batch
  // m takes its share, B_E / K and one of the remainder); 0 fills every free slot.
  int32_t encode_batch = 0;
  // S3 (kv_packing.h): KV positions the sequences of all micro-batches may reserve together
  // (each micro-batch an equal share; 0: no budget, a sequence holds a whole slot), and the
  // positions a request reserves at admission, its prompt included (clamped to
  // [prompt + 1, the context and the share]; default: the context).
  int64_t kv_budget = 0;
  std::function<int32_t(const GenerationRequest&)> reserve;
  bool max_new_caps = true;  // prompt + max_new_tokens caps a reservation that grows
  // How sequences are fitted into the budget (kv_packing.h KvAdmission); pooled admission
  // reads each request's outlook (default: a point at its reservation) and packs to
  // `pooled_z` standard deviations of the micro-batch's summed final positions.
  KvAdmission kv_admission = KvAdmission::kReserved;
  std::function<LengthOutlook(const GenerationRequest&)> outlook;
  double pooled_z = 1.2815515655446004;  // the 0.9 quantile of N(0, 1)

  void validate() const;  // InputError naming the option
};

struct FinishedRequest {
  uint64_t seq_id = 0;
  GenerationResult result;
  bool started = false;  // it had been admitted into a prefill (drain: it was running)
};

// What both schedulers keep of a request while it runs, and what they do with it alike.
struct SeqRecord {
  GenerationRequest request;
  GenerationResult result;
  int32_t n_past = 0;  // positions in the KV cache (of the prompt, while it is prefilled)
  double arrival = 0, admitted = -1, first_token = -1;
  int32_t reserved = 0;  // KV positions reserved (S3 packing)
  // After a preemption: the prompt and the tokens so far, prefilled again (recomputed).
  std::vector<int32_t> resume_ids;
  int32_t preemptions = 0;

  // A valid request (prompt within `kv_capacity`, max_new_tokens > 0) queued at `arrival`.
  SeqRecord(const GenerationRequest& request, double arrival, int32_t kv_capacity);
  // The next at most `budget` rows of its prompt into KV slot `slot`, as sequence `id`; the
  // step samples when they are the last. Advances n_past.
  SeqStep prefill_chunk(uint64_t id, int32_t slot, int32_t budget);
  const std::vector<int32_t>& prefill_ids() const {
    return resume_ids.empty() ? request.prompt_ids : resume_ids;
  }
  bool prefilled() const { return n_past >= static_cast<int32_t>(prefill_ids().size()); }
  // A sampled token (and its log-probabilities); true when that ends the request
  // (request_rules.h).
  bool accept(const SeqToken& token, const SchedulerOptions& options);
  // How the last stage learns to sample it as sequence `id` in KV slot `slot`: its sampling,
  // and the tokens its penalties count when it has any.
  SeqJoin join(uint64_t id, int32_t slot) const;
  // The result's times (from arrival; clamped at 0: a queue clock may run ahead).
  void stamp_times(double now);
  // Ends it with `error` (the cluster failed), the tokens so far kept.
  FinishedRequest end(uint64_t id, const std::string& error, double now, bool started);
};

// Every record of `seqs` (id -> a SeqRecord) ended with `error`, in id (submission) order;
// `started` says which were running.
template <class Seqs, class Started>
std::vector<FinishedRequest> end_all(Seqs& seqs, const std::string& error, double now,
                                     Started&& started) {
  std::vector<uint64_t> ids;
  ids.reserve(seqs.size());
  for (const auto& [id, seq] : seqs) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  std::vector<FinishedRequest> out;
  for (uint64_t id : ids) {
    auto& seq = seqs.at(id);
    out.push_back(seq.end(id, error, now, started(seq)));
  }
  return out;
}

// What the coordinator's loop drives: RRA (below) or WAA (waa_scheduler.h). Steps run in
// lanes (micro-batches), one in flight per lane.
class StepScheduler {
 public:
  virtual ~StepScheduler() = default;
  // Queues a valid request (prompt within the context, max_new_tokens > 0) that was queued
  // at `arrival` (the clock's seconds): its result's times count from there.
  virtual void submit(const GenerationRequest& request, uint64_t seq_id, double arrival) = 0;
  // The next step of lane `m` when it has none in flight, or nullopt when it has nothing to
  // run.
  virtual std::optional<ScheduledStep> next_step(int32_t m) = 0;
  // Takes the tokens of an in-flight step; returns the requests it finished.
  virtual std::vector<FinishedRequest> apply(const StepResult& result) = 0;
  // WAA: the next KV hand-over to start (prefilled sequences into free decode slots), and
  // the end of one (its sequences join the decode batch). RRA hands nothing over.
  virtual std::optional<KvHandover> next_handover() { return std::nullopt; }
  virtual void handed_over(uint64_t handover_id);
  // A re-planned schedule (docs/SCHEDULING.md): N_D and B_E from the next phase on, and no
  // more than `active_slots` sequences in flight (<= the KV slots it has).
  virtual void reschedule(int32_t decode_iters, int32_t encode_batch, int32_t active_slots) = 0;
  // Ends every request still waiting or running (the cluster failed): each comes back as
  // an error result carrying `error` and the tokens it had, in submission order, and the
  // scheduler is idle afterwards.
  virtual std::vector<FinishedRequest> drain(const std::string& error) = 0;
  virtual bool in_flight(int32_t m) const = 0;
  virtual bool idle() const = 0;  // nothing waiting, running, handed over or in flight
  virtual size_t waiting() const = 0;
  virtual int32_t micro_batches() const = 0;  // lanes
  // S3 packing's counters (kv_packing.h), where the scheduler packs; null otherwise.
  virtual const PackingCounters* packing() const { return nullptr; }
};

class RraScheduler final : public StepScheduler {
 public:
  explicit RraScheduler(const SchedulerOptions& options);

  void submit(const GenerationRequest& request, uint64_t seq_id, double arrival) override;
  std::optional<ScheduledStep> next_step(int32_t m) override;
  std::vector<FinishedRequest> apply(const StepResult& result) override;
  void reschedule(int32_t decode_iters, int32_t encode_batch, int32_t active_slots) override;
  std::vector<FinishedRequest> drain(const std::string& error) override;

  bool in_flight(int32_t m) const override {
    return batches_[static_cast<size_t>(m)].step.has_value();
  }
  bool idle() const override;
  size_t waiting() const override { return waiting_.size(); }
  int32_t micro_batches() const override { return static_cast<int32_t>(batches_.size()); }
  const SchedulerOptions& options() const { return options_; }
  const PackingCounters* packing() const override { return &packing_; }
  // Micro-batch m's share of the KV budget (positions; 0: no budget).
  int64_t budget_of(int32_t m) const;

 private:
  struct Seq : SeqRecord {
    using SeqRecord::SeqRecord;
    int32_t slot = -1;
    int32_t micro_batch = -1;
    int32_t passed_over = 0;  // admission phases that took shorter sequences before it
    LengthOutlook outlook;    // pooled admission
    // Its usage profile while it waits (pooled admission): fixed until it runs again.
    std::optional<UsageProfile> waiting_profile;
  };
  struct MicroBatch {
    std::vector<int32_t> free_slots;   // ascending order of use
    std::vector<uint64_t> prefilling;  // admitted, prompt not yet all in the cache
    std::vector<uint64_t> running;
    int32_t decode_left = 0;
    std::optional<uint64_t> step;  // the step in flight
    size_t step_seqs = 0;          // its sampling sequences: the tokens its result carries
    int64_t reserved = 0;          // KV positions its sequences reserve
  };
  void admit(int32_t m);
  std::vector<uint64_t> packed_admissions(int32_t m, size_t max_items);
  void supervise(int32_t m);
  void supervise_pooled(int32_t m);
  void preempt(int32_t m, uint64_t id, int32_t reserve);
  UsageProfile usage_profile() const;
  UsageProfile usage_of(int32_t m) const;
  int32_t reservation_cap(const Seq& seq, int32_t m) const;
  ScheduledStep prefill_step(int32_t m);
  ScheduledStep decode_step(int32_t m);

  SchedulerOptions options_;
  std::vector<MicroBatch> batches_;
  std::deque<uint64_t> waiting_;
  std::unordered_map<uint64_t, Seq> seqs_;
  uint64_t next_step_id_ = 1;
  int32_t active_slots_ = 0;  // sequences in flight at most (the KV slots unless re-planned)
  PackingCounters packing_;
};

}  // namespace strata
