#!/usr/bin/env bash
# Issue 10's corrupt and hostile model folders, replayed through the real binary: each is a
# copy of stories260K with one thing wrong. Every one must end within a minute with exactly
# one error line that names the problem (never garbage with exit 0, a crash or a hang); the
# cases about memory run under a virtual-memory cap.
# Usage: test_model_files.sh STRATA_BINARY STORIES_MODEL_DIR
set -u
STRATA=$1
MODEL=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0
passes=0
# ASan and TSan reserve terabytes of address space: no ulimit -v under them, and no
# out-of-memory case.
SANITIZED=0
if ldd "$STRATA" 2>/dev/null | grep -qE 'lib(asan|tsan)'; then SANITIZED=1; fi
CAP_KB=4000000  # 4 GB: far above what stories260K needs, far below what the configs ask for

python3 - "$MODEL" "$TMP" <<'PY'
import json, os, shutil, struct, sys

src, out = sys.argv[1], sys.argv[2]
raw = open(os.path.join(src, "model.safetensors"), "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = raw[8 : 8 + n]
pad = len(header) - len(header.rstrip(b" "))
assert pad > 0, "stories260K's header is padded; the shortened-header case needs that"
meta = json.loads(header)


def folder(name, weights=raw, config=None, drop=(), files=None):
    d = os.path.join(out, name)
    os.makedirs(d)
    cfg = json.load(open(os.path.join(src, "config.json")))
    for k, v in (config or {}).items():
        cfg[k] = v
    for k in drop:
        del cfg[k]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), d)
    if weights is not None:
        open(os.path.join(d, "model.safetensors"), "wb").write(weights)
    for f, data in (files or {}).items():
        open(os.path.join(d, f), "wb").write(data)


def with_nan(tensor, index):
    begin = meta[tensor]["data_offsets"][0]
    at = 8 + n + begin + 4 * index
    return raw[:at] + struct.pack("<f", float("nan")) + raw[at + 4 :]


folder("header-shortened-into-padding", struct.pack("<Q", n - pad) + raw[8:])
folder("byte-inserted-into-data", raw[: 8 + n + 1000] + b"\x00" + raw[8 + n + 1000 :])
folder("nan-weight", with_nan("model.layers.1.mlp.down_proj.weight", 2 * 172 + 5))
folder("rope-factor-0", config={"rope_scaling": {"rope_type": "linear", "factor": 0}})
folder("rope-factor-minus-1", config={"rope_scaling": {"rope_type": "llama3", "factor": -1}})
folder("eps-1e308", config={"rms_norm_eps": 1e308})
folder("layers-2^31-1", config={"num_hidden_layers": 2**31 - 1})
folder("max-positions-2e8", config={"max_position_embeddings": 200000000})
folder("bos-600", config={"bos_token_id": 600})
folder("model-type-number", config={"model_type": 7, "architectures": None})
folder("corrupt-tokenizer", files={"tokenizer.model": b"\x0a\xff\xff\xff\xff\x0f"})
# Sharded: the index names a shard that has one byte too many.
folder("sharded-corrupt-shard", weights=None, files={
    "model-00001-of-00001.safetensors": raw + b"\x00",
    "model.safetensors.index.json": json.dumps({"weight_map": {
        k: "model-00001-of-00001.safetensors" for k in meta if k != "__metadata__"}}).encode()})
folder("sharded-escaping-shard", weights=None, files={
    "model.safetensors.index.json": json.dumps({"weight_map": {
        "model.embed_tokens.weight": "../header-shortened-into-padding/model.safetensors"}}).encode()})
PY
[ $? -eq 0 ] || { echo "FAIL: could not build the model folders"; exit 1; }

# expect NAME WANT_RC PATTERN [STRATA ARGS...]: generate on the folder NAME ends with exit
# WANT_RC and one non-log stderr line matching PATTERN.
expect() {
  local name=$1 want_rc=$2 pattern=$3
  shift 3
  (
    [ "$SANITIZED" -eq 1 ] || ulimit -v "$CAP_KB"
    exec timeout 60 "$STRATA" generate --model "$TMP/$name" --prompt "Once upon a time" \
      --max-new-tokens 4 --threads 1 "$@"
  ) >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  local lines
  lines=$(grep -vc '^\[' "$TMP/err")
  if [ "$rc" -ne "$want_rc" ] || [ "$lines" -ne 1 ] || ! grep -q -- "$pattern" "$TMP/err"; then
    echo "FAIL $name: rc=$rc (want $want_rc), $lines non-log stderr lines, wanted /$pattern/:"
    head -c 2000 "$TMP/err"
    failures=$((failures + 1))
  else
    echo "ok   $name: $(grep -v '^\[' "$TMP/err")"
    passes=$((passes + 1))
  fi
}

expect header-shortened-into-padding 2 "model.safetensors: the data section is 1171206 bytes but the tensors end at byte 1171200"
expect byte-inserted-into-data 2 "model.safetensors: the data section is 1171201 bytes but the tensors end at byte 1171200"
expect nan-weight 2 "'model.layers.1.mlp.down_proj.weight' element \[2, 5\] (flat index 349) is nan" --check-weights
expect rope-factor-0 2 "config.json: rope_scaling.factor must be positive, got 0"
expect rope-factor-minus-1 2 "config.json: rope_scaling.factor must be positive, got -1"
expect eps-1e308 2 "config.json: field 'rms_norm_eps' = 1e+308 is not a finite 32-bit float"
expect "layers-2^31-1" 2 "config.json: num_hidden_layers = 2147483647 is above the limit of 1024 (input limit layers"
expect max-positions-2e8 2 "config.json: max_position_embeddings = 200000000 is above the limit of 1048576 (input limit context"
expect bos-600 2 "config.json: bos_token_id = 600 is outside the vocabulary \[0, 512)"
expect model-type-number 2 "config.json: field 'model_type' must be a string, got 7"
expect corrupt-tokenizer 2 "tokenizer.model: cannot load sentencepiece model"
expect sharded-corrupt-shard 2 "model-00001-of-00001.safetensors: the data section is 1171201 bytes"
expect sharded-escaping-shard 2 "is not a file name in the model directory"
if [ "$SANITIZED" -eq 0 ]; then
  # Raised past its limit, the context runs out of the capped memory: the error says where.
  expect max-positions-2e8 1 "out of memory while building the rotary tables of 200000000 positions" \
    --limit context=200000000
fi

echo "$passes passed, $failures failed"
[ "$failures" -eq 0 ]
