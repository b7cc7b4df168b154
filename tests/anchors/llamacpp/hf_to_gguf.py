#!/usr/bin/python3
"""Hugging Face folder (config.json + *.safetensors) -> f32 GGUF for llama.cpp c392e5094.

Part of the llama.cpp family cross-check (tests/anchors/llamacpp/README.md); not part of
Strata. NumPy only (no torch, no sentencepiece): it writes with the gguf-py of the llama.cpp
source that check-families-llamacpp.py extracts (../shared/anchors/llamacpp's tarball), and
applies per architecture exactly the transforms of that commit's convert_hf_to_gguf.py:

  llama / mistral (LlamaModel): q_proj/k_proj rows permuted from HF's rotate-half layout to
      GGML's interleaved rope (LlamaModel.permute, k with n_kv_heads); llama.vocab_size and
      rope.dimension_count; linear rope scaling; llama3 rope_freqs (but see below). Mistral's sliding_window
      is not written (the llama arch of this commit has no sliding window).
  qwen2 (Qwen2Model): base metadata, q/k/v biases kept as is (NEOX rope, no permute), yarn.
  phi3 (Phi3MiniModel): qkv_proj and gate_up_proj kept fused (attn_qkv, ffn_up),
      rope.scaling.original_context_length, sliding_window; with rope_scaling su/longrope/yarn,
      rope_factors_long/short tensors and rope.scaling.attn_factor.
  gemma2 (Gemma2Model): lm_head dropped (tied), every *norm.weight + 1, post_attention /
      pre_feedforward / post_feedforward norms to attn_post_norm / ffn_norm / ffn_post_norm,
      attn/final logit softcapping, sliding_window, key/value_length = head_dim.
  mixtral (LlamaModel, the llama arch): as llama (q/k permuted), plus expert_count
      (num_local_experts) and expert_used_count (num_experts_per_tok); block_sparse_moe.gate to
      ffn_gate_inp, and each layer's experts' w1 / w3 / w2 stacked along a new first axis into
      ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, ...]. llama.cpp's llama graph renormalises
      the top-k weights (llm_build_moe_ffn norm_w = true), as MixtralSparseMoeBlock does.
  qwen2moe (Qwen2MoeModel): base metadata, expert_count (num_experts), expert_used_count,
      expert_feed_forward_length (moe_intermediate_size), expert_shared_feed_forward_length
      (shared_expert_intermediate_size); q/k/v biases as is (NEOX rope, no permute); experts'
      gate/up/down_proj stacked into ffn_{gate,up,down}_exps, mlp.gate to ffn_gate_inp,
      mlp.shared_expert.* to ffn_{gate,up,down}_shexp, mlp.shared_expert_gate to
      ffn_gate_inp_shexp. Its graph never renormalises the top-k (norm_w = false), so a config
      with norm_topk_prob true is refused.
  olmoe (OlmoeModel): base metadata, expert_count, expert_used_count; q_norm / k_norm to
      attn_q_norm / attn_k_norm (whole-width, no permute: NEOX rope); experts stacked as for
      qwen2moe. Its graph never renormalises the top-k either (norm_topk_prob true refused),
      has no clip (OlmoeModel writes no clamp_kqv, build_olmoe applies none: clip_qkv other than
      null refused), and makes attn_q_norm / attn_k_norm n_embd wide, so GQA is refused.
      OlmoeModel.set_gguf_parameters adds layer_norm_rms_eps = 1e-5 after the base class wrote
      the config's rms_norm_eps, which gguf-py refuses as a duplicated key; written once here,
      the config's value (a note when it is not 1e-5).
(There is no Qwen3 nor Qwen3-MoE in c392e5094.) The expert stacking follows the converter's
order (LlamaModel: w1, w2, w3; Qwen2MoeModel / OlmoeModel: down, gate, up), each stacked
tensor written where the layer's last expert tensor was met.

The vocabulary is tokenizer.ggml.model = "no_vocab" (llama-vocab.cpp accepts it and makes
{arch}.vocab_size dummy tokens), so {arch}.vocab_size is written for every arch.

Workarounds for limits of llama.cpp c392e5094 on tiny random models (each one an exact
identity of the function computed; off with --strict, printed to stderr when used):
  gemma2: build_gemma2 aborts unless n_layer is 26, 42 or 46 (the 2B/9B/27B types), and it
      scales q by 1/sqrt(head_dim) (2B, 9B) or 1/sqrt(hidden/heads) (27B), not by
      query_pre_attn_scalar. The model is padded with identity layers (q,k,v,o,gate,up,down
      all zero, norms 1: attention and MLP then add rmsnorm(0) = 0 to the residual) up to
      the type whose scaling equals query_pre_attn_scalar; when neither does, q_proj is
      multiplied by sqrt(head_dim / query_pre_attn_scalar) (rope is linear, so exact).
      A final_logit_softcapping of null (none) becomes 1e30 (llama.cpp always caps).
  llama3 rope_freqs: convert_hf_to_gguf.py takes original_max_position_embeddings from the
      top level of config.json (default 8192), HF from rope_scaling; this takes rope_scaling's
      (a converter bug, harmless for real Llama 3, whose value is 8192 in both places).
  phi3: llama.cpp requires output.weight; with tie_word_embeddings and no lm_head the
      embedding is written as output.weight too. Without original_max_position_embeddings
      (the converter would stop) max_position_embeddings is used.

  hf_to_gguf.py --model DIR --out F.gguf [--gguf-py DIR] [--strict]
"""
import argparse
import json
import math
import os
import re
import struct
import sys
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_GGUF_PY = os.path.join(HERE, "..", "..", "..", ".refs", "llamacpp", "llama.cpp", "gguf-py")


def import_gguf(path):
    sys.path.insert(0, os.path.abspath(path))
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        # gguf/vocab.py imports SentencePieceProcessor at import time; nothing here uses it.
        stub = types.ModuleType("sentencepiece")
        stub.SentencePieceProcessor = object
        sys.modules["sentencepiece"] = stub
    import gguf
    return gguf


def read_safetensors(path):
    dtypes = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            buf = raw[base + b: base + e]
            dt = info["dtype"]
            if dt == "BF16":
                a = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif dt in dtypes:
                a = buf.view(dtypes[dt])
            else:
                raise SystemExit(f"hf_to_gguf: {name}: dtype {dt} not handled")
            out[name] = np.asarray(a, dtype=np.float32).reshape(info["shape"])
    return out


def load_tensors(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(os.path.join(model_dir, f)))
    return tensors


def permute(w, n_head, n_head_kv):  # LlamaModel.permute
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def find(h, keys, optional=False):
    for k in keys:
        if k in h:
            return h[k]
    if optional:
        return None
    raise SystemExit(f"hf_to_gguf: config.json lacks all of {keys}")


ARCHS = {
    "LlamaForCausalLM": "LLAMA", "LLaMAForCausalLM": "LLAMA", "MistralForCausalLM": "LLAMA",
    "Qwen2ForCausalLM": "QWEN2", "Phi3ForCausalLM": "PHI3", "Gemma2ForCausalLM": "GEMMA2",
    "MixtralForCausalLM": "LLAMA", "Qwen2MoeForCausalLM": "QWEN2MOE", "OlmoeForCausalLM": "OLMOE",
}

# Per MoE architecture: the config field of the expert count, a function of (layer, name) to
# the expert tensor's stacked HF-like name (the key of gguf-py's tensor map) or None, and the
# order in which the converter emits the stacked tensors.
EXPERT_RE = {
    "MixtralForCausalLM": (r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight",
                           "layers.{bid}.feed_forward.experts.{w}.weight", ("w1", "w2", "w3"), "num_local_experts"),
    "Qwen2MoeForCausalLM": (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight",
                            "model.layers.{bid}.mlp.experts.{w}.weight", ("down_proj", "gate_proj", "up_proj"),
                            "num_experts"),
    "OlmoeForCausalLM": (r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight",
                         "model.layers.{bid}.mlp.experts.{w}.weight", ("down_proj", "gate_proj", "up_proj"),
                         "num_experts"),
}


def stack_experts(tensors, arch_name, n_experts):
    """The tensors with each layer's expert matrices replaced by [E, rows, cols] stacks (in
    the converter's order, at the place of the layer's last expert tensor), keyed by the merged
    names the converters map (LlamaModel / Qwen2MoeModel.modify_tensors)."""
    if arch_name not in EXPERT_RE:
        return tensors
    pattern, merged, order, _ = EXPERT_RE[arch_name]
    rx = re.compile(pattern)
    pending, out = {}, {}
    for name, t in tensors.items():
        m = rx.fullmatch(name)
        if m is None:
            if ".experts." in name:
                raise SystemExit(f"hf_to_gguf: expert tensor {name!r} not understood")
            out[name] = t
            continue
        bid, xid, w = int(m.group(1)), int(m.group(2)), m.group(3)
        if w not in order:
            raise SystemExit(f"hf_to_gguf: expert tensor {name!r} not understood")
        if xid >= n_experts:
            raise SystemExit(f"hf_to_gguf: {name!r}: expert {xid} of {n_experts}")
        pending.setdefault(bid, {})[(w, xid)] = t
        if len(pending[bid]) == n_experts * len(order):
            for wid in order:
                out[merged.format(bid=bid, w=wid)] = np.stack(
                    [pending[bid].pop((wid, x)) for x in range(n_experts)], axis=0)
            del pending[bid]
    if pending:
        left = sorted(f"layer {b}: {len(d)}" for b, d in pending.items())
        raise SystemExit(f"hf_to_gguf: unprocessed experts ({', '.join(left)} tensors; "
                         f"expected {n_experts} x {len(order)} a layer)")
    return out


def base_params(w, h, n_layer):  # Model.set_gguf_parameters
    w.add_block_count(n_layer)
    if (v := find(h, ["max_position_embeddings", "n_ctx"], True)) is not None:
        w.add_context_length(v)
    if (v := find(h, ["hidden_size", "n_embd"], True)) is not None:
        w.add_embedding_length(v)
    if (v := find(h, ["intermediate_size", "n_inner"], True)) is not None:
        w.add_feed_forward_length(v)
    if (v := find(h, ["num_attention_heads", "n_head"], True)) is not None:
        w.add_head_count(v)
    if (v := h.get("num_key_value_heads")) is not None:
        w.add_head_count_kv(v)
    if (v := h.get("rope_theta")) is not None:
        w.add_rope_freq_base(v)
    if (v := h.get("rms_norm_eps")) is not None:
        w.add_layer_norm_rms_eps(v)
    if (v := find(h, ["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"], True)) is not None:
        w.add_layer_norm_eps(v)
    if (v := h.get("num_local_experts")) is not None:
        w.add_expert_count(v)
    if (v := h.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(v)
    if (v := h.get("head_dim")) is not None:
        w.add_key_length(v)
        w.add_value_length(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf-py", default=os.environ.get("LLAMACPP_GGUF_PY", DEFAULT_GGUF_PY))
    ap.add_argument("--strict", action="store_true", help="no workarounds (see the docstring)")
    args = ap.parse_args()
    gguf = import_gguf(args.gguf_py)

    h = json.load(open(os.path.join(args.model, "config.json")))
    archs = h.get("architectures") or []
    if not archs or archs[0] not in ARCHS:
        raise SystemExit(f"hf_to_gguf: architecture {archs} not handled (llama.cpp c392e5094 has no Qwen3)")
    arch = getattr(gguf.MODEL_ARCH, ARCHS[archs[0]])
    tensors = load_tensors(args.model)
    if archs[0] in EXPERT_RE:
        tensors = stack_experts(tensors, archs[0], h[EXPERT_RE[archs[0]][3]])
    n_layer_hf = find(h, ["n_layers", "num_hidden_layers", "n_layer", "num_layers"])
    n_layer = n_layer_hf
    notes = []

    n_embd = h["hidden_size"]
    n_head = h["num_attention_heads"]
    n_head_kv = h.get("num_key_value_heads", n_head)
    vocab = h["vocab_size"]

    q_scale = None
    if arch == gguf.MODEL_ARCH.GEMMA2:
        head_dim = h["head_dim"]
        qpas = h.get("query_pre_attn_scalar", head_dim)
        if n_layer not in (26, 42, 46):
            if args.strict:
                raise SystemExit("hf_to_gguf: llama.cpp's gemma2 needs 26, 42 or 46 layers (--strict)")
            if qpas == head_dim and n_layer < 42:
                n_layer = 26 if n_layer < 26 else 42
            elif qpas == n_embd // n_head and n_layer < 46 and qpas * n_head == n_embd:
                n_layer = 46
            elif n_layer < 42:
                n_layer = 26 if n_layer < 26 else 42
                q_scale = math.sqrt(head_dim / qpas)
            else:
                raise SystemExit(f"hf_to_gguf: gemma2 with {n_layer} layers cannot be padded to a llama.cpp type")
            notes.append(f"gemma2: padded {n_layer_hf} -> {n_layer} layers with identity layers (llama.cpp knows only 26/42/46)")
        else:
            want = head_dim if n_layer in (26, 42) else n_embd / n_head
            if want != qpas:
                q_scale = math.sqrt(want / qpas)
        if q_scale is not None:
            if args.strict:
                raise SystemExit("hf_to_gguf: query_pre_attn_scalar not expressible in llama.cpp (--strict)")
            notes.append(f"gemma2: q_proj scaled by {q_scale:.6g} for query_pre_attn_scalar={qpas}")

    w = gguf.GGUFWriter(path=args.out, arch=gguf.MODEL_ARCH_NAMES[arch])
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(os.path.basename(os.path.normpath(args.model)))
    extra = []  # (gguf name, array) written before the model's tensors, like generate_extra_tensors

    if arch == gguf.MODEL_ARCH.LLAMA:
        base_params(w, h, n_layer)
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(h["head_dim"] if "head_dim" in h else n_embd // n_head)
        rs = h.get("rope_scaling")
        if rs is not None and "factor" in rs and rs.get("type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rs["factor"])
        if rs and rs.get("rope_type", "").lower() == "llama3":
            base = h.get("rope_theta", 10000.0)
            dim = h.get("head_dim", n_embd // n_head)
            freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
            factor = rs.get("factor", 8.0)
            lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
            # convert_hf_to_gguf.py (c392e5094) reads only the top-level key, default 8192; HF's
            # _compute_llama3_parameters reads rope_scaling's. Real Llama 3 configs have 8192 in
            # rope_scaling, so the two agree there; a test model with another value does not.
            old_convert = h.get("original_max_position_embeddings", 8192)
            old = rs.get("original_max_position_embeddings", old_convert)
            if old != old_convert:
                if args.strict:
                    old = old_convert
                else:
                    notes.append(f"llama3 rope: original_max_position_embeddings={old} from rope_scaling "
                                 f"(convert_hf_to_gguf.py would use {old_convert})")
            lo_w, hi_w = old / lo, old / hi
            fac = []
            for fr in freqs:
                wl = 2 * math.pi / fr
                if wl < hi_w:
                    fac.append(1)
                elif wl > lo_w:
                    fac.append(factor)
                else:
                    s = (old / wl - lo) / (hi - lo)
                    fac.append(1 / ((1 - s) / factor + s))
            extra.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", np.array(fac, dtype=np.float32)))
        if h.get("sliding_window") and archs[0] in ("MistralForCausalLM", "MixtralForCausalLM"):
            notes.append(f"{archs[0][:-len('ForCausalLM')].lower()}: sliding_window={h['sliding_window']} "
                         "ignored by llama.cpp's llama arch")
    elif arch == gguf.MODEL_ARCH.QWEN2:
        base_params(w, h, n_layer)
        w.add_vocab_size(vocab)
        rs = h.get("rope_scaling")
        if rs is not None and "factor" in rs and rs.get("type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rs["factor"])
            w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    elif arch in (gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.OLMOE):
        qwen = arch == gguf.MODEL_ARCH.QWEN2MOE
        if h.get("norm_topk_prob"):
            raise SystemExit(f"hf_to_gguf: {archs[0]} with norm_topk_prob true: llama.cpp c392e5094's "
                             f"{'qwen2moe' if qwen else 'olmoe'} graph never renormalises the top-k weights")
        if n_head * (n_embd // n_head) != n_embd or h.get("head_dim", n_embd // n_head) != n_embd // n_head:
            raise SystemExit("hf_to_gguf: llama.cpp's qwen2moe / olmoe need head_dim = hidden / heads")
        if not qwen:
            if h.get("clip_qkv") is not None:
                raise SystemExit("hf_to_gguf: OLMoE clip_qkv: llama.cpp c392e5094's olmoe does not clip")
            if n_head_kv != n_head:
                raise SystemExit("hf_to_gguf: OLMoE with num_key_value_heads != num_attention_heads: llama.cpp "
                                 "c392e5094 makes attn_k_norm n_embd wide (HF: kv_heads * head_dim)")
        base_params(w, h, n_layer)  # OlmoeModel's extra layer_norm_rms_eps: see the module doc
        if not qwen and h.get("rms_norm_eps", 1e-5) != 1e-5:
            notes.append(f"olmoe: rms_norm_eps {h['rms_norm_eps']} written (OlmoeModel also writes 1e-5, "
                         "a duplicate key gguf-py refuses)")
        w.add_vocab_size(vocab)
        if (v := h.get("num_experts")) is not None:
            w.add_expert_count(v)
        if qwen and (v := h.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(v)
        if qwen and (v := h.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(v)
        if qwen and h.get("use_sliding_window"):
            notes.append("qwen2moe: use_sliding_window ignored by llama.cpp")
    elif arch == gguf.MODEL_ARCH.PHI3:
        max_pos = find(h, ["n_positions", "max_position_embeddings"])
        orig = find(h, ["original_max_position_embeddings"], optional=True)
        if orig is None:
            if args.strict:
                raise SystemExit("hf_to_gguf: phi3 needs original_max_position_embeddings (--strict)")
            orig = max_pos
            notes.append("phi3: no original_max_position_embeddings, used max_position_embeddings")
        rope_dims = n_embd // n_head
        w.add_context_length(max_pos)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(h["intermediate_size"])
        w.add_block_count(n_layer)
        w.add_head_count(n_head)
        w.add_head_count_kv(find(h, ["num_key_value_heads", "n_head_kv"]))
        w.add_layer_norm_rms_eps(h["rms_norm_eps"])
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_freq_base(h["rope_theta"])
        w.add_sliding_window(h.get("sliding_window") or 0)
        w.add_vocab_size(vocab)
        rs = h.get("rope_scaling")
        if rs is not None:
            scale = max_pos / orig
            t = rs.get("type", "").lower()
            if t in ("su", "longrope"):
                attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
            elif t == "yarn":
                attn = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
            else:
                raise SystemExit(f"hf_to_gguf: phi3 rope scaling {t!r} not supported by the converter")
            w.add_rope_scaling_attn_factors(attn)
            lf, sf = rs.get("long_factor"), rs.get("short_factor")
            if lf is None or sf is None or len(lf) != len(sf) or len(lf) != rope_dims / 2:
                raise SystemExit(f"hf_to_gguf: phi3 long/short factors must be {rope_dims // 2} long")
            extra.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight", np.array(lf, dtype=np.float32)))
            extra.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight", np.array(sf, dtype=np.float32)))
    elif arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_context_length(h["max_position_embeddings"])
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(h["intermediate_size"])
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_layer_norm_rms_eps(h["rms_norm_eps"])
        w.add_key_length(h["head_dim"])
        w.add_value_length(h["head_dim"])
        w.add_attn_logit_softcapping(h["attn_logit_softcapping"] if h.get("attn_logit_softcapping") is not None else 1e30)
        fcap = h.get("final_logit_softcapping")
        if fcap is None:
            if args.strict:
                raise SystemExit("hf_to_gguf: gemma2 without final_logit_softcapping (--strict)")
            fcap = 1e30
            notes.append("gemma2: final_logit_softcapping null -> 1e30")
        w.add_final_logit_softcapping(fcap)
        if h.get("attn_logit_softcapping") is None:
            notes.append("gemma2: attn_logit_softcapping null -> 1e30")
        w.add_sliding_window(h["sliding_window"])
        w.add_vocab_size(vocab)
        if h.get("rope_theta") is not None and h["rope_theta"] != 10000.0:
            # Gemma2Model writes no rope base; llama.cpp then uses 10000.
            notes.append(f"gemma2: rope_theta={h['rope_theta']} not written by the converter (llama.cpp uses 10000)")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("no_vocab")

    tmap = gguf.get_tensor_name_map(arch, n_layer)
    out = list(extra)
    have_output = False
    for name, t in tensors.items():
        if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            continue
        if arch == gguf.MODEL_ARCH.LLAMA:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = permute(t, n_head, n_head)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = permute(t, n_head, h.get("num_key_value_heads"))
        if arch == gguf.MODEL_ARCH.GEMMA2:
            if name == "lm_head.weight":
                continue
            if name.endswith("norm.weight"):
                t = t + 1
            if q_scale is not None and name.endswith("q_proj.weight"):
                t = t * np.float32(q_scale)
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise SystemExit(f"hf_to_gguf: cannot map tensor {name!r}")
        have_output |= new == "output.weight"
        out.append((new, np.ascontiguousarray(t, dtype=np.float32)))

    if arch == gguf.MODEL_ARCH.PHI3 and not have_output:
        if args.strict:
            raise SystemExit("hf_to_gguf: phi3 without lm_head.weight: llama.cpp needs output.weight (--strict)")
        out.append(("output.weight", tensors["model.embed_tokens.weight"].astype(np.float32)))
        notes.append("phi3: tied embeddings written as output.weight too (llama.cpp requires it)")

    if n_layer > n_layer_hf:  # gemma2 padding: identity layers
        hd = h["head_dim"]
        ff = h["intermediate_size"]
        z = lambda *s: np.zeros(s, dtype=np.float32)  # noqa: E731
        for b in range(n_layer_hf, n_layer):
            for nm, arr in [("attn_norm", np.ones(n_embd, np.float32)), ("attn_q", z(n_head * hd, n_embd)),
                            ("attn_k", z(n_head_kv * hd, n_embd)), ("attn_v", z(n_head_kv * hd, n_embd)),
                            ("attn_output", z(n_embd, n_head * hd)), ("post_attention_norm", np.ones(n_embd, np.float32)),
                            ("ffn_norm", np.ones(n_embd, np.float32)), ("ffn_gate", z(ff, n_embd)),
                            ("ffn_up", z(ff, n_embd)), ("ffn_down", z(n_embd, ff)),
                            ("post_ffw_norm", np.ones(n_embd, np.float32))]:
                out.append((f"blk.{b}.{nm}.weight", arr))

    for new, arr in out:
        w.add_tensor(new, arr, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for n in notes:
        print(f"hf_to_gguf: note: {n}", file=sys.stderr)
    print(json.dumps({"gguf": args.out, "arch": gguf.MODEL_ARCH_NAMES[arch], "n_layer": n_layer,
                      "n_layer_hf": n_layer_hf, "tensors": len(out), "notes": notes}))


if __name__ == "__main__":
    main()
