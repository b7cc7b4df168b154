#include "worker/prefetch.h"

#include <algorithm>

#include "kernels/error.h"

namespace strata {

TwoSlotPrefetcher::TwoSlotPrefetcher(std::vector<int32_t> streamed, bool overlap)
    : streamed_(std::move(streamed)), overlap_(overlap) {
  STRATA_CHECK(std::is_sorted(streamed_.begin(), streamed_.end()), "streamed layers not ascending");
}

bool TwoSlotPrefetcher::streams(int32_t layer) const {
  return std::binary_search(streamed_.begin(), streamed_.end(), layer);
}

int32_t TwoSlotPrefetcher::next_after(int32_t layer) const {
  const auto it = std::upper_bound(streamed_.begin(), streamed_.end(), layer);
  return it == streamed_.end() ? streamed_.front() : *it;
}

void TwoSlotPrefetcher::load(int slot, int32_t layer, SlotIo& io) {
  held_[slot] = layer;
  io.start(slot, layer);
}

void TwoSlotPrefetcher::prime(SlotIo& io) {
  if (!streamed_.empty()) load(1 - current_, streamed_.front(), io);
}

int TwoSlotPrefetcher::acquire(int32_t layer, SlotIo& io) {
  STRATA_CHECK(streams(layer), "layer {} is not streamed at this level", layer);
  int slot = held_[0] == layer ? 0 : held_[1] == layer ? 1 : -1;
  if (slot < 0) {  // not prefetched (first use, overlap off, or a different order)
    slot = 1 - current_;
    load(slot, layer, io);
  }
  io.finish(slot, layer);
  current_ = slot;
  // The other slot held the layer before, whose compute is already issued: refill it.
  const int other = 1 - slot;
  const int32_t next = next_after(layer);
  if (overlap_ && next != layer && held_[other] != next) load(other, next, io);
  return slot;
}

}  // namespace strata
