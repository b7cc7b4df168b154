#include "coordinator/exegpt/rra_scheduler.h"

#include <algorithm>

#include "coordinator/intake/intake.h"
#include "coordinator/intake/request_rules.h"
#include "kernels/error.h"

namespace strata {
namespace {
// Micro-batch m's share of B_E per prefill phase (0: no limit).
int32_t encode_share(int32_t encode_batch, int32_t micro_batches, int32_t m) {
  if (encode_batch <= 0) return 0;
  return std::max(1, encode_batch / micro_batches + (m < encode_batch % micro_batches ? 1 : 0));
}

}  // namespace

void SchedulerOptions::validate() const {
  if (micro_batches <= 0) fail_input("--micro-batches must be positive, got {}", micro_batches);
  if (decode_iters <= 0) fail_input("--decode-iters must be positive, got {}", decode_iters);
  if (kv_slots < micro_batches)
    fail_input("--micro-batches {} needs at least as many KV slots (--max-batch), got {}",
               micro_batches, kv_slots);
  if (kv_capacity <= 0) fail_input("KV capacity must be positive, got {}", kv_capacity);
  if (max_step_tokens <= 0)
    fail_input("--max-step-tokens must be positive, got {}", max_step_tokens);
  if (encode_batch < 0)
    fail_input("the encode batch B_E must not be negative, got {}", encode_batch);
  if (kv_budget < 0) fail_input("--kv-budget must not be negative, got {}", kv_budget);
  if (kv_budget > 0 && kv_budget / micro_batches < 2)
    fail_input("--kv-budget {} gives each of {} micro-batches fewer than 2 KV positions", kv_budget,
               micro_batches);
}

SeqRecord::SeqRecord(const GenerationRequest& r, double arrival_s, int32_t kv_capacity)
    : request(r), arrival(arrival_s) {
  STRATA_CHECK(!r.prompt_ids.empty() && r.max_new_tokens > 0 &&
                   static_cast<int32_t>(r.prompt_ids.size()) <= kv_capacity,
               "request {}: {} prompt tokens, {} new, context {}", r.id, r.prompt_ids.size(),
               r.max_new_tokens, kv_capacity);
  result.id = r.id;
  result.prompt_ids = r.prompt_ids;
  result.choice = r.choice;
  result.n = r.n;
  result.chat = r.chat;
}

SeqStep SeqRecord::prefill_chunk(uint64_t id, int32_t slot, int32_t budget) {
  const std::vector<int32_t>& ids = prefill_ids();
  const int32_t remaining = static_cast<int32_t>(ids.size()) - n_past;
  const int32_t take = std::min(remaining, budget);
  const auto from = ids.begin() + n_past;
  SeqStep s{id, slot, n_past, take, {from, from + take}, take == remaining};
  n_past += take;
  return s;
}

SeqJoin SeqRecord::join(uint64_t id, int32_t slot) const {
  SeqJoin j{id, slot, request.sampling, {}, {}};
  if (request.sampling.uses_history()) {
    j.prompt_ids = request.prompt_ids;
    j.output_ids = result.output_ids;
  }
  return j;
}

bool SeqRecord::accept(const SeqToken& t, const SchedulerOptions& o) {
  result.output_ids.push_back(t.token);
  if (t.logprobs) result.logprobs.push_back(*t.logprobs);
  if (first_token < 0) first_token = o.clock();
  return finish_if_done(request, o.eos_token_ids, o.tokenizer, n_past, o.kv_capacity, result);
}

void SeqRecord::stamp_times(double now) {
  const auto since = [&](double t) { return t < 0 ? -1.0 : std::max(0.0, t - arrival); };
  result.times = RequestTimes{since(admitted), since(first_token), since(now)};
}

FinishedRequest SeqRecord::end(uint64_t id, const std::string& error, double now, bool started) {
  result.stop_reason = StopReason::kError;
  result.error = error;
  stamp_times(now);
  return FinishedRequest{id, std::move(result), started};
}

void StepScheduler::handed_over(uint64_t handover_id) {
  fail(ErrorKind::kFailed, "KV hand-over {} done, but this schedule hands nothing over",
       handover_id);
}

RraScheduler::RraScheduler(const SchedulerOptions& options) : options_(options) {
  options_.validate();
  if (!options_.clock) options_.clock = wall_seconds;
  batches_.resize(static_cast<size_t>(options_.micro_batches));
  active_slots_ = options_.kv_slots;
  // Slot s belongs to micro-batch s mod K; each hands out its lowest free slot first.
  for (int32_t s = options_.kv_slots - 1; s >= 0; --s)
    batches_[static_cast<size_t>(s % options_.micro_batches)].free_slots.push_back(s);
}

void RraScheduler::submit(const GenerationRequest& request, uint64_t seq_id, double arrival) {
  STRATA_CHECK(!seqs_.contains(seq_id), "sequence {} submitted twice", seq_id);
  Seq seq(request, arrival, options_.kv_capacity);
  const int32_t want = options_.reserve ? options_.reserve(request) : options_.kv_capacity;
  const auto least = static_cast<int32_t>(request.prompt_ids.size()) + 1;
  seq.reserved = std::min(std::max(want, least), reservation_cap(seq, micro_batches() - 1));
  if (options_.kv_admission == KvAdmission::kPooled) {
    if (options_.outlook) {
      seq.outlook = options_.outlook(request);
    } else {
      seq.outlook.point = seq.reserved - static_cast<int32_t>(request.prompt_ids.size());
      seq.outlook.cap = seq.outlook.point;
    }
  }
  seqs_.emplace(seq_id, std::move(seq));
  waiting_.push_back(seq_id);
}

int64_t RraScheduler::budget_of(int32_t m) const {
  const int64_t k = micro_batches();
  return options_.kv_budget / k + (m < options_.kv_budget % k ? 1 : 0);
}

// The most a sequence may reserve in micro-batch m: the context, the micro-batch's share of
// the budget and, where max_new_tokens is a length hint, all the tokens it may make.
int32_t RraScheduler::reservation_cap(const Seq& seq, int32_t m) const {
  int64_t cap = options_.kv_capacity;
  if (options_.kv_budget > 0) cap = std::min(cap, budget_of(m));
  if (options_.max_new_caps)
    cap = std::min<int64_t>(
        cap, static_cast<int64_t>(seq.request.prompt_ids.size()) + seq.request.max_new_tokens);
  return static_cast<int32_t>(cap);
}

bool RraScheduler::idle() const {
  if (!waiting_.empty()) return false;
  return std::all_of(batches_.begin(), batches_.end(), [](const MicroBatch& b) {
    return b.running.empty() && b.prefilling.empty() && !b.step;
  });
}

// Waiting requests into the micro-batch's free slots while it holds no more than its share
// of all the work, so the micro-batches stay balanced and every stage has one to run while
// the others compute: in arrival order, or packed into the micro-batch's share of the KV
// budget by first-fit decreasing (S3).
void RraScheduler::admit(int32_t m) {
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  size_t running_now = 0;
  for (const MicroBatch& other : batches_)
    running_now += other.running.size() + other.prefilling.size();
  const size_t k = batches_.size();
  const size_t share = (waiting_.size() + running_now + k - 1) / k;
  const size_t mine = b.running.size() + b.prefilling.size();
  const int32_t limit = encode_share(options_.encode_batch, micro_batches(), m);
  size_t room = std::min(b.free_slots.size(), share > mine ? share - mine : 0);
  const auto active = static_cast<size_t>(active_slots_);
  room = std::min(room, active > running_now ? active - running_now : 0);
  if (limit > 0) room = std::min(room, static_cast<size_t>(limit));
  std::vector<uint64_t> ids;
  if (options_.kv_budget > 0) {
    ids = packed_admissions(m, room);
  } else {
    ids.assign(waiting_.begin(),
               waiting_.begin() + static_cast<ptrdiff_t>(std::min(room, waiting_.size())));
  }
  for (uint64_t id : ids) {
    Seq& seq = seqs_.at(id);
    seq.slot = b.free_slots.back();
    b.free_slots.pop_back();
    seq.micro_batch = m;
    b.reserved += seq.reserved;
    b.prefilling.push_back(id);
    ++packing_.admitted;
  }
  if (ids.empty()) return;
  std::erase_if(waiting_, [&](uint64_t id) { return seqs_.at(id).slot >= 0; });  // admitted
  if (options_.kv_budget > 0)  // those left were passed over
    for (uint64_t id : waiting_) ++seqs_.at(id).passed_over;
}

// First-fit decreasing of the waiting sequences' reservations into what is left of the
// micro-batch's budget. A sequence passed over kMaxPassedOver times while others were taken
// (admit counts them) goes first, and nothing overtakes it until it fits.
std::vector<uint64_t> RraScheduler::packed_admissions(int32_t m, size_t max_items) {
  constexpr int32_t kMaxPassedOver = 64;
  std::vector<int64_t> sizes;
  sizes.reserve(waiting_.size());
  std::optional<size_t> first;
  for (size_t i = 0; i < waiting_.size(); ++i) {
    const Seq& seq = seqs_.at(waiting_[i]);
    sizes.push_back(seq.reserved);
    if (!first && seq.passed_over >= kMaxPassedOver) first = i;
  }
  std::vector<size_t> chosen;
  if (options_.kv_admission == KvAdmission::kPooled) {
    std::vector<UsageProfile> items;
    items.reserve(waiting_.size());
    for (uint64_t id : waiting_) {
      Seq& seq = seqs_.at(id);
      if (!seq.waiting_profile) {
        seq.waiting_profile = usage_profile();
        seq.waiting_profile->add(seq.outlook, static_cast<int32_t>(seq.result.output_ids.size()),
                                 static_cast<int64_t>(seq.prefill_ids().size()) + 1);
      }
      items.push_back(*seq.waiting_profile);
    }
    chosen = pooled_first_fit_decreasing(sizes, items, usage_of(m), options_.pooled_z, budget_of(m),
                                         max_items, first);
  } else {
    const int64_t free = budget_of(m) - batches_[static_cast<size_t>(m)].reserved;
    chosen = first_fit_decreasing(sizes, free, max_items, first);
  }
  std::vector<uint64_t> ids;
  for (size_t i : chosen) ids.push_back(waiting_[i]);
  return ids;
}

std::optional<ScheduledStep> RraScheduler::next_step(int32_t m) {
  STRATA_CHECK(m >= 0 && m < micro_batches(), "micro-batch {} of {}", m, micro_batches());
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  STRATA_CHECK(!b.step, "micro-batch {} already has step {} in flight", m, *b.step);
  if (b.prefilling.empty() && (b.decode_left <= 0 || b.running.empty())) {
    admit(m);
    b.decode_left = options_.decode_iters;  // the next phase: N_D decode iterations
    if (b.prefilling.empty() && b.running.empty()) return std::nullopt;
  }
  if (!b.prefilling.empty()) return prefill_step(m);
  --b.decode_left;
  return decode_step(m);
}

// The next max_step_tokens prompt rows of the phase's admitted sequences, in admission
// order; a sequence whose last chunk this is samples its first token and runs.
ScheduledStep RraScheduler::prefill_step(int32_t m) {
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  ScheduledStep s;
  s.command = StepCommand{next_step_id_++, Phase::kPrefill, m, {}};
  const double now = options_.clock();
  int32_t budget = options_.max_step_tokens;
  size_t done = 0;
  for (size_t i = 0; i < b.prefilling.size() && budget > 0; ++i) {
    const uint64_t id = b.prefilling[i];
    Seq& seq = seqs_.at(id);
    // Its first chunk: the last stage learns how to sample it (a preempted sequence kept its
    // sampling state there, so its random draws go on where they stopped).
    if (seq.n_past == 0 && seq.preemptions == 0) {
      seq.admitted = now;
      s.joins.push_back(seq.join(id, seq.slot));
    }
    s.command.seqs.push_back(seq.prefill_chunk(id, seq.slot, budget));
    budget -= s.command.seqs.back().n_new;
    if (seq.prefilled()) {
      seq.resume_ids.clear();
      b.running.push_back(id);
      ++done;
    }
  }
  b.prefilling.erase(b.prefilling.begin(), b.prefilling.begin() + static_cast<ptrdiff_t>(done));
  b.step = s.command.step_id;
  b.step_seqs = done;
  return s;
}

ScheduledStep RraScheduler::decode_step(int32_t m) {
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  ScheduledStep s;
  s.command = StepCommand{next_step_id_++, Phase::kDecode, m, {}};
  for (uint64_t id : b.running) {
    Seq& seq = seqs_.at(id);
    s.command.seqs.push_back(SeqStep{id, seq.slot, seq.n_past, 1, {seq.result.output_ids.back()}});
    seq.n_past += 1;
    packing_.used_sum += seq.n_past;
  }
  ++packing_.decode_steps;
  packing_.decode_rows += static_cast<int64_t>(b.running.size());
  packing_.reserved_sum += b.reserved;
  b.step = s.command.step_id;
  b.step_seqs = s.command.seqs.size();
  return s;
}

std::vector<FinishedRequest> RraScheduler::apply(const StepResult& result) {
  const int32_t m = result.micro_batch;
  if (m < 0 || m >= micro_batches() || batches_[static_cast<size_t>(m)].step != result.step_id)
    fail(ErrorKind::kFailed,
         "result of step {} for micro-batch {}, which has no such step in flight", result.step_id,
         m);
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  if (result.tokens.size() != b.step_seqs)
    fail(ErrorKind::kFailed, "step {} returned {} tokens for {} sequences", result.step_id,
         result.tokens.size(), b.step_seqs);
  b.step.reset();
  std::vector<FinishedRequest> finished;
  for (const SeqToken& t : result.tokens) {
    auto it = seqs_.find(t.seq_id);
    if (it == seqs_.end() || it->second.micro_batch != m)
      fail(ErrorKind::kFailed, "step {} returned a token for sequence {}, not in micro-batch {}",
           result.step_id, t.seq_id, m);
    if (!it->second.accept(t, options_)) continue;
    b.free_slots.push_back(it->second.slot);
    b.reserved -= it->second.reserved;
    std::erase(b.running, t.seq_id);
    it->second.stamp_times(options_.clock());
    finished.push_back(FinishedRequest{t.seq_id, std::move(it->second.result), true});
    seqs_.erase(it);
  }
  if (options_.kv_budget > 0) {
    if (options_.kv_admission == KvAdmission::kPooled) {
      supervise_pooled(m);
    } else {
      supervise(m);
    }
  }
  std::sort(b.free_slots.rbegin(), b.free_slots.rend());  // lowest on top, as the KV cache does
  return finished;
}

// S3's supervisor: a running sequence whose next token would not fit its reservation gets
// it doubled (capped: reservation_cap) -- in place while the micro-batch's budget has room,
// else it is preempted: its slot and reservation go back, and it waits to be recomputed
// (kv_packing.h says why recompute) ahead of the sequences that never ran.
void RraScheduler::supervise(int32_t m) {
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  const std::vector<uint64_t> running = b.running;
  for (uint64_t id : running) {
    Seq& seq = seqs_.at(id);
    if (seq.n_past + 1 <= seq.reserved) continue;
    const int32_t want =
        std::min(reservation_cap(seq, m), std::max(2 * seq.reserved, seq.n_past + 1));
    if (b.reserved - seq.reserved + want <= budget_of(m)) {
      b.reserved += want - seq.reserved;
      seq.reserved = want;
      ++packing_.extensions;
      continue;
    }
    preempt(m, id, want);
  }
}

// Pooled admission's supervisor: an outgrown reservation is doubled (what binds is the
// positions filled, not the reservations); when the micro-batch's next step would fill more
// than its share of the budget, the running sequences that have filled the fewest positions
// (the cheapest to recompute; ties: the latest) are preempted until it fits.
void RraScheduler::supervise_pooled(int32_t m) {
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  for (uint64_t id : b.running) {
    Seq& seq = seqs_.at(id);
    if (seq.n_past + 1 <= seq.reserved) continue;
    const int32_t want =
        std::min(reservation_cap(seq, m), std::max(2 * seq.reserved, seq.n_past + 1));
    b.reserved += want - seq.reserved;
    seq.reserved = want;
    ++packing_.extensions;
  }
  int64_t used = usage_of(m).used;
  while (used > budget_of(m) && !b.running.empty()) {
    const uint64_t victim =
        *std::min_element(b.running.begin(), b.running.end(), [&](uint64_t x, uint64_t y) {
          const int32_t nx = seqs_.at(x).n_past;
          const int32_t ny = seqs_.at(y).n_past;
          return nx != ny ? nx < ny : x > y;
        });
    used -= seqs_.at(victim).n_past + 1;
    preempt(m, victim, seqs_.at(victim).reserved);
  }
}

// The sequence gives back its slot and reservation and waits, ahead of those that never
// ran, to be recomputed (kv_packing.h says why recompute) with `reserve` positions.
void RraScheduler::preempt(int32_t m, uint64_t id, int32_t reserve) {
  MicroBatch& b = batches_[static_cast<size_t>(m)];
  Seq& seq = seqs_.at(id);
  std::erase(b.running, id);
  b.free_slots.push_back(seq.slot);
  b.reserved -= seq.reserved;
  seq.reserved = reserve;
  seq.resume_ids = seq.request.prompt_ids;
  seq.resume_ids.insert(seq.resume_ids.end(), seq.result.output_ids.begin(),
                        seq.result.output_ids.end());
  packing_.recomputed_tokens += static_cast<int64_t>(seq.resume_ids.size());
  seq.n_past = 0;
  seq.slot = -1;
  seq.micro_batch = -1;
  seq.waiting_profile.reset();  // it has made tokens since
  if (seq.preemptions++ == 0) ++packing_.preempted_seqs;
  ++packing_.preemptions;
  waiting_.push_front(id);
}

UsageProfile RraScheduler::usage_profile() const {
  return UsageProfile::over_context(options_.kv_capacity);
}

// What micro-batch m's sequences fill at their next step and are expected to fill later.
UsageProfile RraScheduler::usage_of(int32_t m) const {
  const MicroBatch& b = batches_[static_cast<size_t>(m)];
  UsageProfile load = usage_profile();
  for (uint64_t id : b.running) {
    const Seq& seq = seqs_.at(id);
    load.add(seq.outlook, static_cast<int32_t>(seq.result.output_ids.size()), seq.n_past + 1);
  }
  for (uint64_t id : b.prefilling) {
    const Seq& seq = seqs_.at(id);
    load.add(seq.outlook, static_cast<int32_t>(seq.result.output_ids.size()),
             static_cast<int64_t>(seq.prefill_ids().size()) + 1);
  }
  return load;
}

void RraScheduler::reschedule(int32_t decode_iters, int32_t encode_batch, int32_t active_slots) {
  if (decode_iters <= 0) fail_input("N_D must be positive, got {}", decode_iters);
  if (encode_batch < 0) fail_input("B_E must not be negative, got {}", encode_batch);
  STRATA_CHECK(active_slots > 0 && active_slots <= options_.kv_slots,
               "{} active slots of {} KV slots", active_slots, options_.kv_slots);
  options_.decode_iters = decode_iters;
  options_.encode_batch = encode_batch;
  active_slots_ = active_slots;
}

std::vector<FinishedRequest> RraScheduler::drain(const std::string& error) {
  std::vector<FinishedRequest> out = end_all(seqs_, error, options_.clock(), [](const Seq& s) {
    return s.slot >= 0 || s.preemptions > 0;
  });
  seqs_.clear();
  waiting_.clear();
  const uint64_t next_step = next_step_id_;
  const PackingCounters packing = packing_;
  *this = RraScheduler(SchedulerOptions(options_));  // every slot free, no step in flight
  next_step_id_ = next_step;
  packing_ = packing;  // what the run did stays reported
  return out;
}

}  // namespace strata
