// CpuBackend, dtype conversions and sampling against naive references written here
// (ggml test-backend-ops style). Every op runs on random inputs and is compared with a
// double-precision reference under a normalised error bound
//   max |got - ref| / max(1, max |ref|)
// and every output buffer sits between canary guard bytes that must survive the op.
// Outputs start as NaN so an element the op forgets to write fails the comparison.
#include <gtest/gtest.h>
#include <omp.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/cpu_isa.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/quant.h"
#include "kernels/sampling.h"
#include "kernels/tensor.h"
#include "support/guarded.h"

namespace strata {

// Readable parameter names in gtest output (found by ADL for DType).
[[maybe_unused]] static void PrintTo(DType t, std::ostream* os) {
  *os << dtype_name(t);
}

namespace {

using testing::canary;
using testing::Guarded;
using testing::kGuardBytes;
using testing::random_floats;

// ---------------------------------------------------------------------------------------
// Helpers: guarded buffers, references for the storage types, error measure.
// ---------------------------------------------------------------------------------------

float nan_f32() {
  return std::numeric_limits<float>::quiet_NaN();
}

// Exact value of an f16 / bf16 bit pattern, computed from the definition (independent of
// the library's converters, which are tested against these).
double ref_f16(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -24);
  } else if (exp == 0x1f) {
    v = mant == 0 ? std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(static_cast<double>(1024 + mant), exp - 25);
  }
  return sign ? -v : v;
}

double ref_bf16(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 7) & 0xff;
  const int mant = h & 0x7f;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -133);
  } else if (exp == 0xff) {
    v = mant == 0 ? std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(static_cast<double>(128 + mant), exp - 134);
  }
  return sign ? -v : v;
}

// Round-to-nearest-even onto a grid of magnitudes given by `value(code)` (monotonic for
// codes 0 .. inf_code, where value(inf_code) is the first power of two past the largest
// finite value, so that overflow rounds exactly as IEEE does). Returns the magnitude code.
template <typename ValueFn>
uint32_t ref_round_magnitude(double a, uint32_t inf_code, ValueFn value) {
  uint32_t lo = 0;
  uint32_t hi = inf_code;
  if (a >= value(inf_code)) return inf_code;
  while (hi - lo > 1) {  // invariant: value(lo) <= a < value(hi)
    const uint32_t mid = lo + (hi - lo) / 2;
    if (value(mid) <= a) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const double midpoint = (value(lo) + value(hi)) / 2;  // exact in double
  if (a < midpoint) return lo;
  if (a > midpoint) return hi;
  return (lo & 1u) ? hi : lo;
}

uint16_t ref_f32_to_f16(float f) {
  const auto sign = static_cast<uint16_t>(std::signbit(f) ? 0x8000u : 0u);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00u);
  const uint32_t code = ref_round_magnitude(
      std::fabs(static_cast<double>(f)), 0x7c00u,
      [](uint32_t c) { return c == 0x7c00u ? 65536.0 : ref_f16(static_cast<uint16_t>(c)); });
  return static_cast<uint16_t>(sign | code);
}

uint16_t ref_f32_to_bf16(float f) {
  const auto sign = static_cast<uint16_t>(std::signbit(f) ? 0x8000u : 0u);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7fc0u);
  const uint32_t code =
      ref_round_magnitude(std::fabs(static_cast<double>(f)), 0x7f80u, [](uint32_t c) {
        return c == 0x7f80u ? std::ldexp(1.0, 128) : ref_bf16(static_cast<uint16_t>(c));
      });
  return static_cast<uint16_t>(sign | code);
}

bool f16_is_nan(uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
}
bool bf16_is_nan(uint16_t h) {
  return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// max |got - ref| / max(1, max |ref|); infinity when got has a NaN/inf where ref is finite.
double norm_err(const float* got, const std::vector<double>& ref) {
  double max_ref = 0.0;
  double max_diff = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got[i];
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    max_diff = std::max(max_diff, std::fabs(g - ref[i]));
  }
  return max_diff / std::max(1.0, max_ref);
}

// Error bounds. f32 math in the backend vs exact double math here.
constexpr double kTolF32 = 1e-5;
// Half-precision inputs are decoded exactly on both sides, so only the f32 accumulation
// differs; the bound is looser only to leave room for a different (blocked) summation.
constexpr double kTolHalf = 2e-5;

// A 2-D tensor of the given dtype holding `values` rounded to that dtype (via the
// reference rounding), stored in a guarded buffer; `exact` receives the stored values.
struct WeightTensor {
  Guarded<uint8_t> storage;
  Tensor view;
  std::vector<double> exact;

  WeightTensor(DType dtype, int64_t rows, int64_t cols, const std::vector<float>& values)
      : storage(static_cast<size_t>(rows * cols) * dtype_size(dtype)) {
    view.data = storage.data();
    view.dtype = dtype;
    view.shape = Shape{rows, cols};
    exact.resize(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      switch (dtype) {
        case DType::kF32:
          reinterpret_cast<float*>(storage.data())[i] = values[i];
          exact[i] = values[i];
          break;
        case DType::kF16: {
          const uint16_t h = ref_f32_to_f16(values[i]);
          std::memcpy(storage.data() + 2 * i, &h, 2);
          exact[i] = ref_f16(h);
          break;
        }
        case DType::kBF16: {
          const uint16_t h = ref_f32_to_bf16(values[i]);
          std::memcpy(storage.data() + 2 * i, &h, 2);
          exact[i] = ref_bf16(h);
          break;
        }
        case DType::kF32Panel: {  // gemm_panel.h's layout, by its formula
          const int64_t r = static_cast<int64_t>(i) / cols, c = static_cast<int64_t>(i) % cols;
          const int64_t at =
              r >= rows / 32 * 32 ? r * cols + c : ((r / 32) * cols + c) * 32 + r % 32;
          reinterpret_cast<float*>(storage.data())[at] = values[i];
          exact[i] = values[i];
          break;
        }
        case DType::kI32:
        case DType::kQ4:
        case DType::kQ4Panel:
          ADD_FAILURE() << "not a float dtype";
          break;
      }
    }
  }
};

std::string dtype_label(DType t) {
  return dtype_name(t);
}

// ---------------------------------------------------------------------------------------
// linear
// ---------------------------------------------------------------------------------------

using LinearParam = std::tuple<DType, int64_t /*m*/, int64_t /*n*/, int64_t /*k*/, bool /*bias*/>;

class LinearTest : public ::testing::TestWithParam<LinearParam> {};

TEST_P(LinearTest, MatchesReference) {
  const auto [dtype, m, n, k, with_bias] = GetParam();
  CpuBackend cpu(2);
  WeightTensor w(dtype, n, k, random_floats(static_cast<size_t>(n * k), 11));
  Guarded<float> x(static_cast<size_t>(m * k));
  x.assign(random_floats(x.size(), 12));
  Guarded<float> bias(static_cast<size_t>(n));
  bias.assign(random_floats(bias.size(), 13, -2.0f, 2.0f));
  Guarded<float> y(static_cast<size_t>(m * n), nan_f32());
  const std::vector<float> x_before = x.vec();

  cpu.linear(x.data(), m, w.view, with_bias ? bias.data() : nullptr, y.data());

  std::vector<double> ref(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double s = with_bias ? static_cast<double>(bias[static_cast<size_t>(c)]) : 0.0;
      for (int64_t i = 0; i < k; ++i)
        s += static_cast<double>(x[static_cast<size_t>(r * k + i)]) *
             w.exact[static_cast<size_t>(c * k + i)];
      ref[static_cast<size_t>(r * n + c)] = s;
    }
  EXPECT_LT(norm_err(y.data(), ref),
            dtype == DType::kF32 || dtype == DType::kF32Panel ? kTolF32 : kTolHalf);
  EXPECT_TRUE(y.guards_intact());
  EXPECT_TRUE(x.guards_intact());
  EXPECT_TRUE(w.storage.guards_intact());
  EXPECT_EQ(x.vec(), x_before) << "linear modified its input";
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, LinearTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                       ::testing::Values(int64_t{1}), ::testing::Values(int64_t{37}, int64_t{300}),
                       ::testing::Values(int64_t{53}, int64_t{129}), ::testing::Bool()),
    [](const auto& tp) {
      return dtype_label(std::get<0>(tp.param)) + "_m" + std::to_string(std::get<1>(tp.param)) +
             "_n" + std::to_string(std::get<2>(tp.param)) + "_k" +
             std::to_string(std::get<3>(tp.param)) + (std::get<4>(tp.param) ? "_bias" : "_nobias");
    });

INSTANTIATE_TEST_SUITE_P(
    CpuBatch, LinearTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                       ::testing::Values(int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5},
                                         int64_t{16}, int64_t{17}),
                       ::testing::Values(int64_t{37}, int64_t{300}),
                       ::testing::Values(int64_t{1}, int64_t{53}), ::testing::Bool()),
    [](const auto& tp) {
      return dtype_label(std::get<0>(tp.param)) + "_m" + std::to_string(std::get<1>(tp.param)) +
             "_n" + std::to_string(std::get<2>(tp.param)) + "_k" +
             std::to_string(std::get<3>(tp.param)) + (std::get<4>(tp.param) ? "_bias" : "_nobias");
    });

// Weights packed for the GEMM at load: one kernel from a decode row to a prefill (m past the
// kernels' 64-row blocks), panels split across the backend's threads, tail rows.
INSTANTIATE_TEST_SUITE_P(CpuPanel, LinearTest,
                         ::testing::Combine(::testing::Values(DType::kF32Panel),
                                            ::testing::Values(int64_t{1}, int64_t{5}, int64_t{16},
                                                              int64_t{33}, int64_t{70}),
                                            ::testing::Values(int64_t{37}, int64_t{300}),
                                            ::testing::Values(int64_t{53}, int64_t{300}),
                                            ::testing::Bool()),
                         [](const auto& tp) {
                           return std::string("f32panel_m") +
                                  std::to_string(std::get<1>(tp.param)) + "_n" +
                                  std::to_string(std::get<2>(tp.param)) + "_k" +
                                  std::to_string(std::get<3>(tp.param)) +
                                  (std::get<4>(tp.param) ? "_bias" : "_nobias");
                         });

// 4-bit weights at more rows than the byte GEMV takes (linear_half: each 32-row panel
// decoded into f32 and multiplied by the panel GEMM), tails included, against a double
// reference over the decoded weights (the values dequantize_4bit gives, on the f32 grid).
TEST(CpuBackendLinear, FourBitAtPrefillRowsMatchesTheDecodedWeights) {
  CpuBackend cpu(2);
  for (const int64_t n : {int64_t{37}, int64_t{64}, int64_t{100}})
    for (const int64_t k : {int64_t{64}, int64_t{320}})
      for (const int64_t m : {int64_t{17}, int64_t{70}}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " k=" << k << " m=" << m);
        const std::vector<float> w = random_floats(static_cast<size_t>(n * k), 31);
        const QuantizedTensor q =
            quantize_4bit(w.data(), {n, k, kQuantGroupSize, QuantAxis::kAlongRow});
        std::vector<float> decoded(w.size());
        dequantize_4bit(q, decoded.data());
        OwnedTensor packed(DType::kQ4, Shape{n, k});
        write_q4_blob(q, packed.storage.data());
        Guarded<float> x(static_cast<size_t>(m * k));
        x.assign(random_floats(x.size(), 32));
        Guarded<float> bias(static_cast<size_t>(n));
        bias.assign(random_floats(bias.size(), 33));
        Guarded<float> y(static_cast<size_t>(m * n), nan_f32());
        cpu.linear(x.data(), m, packed.view, bias.data(), y.data());
        std::vector<double> ref(static_cast<size_t>(m * n));
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < n; ++c) {
            double s = bias[static_cast<size_t>(c)];
            for (int64_t i = 0; i < k; ++i)
              s += static_cast<double>(x[static_cast<size_t>(r * k + i)]) *
                   decoded[static_cast<size_t>(c * k + i)];
            ref[static_cast<size_t>(r * n + c)] = s;
          }
        EXPECT_LT(norm_err(y.data(), ref), kTolF32);
        EXPECT_TRUE(y.guards_intact());
      }
}

TEST(CpuBackendLinear, ZeroRowsWritesNothingAndRejectsNon2dWeight) {
  CpuBackend cpu(1);
  WeightTensor w(DType::kF32, 4, 3, random_floats(12, 1));
  Guarded<float> y(4, 7.0f);
  cpu.linear(nullptr, 0, w.view, nullptr, y.data());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], 7.0f);
  EXPECT_TRUE(y.guards_intact());
  Tensor bad = w.view;
  bad.shape = Shape{12};
  EXPECT_THROW(cpu.linear(y.data(), 1, bad, nullptr, y.data()), Error);
}

// ---------------------------------------------------------------------------------------
// embedding
// ---------------------------------------------------------------------------------------

class EmbeddingTest : public ::testing::TestWithParam<DType> {};

TEST_P(EmbeddingTest, GathersRowsExactly) {
  const DType dtype = GetParam();
  constexpr int64_t vocab = 50;
  for (const int64_t h : {int64_t{37}, int64_t{64}, int64_t{1}}) {
    SCOPED_TRACE("h=" + std::to_string(h));
    CpuBackend cpu(1);
    WeightTensor table(dtype, vocab, h,
                       random_floats(static_cast<size_t>(vocab * h), 21, -4.0f, 4.0f));
    const std::vector<int32_t> ids = {0, 49, 7, 7, 13, 0, 48, 25, 1};
    const auto n = static_cast<int64_t>(ids.size());
    Guarded<int32_t> id_buf(ids.size());
    id_buf.assign(ids);
    Guarded<float> y(static_cast<size_t>(n * h), nan_f32());
    cpu.embedding(id_buf.data(), n, table.view, y.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < h; ++c) {
        const double want = table.exact[static_cast<size_t>(ids[static_cast<size_t>(i)] * h + c)];
        ASSERT_EQ(static_cast<double>(y[static_cast<size_t>(i * h + c)]), want)
            << "row " << i << " col " << c;
      }
    EXPECT_TRUE(y.guards_intact());
    EXPECT_TRUE(table.storage.guards_intact());
  }
}

TEST_P(EmbeddingTest, RejectsIdsOutsideVocabulary) {
  CpuBackend cpu(1);
  WeightTensor table(GetParam(), 10, 4, random_floats(40, 22));
  Guarded<float> y(4);
  for (const int32_t bad : {-1, 10, 1 << 30}) {
    EXPECT_THROW(cpu.embedding(&bad, 1, table.view, y.data()), Error) << bad;
  }
  EXPECT_TRUE(y.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cpu, EmbeddingTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16,
                                           DType::kF32Panel),
                         [](const auto& tp) { return dtype_label(tp.param); });

// ---------------------------------------------------------------------------------------
// rms_norm, layer_norm
// ---------------------------------------------------------------------------------------

using NormParam = std::tuple<int64_t /*m*/, int64_t /*h*/>;
class NormTest : public ::testing::TestWithParam<NormParam> {};

TEST_P(NormTest, RmsNorm) {
  const auto [m, h] = GetParam();
  CpuBackend cpu(2);
  Guarded<float> x(static_cast<size_t>(m * h));
  x.assign(random_floats(x.size(), 31, -3.0f, 3.0f));
  Guarded<float> w(static_cast<size_t>(h));
  w.assign(random_floats(w.size(), 32, 0.5f, 1.5f));
  Guarded<float> y(x.size(), nan_f32());
  const float eps = 1e-5f;
  cpu.rms_norm(x.data(), m, h, w.data(), eps, y.data());
  std::vector<double> ref(x.size());
  for (int64_t r = 0; r < m; ++r) {
    double ss = 0.0;
    for (int64_t i = 0; i < h; ++i)
      ss += static_cast<double>(x[static_cast<size_t>(r * h + i)]) *
            x[static_cast<size_t>(r * h + i)];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(h) + eps);
    for (int64_t i = 0; i < h; ++i)
      ref[static_cast<size_t>(r * h + i)] =
          w[static_cast<size_t>(i)] * inv * x[static_cast<size_t>(r * h + i)];
  }
  EXPECT_LT(norm_err(y.data(), ref), kTolF32);
  EXPECT_TRUE(y.guards_intact());
}

TEST_P(NormTest, LayerNorm) {
  const auto [m, h] = GetParam();
  CpuBackend cpu(2);
  Guarded<float> x(static_cast<size_t>(m * h));
  x.assign(random_floats(x.size(), 41, 2.0f, 6.0f));  // non-zero mean
  Guarded<float> w(static_cast<size_t>(h));
  w.assign(random_floats(w.size(), 42, 0.5f, 1.5f));
  Guarded<float> b(static_cast<size_t>(h));
  b.assign(random_floats(b.size(), 43, -1.0f, 1.0f));
  Guarded<float> y(x.size(), nan_f32());
  const float eps = 1e-5f;
  cpu.layer_norm(x.data(), m, h, w.data(), b.data(), eps, y.data());
  std::vector<double> ref(x.size());
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x.data() + r * h;
    double mean = 0.0;
    for (int64_t i = 0; i < h; ++i) mean += xr[i];
    mean /= static_cast<double>(h);
    double var = 0.0;
    for (int64_t i = 0; i < h; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= static_cast<double>(h);
    const double inv = 1.0 / std::sqrt(var + eps);
    for (int64_t i = 0; i < h; ++i)
      ref[static_cast<size_t>(r * h + i)] =
          (xr[i] - mean) * inv * w[static_cast<size_t>(i)] + b[static_cast<size_t>(i)];
  }
  // The f32 two-pass mean/variance loses a little more than a plain dot product when the
  // row has a large mean relative to its spread (h = 1 has zero variance: output = bias).
  EXPECT_LT(norm_err(y.data(), ref), 4 * kTolF32);
  EXPECT_TRUE(y.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cpu, NormTest,
                         ::testing::Values(NormParam{1, 1}, NormParam{1, 64}, NormParam{4, 67},
                                           NormParam{33, 1024}),
                         [](const auto& tp) {
                           return "m" + std::to_string(std::get<0>(tp.param)) + "_h" +
                                  std::to_string(std::get<1>(tp.param));
                         });

// ---------------------------------------------------------------------------------------
// rope
// ---------------------------------------------------------------------------------------

// cos/sin tables [max_positions, head_dim / 2] for angle(pos, j) = pos * theta^(-2j / head_dim).
struct RopeTableHost {
  std::vector<float> cos, sin;
  RopeTables view(int32_t max_positions, int32_t half) const {
    return RopeTables{cos.data(), sin.data(), max_positions, half};
  }
};

double rope_angle(int32_t pos, int32_t j, int32_t head_dim, double theta) {
  return pos * std::pow(theta, -2.0 * j / head_dim);
}

RopeTableHost make_rope_tables(int32_t max_positions, int32_t head_dim, double theta) {
  const int32_t half = head_dim / 2;
  RopeTableHost t;
  t.cos.resize(static_cast<size_t>(max_positions * half));
  t.sin.resize(t.cos.size());
  for (int32_t p = 0; p < max_positions; ++p)
    for (int32_t j = 0; j < half; ++j) {
      const double a = rope_angle(p, j, head_dim, theta);
      t.cos[static_cast<size_t>(p * half + j)] = static_cast<float>(std::cos(a));
      t.sin[static_cast<size_t>(p * half + j)] = static_cast<float>(std::sin(a));
    }
  return t;
}

// Rotate-half: (x_j, x_{j+half}) -> (x_j cos - x_{j+half} sin, x_{j+half} cos + x_j sin).
std::vector<double> ref_rope(const std::vector<float>& x, int64_t m, int32_t n_heads,
                             int32_t head_dim, const std::vector<int32_t>& positions,
                             double theta) {
  const int32_t half = head_dim / 2;
  std::vector<double> out(x.begin(), x.end());
  for (int64_t r = 0; r < m; ++r)
    for (int32_t hd = 0; hd < n_heads; ++hd) {
      const size_t base = static_cast<size_t>(r * n_heads * head_dim + hd * head_dim);
      for (int32_t j = 0; j < half; ++j) {
        const double a = rope_angle(positions[static_cast<size_t>(r)], j, head_dim, theta);
        const double x0 = x[base + static_cast<size_t>(j)];
        const double x1 = x[base + static_cast<size_t>(j + half)];
        out[base + static_cast<size_t>(j)] = x0 * std::cos(a) - x1 * std::sin(a);
        out[base + static_cast<size_t>(j + half)] = x1 * std::cos(a) + x0 * std::sin(a);
      }
    }
  return out;
}

TEST(CpuBackendRope, RotateHalfMatchesReference) {
  constexpr int32_t n_heads = 3, head_dim = 16, max_pos = 64;
  constexpr double theta = 10000.0;
  const std::vector<int32_t> positions = {0, 1, 5, 63, 17, 5};
  const auto m = static_cast<int64_t>(positions.size());
  const RopeTableHost tables = make_rope_tables(max_pos, head_dim, theta);
  CpuBackend cpu(1);
  Guarded<float> x(static_cast<size_t>(m * n_heads * head_dim));
  const std::vector<float> input = random_floats(x.size(), 51, -2.0f, 2.0f);
  x.assign(input);
  cpu.rope(x.data(), m, n_heads, head_dim, positions.data(), tables.view(max_pos, head_dim / 2));
  EXPECT_LT(norm_err(x.data(), ref_rope(input, m, n_heads, head_dim, positions, theta)), kTolF32);
  EXPECT_TRUE(x.guards_intact());
  // Position 0 is the identity.
  for (int i = 0; i < n_heads * head_dim; ++i)
    EXPECT_EQ(x[static_cast<size_t>(i)], input[static_cast<size_t>(i)]);
}

TEST(CpuBackendRope, RejectsBadPositionsAndTableMismatch) {
  constexpr int32_t head_dim = 8, max_pos = 4;
  const RopeTableHost tables = make_rope_tables(max_pos, head_dim, 10000.0);
  CpuBackend cpu(1);
  std::vector<float> x(head_dim, 1.0f);
  for (const int32_t bad : {-1, max_pos}) {
    EXPECT_THROW(cpu.rope(x.data(), 1, 1, head_dim, &bad, tables.view(max_pos, head_dim / 2)),
                 Error)
        << bad;
  }
  const int32_t ok = 1;
  EXPECT_THROW(cpu.rope(x.data(), 1, 1, head_dim, &ok, tables.view(max_pos, head_dim / 2 + 1)),
               Error);
}

// ---------------------------------------------------------------------------------------
// elementwise: silu_mul, relu, add; softmax
// ---------------------------------------------------------------------------------------

class ElementwiseTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(ElementwiseTest, SiluMul) {
  const int64_t n = GetParam();
  const auto sz = static_cast<size_t>(n);
  CpuBackend cpu(2);
  Guarded<float> gate(sz), up(sz), out(sz, nan_f32());
  gate.assign(random_floats(sz, 61, -8.0f, 8.0f));
  up.assign(random_floats(sz, 62, -2.0f, 2.0f));
  if (n >= 4) {  // saturation at both ends, and zero
    gate[0] = -100.0f;
    gate[1] = 100.0f;
    gate[2] = 0.0f;
  }
  const std::vector<float> g0 = gate.vec(), u0 = up.vec();
  cpu.silu_mul(gate.data(), up.data(), out.data(), n);
  std::vector<double> ref(sz);
  for (size_t i = 0; i < sz; ++i)
    ref[i] = g0[i] / (1.0 + std::exp(-static_cast<double>(g0[i]))) * u0[i];
  EXPECT_LT(norm_err(out.data(), ref), kTolF32);
  EXPECT_TRUE(out.guards_intact());
  EXPECT_EQ(gate.vec(), g0);
  EXPECT_EQ(up.vec(), u0);
  // In place over the gate.
  cpu.silu_mul(gate.data(), up.data(), gate.data(), n);
  EXPECT_LT(norm_err(gate.data(), ref), kTolF32);
  EXPECT_TRUE(gate.guards_intact());
}

TEST_P(ElementwiseTest, Relu) {
  const int64_t n = GetParam();
  const auto sz = static_cast<size_t>(n);
  CpuBackend cpu(2);
  Guarded<float> x(sz);
  x.assign(random_floats(sz, 71, -1.0f, 1.0f));
  if (n >= 4) {
    x[0] = -0.0f;
    x[1] = 1e-30f;
    x[2] = -1e-30f;
  }
  const std::vector<float> x0 = x.vec();
  cpu.relu(x.data(), n);
  std::vector<double> ref(sz);
  for (size_t i = 0; i < sz; ++i) ref[i] = x0[i] > 0.0f ? x0[i] : 0.0;
  for (size_t i = 0; i < sz; ++i) ASSERT_EQ(static_cast<double>(x[i]), ref[i]) << i;
  EXPECT_TRUE(x.guards_intact());
}

TEST_P(ElementwiseTest, Add) {
  const int64_t n = GetParam();
  const auto sz = static_cast<size_t>(n);
  CpuBackend cpu(2);
  Guarded<float> y(sz), x(sz);
  y.assign(random_floats(sz, 81, -10.0f, 10.0f));
  x.assign(random_floats(sz, 82, -10.0f, 10.0f));
  const std::vector<float> y0 = y.vec(), x0 = x.vec();
  cpu.add(y.data(), x.data(), n);
  std::vector<double> ref(sz);
  for (size_t i = 0; i < sz; ++i) ref[i] = static_cast<double>(y0[i]) + x0[i];
  EXPECT_LT(norm_err(y.data(), ref), 1e-6);
  EXPECT_TRUE(y.guards_intact());
  EXPECT_EQ(x.vec(), x0);
}

INSTANTIATE_TEST_SUITE_P(Cpu, ElementwiseTest,
                         ::testing::Values(int64_t{1}, int64_t{1000}, int64_t{(1 << 15) + 7}),
                         [](const auto& tp) { return "n" + std::to_string(tp.param); });

using SoftmaxParam = std::tuple<int64_t /*m*/, int64_t /*n*/>;
class SoftmaxTest : public ::testing::TestWithParam<SoftmaxParam> {};

TEST_P(SoftmaxTest, RowsMatchReference) {
  const auto [m, n] = GetParam();
  const auto sz = static_cast<size_t>(m * n);
  CpuBackend cpu(2);
  Guarded<float> x(sz);
  std::vector<float> in = random_floats(sz, 91, -10.0f, 10.0f);
  // Large row offsets: without subtracting the row maximum exp() overflows or underflows.
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < n; ++i)
      in[static_cast<size_t>(r * n + i)] += (r % 3 == 0 ? 500.0f : r % 3 == 1 ? -500.0f : 0.0f);
  x.assign(in);
  cpu.softmax(x.data(), m, n);
  std::vector<double> ref(sz);
  for (int64_t r = 0; r < m; ++r) {
    double mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i)
      mx = std::max(mx, static_cast<double>(in[static_cast<size_t>(r * n + i)]));
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += std::exp(in[static_cast<size_t>(r * n + i)] - mx);
    for (int64_t i = 0; i < n; ++i)
      ref[static_cast<size_t>(r * n + i)] = std::exp(in[static_cast<size_t>(r * n + i)] - mx) / sum;
  }
  EXPECT_LT(norm_err(x.data(), ref), kTolF32);
  EXPECT_TRUE(x.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cpu, SoftmaxTest,
                         ::testing::Values(SoftmaxParam{1, 1}, SoftmaxParam{3, 17},
                                           SoftmaxParam{5, 1000}, SoftmaxParam{40, 1024}),
                         [](const auto& tp) {
                           return "m" + std::to_string(std::get<0>(tp.param)) + "_n" +
                                  std::to_string(std::get<1>(tp.param));
                         });

// ---------------------------------------------------------------------------------------
// kv_store + attention over a ragged batch
// ---------------------------------------------------------------------------------------

struct AttnCase {
  std::string name;
  int32_t n_heads, n_kv_heads, head_dim, n_slots, capacity;
  std::vector<SeqSlice> seqs;
  int32_t rows;  // activation rows (some may belong to no sequence)
  int threads;
  DType dtype = DType::kF32;  // the cache's elements
};

[[maybe_unused]] void PrintTo(const AttnCase& c, std::ostream* os) {
  *os << c.name;
}

// Row 4 belongs to no sequence (must stay untouched); one sequence has no new rows.
std::vector<SeqSlice> small_batch() {
  return {SeqSlice{0, 3, 0, 2}, SeqSlice{3, 1, 7, 0}, SeqSlice{5, 4, 5, 3}, SeqSlice{9, 0, 3, 1}};
}

// Decode rows only, at contexts below, at and past a multiple of 4 (the AVX-512 scores pass
// takes four positions at a time), one of them a single position.
std::vector<SeqSlice> decode_batch() {
  return {SeqSlice{0, 1, 36, 0}, SeqSlice{1, 1, 0, 1}, SeqSlice{2, 1, 18, 2}, SeqSlice{3, 1, 3, 3}};
}

std::vector<AttnCase> attn_cases() {
  std::vector<AttnCase> cases = {
      {"gqa_4q_2kv", 4, 2, 8, 4, 16, small_batch(), 9, 1},
      {"mha_4q_4kv", 4, 4, 8, 4, 16, small_batch(), 9, 2},
      {"mqa_4q_1kv", 4, 1, 8, 4, 16, small_batch(), 9, 2},
      // Big enough for the parallel path (per-thread score scratch), several threads.
      {"gqa_large",
       4,
       2,
       64,
       3,
       64,
       {SeqSlice{0, 20, 0, 1}, SeqSlice{20, 1, 40, 0}, SeqSlice{21, 7, 30, 2}},
       28,
       3},
      // head_dim 80: five 16-lane chunks; 272: past the 256 the AVX-512 kernels hold in
      // registers (the portable loops run); GQA 8 with head_dim 128.
      {"decode_hd80", 2, 2, 80, 4, 40, decode_batch(), 4, 2},
      {"decode_hd272", 2, 1, 272, 4, 40, decode_batch(), 4, 2},
      {"decode_gqa8_hd128", 8, 1, 128, 4, 40, decode_batch(), 4, 2},
      // head_dim 12 over 7 rows: a 4-bit cache's codes are 42 bytes, its mins start at 44.
      {"hd12_odd_rows", 2, 1, 12, 1, 7, {SeqSlice{0, 2, 4, 0}}, 2, 1},
  };
  // The same over an f16 cache (policy cf16) and a 4-bit one (policy cc: attention_q4).
  const size_t n = cases.size();
  for (DType dtype : {DType::kF16, DType::kQ4})
    for (size_t i = 0; i < n; ++i) {
      AttnCase c = cases[i];
      c.name = (dtype == DType::kF16 ? "f16_" : "q4_") + c.name;
      c.dtype = dtype;
      cases.push_back(c);
    }
  return cases;
}

// Rows of head_dim values that a 4-bit cache holds exactly: each group of `group` is
// mn + c s with integer codes c in [0, 15], both 0 and 15 among them (so the quantiser finds
// mn and s again), s a power of two and mn a multiple of 1/16. Groups differ in s and mn, so
// a value decoded with another group's pair comes out wrong.
void fill_q4_exact(float* x, size_t n, int32_t group, std::mt19937& rng) {
  for (size_t g0 = 0; g0 < n; g0 += static_cast<size_t>(group)) {
    const float s = std::ldexp(1.0f, -3 - static_cast<int>(rng() % 3));
    const float mn = static_cast<float>(static_cast<int>(rng() % 33) - 16) / 16.0f;
    const size_t lo = rng() % static_cast<size_t>(group);
    const size_t hi =
        (lo + 1 + rng() % static_cast<size_t>(group - 1)) % static_cast<size_t>(group);
    for (size_t i = 0; i < static_cast<size_t>(group); ++i) {
      const auto c = i == lo ? 0u : i == hi ? 15u : static_cast<unsigned>(rng() % 16);
      x[g0 + i] = mn + static_cast<float>(c) * s;
    }
  }
}

// An f32 value as an f16 cache holds it.
float f16_rounded(float x) {
  return f16_to_f32(f32_to_f16(x));
}

// The full state of the test: host cache before/after, inputs, and the references.
struct AttnFixture {
  AttnCase c;
  size_t cache_elems;
  std::vector<float> k_cache0, v_cache0;  // before kv_store
  std::vector<float> k_new, v_new, q;
  std::vector<float> k_expect, v_expect;  // after kv_store, as the cache's dtype holds them
  std::vector<double> out_ref;            // only rows that belong to a sequence are meaningful
  std::vector<bool> row_used;

  size_t cache_index(int32_t slot, int32_t kvh, int32_t pos, int32_t d) const {
    return ((static_cast<size_t>(slot) * c.n_kv_heads + kvh) * c.capacity + pos) * c.head_dim + d;
  }

  explicit AttnFixture(AttnCase ac) : c(std::move(ac)) {
    cache_elems = static_cast<size_t>(c.n_slots) * c.n_kv_heads * c.capacity * c.head_dim;
    const bool half = c.dtype == DType::kF16;
    const bool q4 = c.dtype == DType::kQ4;
    const int32_t q4_group = KvQ4LayerView::group_for(c.head_dim);
    auto held = [&](float x) { return half ? f16_rounded(x) : x; };  // q4: values held exactly
    // Unwritten cache positions hold NaN: reading one (a causality or indexing bug) poisons
    // the output. The history of every used sequence is random.
    k_cache0.assign(cache_elems, nan_f32());
    v_cache0.assign(cache_elems, nan_f32());
    std::mt19937 rng(101);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (const SeqSlice& s : c.seqs)
      for (int32_t h = 0; h < c.n_kv_heads; ++h)
        for (int32_t p = 0; p < s.n_past; ++p) {
          float* kr = &k_cache0[cache_index(s.slot, h, p, 0)];
          float* vr = &v_cache0[cache_index(s.slot, h, p, 0)];
          if (q4) {
            fill_q4_exact(kr, static_cast<size_t>(c.head_dim), q4_group, rng);
            fill_q4_exact(vr, static_cast<size_t>(c.head_dim), q4_group, rng);
            continue;
          }
          for (int32_t d = 0; d < c.head_dim; ++d) {
            kr[d] = held(dist(rng));
            vr[d] = held(dist(rng));
          }
        }
    const size_t kv_width = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
    const size_t q_width = static_cast<size_t>(c.n_heads) * c.head_dim;
    k_new = random_floats(static_cast<size_t>(c.rows) * kv_width, 102);
    v_new = random_floats(static_cast<size_t>(c.rows) * kv_width, 103);
    if (q4) {
      fill_q4_exact(k_new.data(), k_new.size(), q4_group, rng);
      fill_q4_exact(v_new.data(), v_new.size(), q4_group, rng);
    }
    q = random_floats(static_cast<size_t>(c.rows) * q_width, 104, -3.0f, 3.0f);

    k_expect = k_cache0;
    v_expect = v_cache0;
    for (const SeqSlice& s : c.seqs)
      for (int32_t t = 0; t < s.n_new; ++t)
        for (int32_t h = 0; h < c.n_kv_heads; ++h)
          for (int32_t d = 0; d < c.head_dim; ++d) {
            const size_t src = static_cast<size_t>(s.row_begin + t) * kv_width +
                               static_cast<size_t>(h * c.head_dim + d);
            k_expect[cache_index(s.slot, h, s.n_past + t, d)] = held(k_new[src]);
            v_expect[cache_index(s.slot, h, s.n_past + t, d)] = held(v_new[src]);
          }

    out_ref.assign(static_cast<size_t>(c.rows) * q_width, 0.0);
    row_used.assign(static_cast<size_t>(c.rows), false);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    const int32_t group = c.n_heads / c.n_kv_heads;
    for (const SeqSlice& s : c.seqs)
      for (int32_t t = 0; t < s.n_new; ++t) {
        const int32_t row = s.row_begin + t;
        row_used[static_cast<size_t>(row)] = true;
        const int32_t n_ctx = s.n_past + t + 1;
        for (int32_t h = 0; h < c.n_heads; ++h) {
          const int32_t kvh = h / group;
          const float* qr =
              q.data() + static_cast<size_t>(row) * q_width + static_cast<size_t>(h * c.head_dim);
          std::vector<double> sc(static_cast<size_t>(n_ctx));
          double mx = -INFINITY;
          for (int32_t p = 0; p < n_ctx; ++p) {
            double dot = 0.0;
            for (int32_t d = 0; d < c.head_dim; ++d)
              dot += static_cast<double>(qr[d]) * k_expect[cache_index(s.slot, kvh, p, d)];
            sc[static_cast<size_t>(p)] = dot * scale;
            mx = std::max(mx, sc[static_cast<size_t>(p)]);
          }
          double sum = 0.0;
          for (auto& v : sc) sum += (v = std::exp(v - mx));
          for (int32_t d = 0; d < c.head_dim; ++d) {
            double o = 0.0;
            for (int32_t p = 0; p < n_ctx; ++p)
              o += sc[static_cast<size_t>(p)] / sum * v_expect[cache_index(s.slot, kvh, p, d)];
            out_ref[static_cast<size_t>(row) * q_width + static_cast<size_t>(h * c.head_dim + d)] =
                o;
          }
        }
      }
  }
};

// Bitwise comparison (the cache holds NaN sentinels).
::testing::AssertionResult same_bits(const float* got, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i]))
      return ::testing::AssertionFailure()
             << "element " << i << ": got " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

// An f16 cache against the f32 values it should hold (f32_to_f16 of each; NaN stays NaN).
::testing::AssertionResult same_bits(const uint16_t* got, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != f32_to_f16(want[i]))
      return ::testing::AssertionFailure()
             << "element " << i << ": got f16 bits " << got[i] << ", want " << f32_to_f16(want[i])
             << " (" << want[i] << ")";
  return ::testing::AssertionSuccess();
}

constexpr float kUntouched = 12345.0f;

// The cache as the case's dtype stores it, in guarded memory.
template <class T>
struct CacheUnderTest {
  Guarded<T> k, v;
  CacheUnderTest(const AttnFixture& f) : k(f.cache_elems), v(f.cache_elems) {
    for (size_t i = 0; i < f.cache_elems; ++i) {
      if constexpr (std::is_same_v<T, uint16_t>) {
        k[i] = f32_to_f16(f.k_cache0[i]);
        v[i] = f32_to_f16(f.v_cache0[i]);
      } else {
        k[i] = f.k_cache0[i];
        v[i] = f.v_cache0[i];
      }
    }
  }
};

AttentionDims attn_dims(const AttnCase& c) {
  return {c.n_heads, c.n_kv_heads, c.head_dim,
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)))};
}

// The rows of a sequence against the double-precision reference; the others untouched.
void expect_attention_output(const AttnFixture& f, const Guarded<float>& out) {
  const AttnCase& c = f.c;
  const size_t q_width = static_cast<size_t>(c.n_heads) * c.head_dim;
  EXPECT_TRUE(out.guards_intact());
  std::vector<double> ref_used;
  std::vector<float> got_used;
  for (int32_t r = 0; r < c.rows; ++r) {
    for (size_t i = 0; i < q_width; ++i) {
      const size_t idx = static_cast<size_t>(r) * q_width + i;
      if (f.row_used[static_cast<size_t>(r)]) {
        ref_used.push_back(f.out_ref[idx]);
        got_used.push_back(out[idx]);
      } else {
        ASSERT_EQ(bits_of(out[idx]), bits_of(kUntouched))
            << "row " << r << " belongs to no sequence";
      }
    }
  }
  EXPECT_LT(norm_err(got_used.data(), ref_used), kTolF32);
}

template <class T>
void check_kv_store_then_attention(const AttnFixture& f, CpuIsa isa) {
  const AttnCase& c = f.c;
  CpuBackend cpu(c.threads, isa);
  CacheUnderTest<T> cache(f);
  Guarded<float> k_new(f.k_new.size()), v_new(f.v_new.size()), q(f.q.size());
  k_new.assign(f.k_new);
  v_new.assign(f.v_new);
  q.assign(f.q);
  const KvLayerView view{cache.k.data(), cache.v.data(), c.n_slots, c.capacity,
                         c.n_kv_heads,   c.head_dim,     c.dtype};

  cpu.kv_store(k_new.data(), v_new.data(), c.seqs, view);
  EXPECT_TRUE(same_bits(cache.k.data(), f.k_expect)) << "K cache";
  EXPECT_TRUE(same_bits(cache.v.data(), f.v_expect)) << "V cache";
  EXPECT_TRUE(cache.k.guards_intact());
  EXPECT_TRUE(cache.v.guards_intact());

  for (int round = 0; round < 2; ++round) {  // the second call reuses the backend's scratch
    SCOPED_TRACE("round " + std::to_string(round));
    Guarded<float> out(f.q.size(), kUntouched);
    cpu.attention(q.data(), c.seqs, view, attn_dims(c), out.data());
    expect_attention_output(f, out);
    // The cache and q are inputs of attention.
    EXPECT_TRUE(same_bits(cache.k.data(), f.k_expect));
    EXPECT_TRUE(same_bits(q.data(), f.q));
  }
}

// A 4-bit cache blob (KvQ4LayerView's layout: codes, padded up to a multiple of 4 bytes,
// then every group's min, then its scale) written and read by the test's own naive quantiser. Rows
// that hold NaN (unwritten positions) get a NaN min and scale, so reading one poisons the output as
// it does above.
struct Q4CacheUnderTest {
  KvQ4LayerView view;
  Guarded<uint8_t> k, v;
  Q4CacheUnderTest(const AttnFixture& f, const KvQ4LayerView& shape)
      : view(shape), k(shape.tensor_bytes()), v(shape.tensor_bytes()) {
    view.k = k.data();
    view.v = v.data();
    encode(f.k_cache0, k.data());
    encode(f.v_cache0, v.data());
  }
  float* mins(uint8_t* blob) const {
    const size_t codes = view.rows() * static_cast<size_t>(view.head_dim) / 2;
    return reinterpret_cast<float*>(blob + (codes + 3) / 4 * 4);
  }
  void encode(const std::vector<float>& x, uint8_t* blob) const {
    float* mn = mins(blob);
    float* sc = mn + view.groups();
    const auto g = static_cast<size_t>(view.group);
    for (size_t gi = 0; gi < view.groups(); ++gi) {
      const float* xg = x.data() + gi * g;
      const auto [lo, hi] = std::minmax_element(xg, xg + g);
      mn[gi] = std::isnan(xg[0]) ? nan_f32() : *lo;
      sc[gi] = std::isnan(xg[0]) ? nan_f32() : (*hi - *lo) / 15.0f;
      for (size_t i = 0; i < g; ++i) {
        const float c = std::isnan(xg[0]) ? 0.0f : std::nearbyint((xg[i] - mn[gi]) / sc[gi]);
        uint8_t& byte = blob[(gi * g + i) / 2];
        const auto code = static_cast<uint8_t>(c);
        byte = (i % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0) | code)
                            : static_cast<uint8_t>((byte & 0x0F) | (code << 4));
      }
    }
  }
  // Element i as the blob holds it: code * scale + min.
  float decoded(const uint8_t* blob, size_t i) const {
    const float* mn = mins(const_cast<uint8_t*>(blob));
    const size_t gi = i / static_cast<size_t>(view.group);
    const int code = (i % 2 == 0) ? (blob[i / 2] & 0x0F) : (blob[i / 2] >> 4);
    return static_cast<float>(code) * mn[view.groups() + gi] + mn[gi];
  }
  ::testing::AssertionResult holds(const uint8_t* blob, const std::vector<float>& want) const {
    for (size_t i = 0; i < want.size(); ++i) {
      const float got = decoded(blob, i);
      if (std::isnan(want[i]) ? !std::isnan(got) : bits_of(got) != bits_of(want[i]))
        return ::testing::AssertionFailure()
               << "element " << i << ": holds " << got << ", want " << want[i];
    }
    return ::testing::AssertionSuccess();
  }
};

void check_q4_store_then_attention(const AttnFixture& f, CpuIsa isa) {
  const AttnCase& c = f.c;
  CpuBackend cpu(c.threads, isa);
  const KvQ4LayerView shape{nullptr,
                            nullptr,
                            c.n_slots,
                            c.capacity,
                            c.n_kv_heads,
                            c.head_dim,
                            KvQ4LayerView::group_for(c.head_dim)};
  Q4CacheUnderTest cache(f, shape);
  Guarded<float> k_new(f.k_new.size()), v_new(f.v_new.size()), q(f.q.size());
  k_new.assign(f.k_new);
  v_new.assign(f.v_new);
  q.assign(f.q);
  cpu.kv_store_q4(k_new.data(), v_new.data(), c.seqs, cache.view);
  EXPECT_TRUE(cache.holds(cache.k.data(), f.k_expect)) << "K cache";
  EXPECT_TRUE(cache.holds(cache.v.data(), f.v_expect)) << "V cache";
  EXPECT_TRUE(cache.k.guards_intact());
  EXPECT_TRUE(cache.v.guards_intact());
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Guarded<float> out(f.q.size(), kUntouched);
    cpu.attention_q4(q.data(), c.seqs, cache.view, attn_dims(c), out.data());
    expect_attention_output(f, out);
    EXPECT_TRUE(cache.holds(cache.k.data(), f.k_expect));
  }
}

class AttentionTest : public ::testing::TestWithParam<AttnCase> {};

// Every instruction set this CPU has: the AVX-512 decode passes and the portable loops.
TEST_P(AttentionTest, KvStoreThenAttentionMatchReference) {
  const AttnFixture f(GetParam());
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (isa > detected_cpu_isa()) continue;
    SCOPED_TRACE(cpu_isa_name(isa));
    if (f.c.dtype == DType::kQ4) {
      check_q4_store_then_attention(f, isa);
    } else if (f.c.dtype == DType::kF16) {
      check_kv_store_then_attention<uint16_t>(f, isa);
    } else {
      check_kv_store_then_attention<float>(f, isa);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, AttentionTest, ::testing::ValuesIn(attn_cases()),
                         [](const auto& tp) { return tp.param.name; });

// By hand: 64 where head_dim is a multiple of 64, else its largest even divisor up to 64.
// Before, head_dim 80 got groups of 64 and each row's last 16 values were never stored.
TEST(KvQ4Layout, GroupsAreWholeEvenDivisorsOfTheHeadDim) {
  const std::vector<std::pair<int32_t, int32_t>> by_hand = {
      {2, 2},   {6, 6},   {8, 8},    {16, 16},  {64, 64},  {66, 22},
      {80, 40}, {96, 48}, {100, 50}, {128, 64}, {256, 64}, {272, 34}};
  for (const auto& [hd, group] : by_hand) EXPECT_EQ(KvQ4LayerView::group_for(hd), group) << hd;
  for (int32_t hd = 2; hd <= 600; hd += 2) {
    const int32_t g = KvQ4LayerView::group_for(hd);
    EXPECT_TRUE(g % 2 == 0 && g <= 64 && hd % g == 0) << "head_dim " << hd << ": group " << g;
  }
}

// By hand: head_dim 12 over 5 rows is 30 bytes of codes, padded to 32 so the mins are f32
// aligned, then 5 groups' mins and scales (40 bytes). head_dim 64 over 3 rows needs no pad.
TEST(KvQ4Layout, MinsStartFourByteAligned) {
  const KvQ4LayerView odd{nullptr, nullptr, 1, 5, 1, 12, 12};
  EXPECT_EQ(odd.codes_bytes(), 32u);
  EXPECT_EQ(odd.tensor_bytes(), 72u);
  const KvQ4LayerView even{nullptr, nullptr, 1, 3, 1, 64, 64};
  EXPECT_EQ(even.codes_bytes(), 96u);
  EXPECT_EQ(even.tensor_bytes(), 120u);
}

// A 4-bit view whose groups do not divide head_dim is refused before anything is read.
TEST(KvQ4Layout, AttentionRefusesGroupsThatDoNotDivideTheHeadDim) {
  CpuBackend cpu(1);
  std::vector<uint8_t> blob(1024);
  const KvQ4LayerView view{blob.data(), blob.data(), 1, 4, 1, 64, 48};
  std::vector<float> q(64), out(64);
  const std::vector<SeqSlice> seqs{{0, 1, 0, 0}};
  try {
    cpu.attention_q4(q.data(), seqs, view, {1, 1, 64, 0.125f}, out.data());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("groups of 48 do not divide head_dim 64"),
              std::string::npos)
        << e.what();
  }
}

TEST(CpuBackendKvStore, RejectsACacheOfAnotherElementType) {
  CpuBackend cpu(1);
  std::vector<float> kc(8, 0.0f), vc(8, 0.0f), k(2, 1.0f), v(2, 1.0f), q(2, 1.0f), out(2);
  const KvLayerView view{kc.data(), vc.data(), 1, 4, 1, 2, DType::kBF16};
  const std::vector<SeqSlice> one = {SeqSlice{0, 1, 0, 0}};
  for (int op = 0; op < 2; ++op) {
    try {
      if (op == 0) {
        cpu.kv_store(k.data(), v.data(), one, view);
      } else {
        cpu.attention(q.data(), one, view, AttentionDims{1, 1, 2, 1.0f}, out.data());
      }
      ADD_FAILURE() << "a bf16 cache was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
    }
  }
  for (float e : kc) EXPECT_EQ(e, 0.0f);
}

TEST(CpuBackendKvStore, RejectsBadSlotAndOverflow) {
  CpuBackend cpu(1);
  std::vector<float> kc(2 * 1 * 4 * 2, 0.0f), vc(kc.size(), 0.0f), k(2, 1.0f), v(2, 1.0f);
  const KvLayerView view{kc.data(), vc.data(), 2, 4, 1, 2};
  const std::vector<SeqSlice> bad_slot = {SeqSlice{0, 1, 0, 2}};
  EXPECT_THROW(cpu.kv_store(k.data(), v.data(), bad_slot, view), Error);
  const std::vector<SeqSlice> overflow = {SeqSlice{0, 1, 4, 0}};
  EXPECT_THROW(cpu.kv_store(k.data(), v.data(), overflow, view), Error);
  for (float e : kc) EXPECT_EQ(e, 0.0f);
  // Exactly filling the slot is fine: position 3 of slot 1 is the last element.
  const std::vector<SeqSlice> full = {SeqSlice{0, 1, 3, 1}};
  EXPECT_NO_THROW(cpu.kv_store(k.data(), v.data(), full, view));
  EXPECT_EQ(kc.back(), 1.0f);
  EXPECT_EQ(vc.back(), 1.0f);
}

TEST(CpuBackendMemory, AllocateIsZeroedAlignedAndCopies) {
  CpuBackend cpu(1);
  EXPECT_EQ(cpu.device(), Device::kHost);
  DeviceBuffer a(cpu, 1000), b(cpu, 1000);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 64, 0u);
  for (size_t i = 0; i < 250; ++i) EXPECT_EQ(a.f32()[i], 0.0f);
  const std::vector<float> src = random_floats(250, 5);
  cpu.copy(a.data(), src.data(), 1000, CopyKind::kHostToDevice);
  cpu.copy(b.data(), a.data(), 1000, CopyKind::kDeviceToDevice);
  std::vector<float> back(250);
  cpu.copy(back.data(), b.data(), 1000, CopyKind::kDeviceToHost);
  EXPECT_EQ(back, src);
}

// ---------------------------------------------------------------------------------------
// dtype conversions
// ---------------------------------------------------------------------------------------

TEST(DtypeF16, EveryNonNanPatternRoundTrips) {
  int checked = 0;
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto h = static_cast<uint16_t>(b);
    if (f16_is_nan(h)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(h))) << std::hex << b;
      EXPECT_TRUE(f16_is_nan(f32_to_f16(f16_to_f32(h)))) << std::hex << b;
      continue;
    }
    ASSERT_EQ(f32_to_f16(f16_to_f32(h)), h) << std::hex << "0x" << b;
    ++checked;
  }
  EXPECT_EQ(checked, 65536 - 2 * 1023);
}

TEST(DtypeF16, DecodeMatchesDefinition) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float got = f16_to_f32(h);
    if (f16_is_nan(h)) {
      EXPECT_TRUE(std::isnan(got));
      EXPECT_EQ(std::signbit(got), (b & 0x8000u) != 0);
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), ref_f16(h)) << std::hex << "0x" << b;
    ASSERT_EQ(std::signbit(got), (b & 0x8000u) != 0) << std::hex << "0x" << b;
  }
}

// Floats spread over every interesting range for f16: random bit patterns (mostly far out
// of range), values whose exponent lands in or near f16's (normal, subnormal, overflow),
// exact halfway points between neighbouring f16 values, and hand-picked edges.
std::vector<float> f16_probe_floats() {
  std::vector<float> v;
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) v.push_back(from_bits(static_cast<uint32_t>(rng())));
  std::uniform_int_distribution<int> exp_dist(-28, 17);
  std::uniform_int_distribution<uint32_t> mant_dist(0, (1u << 23) - 1);
  for (int i = 0; i < 400000; ++i) {
    const float f =
        std::ldexp(1.0f + static_cast<float>(mant_dist(rng)) / 8388608.0f, exp_dist(rng));
    v.push_back((i & 1) ? -f : f);
  }
  for (uint32_t h = 0; h < 0x7c00u; ++h) {  // halfway between h and h + 1, and just beside it
    const double lo = ref_f16(static_cast<uint16_t>(h));
    const double hi = h + 1 == 0x7c00u ? 65536.0 : ref_f16(static_cast<uint16_t>(h + 1));
    const auto mid = static_cast<float>((lo + hi) / 2);
    v.push_back(mid);
    v.push_back(std::nextafter(mid, 0.0f));
    v.push_back(std::nextafter(mid, 1e30f));
    v.push_back(-mid);
  }
  const float edges[] = {0.0f,
                         -0.0f,
                         1.0f,
                         65504.0f,
                         65519.99f,
                         65520.0f,
                         65536.0f,
                         1e10f,
                         std::ldexp(1.0f, -24),
                         std::ldexp(1.0f, -25),
                         std::nextafter(std::ldexp(1.0f, -25), 1.0f),
                         std::ldexp(1.0f, -26),
                         std::ldexp(1.0f, -14),
                         std::nextafter(std::ldexp(1.0f, -14), 0.0f),
                         std::numeric_limits<float>::denorm_min(),
                         std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity()};
  for (float e : edges) {
    v.push_back(e);
    v.push_back(-e);
  }
  return v;
}

TEST(DtypeF16, EncodeIsRoundToNearestEven) {
  // Sanity of the reference itself on known cases.
  ASSERT_EQ(ref_f32_to_f16(1.0f), 0x3c00u);
  ASSERT_EQ(ref_f32_to_f16(65504.0f), 0x7bffu);
  ASSERT_EQ(ref_f32_to_f16(65520.0f), 0x7c00u);
  ASSERT_EQ(ref_f32_to_f16(std::ldexp(1.0f, -25)), 0x0000u);
  ASSERT_EQ(ref_f32_to_f16(std::ldexp(3.0f, -25)), 0x0002u);         // 1.5 ulp -> 2 (even)
  ASSERT_EQ(ref_f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00u);  // tie -> even
  ASSERT_EQ(ref_f32_to_f16(1.0f + std::ldexp(3.0f, -11)), 0x3c02u);  // tie -> even
  size_t n = 0;
  for (const float f : f16_probe_floats()) {
    const uint16_t got = f32_to_f16(f);
    const uint16_t want = ref_f32_to_f16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(f16_is_nan(got)) << f;
      continue;
    }
    ASSERT_EQ(got, want) << "f = " << f << " (bits 0x" << std::hex << bits_of(f) << ")";
    ++n;
  }
  EXPECT_GT(n, 600000u);
}

TEST(DtypeF16, MatchesF16cHardware) {
#if defined(__F16C__)
  for (const float f : f16_probe_floats()) {
    const auto hw = static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
    const uint16_t got = f32_to_f16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(f16_is_nan(got) && f16_is_nan(hw)) << f;
      continue;
    }
    ASSERT_EQ(got, hw) << "f = " << f << " (bits 0x" << std::hex << bits_of(f) << ")";
  }
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float hw = _cvtsh_ss(h);
    if (f16_is_nan(h)) continue;
    ASSERT_EQ(bits_of(f16_to_f32(h)), bits_of(hw)) << std::hex << "0x" << b;
  }
#else
  GTEST_SKIP() << "built without F16C";
#endif
}

TEST(DtypeBf16, RoundToNearestEvenCases) {
  struct Case {
    uint32_t f32_bits;
    uint16_t want;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80u},                          // 1.0 exact
      {0x3f807fffu, 0x3f80u},                          // just below half: down
      {0x3f808000u, 0x3f80u},                          // tie, lower is even: down
      {0x3f808001u, 0x3f81u},                          // just above half: up
      {0x3f818000u, 0x3f82u},                          // tie, lower is odd: up to even
      {0x3f81ffffu, 0x3f82u}, {0xbf808000u, 0xbf80u},  // negative tie
      {0xbf818000u, 0xbf82u}, {0x7f7f8000u, 0x7f80u},  // tie at the top: up to inf (even)
      {0x7f7fffffu, 0x7f80u},                          // FLT_MAX rounds to inf
      {0x7f7f7fffu, 0x7f7fu}, {0x00000001u, 0x0000u},  // smallest subnormal: down to +0
      {0x00008000u, 0x0000u},                          // subnormal tie: even
      {0x00018000u, 0x0002u}, {0x80000000u, 0x8000u},  // -0
      {0x7f800000u, 0x7f80u},                          // inf
      {0xff800000u, 0xff80u},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(f32_to_bf16(from_bits(c.f32_bits)), c.want) << std::hex << "0x" << c.f32_bits;
    EXPECT_EQ(ref_f32_to_bf16(from_bits(c.f32_bits)), c.want)
        << std::hex << "reference, 0x" << c.f32_bits;
  }
  // NaNs stay NaN, even a signalling NaN whose payload lies only in the low 16 bits
  // (truncation would turn it into infinity), and keep their sign.
  for (const uint32_t nan_bits : {0x7f800001u, 0x7fc00000u, 0xff800001u, 0x7fffffffu}) {
    const uint16_t got = f32_to_bf16(from_bits(nan_bits));
    EXPECT_TRUE(bf16_is_nan(got)) << std::hex << nan_bits << " -> " << got;
    EXPECT_EQ(got & 0x8000u, (nan_bits >> 16) & 0x8000u);
  }
}

TEST(DtypeBf16, RoundTripAndRandomAgainstReference) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto h = static_cast<uint16_t>(b);
    if (bf16_is_nan(h)) continue;
    ASSERT_EQ(static_cast<double>(bf16_to_f32(h)), ref_bf16(h)) << std::hex << b;
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(h)), h) << std::hex << b;
  }
  std::mt19937 rng(17);
  for (int i = 0; i < 300000; ++i) {
    const float f = from_bits(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), ref_f32_to_bf16(f)) << std::hex << bits_of(f);
  }
}

TEST(DtypeConvert, ArraysMatchScalarsAndRejectI32) {
  const std::vector<float> src = random_floats(1001, 3, -70000.0f, 70000.0f);
  for (const DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(t));
    Guarded<uint8_t> packed(src.size() * dtype_size(t));
    convert_from_f32(t, src.data(), packed.data(), src.size());
    Guarded<float> back(src.size(), nan_f32());
    convert_to_f32(t, packed.data(), back.data(), src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      uint16_t h = 0;
      if (t != DType::kF32) std::memcpy(&h, packed.data() + 2 * i, 2);
      const double want = t == DType::kF32   ? src[i]
                          : t == DType::kF16 ? ref_f16(ref_f32_to_f16(src[i]))
                                             : ref_bf16(ref_f32_to_bf16(src[i]));
      if (t == DType::kF16) {
        ASSERT_EQ(h, ref_f32_to_f16(src[i])) << i;
      }
      if (t == DType::kBF16) {
        ASSERT_EQ(h, ref_f32_to_bf16(src[i])) << i;
      }
      ASSERT_EQ(static_cast<double>(back[i]), want) << i;
    }
    EXPECT_TRUE(packed.guards_intact());
    EXPECT_TRUE(back.guards_intact());
  }
  float f = 1.0f;
  int32_t i32 = 0;
  EXPECT_THROW(convert_to_f32(DType::kI32, &i32, &f, 1), Error);
  EXPECT_THROW(convert_from_f32(DType::kI32, &f, &i32, 1), Error);
}

TEST(DtypeNames, ParseAndSize) {
  EXPECT_EQ(parse_dtype("f32"), DType::kF32);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("float16"), DType::kF16);
  EXPECT_EQ(parse_dtype("i32"), DType::kI32);
  EXPECT_FALSE(parse_dtype("f64").has_value());
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
}

// ---------------------------------------------------------------------------------------
// sampling
// ---------------------------------------------------------------------------------------

// argmax with ties to the lowest id, written independently.
int32_t ref_argmax(const std::vector<float>& x) {
  int32_t best = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] > x[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  return best;
}

// Draws of each token over `draws` samples.
std::vector<int64_t> draw_counts(const std::vector<float>& logits, const SamplingParams& params,
                                 int64_t draws) {
  Sampler sampler;
  Rng rng(params.seed);
  std::vector<int64_t> counts(logits.size(), 0);
  for (int64_t i = 0; i < draws; ++i) {
    const int32_t t =
        sampler.sample(logits.data(), static_cast<int32_t>(logits.size()), params, rng);
    EXPECT_GE(t, 0);
    EXPECT_LT(t, static_cast<int32_t>(logits.size()));
    ++counts[static_cast<size_t>(t)];
  }
  return counts;
}

// Each token's count against its probability p: a token the filter forbids (p = 0) is drawn
// exactly never; any other within 4.5 binomial standard deviations of n p, a bound a correct
// sampler leaves about once in 150,000 tokens checked, whatever the seed.
void expect_binomial(const std::vector<int64_t>& counts, int64_t draws,
                     const std::vector<double>& p, const std::string& what) {
  ASSERT_EQ(counts.size(), p.size());
  const auto n = static_cast<double>(draws);
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << what << ": forbidden token " << i << " drawn " << counts[i]
                              << " times";
      continue;
    }
    const double sd = std::sqrt(n * p[i] * (1 - p[i]));
    EXPECT_LE(std::abs(static_cast<double>(counts[i]) - n * p[i]), 4.5 * sd)
        << what << ": token " << i << " drawn " << counts[i] << " times of " << draws
        << ", expected " << n * p[i] << " +- " << 4.5 * sd;
  }
}

// The logits of the sampling tests and their softmax by hand (six digits):
//   T = 1:   e^1, e^2, e^0.5, e^-1, e^1.5, e^0 = 2.718282, 7.389056, 1.648721, 0.367879,
//            4.481689, 1; sum 17.605628.
//   T = 0.5: e^(2 l) = 7.389056, 54.598150, 2.718282, 0.135335, 20.085537, 1; sum 85.926360.
// Sorted by logit the ids are 1 (2.0), 4 (1.5), 0 (1.0), 2 (0.5), 5 (0.0), 3 (-1.0).
const std::vector<float> kSamplingLogits = {1.0f, 2.0f, 0.5f, -1.0f, 1.5f, 0.0f};
constexpr int64_t kSamplingDraws = 100000;

TEST(Sampling, GreedyIsArgmaxWithTiesToLowestId) {
  Sampler sampler;
  Rng rng(1);
  const SamplingParams greedy;  // temperature 0
  const std::vector<std::vector<float>> cases = {
      {1.0f, 3.0f, 3.0f, 2.0f},        // tie in the middle
      {5.0f, 5.0f, 5.0f},              // all equal
      {-3.0f, -1.0f, -2.0f, -1.0f},    // negatives
      {0.0f, 0.0f, 0.0f, 0.0f, 9.0f},  // last
      {-INFINITY, -INFINITY, -5.0f},
      {42.0f},
  };
  const int32_t want[] = {1, 0, 1, 4, 2, 0};
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto n = static_cast<int32_t>(cases[i].size());
    EXPECT_EQ(argmax(cases[i].data(), n), want[i]) << i;
    EXPECT_EQ(sampler.sample(cases[i].data(), n, greedy, rng), want[i]) << i;
  }
  const std::vector<float> logits = random_floats(1000, 9, -5.0f, 5.0f);
  EXPECT_EQ(sampler.sample(logits.data(), 1000, greedy, rng), ref_argmax(logits));
}

TEST(Sampling, SameSeedSameSequence) {
  const std::vector<float> logits = random_floats(100, 10, -2.0f, 2.0f);
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 50;
  p.top_p = 0.9f;
  auto run = [&](uint64_t seed) {
    Sampler sampler;
    Rng rng(seed);
    std::vector<int32_t> seq;
    for (int i = 0; i < 200; ++i) seq.push_back(sampler.sample(logits.data(), 100, p, rng));
    return seq;
  };
  EXPECT_EQ(run(1234), run(1234));
  EXPECT_NE(run(1234), run(1235));
  Rng a(99), b(99), c(100);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const uint64_t va = a.next();
    EXPECT_EQ(va, b.next());
    differs |= va != c.next();
  }
  EXPECT_TRUE(differs);
}

// xoshiro256** seeded through splitmix64, written from the published reference code
// (prng.di.unimi.it), so the generator is the documented one on every platform.
TEST(Sampling, RngIsXoshiro256StarStarSeededBySplitmix64) {
  auto splitmix64 = [](uint64_t& x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t zero = 0;
  ASSERT_EQ(splitmix64(zero), 0xe220a8397b1dcdafull);  // splitmix64's known first output for 0
  auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
  for (const uint64_t seed : {uint64_t{0}, uint64_t{1}, uint64_t{0xdeadbeefcafef00dull}}) {
    uint64_t x = seed;
    uint64_t s[4];
    for (auto& w : s) w = splitmix64(x);
    Rng rng(seed);
    for (int i = 0; i < 1000; ++i) {
      const uint64_t want = rotl(s[1] * 5, 7) * 9;
      const uint64_t t = s[1] << 17;
      s[2] ^= s[0];
      s[3] ^= s[1];
      s[1] ^= s[2];
      s[0] ^= s[3];
      s[2] ^= t;
      s[3] = rotl(s[3], 45);
      ASSERT_EQ(rng.next(), want) << "seed " << seed << " draw " << i;
    }
  }
}

TEST(Sampling, UniformIsInUnitIntervalWithMeanHalf) {
  Rng rng(5);
  double sum = 0.0;
  constexpr int n = 100000;
  for (int i = 0; i < n; ++i) {
    const float u = rng.uniform();
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.01);
}

TEST(Sampling, TopKOneIsGreedyAtAnyTemperature) {
  std::vector<float> logits = random_floats(64, 11, -3.0f, 3.0f);
  logits[10] = 3.5f;
  logits[40] = 3.5f;  // tie with a higher id
  ASSERT_EQ(ref_argmax(logits), 10);
  Sampler sampler;
  for (const float temp : {0.05f, 0.7f, 1.0f, 5.0f, 100.0f}) {
    SamplingParams p;
    p.temperature = temp;
    p.top_k = 1;
    Rng rng(77);
    for (int i = 0; i < 300; ++i) ASSERT_EQ(sampler.sample(logits.data(), 64, p, rng), 10) << temp;
  }
}

TEST(Sampling, TinyTopPIsGreedy) {
  std::vector<float> logits = random_floats(64, 12, -1.0f, 1.0f);
  logits[5] = 1.2f;
  logits[33] = 1.2f;
  Sampler sampler;
  for (const float temp : {0.5f, 1.0f, 10.0f}) {
    SamplingParams p;
    p.temperature = temp;
    p.top_p = 1e-6f;
    Rng rng(78);
    for (int i = 0; i < 300; ++i) ASSERT_EQ(sampler.sample(logits.data(), 64, p, rng), 5) << temp;
  }
}

TEST(Sampling, FrequenciesMatchSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 2024;
  // 2.718282 / 17.605628, 7.389056 / 17.605628, ... (the hand softmax above).
  expect_binomial(draw_counts(kSamplingLogits, p, kSamplingDraws), kSamplingDraws,
                  {0.154398, 0.419699, 0.093647, 0.020896, 0.254560, 0.056800}, "T=1");
  p.temperature = 0.5f;  // sharper: 7.389056 / 85.926360, ...
  expect_binomial(draw_counts(kSamplingLogits, p, kSamplingDraws), kSamplingDraws,
                  {0.085993, 0.635406, 0.031635, 0.001575, 0.233753, 0.011638}, "T=0.5");
}

TEST(Sampling, TopKAndTopPRenormaliseTheKeptTokens) {
  struct Case {
    const char* what;
    float temperature;
    int32_t top_k;
    float top_p;
    uint64_t seed;
    std::vector<double> p;  // by hand; 0 for what the filter must never draw
  };
  // T = 1, the three highest kept (ids 1, 4, 0): z = 7.389056 + 4.481689 + 2.718282 =
  // 14.589027. The nucleus at 0.7 keeps the same three: 0.419699 + 0.254560 = 0.674 < 0.7,
  // + 0.154398 = 0.829 >= 0.7.
  const std::vector<double> three = {
      2.718282 / 14.589027, 7.389056 / 14.589027, 0, 0, 4.481689 / 14.589027, 0};
  // T = 0.5, all but id 3 kept: z = 85.926360 - 0.135335 = 85.791025. The nucleus at 0.99
  // keeps the same five: the cumulative softmax 0.635406, 0.869159, 0.955152, 0.986787 < 0.99,
  // 0.998425 >= 0.99. The one left out is 0.16% of the mass: 157 draws in 100,000 if a filter
  // kept one token too many.
  const std::vector<double> five = {7.389056 / 85.791025,  54.598150 / 85.791025,
                                    2.718282 / 85.791025,  0,
                                    20.085537 / 85.791025, 1 / 85.791025};
  const Case cases[] = {{"top_k=3", 1.0f, 3, 1.0f, 7, three},
                        {"top_p=0.7", 1.0f, 0, 0.7f, 8, three},
                        {"T=0.5 top_k=5", 0.5f, 5, 1.0f, 9, five},
                        {"T=0.5 top_p=0.99", 0.5f, 0, 0.99f, 10, five}};
  for (const Case& c : cases) {
    SamplingParams p;
    p.temperature = c.temperature;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.seed = c.seed;
    expect_binomial(draw_counts(kSamplingLogits, p, kSamplingDraws), kSamplingDraws, c.p, c.what);
  }
}

TEST(Sampling, ValidateRejectsOutOfRangeValues) {
  const SamplingParams ok;
  EXPECT_NO_THROW(ok.validate());
  SamplingParams good;
  good.temperature = 0.8f;
  good.top_k = 40;
  good.top_p = 1.0f;
  EXPECT_NO_THROW(good.validate());

  auto expect_rejects = [](SamplingParams p, const char* field) {
    try {
      p.validate();
      ADD_FAILURE() << "accepted " << p.str();
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    }
  };
  SamplingParams p;
  p.temperature = -0.1f;
  expect_rejects(p, "temperature");
  p.temperature = std::numeric_limits<float>::quiet_NaN();
  expect_rejects(p, "temperature");
  p.temperature = std::numeric_limits<float>::infinity();
  expect_rejects(p, "temperature");
  p = SamplingParams{};
  p.top_p = 0.0f;
  expect_rejects(p, "top_p");
  p.top_p = 1.5f;
  expect_rejects(p, "top_p");
  p.top_p = -0.5f;
  expect_rejects(p, "top_p");
  p.top_p = std::numeric_limits<float>::quiet_NaN();
  expect_rejects(p, "top_p");
  p = SamplingParams{};
  p.top_k = -1;
  expect_rejects(p, "top_k");
}

// Issue 10, failure 6: a thread count the machine cannot use is refused, never passed on
// to OpenMP and OpenBLAS (--threads 1000 hung inside OpenBLAS on a 2-core machine).
TEST(CpuThreads, RequestsAboveFourPerHardwareThreadAreRefused) {
  const int hw = omp_get_num_procs();
  EXPECT_LE(max_cpu_threads(), 4 * hw);
  EXPECT_GE(max_cpu_threads(), 1);
  EXPECT_EQ(resolve_cpu_threads(1), 1);
  EXPECT_EQ(resolve_cpu_threads(0), std::min(hw, max_cpu_threads()));
  for (int bad : {4 * hw + 1, 1000, -1}) {
    try {
      CpuBackend b(bad);
      if (bad > 0) ADD_FAILURE() << bad << " threads accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad) + " CPU threads requested"),
                std::string::npos)
          << e.what();
    }
  }
}

// Allocations that know what they are say so when memory runs out.
TEST(OomContext, SaysWhatWasBeingAllocated) {
  try {
    with_oom_context("allocating the KV cache", []() -> int { throw std::bad_alloc(); });
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOverloaded);
    EXPECT_EQ(std::string(e.what()), "out of memory while allocating the KV cache");
  }
#ifndef __SANITIZE_ADDRESS__  // ASan aborts on a 2^63-byte request instead of failing it
  try {
    CpuBackend cpu(1);
    with_oom_context("building tables", [&] { return cpu.allocate(~size_t{0} >> 1); });
    ADD_FAILURE() << "allocated 2^63 bytes";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOverloaded);
    EXPECT_EQ(std::string(e.what()).rfind("out of memory while building tables: cpu backend", 0),
              0u)
        << e.what();
  }
#endif
  EXPECT_EQ(with_oom_context("x", [] { return 7; }), 7);
  EXPECT_THROW(with_oom_context("x", []() -> int { throw InputError("bad"); }), InputError);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Attention with a sliding window and soft-capped scores against the formulas written out
// (Mistral's / Gemma-2's: a query at i sees keys i - window < j <= i; s = cap tanh(s / cap)
// after the scale, before the mask), for a prefill chunk and a decode row, head_dim 32 so the
// vectorised decode passes run too.
TEST(CpuBackendAttention, SlidingWindowAndSoftcapFollowTheirFormulas) {
  constexpr int32_t kHd = 32, kCap = 16, kWindow = 3;
  constexpr float kScale = 0.4f, kSoftcap = 2.0f;
  CpuBackend cpu(1);
  const std::vector<float> keys = random_floats(2 * kCap * kHd, 11);
  const std::vector<float> values = random_floats(keys.size(), 12);
  std::vector<float> kc = keys, vc = values;  // two slots, positions written already
  const KvLayerView view{kc.data(), vc.data(), 2, kCap, 1, kHd};
  // Slot 0: a 6-row prefill; slot 1: one decode row at position 9.
  const std::vector<SeqSlice> seqs = {SeqSlice{0, 6, 0, 0}, SeqSlice{6, 1, 9, 1}};
  const std::vector<float> q = random_floats(7 * kHd, 13);
  std::vector<float> out(q.size());
  cpu.attention(q.data(), seqs, view, AttentionDims{1, 1, kHd, kScale, kWindow, kSoftcap},
                out.data());
  auto expect_row = [&](int32_t row, int32_t slot, int32_t pos) {
    const float* k = keys.data() + static_cast<size_t>(slot) * kCap * kHd;
    const float* v = values.data() + static_cast<size_t>(slot) * kCap * kHd;
    std::vector<double> p;
    double sum = 0;
    for (int32_t j = std::max(0, pos - kWindow + 1); j <= pos; ++j) {
      double s = 0;
      for (int32_t d = 0; d < kHd; ++d) s += double{q[row * kHd + d]} * k[j * kHd + d];
      s = kSoftcap * std::tanh(s * kScale / kSoftcap);
      p.push_back(std::exp(s));
      sum += p.back();
    }
    for (int32_t d = 0; d < kHd; ++d) {
      double o = 0;
      for (size_t n = 0; n < p.size(); ++n)
        o += p[n] / sum * v[(std::max(0, pos - kWindow + 1) + static_cast<int32_t>(n)) * kHd + d];
      EXPECT_NEAR(out[static_cast<size_t>(row) * kHd + d], o, 1e-5) << "row " << row << " d " << d;
    }
  };
  for (int32_t i = 0; i < 6; ++i) expect_row(i, 0, i);
  expect_row(6, 1, 9);
}

}  // namespace
}  // namespace strata
