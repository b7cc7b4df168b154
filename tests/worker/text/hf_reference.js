// Reference encodings from Hugging Face tokenizers (node bindings) for test_hf_tokenizer.
// Usage: node hf_reference.js TOKENIZER_JSON INPUT.jsonl OUTPUT.jsonl [--add-special]
// Input lines are {"text": ...}; each output line is {"ids": [...], "decoded": "..."}, where
// `decoded` is decode(ids, skip_special_tokens=false). An input line {"ids": [...]} instead
// asks only for the decode of those ids: {"decoded": "..."}. The package location comes from
// STRATA_REFERENCES (scripts/fetch-references.sh unpacks it there).
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const args = process.argv.slice(2);
  const addSpecial = args.includes('--add-special');
  const [tokenizerPath, inputPath, outputPath] = args.filter((a) => a !== '--add-special');
  if (!tokenizerPath || !inputPath || !outputPath) {
    throw new Error('usage: hf_reference.js TOKENIZER_JSON INPUT.jsonl OUTPUT.jsonl [--add-special]');
  }
  const refs = process.env.STRATA_REFERENCES ||
      path.join(process.env.HOME || '/root', '.cache/strata/references');
  const {Tokenizer} = require(path.join(refs, 'tokenizers/package/index.js'));
  const tokenizer = Tokenizer.fromFile(tokenizerPath);
  const lines = fs.readFileSync(inputPath, 'utf8').split('\n').filter((l) => l.length > 0);
  const out = [];
  // One text at a time, as the engine encodes requests (no batch API, no padding).
  for (const line of lines) {
    const input = JSON.parse(line);
    if (Array.isArray(input.ids)) {
      out.push(JSON.stringify({decoded: await tokenizer.decode(input.ids, false)}));
      continue;
    }
    const enc = await tokenizer.encode(input.text, null, {addSpecialTokens: addSpecial});
    const ids = enc.getIds();
    const decoded = await tokenizer.decode(ids, false);
    out.push(JSON.stringify({ids, decoded}));
  }
  fs.writeFileSync(outputPath, out.join('\n') + (out.length ? '\n' : ''));
}

main().catch((e) => {
  process.stderr.write(`hf_reference.js: ${e.stack || e}\n`);
  process.exit(1);
});
