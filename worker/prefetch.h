// FlexGen's weight prefetch (Algorithm 1, "load weight of the next layer") over two slots,
// written once for both levels that stream layers: disk -> host staging (LayerStreamer, an
// I/O thread) and host or disk -> device slots (LayerFeeder, the backend's transfer queue).
// It decides which slot a layer goes into and which layer to fetch next; the level's SlotIo
// moves the bytes.
#pragma once

#include <cstdint>
#include <vector>

namespace strata {

// How one level moves a layer into a slot.
class SlotIo {
 public:
  virtual ~SlotIo() = default;
  // Begins moving `layer` into `slot`. The slot's previous contents are no longer read by
  // compute that has yet to be issued; a level whose loads can be in flight waits for any
  // earlier load into this slot itself.
  virtual void start(int slot, int32_t layer) = 0;
  // Returns once compute may read `slot` (the host waits, or compute is ordered after it).
  virtual void finish(int slot, int32_t layer) = 0;
};

class TwoSlotPrefetcher {
 public:
  // `streamed`: the layers this level serves, ascending; after the last comes the first
  // again (the next token's pass). `overlap` false loads a layer only when it is asked
  // for (the ablation).
  TwoSlotPrefetcher(std::vector<int32_t> streamed, bool overlap);

  // Starts loading the first streamed layer, before the first acquire asks for it.
  void prime(SlotIo& io);
  // The slot holding `layer`, ready for compute; starts loading the streamed layer after
  // it into the other slot, unless that slot holds it already.
  int acquire(int32_t layer, SlotIo& io);

  bool streams(int32_t layer) const;
  int32_t held(int slot) const { return held_[slot]; }
  const std::vector<int32_t>& streamed() const { return streamed_; }

 private:
  int32_t next_after(int32_t layer) const;
  void load(int slot, int32_t layer, SlotIo& io);

  std::vector<int32_t> streamed_;
  bool overlap_;
  int32_t held_[2] = {-1, -1};  // what each slot holds or is loading
  int current_ = 1;             // the slot handed out last (a miss loads into the other)
};

}  // namespace strata
