// ExeGPT's WAA (workload-aware allocation, §4.1, Fig. 4c) as the coordinator runs it: a
// prefill (encoder) pipeline and a decode pipeline on their own workers, running at once.
// The prefill side takes an encoder batch of B_E waiting requests at a time into its own KV
// slots, prefills them (in chunks of max_step_tokens rows, as RRA does) and samples their
// first tokens; a sequence not finished by then waits for a free decode slot, and its KV
// cache moves to the decode pipeline in a hand-over (KvHandover). Once every stage has
// finished the hand-over, its sequences join the running decode batch, which runs as B_m
// decoder micro-batches one behind the other through the decode stages. A sequence that
// finishes leaves at once (early termination): its decode slot is free for the next
// hand-over, so the batch stays packed without moving anyone's cache.
//
// §5.2's dynamic workload adjustment happens where the encoder batch is formed: it is cut
// or grown so that its workload (the sum of its input lengths) stays within `threshold` of
// the planned B_E x mean input, and B_E itself is raised (lowered) by a step while the
// decode batch is below (above) the planned B_D by more than the threshold. counters()
// says how often each acted.
//
// Lanes (StepCommand::micro_batch): [0, prefill_micro_batches) are prefill steps,
// the next `micro_batches` (B_m) are decoder micro-batches.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "coordinator/exegpt/rra_scheduler.h"

namespace strata {

struct WaaOptions {
  // micro_batches: B_m; kv_slots: the decode pipeline's KV slots; encode_batch: B_E (0: as
  // many as the prefill slots hold); decode_iters is unused (decoding never pauses).
  SchedulerOptions common;
  int32_t prefill_micro_batches = 1;  // prefill steps in flight in the prefill pipeline
  int32_t prefill_slots = 0;          // the prefill pipeline's KV slots
  // §5.2: the planned mean input length and decode batch B_D (0: that check is off).
  double planned_input = 0;
  double planned_decode_batch = 0;
  double threshold = 0.25;

  void validate() const;  // InputError naming the option
  std::string str() const;
};

struct WaaCounters {
  int64_t encoder_batches = 0;
  int64_t encoder_adjustments = 0;  // a batch cut or grown to keep its workload in band
  int64_t decoder_adjustments = 0;  // B_E raised or lowered: the decode batch out of band
  int64_t handovers = 0;
  int64_t handed_sequences = 0;
};

class WaaScheduler final : public StepScheduler {
 public:
  explicit WaaScheduler(const WaaOptions& options);

  void submit(const GenerationRequest& request, uint64_t seq_id, double arrival) override;
  std::optional<ScheduledStep> next_step(int32_t m) override;
  std::vector<FinishedRequest> apply(const StepResult& result) override;
  std::optional<KvHandover> next_handover() override;
  void handed_over(uint64_t handover_id) override;
  void reschedule(int32_t decode_iters, int32_t encode_batch, int32_t active_slots) override;
  std::vector<FinishedRequest> drain(const std::string& error) override;

  bool in_flight(int32_t m) const override { return lane(m).step.has_value(); }
  bool idle() const override;
  size_t waiting() const override { return waiting_.size(); }
  int32_t micro_batches() const override { return static_cast<int32_t>(lanes_.size()); }
  bool prefill_lane(int32_t m) const { return m < options_.prefill_micro_batches; }

  const WaaOptions& options() const { return options_; }
  const WaaCounters& counters() const { return counters_; }
  size_t decoding() const;  // sequences in the decode batch (running there)

 private:
  struct Seq : SeqRecord {
    using SeqRecord::SeqRecord;
    int32_t prefill_slot = -1;
    int32_t decode_slot = -1;
    int32_t lane = -1;
  };
  struct Lane {
    std::vector<uint64_t> prefilling;  // prefill lane: admitted, prompt not all in the cache
    std::vector<uint64_t> running;     // decode lane: its micro-batch
    std::optional<uint64_t> step;
    size_t step_seqs = 0;
  };
  Lane& lane(int32_t m) { return lanes_[static_cast<size_t>(m)]; }
  const Lane& lane(int32_t m) const { return lanes_[static_cast<size_t>(m)]; }
  int32_t encoder_target();
  void admit(int32_t m);
  ScheduledStep prefill_step(int32_t m);
  ScheduledStep decode_step(int32_t m);
  int32_t least_loaded_decode_lane() const;
  FinishedRequest finish(uint64_t id);

  WaaOptions options_;
  std::vector<Lane> lanes_;
  std::deque<uint64_t> waiting_;
  std::deque<uint64_t> ready_;                         // prefilled, waiting for a decode slot
  std::map<uint64_t, std::vector<uint64_t>> handing_;  // hand-overs in progress
  std::vector<int32_t> prefill_free_, decode_free_;    // lowest slot last
  std::vector<int32_t> lane_load_;                     // decode lanes: sequences assigned
  std::unordered_map<uint64_t, Seq> seqs_;
  uint64_t next_step_id_ = 1, next_handover_id_ = 1;
  int32_t active_slots_ = 0;
  WaaCounters counters_;
};

}  // namespace strata
