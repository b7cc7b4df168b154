#include "worker/stage_worker.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <variant>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/log.h"
#include "transport/all_reduce.h"
#include "transport/control_channel.h"
#include "transport/peer_monitor.h"
#include "transport/tensor_channel.h"
#include "worker/compute_thread.h"
#include "worker/node_probe.h"
#include "worker/stage.h"
#include "worker/tensor_parallel.h"

namespace strata {
namespace {

// The coordinator said stop while this worker was waiting inside a step.
struct ShutdownRequested {};

// WAA's KV hand-over moves on its own tag, beside the activations.
constexpr int kKvTag = kTensorTag + 1;

// One hand-over's transfers on this stage: to every decode stage that shares layers with
// this prefill stage, or from every prefill stage that shares layers with this decode
// stage (one buffer and one transfer per peer, in pipeline order on both sides).
struct KvTransfers {
  KvHandover handover;
  bool receiving = false;
  struct Part {
    int peer = -1;
    int32_t begin = 0, end = 0;  // the model layers the two stages share
    std::vector<int32_t> buffer;
    Transfer transfer;
  };
  std::vector<Part> parts;
  uint64_t bytes = 0;
  Deadline deadline = Deadline::after_seconds(0);
};

// One step's activations: on the compute device when the link to that neighbour is NCCL,
// else the backend's transfer-ready host memory (page-locked with CUDA) for MPI.
struct StepBuffers {
  DeviceBuffer in;
  DeviceBuffer out[2];  // the step's output while the previous one is still sending
  bool in_device = false;
  bool out_device = false;
};

class StageWorker {
 public:
  StageWorker(const Communicator& world, Backend& backend, const StageWorkerOptions& o)
      : world_(world), backend_(backend), options_(o), control_(world) {}

  int run();

 private:
  bool receive_plan();
  void start(const ClusterPlan& plan);
  void join_group(const StagePlan& stage);
  void allocate_buffers(const StagePlan& stage);
  int serve();
  bool handle(const ControlMessage& message);  // false on Shutdown
  void on_step(const StepCommand& command);
  void on_handover(const KvHandover& handover);
  bool progress_handovers(bool compute_idle);
  void finish_handover(KvTransfers& h);
  void on_profile(const ProfileRequest& request);
  void measure_transfers(const ProfileRequest& request, ProfileReport& report);
  void run_on_compute(std::function<void()> job, const std::string& what, double timeout_s,
                      const char* timeout_name);
  std::vector<SeqToken> compute_step(const StepCommand& command, std::span<float> in,
                                     std::span<float> out);
  void on_shutdown();
  void send_stats();
  StageStats stats_so_far() const;
  int linger_after(const std::exception& e);
  int settle_compute(int code);

  // The next message from rank 0; `deadline` nullopt: until rank 0 is silent for the
  // heartbeat timeout (every ping it sends moves the deadline on).
  ControlMessage next_message(std::optional<Deadline> deadline, const char* awaited);
  // A ping is answered, anything else queued; Shutdown ends a step at once (throws) when
  // `stop_on_shutdown`, else (between steps) it is queued and handled in order.
  bool serve_control_once(bool stop_on_shutdown = true);
  void check_coordinator() const;
  void wait_serving(Transfer& transfer, const Deadline& deadline);
  void wait_sends(const Deadline& deadline);

  const Communicator& world_;
  Backend& backend_;
  StageWorkerOptions options_;
  ControlChannel control_;
  std::deque<ControlMessage> pending_;
  std::optional<ClusterPlan> plan_;
  std::unique_ptr<TensorLinks> links_;
  std::unique_ptr<MpiTensorChannel> kv_channel_;
  // A tensor-parallel stage's group and the sum its shard's layers call (both outlive the
  // stage, whose compute uses them).
  std::unique_ptr<AllReduceGroup> group_;
  std::unique_ptr<GroupBlockReduce> block_reduce_;
  int32_t tp_index_ = 0;  // 0: the stage's rank (the leader) or no group
  std::deque<std::unique_ptr<KvTransfers>> handovers_;  // posted, not yet all done
  int64_t handovers_taken_ = 0;
  bool progressing_ = false;  // inside progress_handovers
  std::unique_ptr<PipelineStage> stage_;
  std::unique_ptr<StepBuffers> buffers_;
  size_t buffer_floats_ = 0;
  // The previous stage's rank (its leader sends to every member of this stage), and every
  // rank of the next stage, its own rank first (this stage's leader sends to each).
  int prev_ = -1;
  std::vector<int> next_group_;
  int next() const { return next_group_.empty() ? -1 : next_group_[0]; }
  std::vector<Transfer> sends_[2];  // of buffers_->out, so destroyed (cancelled) first
  ComputeThread compute_;           // uses stage_ and buffers_, so joined before they go
  bool bound_ = false;              // the compute thread has bound itself to the backend
  int next_out_ = 0;
  uint64_t step_id_ = 0;
  StageStats stats_;
  double window_start_ = -1, window_end_ = 0;
  double busy_since_ = -1;  // the step computing now began (-1: none)
  // System-clock seconds minus steady-clock seconds: the timeline's spans in wall time.
  const double wall_offset_ =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
      now_s();
  double last_heard_ = now_s();  // the last message from rank 0
};

int StageWorker::run() {
  stats_.rank = world_.rank();
  if (!receive_plan()) return 0;
  int code = 0;
  try {
    start(*plan_);
    code = serve();
  } catch (const ShutdownRequested&) {
    send_stats();  // stopped mid-step (a job cut short): rank 0 still waits for the stats
    code = 0;
  } catch (const std::exception& e) {
    code = linger_after(e);
  }
  return settle_compute(code);
}

// A step may still compute when the worker stops (Shutdown or an error mid-step): it gets
// the step timeout to end. One that does not is abandoned together with what it uses, and
// the caller must end the process.
int StageWorker::settle_compute(int code) {
  if (!compute_.busy() || compute_.wait_for(std::chrono::duration<double>(options_.step_timeout_s)))
    return code;
  log::get("worker")->error(
      "rank {}: step {} still computing {} s after the stop; ending the process", world_.rank(),
      step_id_, options_.step_timeout_s);
  for (auto& sends : sends_) sends.clear();
  compute_.abandon();
  (void)stage_.release();
  (void)buffers_.release();
  return kStageLostPeer;
}

// False when the coordinator shuts the job down before sending a plan (it refused one).
bool StageWorker::receive_plan() {
  const Deadline deadline = Deadline::after_seconds(options_.plan_timeout_s);
  while (true) {
    ControlMessage m = next_message(deadline, "the cluster plan");
    if (std::holds_alternative<Shutdown>(m)) return false;
    if (auto* plan = std::get_if<ClusterPlan>(&m)) {
      plan_ = *plan;
      return true;
    }
    fail(ErrorKind::kFailed, "expected the cluster plan from rank 0, got {}", str(m));
  }
}

void StageWorker::start(const ClusterPlan& plan) {
  plan.validate();
  const int me = world_.rank();
  links_ = std::make_unique<TensorLinks>(TensorLinks::create(
      world_, options_.device, Deadline::after_seconds(options_.plan_timeout_s)));
  const StagePlan* stage = plan.stage_of_rank(me);
  if (stage == nullptr)
    fail(ErrorKind::kFailed, "plan {} has no stage for rank {}", plan.plan_id, me);
  tp_index_ = stage->tp_index(me);
  // Neighbours within the stage's pipeline (a WAA plan has two); a shard other than the
  // leader receives from the previous stage as the leader does but sends nothing.
  const std::span<const StagePlan> pipeline = plan.pipeline_of(*stage);
  for (size_t i = 0; i < pipeline.size(); ++i) {
    if (pipeline[i].rank != stage->rank) continue;
    if (i > 0) prev_ = pipeline[i - 1].rank;
    if (i + 1 < pipeline.size() && tp_index_ == 0) next_group_ = pipeline[i + 1].ranks();
  }
  if (plan.waa()) kv_channel_ = std::make_unique<MpiTensorChannel>(world_, kKvTag);
  if (stage->tp_degree() > 1) join_group(*stage);
  StageOptions so = options_.stage;
  so.tp_index = tp_index_;
  so.tp_reduce = block_reduce_.get();
  // A re-deployed stage lets go of the last one before it loads, and the peaks of resident
  // memory count from here: what this plan's stage takes, as the kernel sees it.
  buffers_.reset();
  stage_.reset();
  if (!reset_peak_rss())
    log::get("worker")->warn("rank {}: the peak of resident memory cannot be reset", me);
  stats_.rss_before_load_bytes = static_cast<uint64_t>(process_rss_bytes());
  stage_ = std::make_unique<PipelineStage>(plan, *stage, backend_, so);
  allocate_buffers(*stage);
  // The load's own peak (a matrix repacked while its original still exists, a layer on its
  // way to disk) apart from the run's: the budget bounds what the stage holds as it runs.
  stats_.load_peak_rss_bytes = static_cast<uint64_t>(process_peak_rss_bytes());
  reset_peak_rss();
  log::get("worker")->info(
      "rank {}: activations from rank {} over {}, to ranks [{}] over {}{}", me, prev_,
      prev_ < 0 ? "-" : links_->to(prev_).name(), fmt::join(next_group_, ", "),
      next() < 0 ? "-" : links_->to(next()).name(), group_ ? "; " + group_->str() : "");
}

// The stage's tensor-parallel group: NCCL when every member computes on its own GPU (as
// TensorLinks found them), MPI otherwise.
void StageWorker::join_group(const StagePlan& stage) {
  const std::vector<int32_t> members = stage.ranks();
  const bool nccl = options_.device >= 0 && std::all_of(members.begin(), members.end(),
                                                        [&](int32_t r) { return links_->gpu(r); });
  const Deadline deadline = Deadline::after_seconds(options_.plan_timeout_s);
  group_ = nccl ? make_nccl_all_reduce(world_, {members.begin(), members.end()}, options_.device,
                                       deadline)
                : make_mpi_all_reduce(world_, {members.begin(), members.end()});
  block_reduce_ = std::make_unique<GroupBlockReduce>(backend_, *group_, options_.step_timeout_s);
}

// One step's activations in (not the first stage) and out: two buffers to the next stage
// (the leader of a stage that is not the last), or one the shard discards (the other members
// of a tensor-parallel group, whose output is the leader's too). Checked against the plan on
// the leader; a member holds the same shard without the head.
void StageWorker::allocate_buffers(const StagePlan& stage) {
  buffer_floats_ =
      static_cast<size_t>(plan_->max_batch_rows) * static_cast<size_t>(plan_->hidden_size);
  const size_t bytes = buffer_floats_ * sizeof(float);
  auto buffer = [&](bool device) {
    return device ? DeviceBuffer(backend_, bytes) : DeviceBuffer::host(backend_, bytes);
  };
  buffers_ = std::make_unique<StepBuffers>();
  StepBuffers& b = *buffers_;
  if (!stage_->first()) {
    b.in_device = links_->to(prev_).device_buffers();
    b.in = buffer(b.in_device);
  }
  if (!next_group_.empty()) {
    b.out_device = links_->to(next_group_[0]).device_buffers();
    for (int r : next_group_)
      if (links_->to(r).device_buffers() != b.out_device)
        fail(ErrorKind::kFailed,
             "rank {}: the next stage's ranks [{}] mix NCCL and MPI links; give every rank of a "
             "tensor-parallel group the same kind of device",
             world_.rank(), fmt::join(next_group_, ", "));
    b.out[0] = buffer(b.out_device);
    b.out[1] = buffer(b.out_device);
  } else if (!stage_->last()) {
    // The compute backend's own memory, which nothing reads.
    b.out_device = backend_.device() != Device::kHost;
    b.out[0] = DeviceBuffer(backend_, bytes);
  }
  TierBytes allocated = stage_->memory();
  for (const DeviceBuffer* buf : {&b.in, &b.out[0], &b.out[1]}) {
    const bool device = buf == &b.in ? b.in_device : b.out_device;
    (device ? allocated.gpu : allocated.cpu) += static_cast<int64_t>(buf->size());
  }
  stats_.allocated_gpu_bytes = static_cast<uint64_t>(allocated.gpu);
  stats_.allocated_cpu_bytes = static_cast<uint64_t>(allocated.cpu);
  stats_.allocated_disk_bytes = static_cast<uint64_t>(allocated.disk);
  if (tp_index_ == 0) {
    check_allocation(stage, allocated);
  } else {
    log::get("worker")->info("rank {}: shard {} of stage {} allocated {}", world_.rank(), tp_index_,
                             stage.str(), allocated.str());
  }
}

// Commands in order; between them, the hand-overs in progress move on (a WAA stage keeps
// serving steps while its KV transfers complete).
int StageWorker::serve() {
  Backoff backoff;
  while (true) {
    if (!pending_.empty()) {
      ControlMessage m = std::move(pending_.front());
      pending_.pop_front();
      if (!handle(m)) return 0;
      backoff = Backoff();
      continue;
    }
    if (progress_handovers(true) || serve_control_once(false)) {
      backoff = Backoff();
      continue;
    }
    check_coordinator();
    backoff.pause();
  }
}

bool StageWorker::handle(const ControlMessage& m) {
  if (auto* step = std::get_if<StepCommand>(&m)) {
    on_step(*step);
  } else if (auto* request = std::get_if<ProfileRequest>(&m)) {
    on_profile(*request);
  } else if (auto* plan = std::get_if<ClusterPlan>(&m)) {
    // Re-deployment (a schedule chose other layers or KV slots): the old stage goes first,
    // its memory with it, then the new one loads as the first did.
    wait_sends(Deadline::after_seconds(options_.step_timeout_s));
    buffers_.reset();
    handovers_.clear();
    stage_.reset();
    block_reduce_.reset();
    group_.reset();
    plan_ = *plan;
    prev_ = -1;
    next_group_.clear();
    start(*plan_);
  } else if (auto* handover = std::get_if<KvHandover>(&m)) {
    on_handover(*handover);
  } else if (auto* update = std::get_if<BatchUpdate>(&m)) {
    for (const SeqJoin& j : update->joined) stage_->join(j);
    for (uint64_t id : update->left) stage_->leave(id);
  } else if (std::holds_alternative<Shutdown>(m)) {
    on_shutdown();
    return false;
  } else {
    fail(ErrorKind::kFailed, "unexpected {} from rank 0 while serving", message_name(m));
  }
  return true;
}

// Tests of poison requests: a prompt holding the token kills the process, as a request
// that crashes the engine would.
void crash_on_token(const StepCommand& c, int32_t token) {
  if (token < 0) return;
  for (const SeqStep& s : c.seqs) {
    if (std::find(s.token_ids.begin(), s.token_ids.end(), token) == s.token_ids.end()) continue;
    log::get("worker")->warn("test hook: sequence {} holds token {}: dying now (SIGKILL)", s.seq_id,
                             token);
    std::raise(SIGKILL);
  }
}

void StageWorker::on_step(const StepCommand& c) {
  step_id_ = c.step_id;
  if (stage_->first()) crash_on_token(c, options_.debug_crash_token);
  const double t0 = now_s();
  if (window_start_ < 0) window_start_ = t0;
  const Deadline deadline = Deadline::after_seconds(options_.step_timeout_s);
  const size_t act = static_cast<size_t>(c.rows()) * static_cast<size_t>(stage_->hidden());
  if (act > buffer_floats_)
    fail(ErrorKind::kFailed, "step {}: {} rows exceed the plan's {}", c.step_id, c.rows(),
         plan_->max_batch_rows);
  StepBuffers& b = *buffers_;
  std::span<float> in(b.in.f32(), stage_->first() ? 0 : act);
  if (!stage_->first()) {
    Transfer t = links_->to(prev_).start_recv(prev_, in);
    wait_serving(t, deadline);
  }
  const int k = next_group_.empty() ? 0 : next_out_;
  for (Transfer& t : sends_[k]) wait_serving(t, deadline);  // the buffer's previous sends
  const double busy_from = now_s();
  busy_since_ = busy_from;
  std::span<float> out(b.out[k].f32(), stage_->last() ? 0 : act);
  std::vector<SeqToken> tokens = compute_step(c, in, out);
  if (stage_->last()) {
    control_.send(0, StepResult{c.step_id, c.micro_batch, std::move(tokens)}, deadline);
  } else if (!next_group_.empty()) {
    sends_[k].clear();
    for (int r : next_group_)
      sends_[k].push_back(links_->to(r).start_send(r, std::span<const float>(out)));
    next_out_ ^= 1;
  }
  window_end_ = now_s();
  busy_since_ = -1;
  stats_.add_span(busy_from + wall_offset_, window_end_ + wall_offset_);  // the timeline
  stats_.busy_seconds += window_end_ - busy_from;
  stats_.steps += 1;
  stats_.rows += static_cast<uint64_t>(c.rows());
  const WeightTraffic traffic = stage_->weight_traffic();  // the compute thread is done
  stats_.bytes_from_cpu = traffic.from_cpu;
  stats_.bytes_from_disk = traffic.from_disk;
  if (options_.debug_exit_after_steps >= 0 &&
      stats_.steps >= static_cast<uint64_t>(options_.debug_exit_after_steps)) {
    log::get("worker")->warn("test hook: rank {} dies now (SIGKILL) after {} steps", world_.rank(),
                             stats_.steps);
    std::raise(SIGKILL);
  }
}

// WAA's hand-over on this stage: a prefill stage packs the KV of its layers that each decode
// stage holds (on the compute thread, which is idle between steps) and posts the sends; a
// decode stage posts the receives and stores them once they are in, between its steps
// (progress_handovers). Neither waits here: the stage goes on with its next steps.
void StageWorker::on_handover(const KvHandover& h) {
  if (!plan_->waa())
    fail(ErrorKind::kFailed, "{} for plan {}, which is not WAA", h.str(), plan_->plan_id);
  const StagePlan& me = stage_->stage();
  const bool receiving = !plan_->encoder(me);
  if (receiving && stage_->last())
    for (const SeqJoin& j : h.joins) stage_->join_after_prefill(j);
  auto t = std::make_unique<KvTransfers>();
  t->handover = h;
  t->receiving = receiving;
  t->deadline = Deadline::after_seconds(options_.step_timeout_s);
  for (const StagePlan& peer : plan_->pipeline(receiving ? Phase::kPrefill : Phase::kDecode)) {
    const int32_t begin = std::max(me.layer_begin, peer.layer_begin);
    const int32_t end = std::min(me.layer_end, peer.layer_end);
    if (begin >= end) continue;
    KvTransfers::Part part{peer.rank, begin, end, {}, {}};
    const size_t bytes = stage_->kv_bytes(h.moves, begin, end);
    part.buffer.assign((bytes + sizeof(int32_t) - 1) / sizeof(int32_t), 0);
    t->bytes += bytes;
    t->parts.push_back(std::move(part));
  }
  if (!receiving) {
    PipelineStage* stage = stage_.get();
    KvTransfers* raw = t.get();
    run_on_compute(
        [=] {
          for (KvTransfers::Part& p : raw->parts)
            stage->export_kv(raw->handover.moves, p.begin, p.end,
                             reinterpret_cast<std::byte*>(p.buffer.data()));
        },
        fmt::format("KV hand-over {}", h.handover_id), options_.step_timeout_s, "the step timeout");
  }
  for (KvTransfers::Part& p : t->parts)
    p.transfer = receiving ? kv_channel_->start_recv(p.peer, std::span<int32_t>(p.buffer))
                           : kv_channel_->start_send(p.peer, std::span<const int32_t>(p.buffer));
  handovers_.push_back(std::move(t));
  if (options_.debug_die_in_handover >= 0 && ++handovers_taken_ >= options_.debug_die_in_handover) {
    log::get("worker")->warn("test hook: rank {} dies now (SIGKILL) in KV hand-over {}",
                             world_.rank(), h.handover_id);
    std::raise(SIGKILL);
  }
}

// Tests the hand-overs' transfers; one whose transfers are all done is finished (a decode
// stage stores what it received, which needs the compute thread idle). A transfer not done
// by its deadline (the peer is gone or stuck) is an Error naming it. True when one finished.
bool StageWorker::progress_handovers(bool compute_idle) {
  if (progressing_) return false;  // a hand-over finishing waits on the compute thread
  progressing_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{progressing_};
  bool finished = false;
  for (auto it = handovers_.begin(); it != handovers_.end();) {
    KvTransfers& h = **it;
    bool done = true;
    for (KvTransfers::Part& p : h.parts) {
      if (!p.transfer.pending() || p.transfer.test()) continue;
      done = false;
      if (h.deadline.expired()) p.transfer.wait(h.deadline);  // throws, naming the peer
    }
    if (!done || (h.receiving && !compute_idle)) {
      ++it;
      continue;
    }
    finish_handover(h);
    it = handovers_.erase(it);
    finished = true;
  }
  return finished;
}

void StageWorker::finish_handover(KvTransfers& h) {
  if (h.receiving) {
    PipelineStage* stage = stage_.get();
    KvTransfers* raw = &h;
    run_on_compute(
        [=] {
          for (const KvTransfers::Part& p : raw->parts)
            stage->import_kv(raw->handover.moves, p.begin, p.end,
                             reinterpret_cast<const std::byte*>(p.buffer.data()));
        },
        fmt::format("KV hand-over {}", h.handover.handover_id), options_.step_timeout_s,
        "the step timeout");
  }
  control_.send(0, KvHandoverDone{h.handover.handover_id, world_.rank(), h.bytes},
                Deadline::after_seconds(options_.step_timeout_s));
}

// Runs a job on the compute thread and serves control messages (pings) until it ends. The
// job holds its own copies and pointers, not this worker, so that settle_compute can abandon
// a job that never ends.
void StageWorker::run_on_compute(std::function<void()> job, const std::string& what,
                                 double timeout_s, const char* timeout_name) {
  // The thread's OpenMP count and CUDA device, once: the compute backend's and the host's
  // that attends over an offloaded cache.
  Backend* backend = bound_ ? nullptr : &backend_;
  Backend* host = bound_ ? nullptr : options_.stage.cache.host;
  bound_ = true;
  compute_.start([=] {
    if (host != nullptr && host != backend) host->bind_thread();
    if (backend != nullptr) backend->bind_thread();
    job();
  });
  const Deadline deadline = Deadline::after_seconds(timeout_s);
  Backoff backoff;
  while (!compute_.poll()) {
    if (deadline.expired())
      fail(ErrorKind::kFailed, "{}: still computing after {} s ({})", what, timeout_s,
           timeout_name);
    if (progress_handovers(false) || serve_control_once()) continue;
    check_coordinator();
    backoff.pause();
  }
}

// ExeGPT's XProfiler on this rank: its stage's timings on the compute thread, then its
// links (receiving from the previous stage, sending to the next), reported to rank 0.
void StageWorker::on_profile(const ProfileRequest& r) {
  if (plan_->tensor_parallel())
    fail(ErrorKind::kFailed,
         "plan {} has tensor-parallel stages: profiling measures stages of one rank each (the "
         "schedule search prices a group from them)",
         plan_->plan_id);
  auto report = std::make_shared<ProfileReport>();
  PipelineStage* stage = stage_.get();
  run_on_compute([=] { *report = stage->profile(r); }, "profiling", options_.plan_timeout_s,
                 "the load timeout");
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  report->host = host;
  measure_transfers(r, *report);
  control_.send(0, *report, Deadline::after_seconds(options_.step_timeout_s));
}

// Each size from the previous stage is received, then each size to the next is sent and
// timed until it is delivered, so a link is measured while its receiver waits for it.
void StageWorker::measure_transfers(const ProfileRequest& r, ProfileReport& report) {
  const Deadline deadline = Deadline::after_seconds(options_.step_timeout_s);
  StepBuffers& b = *buffers_;
  const auto floats = [&](int32_t rows) {
    return std::min(buffer_floats_,
                    static_cast<size_t>(std::max(rows, 1)) * static_cast<size_t>(stage_->hidden()));
  };
  const int32_t reps = std::max(r.repeats, 1);
  if (!stage_->first())
    for (int32_t rows : r.transfer_rows)
      for (int32_t i = 0; i < reps; ++i) {
        Transfer t =
            links_->to(prev_).start_recv(prev_, std::span<float>(b.in.f32(), floats(rows)));
        wait_serving(t, deadline);
      }
  if (stage_->last()) return;
  for (int32_t rows : r.transfer_rows) {
    double best = std::numeric_limits<double>::infinity();
    for (int32_t i = 0; i < reps; ++i) {
      const double t0 = now_s();
      Transfer t = links_->to(next()).start_send(
          next(), std::span<const float>(b.out[0].f32(), floats(rows)));
      wait_serving(t, deadline);
      best = std::min(best, now_s() - t0);
    }
    report.transfer_seconds.push_back(best);
  }
}

// One step on the compute thread, pings served meanwhile, bounded by the step timeout.
std::vector<SeqToken> StageWorker::compute_step(const StepCommand& c, std::span<float> in,
                                                std::span<float> out) {
  auto tokens = std::make_shared<std::vector<SeqToken>>();
  PipelineStage* stage = stage_.get();
  const bool in_device = buffers_->in_device, out_device = buffers_->out_device;
  const double delay = options_.debug_step_delay_s;
  run_on_compute(
      [=] {
        if (delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay));
        *tokens = stage->run(c, in, out, in_device, out_device);
      },
      fmt::format("step {}", c.step_id), options_.step_timeout_s, "the step timeout");
  return std::move(*tokens);
}

void StageWorker::on_shutdown() {
  wait_sends(Deadline::after_seconds(options_.step_timeout_s));
  handovers_.clear();  // the run is over: what was not handed over is not needed (cancels)
  send_stats();
}

// The statistics up to now: the window runs to this moment, a step computing counts as busy.
// Without the step spans: a heartbeat stays small.
StageStats StageWorker::stats_so_far() const {
  StageStats s = stats_;
  s.step_spans.clear();
  s.peak_rss_bytes = static_cast<uint64_t>(process_peak_rss_bytes());
  const double now = now_s();
  if (busy_since_ >= 0) s.busy_seconds += now - busy_since_;
  if (window_start_ >= 0) s.window_seconds = now - window_start_;
  s.idle_seconds = std::max(0.0, s.window_seconds - s.busy_seconds);
  return s;
}

void StageWorker::send_stats() {
  stats_.peak_rss_bytes = static_cast<uint64_t>(process_peak_rss_bytes());
  if (window_start_ >= 0) stats_.window_seconds = window_end_ - window_start_;
  stats_.idle_seconds = std::max(0.0, stats_.window_seconds - stats_.busy_seconds);
  try {
    control_.send(0, stats_, Deadline::after_seconds(options_.step_timeout_s));
  } catch (const Error& e) {
    log::get("worker")->warn("rank {}: statistics not sent: {}", world_.rank(), e.what());
  }
}

// Reports the error to rank 0, then stays until Shutdown (answering pings, so the
// coordinator can tell this live rank from a dead one), or until the coordinator is silent.
int StageWorker::linger_after(const std::exception& e) {
  auto log = log::get("worker");
  const auto* error = dynamic_cast<const Error*>(&e);
  const Error as_error = error ? *error : Error(ErrorKind::kFailed, e.what());
  log->error("rank {}: {}", world_.rank(), e.what());
  if (now_s() - last_heard_ > options_.coordinator_timeout_s)
    return kStageLostPeer;  // no one to tell
  try {
    control_.send(0, ErrorReport::from(as_error, world_.rank(), step_id_),
                  Deadline::after_seconds(5));
    for (auto& sends : sends_) sends.clear();  // cancels
    handovers_.clear();
    while (
        !std::holds_alternative<Shutdown>(next_message(std::nullopt, "shutdown after an error"))) {
    }
  } catch (const std::exception& again) {
    log->error("rank {}: after the error: {}", world_.rank(), again.what());
    return kStageLostPeer;
  }
  return as_error.kind() == ErrorKind::kDisconnected ? kStageLostPeer : 1;
}

// The next message from rank 0, queued ones first; pings are answered here, never returned.
ControlMessage StageWorker::next_message(std::optional<Deadline> fixed, const char* awaited) {
  while (true) {
    if (!pending_.empty()) {
      ControlMessage m = std::move(pending_.front());
      pending_.pop_front();
      return m;
    }
    if (!fixed) check_coordinator();
    const Deadline deadline =
        fixed ? *fixed
              : Deadline::after_seconds(options_.coordinator_timeout_s - (now_s() - last_heard_));
    Received r = control_.recv(0, deadline, awaited);
    last_heard_ = now_s();
    if (auto* ping = std::get_if<Heartbeat>(&r.message); ping && !ping->reply) {
      answer_ping(control_, 0, *ping, Deadline::after_seconds(options_.step_timeout_s),
                  stats_so_far());
      continue;
    }
    return std::move(r.message);
  }
}

// While waiting inside a step: answer a ping at once, keep anything else for later, and
// stop at once on Shutdown.
bool StageWorker::serve_control_once(bool stop_on_shutdown) {
  std::optional<Received> r =
      control_.try_recv(0, Deadline::after_seconds(options_.step_timeout_s));
  if (!r) return false;
  last_heard_ = now_s();
  if (auto* ping = std::get_if<Heartbeat>(&r->message); ping && !ping->reply) {
    answer_ping(control_, 0, *ping, Deadline::after_seconds(options_.step_timeout_s),
                stats_so_far());
  } else if (stop_on_shutdown && std::holds_alternative<Shutdown>(r->message)) {
    throw ShutdownRequested{};
  } else {
    pending_.push_back(std::move(r->message));
  }
  return true;
}

// Rank 0 pings every heartbeat interval: a silence past the heartbeat timeout means it is
// gone (killed, its node lost), and this worker ends rather than wait out a step timeout.
void StageWorker::check_coordinator() const {
  const double silent = now_s() - last_heard_;
  if (silent > options_.coordinator_timeout_s)
    fail(ErrorKind::kDisconnected,
         "rank 0 (the coordinator) silent for {:.1f} s (heartbeat timeout {} s): it is gone",
         silent, options_.coordinator_timeout_s);
}

void StageWorker::wait_sends(const Deadline& deadline) {
  for (auto& sends : sends_)
    for (Transfer& t : sends) wait_serving(t, deadline);
}

void StageWorker::wait_serving(Transfer& t, const Deadline& deadline) {
  if (!t.pending()) return;
  Backoff backoff;
  while (!deadline.expired()) {
    if (t.test()) return;
    if (progress_handovers(!compute_.busy()) || serve_control_once()) continue;
    check_coordinator();
    backoff.pause();
  }
  t.wait(deadline);  // one last test, then the timeout error naming the peer
}

}  // namespace

int run_stage_worker(const Communicator& world, Backend& backend,
                     const StageWorkerOptions& options) {
  StageWorker worker(world, backend, options);
  return worker.run();
}

}  // namespace strata
