#include "placement/tier.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "kernels/error.h"

namespace strata {

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kCpu:
      return "cpu";
    case Tier::kDisk:
      return "disk";
  }
  return "?";
}

std::string TierBytes::str() const {
  constexpr double kMiB = 1 << 20;
  return fmt::format("gpu {:.1f} MiB, cpu {:.1f} MiB, disk {:.1f} MiB",
                     static_cast<double>(gpu) / kMiB, static_cast<double>(cpu) / kMiB,
                     static_cast<double>(disk) / kMiB);
}

std::vector<int32_t> spread_disk_layers(int32_t n_layers, int32_t n_disk) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < n_layers; ++i) {
    // Layer i goes to disk when the running share crosses an integer: evenly spread, so
    // every disk read has resident layers' compute to hide behind.
    if ((static_cast<int64_t>(i) + 1) * n_disk / n_layers >
        static_cast<int64_t>(i) * n_disk / n_layers)
      out.push_back(i);
  }
  return out;
}

std::vector<Tier> spread_tiers(int32_t n, int32_t n_gpu, int32_t n_cpu) {
  STRATA_CHECK(n_gpu >= 0 && n_cpu >= 0 && n_gpu + n_cpu <= n, "tiers {}+{} of {} layers", n_gpu,
               n_cpu, n);
  std::vector<Tier> tiers(static_cast<size_t>(n), Tier::kGpu);
  const std::vector<int32_t> disk = spread_disk_layers(n, n - n_gpu - n_cpu);
  std::vector<int32_t> left;
  for (int32_t i = 0; i < n; ++i) {
    if (std::binary_search(disk.begin(), disk.end(), i)) {
      tiers[static_cast<size_t>(i)] = Tier::kDisk;
    } else {
      left.push_back(i);
    }
  }
  for (int32_t pick : spread_disk_layers(static_cast<int32_t>(left.size()), n_cpu))
    tiers[static_cast<size_t>(left[static_cast<size_t>(pick)])] = Tier::kCpu;
  return tiers;
}

std::vector<Tier> tiers_from_shares(int32_t n, int gpu_percent, int cpu_percent, const char* what) {
  if (gpu_percent < 0 || cpu_percent < 0 || gpu_percent + cpu_percent > 100)
    fail_input("{} shares gpu={}% cpu={}% must be >= 0 and sum to at most 100", what, gpu_percent,
               cpu_percent);
  const auto n_gpu = static_cast<int32_t>(std::lround(n * gpu_percent / 100.0));
  const auto n_cpu =
      std::min(n - n_gpu,
               static_cast<int32_t>(std::lround(n * (gpu_percent + cpu_percent) / 100.0)) - n_gpu);
  return spread_tiers(n, n_gpu, n_cpu);
}

int32_t count_tier(const std::vector<Tier>& tiers, Tier t) {
  return static_cast<int32_t>(std::count(tiers.begin(), tiers.end(), t));
}

std::vector<uint8_t> tiers_to_wire(const std::vector<Tier>& tiers) {
  std::vector<uint8_t> out;
  for (Tier t : tiers) out.push_back(static_cast<uint8_t>(t));
  return out;
}

std::vector<Tier> tiers_from_wire(const std::vector<uint8_t>& wire, std::string_view what) {
  std::vector<Tier> out;
  for (uint8_t t : wire) {
    if (t > static_cast<uint8_t>(Tier::kDisk))
      fail(ErrorKind::kFailed, "{}: tier {} is not 0-2", what, t);
    out.push_back(static_cast<Tier>(t));
  }
  return out;
}

int64_t parse_size(const std::string& text, const char* option) {
  // from_chars: no "inf", "nan", hex or leading spaces, unlike stod.
  double v = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v,
                                         std::chars_format::fixed | std::chars_format::scientific);
  const std::string unit(end, text.data() + text.size());
  double scale = 0;
  if (unit == "T" || unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  if (unit.empty() || unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
  if (unit == "K" || unit == "KiB") scale = 1024.0;
  if (unit == "B") scale = 1.0;
  if (ec != std::errc() || end == text.data() || scale == 0 || !std::isfinite(v) || v < 0)
    fail_input(
        "{}: cannot read size '{}': a non-negative number with a unit (2TiB, 1.5GiB, 800MiB, "
        "64KiB, 4096B; a bare number is GiB)",
        option, text);
  if (v * scale > static_cast<double>(kMaxSize))
    fail_input("{}: size '{}' is above the largest accepted, 1 EiB ({} bytes)", option, text,
               kMaxSize);
  return static_cast<int64_t>(v * scale);
}

}  // namespace strata
