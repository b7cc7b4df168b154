// RoPE scaling (config.json's rope_scaling: "linear" and "llama3") against a naive
// double-precision Llama forward written here, whose rotary frequencies are computed by hand
// from Hugging Face's formulas (_compute_linear_scaling_rope_parameters,
// _compute_llama3_parameters). The reference itself is first checked against llama2.c's
// logits for the unscaled model, so only the frequencies differ between the runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <string>
#include <vector>

#include "kernels/cpu_backend.h"
#include "support/stories_reference.h"
#include "worker/loader.h"
#include "worker/scoring.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using Vec = std::vector<double>;

// stories260K with `rope_scaling` added to its config.json (weights linked, not copied).
std::string scaled_model_dir(const std::string& name, const nlohmann::json& rope_scaling) {
  const fs::path dir = fs::path(STRATA_TEST_TMP) / ("rope_" + name);
  fs::create_directories(dir);
  const fs::path src = testing::stories_dir();
  nlohmann::json config = nlohmann::json::parse(std::ifstream(src / "config.json"));
  config["rope_scaling"] = rope_scaling;
  std::ofstream(dir / "config.json") << config.dump(2);
  const fs::path weights = dir / "model.safetensors";
  if (!fs::exists(weights)) fs::create_symlink(src / "model.safetensors", weights);
  return dir.string();
}

Vec rms_norm(const Vec& x, const Tensor& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w.as<const float>()[i];
  return y;
}

Vec matvec(const Tensor& w, const Vec& x) {  // w [out, in] row-major, f32
  const auto out = static_cast<size_t>(w.shape[0]);
  Vec y(out, 0.0);
  for (size_t o = 0; o < out; ++o)
    for (size_t i = 0; i < x.size(); ++i) y[o] += w.as<const float>()[o * x.size() + i] * x[i];
  return y;
}

// Rotate-half RoPE (HF's apply_rotary_pos_emb) on every head of x at position `pos`.
void rotate(Vec& x, int32_t heads, int32_t hd, int32_t pos, const Vec& inv_freq) {
  const int32_t half = hd / 2;
  for (int32_t h = 0; h < heads; ++h) {
    double* v = x.data() + static_cast<size_t>(h * hd);
    for (int32_t j = 0; j < half; ++j) {
      const double a = pos * inv_freq[static_cast<size_t>(j)];
      const double x0 = v[j], x1 = v[j + half];
      v[j] = x0 * std::cos(a) - x1 * std::sin(a);
      v[j + half] = x1 * std::cos(a) + x0 * std::sin(a);
    }
  }
}

// Logits [ids.size()][vocab] of a Llama model (weights as loaded, f32) with `inv_freq`.
std::vector<Vec> naive_llama(const ModelConfig& c, const ModelWeights& w,
                             const std::vector<int32_t>& ids, const Vec& inv_freq) {
  const auto h = static_cast<size_t>(c.hidden), hd = static_cast<size_t>(c.head_dim);
  const double eps = c.norm_eps;
  std::vector<Vec> x(ids.size(), Vec(h));
  for (size_t t = 0; t < ids.size(); ++t)
    for (size_t i = 0; i < h; ++i)
      x[t][i] = w.embed.as<const float>()[static_cast<size_t>(ids[t]) * h + i];
  for (const LayerWeights& L : w.layers) {
    std::vector<Vec> q, k, v;
    for (size_t t = 0; t < x.size(); ++t) {
      const Vec n = rms_norm(x[t], L.attn_norm, eps);
      q.push_back(matvec(L.q, n));
      k.push_back(matvec(L.k, n));
      v.push_back(matvec(L.v, n));
      rotate(q.back(), c.n_heads, c.head_dim, static_cast<int32_t>(t), inv_freq);
      rotate(k.back(), c.n_kv_heads, c.head_dim, static_cast<int32_t>(t), inv_freq);
    }
    for (size_t t = 0; t < x.size(); ++t) {
      Vec attn(static_cast<size_t>(c.q_width()), 0.0);
      for (size_t hh = 0; hh < static_cast<size_t>(c.n_heads); ++hh) {
        const size_t kh = hh / static_cast<size_t>(c.n_heads / c.n_kv_heads);
        Vec s(t + 1);
        double mx = -1e300, sum = 0;
        for (size_t u = 0; u <= t; ++u) {
          double d = 0;
          for (size_t j = 0; j < hd; ++j) d += q[t][hh * hd + j] * k[u][kh * hd + j];
          s[u] = d / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[u]);
        }
        for (auto& e : s) sum += (e = std::exp(e - mx));
        for (size_t u = 0; u <= t; ++u)
          for (size_t j = 0; j < hd; ++j) attn[hh * hd + j] += s[u] / sum * v[u][kh * hd + j];
      }
      const Vec o = matvec(L.o, attn);
      for (size_t i = 0; i < h; ++i) x[t][i] += o[i];
      const Vec n = rms_norm(x[t], L.mlp_norm, eps);
      const Vec g = matvec(L.gate, n), u = matvec(L.up, n);
      Vec f(g.size());
      for (size_t i = 0; i < f.size(); ++i) f[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];  // SiLU
      const Vec d = matvec(L.down, f);
      for (size_t i = 0; i < h; ++i) x[t][i] += d[i];
    }
  }
  std::vector<Vec> logits;
  for (const Vec& xt : x) logits.push_back(matvec(w.lm_head, rms_norm(xt, w.final_norm, eps)));
  return logits;
}

// stories260K: head_dim 8, theta 10000, so the unscaled inverse frequencies are
// 10000^(-2j/8) = 1, 0.1, 0.01, 0.001 (j = 0..3).
Vec unscaled_inv_freq() {
  return {1.0, 0.1, 0.01, 0.001};
}

struct Compared {
  double vs_reference = 0;  // max |strata - naive|
  double vs_unscaled = 0;   // max |naive scaled - naive unscaled|: how much the scaling moves
};

Compared compare(const std::string& dir, const Vec& inv_freq) {
  const auto ref = testing::load_stories_references().front();  // "Once upon a time", 69 tokens
  const std::vector<int32_t> ids = ref.sequence();
  LoadOptions row_major;  // the naive reference reads the checkpoint's layout
  row_major.cpu_panels = false;
  const LoadedModel m = load_model(dir, row_major);
  const std::vector<Vec> want = naive_llama(m.config, m.weights, ids, inv_freq);
  const std::vector<Vec> plain = naive_llama(m.config, m.weights, ids, unscaled_inv_freq());
  CpuBackend backend(2);
  LoadedModel engine = load_model(dir);  // the engine's own layout
  const ModelConfig config = engine.config;
  Model model(config, std::move(engine.weights), backend, 128);
  const std::vector<float> got = teacher_forced_logits(model, ids, 16);
  const auto vocab = static_cast<size_t>(config.vocab);
  Compared c;
  for (size_t t = 0; t < ids.size(); ++t) {
    for (size_t v = 0; v < vocab; ++v) {
      c.vs_reference = std::max(c.vs_reference, std::fabs(got[t * vocab + v] - want[t][v]));
      c.vs_unscaled = std::max(c.vs_unscaled, std::fabs(want[t][v] - plain[t][v]));
    }
  }
  return c;
}

TEST(RopeScaling, NaiveReferenceMatchesLlama2cWithoutScaling) {
  const auto ref = testing::load_stories_references().front();
  LoadOptions row_major;
  row_major.cpu_panels = false;
  LoadedModel m = load_model(testing::stories_dir(), row_major);
  const auto want = naive_llama(m.config, m.weights, ref.sequence(), unscaled_inv_freq());
  double worst = 0;
  const auto vocab = static_cast<size_t>(ref.vocab);
  for (size_t t = 0; t < want.size(); ++t)
    for (size_t v = 0; v < vocab; ++v)
      worst = std::max(worst, std::fabs(want[t][v] - ref.logits[t * vocab + v]));
  EXPECT_LT(worst, 1e-4);
}

TEST(RopeScaling, LinearDividesEveryFrequencyByTheFactor) {
  // factor 4: 1/4, 0.1/4, 0.01/4, 0.001/4.
  const Compared c = compare(scaled_model_dir("linear", {{"type", "linear"}, {"factor", 4.0}}),
                             {0.25, 0.025, 0.0025, 0.00025});
  EXPECT_LT(c.vs_reference, 2e-4);
  EXPECT_GT(c.vs_unscaled, 0.1) << "the scaling should change these logits";
}

TEST(RopeScaling, Llama3KeepsHighFrequenciesScalesLowOnesAndBlendsBetween) {
  // factor 8, low_freq_factor 1, high_freq_factor 4, original context 128: wavelengths
  // shorter than 128 / 4 = 32 keep their frequency, longer than 128 / 1 = 128 are divided by
  // 8, in between blend with smooth = (128 / wavelen - 1) / (4 - 1).
  //   j = 0: f 1,     wavelen 2 pi = 6.28      < 32   -> 1
  //   j = 1: f 0.1,   wavelen 20 pi = 62.8     blend  -> smooth = (128 / (20 pi) - 1) / 3,
  //                                                      (1 - smooth) * 0.1 / 8 + smooth * 0.1
  //   j = 2: f 0.01,  wavelen 628              > 128  -> 0.00125
  //   j = 3: f 0.001, wavelen 6283             > 128  -> 0.000125
  const double smooth = (128 / (20 * std::numbers::pi) - 1.0) / 3.0;  // 0.3457...
  const Vec inv_freq{1.0, (1.0 - smooth) * 0.0125 + smooth * 0.1, 0.00125, 0.000125};
  const Compared c =
      compare(scaled_model_dir("llama3", {{"rope_type", "llama3"},
                                          {"factor", 8.0},
                                          {"low_freq_factor", 1.0},
                                          {"high_freq_factor", 4.0},
                                          {"original_max_position_embeddings", 128}}),
              inv_freq);
  EXPECT_LT(c.vs_reference, 2e-4);
  EXPECT_GT(c.vs_unscaled, 0.1) << "the scaling should change these logits";
}

}  // namespace
}  // namespace strata
