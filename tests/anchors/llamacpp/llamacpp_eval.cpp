// llama.cpp side of the family cross-check (tests/anchors/llamacpp/README.md). Not part of
// Strata's build: compiled by check-families-llamacpp.py with g++ against the libllama.so
// that the script builds from ../shared/anchors/llamacpp (llama.cpp c392e5094).
//   llamacpp_eval --model F.gguf --ids "1 2 3" [--new 32] [--logits-out F.f32]
//                 [--gen-logits-out G.f32] [--json-out F.json] [--threads 2] [--ctx N]
// Evaluates the prompt in one batch with logits at every position (KV cache f32, no flash
// attention), writes them raw little-endian f32 [n_prompt, n_vocab], then generates --new ids
// greedily (argmax, first index on ties): id 0 from the last prompt position, id k from
// feeding id k-1. --gen-logits-out gets the logits those ids were taken from, [new, n_vocab]
// (row 0 = the last prompt row). Prints {"greedy": [...], ...} as one JSON line on stdout.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static void usage() {
  std::fprintf(stderr,
               "usage: llamacpp_eval --model F.gguf --ids \"1 2 3\" [--new 32] [--logits-out F] "
               "[--gen-logits-out F] [--json-out F] [--threads 2] [--ctx N]\n");
  std::exit(2);
}

static int argmax(const float* v, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

static bool quiet = true;
static void log_cb(ggml_log_level level, const char* text, void*) {
  if (!quiet || level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
}

int main(int argc, char** argv) {
  std::string model_path, ids_str, logits_out, gen_logits_out, json_out;
  int n_new = 32, n_threads = 2, n_ctx_arg = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (a == "--model")
      model_path = next();
    else if (a == "--ids")
      ids_str = next();
    else if (a == "--new")
      n_new = std::atoi(next().c_str());
    else if (a == "--logits-out")
      logits_out = next();
    else if (a == "--gen-logits-out")
      gen_logits_out = next();
    else if (a == "--json-out")
      json_out = next();
    else if (a == "--threads")
      n_threads = std::atoi(next().c_str());
    else if (a == "--ctx")
      n_ctx_arg = std::atoi(next().c_str());
    else if (a == "--verbose")
      quiet = false;
    else
      usage();
  }
  if (model_path.empty() || ids_str.empty()) usage();
  std::vector<llama_token> prompt;
  {
    std::istringstream ss(ids_str);
    long v;
    while (ss >> v) prompt.push_back((llama_token)v);
  }
  const int n_prompt = (int)prompt.size();
  if (n_prompt == 0) usage();

  llama_log_set(log_cb, nullptr);
  llama_backend_init();

  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  mp.progress_callback = [](float, void*) { return true; };  // no progress dots
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (!model) {
    std::fprintf(stderr, "llamacpp_eval: cannot load %s\n", model_path.c_str());
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);
  for (llama_token t : prompt) {
    if (t < 0 || t >= n_vocab) {
      std::fprintf(stderr, "llamacpp_eval: id %d outside [0, %d)\n", t, n_vocab);
      return 1;
    }
  }

  const int need = n_prompt + n_new;
  llama_context_params cp = llama_context_default_params();
  // Just large enough (llama.cpp pads it to 32). It matters for Phi-3 with rope scaling:
  // llama.cpp takes the long factors when n_ctx > original_max_position_embeddings.
  cp.n_ctx = n_ctx_arg > 0 ? (uint32_t)n_ctx_arg : (uint32_t)((need + 31) / 32 * 32);
  cp.n_batch = cp.n_ubatch = (uint32_t)std::max(n_prompt, 64);  // >= GGML_KQ_MASK_PAD
  cp.n_seq_max = 1;
  cp.n_threads = cp.n_threads_batch = n_threads;
  cp.type_k = GGML_TYPE_F32;
  cp.type_v = GGML_TYPE_F32;
  cp.flash_attn = false;
  cp.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) {
    std::fprintf(stderr, "llamacpp_eval: cannot create context\n");
    return 1;
  }

  llama_batch batch = llama_batch_init(std::max(n_prompt, 1), 0, 1);
  batch.n_tokens = n_prompt;
  for (int i = 0; i < n_prompt; ++i) {
    batch.token[i] = prompt[i];
    batch.pos[i] = i;
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  if (llama_decode(ctx, batch) != 0) {
    std::fprintf(stderr, "llamacpp_eval: prompt decode failed\n");
    return 1;
  }

  if (!logits_out.empty()) {
    FILE* f = std::fopen(logits_out.c_str(), "wb");
    if (!f) {
      std::perror(logits_out.c_str());
      return 1;
    }
    for (int i = 0; i < n_prompt; ++i)
      std::fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
    std::fclose(f);
  }

  FILE* gf = nullptr;
  if (!gen_logits_out.empty()) {
    gf = std::fopen(gen_logits_out.c_str(), "wb");
    if (!gf) {
      std::perror(gen_logits_out.c_str());
      return 1;
    }
  }
  std::vector<int> greedy;
  const float* last = llama_get_logits_ith(ctx, n_prompt - 1);
  for (int k = 0; k < n_new; ++k) {
    if (gf) std::fwrite(last, sizeof(float), n_vocab, gf);
    const int id = argmax(last, n_vocab);
    greedy.push_back(id);
    if (k + 1 == n_new) break;
    batch.n_tokens = 1;
    batch.token[0] = id;
    batch.pos[0] = n_prompt + k;
    batch.n_seq_id[0] = 1;
    batch.seq_id[0][0] = 0;
    batch.logits[0] = 1;
    if (llama_decode(ctx, batch) != 0) {
      std::fprintf(stderr, "llamacpp_eval: decode failed at step %d\n", k);
      return 1;
    }
    last = llama_get_logits_ith(ctx, 0);
  }
  if (gf) std::fclose(gf);

  std::ostringstream js;
  js << "{\"greedy\": [";
  for (size_t i = 0; i < greedy.size(); ++i) js << (i ? ", " : "") << greedy[i];
  js << "], \"n_prompt\": " << n_prompt << ", \"n_vocab\": " << n_vocab
     << ", \"n_ctx\": " << llama_n_ctx(ctx) << ", \"n_threads\": " << n_threads << "}";
  std::printf("%s\n", js.str().c_str());
  if (!json_out.empty()) {
    FILE* f = std::fopen(json_out.c_str(), "w");
    if (!f) {
      std::perror(json_out.c_str());
      return 1;
    }
    std::fprintf(f, "%s\n", js.str().c_str());
    std::fclose(f);
  }

  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
