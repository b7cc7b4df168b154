#include "worker/weights.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>

#include "kernels/error.h"
#include "kernels/log.h"
#include "worker/dummy.h"
#include "worker/safetensors.h"

namespace strata {
namespace {

enum class Role { kMatrix, kVector };

// Produces one tensor by name, checked against the shape the config implies.
using FetchFn =
    std::function<Tensor(const std::string& name, Shape expected, Role role, int64_t fan_in)>;

struct NameTable {
  std::string embed, positions, project_in, project_out, final_norm, lm_head;
  std::string layer_prefix;  // followed by "{i}."
  std::string attn_norm, q, k, v, o, mlp_norm, gate, up, down;
};

NameTable llama_names() {
  return {"model.embed_tokens",
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

// Each block's norm, then its linears' weights, then their biases: the order the tensors are
// fetched in (which a dummy model's seeded weights follow).
void build_layer(const ModelConfig& c, const NameTable& n, int32_t i, const FetchFn& fetch,
                 LayerWeights& L) {
  const std::string p = n.layer_prefix + std::to_string(i) + ".";
  const int64_t h = c.hidden;
  const bool ln = c.architecture().norm_bias();
  const LayerLinears linears = layer_linears(c.shape());
  auto block = [&](LinearBlock b, const std::string& norm, Tensor& weight, Tensor& bias) {
    weight = fetch(p + norm + ".weight", {h}, Role::kVector, 0);
    if (ln) bias = fetch(p + norm + ".bias", {h}, Role::kVector, -1);
    for (const LayerLinear& l : linears)
      if (l.present && linear_block(l.slot) == b)
        L.*slot_weight_member(l.slot) =
            fetch(p + linear_name(n, l.slot) + ".weight", {l.out, l.in}, Role::kMatrix, l.in);
    for (const LayerLinear& l : linears)
      if (l.present && l.bias && linear_block(l.slot) == b)
        L.*slot_bias_member(l.slot) =
            fetch(p + linear_name(n, l.slot) + ".bias", {l.out}, Role::kVector, -1);
  };
  block(LinearBlock::kAttention, n.attn_norm, L.attn_norm, L.attn_norm_bias);
  block(LinearBlock::kMlp, n.mlp_norm, L.mlp_norm, L.mlp_norm_bias);
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
    w.final_norm = fetch(n.final_norm + ".weight", {h}, Role::kVector, 0);
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
    // split matrix): the layer no longer reads it.
    const auto used = [&](const std::unique_ptr<OwnedTensor>& t) {
      for (const Tensor* m : {&L.attn_norm, &L.attn_norm_bias, &L.q, &L.k, &L.v, &L.o, &L.q_bias,
                              &L.k_bias, &L.v_bias, &L.o_bias, &L.mlp_norm, &L.mlp_norm_bias,
                              &L.gate, &L.up, &L.down, &L.up_bias, &L.down_bias})
        if (m->data != nullptr && m->data == t->view.data) return true;
      return false;
    };
    owned.erase(std::remove_if(owned.begin() + static_cast<std::ptrdiff_t>(mark), owned.end(),
                               [&](const auto& t) { return !used(t); }),
                owned.end());
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
  for (Tensor* t : {&L.q, &L.k, &L.v, &L.q_bias, &L.k_bias, &L.v_bias, &L.gate, &L.up, &L.up_bias})
    *t = shard_rows(*t, i, d, owned);
  for (Tensor* t : {&L.o, &L.down}) *t = shard_columns(*t, i, d, owned);
  if (i != 0) L.o_bias = L.down_bias = Tensor{};
}

int64_t ModelWeights::matrix_bytes() const {
  int64_t total = static_cast<int64_t>(embed.bytes() + positions.bytes() + project_in.bytes() +
                                       project_out.bytes());
  if (lm_head.data != embed.data) total += static_cast<int64_t>(lm_head.bytes());
  for (const LayerWeights& L : layers) {
    for (const Tensor* t : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down})
      total += static_cast<int64_t>(t->bytes());
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

ModelWeights load_checkpoint_weights(const ModelConfig& config, const std::string& dir,
                                     const LayerSink& sink, const WeightParts& parts,
                                     const CheckpointOptions& options) {
  auto archive =
      std::make_shared<SafetensorsArchive>(SafetensorsArchive::open_dir(dir, options.limits));
  NameTable names = llama_names();
  if (config.family == ModelFamily::kOpt) {
    const bool prefixed = archive->find("model.decoder.embed_tokens.weight").tensor != nullptr;
    names = opt_names(prefixed ? "model." : "");
  }
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
    if (role == Role::kMatrix || view.dtype == DType::kF32) return view;
    Tensor f = own(w, DType::kF32, expected);
    convert_to_f32(view.dtype, view.data, f.as<float>(), static_cast<size_t>(expected.numel()));
    return f;
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
  FetchFn fetch = [&](const std::string& name, Shape expected, Role role,
                      int64_t fan_in) -> Tensor {
    Tensor t = own(w, role == Role::kMatrix ? config.dtype : DType::kF32, expected);
    fill_dummy_tensor(seed, name, fan_in, t);
    return t;
  };
  const NameTable names = config.family == ModelFamily::kOpt ? opt_names("model.") : llama_names();
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
      return nullptr;  // gate has no bias in any family
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
