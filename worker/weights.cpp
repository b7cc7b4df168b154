#include "worker/weights.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <span>

#include "kernels/error.h"
#include "kernels/log.h"
#include "worker/dummy.h"
#include "worker/safetensors.h"

namespace strata {
namespace {

// kNorm: a norm's weight, which the family may offset (Gemma's (1 + w)), so never a view of
// the file.
enum class Role { kMatrix, kVector, kNorm };

// Produces one tensor by name, checked against the shape the config implies.
using FetchFn =
    std::function<Tensor(const std::string& name, Shape expected, Role role, int64_t fan_in)>;

struct NameTable {
  std::string embed, positions, project_in, project_out, final_norm, lm_head;
  std::string layer_prefix;  // followed by "{i}."
  std::string attn_norm, q, k, v, o, mlp_norm, gate, up, down;
  std::string qkv, gate_up;                   // Phi-3's fused projections (q, k, v, gate, up empty)
  std::string q_norm, k_norm;                 // Qwen3
  std::string post_attn_norm, post_mlp_norm;  // Gemma-2
  // A MoE layer's router, the shared expert's gate (Qwen2-MoE), and each expert's linears:
  // experts + "{j}." + expert_gate etc.
  std::string router, shared_expert_gate, experts, expert_gate, expert_up, expert_down;
};

// The MoE families' MLP names: Mixtral's block_sparse_moe with w1 (gate), w3 (up), w2
// (down); the Qwen MoE families' and OLMoE's mlp.experts with gate/up/down_proj, Qwen2-MoE's
// dense gate/up/down being its shared expert.
void moe_names(ModelFamily family, NameTable& n) {
  if (family == ModelFamily::kMixtral) {
    n.router = "block_sparse_moe.gate";
    n.experts = "block_sparse_moe.experts.";
    n.expert_gate = "w1";
    n.expert_up = "w3";
    n.expert_down = "w2";
  } else {
    n.router = "mlp.gate";
    n.experts = "mlp.experts.";
    n.expert_gate = "gate_proj";
    n.expert_up = "up_proj";
    n.expert_down = "down_proj";
  }
  if (family == ModelFamily::kQwen2Moe) {
    n.gate = "mlp.shared_expert.gate_proj";
    n.up = "mlp.shared_expert.up_proj";
    n.down = "mlp.shared_expert.down_proj";
    n.shared_expert_gate = "mlp.shared_expert_gate";
  }
  if (family == ModelFamily::kQwen3Moe || family == ModelFamily::kOlmoe) {
    n.q_norm = "self_attn.q_norm";
    n.k_norm = "self_attn.k_norm";
  }
}

// Llama's names, which Mistral, Qwen2 and Qwen3 keep (Qwen3 adds q_norm / k_norm); Phi-3
// fuses q/k/v and gate/up; Gemma-2 renames the MLP's norm and adds the two post-block norms.
NameTable decoder_names(ModelFamily family) {
  NameTable n{"model.embed_tokens",
              "",
              "",
              "",
              "model.norm",
              "lm_head",
              "model.layers.",
              "input_layernorm",
              "self_attn.q_proj",
              "self_attn.k_proj",
              "self_attn.v_proj",
              "self_attn.o_proj",
              "post_attention_layernorm",
              "mlp.gate_proj",
              "mlp.up_proj",
              "mlp.down_proj"};
  if (family == ModelFamily::kQwen3) {
    n.q_norm = "self_attn.q_norm";
    n.k_norm = "self_attn.k_norm";
  } else if (family == ModelFamily::kPhi3) {
    n.qkv = "self_attn.qkv_proj";
    n.gate_up = "mlp.gate_up_proj";
    n.q = n.k = n.v = n.gate = n.up = "";
  } else if (family == ModelFamily::kGemma2) {
    n.post_attn_norm = "post_attention_layernorm";
    n.mlp_norm = "pre_feedforward_layernorm";
    n.post_mlp_norm = "post_feedforward_layernorm";
  } else if (family == ModelFamily::kMixtral || family == ModelFamily::kQwen2Moe ||
             family == ModelFamily::kQwen3Moe || family == ModelFamily::kOlmoe) {
    moe_names(family, n);
  }
  return n;
}

// OPT checkpoints name their tensors with or without the leading "model.".
NameTable opt_names(const std::string& root) {
  return {root + "decoder.embed_tokens",
          root + "decoder.embed_positions",
          root + "decoder.project_in",
          root + "decoder.project_out",
          root + "decoder.final_layer_norm",
          "lm_head",
          root + "decoder.layers.",
          "self_attn_layer_norm",
          "self_attn.q_proj",
          "self_attn.k_proj",
          "self_attn.v_proj",
          "self_attn.out_proj",
          "final_layer_norm",
          "",
          "fc1",
          "fc2"};
}

// Rows [begin, begin + rows) of a [R, C] matrix, as a view of the same storage.
Tensor row_block(const Tensor& t, int64_t begin, int64_t rows) {
  Tensor v = t;
  v.shape = Shape{rows, t.shape[1]};
  v.data = static_cast<char*>(t.data) +
           static_cast<size_t>(begin) * static_cast<size_t>(t.shape[1]) * dtype_size(t.dtype);
  return v;
}

// The checkpoint's name of a linear (its ".weight" and ".bias" follow).
const std::string& linear_name(const NameTable& n, LinearSlot slot) {
  switch (slot) {
    case LinearSlot::kQ:
      return n.q;
    case LinearSlot::kK:
      return n.k;
    case LinearSlot::kV:
      return n.v;
    case LinearSlot::kO:
      return n.o;
    case LinearSlot::kGate:
      return n.gate;
    case LinearSlot::kUp:
      return n.up;
    case LinearSlot::kDown:
      return n.down;
  }
  STRATA_CHECK(false, "linear slot {}", static_cast<int>(slot));
}

// A fused projection's row blocks handed to the slots it holds, in order (Phi-3's qkv_proj:
// q, k, v; gate_up_proj: gate, up, as Phi3MLP's chunk(2) splits it).
void fetch_fused(const std::string& name, std::span<const LayerLinear> parts, const FetchFn& fetch,
                 LayerWeights& L) {
  int64_t rows = 0;
  for (const LayerLinear& l : parts) rows += l.out;
  const Tensor fused = fetch(name + ".weight", {rows, parts[0].in}, Role::kMatrix, parts[0].in);
  int64_t at = 0;
  for (const LayerLinear& l : parts) {
    L.*slot_weight_member(l.slot) = fused.data != nullptr ? row_block(fused, at, l.out) : fused;
    at += l.out;
  }
}

// A MoE layer's router, shared expert gate and experts, after its dense tensors.
void build_experts(const ModelConfig& c, const NameTable& n, const std::string& p,
                   const FetchFn& fetch, LayerWeights& L) {
  const int64_t h = c.hidden, f = c.expert_intermediate;
  L.router = fetch(p + n.router + ".weight", {c.n_experts, h}, Role::kMatrix, h);
  if (!n.shared_expert_gate.empty())
    L.shared_expert_gate = fetch(p + n.shared_expert_gate + ".weight", {1, h}, Role::kVector, -1);
  L.experts.resize(static_cast<size_t>(c.n_experts));
  for (int32_t j = 0; j < c.n_experts; ++j) {
    const std::string e = p + n.experts + std::to_string(j) + ".";
    ExpertWeights& x = L.experts[static_cast<size_t>(j)];
    x.gate = fetch(e + n.expert_gate + ".weight", {f, h}, Role::kMatrix, h);
    x.up = fetch(e + n.expert_up + ".weight", {f, h}, Role::kMatrix, h);
    x.down = fetch(e + n.expert_down + ".weight", {h, f}, Role::kMatrix, f);
  }
}

// Each block's norm, then its linears' weights, then their biases, then the block's extra
// norms: the order the tensors are fetched in (which a dummy model's seeded weights follow).
void build_layer(const ModelConfig& c, const NameTable& n, int32_t i, const FetchFn& fetch,
                 LayerWeights& L) {
  const std::string p = n.layer_prefix + std::to_string(i) + ".";
  const int64_t h = c.hidden;
  const bool ln = c.architecture().norm_bias();
  const LayerLinears linears = layer_linears(c.shape());
  const auto norm = [&](const std::string& name, int64_t width, Tensor& weight) {
    if (!name.empty()) weight = fetch(p + name + ".weight", {width}, Role::kNorm, 0);
  };
  const auto fused = [&](const std::string& name, std::initializer_list<LinearSlot> slots) {
    std::vector<LayerLinear> parts;
    for (LinearSlot s : slots) parts.push_back(linear_of(linears, s));
    fetch_fused(p + name, parts, fetch, L);
  };
  auto block = [&](LinearBlock b, const std::string& norm_name, Tensor& weight, Tensor& bias) {
    norm(norm_name, h, weight);
    if (ln) bias = fetch(p + norm_name + ".bias", {h}, Role::kVector, -1);
    if (b == LinearBlock::kAttention && !n.qkv.empty())
      fused(n.qkv, {LinearSlot::kQ, LinearSlot::kK, LinearSlot::kV});
    if (b == LinearBlock::kMlp && !n.gate_up.empty())
      fused(n.gate_up, {LinearSlot::kGate, LinearSlot::kUp});
    for (const LayerLinear& l : linears)
      if (l.present && linear_block(l.slot) == b && !linear_name(n, l.slot).empty())
        L.*slot_weight_member(l.slot) =
            fetch(p + linear_name(n, l.slot) + ".weight", {l.out, l.in}, Role::kMatrix, l.in);
    for (const LayerLinear& l : linears)
      if (l.present && l.bias && linear_block(l.slot) == b)
        L.*slot_bias_member(l.slot) =
            fetch(p + linear_name(n, l.slot) + ".bias", {l.out}, Role::kVector, -1);
  };
  block(LinearBlock::kAttention, n.attn_norm, L.attn_norm, L.attn_norm_bias);
  const bool whole = c.architecture().qk_norm_whole;  // OLMoE's over the projections
  norm(n.q_norm, whole ? c.q_width() : c.head_dim, L.q_norm);
  norm(n.k_norm, whole ? c.kv_width() : c.head_dim, L.k_norm);
  norm(n.post_attn_norm, h, L.post_attn_norm);
  block(LinearBlock::kMlp, n.mlp_norm, L.mlp_norm, L.mlp_norm_bias);
  norm(n.post_mlp_norm, h, L.post_mlp_norm);
  if (c.moe()) build_experts(c, n, p, fetch, L);
}

void build_fixed(const ModelConfig& c, const NameTable& n, const FetchFn& fetch,
                 const WeightParts& parts, ModelWeights& w) {
  const int64_t h = c.hidden;
  const Architecture a = c.architecture();
  const int64_t e = a.embed_dim;
  if (parts.embedding || (parts.head && c.tie_word_embeddings))
    w.embed = fetch(n.embed + ".weight", {c.vocab, e}, Role::kMatrix, -1);
  if (a.learned_positions() && parts.embedding)
    w.positions =
        fetch(n.positions + ".weight", {c.max_positions + c.position_offset, h}, Role::kMatrix, -1);
  if (e != h && parts.embedding)
    w.project_in = fetch(n.project_in + ".weight", {h, e}, Role::kMatrix, e);
  if (!parts.head) return;
  if (e != h) w.project_out = fetch(n.project_out + ".weight", {e, h}, Role::kMatrix, h);
  // OPT-350m style (post-LN) models have no final layer norm.
  if (a.final_norm) {
    w.final_norm = fetch(n.final_norm + ".weight", {h}, Role::kNorm, 0);
    if (a.norm_bias()) w.final_norm_bias = fetch(n.final_norm + ".bias", {h}, Role::kVector, -1);
  }
  w.lm_head = c.tie_word_embeddings ? w.embed
                                    : fetch(n.lm_head + ".weight", {c.vocab, e}, Role::kMatrix, e);
}

ModelWeights build_weights(const ModelConfig& c, const NameTable& n, const FetchFn& fetch,
                           const LayerSink& sink, std::vector<std::unique_ptr<OwnedTensor>>& owned,
                           const WeightParts& parts) {
  ModelWeights w;
  build_fixed(c, n, fetch, parts, w);
  const int32_t count = parts.n_layers < 0 ? c.n_layers - parts.layer_begin : parts.n_layers;
  STRATA_CHECK(parts.layer_begin >= 0 && count >= 0 && parts.layer_begin + count <= c.n_layers,
               "layers [{}, {}) of a {}-layer model", parts.layer_begin, parts.layer_begin + count,
               c.n_layers);
  w.layers.resize(static_cast<size_t>(count));
  for (int32_t i = 0; i < count; ++i) {
    LayerWeights& L = w.layers[static_cast<size_t>(i)];
    const size_t mark = owned.size();
    build_layer(c, n, parts.layer_begin + i, fetch, L);
    if (parts.tp_degree > 1) shard_layer(parts, L, owned);
    if (!sink && parts.tp_degree == 1) continue;
    if (sink) sink(i, L);
    if (L.q.data == nullptr) {
      owned.resize(mark);  // the sink took the layer elsewhere
      continue;
    }
    // Storage the sink or the shard replaced (a matrix compressed to 4-bit, the whole of a
    // split matrix, experts moved to disk): the layer no longer reads it.
    drop_unreferenced(L, owned, mark);
  }
  return w;
}

// Rows [index, index + 1) * R / degree of a [R] or [R, C] tensor, as a new tensor.
Tensor shard_rows(const Tensor& t, int32_t index, int32_t degree,
                  std::vector<std::unique_ptr<OwnedTensor>>& owned) {
  if (t.data == nullptr) return t;
  STRATA_CHECK(t.dtype != DType::kQ4 && t.shape[0] % degree == 0, "rows of {} by {}", t.shape.str(),
               degree);
  Shape shape = t.shape;
  shape.dims[0] /= degree;
  owned.push_back(std::make_unique<OwnedTensor>(t.dtype, shape));
  const size_t bytes = owned.back()->view.bytes();
  std::memcpy(owned.back()->view.data, static_cast<const char*>(t.data) + bytes * index, bytes);
  return owned.back()->view;
}

// Columns [index, index + 1) * C / degree of a [R, C] matrix, as a new tensor.
Tensor shard_columns(const Tensor& t, int32_t index, int32_t degree,
                     std::vector<std::unique_ptr<OwnedTensor>>& owned) {
  STRATA_CHECK(t.dtype != DType::kQ4 && t.shape.rank == 2 && t.shape[1] % degree == 0,
               "columns of {} by {}", t.shape.str(), degree);
  const int64_t rows = t.shape[0], cols = t.shape[1] / degree;
  owned.push_back(std::make_unique<OwnedTensor>(t.dtype, Shape{rows, cols}));
  const size_t elem = dtype_size(t.dtype);
  const size_t piece = static_cast<size_t>(cols) * elem;
  auto* out = static_cast<char*>(owned.back()->view.data);
  const auto* in = static_cast<const char*>(t.data) + piece * static_cast<size_t>(index);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + piece * static_cast<size_t>(r), in + piece * degree * static_cast<size_t>(r),
                piece);
  return owned.back()->view;
}

Tensor own(ModelWeights& w, DType dtype, Shape shape) {
  w.owned.push_back(std::make_unique<OwnedTensor>(dtype, shape));
  return w.owned.back()->view;
}

}  // namespace

void shard_layer(const WeightParts& parts, LayerWeights& L,
                 std::vector<std::unique_ptr<OwnedTensor>>& owned) {
  const int32_t i = parts.tp_index, d = parts.tp_degree;
  STRATA_CHECK(d >= 1 && i >= 0 && i < d, "tensor-parallel shard {} of {}", i, d);
  // Heads are contiguous row blocks of q / k / v (head-major), so a block of whole heads is a
  // block of rows; shard i's query heads read exactly its KV heads (GQA groups stay whole).
  for (Tensor* t : {&L.q, &L.k, &L.v, &L.q_bias, &L.k_bias, &L.v_bias, &L.gate, &L.gate_bias, &L.up,
                    &L.up_bias})
    *t = shard_rows(*t, i, d, owned);
  for (Tensor* t : {&L.o, &L.down})
    if (t->data != nullptr) *t = shard_columns(*t, i, d, owned);
  if (i != 0) L.o_bias = L.down_bias = Tensor{};
  // Each expert's columns as a dense MLP's: every shard routes alike (the router whole), and
  // the weighted sum of partial outputs sums to the whole over the group.
  for (ExpertWeights& e : L.experts) {
    e.gate = shard_rows(e.gate, i, d, owned);
    e.up = shard_rows(e.up, i, d, owned);
    if (e.down.data != nullptr) e.down = shard_columns(e.down, i, d, owned);
  }
}

// A view into an entry counts (Phi-3's fused projections: k and v lie inside qkv's storage).
void drop_unreferenced(const LayerWeights& L, std::vector<std::unique_ptr<OwnedTensor>>& store,
                       size_t mark) {
  const auto used = [&](const std::unique_ptr<OwnedTensor>& t) {
    const auto* begin = static_cast<const char*>(t->view.data);
    bool in = false;
    for_each_tensor(L, [&](const Tensor& x) {
      const auto* d = static_cast<const char*>(x.data);
      in = in || (d != nullptr && d >= begin && d < begin + t->view.bytes());
    });
    return in;
  };
  store.erase(std::remove_if(store.begin() + static_cast<std::ptrdiff_t>(mark), store.end(),
                             [&](const auto& t) { return !used(t); }),
              store.end());
}

int64_t ModelWeights::matrix_bytes() const {
  int64_t total = static_cast<int64_t>(embed.bytes() + positions.bytes() + project_in.bytes() +
                                       project_out.bytes());
  if (lm_head.data != embed.data) total += static_cast<int64_t>(lm_head.bytes());
  for (const LayerWeights& L : layers) {
    for (const Tensor* t : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down, &L.router})
      total += static_cast<int64_t>(t->bytes());
    for (const ExpertWeights& e : L.experts)
      for (const ExpertMember m : kExpertMembers) total += static_cast<int64_t>((e.*m).bytes());
  }
  return total;
}

namespace {

// An IEEE value is NaN or infinite exactly when its exponent bits are all ones.
template <typename T>
int64_t first_all_ones(const void* data, int64_t n, T exponent_mask) {
  const T* p = static_cast<const T*>(data);
  for (int64_t i = 0; i < n; ++i)
    if ((p[i] & exponent_mask) == exponent_mask) return i;
  return -1;
}

// "[3, 17]" for flat index 3 * 64 + 17 of a [*, 64] shape.
std::string multi_index(const Shape& shape, int64_t flat) {
  Shape idx = shape;
  for (int i = shape.rank - 1; i >= 0; --i) {
    idx.dims[static_cast<size_t>(i)] = flat % shape[i];
    flat /= shape[i];
  }
  return idx.str();
}

void check_finite(const std::string& file, const std::string& name, const Tensor& t) {
  const int64_t bad = first_non_finite(t);
  if (bad < 0) return;
  float v = 0;
  convert_to_f32(t.dtype, static_cast<const char*>(t.data) + bad * dtype_size(t.dtype), &v, 1);
  fail_input("{}: tensor '{}' element {} (flat index {}) is {} (--check-weights)", file, name,
             multi_index(t.shape, bad), bad, v);
}

}  // namespace

int64_t first_non_finite(const Tensor& t) {
  const int64_t n = t.shape.numel();
  switch (t.dtype) {
    case DType::kF32:
      return first_all_ones<uint32_t>(t.data, n, 0x7f800000u);
    case DType::kF16:
      return first_all_ones<uint16_t>(t.data, n, 0x7c00u);
    case DType::kBF16:
      return first_all_ones<uint16_t>(t.data, n, 0x7f80u);
    case DType::kI32:
    case DType::kQ4:
    case DType::kF32Panel:
    case DType::kQ4Panel:
      break;
  }
  STRATA_CHECK(false, "first_non_finite: {} is not a float type", dtype_name(t.dtype));
}

namespace {

NameTable names_of(const ModelConfig& config, const SafetensorsArchive* archive) {
  if (config.family != ModelFamily::kOpt) return decoder_names(config.family);
  const bool prefixed =
      archive == nullptr || archive->find("model.decoder.embed_tokens.weight").tensor != nullptr;
  return opt_names(prefixed ? "model." : "");
}

// Norm weights as the layer code applies them: f32, with the family's offset folded in
// (Gemma's RMSNorm scales by 1 + w).
Tensor as_norm(ModelWeights& w, const Tensor& stored, float offset) {
  Tensor f = own(w, DType::kF32, stored.shape);
  convert_to_f32(stored.dtype, stored.data, f.as<float>(),
                 static_cast<size_t>(stored.shape.numel()));
  if (offset != 0.0f)
    for (int64_t i = 0; i < f.shape.numel(); ++i) f.as<float>()[i] += offset;
  return f;
}

// Every tensor the whole model reads from a checkpoint, by name.
std::set<std::string> expected_names(const ModelConfig& config, const NameTable& names) {
  std::set<std::string> out;
  const FetchFn record = [&](const std::string& name, Shape, Role, int64_t) {
    out.insert(name);
    return Tensor{};
  };
  ModelWeights scratch;
  build_fixed(config, names, record, WeightParts{}, scratch);
  LayerWeights layer;
  for (int32_t i = 0; i < config.n_layers; ++i) build_layer(config, names, i, record, layer);
  return out;
}

// Whether two tensors of the checkpoint hold the same bytes (a tied head saved beside the
// embedding it is a copy of).
bool same_tensor(const SafetensorsArchive& archive, const std::string& a, const std::string& b) {
  const auto x = archive.find(a), y = archive.find(b);
  if (x.tensor == nullptr || y.tensor == nullptr || x.tensor->dtype != y.tensor->dtype ||
      !(x.tensor->shape == y.tensor->shape))
    return false;
  const Tensor tx = x.file->view(*x.tensor), ty = y.file->view(*y.tensor);
  return tx.bytes() == ty.bytes() && std::memcmp(tx.data, ty.data, tx.bytes()) == 0;
}

// The loader is strict: a tensor the model would not read means the config does not describe
// the checkpoint (a Qwen2 relabelled llama: its biases; a tied head shipped anyway), so it is
// refused by name rather than silently left out. RoPE's inv_freq buffers, which some Llama
// checkpoints carry, are derived from the config and skipped.
void refuse_unread(const ModelConfig& config, const NameTable& names,
                   const SafetensorsArchive& archive) {
  const std::set<std::string> expected = expected_names(config, names);
  const std::string head = names.lm_head + ".weight";
  for (const std::string& name : archive.names()) {
    if (expected.count(name) != 0 || name.ends_with(".rotary_emb.inv_freq")) continue;
    const bool tied_head = name == head && config.tie_word_embeddings;
    if (tied_head && same_tensor(archive, head, names.embed + ".weight")) continue;
    const char* why =
        tied_head ? " (tie_word_embeddings is true, so the head is the embedding, and this one "
                    "differs from it)"
                  : "";
    fail_input(
        "{}: tensor '{}' is not read by a {} model as {} describes it{}; refusing to load "
        "it partly",
        archive.find(name).file->path(), name, family_name(config.family), config.source, why);
  }
}

}  // namespace

ModelWeights load_checkpoint_weights(const ModelConfig& config, const std::string& dir,
                                     const LayerSink& sink, const WeightParts& parts,
                                     const CheckpointOptions& options) {
  auto archive =
      std::make_shared<SafetensorsArchive>(SafetensorsArchive::open_dir(dir, options.limits));
  const NameTable names = names_of(config, archive.get());
  refuse_unread(config, names, *archive);
  const float offset = config.architecture().norm_offset;
  ModelWeights w;
  w.archive = archive;
  FetchFn fetch = [&](const std::string& name, Shape expected, Role role, int64_t) -> Tensor {
    const auto entry = archive->find(name);
    if (entry.tensor == nullptr)
      fail_input("{}: tensor '{}' is missing from the checkpoint (required by {})", dir, name,
                 config.source);
    const SafetensorsTensor& t = *entry.tensor;
    if (!(t.shape == expected))
      fail_input("{}: tensor '{}' has shape {} but {} implies {}", entry.file->path(), name,
                 t.shape.str(), config.source, expected.str());
    if (t.dtype == DType::kI32)
      fail_input("{}: tensor '{}' has dtype i32; weights must be f32, f16 or bf16",
                 entry.file->path(), name);
    Tensor view = entry.file->view(t);
    if (options.check_weights) check_finite(entry.file->path(), name, view);
    if (role == Role::kNorm) return as_norm(w, view, offset);
    if (role == Role::kMatrix || view.dtype == DType::kF32) return view;
    return as_norm(w, view, 0.0f);  // a bias, to f32
  };
  ModelWeights built = build_weights(config, names, fetch, sink, w.owned, parts);
  built.owned = std::move(w.owned);
  built.archive = archive;
  log::get("worker")->debug("loaded {} ({} bytes of matrices)", dir, built.matrix_bytes());
  return built;
}

ModelWeights make_dummy_weights(const ModelConfig& config, uint64_t seed, const LayerSink& sink,
                                const WeightParts& parts, bool host_resident) {
  // Refuse before allocating: a 175B shape must say it does not fit, not die in the OOM killer.
  const double need = static_cast<double>(config.shape().total_params()) * dtype_size(config.dtype);
  const double have =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if ((!sink || host_resident) && need > 0.9 * have)
    fail(ErrorKind::kOverloaded,
         "{}: weights need {:.1f} GiB in {} but this host has {:.1f} GiB of memory (limit 90%); "
         "give a --cpu-mem budget and a --disk-dir to keep the rest on disk",
         config.source, need / (1 << 30), dtype_name(config.dtype), have / (1 << 30));
  ModelWeights w;
  const float offset = config.architecture().norm_offset;
  FetchFn fetch = [&](const std::string& name, Shape expected, Role role,
                      int64_t fan_in) -> Tensor {
    Tensor t = own(w, role == Role::kMatrix ? config.dtype : DType::kF32, expected);
    fill_dummy_tensor(seed, name, fan_in, t);
    if (role == Role::kNorm && offset != 0.0f)
      for (int64_t i = 0; i < t.shape.numel(); ++i) t.as<float>()[i] += offset;
    return t;
  };
  const NameTable names = names_of(config, nullptr);
  ModelWeights built = build_weights(config, names, fetch, sink, w.owned, parts);
  built.owned = std::move(w.owned);
  return built;
}

void drop_mapped_pages(const Tensor& t) {
  if (t.data == nullptr || t.bytes() == 0) return;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGE_SIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(t.data) + page - 1) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(t.data) + t.bytes()) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

LayerMember slot_weight_member(LinearSlot slot) {
  switch (slot) {
    case LinearSlot::kQ:
      return &LayerWeights::q;
    case LinearSlot::kK:
      return &LayerWeights::k;
    case LinearSlot::kV:
      return &LayerWeights::v;
    case LinearSlot::kO:
      return &LayerWeights::o;
    case LinearSlot::kGate:
      return &LayerWeights::gate;
    case LinearSlot::kUp:
      return &LayerWeights::up;
    case LinearSlot::kDown:
      return &LayerWeights::down;
  }
  STRATA_CHECK(false, "linear slot {}", static_cast<int>(slot));
}

LayerMember slot_bias_member(LinearSlot slot) {
  switch (slot) {
    case LinearSlot::kQ:
      return &LayerWeights::q_bias;
    case LinearSlot::kK:
      return &LayerWeights::k_bias;
    case LinearSlot::kV:
      return &LayerWeights::v_bias;
    case LinearSlot::kO:
      return &LayerWeights::o_bias;
    case LinearSlot::kGate:
      return &LayerWeights::gate_bias;
    case LinearSlot::kUp:
      return &LayerWeights::up_bias;
    case LinearSlot::kDown:
      return &LayerWeights::down_bias;
  }
  STRATA_CHECK(false, "linear slot {}", static_cast<int>(slot));
}

const Tensor& slot_weight(const LayerWeights& L, LinearSlot slot) {
  return L.*slot_weight_member(slot);
}

const Tensor& slot_bias(const LayerWeights& L, LinearSlot slot) {
  static const Tensor kNone;
  const LayerMember m = slot_bias_member(slot);
  return m != nullptr ? L.*m : kNone;
}

}  // namespace strata
