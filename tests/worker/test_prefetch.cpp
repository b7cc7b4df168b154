// The one two-slot weight prefetcher (prefetch.h) that both streaming levels use, against
// sequences worked out by hand: which slot each layer goes into, when it is started, and
// that with prefetch on each streamed layer moves exactly once per pass, one acquire ahead.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/error.h"
#include "worker/prefetch.h"

namespace strata {
namespace {

// Records what the prefetcher asks of a level, as "start S L" and "finish S L".
class RecordingIo final : public SlotIo {
 public:
  void start(int slot, int32_t layer) override {
    log.push_back(fmt::format("start {} {}", slot, layer));
  }
  void finish(int slot, int32_t layer) override {
    log.push_back(fmt::format("finish {} {}", slot, layer));
  }
  int starts() const {
    int n = 0;
    for (const std::string& e : log) n += e.starts_with("start") ? 1 : 0;
    return n;
  }
  std::vector<std::string> log;
};

using Log = std::vector<std::string>;

TEST(TwoSlotPrefetcher, WithOverlapEachLayerIsStartedOneAcquireAheadAndOncePerPass) {
  TwoSlotPrefetcher p({1, 3, 4}, true);
  RecordingIo io;
  p.prime(io);
  for (int pass = 0; pass < 2; ++pass)
    for (int32_t layer : {1, 3, 4}) p.acquire(layer, io);
  // By hand: slots A=0, B=1. prime: 1 -> A. acquire 1: in A; 3 -> B. acquire 3: in B; 4 -> A.
  // acquire 4: in A; 1 (the next pass) -> B. Second pass: 1 in B, 3 -> A; 3 in A, 4 -> B; 4
  // in B, 1 -> A.
  const Log want = {"start 0 1",  "finish 0 1", "start 1 3",  "finish 1 3", "start 0 4",
                    "finish 0 4", "start 1 1",  "finish 1 1", "start 0 3",  "finish 0 3",
                    "start 1 4",  "finish 1 4", "start 0 1"};
  EXPECT_EQ(io.log, want);
}

TEST(TwoSlotPrefetcher, WithoutOverlapALayerMovesOnlyWhenAskedForAndNotHeld) {
  TwoSlotPrefetcher p({1, 3, 4}, false);
  RecordingIo io;
  p.prime(io);
  for (int pass = 0; pass < 3; ++pass)
    for (int32_t layer : {1, 3, 4}) p.acquire(layer, io);
  // prime reads 1; pass 1 finds 1 and reads 3, 4; passes 2 and 3 read all three (each
  // evicted just before): 1 + 2 + 3 + 3 = 9. Every start but prime's is for the layer asked
  // for, right before it is finished.
  EXPECT_EQ(io.starts(), 9);
  for (size_t i = 1; i + 1 < io.log.size(); ++i) {
    if (!io.log[i].starts_with("start")) continue;
    EXPECT_EQ(io.log[i + 1], "finish" + io.log[i].substr(5)) << i;
  }
}

TEST(TwoSlotPrefetcher, ASingleStreamedLayerIsNeverReloaded) {
  TwoSlotPrefetcher p({2}, true);
  RecordingIo io;
  p.prime(io);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(p.acquire(2, io), 0);
  EXPECT_EQ(io.starts(), 1);
}

TEST(TwoSlotPrefetcher, AnUnexpectedLayerGoesIntoTheSlotNotHandedOutLast) {
  TwoSlotPrefetcher p({0, 1, 2, 3}, true);
  RecordingIo io;
  p.prime(io);                     // 0 -> slot 0
  EXPECT_EQ(p.acquire(0, io), 0);  // 1 -> slot 1
  // Layer 3 was not predicted: it replaces the prefetch in slot 1 (slot 0 was handed out
  // last), and 0 (after 3, wrapping) is already in slot 0.
  EXPECT_EQ(p.acquire(3, io), 1);
  EXPECT_EQ(p.held(0), 0);
  EXPECT_EQ(p.held(1), 3);
  EXPECT_EQ(io.log.back(), "finish 1 3");
}

TEST(TwoSlotPrefetcher, RefusesALayerItDoesNotStream) {
  TwoSlotPrefetcher p({1, 3}, true);
  RecordingIo io;
  EXPECT_THROW(p.acquire(2, io), Error);
  EXPECT_THROW(TwoSlotPrefetcher({3, 1}, true), Error);
}

}  // namespace
}  // namespace strata
