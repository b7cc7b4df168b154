#!/usr/bin/python3
"""Write one random-weight Mixtral-shaped MoE model twice: for Strata and for llama.cpp.

  make-moe-bench-model.py OUT_DIR [--seed 0] [--shape mixtral-mini|tiny]
                          [--gguf-py DIR] [--tokenizer FILE] [--no-hf-tokenizer]

OUT_DIR gets, with the SAME f32 values:
  hf-SHAPE/            a Hugging Face Mixtral folder (config.json, model.safetensors, and
                       tokenizer.model unless --no-hf-tokenizer) for Strata;
  SHAPE-f32.gguf       the model as llama.cpp's convert_hf_to_gguf.py writes a Mixtral: arch
                       "llama", q/k rows permuted for llama.cpp's interleaved RoPE, each
                       layer's experts stacked into blk.N.ffn_{gate,up,down}_exps,
                       blk.N.ffn_gate_inp the router, llama.expert_count/expert_used_count,
                       and a Llama SPM vocabulary read from --tokenizer (so llama.cpp's tools
                       run on it).

Shapes: mixtral-mini: hidden 1024, 8 layers, 16 heads, 4 KV heads (head_dim 64), 8 experts
top-2 of intermediate 3584, vocab 32000, 4096 positions, untied head (about 3.2 GB per copy).
tiny: hidden 64, 2 layers, 4 heads, 2 KV heads, 8 experts top-2 of 128, same vocabulary (the
conversion check of scripts/bench-moe-vs-llamacpp.sh).

Weights ~ N(0, gain/fan_in) (attention and expert outputs of order the residual stream), the
router's rows N(0, 1/hidden) so that tokens spread over the experts, norms 1 + N(0, 0.1).
Every tensor has its own generator seeded by (seed, its index), so the values do not depend on
the write order. The tensors are written one at a time (the GGUF from a memory map of the
safetensors just written), so at most one layer's experts are in memory.

Needs NumPy and llama.cpp's gguf-py (--gguf-py, default: the tree that
../shared/anchors/llamacpp/setup.sh extracts, $HOME/.cache/strata-anchor/llama.cpp/gguf-py).
gguf-py imports sentencepiece, which is not needed here: a stand-in module is put in its place
when it is missing, and tokenizer.model (a SentencePiece ModelProto) is parsed by hand.
"""
import argparse
import json
import os
import shutil
import sys
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = {
    "mixtral-mini": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                         intermediate_size=3584, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                 intermediate_size=128, vocab_size=32000, max_position_embeddings=4096),
}


def mixtral_config(shape):
    """Mixtral-8x7B-v0.1's config.json (transformers 4.4x) with the shape's sizes."""
    c = {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": "mixtral",
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.45.0",
        "use_cache": True,
    }
    c.update(SHAPES[shape])
    return c


# ----------------------------------------------------------------------------- weights

def hf_tensors(c):
    """(name, shape, kind) in model order; kind picks the init scale."""
    h, f, e = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    v = c["vocab_size"]
    out = [("model.embed_tokens.weight", [v, h], "embed")]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", [h], "norm"),
                (p + "self_attn.q_proj.weight", [q, h], "in"),
                (p + "self_attn.k_proj.weight", [kv, h], "in"),
                (p + "self_attn.v_proj.weight", [kv, h], "in"),
                (p + "self_attn.o_proj.weight", [h, q], "out"),
                (p + "post_attention_layernorm.weight", [h], "norm"),
                (p + "block_sparse_moe.gate.weight", [e, h], "router")]
        for j in range(e):
            x = f"{p}block_sparse_moe.experts.{j}."
            out += [(x + "w1.weight", [f, h], "in"), (x + "w2.weight", [h, f], "out"),
                    (x + "w3.weight", [f, h], "in")]
    out += [("model.norm.weight", [h], "norm"), ("lm_head.weight", [v, h], "head")]
    return out


def init_tensor(seed, index, shape, kind):
    rng = np.random.default_rng([seed, index])
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        return 1.0 + np.float32(0.1) * x
    scale = {"embed": 0.3, "head": 0.2, "router": 1.0 / np.sqrt(shape[1]),
             "in": 1.0 / np.sqrt(shape[1]), "out": 0.7 / np.sqrt(shape[1])}[kind]
    x *= np.float32(scale)
    return x


def write_safetensors(path, c, seed):
    """8-byte LE header length, JSON header (padded with spaces to 8 bytes), raw f32 data,
    each tensor generated and written in turn."""
    specs = hf_tensors(c)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in specs:
        n = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for index, (name, shape, kind) in enumerate(specs):
            init_tensor(seed, index, shape, kind).astype("<f4", copy=False).tofile(f)
    os.replace(tmp, path)


def read_safetensors(path):
    """name -> read-only memmapped f32 array."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = mm[8 + n + a:8 + n + b].view("<f4").reshape(t["shape"])
    return out


# ----------------------------------------------------------------------------- vocabulary

def read_varint(buf, i):
    r = s = 0
    while True:
        b = buf[i]
        i += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            return r, i


def protobuf_fields(buf):
    """(field number, wire type, value) of one protobuf message (values: int or bytes)."""
    i = 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = read_varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} not supported")
        yield field, wire, v


def read_sentencepiece(path):
    """ModelProto.pieces (field 1): SentencePiece {1: piece, 2: score, 3: type}. Returns
    (pieces as bytes, scores, types); the types are SentencePiece's enum (NORMAL 1, UNKNOWN 2,
    CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6), which gguf's token types equal."""
    pieces, scores, types_ = [], [], []
    with open(path, "rb") as f:
        buf = f.read()
    for field, wire, v in protobuf_fields(buf):
        if field != 1 or wire != 2:
            continue
        piece, score, kind = b"", 0.0, 1
        for pf, pw, pv in protobuf_fields(v):
            if pf == 1 and pw == 2:
                piece = bytes(pv)
            elif pf == 2 and pw == 5:
                score = float(np.frombuffer(pv, "<f4")[0])
            elif pf == 3 and pw == 0:
                kind = pv
        pieces.append(piece)
        scores.append(score)
        types_.append(kind)
    return pieces, scores, types_


# ----------------------------------------------------------------------------- GGUF

def import_gguf(gguf_py):
    try:
        import sentencepiece  # noqa: F401
    except ImportError:  # gguf/vocab.py imports it at load; nothing here uses it
        stub = types.ModuleType("sentencepiece")
        stub.SentencePieceProcessor = None
        sys.modules["sentencepiece"] = stub
    sys.path.insert(0, gguf_py)
    import gguf
    return gguf


def permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows to llama.cpp's
    interleaved pairs, per head."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(c, st):
    """(gguf name, shape, producer) in the order convert_hf_to_gguf.py emits them."""
    nh, nkv, e = c["num_attention_heads"], c["num_key_value_heads"], c["num_local_experts"]
    out = [("token_embd.weight", st["model.embed_tokens.weight"].shape,
            lambda: st["model.embed_tokens.weight"])]
    for n in range(c["num_hidden_layers"]):
        p, b = f"model.layers.{n}.", f"blk.{n}."
        x = p + "block_sparse_moe.experts."

        def stack(w, x=x):
            return lambda: np.stack([st[f"{x}{j}.{w}.weight"] for j in range(e)])

        def get(name):
            return lambda: st[name]

        out += [
            (b + "attn_norm.weight", st[p + "input_layernorm.weight"].shape, get(p + "input_layernorm.weight")),
            (b + "attn_q.weight", st[p + "self_attn.q_proj.weight"].shape,
             lambda p=p: permute(st[p + "self_attn.q_proj.weight"], nh)),
            (b + "attn_k.weight", st[p + "self_attn.k_proj.weight"].shape,
             lambda p=p: permute(st[p + "self_attn.k_proj.weight"], nkv)),
            (b + "attn_v.weight", st[p + "self_attn.v_proj.weight"].shape, get(p + "self_attn.v_proj.weight")),
            (b + "attn_output.weight", st[p + "self_attn.o_proj.weight"].shape, get(p + "self_attn.o_proj.weight")),
            (b + "ffn_norm.weight", st[p + "post_attention_layernorm.weight"].shape,
             get(p + "post_attention_layernorm.weight")),
            (b + "ffn_gate_inp.weight", st[p + "block_sparse_moe.gate.weight"].shape,
             get(p + "block_sparse_moe.gate.weight")),
            # w1 gate, w2 down, w3 up (gguf-py's tensor_mapping for "mixtral (merged)")
            (b + "ffn_gate_exps.weight", (e, *st[x + "0.w1.weight"].shape), stack("w1")),
            (b + "ffn_down_exps.weight", (e, *st[x + "0.w2.weight"].shape), stack("w2")),
            (b + "ffn_up_exps.weight", (e, *st[x + "0.w3.weight"].shape), stack("w3")),
        ]
    out += [("output_norm.weight", st["model.norm.weight"].shape, lambda: st["model.norm.weight"]),
            ("output.weight", st["lm_head.weight"].shape, lambda: st["lm_head.weight"])]
    return out


def write_gguf(path, c, st, tokenizer, gguf, name):
    w = gguf.GGUFWriter(path + ".part", "llama")
    h, nh = c["hidden_size"], c["num_attention_heads"]
    # Model.set_gguf_parameters + LlamaModel.set_gguf_parameters, in their order.
    w.add_name(name)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(h // nh)
    # LlamaModel.set_vocab -> _set_vocab_sentencepiece, then SpecialVocab from config.json.
    pieces, scores, toktypes = read_sentencepiece(tokenizer)
    if len(pieces) != c["vocab_size"]:
        raise SystemExit(f"{tokenizer}: {len(pieces)} pieces, the model has {c['vocab_size']}")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    specs = gguf_tensors(c, st)
    for tname, shape, _ in specs:
        w.add_tensor_info(tname, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, shape, produce in specs:
        a = np.ascontiguousarray(produce(), dtype=np.float32)
        assert a.shape == tuple(shape), (tname, a.shape, shape)
        w.write_tensor_data(a)
        del a
    w.close()
    os.replace(path + ".part", path)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="mixtral-mini", choices=sorted(SHAPES))
    p.add_argument("--gguf-py", default=os.path.expanduser("~/.cache/strata-anchor/llama.cpp/gguf-py"))
    p.add_argument("--tokenizer", default=os.path.join(
        os.environ.get("STRATA_SHARED", os.path.join(HERE, "..", "..", "shared")),
        "anchors", "llamacpp", "tokenizer.model"))
    p.add_argument("--no-hf-tokenizer", action="store_true",
                   help="leave tokenizer.model out of the HF folder (prompts are then token ids)")
    a = p.parse_args(argv)
    if not os.path.isfile(a.tokenizer):
        p.error(f"no tokenizer.model at {a.tokenizer} (--tokenizer)")
    gguf = import_gguf(a.gguf_py)

    c = mixtral_config(a.shape)
    hf = os.path.join(a.out, f"hf-{a.shape}")
    os.makedirs(hf, exist_ok=True)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    st_path = os.path.join(hf, "model.safetensors")
    if not os.path.isfile(st_path):
        write_safetensors(st_path, c, a.seed)
        print(f"wrote {st_path}", file=sys.stderr)
    tok = os.path.join(hf, "tokenizer.model")
    if a.no_hf_tokenizer:
        if os.path.exists(tok):
            os.remove(tok)
    else:
        shutil.copyfile(a.tokenizer, tok)
    gguf_path = os.path.join(a.out, f"{a.shape}-f32.gguf")
    if not os.path.isfile(gguf_path):
        write_gguf(gguf_path, c, read_safetensors(st_path), a.tokenizer, gguf, a.shape)
        print(f"wrote {gguf_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
