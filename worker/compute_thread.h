// One thread for a pipeline stage's compute, so the thread that owns MPI stays free to
// answer the coordinator's heartbeats while a long step runs (a stage that streams a large
// model from disk may compute for minutes; silence then would look like a dead rank).
// Jobs run one at a time; the owner polls for the end and keeps serving messages meanwhile.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

namespace strata {

class ComputeThread {
 public:
  ComputeThread();
  // Waits for a running job: call abandon() first where that could take unbounded time.
  ~ComputeThread();
  ComputeThread(const ComputeThread&) = delete;
  ComputeThread& operator=(const ComputeThread&) = delete;

  // Starts `job` on the thread; one job at a time (a second while busy is a bug).
  void start(std::function<void()> job);
  // True once no job is running; rethrows the exception of the job that just ended.
  bool poll();
  // Waits up to `timeout` for the running job; true when none runs any more.
  bool wait_for(std::chrono::duration<double> timeout);
  bool busy() const;
  // Gives up on a job that will not end: the thread is detached and keeps its own state,
  // so this object can go. Whatever the job touches must outlive it (leak it): the caller
  // is about to end the process.
  void abandon();

 private:
  struct State;
  static void serve_jobs(const std::shared_ptr<State>& state);
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace strata
