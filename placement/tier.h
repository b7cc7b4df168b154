// FlexGen's three memory tiers (§4.2) and how a share of a stage's layers is spread over
// them at layer granularity. Decided here (placement/), executed by worker/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

enum class Tier : uint8_t { kGpu = 0, kCpu = 1, kDisk = 2 };
const char* tier_name(Tier t);
inline constexpr Tier kTiers[] = {Tier::kGpu, Tier::kCpu, Tier::kDisk};

// Bytes per tier: what a placement plans, or what a worker reports it allocated.
struct TierBytes {
  int64_t gpu = 0;
  int64_t cpu = 0;
  int64_t disk = 0;

  int64_t& operator[](Tier t) { return t == Tier::kGpu ? gpu : t == Tier::kCpu ? cpu : disk; }
  int64_t operator[](Tier t) const { return t == Tier::kGpu ? gpu : t == Tier::kCpu ? cpu : disk; }
  TierBytes& operator+=(const TierBytes& o) {
    gpu += o.gpu;
    cpu += o.cpu;
    disk += o.disk;
    return *this;
  }
  std::string str() const;  // "gpu 1.0 MiB, cpu 2.5 MiB, disk 0.0 MiB"
  bool operator==(const TierBytes&) const = default;
};

// The disk page every O_DIRECT transfer is aligned to (worker/direct_file.h asserts that
// its kDirectAlignment is this).
inline constexpr int64_t kPageBytes = 4096;
inline int64_t align_bytes(int64_t n, int64_t a = kPageBytes) {
  return (n + a - 1) / a * a;
}

// `n_disk` of `n_layers` layers, spread evenly (ascending).
std::vector<int32_t> spread_disk_layers(int32_t n_layers, int32_t n_disk);
// Per-layer tiers with `n_gpu` layers on the device, `n_cpu` in host memory and the rest on
// disk, each share spread evenly over the layers so every streamed layer has resident
// layers' compute to hide behind.
std::vector<Tier> spread_tiers(int32_t n_layers, int32_t n_gpu, int32_t n_cpu);
// The same from percentages (rounded to whole layers). InputError names `what` and the
// shares when they are out of range.
std::vector<Tier> tiers_from_shares(int32_t n_layers, int gpu_percent, int cpu_percent,
                                    const char* what);
int32_t count_tier(const std::vector<Tier>& tiers, Tier t);

// Per-layer tiers as a stage plan carries them (transport/messages.h StagePlan: one byte a
// layer, the Tier's value), and back. A byte that is no tier is Error(kFailed) naming `what`
// (a plan's sender and receiver disagree).
std::vector<uint8_t> tiers_to_wire(const std::vector<Tier>& tiers);
std::vector<Tier> tiers_from_wire(const std::vector<uint8_t>& wire, std::string_view what);

// "2TiB", "1.5GiB", "800MiB", "64KiB", "4096B" -> bytes; a bare number is GiB. Refuses (InputError
// naming the option) anything but a finite, non-negative decimal number of at most kMaxSize.
int64_t parse_size(const std::string& text, const char* option);
inline constexpr int64_t kMaxSize = int64_t{1} << 60;  // 1 EiB: past any machine's memory or disk

}  // namespace strata
