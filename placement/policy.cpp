#include "placement/policy.h"

#include <fmt/format.h>

#include <array>
#include <charconv>
#include <vector>

#include "kernels/error.h"

namespace strata {

namespace {

constexpr std::string_view kAllowedKeys =
    "gbs, ngb, w, c, h, cw, cc, cf16, cpu_attn, overlap, pie, hetegen";

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  for (size_t start = 0;;) {
    const size_t end = s.find(sep, start);
    parts.push_back(trim(s.substr(start, end == std::string_view::npos ? end : end - start)));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

// A whole-token decimal integer; key and value name the item in the error message.
int64_t parse_int(std::string_view token, std::string_view key, std::string_view value) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), v);
  if (token.empty() || ec != std::errc() || end != token.data() + token.size())
    fail_input("policy: {}={}: '{}' is not an integer", key, value, token);
  return v;
}

int64_t parse_batch(std::string_view key, std::string_view value) {
  const int64_t v = parse_int(value, key, value);
  if (v <= 0 || v > Policy::kMaxBatch)
    fail_input("policy: {}={}: must be a positive integer no larger than {}", key, value,
               Policy::kMaxBatch);
  return v;
}

bool parse_flag(std::string_view key, std::string_view value) {
  if (value == "0") return false;
  if (value == "1") return true;
  fail_input("policy: {}={}: must be 0 or 1", key, value);
}

// "GPU/CPU/DISK" percentages into gpu and cpu, the disk share being the rest.
void parse_split(std::string_view key, std::string_view value, int& gpu, int& cpu) {
  const auto parts = split(value, '/');
  if (parts.size() != 3)
    fail_input("policy: {}={}: expected three percentages GPU/CPU/DISK, e.g. {}=20/80/0", key,
               value, key);
  std::array<int64_t, 3> p{};
  for (size_t i = 0; i < 3; ++i) {
    p[i] = parse_int(parts[i], key, value);
    if (p[i] < 0 || p[i] > 100)
      fail_input("policy: {}={}: percentage {} is outside [0, 100]", key, value, p[i]);
  }
  if (p[0] + p[1] + p[2] != 100)
    fail_input("policy: {}={}: percentages sum to {}, they must sum to 100 (GPU/CPU/DISK)", key,
               value, p[0] + p[1] + p[2]);
  gpu = static_cast<int>(p[0]);
  cpu = static_cast<int>(p[1]);
}

void apply(Policy& p, std::string_view key, std::string_view value) {
  if (key == "gbs") {
    p.gpu_batch_size = parse_batch(key, value);
  } else if (key == "ngb") {
    p.num_gpu_batches = parse_batch(key, value);
  } else if (key == "w") {
    parse_split(key, value, p.w_gpu_percent, p.w_cpu_percent);
  } else if (key == "c") {
    parse_split(key, value, p.cache_gpu_percent, p.cache_cpu_percent);
  } else if (key == "h") {
    parse_split(key, value, p.act_gpu_percent, p.act_cpu_percent);
  } else if (key == "cw") {
    p.compress_weight = parse_flag(key, value);
  } else if (key == "cc") {
    p.compress_cache = parse_flag(key, value);
  } else if (key == "cf16") {
    p.cache_f16 = parse_flag(key, value);
  } else if (key == "cpu_attn") {
    p.cpu_cache_compute = parse_flag(key, value);
  } else if (key == "overlap") {
    p.overlap = parse_flag(key, value);
  } else if (key == "pie") {
    const int64_t m = parse_int(value, key, value);
    if (m < 0 || m > Policy::kMaxBatch)
      fail_input("policy: pie={}: host layers must be a whole number >= 0", value);
    p.pie_host_layers = static_cast<int>(m);
  } else if (key == "hetegen") {
    const int64_t a = parse_int(value, key, value);
    if (a < 0 || a > 100)
      fail_input("policy: hetegen={}: alpha is a percentage in [0, 100] (0: off)", value);
    p.hetegen_alpha_percent = static_cast<int>(a);
  } else {
    fail_input("policy: unknown key '{}' (in '{}={}'); allowed keys: {}", key, key, value,
               kAllowedKeys);
  }
}

void check_split(std::string_view name, int gpu, int cpu) {
  if (gpu < 0 || gpu > 100 || cpu < 0 || cpu > 100 || gpu + cpu > 100)
    fail_input(
        "policy: {}=({},{},{}): GPU and CPU percentages must lie in [0, 100] with a sum of at "
        "most 100 (the disk takes the rest)",
        name, gpu, cpu, 100 - gpu - cpu);
}

}  // namespace

void Policy::validate() const {
  if (gbs() <= 0 || gbs() > kMaxBatch)
    fail_input("policy: gpu_batch_size={} must be in [1, {}]", gbs(), kMaxBatch);
  if (ngb() <= 0 || ngb() > kMaxBatch)
    fail_input("policy: num_gpu_batches={} must be in [1, {}]", ngb(), kMaxBatch);
  check_split("w", w_gpu_percent, w_cpu_percent);
  check_split("c", cache_gpu_percent, cache_cpu_percent);
  check_split("h", act_gpu_percent, act_cpu_percent);
  // FlexGen §5: dequantising on the CPU costs more than CPU attention saves, so FlexGen
  // turns CPU delegation off when the cache is compressed; asking for both is a mistake.
  if (compress_cache && cpu_cache_compute)
    fail_input(
        "policy: compress_cache=1 with cpu_attention=1: a compressed KV cache is attended on "
        "the GPU (FlexGen §5); set cc=0 or cpu_attn=0");
  if (compress_cache && cache_f16)
    fail_input(
        "policy: compress_cache=1 with cache_f16=1: the KV cache is stored either 4-bit "
        "or f16; set cc=0 or cf16=0");
  if (pie_host_layers < 0)
    fail_input("policy: pie={}: host layers must be a whole number >= 0", pie_host_layers);
  if (pie_host_layers > 0 && cache_gpu_percent != 100)
    fail_input(
        "policy: pie={} with c={}/{}/{}: Pie swaps a cache that lives on the GPU tier; set "
        "c=100/0/0",
        pie_host_layers, cache_gpu_percent, cache_cpu_percent, cache_disk_percent());
  if (hetegen_alpha_percent < 0 || hetegen_alpha_percent > 100)
    fail_input("policy: hetegen={}: alpha is a percentage in [0, 100] (0: off)",
               hetegen_alpha_percent);
}

std::string Policy::str() const {
  return fmt::format(
      "Policy(gpu_batch_size={}, num_gpu_batches={}, w=({},{},{}), c=({},{},{}), h=({},{},{}), "
      "compress_weight={:d}, compress_cache={:d}, cpu_attention={:d}, overlap={:d}{})",
      gbs(), ngb(), w_gpu_percent, w_cpu_percent, w_disk_percent(), cache_gpu_percent,
      cache_cpu_percent, cache_disk_percent(), act_gpu_percent, act_cpu_percent, act_disk_percent(),
      compress_weight, compress_cache, cpu_cache_compute, overlap, extras(", ", "_"));
}

std::string Policy::extras(std::string_view sep, std::string_view style) const {
  std::string out;
  if (cache_f16) out += fmt::format("{}{}=1", sep, style == "_" ? "cache_f16" : "cf16");
  if (pie_host_layers > 0)
    out += fmt::format("{}pie{}={}", sep, style == "_" ? "_host_layers" : "", pie_host_layers);
  if (hetegen_alpha_percent > 0)
    out += fmt::format("{}hetegen{}={}", sep, style == "_" ? "_alpha_percent" : "",
                       hetegen_alpha_percent);
  return out;
}

std::string Policy::compact() const {
  std::string block;
  if (gpu_batch_size) block += fmt::format("gbs={},", *gpu_batch_size);
  if (num_gpu_batches) block += fmt::format("ngb={},", *num_gpu_batches);
  return fmt::format(
      "{}w={}/{}/{},c={}/{}/{},h={}/{}/{},cw={:d},cc={:d},"
      "cpu_attn={:d},overlap={:d}{}",
      block, w_gpu_percent, w_cpu_percent, w_disk_percent(), cache_gpu_percent, cache_cpu_percent,
      cache_disk_percent(), act_gpu_percent, act_cpu_percent, act_disk_percent(), compress_weight,
      compress_cache, cpu_cache_compute, overlap, extras(",", ""));
}

Policy Policy::parse(std::string_view text) {
  if (trim(text).empty())
    fail_input("policy: empty; expected key=value pairs such as {}", Policy{}.compact());
  Policy p;
  std::vector<std::string_view> seen;
  for (std::string_view item : split(text, ',')) {
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      fail_input("policy: '{}' is not key=value; allowed keys: {}", item, kAllowedKeys);
    const std::string_view key = trim(item.substr(0, eq));
    const std::string_view value = trim(item.substr(eq + 1));
    for (std::string_view k : seen)
      if (k == key) fail_input("policy: key '{}' is given twice (again as '{}')", key, item);
    apply(p, key, value);
    seen.push_back(key);
  }
  p.validate();
  return p;
}

bool activations_on_compute_tier(const Policy& p, bool device_compute) {
  return device_compute ? p.act_gpu_percent == 100 : p.act_disk_percent() == 0;
}

void check_engine_activations(const Policy& p, bool device_compute) {
  if (!activations_on_compute_tier(p, device_compute))
    fail_input(
        "--policy '{}': activations live on the compute tier ({}); h= other than that is not "
        "implemented",
        p.compact(), device_compute ? "h=100/0/0" : "h=0/100/0 on a CPU-only node");
}

Policy with_engine_activations(Policy p, bool device_compute) {
  if (device_compute) {
    p.act_gpu_percent = 100;
    p.act_cpu_percent = 0;
  }
  return p;
}

}  // namespace strata
