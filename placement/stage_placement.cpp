#include "placement/stage_placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/backend.h"
#include "kernels/error.h"
#include "placement/hetegen.h"
#include "placement/layer_linears.h"

namespace strata {
namespace {

// The rows a KV slot holds: the context, or a sliding window's (worker/kv_cache.cpp makes
// the same choice from the same numbers).
int64_t slot_rows(const ModelShape& s, const StageRequest& r) {
  const KvWindow w = kv_window(s, r);
  return w.active() ? w.rows : r.kv_capacity;
}

// KV positions the cache holds: every slot's rows, or S3's packed budget when smaller.
int64_t committed_positions(const ModelShape& s, const StageRequest& r) {
  const int64_t whole = int64_t{r.kv_slots} * slot_rows(s, r);
  return r.kv_positions > 0 ? std::min(r.kv_positions, whole) : whole;
}

constexpr int64_t kF32 = 4;
constexpr int64_t kI32 = 4;

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 20);
}

int64_t matrix_bytes(const ModelShape& s, int64_t rows, int64_t cols, bool compress) {
  return stored_matrix_bytes(s.dtype, rows, cols, compress);
}

// The largest linear calls a stage makes (worker/transformer.cpp kernel_bounds, from the
// tensors themselves): every layer matrix, and project_in / project_out / lm_head where the
// stage has them.
KernelBounds stage_kernel_bounds(const ModelShape& s, const StageRequest& r, const Policy& policy) {
  const int64_t e = s.embed_width();
  KernelBounds b;
  b.max_rows = r.max_rows;
  b.max_positions = slot_rows(s, r);
  // Stored as the loader leaves it (worker/loader.h).
  auto add = [&](int64_t rows, int64_t cols, bool layer) {
    b.add_weight(rows, cols, stored_dtype(s.dtype, cols, policy.compress_weight), layer);
  };
  for (const LayerLinear& l : layer_linears(s))
    if (l.present) add(l.out, l.in, true);
  if (s.moe()) {  // the router as stored (never compressed), an expert's three matrices
    b.add_weight(s.n_experts, s.hidden, s.dtype, true);
    add(s.expert_intermediate, s.hidden, true);
    add(s.hidden, s.expert_intermediate, true);
  }
  if (r.embedding && e != s.hidden) add(s.hidden, e, false);
  if (r.head && e != s.hidden) add(e, s.hidden, false);
  if (r.head) add(s.vocab, e, false);
  return b;
}

// One layer's norms (and LayerNorm biases), bytes each: the two blocks', Qwen3's q/k norms,
// Gemma-2's post-block norms.
std::vector<int64_t> layer_norm_bytes(const ModelShape& s) {
  std::vector<int64_t> n((s.norm_bias ? 4 : 2) + (s.post_norms ? 2 : 0), s.hidden * kF32);
  if (s.qk_norm) n.insert(n.end(), 2, s.head_dim * kF32);
  if (s.qk_norm_whole) n.insert(n.end(), {s.q_width() * kF32, s.kv_width() * kF32});
  return n;
}

// A MoE layer's router (never compressed: its top-k decides which experts run), the shared
// expert's gate (f32), and every expert's gate, up and down (worker/weights.h, the order
// LayerLayout packs them in).
std::vector<int64_t> expert_tensors(const ModelShape& s, bool compress) {
  const int64_t h = s.hidden, f = s.expert_intermediate;
  return {matrix_bytes(s, f, h, compress), matrix_bytes(s, f, h, compress),
          matrix_bytes(s, h, f, compress)};
}

// The tensors of a MoE layer that holds `resident` of its experts.
std::vector<int64_t> moe_layer_tensors(const ModelShape& s, bool compress, int64_t resident) {
  std::vector<int64_t> t;
  if (!s.moe()) return t;
  t.push_back(matrix_bytes(s, s.n_experts, s.hidden, false));
  if (s.shared_expert_gate) t.push_back(s.hidden * kF32);
  for (int64_t e = 0; e < resident; ++e)
    for (const int64_t b : expert_tensors(s, compress)) t.push_back(b);
  return t;
}

// Tensors packed one after another, each 64-byte aligned, the blob page-aligned
// (worker/layer_store.cpp LayerLayout).
int64_t packed_bytes(const std::vector<int64_t>& tensors) {
  int64_t packed = 0;
  for (const int64_t b : tensors) packed = align_bytes(packed + b, 64);
  return align_bytes(packed);
}

// One layer's tensors in LayerLayout's order (worker/layer_store.cpp kMembers), bytes each.
std::vector<int64_t> layer_tensors(const ModelShape& s, bool compress, int64_t resident) {
  const LayerLinears linears = layer_linears(s);
  std::vector<int64_t> t;
  for (LinearBlock block : {LinearBlock::kAttention, LinearBlock::kMlp}) {
    t.push_back(s.hidden * kF32);  // the block's norm (attn_norm, mlp_norm)
    if (s.norm_bias) t.push_back(s.hidden * kF32);
    for (const LayerLinear& l : linears)
      if (l.present && linear_block(l.slot) == block)
        t.push_back(stored_weight_bytes(s, l, compress));
    for (const LayerLinear& l : linears)
      if (l.present && l.bias && linear_block(l.slot) == block) t.push_back(l.out * kF32);
    if (block == LinearBlock::kAttention && s.qk_norm) t.insert(t.end(), 2, s.head_dim * kF32);
    if (block == LinearBlock::kAttention && s.qk_norm_whole)
      t.insert(t.end(), {s.q_width() * kF32, s.kv_width() * kF32});
    if (s.post_norms) t.push_back(s.hidden * kF32);  // post_attn_norm, post_mlp_norm
  }
  for (const int64_t bytes : moe_layer_tensors(s, compress, resident)) t.push_back(bytes);
  return t;
}

// HeteGen's split of one layer as the worker holds it (worker/split_linear.h,
// worker/layer_feeder.cpp): each split linear cut after ceil(alpha x rows) rows, its bias
// likewise; the alpha shares packed (LayerLayout: tensors 64-byte aligned, the blob
// page-aligned) in pinned host memory and streamed to a device slot each pass; the CPU shares
// in host memory as they are; the norms and the modules kept whole packed on the device.
struct SplitLayer {
  int64_t gpu = 0, host = 0, stream = 0;
  int64_t max_in = 0, max_out = 0;  // over the split linears: the staging's widths (0: none)
};

SplitLayer split_layer(const ModelShape& s, bool compress, const StageRequest& r, int32_t layer) {
  SplitLayer out;
  int64_t resident = 0, stream = 0;  // packed, 64-byte aligned tensors
  auto pack = [](int64_t& blob, int64_t bytes) {
    if (bytes > 0) blob = align_bytes(blob + bytes, 64);
  };
  for (const LayerLinear& l : layer_linears(s)) {
    if (!l.present) continue;
    const int i = static_cast<int>(l.slot);
    const int64_t rows = l.out, cols = l.in;
    if (layer >= 0 && hetegen::module_whole(r.hetegen_whole, layer, i)) {
      pack(resident, matrix_bytes(s, rows, cols, compress));
      if (l.bias) pack(resident, rows * kF32);
      continue;
    }
    const double alpha = hetegen::module_alpha(r.hetegen_alpha, r.hetegen_slot_alpha, i);
    const int64_t g = hetegen::split_gpu_rows(alpha, rows);
    pack(stream, matrix_bytes(s, g, cols, compress));
    if (l.bias) pack(stream, g * kF32);
    out.host += matrix_bytes(s, rows - g, cols, compress) + (l.bias ? (rows - g) * kF32 : 0);
    out.max_in = std::max(out.max_in, cols);
    out.max_out = std::max(out.max_out, rows);
  }
  for (const int64_t norm : layer_norm_bytes(s)) pack(resident, norm);
  out.gpu = align_bytes(resident);
  out.stream = stream > 0 ? align_bytes(stream) : 0;
  out.host += out.stream;  // the shares' pinned blob
  return out;
}

// The embedding, positions, projections, final norm and head that the stage holds.
int64_t fixed_bytes(const ModelShape& s, bool embedding, bool head, bool compress) {
  const int64_t h = s.hidden, e = s.embed_width();
  auto mat = [&](int64_t rows, int64_t cols) { return matrix_bytes(s, rows, cols, compress); };
  auto table = [&](int64_t rows, int64_t cols) { return matrix_bytes(s, rows, cols, false); };
  int64_t b = 0;
  if (embedding || (head && s.tied_head)) b += mat(s.vocab, e);
  if (s.learned_positions && embedding) {
    b += table(s.max_positions + s.position_offset, h);  // never compressed
    if (e != h) b += mat(h, e);                          // project_in
  }
  if (!head) return b;
  if (s.learned_positions && e != h) b += mat(e, h);  // project_out
  if (s.final_norm) b += h * kF32 * (s.norm_bias ? 2 : 1);
  if (!s.tied_head) b += mat(s.vocab, e);
  return b;
}

struct Counts {
  int32_t gpu = 0, cpu = 0;
};

Counts counts_from_shares(const Policy& p, int32_t n, bool device_compute) {
  const std::vector<Tier> t = tiers_from_shares(n, p.w_gpu_percent, p.w_cpu_percent, "weight");
  Counts c{count_tier(t, Tier::kGpu), count_tier(t, Tier::kCpu)};
  if (!device_compute) {  // the host computes: GPU shares are host-resident too
    c.cpu += c.gpu;
    c.gpu = 0;
  }
  return c;
}

// Fill the compute tier, then the host, as the budgets allow (`other`: what the stage's
// cache and buffers already take of each tier when the budgets bound the whole stage).
Counts counts_from_budgets(const WeightPlacement& p, int32_t n, const TierBudgets& b,
                           const TierBytes& other, int64_t host_staging) {
  const int64_t L = p.layer_bytes;
  Counts c;
  if (p.device_compute) {
    const int64_t avail = b.gpu - other.gpu;
    const int64_t S = p.split_gpu_bytes;
    if (b.gpu < 0 || p.fixed_bytes + n * L <= avail) {
      c.gpu = n;
    } else if (p.hetegen()) {
      // The layers not on the GPU are split: each keeps S (its norms) there, and their alpha
      // shares stream through two slots (of a whole layer instead if some layer lands on disk,
      // which the budget check then counts).
      const int64_t slots = 2 * p.split_stream_bytes;
      c.gpu = L > S ? static_cast<int32_t>(std::clamp<int64_t>(
                          (avail - p.fixed_bytes - n * S - slots) / (L - S), 0, n))
                    : 0;
    } else {
      c.gpu = static_cast<int32_t>(std::clamp<int64_t>((avail - p.fixed_bytes - 2 * L) / L, 0, n));
    }
  }
  const int32_t rest = n - c.gpu;
  const int64_t host_fixed = p.device_compute ? 0 : p.fixed_bytes;
  const int64_t H = p.host_layer_bytes;
  const int64_t avail = b.cpu - other.cpu;
  if (b.cpu < 0 || host_fixed + rest * H <= avail) {
    c.cpu = rest;
  } else {
    c.cpu =
        static_cast<int32_t>(std::clamp<int64_t>((avail - host_fixed - host_staging) / H, 0, rest));
  }
  return c;
}

void check_weight_budget(const char* option, int64_t budget, int64_t need, const WeightPlacement& p,
                         const char* what) {
  if (budget < 0 || need <= budget) return;
  fail_input(
      "{} {:.1f} MiB is too small for this weight placement: {} need {:.1f} MiB (short by {:.1f} "
      "MiB; {})",
      option, mib(budget), what, mib(need), mib(need - budget), p.str());
}

}  // namespace

KvWindow kv_window(const ModelShape& s, const StageRequest& r) {
  if (s.cache_window <= 0 || r.max_rows <= 0 || r.kv_capacity <= 0) return {};
  return KvWindow::of(static_cast<int32_t>(s.cache_window), r.kv_capacity, r.max_rows);
}

int64_t WeightPlacement::gpu_bytes() const {
  if (!device_compute) return 0;
  int64_t split_gpu = 0;
  for (const SplitBytes& b : split) split_gpu += b.gpu;
  return fixed_bytes + count(Tier::kGpu) * layer_bytes + split_gpu + device_staging_bytes;
}

int64_t WeightPlacement::cpu_bytes() const {
  if (hetegen()) {
    int64_t host = 0;
    for (const SplitBytes& b : split) host += b.host;
    return host + staging_bytes;
  }
  return (device_compute ? 0 : fixed_bytes) + count(Tier::kCpu) * host_layer_bytes + staging_bytes +
         expert_cache_bytes;
}

int64_t WeightPlacement::split_stream_total() const {
  int64_t total = 0;
  for (const SplitBytes& b : split) total += b.stream;
  return total;
}

int64_t WeightPlacement::disk_bytes() const {
  return count(Tier::kDisk) * layer_bytes + expert_disk_bytes;
}

std::string WeightPlacement::str() const {
  return fmt::format(
             "WeightPlacement({} compute, layers gpu/cpu/disk {}/{}/{}, fixed {:.1f} MiB, layer "
             "{:.1f} "
             "MiB, device slots {:.1f} MiB, host staging {:.1f} MiB{})",
             device_compute ? "device" : "host", count(Tier::kGpu), count(Tier::kCpu),
             count(Tier::kDisk), mib(fixed_bytes), mib(layer_bytes), mib(device_staging_bytes),
             mib(staging_bytes),
             hetegen()
                 ? fmt::format(
                       ", HeteGen alpha {:.3f}: {} CPU-tier layers split, {:.3f} MiB on "
                       "the device + {:.1f} MiB in host memory each, {:.3f} MiB of alpha shares "
                       "streamed each pass",
                       hetegen_alpha, split_layers(), mib(split_gpu_bytes), mib(host_layer_bytes),
                       mib(split_stream_total()))
                 : "") +
         (experts_on_disk()
              ? fmt::format(", experts {} of {} per layer resident, the rest on disk ({:.1f} MiB "
                            "each, {:.1f} MiB in all) through {} cache slots",
                            resident_experts, n_experts, mib(expert_bytes), mib(expert_disk_bytes),
                            expert_cache_slots)
              : "");
}

int64_t KvPlacement::file_bytes() const {
  return count(Tier::kDisk) * 2 * align_bytes(layer_bytes);
}

std::string KvPlacement::str() const {
  return fmt::format(
      "KvPlacement({}, layers gpu/cpu/disk {}/{}/{}, layer K or V {:.3f} MiB, {} rows a "
      "slot{})",
      compress ? "4-bit" : (f16 ? "f16" : "f32"), count(Tier::kGpu), count(Tier::kCpu),
      count(Tier::kDisk), mib(layer_bytes), slot_rows,
      pie_host_layers
          ? fmt::format("; Pie, m in [{}, {}]: {} device + {} host buffers of {:.3f} MiB",
                        pie_host_layers->lowest, pie_host_layers->highest, pie.device, pie.host,
                        mib(pie.bytes))
          : "");
}

TierBytes StagePlacement::weight_bytes() const {
  return {weights.gpu_bytes(), weights.cpu_bytes(), weights.disk_bytes()};
}

TierBytes StagePlacement::cache_bytes() const {
  TierBytes b;
  if (cache.pie_host_layers) {  // every layer on the GPU tier, in Pie's buffers
    b.gpu += cache.pie.device_bytes();
    b.cpu += cache.pie.host_bytes();
    return b;
  }
  const int64_t resident_gpu = cache.count(Tier::kGpu) * 2 * cache.layer_bytes;
  (device_compute ? b.gpu : b.cpu) += resident_gpu;
  b.cpu += cache.count(Tier::kCpu) * 2 * cache.layer_bytes + cache.staging_bytes;
  b.disk += cache.file_bytes();
  return b;
}

TierBytes StagePlacement::buffer_bytes() const {
  TierBytes b;
  (device_compute ? b.gpu : b.cpu) += activation_bytes + compute_workspace_bytes;
  b.cpu += host_workspace_bytes;
  return b;
}

TierBytes StagePlacement::total() const {
  TierBytes t = weight_bytes();
  t += cache_bytes();
  t += buffer_bytes();
  return t;
}

std::string StagePlacement::str() const {
  std::string w, c;
  for (Tier t : weights.tiers) w += tier_name(t)[0];
  for (Tier t : cache.tiers) c += tier_name(t)[0];
  return fmt::format(
      "StagePlacement(layers [{}, {}){}{}, {} compute, total {}; weights {} [{}]; kv cache {} "
      "[{}] = {}; activations {:.1f} MiB, workspace {:.1f} MiB compute + {:.1f} MiB host{}{}{})",
      layer_begin, layer_end, embedding ? " + embedding" : "", head ? " + head" : "",
      device_compute ? "device" : "host", total().str(), weights.str(), w, cache.str(), c,
      cache_bytes().str(), mib(activation_bytes), mib(compute_workspace_bytes),
      mib(host_workspace_bytes),
      kernel_scratch_bytes > 0
          ? fmt::format("; kernel scratch {:.1f} MiB on the device", mib(kernel_scratch_bytes))
          : "",
      gpu_batch_size > 0 ? fmt::format(", GPU batch {}", gpu_batch_size) : "",
      cpu_attention ? ", attention on the CPU" : "");
}

namespace {

// The stage's layers, [r.layer_begin, end), refused unless a non-empty part of the model.
int32_t stage_layer_end(const ModelShape& s, const StageRequest& r) {
  const auto n_model = static_cast<int32_t>(s.n_layers);
  const int32_t end = r.layer_end < 0 ? n_model : r.layer_end;
  if (r.layer_begin < 0 || r.layer_begin >= end || end > n_model)
    fail_input("layer range [{}, {}) is not a non-empty part of the model's {} layers",
               r.layer_begin, end, n_model);
  return end;
}

void check_hetegen(const StageRequest& r, int32_t n) {
  if (r.hetegen_alpha == 0) return;
  hetegen::check_split(r.hetegen_alpha, r.hetegen_slot_alpha, r.hetegen_whole, n);
  if (!r.device_compute)
    fail_input("HeteGen splits layers between a device and the CPU: it needs device compute");
}

// K or V of one layer as stored: f32, f16 or 4-bit, for every committed position.
int64_t kv_layer_bytes(const ModelShape& s, const StageRequest& r, const Policy& policy) {
  const int64_t positions = committed_positions(s, r);
  const int64_t rows = slot_rows(s, r);
  const bool packed = positions < int64_t{r.kv_slots} * rows;
  if (!policy.compress_cache)
    return positions * s.n_kv_heads * s.head_dim * (policy.cache_f16 ? 2 : kF32);
  KvQ4LayerView v;  // its bytes are per position: one slot of them all says the same
  v.n_slots = packed ? 1 : r.kv_slots;
  v.capacity = static_cast<int32_t>(packed ? positions : rows);
  v.n_kv_heads = static_cast<int32_t>(s.n_kv_heads);
  v.head_dim = static_cast<int32_t>(s.head_dim);
  v.group = KvQ4LayerView::group_for(v.head_dim);
  return static_cast<int64_t>(v.tensor_bytes());
}

// Pie's buffers in place of the GPU-tier layers, as worker/kv_cache.cpp refuses and allocates
// them.
void place_pie(const StageRequest& r, const Policy& policy, int32_t n, KvPlacement& kv) {
  if (!r.device_compute)
    fail_input("Pie swaps the KV cache between a device and the host: it needs device compute");
  if (kv.count(Tier::kGpu) != n)
    fail_input("Pie swaps GPU-tier KV-cache layers; the policy '{}' puts {} of {} layers elsewhere",
               policy.compact(), n - kv.count(Tier::kGpu), n);
  kv.pie_host_layers = r.pie;
  kv.pie = PieBuffers::of(n, r.pie->lowest, r.pie->highest, kv.layer_bytes);
}

// The KV cache: layer tiers from the cache shares, K and V per layer as stored.
KvPlacement place_cache(const ModelShape& s, const StageRequest& r, const Policy& policy,
                        int32_t n) {
  KvPlacement kv;
  if (r.kv_slots <= 0) return kv;
  kv.compress = policy.compress_cache;
  kv.f16 = policy.cache_f16;
  if (kv.compress && s.head_dim % 2 != 0)
    fail_input("head_dim {} is odd; the 4-bit KV cache packs two values per byte", s.head_dim);
  if (r.kv_positions < 0 || (r.kv_positions > 0 && r.device_compute))
    fail_input("{} packed KV positions with {} compute: packing commits host memory only",
               r.kv_positions, r.device_compute ? "device" : "host");
  kv.layer_bytes = kv_layer_bytes(s, r, policy);
  kv.slot_rows = slot_rows(s, r);
  kv.tiers = tiers_from_shares(n, policy.cache_gpu_percent, policy.cache_cpu_percent, "cache");
  if (kv.count(Tier::kDisk) > 0) kv.staging_bytes = 2 * align_bytes(kv.layer_bytes);
  if (r.pie) place_pie(r, policy, n, kv);
  return kv;
}

// One step's activations on the compute tier (worker/transformer.h: one layer's temporaries;
// block_executor.h: a state per GPU batch).
int64_t activation_bytes(const ModelShape& s, const StageRequest& r, int32_t gpu_batch_size) {
  const int64_t rows = r.max_rows;
  const int64_t wide = std::max({s.hidden, s.q_width(), s.embed_width()});
  const int64_t mlp = std::max(s.intermediate, s.expert_intermediate);
  int64_t a = rows * kF32 * (2 * wide + 2 * s.q_width() + 2 * s.kv_width() + 2 * mlp);  // h sel ..
  // A MoE layer's router logits, an expert's gathered rows and output, and each row's
  // experts and weights.
  if (s.moe()) a += rows * kF32 * (s.n_experts + 2 * s.hidden + 2 * s.experts_per_token + 2);
  if (r.head) a += std::min<int64_t>(rows, kLogitChunk) * s.vocab * kF32;
  if (!s.learned_positions)  // rotary (longrope: the short and the long factors' tables)
    a += 2 * s.max_positions * (s.longrope ? 2 : 1) * (s.head_dim / 2) * kF32;
  // Each GPU batch of a block keeps its residual stream and its step ids: tokens,
  // positions, the row table (RowEntry per row) and rope rows. One GPU batch at least.
  const int64_t gbs = gpu_batch_size;
  const int64_t states = gbs > 0 && r.kv_slots > gbs ? (r.kv_slots + gbs - 1) / gbs : 1;
  a += states * rows * (wide * kF32 + 3 * kI32 + static_cast<int64_t>(sizeof(RowEntry)));
  return a;
}

// The step's buffers: activations, attention's workspaces for a cache off the device
// (kv_attention.h), the kernels' scratch, and what a pipeline stage keeps on the host.
void place_buffers(const ModelShape& s, const StageRequest& r, const Policy& policy,
                   StagePlacement& p) {
  if (r.max_rows > 0) {
    const int64_t rows = r.max_rows;
    const KvPlacement& kv = p.cache;
    if (r.kv_slots > 0) {
      const bool off_device =
          r.device_compute && kv.count(Tier::kGpu) < static_cast<int32_t>(kv.tiers.size());
      if (off_device && !p.cpu_attention)  // a layer staged on the device around attention
        p.compute_workspace_bytes += 2 * kv.layer_bytes;
      if (off_device && p.cpu_attention)  // q, k, v and the output on the host
        p.host_workspace_bytes += rows * kF32 * (2 * s.q_width() + 2 * s.kv_width());
    }
    p.activation_bytes = activation_bytes(s, r, p.gpu_batch_size);
    if (r.device_compute)
      p.kernel_scratch_bytes = accelerator_scratch_bytes(stage_kernel_bounds(s, r, policy));
  }
  p.host_workspace_bytes +=
      int64_t{r.host_logit_rows} * s.vocab * kF32 + int64_t{r.host_token_rows} * kI32;
}

// What one layer and the fixed parts weigh where they are held: packed, in host memory, and
// split by HeteGen (without whole modules).
WeightPlacement weight_sizes(const ModelShape& s, const StageRequest& r, bool compress,
                             int32_t resident, int32_t n) {
  WeightPlacement w;
  w.device_compute = r.device_compute;
  if (s.moe() && resident < s.n_experts) {
    w.n_experts = static_cast<int32_t>(s.n_experts);
    w.resident_experts = resident;
    w.expert_cache_slots = r.expert_cache_slots > 0 ? r.expert_cache_slots
                                                    : static_cast<int32_t>(2 * s.experts_per_token);
    w.expert_bytes = packed_bytes(expert_tensors(s, compress));
    w.expert_disk_bytes = int64_t{n} * (s.n_experts - resident) * w.expert_bytes;
    w.expert_cache_bytes = w.expert_cache_slots * (w.expert_bytes + kPageBytes);
  }
  int64_t packed = 0, plain = 0;
  for (int64_t b : layer_tensors(s, compress, s.moe() ? resident : 0)) {
    packed = align_bytes(packed + b, 64);
    plain += b;
  }
  w.layer_bytes = align_bytes(packed);
  w.host_layer_bytes = r.device_compute ? w.layer_bytes : plain;
  w.fixed_bytes = fixed_bytes(s, r.embedding, r.head, compress);
  if (r.hetegen_alpha > 0) {
    const SplitLayer split = split_layer(s, compress, r, -1);  // no module whole
    w.hetegen_alpha = r.hetegen_alpha;
    w.split_gpu_bytes = split.gpu;
    w.split_stream_bytes = split.stream;
    w.host_layer_bytes = split.host;
  }
  return w;
}

// The layers' tiers: from the policy's shares, or filling the tiers as the budgets allow
// (after the cache and buffers in `p` when the budgets bound the whole stage).
void place_layer_tiers(const StageRequest& r, int32_t n, const StagePlacement& p,
                       WeightPlacement& w) {
  const int64_t host_staging = 2 * (w.layer_bytes + kPageBytes);
  Counts c;
  if (r.policy && r.weight_shares) {
    c = counts_from_shares(*r.policy, n, r.device_compute);
  } else {
    TierBytes other;
    if (r.budgets.whole_stage) {
      other = p.cache_bytes();
      other += p.buffer_bytes();
    }
    c = counts_from_budgets(w, n, r.budgets, other, host_staging);
  }
  const int32_t n_disk = n - c.gpu - c.cpu;
  if (n_disk > 0) w.staging_bytes = host_staging;
  w.tiers = spread_tiers(n, c.gpu, c.cpu);
  for (int32_t i = 0; i < n; ++i)
    if (w.tiers[static_cast<size_t>(i)] == Tier::kDisk) w.disk_layers.push_back(i);
  if (w.streamed_layers() > 0) w.device_staging_bytes = 2 * w.layer_bytes;
}

// HeteGen's split layers, each as held (its whole modules); the slots take the largest alpha
// shares when no whole layer streams; the staging is as wide as the widest split linear and
// sized for a step's rows like the activations.
void place_split_layers(const ModelShape& s, const StageRequest& r, bool compress,
                        StagePlacement& p) {
  WeightPlacement& w = p.weights;
  if (w.split_layers() == 0) return;
  const auto n = static_cast<int32_t>(w.tiers.size());
  int64_t max_in = 0, max_out = 0, max_stream = 0;
  w.split.assign(static_cast<size_t>(n), {});
  for (int32_t i = 0; i < n; ++i) {
    if (w.tiers[static_cast<size_t>(i)] != Tier::kCpu) continue;
    const SplitLayer l = split_layer(s, compress, r, i);
    w.split[static_cast<size_t>(i)] = {l.gpu, l.host, l.stream};
    max_in = std::max(max_in, l.max_in);
    max_out = std::max(max_out, l.max_out);
    max_stream = std::max(max_stream, l.stream);
  }
  w.device_staging_bytes = std::max(w.device_staging_bytes, 2 * max_stream);
  if (max_out > 0) {
    w.split_host_row_bytes = (max_in + max_out) * kF32;
    w.split_device_row_bytes = max_out * kF32;
  }
  p.compute_workspace_bytes += int64_t{r.max_rows} * w.split_device_row_bytes;
  p.host_workspace_bytes += int64_t{r.max_rows} * w.split_host_row_bytes;
}

// Budgets that bound the weights alone (the engine's --gpu-mem, --cpu-mem, --disk-mem).
void check_weight_budgets(const TierBudgets& b, bool device_compute, const WeightPlacement& w) {
  if (device_compute)
    check_weight_budget("--gpu-mem", b.gpu, w.gpu_bytes(), w,
                        w.hetegen() ? "embeddings, head, GPU-tier layers, HeteGen's split "
                                      "layers' norms and whole modules, and two device slots"
                                    : "embeddings, head, GPU-tier layers and two device slots");
  check_weight_budget("--disk-mem", b.disk, w.disk_bytes(), w, "disk-tier layers");
  check_weight_budget("--cpu-mem", b.cpu, w.cpu_bytes(), w,
                      device_compute ? "CPU-tier layers and disk staging"
                                     : "embeddings, head, resident layers and disk staging");
}

}  // namespace

namespace {

// Experts each MoE layer holds: the request's, or all of them where the host's budget holds
// every layer whole, else the most that keep every layer (attention, router and those
// experts) in host memory with the rest of the experts on disk (their cache counted); 0
// when not even that fits, and whole layers then go to disk too. A device stage keeps its
// experts with its layers (the layer tiers decide).
int32_t resident_experts(const ModelShape& s, const StageRequest& r, int32_t n,
                         const StagePlacement& p, const Policy& policy) {
  if (!s.moe()) return 0;
  const auto all = static_cast<int32_t>(s.n_experts);
  if (r.resident_experts >= 0) {
    if (r.resident_experts > all)
      fail_input("{} resident experts per layer, but the model has {}", r.resident_experts, all);
    return r.resident_experts;
  }
  if (!r.experts_follow_budget || r.device_compute || r.budgets.cpu < 0 ||
      (r.policy && r.weight_shares))
    return all;
  const int64_t other = r.budgets.whole_stage ? p.cache_bytes().cpu + p.buffer_bytes().cpu : 0;
  for (int32_t k = all; k >= 0; --k) {
    const WeightPlacement w = weight_sizes(s, r, policy.compress_weight, k, n);
    if (w.fixed_bytes + n * w.host_layer_bytes + w.expert_cache_bytes + other <= r.budgets.cpu)
      return k;
  }
  return 0;
}

}  // namespace

StagePlacement place_stage(const ModelShape& s, const StageRequest& r) {
  const int32_t end = stage_layer_end(s, r);
  const int32_t n = end - r.layer_begin;
  const Policy policy = r.policy.value_or(Policy{});
  policy.validate();
  check_hetegen(r, n);
  StagePlacement p;
  p.layer_begin = r.layer_begin;
  p.layer_end = end;
  p.embedding = r.embedding;
  p.head = r.head;
  p.device_compute = r.device_compute;
  p.gpu_batch_size = r.policy ? static_cast<int32_t>(r.policy->gpu_batch_size.value_or(0)) : 0;
  p.cpu_attention = policy.cpu_cache_compute;
  p.cache = place_cache(s, r, policy, n);
  place_buffers(s, r, policy, p);
  p.weights = weight_sizes(s, r, policy.compress_weight, resident_experts(s, r, n, p, policy), n);
  place_layer_tiers(r, n, p, p.weights);
  place_split_layers(s, r, policy.compress_weight, p);
  if (!r.budgets.whole_stage) check_weight_budgets(r.budgets, r.device_compute, p.weights);
  return p;
}

std::vector<std::string> shortfalls(const StagePlacement& p, const TierBudgets& b) {
  std::vector<std::string> out;
  TierBytes need = p.total();
  need.gpu += p.kernel_scratch_bytes;
  for (Tier t : kTiers) {
    if (b[t] < 0 || need[t] <= b[t]) continue;
    out.push_back(fmt::format(
        "{} needs {:.1f} MiB ({} bytes), budget {:.1f} MiB ({} bytes): short by {:.1f} MiB ({} "
        "bytes)",
        tier_name(t), mib(need[t]), need[t], mib(b[t]), b[t], mib(need[t] - b[t]), need[t] - b[t]));
  }
  return out;
}

WeightPlacement place_weights(const ModelShape& model, const StageRequest& request) {
  return place_stage(model, request).weights;
}

}  // namespace strata
