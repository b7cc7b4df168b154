#!/usr/bin/python3
"""Write a tiny random Hugging Face-format model of one family (NumPy only).

  make_model.py --family F --out DIR [--seed N] [--shards K] [--dtype float32|bfloat16]
                [--no-rope-scaling]

F is one of llama, mistral, qwen2, qwen3, phi3, gemma2, and the mixture-of-experts families
mixtral, qwen2moe, olmoe, qwen3moe. DIR gets:
  config.json   the fields the family's real Hugging Face config.json carries (as saved by
                transformers 4.4x for Llama-3.2, Mistral-7B, Qwen2.5, Qwen3, Phi-3-128k,
                Gemma-2, Mixtral-8x7B, Qwen1.5-MoE-A2.7B, OLMoE-1B-7B-0924, Qwen3-30B-A3B),
                with tiny sizes;
  model.safetensors, or with --shards K > 1 model-0000i-of-0000K.safetensors and
                model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"});
                tensors under the family's HF names (modeling_<family>.py module paths).

Sizes: hidden 64, 4 heads, 2 KV heads, head_dim 16 (qwen3 and gemma2: 24, so that head_dim
differs from hidden/heads), intermediate 96, 3 layers (gemma2: 4, so sliding/global layers
alternate twice), vocab 256, max_position_embeddings 512. mistral and gemma2 have
sliding_window 16, so a 40-token prompt exceeds it. llama carries a llama3 rope_scaling
(original context 128, so all three wavelength bands of the llama3 rule occur with head_dim 16);
--no-rope-scaling writes rope_scaling null instead. phi3 carries longrope with
original_max_position_embeddings 128.

Mixture-of-experts families (every layer a MoE layer; each expert a SwiGLU MLP
down(silu(gate(x)) * up(x)); the router `gate` [num_experts, hidden]):
  mixtral   num_local_experts 8, num_experts_per_tok 2, intermediate_size 96 (the expert's),
            sliding_window null; block_sparse_moe.gate, block_sparse_moe.experts.{j}.w1 (gate),
            w3 (up), w2 (down); llama attention (4 heads, 2 KV heads, no bias). HF always
            renormalises the top-2 weights.
  qwen2moe  model_type qwen2_moe: num_experts 8, num_experts_per_tok 4, moe_intermediate_size 32,
            shared_expert_intermediate_size 64, intermediate_size 96 (dense layers only: none
            here), norm_topk_prob false, decoder_sparse_step 1, mlp_only_layers []; mlp.gate,
            mlp.experts.{j}.{gate,up,down}_proj, mlp.shared_expert.{gate,up,down}_proj and
            mlp.shared_expert_gate [1, hidden]; Qwen2 attention (q/k/v bias, o none).
  olmoe     num_experts 64, num_experts_per_tok 8, intermediate_size 32 (the expert's),
            norm_topk_prob false, clip_qkv null; self_attn.q_norm [heads * head_dim] and
            k_norm [kv_heads * head_dim] (RMSNorm over the whole projection), mlp.gate,
            mlp.experts.{j}.{gate,up,down}_proj; no bias. num_key_value_heads = 4 = heads, as
            OLMoE-1B-7B has (16 = 16): HF's OlmoeAttention would take GQA (k_norm is
            kv_heads * head_dim wide), but llama.cpp c392e5094's olmoe makes attn_k_norm
            n_embd wide, so GQA could not be cross-checked there.
  qwen3moe  model_type qwen3_moe: num_experts 16, num_experts_per_tok 4, moe_intermediate_size 32,
            intermediate_size 96 (unused), norm_topk_prob true, decoder_sparse_step 1,
            mlp_only_layers [], head_dim 24 (as qwen3); Qwen3 attention (per-head q_norm /
            k_norm [head_dim]); mlp.gate, mlp.experts.{j}.{gate,up,down}_proj.
  The heads are untied (as every one of those checkpoints). Router weights are
  N(0, (ROUTER_GAIN / sqrt(hidden))^2), so the router logits of the RMS-normed input have a
  std of about ROUTER_GAIN (2; olmoe 3): the softmax is neither flat (top-k weights all ~1/E,
  every expert alike) nor one-hot, different tokens pick different experts, and the logit gap
  between the k-th and (k+1)-th expert is far above f32 rounding (selfcheck.py checks its
  minimum over a prompt). Without renormalisation (qwen2moe, olmoe) the top-k weights sum to
  well under 1, so those experts' down projections get a larger gain (MOE_OUT_GAIN) to keep
  the MoE output of the order of the residual stream.

The head is tied (no lm_head.weight) for qwen3 (as Qwen3-0.6B..4B) and gemma2, untied for
the others (qwen2 as Qwen2.5-7B).

Weight scales are chosen so that attention and MLP outputs are of the order of the residual
stream (projections ~ N(0, gain/fan_in)), the logits have a std of order 1 (gemma2 ~4) and
greedy decoding does not just repeat one token; norms are 1 + noise (gemma2: 0 + noise, since
Gemma2RMSNorm multiplies by 1 + w). See init_tensor(). Everything is deterministic from --seed.
"""
import argparse
import json
import os
import sys

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2",
            "mixtral", "qwen2moe", "olmoe", "qwen3moe")
MOE_FAMILIES = ("mixtral", "qwen2moe", "olmoe", "qwen3moe")
# config.json's model_type where it is not the family's name here
MODEL_TYPE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, MAX_POS = 64, 4, 2, 96, 256, 512


# ----------------------------------------------------------------------------- config.json

def base_config(family, dtype):
    """Fields shared by the llama-like families, with small values."""
    return {
        "architectures": [ARCH[family]],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POS,
        "model_type": MODEL_TYPE.get(family, family),
        "num_attention_heads": HEADS,
        "num_hidden_layers": 3,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.45.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def llama_config(dtype, rope_scaling):
    # Llama-3.2-1B's config.json: head_dim, mlp_bias, pretraining_tp, llama3 rope_scaling.
    c = base_config("llama", dtype)
    c.update({
        "attention_bias": False,
        "head_dim": 16,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 4.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 128,
            "rope_type": "llama3",
        } if rope_scaling else None,
    })
    return c


def mistral_config(dtype, rope_scaling):
    # Mistral-7B-v0.1's config.json plus head_dim (MistralConfig has had it since 4.45).
    c = base_config("mistral", dtype)
    c.update({"head_dim": 16, "sliding_window": 16})
    return c


def qwen2_config(dtype, rope_scaling):
    # Qwen2.5-7B's config.json (untied head; 0.5B-3B tie it): the window fields exist but
    # use_sliding_window is false.
    c = base_config("qwen2", dtype)
    c.update({
        "max_window_layers": 3,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 512,
        "tie_word_embeddings": False,
        "use_mrope": False,
        "use_sliding_window": False,
    })
    return c


def qwen3_config(dtype, rope_scaling):
    # Qwen3-0.6B's config.json: explicit head_dim (128 there, != 1024/16), attention_bias.
    c = base_config("qwen3", dtype)
    c.update({
        "attention_bias": False,
        "head_dim": 24,
        "max_window_layers": 3,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    })
    return c


def phi3_config(dtype, rope_scaling):
    # Phi-3-mini-128k-instruct's config.json (minus auto_map): longrope with
    # original_max_position_embeddings outside rope_scaling, sliding_window larger than any
    # sequence (262144 there), pad = eos.
    rng = np.random.default_rng(1234)  # fixed: the factors are part of the "architecture"
    half = 16 // 2
    short = np.round(np.sort(rng.uniform(1.0, 1.5, half)), 4).tolist()
    long = np.round(np.sort(rng.uniform(1.0, 4.0, half)), 4).tolist()
    c = base_config("phi3", dtype)
    c.update({
        "attention_bias": False,
        "embd_pdrop": 0.0,
        "original_max_position_embeddings": 128,
        "pad_token_id": 2,
        "resid_pdrop": 0.0,
        "rope_scaling": {"long_factor": long, "short_factor": short, "type": "longrope"},
        "sliding_window": 262144,
    })
    return c


def gemma2_config(dtype, rope_scaling):
    # gemma-2-2b's config.json: both hidden_act and hidden_activation, cache_implementation,
    # query_pre_attn_scalar (32 here, not head_dim 24, so the scale is really exercised).
    c = base_config("gemma2", dtype)
    del c["tie_word_embeddings"]  # gemma-2's config.json leaves it to the default (True)
    c.update({
        "attention_bias": False,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "num_hidden_layers": 4,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-06,
        "sliding_window": 16,
    })
    return c


def mixtral_config(dtype, rope_scaling):
    # Mixtral-8x7B-v0.1's config.json: no head_dim (hidden / heads), sliding_window null,
    # intermediate_size is each expert's.
    c = base_config("mixtral", dtype)
    c.update({
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
    })
    return c


def qwen2moe_config(dtype, rope_scaling):
    # Qwen1.5-MoE-A2.7B's config.json (plus mlp_only_layers, Qwen2MoeConfig's field): 4 of
    # the experts and the shared expert; intermediate_size is for dense layers (none here).
    c = base_config("qwen2moe", dtype)
    c.update({
        "decoder_sparse_step": 1,
        "max_window_layers": 3,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "num_experts": 8,
        "num_experts_per_tok": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 64,
        "sliding_window": 512,
        "use_sliding_window": False,
    })
    return c


def olmoe_config(dtype, rope_scaling):
    # OLMoE-1B-7B-0924's config.json: intermediate_size is each expert's, num_key_value_heads
    # equal to num_attention_heads (see the module doc), no head_dim (OlmoeAttention uses
    # hidden / heads).
    c = base_config("olmoe", dtype)
    c.update({
        "attention_bias": False,
        "clip_qkv": None,
        "intermediate_size": 32,
        "norm_topk_prob": False,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_key_value_heads": HEADS,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rope_scaling": None,
        "router_aux_loss_coef": 0.01,
    })
    return c


def qwen3moe_config(dtype, rope_scaling):
    # Qwen3-30B-A3B's config.json: explicit head_dim (128 there, != 2048/32), norm_topk_prob
    # true, untied head; intermediate_size is for dense layers (none here).
    c = base_config("qwen3moe", dtype)
    c.update({
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "head_dim": 24,
        "max_window_layers": 3,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "use_sliding_window": False,
    })
    return c


CONFIGS = {
    "llama": llama_config,
    "mistral": mistral_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "phi3": phi3_config,
    "gemma2": gemma2_config,
    "mixtral": mixtral_config,
    "qwen2moe": qwen2moe_config,
    "olmoe": olmoe_config,
    "qwen3moe": qwen3moe_config,
}


# ----------------------------------------------------------------------------- weights

def head_dim_of(c):
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def layer_shapes(family, c):
    """(name suffix, shape, kind) of one decoder layer; kind picks the init scale. The order
    (which fixes the random draws) is the norms, the attention projections, the MLP, then the
    attention's extras (biases, q/k norms, gemma2's sandwich norms)."""
    attention, extras = attention_shapes(family, c)
    return attention + mlp_shapes(family, c) + extras


def attention_shapes(family, c):
    """(the norms and projections, the extras) of one layer's attention."""
    h, d = c["hidden_size"], head_dim_of(c)
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    norms = [("input_layernorm.weight", [h], "norm"), ("post_attention_layernorm.weight", [h], "norm")]
    if family == "phi3":  # Phi3Attention.qkv_proj rows q|k|v
        return norms + [
            ("self_attn.qkv_proj.weight", [q + 2 * kv, h], "in"),
            ("self_attn.o_proj.weight", [h, q], "out"),
        ], []
    attention = norms + [
        ("self_attn.q_proj.weight", [q, h], "qk"),
        ("self_attn.k_proj.weight", [kv, h], "qk"),
        ("self_attn.v_proj.weight", [kv, h], "in"),
        ("self_attn.o_proj.weight", [h, q], "out"),
    ]
    s = []
    if family in ("qwen2", "qwen2moe"):  # Qwen2(Moe)Attention: q/k/v with bias=True, o_proj without
        s += [("self_attn.q_proj.bias", [q], "bias"), ("self_attn.k_proj.bias", [kv], "bias"),
              ("self_attn.v_proj.bias", [kv], "bias")]
    if family in ("qwen3", "qwen3moe"):  # Qwen3(Moe)Attention.q_norm / k_norm: RMSNorm over head_dim
        s += [("self_attn.q_norm.weight", [d], "norm"), ("self_attn.k_norm.weight", [d], "norm")]
    if family == "olmoe":  # OlmoeAttention.q_norm / k_norm: RMSNorm over the whole projection
        s += [("self_attn.q_norm.weight", [q], "norm"), ("self_attn.k_norm.weight", [kv], "norm")]
    if family == "gemma2":  # Gemma2DecoderLayer's sandwich norms
        s += [("pre_feedforward_layernorm.weight", [h], "norm"),
              ("post_feedforward_layernorm.weight", [h], "norm")]
    return attention, s


def swiglu_shapes(prefix, h, i, out_kind="out", names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return [(f"{prefix}{gate}.weight", [i, h], "in"), (f"{prefix}{up}.weight", [i, h], "in"),
            (f"{prefix}{down}.weight", [h, i], out_kind)]


def mlp_shapes(family, c):
    h, i = c["hidden_size"], c["intermediate_size"]
    if family == "phi3":  # Phi3MLP.gate_up_proj rows gate|up
        return [("mlp.gate_up_proj.weight", [2 * i, h], "in"), ("mlp.down_proj.weight", [h, i], "out")]
    if family not in MOE_FAMILIES:
        return swiglu_shapes("mlp.", h, i)
    if family == "mixtral":  # MixtralSparseMoeBlock: gate (router), experts[j].w1/w3/w2
        s = [("block_sparse_moe.gate.weight", [c["num_local_experts"], h], "router")]
        for j in range(c["num_local_experts"]):
            s += swiglu_shapes(f"block_sparse_moe.experts.{j}.", h, i, "expert_out", ("w1", "w3", "w2"))
        return s
    width = c["moe_intermediate_size"] if "moe_intermediate_size" in c else i  # olmoe: intermediate_size
    s = [("mlp.gate.weight", [c["num_experts"], h], "router")]
    for j in range(c["num_experts"]):
        s += swiglu_shapes(f"mlp.experts.{j}.", h, width, "expert_out")
    if family == "qwen2moe":  # Qwen2MoeSparseMoeBlock: shared_expert, shared_expert_gate
        s += swiglu_shapes("mlp.shared_expert.", h, c["shared_expert_intermediate_size"])
        s.append(("mlp.shared_expert_gate.weight", [1, h], "in"))
    return s


def model_shapes(family, c):
    shapes = [("model.embed_tokens.weight", [c["vocab_size"], c["hidden_size"]], "embed"),
              ("model.norm.weight", [c["hidden_size"]], "final_norm")]
    for n in range(c["num_hidden_layers"]):
        shapes += [(f"model.layers.{n}.{s}", shape, kind) for s, shape, kind in layer_shapes(family, c)]
    if not tied(family, c):
        shapes.append(("lm_head.weight", [c["vocab_size"], c["hidden_size"]], "head"))
    return shapes


def tied(family, c):
    return c.get("tie_word_embeddings", family == "gemma2")


# Per MoE family: the router logits' std (router rows N(0, (gain / sqrt(hidden))^2) on an
# RMS-normed input), and the experts' down projection gain (the plain "out" gain is 0.7). Both
# picked by trying a few values (seed 0): the routing is spread (different tokens pick
# different expert sets; each layer uses every expert, or nearly so for olmoe's 64), the
# router logit gap between the k-th and (k+1)-th expert stays above ~5e-4 over a 72-token
# sequence (f32 rounding of a logit is ~1e-7), and greedy decoding wanders (16 to 29 distinct
# ids of 32 on selfcheck.py's prompt, as the dense families). Without renormalisation the
# top-k weights sum to well under 1 (qwen2moe's 4 of 8, olmoe's 8 of 64), hence the larger
# down gains there.
ROUTER_GAIN = {"mixtral": 2.0, "qwen2moe": 2.0, "olmoe": 3.0, "qwen3moe": 2.0}
MOE_OUT_GAIN = {"mixtral": 1.0, "qwen2moe": 1.5, "olmoe": 2.5, "qwen3moe": 1.0}


def init_tensor(rng, family, shape, kind, is_tied):
    """Random values whose scale keeps every sub-block's output of order 1 (see module doc).

    Tied models (qwen3, gemma2) get small embeddings: the residual stream carries the current
    token's embedding to the head, and a large one makes the model repeat its input forever
    (greedy ids all equal). Their final norm is larger instead, to bring the logits' std back
    to order 1 (qwen3) or to ~4 (gemma2, so the final softcap of 30 bends the top logits).
    """
    gemma = family == "gemma2"
    if kind == "norm":
        return (0.0 if gemma else 1.0) + rng.normal(0.0, 0.1, shape)  # Gemma2RMSNorm: * (1 + w)
    if kind == "final_norm":
        centre = 4.0 if gemma else (2.0 if is_tied else 1.0)
        return centre + rng.normal(0.0, 0.1, shape)
    if kind == "bias":
        return rng.normal(0.0, 0.3, shape)
    if kind == "embed":
        return rng.normal(0.0, 0.1 if is_tied else 0.3, shape)
    if kind == "head":
        return rng.normal(0.0, 0.2, shape)
    # gemma2's larger q/k gain gives attention scores up to ~20, so its softcap (50) matters;
    # more makes the softmax nearly hard and the model chaotic (f32 rounding visible in logits).
    gain = {"qk": 2.0 if gemma else 1.0, "in": 1.0, "out": 0.7, "router": ROUTER_GAIN.get(family),
            "expert_out": MOE_OUT_GAIN.get(family)}[kind]
    return rng.normal(0.0, gain / np.sqrt(shape[1]), shape)


def make_tensors(family, c, seed):
    rng = np.random.default_rng(seed)
    return {name: init_tensor(rng, family, shape, kind, tied(family, c)).astype(np.float32)
            for name, shape, kind in model_shapes(family, c)}


# ----------------------------------------------------------------------------- safetensors

def to_bf16_bits(a):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, as torch does."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def encode(a, dtype):
    if dtype == "bfloat16":
        return "BF16", to_bf16_bits(a).astype("<u2").tobytes()
    return "F32", np.ascontiguousarray(a, dtype="<f4").tobytes()


def write_safetensors(path, tensors, dtype):
    """8-byte LE header length, JSON header (padded with spaces to 8 bytes), raw data."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        st_dtype, raw = encode(tensors[name], dtype)
        header[name] = {"dtype": st_dtype, "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)
    return offset


def split_shards(names, k):
    """Consecutive groups of tensor names (in model order), as even in count as possible."""
    k = max(1, min(k, len(names)))
    bounds = [round(j * len(names) / k) for j in range(k + 1)]
    return [names[bounds[j]:bounds[j + 1]] for j in range(k)]


def write_weights(out, tensors, shards, dtype):
    if shards <= 1:
        write_safetensors(os.path.join(out, "model.safetensors"), tensors, dtype)
        return
    groups = split_shards(list(tensors), shards)
    weight_map, total = {}, 0
    for j, group in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(os.path.join(out, fname), {n: tensors[n] for n in group}, dtype)
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------- main

def make_model(family, out, seed=0, shards=1, dtype="float32", rope_scaling=True):
    """Library entry point (selfcheck.py uses it); returns the config dict written."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"unknown dtype {dtype!r} (float32 or bfloat16)")
    os.makedirs(out, exist_ok=True)
    config = CONFIGS[family](dtype, rope_scaling)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    write_weights(out, make_tensors(family, config, seed), shards, dtype)
    return config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-rope-scaling", action="store_true",
                   help="llama: rope_scaling null instead of llama3 (other families: no effect)")
    a = p.parse_args(argv)
    if a.shards < 1:
        p.error("--shards must be >= 1")
    make_model(a.family, a.out, a.seed, a.shards, a.dtype, not a.no_rope_scaling)
    print(f"wrote {a.family} model to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
