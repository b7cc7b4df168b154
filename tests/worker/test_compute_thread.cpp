// The stage's compute thread: jobs run off the calling thread one at a time, the caller
// polls while it does other work, a job's exception comes back to the caller, and a job
// that will not end can be abandoned without blocking the owner.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "kernels/error.h"
#include "worker/compute_thread.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

TEST(ComputeThread, RunsJobsOffTheCallingThreadWhileTheCallerPolls) {
  ComputeThread compute;
  std::atomic<bool> release{false};
  std::thread::id ran_on;
  compute.start([&] {
    ran_on = std::this_thread::get_id();
    while (!release) std::this_thread::sleep_for(1ms);
  });
  EXPECT_TRUE(compute.busy());
  int polls = 0;
  for (; polls < 5; ++polls) EXPECT_FALSE(compute.poll());  // the caller is free meanwhile
  release = true;
  EXPECT_TRUE(compute.wait_for(10s));
  EXPECT_TRUE(compute.poll());
  EXPECT_NE(ran_on, std::this_thread::get_id());
  int value = 0;
  compute.start([&] { value = 42; });  // the next job after the first ended
  ASSERT_TRUE(compute.wait_for(10s));
  EXPECT_TRUE(compute.poll());
  EXPECT_EQ(value, 42);
}

TEST(ComputeThread, AJobsExceptionReachesThePollerOnce) {
  ComputeThread compute;
  compute.start([] { throw std::runtime_error("step 7: out of slots"); });
  ASSERT_TRUE(compute.wait_for(10s));
  try {
    compute.poll();
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "step 7: out of slots");
  }
  EXPECT_TRUE(compute.poll());  // reported once
}

TEST(ComputeThread, StartingWhileBusyIsRefused) {
  ComputeThread compute;
  std::atomic<bool> release{false};
  compute.start([&] {
    while (!release) std::this_thread::sleep_for(1ms);
  });
  EXPECT_THROW(compute.start([] {}), Error);
  release = true;
  EXPECT_TRUE(compute.wait_for(10s));
}

TEST(ComputeThread, WaitForTimesOutAndAbandonDoesNotBlock) {
  auto release = std::make_shared<std::atomic<bool>>(false);
  const auto t0 = std::chrono::steady_clock::now();
  {
    ComputeThread compute;
    compute.start([release] {
      while (!*release) std::this_thread::sleep_for(1ms);
    });
    EXPECT_FALSE(compute.wait_for(50ms));
    compute.abandon();
  }  // the destructor must not wait for the abandoned job
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  *release = true;  // let the detached thread finish before the process ends
  std::this_thread::sleep_for(20ms);
}

}  // namespace
}  // namespace strata
