// FlexGen's offloading policy (§4.2): the zig-zag block schedule (GPU batch size x number
// of GPU batches) and where weights, KV cache and activations live, as percentages over
// GPU, CPU and disk (wg/wc/wd, cg/cc/cd, hg/hc/hd; each disk share is 100 - GPU - CPU),
// plus the switches FlexGen exposes: 4-bit compression of weights / cache (§5), attention
// on the CPU when the cache is there ("computation delegation", §4.2) and overlap of I/O
// with compute (Algorithm 1). A plain struct that prints itself; nothing here runs it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace strata {

struct Policy {
  // The block schedule: gbs and the number of GPU batches in a block. Unset (a policy that
  // names neither): the engine runs each step as one GPU batch of --max-batch sequences;
  // the cost model and block_size() read an unset field as 1.
  std::optional<int64_t> gpu_batch_size;   // gbs
  std::optional<int64_t> num_gpu_batches;  // GPU batches in a block
  int w_gpu_percent = 100;                 // wg
  int w_cpu_percent = 0;                   // wc
  int cache_gpu_percent = 100;             // cg
  int cache_cpu_percent = 0;               // cc
  int act_gpu_percent = 100;               // hg
  int act_cpu_percent = 0;                 // hc
  bool compress_weight = false;
  bool compress_cache = false;
  // The cache's elements in f16 rather than f32 (FlexGen's and llama.cpp's cache): half the
  // bytes to hold and for decode attention to read, in any tier, attended wherever an f32
  // cache would be. Not with cc.
  bool cache_f16 = false;
  bool cpu_cache_compute = false;  // attention on the CPU for the cache kept off the GPU
  bool overlap = true;
  // Pie (papers/pie.md §3): m of the model's layers keep their (GPU-tier) KV cache in host
  // memory and swap through the GPU's buffers, so the GPU holds (n - m) / n of the cache.
  // 0: off. Needs the cache wholly on the GPU tier (c=100/0/0).
  int pie_host_layers = 0;
  // HeteGen (papers/hetegen.md §4): the CPU-tier weights are split, alpha = this / 100 of
  // each linear crossing the link for the GPU, the rest computed by the CPU where it lies.
  // 0: off (FlexGen streams the CPU-tier weights whole).
  int hetegen_alpha_percent = 0;

  // Guards the block-size product and the cost model's arithmetic against absurd input.
  static constexpr int64_t kMaxBatch = int64_t{1} << 20;

  int w_disk_percent() const { return 100 - w_gpu_percent - w_cpu_percent; }
  int cache_disk_percent() const { return 100 - cache_gpu_percent - cache_cpu_percent; }
  int act_disk_percent() const { return 100 - act_gpu_percent - act_cpu_percent; }
  // FlexGen's block size bls (the "effective batch size").
  int64_t block_size() const { return gbs() * ngb(); }
  int64_t gbs() const { return gpu_batch_size.value_or(1); }
  int64_t ngb() const { return num_gpu_batches.value_or(1); }
  // Whether the policy names the block schedule (gbs or ngb given).
  bool names_block() const { return gpu_batch_size.has_value() || num_gpu_batches.has_value(); }

  // Throws InputError naming the field, its value and what is allowed.
  void validate() const;

  // FlexGen's tuple style: "Policy(gpu_batch_size=48, num_gpu_batches=3, w=(20,80,0), ...)".
  std::string str() const;
  // The command-line form that parse() reads back: "gbs=48,ngb=3,w=20/80/0,..." (gbs and
  // ngb only when set, cf16, pie and hetegen only when on, so parse(compact()) == *this).
  std::string compact() const;

  // Comma-separated key=value: gbs, ngb (positive integers), w, c, h ("GPU/CPU/DISK"
  // integer percentages summing to 100), cw, cc, cf16, cpu_attn, overlap (0 or 1), pie (host
  // layers, >= 0), hetegen (alpha in percent, 0-100). Keys left out
  // keep the defaults above; a key given twice, an unknown key or a bad value is an
  // InputError that names the key, the value and what is allowed.
  static Policy parse(std::string_view text);

  bool operator==(const Policy&) const = default;

 private:
  // The f16 cache's, Pie's and HeteGen's fields where on, each led by `sep`; style "_":
  // str()'s long names.
  std::string extras(std::string_view sep, std::string_view style) const;
};

// The engine keeps activations as per-step scratch on its compute tier; FlexGen's h= has no
// other place in it. That is h=100/0/0 with a device, and on a CPU-only node any h without a
// disk share (both of the other tiers are the host's memory there). The one rule the engine,
// the planner and the policy search follow.
bool activations_on_compute_tier(const Policy& p, bool device_compute);
// InputError naming the policy and the h= it must have unless activations_on_compute_tier.
void check_engine_activations(const Policy& p, bool device_compute);
// `p` with its activations where the engine keeps them: h=100/0/0 with a device (what a
// searched or planned policy runs with); on a CPU-only node `p` as it is.
Policy with_engine_activations(Policy p, bool device_compute);

}  // namespace strata
