#include "coordinator/exegpt/waa_scheduler.h"

#include <algorithm>
#include <cmath>

#include "coordinator/intake/intake.h"
#include "coordinator/intake/request_rules.h"
#include "kernels/error.h"

namespace strata {

void WaaOptions::validate() const {
  common.validate();
  if (prefill_micro_batches <= 0)
    fail_input("WAA's prefill micro-batches must be positive, got {}", prefill_micro_batches);
  if (prefill_slots < prefill_micro_batches)
    fail_input(
        "WAA's prefill pipeline needs at least {} KV slots (one per prefill micro-batch), "
        "got {}",
        prefill_micro_batches, prefill_slots);
  if (planned_input < 0 || planned_decode_batch < 0)
    fail_input("WAA's planned mean input {} and decode batch {} must not be negative",
               planned_input, planned_decode_batch);
  if (!(threshold > 0 && threshold < 1))
    fail_input("WAA's workload threshold must be in (0, 1), got {}", threshold);
}

std::string WaaOptions::str() const {
  return fmt::format(
      "WAA: B_E {} B_m {} prefill micro-batches {} KV slots prefill {} decode {} planned input {} "
      "B_D {} threshold {}",
      common.encode_batch, common.micro_batches, prefill_micro_batches, prefill_slots,
      common.kv_slots, planned_input, planned_decode_batch, threshold);
}

WaaScheduler::WaaScheduler(const WaaOptions& options) : options_(options) {
  options_.validate();
  if (!options_.common.clock) options_.common.clock = wall_seconds;
  lanes_.resize(
      static_cast<size_t>(options_.prefill_micro_batches + options_.common.micro_batches));
  lane_load_.assign(static_cast<size_t>(options_.common.micro_batches), 0);
  for (int32_t s = options_.prefill_slots - 1; s >= 0; --s) prefill_free_.push_back(s);
  for (int32_t s = options_.common.kv_slots - 1; s >= 0; --s) decode_free_.push_back(s);
  active_slots_ = options_.common.kv_slots;
}

void WaaScheduler::submit(const GenerationRequest& request, uint64_t seq_id, double arrival) {
  STRATA_CHECK(!seqs_.contains(seq_id), "sequence {} submitted twice", seq_id);
  seqs_.emplace(seq_id, Seq(request, arrival, options_.common.kv_capacity));
  waiting_.push_back(seq_id);
}

size_t WaaScheduler::decoding() const {
  size_t n = 0;
  for (int32_t m = options_.prefill_micro_batches; m < micro_batches(); ++m)
    n += lane(m).running.size();
  return n;
}

bool WaaScheduler::idle() const {
  if (!waiting_.empty() || !ready_.empty() || !handing_.empty()) return false;
  return std::all_of(lanes_.begin(), lanes_.end(), [](const Lane& l) {
    return l.prefilling.empty() && l.running.empty() && !l.step;
  });
}

// B_E for the next encoder batch (§5.2): a step up while the decode batch (running, handed
// over or waiting for it) is below the planned B_D by more than the threshold, a step down
// while it is above.
int32_t WaaScheduler::encoder_target() {
  const int32_t b_e = options_.common.encode_batch;
  if (b_e <= 0) return static_cast<int32_t>(prefill_free_.size());
  const double b_d = options_.planned_decode_batch, th = options_.threshold;
  if (b_d <= 0) return b_e;
  size_t handing = 0;
  for (const auto& [id, seqs] : handing_) handing += seqs.size();
  const double decode_now = static_cast<double>(decoding() + handing + ready_.size());
  const int32_t step = std::max(1, static_cast<int32_t>(std::lround(th * b_e)));
  if (decode_now < (1 - th) * b_d) {
    ++counters_.decoder_adjustments;
    return b_e + step;
  }
  if (decode_now > (1 + th) * b_d) {
    ++counters_.decoder_adjustments;
    return std::max(1, b_e - step);
  }
  return b_e;
}

// An encoder batch from the waiting requests, in arrival order, into free prefill slots:
// B_E of them (encoder_target), cut before a request that would take the batch's input
// workload past (1 + threshold) x the planned one, or grown while it is below
// (1 - threshold) x that and the next request keeps it in band.
void WaaScheduler::admit(int32_t m) {
  if (waiting_.empty() || prefill_free_.empty()) return;
  const int32_t target = encoder_target();
  const double planned = options_.planned_input * target, th = options_.threshold;
  const bool banded = options_.planned_input > 0;
  Lane& l = lane(m);
  int64_t sum = 0;
  int32_t taken = 0;
  bool adjusted = false;
  const double now = options_.common.clock();
  while (!waiting_.empty() && !prefill_free_.empty()) {
    const auto len = static_cast<int64_t>(seqs_.at(waiting_.front()).request.prompt_ids.size());
    const bool over = banded && static_cast<double>(sum + len) > (1 + th) * planned;
    if (taken >= target) {
      if (!banded || static_cast<double>(sum) >= (1 - th) * planned || over) break;
      adjusted = true;  // grown: the batch's workload is short of the band
    } else if (taken > 0 && over) {
      adjusted = true;  // cut: the next request would take it past the band
      break;
    }
    Seq& seq = seqs_.at(waiting_.front());
    seq.prefill_slot = prefill_free_.back();
    prefill_free_.pop_back();
    seq.lane = m;
    seq.admitted = now;
    l.prefilling.push_back(waiting_.front());
    waiting_.pop_front();
    sum += len;
    ++taken;
  }
  ++counters_.encoder_batches;
  if (adjusted) ++counters_.encoder_adjustments;
}

std::optional<ScheduledStep> WaaScheduler::next_step(int32_t m) {
  STRATA_CHECK(m >= 0 && m < micro_batches(), "lane {} of {}", m, micro_batches());
  Lane& l = lane(m);
  STRATA_CHECK(!l.step, "lane {} already has step {} in flight", m, *l.step);
  if (prefill_lane(m)) {
    if (l.prefilling.empty()) admit(m);
    if (l.prefilling.empty()) return std::nullopt;
    return prefill_step(m);
  }
  if (l.running.empty()) return std::nullopt;
  return decode_step(m);
}

// The next max_step_tokens prompt rows of the lane's encoder batch; a sequence whose last
// chunk this is samples its first token on the prefill pipeline's last stage.
ScheduledStep WaaScheduler::prefill_step(int32_t m) {
  Lane& l = lane(m);
  ScheduledStep s;
  s.command = StepCommand{next_step_id_++, Phase::kPrefill, m, {}};
  int32_t budget = options_.common.max_step_tokens;
  size_t done = 0;
  for (size_t i = 0; i < l.prefilling.size() && budget > 0; ++i) {
    const uint64_t id = l.prefilling[i];
    Seq& seq = seqs_.at(id);
    if (seq.n_past == 0) s.joins.push_back(seq.join(id, seq.prefill_slot));
    s.command.seqs.push_back(seq.prefill_chunk(id, seq.prefill_slot, budget));
    budget -= s.command.seqs.back().n_new;
    if (seq.prefilled()) ++done;
  }
  l.prefilling.erase(l.prefilling.begin(), l.prefilling.begin() + static_cast<ptrdiff_t>(done));
  l.step = s.command.step_id;
  l.step_seqs = done;
  return s;
}

ScheduledStep WaaScheduler::decode_step(int32_t m) {
  Lane& l = lane(m);
  ScheduledStep s;
  s.command = StepCommand{next_step_id_++, Phase::kDecode, m, {}};
  for (uint64_t id : l.running) {
    Seq& seq = seqs_.at(id);
    s.command.seqs.push_back(
        SeqStep{id, seq.decode_slot, seq.n_past, 1, {seq.result.output_ids.back()}});
    seq.n_past += 1;
  }
  l.step = s.command.step_id;
  l.step_seqs = s.command.seqs.size();
  return s;
}

std::vector<FinishedRequest> WaaScheduler::apply(const StepResult& result) {
  const int32_t m = result.micro_batch;
  if (m < 0 || m >= micro_batches() || lane(m).step != result.step_id)
    fail(ErrorKind::kFailed, "result of step {} for lane {}, which has no such step in flight",
         result.step_id, m);
  Lane& l = lane(m);
  if (result.tokens.size() != l.step_seqs)
    fail(ErrorKind::kFailed, "step {} returned {} tokens for {} sequences", result.step_id,
         result.tokens.size(), l.step_seqs);
  l.step.reset();
  std::vector<FinishedRequest> finished;
  for (const SeqToken& t : result.tokens) {
    auto it = seqs_.find(t.seq_id);
    if (it == seqs_.end() || it->second.lane != m)
      fail(ErrorKind::kFailed, "step {} returned a token for sequence {}, not in lane {}",
           result.step_id, t.seq_id, m);
    if (it->second.accept(t, options_.common)) {
      finished.push_back(finish(t.seq_id));
    } else if (prefill_lane(m)) {
      ready_.push_back(t.seq_id);  // its KV cache waits for a decode slot
    }
  }
  return finished;
}

// Early termination: the sequence leaves its micro-batch and frees its slot at once.
FinishedRequest WaaScheduler::finish(uint64_t id) {
  Seq& seq = seqs_.at(id);
  if (seq.decode_slot >= 0) {
    decode_free_.push_back(seq.decode_slot);
    std::sort(decode_free_.rbegin(), decode_free_.rend());
    Lane& l = lane(seq.lane);
    std::erase(l.running, id);
    --lane_load_[static_cast<size_t>(seq.lane - options_.prefill_micro_batches)];
  }
  if (seq.prefill_slot >= 0) {
    prefill_free_.push_back(seq.prefill_slot);
    std::sort(prefill_free_.rbegin(), prefill_free_.rend());
  }
  seq.stamp_times(options_.common.clock());
  FinishedRequest f{id, std::move(seq.result), true};
  seqs_.erase(id);
  return f;
}

int32_t WaaScheduler::least_loaded_decode_lane() const {
  const auto it = std::min_element(lane_load_.begin(), lane_load_.end());
  return options_.prefill_micro_batches + static_cast<int32_t>(it - lane_load_.begin());
}

// Prefilled sequences into free decode slots (no more in use than the active slots), each
// to the decoder micro-batch with the fewest.
std::optional<KvHandover> WaaScheduler::next_handover() {
  int32_t in_use = options_.common.kv_slots - static_cast<int32_t>(decode_free_.size());
  if (ready_.empty() || decode_free_.empty() || in_use >= active_slots_) return std::nullopt;
  KvHandover h;
  h.handover_id = next_handover_id_++;
  std::vector<uint64_t>& ids = handing_[h.handover_id];
  while (!ready_.empty() && !decode_free_.empty() && in_use < active_slots_) {
    const uint64_t id = ready_.front();
    ready_.pop_front();
    Seq& seq = seqs_.at(id);
    seq.decode_slot = decode_free_.back();
    decode_free_.pop_back();
    ++in_use;
    seq.lane = least_loaded_decode_lane();
    ++lane_load_[static_cast<size_t>(seq.lane - options_.prefill_micro_batches)];
    h.moves.push_back(KvMove{id, seq.prefill_slot, seq.decode_slot, seq.n_past});
    h.joins.push_back(seq.join(id, seq.decode_slot));
    ids.push_back(id);
  }
  ++counters_.handovers;
  counters_.handed_sequences += static_cast<int64_t>(ids.size());
  return h;
}

// Every stage has the hand-over's KV: its sequences free their prefill slots and join their
// decoder micro-batches (from that lane's next step on).
void WaaScheduler::handed_over(uint64_t handover_id) {
  auto it = handing_.find(handover_id);
  if (it == handing_.end())
    fail(ErrorKind::kFailed, "KV hand-over {} done, but none such is in progress", handover_id);
  for (uint64_t id : it->second) {
    Seq& seq = seqs_.at(id);
    prefill_free_.push_back(seq.prefill_slot);
    seq.prefill_slot = -1;
    lane(seq.lane).running.push_back(id);
  }
  std::sort(prefill_free_.rbegin(), prefill_free_.rend());
  handing_.erase(it);
}

void WaaScheduler::reschedule(int32_t decode_iters, int32_t encode_batch, int32_t active_slots) {
  (void)decode_iters;  // WAA's decoders never pause for an encode
  if (encode_batch < 0) fail_input("B_E must not be negative, got {}", encode_batch);
  STRATA_CHECK(active_slots > 0 && active_slots <= options_.common.kv_slots,
               "{} active slots of {} KV slots", active_slots, options_.common.kv_slots);
  options_.common.encode_batch = encode_batch;
  active_slots_ = active_slots;
}

std::vector<FinishedRequest> WaaScheduler::drain(const std::string& error) {
  std::vector<FinishedRequest> out =
      end_all(seqs_, error, options_.common.clock(), [](const Seq& s) { return s.admitted >= 0; });
  const uint64_t next_step = next_step_id_, next_handover = next_handover_id_;
  const WaaCounters counters = counters_;
  *this = WaaScheduler(options_);  // every slot free, nothing in flight
  next_step_id_ = next_step;
  next_handover_id_ = next_handover;
  counters_ = counters;
  return out;
}

}  // namespace strata
