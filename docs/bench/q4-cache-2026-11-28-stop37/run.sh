#!/bin/bash
# Interleaved: old (HEAD before stop 37) vs new strata, same model, same flags.
A=~/.cache/strata-anchor/hf-llama110m
OLD=/work/old-head/build-old/launch/strata
NEW=/work/main/build/launch/strata
for round in 1 2; do
  for row in "cc-b32 32 --policy cc=1" "cc-b1 1 --policy cc=1" "f32-b32 32"; do
    set -- $row
    name=$1; batch=$2; shift 2
    for which in old new; do
      bin=$OLD; [ $which = new ] && bin=$NEW
      $bin bench --model $A --prompt-len 128 --gen-len 64 --batch $batch --threads 2 \
        --max-step-tokens 4096 --no-limits --profile "$@" > $which-$name-r$round.json 2>/dev/null || echo "FAIL $which $name"
      python3 -c "
import json; d=json.load(open('$which-$name-r$round.json')); r=d['result']
p=d.get('profile',{})
att=p.get('attention',{}).get('seconds'); kv=p.get('kv_store',{}).get('seconds')
print('$which $name r$round gen', r['generation_tokens_per_s'], 'dec', r['decode_tokens_per_s'], 'prefill_s', r['prefill_seconds'], 'attn_s', att, 'kv_store_s', kv, 'peak_rss', d.get('peak_rss_bytes'))"
    done
  done
done
