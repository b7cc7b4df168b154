// OPT: a one-token example computed by hand from closed-form expressions, a naive
// double-precision reference of Hugging Face's OPTForCausalLM over several tokens (learned
// positions at offset 2, pre-LayerNorm, ReLU, final layer norm, tied head, biases), both
// loaded through real safetensors files; and dummy:opt-125m determinism.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "coordinator/run/local_stages.h"
#include "kernels/cpu_backend.h"
#include "support/folding_backend.h"
#include "worker/loader.h"
#include "worker/safetensors.h"
#include "worker/scoring.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

struct TinyOpt {
  int hidden, heads, ffn, vocab, layers, max_pos;
  std::map<std::string, std::vector<float>> tensors;
  std::map<std::string, Shape> shapes;

  void set(const std::string& name, Shape shape, std::vector<float> values) {
    EXPECT_EQ(static_cast<int64_t>(values.size()), shape.numel()) << name;
    tensors[name] = std::move(values);
    shapes[name] = shape;
  }
  std::vector<float>& at(const std::string& name) { return tensors.at(name); }

  // Writes config.json + model.safetensors; `prefix` is "model." or "" (both occur in the wild).
  // `pre_ln` false: OPT-350m's post-LayerNorm layers; `proj` > 0: word_embed_proj_dim.
  std::string write(const std::string& test_name, const std::string& prefix = "model.",
                    bool pre_ln = true, int proj = 0) {
    const fs::path dir = fs::path(STRATA_TEST_TMP) / test_name;
    fs::create_directories(dir);
    const nlohmann::json config = {{"architectures", {"OPTForCausalLM"}},
                                   {"model_type", "opt"},
                                   {"hidden_size", hidden},
                                   {"ffn_dim", ffn},
                                   {"num_hidden_layers", layers},
                                   {"num_attention_heads", heads},
                                   {"vocab_size", vocab},
                                   {"max_position_embeddings", max_pos},
                                   {"do_layer_norm_before", pre_ln},
                                   {"word_embed_proj_dim", proj > 0 ? proj : hidden},
                                   {"activation_function", "relu"},
                                   {"bos_token_id", 2},
                                   {"eos_token_id", 2},
                                   {"torch_dtype", "float32"}};
    std::ofstream(dir / "config.json") << config.dump();
    std::vector<TensorToWrite> out;
    for (auto& [name, values] : tensors) {
      Tensor t;
      t.data = values.data();
      t.shape = shapes[name];
      out.push_back({prefix + name, t});
    }
    write_safetensors((dir / "model.safetensors").string(), out);
    return dir.string();
  }
};

std::vector<float> random_values(std::mt19937& rng, size_t n, float scale) {
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// `pre_ln` and `proj` as in TinyOpt::write: a post-LayerNorm model has no final layer norm
// (HF's OPTDecoder creates it only with do_layer_norm_before), and a word_embed_proj_dim e
// other than hidden h gives embeddings [vocab, e] and bias-free project_in [h, e] and
// project_out [e, h].
TinyOpt random_opt(unsigned seed, bool pre_ln = true, int proj_dim = 0) {
  TinyOpt m{8, 2, 12, 11, 2, 16, {}, {}};
  std::mt19937 rng(seed);
  const int64_t h = m.hidden, f = m.ffn, e = proj_dim > 0 ? proj_dim : h;
  m.set("decoder.embed_tokens.weight", {m.vocab, e},
        random_values(rng, static_cast<size_t>(m.vocab * e), 1.0f));
  m.set("decoder.embed_positions.weight", {m.max_pos + 2, h},
        random_values(rng, static_cast<size_t>((m.max_pos + 2) * h), 1.0f));
  if (pre_ln) {
    m.set("decoder.final_layer_norm.weight", {h}, random_values(rng, static_cast<size_t>(h), 0.5f));
    m.set("decoder.final_layer_norm.bias", {h}, random_values(rng, static_cast<size_t>(h), 0.5f));
  }
  if (proj_dim > 0) {
    m.set("decoder.project_in.weight", {h, e},
          random_values(rng, static_cast<size_t>(h * e), 0.6f));
    m.set("decoder.project_out.weight", {e, h},
          random_values(rng, static_cast<size_t>(e * h), 0.6f));
  }
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = "decoder.layers." + std::to_string(l) + ".";
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      m.set(p + "self_attn." + proj + ".weight", {h, h},
            random_values(rng, static_cast<size_t>(h * h), 0.5f));
      m.set(p + "self_attn." + proj + ".bias", {h},
            random_values(rng, static_cast<size_t>(h), 0.2f));
    }
    for (const char* ln : {"self_attn_layer_norm", "final_layer_norm"}) {
      auto w = random_values(rng, static_cast<size_t>(h), 0.3f);
      for (auto& x : w) x += 1.0f;
      m.set(p + ln + ".weight", {h}, w);
      m.set(p + ln + ".bias", {h}, random_values(rng, static_cast<size_t>(h), 0.2f));
    }
    m.set(p + "fc1.weight", {f, h}, random_values(rng, static_cast<size_t>(f * h), 0.5f));
    m.set(p + "fc1.bias", {f}, random_values(rng, static_cast<size_t>(f), 0.2f));
    m.set(p + "fc2.weight", {h, f}, random_values(rng, static_cast<size_t>(h * f), 0.5f));
    m.set(p + "fc2.bias", {h}, random_values(rng, static_cast<size_t>(h), 0.2f));
  }
  return m;
}

// --- naive reference, double precision, straight from HF's modeling_opt.py ---------------
using Vec = std::vector<double>;

Vec layer_norm(const Vec& x, const std::vector<float>& w, const std::vector<float>& b) {
  double mean = 0, var = 0;
  for (double v : x) mean += v;
  mean /= static_cast<double>(x.size());
  for (double v : x) var += (v - mean) * (v - mean);
  var /= static_cast<double>(x.size());
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = (x[i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i];
  return y;
}

Vec linear(const Vec& x, const std::vector<float>& w, const std::vector<float>* b, size_t out) {
  Vec y(out, 0.0);
  for (size_t o = 0; o < out; ++o) {
    for (size_t i = 0; i < x.size(); ++i) y[o] += static_cast<double>(w[o * x.size() + i]) * x[i];
    if (b) y[o] += (*b)[o];
  }
  return y;
}

// HF's OPTDecoderLayer: with do_layer_norm_before (pre_ln) each block normalises its input;
// without it (OPT-350m) each block normalises the residual sum after it, and the decoder has
// no final layer norm (applied here when the weights have one). project_in maps the
// token embedding (before the positions are added), project_out the final hidden state
// (after the final layer norm, if any) to word_embed_proj_dim for the tied head.
std::vector<Vec> reference_logits(TinyOpt& m, const std::vector<int32_t>& ids, bool pre_ln = true,
                                  int proj = 0) {
  const size_t h = static_cast<size_t>(m.hidden), hd = h / static_cast<size_t>(m.heads);
  const size_t e = proj > 0 ? static_cast<size_t>(proj) : h;
  std::vector<Vec> x(ids.size(), Vec(h));
  for (size_t t = 0; t < ids.size(); ++t) {
    Vec tok(e);
    for (size_t i = 0; i < e; ++i)
      tok[i] = m.at("decoder.embed_tokens.weight")[static_cast<size_t>(ids[t]) * e + i];
    if (proj > 0) tok = linear(tok, m.at("decoder.project_in.weight"), nullptr, h);
    for (size_t i = 0; i < h; ++i)
      x[t][i] = tok[i] + m.at("decoder.embed_positions.weight")[(t + 2) * h + i];  // offset 2
  }
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = "decoder.layers." + std::to_string(l) + ".";
    auto W = [&](const std::string& n) -> std::vector<float>& { return m.at(p + n); };
    std::vector<Vec> q, k, v;
    for (auto& xt : x) {
      const Vec hn =
          pre_ln ? layer_norm(xt, W("self_attn_layer_norm.weight"), W("self_attn_layer_norm.bias"))
                 : xt;
      q.push_back(linear(hn, W("self_attn.q_proj.weight"), &W("self_attn.q_proj.bias"), h));
      k.push_back(linear(hn, W("self_attn.k_proj.weight"), &W("self_attn.k_proj.bias"), h));
      v.push_back(linear(hn, W("self_attn.v_proj.weight"), &W("self_attn.v_proj.bias"), h));
    }
    for (size_t t = 0; t < x.size(); ++t) {
      Vec attn(h, 0.0);
      for (size_t hh = 0; hh < static_cast<size_t>(m.heads); ++hh) {
        std::vector<double> s(t + 1);
        double mx = -1e300, sum = 0;
        for (size_t u = 0; u <= t; ++u) {
          double d = 0;
          for (size_t j = 0; j < hd; ++j) d += q[t][hh * hd + j] * k[u][hh * hd + j];
          s[u] = d / std::sqrt(static_cast<double>(hd));  // HF scales q by head_dim^-0.5
          mx = std::max(mx, s[u]);
        }
        for (auto& a : s) sum += (a = std::exp(a - mx));
        for (size_t u = 0; u <= t; ++u)
          for (size_t j = 0; j < hd; ++j) attn[hh * hd + j] += s[u] / sum * v[u][hh * hd + j];
      }
      const Vec o = linear(attn, W("self_attn.out_proj.weight"), &W("self_attn.out_proj.bias"), h);
      for (size_t i = 0; i < h; ++i) x[t][i] += o[i];
      if (!pre_ln)
        x[t] = layer_norm(x[t], W("self_attn_layer_norm.weight"), W("self_attn_layer_norm.bias"));
      const Vec hn =
          pre_ln ? layer_norm(x[t], W("final_layer_norm.weight"), W("final_layer_norm.bias"))
                 : x[t];
      Vec f = linear(hn, W("fc1.weight"), &W("fc1.bias"), static_cast<size_t>(m.ffn));
      for (auto& a : f) a = std::max(a, 0.0);  // ReLU
      const Vec d = linear(f, W("fc2.weight"), &W("fc2.bias"), h);
      for (size_t i = 0; i < h; ++i) x[t][i] += d[i];
      if (!pre_ln)
        x[t] = layer_norm(x[t], W("final_layer_norm.weight"), W("final_layer_norm.bias"));
    }
  }
  std::vector<Vec> logits;
  for (auto& xt : x) {
    Vec y = m.tensors.count("decoder.final_layer_norm.weight")
                ? layer_norm(xt, m.at("decoder.final_layer_norm.weight"),
                             m.at("decoder.final_layer_norm.bias"))
                : xt;
    if (proj > 0) y = linear(y, m.at("decoder.project_out.weight"), nullptr, e);
    logits.push_back(linear(y, m.at("decoder.embed_tokens.weight"), nullptr,
                            static_cast<size_t>(m.vocab)));  // tied
  }
  return logits;
}

std::vector<float> strata_logits(const std::string& dir, const std::vector<int32_t>& ids,
                                 int32_t chunk, Backend* on = nullptr) {
  CpuBackend cpu(1);
  Backend& backend = on != nullptr ? *on : cpu;
  LoadedModel lm = load_model(dir);
  Model model(lm.config, std::move(lm.weights), backend, 64);
  return teacher_forced_logits(model, ids, chunk);
}

TEST(Opt, OneTokenByHand) {
  // hidden 2, one head, ffn 2, vocab 3. Token 1 at position 0 reads position row 0 + 2.
  TinyOpt m{2, 1, 2, 3, 1, 4, {}, {}};
  m.set("decoder.embed_tokens.weight", {3, 2}, {0, 1, 1, 0, 1, 1});
  std::vector<float> pos(12, 0.0f);
  pos[2 * 2 + 1] = 2.0f;  // row 2 = [0, 2]; rows 0 and 1 stay zero
  m.set("decoder.embed_positions.weight", {6, 2}, pos);
  const std::string p = "decoder.layers.0.";
  m.set(p + "self_attn_layer_norm.weight", {2}, {1, 1});
  m.set(p + "self_attn_layer_norm.bias", {2}, {0, 0});
  m.set(p + "final_layer_norm.weight", {2}, {1, 1});
  m.set(p + "final_layer_norm.bias", {2}, {0, 0});
  m.set(p + "self_attn.q_proj.weight", {2, 2}, {3, 1, 4, 1});  // one token: q, k do not matter
  m.set(p + "self_attn.q_proj.bias", {2}, {5, 9});
  m.set(p + "self_attn.k_proj.weight", {2, 2}, {2, 6, 5, 3});
  m.set(p + "self_attn.k_proj.bias", {2}, {5, 8});
  m.set(p + "self_attn.v_proj.weight", {2, 2}, {1, 0, 0, 1});
  m.set(p + "self_attn.v_proj.bias", {2}, {0.5f, 0});
  m.set(p + "self_attn.out_proj.weight", {2, 2}, {0, 1, 1, 0});
  m.set(p + "self_attn.out_proj.bias", {2}, {0, 0});
  m.set(p + "fc1.weight", {2, 2}, {1, 0, 0, 1});
  m.set(p + "fc1.bias", {2}, {0, 0});
  m.set(p + "fc2.weight", {2, 2}, {2, 0, 0, 1});
  m.set(p + "fc2.bias", {2}, {0, 1});
  m.set("decoder.final_layer_norm.weight", {2}, {1, 2});
  m.set("decoder.final_layer_norm.bias", {2}, {0, 1});
  const std::string dir = m.write("OneTokenByHand");

  // x = embed[1] + pos[2] = [1, 2]; LN -> [-a, a] with a = 0.5 / sqrt(0.25 + eps).
  const double eps = 1e-5, a = 0.5 / std::sqrt(0.25 + eps);
  // One key: softmax = 1, attention = v = [-a + 0.5, a]; out_proj swaps: [a, 0.5 - a].
  double x0 = 1 + a, x1 = 2 + 0.5 - a;
  // MLP LN: deviations +-d, d = (x0 - x1) / 2, normalised to +-b.
  const double d = (x0 - x1) / 2, b = d / std::sqrt(d * d + eps);
  // fc1 = identity, ReLU keeps [b, 0] (b > 0); fc2 = diag(2, 1) + [0, 1] -> [2b, 1].
  x0 += 2 * b;
  x1 += 1;
  // Final LN with weight [1, 2], bias [0, 1]: +-c, c = ((x0 - x1) / 2) / sqrt(...).
  const double e = (x0 - x1) / 2, c = e / std::sqrt(e * e + eps);
  const double y0 = c, y1 = -c * 2 + 1;
  // Tied head: logits = embed . y
  const double expected[3] = {y1, y0, y0 + y1};

  const auto got = strata_logits(dir, {1}, 1);
  for (int i = 0; i < 3; ++i)
    EXPECT_NEAR(got[static_cast<size_t>(i)], expected[i], 1e-5) << "logit " << i;
}

TEST(Opt, MatchesNaiveReferenceOverSeveralTokens) {
  TinyOpt m = random_opt(7);
  const std::string dir = m.write("NaiveReference");
  const std::vector<int32_t> ids = {2, 5, 9, 1, 0, 10, 3};
  const auto ref = reference_logits(m, ids);
  for (int32_t chunk : {7, 1, 3}) {
    const auto got = strata_logits(dir, ids, chunk);
    for (size_t t = 0; t < ids.size(); ++t)
      for (size_t v = 0; v < static_cast<size_t>(m.vocab); ++v)
        EXPECT_NEAR(got[t * static_cast<size_t>(m.vocab) + v], ref[t][v], 2e-5)
            << "t=" << t << " v=" << v << " chunk " << chunk;
  }
}

// OPT-350m's two differences from the other OPT sizes, alone and together: post-LayerNorm
// layers without a final layer norm, and word_embed_proj_dim (here 6) != hidden (8).
TEST(Opt, PostLayerNormAndProjectionsMatchNaiveReference) {
  const std::vector<int32_t> ids = {2, 5, 9, 1, 0, 10, 3};
  for (auto [pre_ln, proj] : {std::pair{false, 0}, {true, 6}, {false, 6}}) {
    TinyOpt m = random_opt(13, pre_ln, proj);
    const std::string name = fmt::format("Variant_ln{}_proj{}", pre_ln ? "pre" : "post", proj);
    const std::string dir = m.write(name, "model.", pre_ln, proj);
    const auto ref = reference_logits(m, ids, pre_ln, proj);
    // The variant matters: the standard model's reference on the same weights differs.
    double differs = 0;
    if (proj == 0) {
      const auto standard = reference_logits(m, ids, true, 0);
      for (size_t t = 0; t < ids.size(); ++t)
        for (size_t v = 0; v < static_cast<size_t>(m.vocab); ++v)
          differs = std::max(differs, std::fabs(standard[t][v] - ref[t][v]));
      EXPECT_GT(differs, 0.1) << name;
    }
    for (int32_t chunk : {7, 1, 3}) {
      const auto got = strata_logits(dir, ids, chunk);
      ASSERT_EQ(got.size(), ids.size() * static_cast<size_t>(m.vocab)) << name;
      for (size_t t = 0; t < ids.size(); ++t)
        for (size_t v = 0; v < static_cast<size_t>(m.vocab); ++v)
          EXPECT_NEAR(got[t * static_cast<size_t>(m.vocab) + v], ref[t][v], 2e-5)
              << name << " t=" << t << " v=" << v << " chunk " << chunk;
    }
  }
}

// The folded paths give the naive reference's logits, pre- and post-LayerNorm. With the
// linears declined: fc1's ReLU folded once per layer and forward pass, the output and down
// projections added into the residual twice. With them taken: q, k and v as one call and fc1
// with its ReLU as another, the pre-LayerNorm model's norms folded into both.
TEST(Opt, FoldedEpiloguesMatchNaiveReference) {
  const std::vector<int32_t> ids = {2, 5, 9, 1, 0, 10, 3};
  for (const bool pre_ln : {true, false}) {
    TinyOpt m = random_opt(17, pre_ln, 0);
    const std::string dir = m.write(pre_ln ? "FoldedPreLn" : "FoldedPostLn", "model.", pre_ln);
    const auto ref = reference_logits(m, ids, pre_ln, 0);
    for (const bool sets : {false, true})
      for (int32_t chunk : {1, 7}) {
        CpuBackend cpu(1);
        testing::FoldingBackend folding(cpu, sets);
        const auto got = strata_logits(dir, ids, chunk, &folding);
        const int passes = static_cast<int>((ids.size() + static_cast<size_t>(chunk) - 1) /
                                            static_cast<size_t>(chunk));
        EXPECT_EQ(folding.relu_calls, sets ? 0 : m.layers * passes);
        EXPECT_EQ(folding.accumulate_calls, 2 * m.layers * passes);
        EXPECT_EQ(folding.linears_calls, sets ? 2 * m.layers * passes : 0);
        EXPECT_EQ(folding.norm_folds, sets && pre_ln ? 2 * m.layers * passes : 0);
        // kv_store and attention as one call where each pass is one new row a sequence.
        EXPECT_EQ(folding.attend_folds, sets && chunk == 1 ? m.layers * passes : 0);
        for (size_t t = 0; t < ids.size(); ++t)
          for (size_t v = 0; v < static_cast<size_t>(m.vocab); ++v)
            EXPECT_NEAR(got[t * static_cast<size_t>(m.vocab) + v], ref[t][v], 2e-5)
                << "pre_ln " << pre_ln << " sets " << sets << " t=" << t << " v=" << v << " chunk "
                << chunk;
      }
  }
}

TEST(Opt, CheckpointsWithoutModelPrefixLoadTheSame) {
  TinyOpt m = random_opt(11);
  const std::vector<int32_t> ids = {2, 4, 6};
  const auto with = strata_logits(m.write("Prefixed", "model."), ids, 3);
  const auto without = strata_logits(m.write("Unprefixed", ""), ids, 3);
  EXPECT_EQ(with, without);
}

TEST(Opt, DummyOpt125mIsDeterministicForASeed) {
  CpuBackend backend(2);
  auto run = [&](uint64_t weight_seed) {
    LoadOptions lo;
    lo.dummy_seed = weight_seed;
    LoadedModel lm = load_model("dummy:opt-125m", lo);
    EXPECT_EQ(lm.config.hidden, 768);
    EXPECT_EQ(lm.config.n_layers, 12);
    EXPECT_EQ(lm.config.vocab, 50272);
    Model model(lm.config, std::move(lm.weights), backend, 16);
    LocalCluster gen(model, LocalOptions{2, 16, 0});
    GenerationRequest a{"a", {2, 100, 200, 300}, 6, {}, true};
    GenerationRequest b{"b", {2, 7}, 6, SamplingParams{1.0f, 0, 1.0f, 5}, true};
    std::vector<std::vector<int32_t>> out;
    for (const auto& r : gen.run({a, b})) out.push_back(r.output_ids);
    return out;
  };
  const auto first = run(0);
  EXPECT_EQ(first, run(0));
  EXPECT_EQ(first[0].size(), 6u);
  EXPECT_NE(first, run(1)) << "a different weight seed should change the model";
}

}  // namespace
}  // namespace strata
