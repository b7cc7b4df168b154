#!/usr/bin/python3
"""Float64 NumPy forward of a Hugging Face llama / mistral / qwen2 / qwen3 / phi3 / gemma2 / mixtral /
qwen2_moe / olmoe / qwen3_moe folder.

  reference_forward.py --model DIR --ids "1 2 3 ..." [--new 32] [--q4] [--logits-out F] [--json-out F]

Reads config.json and model.safetensors (or the shards of model.safetensors.index.json) and
computes what transformers' modeling_<family>.py computes with eager attention, in float64:
  --logits-out F  raw little-endian float32 logits of every prompt position, [n_prompt, vocab]
                  (the layout of `strata score --ids ... --logits-out`);
  --json-out F    {"greedy": [--new ids, argmax (first index on ties) each step],
                   "logits_std": std of the prompt logits}.
Greedy decoding recomputes the whole sequence at every step, which is also what HF does for
phi3 when the length first crosses original_max_position_embeddings (see rope_for()).
Any config field or value it does not implement makes it exit with status 2 and a message.
  --q4            run the same forward on weights round-tripped through Strata's 4-bit
                  group-wise compression (`--policy ...,cw=1`); see q4_roundtrip() and
                  q4_compress_weights() for the format and for which tensors it covers.

Semantics, with the HF source they come from (transformers 4.45-4.5x; file names under
src/transformers/):
  * RMSNorm (models/llama/modeling_llama.py LlamaRMSNorm): x * rsqrt(mean(x^2) + eps) * w,
    computed in f32 in HF; gemma2 (models/gemma2/modeling_gemma2.py Gemma2RMSNorm):
    x * rsqrt(mean(x^2) + eps) * (1 + w).
  * RoPE rotate-half (apply_rotary_pos_emb/rotate_half): q*cos + rotate_half(q)*sin with
    emb = cat(freqs, freqs); phi3 rotates only the first head_dim*partial_rotary_factor dims.
    inv_freq from modeling_rope_utils.py: default, linear (inv_freq/factor), llama3 (3 bands by
    wavelength), longrope (phi3; see rope_for()).
  * Attention (eager_attention_forward): GQA via repeat_kv (query head h uses KV head
    h // (heads/kv_heads)), scale head_dim**-0.5 (gemma2: query_pre_attn_scalar**-0.5),
    gemma2 softcap tanh(s/cap)*cap BEFORE the mask, softmax.
  * Sliding window (masking_utils.py sliding_window_overlay: kv_idx > q_idx - sliding_window,
    and causal kv_idx <= q_idx): query i sees keys j with 0 <= i - j < window, i.e. `window`
    keys including itself. Same rule in the pre-masking_utils code (modeling_mistral.py
    `arange(target) <= cache_position - sliding_window` masked; modeling_gemma2.py
    `tril(ones, diagonal=-sliding_window)` masked). Which layers: mistral and phi3 every layer
    when sliding_window is set; qwen2/qwen3 only with use_sliding_window and layer index
    >= max_window_layers (configuration_qwen2.py layer_types); gemma2 the even layers 0, 2, ...
    (modeling_gemma2.py `is_sliding = not bool(layer_idx % 2)`; configuration_gemma2.py
    layer_types "sliding_attention" if (i + 1) % 2). A config's layer_types overrides these.
  * gemma2: embeddings times sqrt(hidden) rounded to the model dtype first
    (`torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)`), sandwich norms around
    attention and MLP, gelu_pytorch_tanh GeGLU, final logit softcap, tied head.
  * qwen2: q/k/v biases (o_proj none); qwen3: q_norm/k_norm (RMSNorm over head_dim) per head
    before RoPE; llama: attention_bias (q,k,v,o) and mlp_bias.
  * phi3: fused qkv_proj rows [q | k | v], gate_up_proj rows [gate | up], up * silu(gate).
  * Mixture of experts (models/mixtral/modeling_mixtral.py MixtralSparseMoeBlock,
    qwen2_moe/modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock, olmoe/modeling_olmoe.py
    OlmoeSparseMoeBlock, qwen3_moe/modeling_qwen3_moe.py Qwen3MoeSparseMoeBlock), per token:
    router logits = x @ gate^T over all E experts; p = softmax(logits) (float); the k experts
    of largest p (torch.topk; ties: lowest index first); their weights p_k, divided by their
    sum where the top-k is renormalised (mixtral always, the others with norm_topk_prob);
    out = sum_k w_k * down_k(silu(gate_k(x)) * up_k(x)). qwen2_moe adds
    sigmoid(x @ shared_expert_gate^T) * shared_expert(x) (a SwiGLU MLP of
    shared_expert_intermediate_size). Every layer is a MoE layer: decoder_sparse_step != 1 or
    a non-empty mlp_only_layers is refused.
  * olmoe (OlmoeAttention): q_norm / k_norm are RMSNorms over the whole q and k projections
    (widths heads * head_dim and kv_heads * head_dim, head_dim = hidden / heads) before they are
    split into heads and rotated; clip_qkv, when set, clamps q, k (after their norms) and v to
    [-clip_qkv, clip_qkv]. qwen3_moe: qwen3's per-head q_norm / k_norm. qwen2_moe: qwen2's
    q/k/v biases. mixtral: llama attention, mistral's sliding window rule.
"""
import argparse
import json
import math
import os
import re
import sys

import numpy as np


class Unsupported(Exception):
    """A config field, value or checkpoint layout this reference does not implement."""


# ----------------------------------------------------------------------------- safetensors

ST_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def read_safetensors(path):
    """{name: float64 array} of one .safetensors file (F32, F16, BF16, F64)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[b:e]
        if info["dtype"] == "BF16":  # bf16 = the high half of an f32
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in ST_DTYPES:
            a = np.frombuffer(raw, dtype=ST_DTYPES[info["dtype"]])
        else:
            raise Unsupported(f"{path}: tensor {name} has dtype {info['dtype']}")
        out[name] = a.astype(np.float64).reshape(info["shape"])
    return out


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for fname in files:
        weights.update(read_safetensors(os.path.join(model_dir, fname)))
    return weights


# ----------------------------------------------------------------------------- 4-bit weights (--q4)
#
# Strata's compress_weight (FlexGen's group-wise asymmetric 4-bit quantisation), rewritten here
# from its definition in kernels/quant.h / kernels/quant.cpp (group_stats, encode, decode) and
# not from its code:
#   * groups of Q4_GROUP = 64 (kQuantGroupSize) consecutive elements of one row of a row-major
#     [out, in] matrix, i.e. along the input width (QuantAxis::kAlongRow; quant.h explains why
#     this is per output channel rather than FlexGen's literal strided group_dim=0);
#   * per group, in f32: min = min(x), scale = (max(x) - min) / 15 (kQuantLevels);
#   * code q = clamp(nearbyint((x - min) / scale), 0, 15), each of x - min and the division
#     rounded to f32, nearbyint in the default mode (ties to even); a group with max == min
#     has scale 0 and every code 0, so it decodes exactly to min;
#   * min and scale are stored as f32 (not FlexGen's f16), so the decode
#     x' = fma(q, scale, min) (one rounding to f32, quant.cpp decode()) is all that is lost;
#   * a non-finite value, or a range that overflows f32, makes Strata refuse the model
#     (quantize_rows -> fail_group: InputError); here that is Unsupported.
# The input is the weight as the loader's convert_to_f32 gives it (exact for F32 / F16 / BF16
# checkpoints), so the f64 tensors read above are first rounded to f32, which is a no-op for
# those dtypes.

Q4_GROUP = 64   # kernels/quant.h kQuantGroupSize
Q4_LEVELS = 15  # kernels/quant.h kQuantLevels (2^4 - 1)


def f32_fma(a, b, c):
    """Correctly rounded float32 a * b + c for float32 arrays whose products a * b are exact in
    f64 (here a is a 4-bit code, so a * b has at most 28 significant bits).

    The f64 sum is made round-to-odd (TwoSum's exact error decides whether to step the last
    bit), after which the rounding to f32 is correct: 53 >= 2 * 24 + 2 bits.
    """
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)  # TwoSum: s + err == p + c exactly
    even = (s.view(np.int64) & 1) == 0
    bump = (err != 0) & even
    s = np.where(bump, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def q4_roundtrip(w):
    """dequantise(quantise(w)) of one [rows, cols] matrix, cols a multiple of Q4_GROUP, in f32."""
    x = np.asarray(w, dtype=np.float32)
    rows, cols = x.shape
    if cols % Q4_GROUP or cols % 2:
        raise ValueError(f"q4_roundtrip of [{rows}, {cols}]: columns are not whole groups")
    g = x.reshape(rows, cols // Q4_GROUP, Q4_GROUP)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        mn = g.min(axis=-1, keepdims=True)
        mx = g.max(axis=-1, keepdims=True)
        scale = (mx - mn) / np.float32(Q4_LEVELS)  # f32 - f32, then / f32
        if not (np.isfinite(g).all() and np.isfinite(scale).all()):
            raise Unsupported(f"4-bit compression of a [{rows}, {cols}] matrix: a group holds a "
                              "non-finite value or a range beyond f32 (Strata refuses it)")
        q = np.rint((g - mn) / scale)  # nan where scale == 0: replaced just below
    q = np.where(scale == 0, np.float32(0), np.clip(q, 0, Q4_LEVELS)).astype(np.float32)
    return f32_fma(q, np.broadcast_to(scale, q.shape), np.broadcast_to(mn, q.shape)).reshape(rows, cols)


# The layer matrices of worker/weights.cpp's NameTable for these families (LinearSlot q, k, v, o,
# gate, up, down) and Phi-3's fused ones, plus the matrices outside the layers.
Q4_LAYER_MATRIX = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.o_proj.weight", "self_attn.qkv_proj.weight", "mlp.gate_proj.weight",
                   "mlp.up_proj.weight", "mlp.down_proj.weight", "mlp.gate_up_proj.weight")
Q4_FIXED_MATRIX = ("model.embed_tokens.weight", "lm_head.weight")
# The MoE layers' matrices that convert_layer compresses: Qwen2-MoE's shared expert (the
# NameTable's gate/up/down slots) and every expert's gate/up/down (kExpertMembers). The router
# (mlp.gate / block_sparse_moe.gate) stays as stored ("its top-k picks experts"), and so does
# Qwen2-MoE's shared_expert_gate (a [1, hidden] vector).
Q4_MOE_LAYER_MATRIX = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                       "mlp.shared_expert.down_proj.weight")
Q4_EXPERT_MATRIX = re.compile(r"(block_sparse_moe\.experts\.\d+\.w[123]|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight")


def q4_compress_weights(weights):
    """The weights as Strata holds them under compress_weight (cw=1); returns (weights, names).

    Which tensors (worker/loader.cpp compress_layer / compress_fixed / compress_matrix,
    placement/layer_linears.cpp compressible / stored_dtype):
      * compress_layer: every linear matrix of every layer whose `in` (columns) is a whole
        number of groups (compressible(in): in % 64 == 0); the others (e.g. down_proj with an
        intermediate size of 96) stay as they are. In a MoE layer that is every expert's
        gate / up / down and Qwen2-MoE's shared expert, not the router nor shared_expert_gate
        (loader.cpp convert_layer). Phi-3's fused qkv_proj / gate_up_proj are
        split by rows into q/k/v and gate/up views before compression (weights.cpp
        fetch_fused); groups run along `in`, inside one row, so a row split changes no group
        and the fused matrix is round-tripped here whole.
      * compress_fixed (convert_fixed with embedding = true): the embedding table and an
        untied lm_head, each under the same compressible(in) rule (in = hidden). A tied head
        IS the embedding (lm_head = embed after compressing it), so the head of a tied model
        uses the same 4-bit table. The embedding is then looked up from the 4-bit table: a
        token's row is dequantised as it is read (kernels/cpu_backend.cpp
        CpuBackend::embedding, dequantize_one_row); Gemma-2's sqrt(hidden) scale applies
        after the lookup (transformer.cpp embed_scale), as in the plain forward.
      * norms (Gemma-2's (1 + w) ones included), q_norm / k_norm and biases: untouched (f32).
    (Strata has no project_in / project_out for these families.)
    """
    out, names = dict(weights), []
    for name, w in weights.items():
        suffix = name.split(".", 3)[-1]
        layer = name.startswith("model.layers.") and (
            suffix in Q4_LAYER_MATRIX or suffix in Q4_MOE_LAYER_MATRIX or Q4_EXPERT_MATRIX.fullmatch(suffix))
        if not (layer or name in Q4_FIXED_MATRIX):
            continue
        if w.ndim != 2 or w.shape[1] % Q4_GROUP:  # compressible(in)
            continue
        out[name] = q4_roundtrip(w).astype(np.float64)
        names.append(name)
    return out, sorted(names)


# ----------------------------------------------------------------------------- config

# Fields every family accepts: the sizes the forward reads, and those with no effect on an
# inference forward of one unpadded sequence (dropouts, init, cache, token ids).
COMMON = {"architectures", "model_type", "torch_dtype", "transformers_version", "use_cache",
          "initializer_range", "attention_dropout", "bos_token_id", "eos_token_id",
          "pad_token_id", "_name_or_path", "tie_word_embeddings", "vocab_size", "hidden_size",
          "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
          "hidden_act"}

# Per family: extra fields implemented, and HF's class defaults for those the forward reads
# (configuration_<family>.py), used when config.json leaves a field out.
FAMILY = {
    "llama": {"arch": "LlamaForCausalLM", "fields": {"attention_bias", "mlp_bias", "pretraining_tp"},
              "defaults": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}},
    "mistral": {"arch": "MistralForCausalLM", "fields": {"sliding_window"},
                "defaults": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096}},
    "qwen2": {"arch": "Qwen2ForCausalLM",
              "fields": {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "use_mrope"},
              "defaults": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096,
                           "use_sliding_window": False, "max_window_layers": 28}},
    "qwen3": {"arch": "Qwen3ForCausalLM",
              "fields": {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                         "layer_types"},
              "defaults": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096,
                           "use_sliding_window": False, "max_window_layers": 28}},
    "phi3": {"arch": "Phi3ForCausalLM",
             "fields": {"attention_bias", "sliding_window", "original_max_position_embeddings",
                        "partial_rotary_factor", "embd_pdrop", "resid_pdrop"},
             "defaults": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
                          "original_max_position_embeddings": 4096}},
    "gemma2": {"arch": "Gemma2ForCausalLM",
               "fields": {"attention_bias", "sliding_window", "layer_types", "query_pre_attn_scalar",
                          "attn_logit_softcapping", "final_logit_softcapping", "hidden_activation",
                          "cache_implementation"},
               "defaults": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 4096,
                            "head_dim": 256, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                            "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}},
    # The MoE families (configuration_mixtral.py, configuration_qwen2_moe.py,
    # configuration_olmoe.py, configuration_qwen3_moe.py). The router's training-only fields
    # (router_aux_loss_coef, output_router_logits, router_jitter_noise: jitter only in
    # training) change nothing here.
    "mixtral": {"arch": "MixtralForCausalLM",
                "fields": {"sliding_window", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                           "output_router_logits", "router_jitter_noise"},
                "defaults": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
                             "num_local_experts": 8, "num_experts_per_tok": 2}},
    "qwen2_moe": {"arch": "Qwen2MoeForCausalLM",
                  "fields": {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                             "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                             "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"},
                  "defaults": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096,
                               "use_sliding_window": False, "max_window_layers": 28, "num_experts": 60,
                               "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                               "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                               "decoder_sparse_step": 1}},
    "olmoe": {"arch": "OlmoeForCausalLM",
              "fields": {"attention_bias", "clip_qkv", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                         "router_aux_loss_coef", "output_router_logits"},
              "defaults": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_experts": 64,
                           "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None}},
    "qwen3_moe": {"arch": "Qwen3MoeForCausalLM",
                  "fields": {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                             "layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                             "output_router_logits"},
                  "defaults": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096,
                               "use_sliding_window": False, "max_window_layers": 28, "num_experts": 128,
                               "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                               "decoder_sparse_step": 1}},
}
MOE = {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe"}


def get(cfg, key):
    """config.json's value, else HF's class default for the family (None when neither)."""
    if key in cfg:
        return cfg[key]
    return FAMILY[cfg["model_type"]]["defaults"].get(key)


def check_config(cfg):
    """Raise Unsupported for anything outside what the forward below implements."""
    family = cfg.get("model_type")
    if family not in FAMILY:
        raise Unsupported(f"model_type {family!r} (supported: {', '.join(FAMILY)})")
    spec = FAMILY[family]
    unknown = sorted(set(cfg) - COMMON - spec["fields"])
    if unknown:
        raise Unsupported(f"{family}: config field(s) not implemented: {', '.join(unknown)}")
    if cfg.get("architectures", [spec["arch"]]) != [spec["arch"]]:
        raise Unsupported(f"architectures {cfg['architectures']} (expected [{spec['arch']}])")
    check_values(cfg, family)
    check_rope_scaling(cfg, family)


def check_values(cfg, family):
    act = "gelu_pytorch_tanh" if family == "gemma2" else "silu"
    if family == "gemma2":
        if get(cfg, "hidden_activation") != act or cfg.get("hidden_act", act) != act:
            raise Unsupported("gemma2: hidden_activation/hidden_act other than gelu_pytorch_tanh")
    elif cfg.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("pretraining_tp", 1) != 1:
        raise Unsupported("pretraining_tp != 1")
    if cfg.get("use_mrope", False):
        raise Unsupported("qwen2: use_mrope")
    if family == "phi3" and cfg.get("attention_bias", False):
        raise Unsupported("phi3: attention_bias (Phi3Attention ignores it; ambiguous)")
    for key in ("embd_pdrop", "resid_pdrop", "attention_dropout"):
        if not isinstance(cfg.get(key, 0.0), (int, float)):
            raise Unsupported(f"{key} is not a number")
    for t in cfg.get("layer_types") or []:
        if t not in ("full_attention", "sliding_attention"):
            raise Unsupported(f"layer_types entry {t!r}")
    if cfg.get("layer_types") is not None and len(cfg["layer_types"]) != cfg["num_hidden_layers"]:
        raise Unsupported("layer_types length != num_hidden_layers")
    prf = cfg.get("partial_rotary_factor", 1.0)
    if not 0.0 < prf <= 1.0:
        raise Unsupported(f"partial_rotary_factor {prf}")
    if family in MOE:
        check_moe(cfg, family)


def check_moe(cfg, family):
    e, k = n_experts(cfg), get(cfg, "num_experts_per_tok")
    if not (isinstance(e, int) and isinstance(k, int) and 1 <= k <= e):
        raise Unsupported(f"{family}: num_experts_per_tok {k} must be in [1, {e}] experts")
    # Qwen MoE: layer i is a MoE layer iff i not in mlp_only_layers and (i + 1) % step == 0;
    # a dense layer (mlp.gate_proj of intermediate_size) is not implemented here.
    if get(cfg, "decoder_sparse_step") not in (None, 1):
        raise Unsupported(f"{family}: decoder_sparse_step {cfg['decoder_sparse_step']} (only 1: every layer MoE)")
    if cfg.get("mlp_only_layers"):
        raise Unsupported(f"{family}: mlp_only_layers {cfg['mlp_only_layers']} (only []: every layer MoE)")
    if family == "olmoe":
        # OlmoeAttention: head_dim = hidden / heads whatever the config says.
        if cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"]):
            raise Unsupported("olmoe: head_dim other than hidden_size / num_attention_heads")
        clip = get(cfg, "clip_qkv")
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
            raise Unsupported(f"olmoe: clip_qkv {clip!r}")


def n_experts(cfg):
    return get(cfg, "num_local_experts" if cfg["model_type"] == "mixtral" else "num_experts")


def norm_topk(cfg):
    """Whether the top-k weights are divided by their sum."""
    if cfg["model_type"] == "mixtral":  # MixtralSparseMoeBlock: routing_weights /= sum, always
        return True
    return bool(get(cfg, "norm_topk_prob"))


ROPE_KEYS = {
    "linear": ({"factor"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, set()),
    "longrope": ({"short_factor", "long_factor"}, {"factor", "attention_factor", "original_max_position_embeddings"}),
}
_ROPE_COMMON = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "olmoe", "qwen3_moe"}
ROPE_FAMILIES = {"linear": _ROPE_COMMON, "llama3": _ROPE_COMMON, "longrope": {"phi3"}}


def rope_type(cfg):
    rs = cfg.get("rope_scaling")
    if rs is None:
        return "default"
    return rs.get("rope_type", rs.get("type", "default"))  # BC: "type" was the old key


def check_rope_scaling(cfg, family):
    rs, kind = cfg.get("rope_scaling"), rope_type(cfg)
    if rs is None or kind == "default":
        if rs is not None and set(rs) - {"rope_type", "type"}:
            raise Unsupported(f"rope_scaling {rs}")
        return
    if kind not in ROPE_KEYS or family not in ROPE_FAMILIES[kind]:
        raise Unsupported(f"{family}: rope_scaling type {kind!r}")
    required, optional = ROPE_KEYS[kind]
    keys = set(rs) - {"rope_type", "type"}
    if required - keys or keys - required - optional:
        raise Unsupported(f"rope_scaling {kind}: keys {sorted(keys)} (need {sorted(required)})")
    if kind == "longrope":
        half = rotary_dim(cfg) // 2
        if len(rs["short_factor"]) != half or len(rs["long_factor"]) != half:
            raise Unsupported(f"longrope factors must have rotary_dim/2 = {half} entries")
        if "original_max_position_embeddings" in rs:
            raise Unsupported("longrope original_max_position_embeddings inside rope_scaling (v5 layout)")


def bias_layout(cfg):
    """(attention projections with a bias, MLP has biases), as each modeling file builds them."""
    family = cfg["model_type"]
    if family in ("qwen2", "qwen2_moe"):  # Qwen2(Moe)Attention: q/k/v bias=True, o_proj bias=False
        return {"q", "k", "v"}, False
    if family in ("llama", "qwen3", "gemma2", "qwen3_moe", "olmoe") and cfg.get("attention_bias", False):
        return {"q", "k", "v", "o"}, bool(cfg.get("mlp_bias", False))
    return set(), bool(cfg.get("mlp_bias", False))  # mistral, phi3, mixtral: no biases


def head_dim(cfg):
    return get(cfg, "head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def rotary_dim(cfg):
    # phi3 only (Phi3 apply_rotary_pos_emb splits q into rot | pass); 1.0 elsewhere.
    return int(head_dim(cfg) * cfg.get("partial_rotary_factor", 1.0))


def sliding_layers(cfg):
    """Per layer: the window size, or None for full causal attention."""
    family, n = cfg["model_type"], cfg["num_hidden_layers"]
    window = get(cfg, "sliding_window")
    if family in ("llama", "olmoe") or window is None:
        return [None] * n
    if cfg.get("layer_types") is not None:
        kinds = cfg["layer_types"]
    elif family in ("mistral", "phi3", "mixtral"):  # one mask for every layer (create_sliding_window_causal_mask)
        kinds = ["sliding_attention"] * n
    elif family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):  # configuration_qwen2.py: use_sliding_window and i >= max_window_layers
        on = bool(get(cfg, "use_sliding_window"))
        kinds = ["sliding_attention" if on and i >= get(cfg, "max_window_layers") else "full_attention"
                 for i in range(n)]
    else:  # gemma2: layers 0, 2, 4, ... slide (modeling_gemma2.py is_sliding = not bool(layer_idx % 2))
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return [window if k == "sliding_attention" else None for k in kinds]


# ----------------------------------------------------------------------------- rope

def default_inv_freq(cfg):
    dim = rotary_dim(cfg)
    base = float(cfg.get("rope_theta", 10000.0))
    return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def llama3_inv_freq(cfg):
    """modeling_rope_utils.py _compute_llama3_parameters."""
    rs, inv = cfg["rope_scaling"], default_inv_freq(cfg)
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > low_wavelen, inv / factor, inv)  # long wavelengths: interpolate
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, out)


def longrope_params(cfg, seq_len):
    """modeling_rope_utils.py _compute_longrope_parameters + dynamic_rope_update.

    Phi3Config always has original_max_position_embeddings (default 4096, outside
    rope_scaling); then factor = max_position_embeddings / original_max_position_embeddings
    (rope_scaling's own "factor" is ignored) and the cos/sin scale is
    sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1), unless rope_scaling gives
    attention_factor. The long factors are used when the sequence length (max position id + 1)
    exceeds original_max_position_embeddings, else the short ones (dynamic_rope_update's
    longrope_frequency_update).
    """
    rs = cfg["rope_scaling"]
    original = get(cfg, "original_max_position_embeddings")
    factor = cfg["max_position_embeddings"] / original
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(rs["long_factor"] if seq_len > original else rs["short_factor"], dtype=np.float64)
    dim = rotary_dim(cfg)
    base = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (ext * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    return inv, attention


def rope_for(cfg, seq_len):
    """(cos, sin) of shape [seq_len, rotary_dim] for positions 0..seq_len-1.

    seq_len matters only for longrope; HF's Phi3ForCausalLM.prepare_inputs_for_generation drops
    the cache when the length first passes original_max_position_embeddings, so a full
    recompute at every step reproduces what generate() does.
    """
    kind, scale = rope_type(cfg), 1.0
    if kind == "default":
        inv = default_inv_freq(cfg)
    elif kind == "linear":
        inv = default_inv_freq(cfg) / cfg["rope_scaling"]["factor"]
    elif kind == "llama3":
        inv = llama3_inv_freq(cfg)
    else:
        inv, scale = longrope_params(cfg, seq_len)
    freqs = np.arange(seq_len, dtype=np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb) * scale, np.sin(emb) * scale


def apply_rope(x, cos, sin):
    """x [heads, n, head_dim]; rotate-half on the first cos.shape[-1] dims, pass the rest."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([rot * cos + rotated * sin, rest], axis=-1)


# ----------------------------------------------------------------------------- blocks

def rms_norm(x, w, eps, gemma):
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed * ((1.0 + w) if gemma else w)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return np.exp(-np.logaddexp(0.0, -x))  # 1 / (1 + e^-x) without overflow


def gelu_tanh(x):
    # ACT2FN["gelu_pytorch_tanh"]: tanh approximation of GELU.
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def model_dtype_round(value, cfg):
    """A Python float as torch.tensor(value, dtype=model dtype) would hold it."""
    dtype = cfg.get("torch_dtype", "float32")
    f32 = np.float32(value)
    if dtype == "bfloat16":
        u = int(f32.view(np.uint32))
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return float(np.uint32(u).view(np.float32))
    if dtype == "float16":
        return float(np.float16(value))
    return float(f32)


class Model:
    """Weights of one checkpoint, keyed by HF names, plus the forward of its family."""

    def __init__(self, cfg, weights):
        check_config(cfg)
        self.cfg, self.w = cfg, weights
        self.family = cfg["model_type"]
        self.gemma = self.family == "gemma2"
        self.eps = get(cfg, "rms_norm_eps")
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = head_dim(cfg)
        self.windows = sliding_layers(cfg)
        self.attn_bias, self.mlp_bias = bias_layout(cfg)
        self.used = set()
        self.routing = []  # MoE, of the last forward: per layer {"chosen": [n, k], "margin": [n]}
        self.head = self.lm_head_weight()

    def t(self, name):
        if name not in self.w:
            raise Unsupported(f"checkpoint has no tensor {name}")
        self.used.add(name)
        return self.w[name]

    def bias(self, module, expected):
        """module.bias when the config says the module has one (else any is reported unused)."""
        return self.t(module + ".bias") if expected else None

    def lm_head_weight(self):
        if get(self.cfg, "tie_word_embeddings"):
            if "lm_head.weight" in self.w:
                raise Unsupported("tie_word_embeddings with an lm_head.weight in the checkpoint (ambiguous)")
            return self.t("model.embed_tokens.weight")
        return self.t("lm_head.weight")

    def check_all_used(self):
        unused = sorted(set(self.w) - self.used)
        if unused:
            raise Unsupported(f"checkpoint tensors the {self.family} forward does not use: {unused[:5]}")

    # -- attention

    def qkv(self, p, x):
        """Projections, as [heads, n, head_dim] each."""
        d, n = self.head_dim, x.shape[0]
        if self.family == "phi3":  # Phi3Attention: qkv_proj rows q | k | v
            fused = linear(x, self.t(p + "qkv_proj.weight"))
            q_w, kv_w = self.heads * d, self.kv_heads * d
            q, k, v = fused[:, :q_w], fused[:, q_w:q_w + kv_w], fused[:, q_w + kv_w:]
        else:
            q, k, v = (linear(x, self.t(p + f"{m}_proj.weight"), self.bias(p + f"{m}_proj", m in self.attn_bias))
                       for m in "qkv")
        if self.family == "olmoe":  # OlmoeAttention: RMSNorm over the whole projections, then clip
            q = rms_norm(q, self.t(p + "q_norm.weight"), self.eps, False)
            k = rms_norm(k, self.t(p + "k_norm.weight"), self.eps, False)
            clip = get(self.cfg, "clip_qkv")
            if clip is not None:
                q, k, v = (np.clip(a, -clip, clip) for a in (q, k, v))
        q, k, v = (a.reshape(n, -1, d).transpose(1, 0, 2) for a in (q, k, v))
        if self.family in ("qwen3", "qwen3_moe"):  # Qwen3(Moe)Attention: per-head RMSNorm over head_dim, before RoPE
            q = rms_norm(q, self.t(p + "q_norm.weight"), self.eps, False)
            k = rms_norm(k, self.t(p + "k_norm.weight"), self.eps, False)
        return q, k, v

    def scores(self, q, k, window):
        """Masked, softcapped attention logits [heads, n, n]."""
        n = q.shape[1]
        k = np.repeat(k, self.heads // self.kv_heads, axis=0)  # repeat_kv: head h -> kv h // n_rep
        scale = (get(self.cfg, "query_pre_attn_scalar") if self.gemma else self.head_dim) ** -0.5
        s = q @ k.transpose(0, 2, 1) * scale
        cap = get(self.cfg, "attn_logit_softcapping") if self.gemma else None
        if cap is not None:
            s = np.tanh(s / cap) * cap  # eager_attention_forward: softcap before the mask
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = j <= i
        if window is not None:
            allowed &= (i - j) < window  # masking_utils.sliding_window_overlay
        return np.where(allowed[None], s, -np.inf)

    def attention(self, p, x, cos, sin, window):
        q, k, v = self.qkv(p, x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        s = self.scores(q, k, window)
        prob = np.exp(s - s.max(axis=-1, keepdims=True))
        prob /= prob.sum(axis=-1, keepdims=True)
        v = np.repeat(v, self.heads // self.kv_heads, axis=0)
        out = (prob @ v).transpose(1, 0, 2).reshape(x.shape[0], -1)
        return linear(out, self.t(p + "o_proj.weight"), self.bias(p + "o_proj", "o" in self.attn_bias))

    # -- MLP

    def swiglu(self, p, x, names=("gate_proj", "up_proj", "down_proj")):
        gate, up, down = (self.t(p + m + ".weight") for m in names)
        return linear(silu(linear(x, gate)) * linear(x, up), down)

    def route(self, logits):
        """(experts [n, k], weights [n, k]) of router logits [n, E], as the Sparse MoE blocks do:
        softmax over all E (in float), top-k of the probabilities, renormalised if so configured."""
        prob = np.exp(logits - logits.max(axis=-1, keepdims=True))
        prob /= prob.sum(axis=-1, keepdims=True)
        k = get(self.cfg, "num_experts_per_tok")
        # torch.topk: the k largest, in descending order; on equal values the lower index first
        # (a stable sort of -p gives that order).
        order = np.argsort(-prob, axis=-1, kind="stable")
        chosen = order[:, :k]
        weights = np.take_along_axis(prob, chosen, axis=-1)
        ranked = np.take_along_axis(logits, order, axis=-1)
        # kept for selfcheck.py: how near each token came to choosing other experts (the router
        # logit gap between its k-th and (k+1)-th expert, log p_k - log p_k+1)
        self.routing.append({"chosen": chosen, "margin": ranked[:, k - 1] - ranked[:, k] if k < prob.shape[1]
                             else np.full(prob.shape[0], np.inf)})
        if norm_topk(self.cfg):
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return chosen, weights

    def moe(self, p, x):
        """The sparse MoE block of one layer (p: the layer's prefix) on x [n, hidden]."""
        if self.family == "mixtral":
            router, experts, names = p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.experts.", ("w1", "w3", "w2")
        else:
            router, experts, names = p + "mlp.gate.weight", p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj")
        chosen, weights = self.route(linear(x, self.t(router)))
        out = np.zeros_like(x)
        for j in range(n_experts(self.cfg)):
            rows, slot = np.nonzero(chosen == j)
            # every expert's tensors are read (and so "used") even when no token picks it
            e = self.swiglu(f"{experts}{j}.", x[rows], names)
            out[rows] += weights[rows, slot][:, None] * e
        if self.family == "qwen2_moe":  # Qwen2MoeSparseMoeBlock: + sigmoid(gate) * shared_expert
            shared_gate = linear(x, self.t(p + "mlp.shared_expert_gate.weight"))
            out = out + sigmoid(shared_gate) * self.swiglu(p + "mlp.shared_expert.", x)
        return out

    def mlp(self, p, x):
        if self.family == "phi3":  # Phi3MLP: gate, up = gate_up_proj(x).chunk(2)
            gate, up = np.split(linear(x, self.t(p + "gate_up_proj.weight")), 2, axis=-1)
            return linear(up * silu(gate), self.t(p + "down_proj.weight"))
        act = gelu_tanh if self.gemma else silu
        gate = linear(x, self.t(p + "gate_proj.weight"), self.bias(p + "gate_proj", self.mlp_bias))
        up = linear(x, self.t(p + "up_proj.weight"), self.bias(p + "up_proj", self.mlp_bias))
        return linear(act(gate) * up, self.t(p + "down_proj.weight"), self.bias(p + "down_proj", self.mlp_bias))

    # -- layers

    def norm(self, name, x):
        return rms_norm(x, self.t(name), self.eps, self.gemma)

    def layer(self, n, x, cos, sin):
        p = f"model.layers.{n}."
        attn = self.attention(p + "self_attn.", self.norm(p + "input_layernorm.weight", x), cos, sin,
                              self.windows[n])
        if self.gemma:  # Gemma2DecoderLayer: post-attention and pre/post-feedforward norms
            x = x + self.norm(p + "post_attention_layernorm.weight", attn)
            ff = self.mlp(p + "mlp.", self.norm(p + "pre_feedforward_layernorm.weight", x))
            return x + self.norm(p + "post_feedforward_layernorm.weight", ff)
        x = x + attn
        h = self.norm(p + "post_attention_layernorm.weight", x)
        return x + (self.moe(p, h) if self.family in MOE else self.mlp(p + "mlp.", h))

    def embed(self, ids):
        table = self.t("model.embed_tokens.weight")
        if min(ids) < 0 or max(ids) >= table.shape[0]:
            raise Unsupported(f"token id outside the vocabulary [0, {table.shape[0]})")
        x = table[np.asarray(ids)]
        if self.gemma:  # Gemma2Model: normalizer = torch.tensor(hidden**0.5, dtype=model dtype)
            x = x * model_dtype_round(self.cfg["hidden_size"] ** 0.5, self.cfg)
        return x

    def forward(self, ids):
        """Logits [len(ids), vocab] of the whole sequence (positions 0..n-1)."""
        x = self.embed(ids)
        self.routing = []
        cos, sin = rope_for(self.cfg, len(ids))
        for n in range(self.cfg["num_hidden_layers"]):
            x = self.layer(n, x, cos, sin)
        logits = self.norm("model.norm.weight", x) @ self.head.T
        cap = get(self.cfg, "final_logit_softcapping") if self.gemma else None
        if cap is not None:
            logits = np.tanh(logits / cap) * cap
        return logits

    def greedy(self, ids, n_new):
        seq, out = list(ids), []
        for _ in range(n_new):
            nxt = int(np.argmax(self.forward(seq)[-1]))  # first index on ties
            out.append(nxt)
            seq.append(nxt)
        return out


def load_model(model_dir, cfg_override=None, q4=False):
    """The model of a folder; q4: its weights as Strata's compress_weight stores them."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg_override:
        cfg.update(cfg_override)
    weights = load_weights(model_dir)
    compressed = []
    if q4:
        check_config(cfg)  # refuse an unsupported config before spending time on it
        weights, compressed = q4_compress_weights(weights)
    model = Model(cfg, weights)
    model.q4_compressed = compressed
    return model


# ----------------------------------------------------------------------------- main

def parse_ids(text):
    ids = [int(t) for t in text.replace(",", " ").split()]
    if not ids:
        raise ValueError("--ids is empty")
    return ids


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--ids", required=True, help='prompt token ids, "1 2 3"')
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--q4", action="store_true",
                   help="weights round-tripped through Strata's 4-bit compression (policy cw=1)")
    p.add_argument("--logits-out")
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    try:
        ids = parse_ids(a.ids)
        model = load_model(a.model, q4=a.q4)
        logits = model.forward(ids)
        model.check_all_used()
        greedy = model.greedy(ids, a.new)
    except (Unsupported, ValueError, KeyError, OSError) as e:
        print(f"reference_forward: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if a.logits_out:
        logits.astype("<f4").tofile(a.logits_out)
    result = {"greedy": greedy, "logits_std": float(np.std(logits))}
    if a.q4:
        result["q4_compressed"] = model.q4_compressed
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f)
            f.write("\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
