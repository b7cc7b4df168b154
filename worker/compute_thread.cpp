#include "worker/compute_thread.h"

#include <condition_variable>
#include <exception>
#include <mutex>

#include "kernels/error.h"

namespace strata {

struct ComputeThread::State {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> job;
  bool busy = false;
  bool stop = false;
  std::exception_ptr error;
};

void ComputeThread::serve_jobs(const std::shared_ptr<State>& s) {
  std::unique_lock lock(s->mu);
  while (true) {
    s->cv.wait(lock, [&] { return s->stop || s->job; });
    if (!s->job) return;
    std::function<void()> job = std::move(s->job);
    s->job = nullptr;
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    s->error = error;
    s->busy = false;
    s->cv.notify_all();
  }
}

ComputeThread::ComputeThread() : state_(std::make_shared<State>()) {
  thread_ = std::thread([s = state_] { serve_jobs(s); });
}

ComputeThread::~ComputeThread() {
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ComputeThread::start(std::function<void()> job) {
  std::lock_guard lock(state_->mu);
  STRATA_CHECK(!state_->busy, "a compute job started while another runs");
  state_->job = std::move(job);
  state_->busy = true;
  state_->error = nullptr;
  state_->cv.notify_all();
}

bool ComputeThread::poll() {
  std::exception_ptr error;
  {
    std::lock_guard lock(state_->mu);
    if (state_->busy) return false;
    std::swap(error, state_->error);
  }
  if (error) std::rethrow_exception(error);
  return true;
}

bool ComputeThread::wait_for(std::chrono::duration<double> timeout) {
  std::unique_lock lock(state_->mu);
  return state_->cv.wait_for(lock, timeout, [&] { return !state_->busy; });
}

bool ComputeThread::busy() const {
  std::lock_guard lock(state_->mu);
  return state_->busy;
}

void ComputeThread::abandon() {
  if (thread_.joinable()) thread_.detach();
  std::lock_guard lock(state_->mu);
  state_->stop = true;  // the thread ends after its job
  state_->cv.notify_all();
}

}  // namespace strata
