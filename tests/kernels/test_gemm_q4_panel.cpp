// The 4-bit panels (kernels/gemm_q4_panel.h): the packed bytes checked against the layout
// the header defines (by its formula, not by re-running pack_q4_panels), rows decoded as the
// row layout decodes them, and the linear of every instruction set against a double
// reference over the dequantised weights (quant.h's dequantize_4bit, an independent decoder
// of the same codes), with the error the int8 split of x allows: |x - x'| <= max|x_group| /
// 65024 per value (quant.h), so per output sum_c |w_c| * max|x_group(c)| / 65024, plus f32
// rounding. Shapes cover the micro-kernel's row tiles (8), its tails, the kQ4PanelMc row
// blocks, and matrices whose last panel is short.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/error.h"
#include "kernels/gemm_q4_panel.h"
#include "kernels/quant.h"

namespace strata {

[[maybe_unused]] static void PrintTo(CpuIsa isa, std::ostream* os) {
  *os << cpu_isa_name(isa);
}

namespace {

std::vector<float> uniform(size_t count, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(count);
  for (float& x : v) x = d(rng);
  return v;
}

// A random [n, k] matrix quantised as kQ4 (groups of 64 along rows) and packed into panels.
struct Packed {
  int64_t n, k;
  QuantizedTensor q;
  std::vector<float> decoded;  // dequantize_4bit's values, row-major
  OwnedTensor panels;
  Packed(int64_t rows, int64_t cols, std::mt19937& rng)
      : n(rows),
        k(cols),
        q(quantize_4bit(uniform(static_cast<size_t>(rows * cols), -1.0f, 1.0f, rng).data(),
                        {rows, cols, kQuantGroupSize, QuantAxis::kAlongRow})),
        decoded(static_cast<size_t>(rows * cols)),
        panels(DType::kQ4Panel, Shape{rows, cols}) {
    dequantize_4bit(q, decoded.data());
    pack_q4_panels(q.view(), panels.storage.as<uint8_t>());
  }
};

TEST(Q4Panel, BytesFollowTheHeadersLayout) {
  std::mt19937 rng(1);
  for (const int64_t n : {1, 16, 37}) {
    const int64_t k = 192, gpr = k / 64;
    const Packed w(n, k, rng);
    ASSERT_EQ(w.panels.view.bytes(), static_cast<size_t>(n * gpr * 40)) << "kQ4's bytes";
    const auto* out = w.panels.storage.as<const uint8_t>();
    const auto* codes = w.q.packed.as<const uint8_t>();
    const auto* scales = w.q.scales.as<const float>();
    const auto* mins = w.q.mins.as<const float>();
    for (int64_t row = 0; row < n; ++row)
      for (int64_t g = 0; g < gpr; ++g) {
        const int64_t p = row / 16, r = row % 16, rows = std::min<int64_t>(16, n - 16 * p);
        const uint8_t* block = out + (16 * p * gpr + g * rows) * 40;
        for (int64_t s = 0; s < 8; ++s)
          for (int64_t b = 0; b < 4; ++b)
            ASSERT_EQ(block[(s * rows + r) * 4 + b], codes[row * k / 2 + g * 32 + 4 * s + b])
                << "row " << row << " group " << g;
        float scale, mn;
        std::memcpy(&scale, block + rows * 32 + 4 * r, 4);
        std::memcpy(&mn, block + rows * 36 + 4 * r, 4);
        EXPECT_EQ(scale, scales[row * gpr + g]) << "row " << row;
        EXPECT_EQ(mn, mins[row * gpr + g]) << "row " << row;
      }
  }
}

TEST(Q4Panel, RowsDecodeToTheRowLayoutsValues) {
  std::mt19937 rng(2);
  const Packed w(45, 320, rng);
  std::vector<float> got(static_cast<size_t>(w.k)), want(got.size());
  for (int64_t row = 0; row < w.n; ++row) {
    q4_panel_row(w.panels.storage.as<const uint8_t>(), w.n, w.k, row, got.data());
    dequantize_one_row(w.q.view(), row, want.data());
    ASSERT_EQ(got, want) << "row " << row;
  }
  EXPECT_THROW(q4_panel_row(w.panels.storage.as<const uint8_t>(), w.n, w.k, w.n, got.data()),
               Error);
}

// The reference and the bound of one output.
struct Expected {
  double value;
  double bound;
};

Expected reference(const Packed& w, const std::vector<float>& x, const float* bias, int64_t i,
                   int64_t row) {
  double value = bias != nullptr ? bias[row] : 0.0;
  double split = 0.0, magnitude = 0.0;
  for (int64_t g = 0; g < w.k / 64; ++g) {
    double amax = 0.0;
    for (int64_t c = g * 64; c < (g + 1) * 64; ++c)
      amax = std::max(amax, std::fabs(static_cast<double>(x[static_cast<size_t>(i * w.k + c)])));
    for (int64_t c = g * 64; c < (g + 1) * 64; ++c) {
      const double wc = w.decoded[static_cast<size_t>(row * w.k + c)];
      const double xc = x[static_cast<size_t>(i * w.k + c)];
      value += wc * xc;
      split += std::fabs(wc) * amax / 65024.0;
      magnitude += std::fabs(wc * xc);
    }
  }
  return {value, split + 1e-5 * magnitude + 1e-6};
}

class Q4PanelIsaTest : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(Q4PanelIsaTest, LinearMatchesTheDecodedWeightsWithinTheSplitsBound) {
  const CpuIsa isa = GetParam();
  if (isa > detected_cpu_isa()) GTEST_SKIP() << "this CPU has " << cpu_isa_name(detected_cpu_isa());
  if (isa == CpuIsa::kAvx512 && !q4_panels_pay(isa)) GTEST_SKIP() << "no AVX-512 VNNI here";
  std::mt19937 rng(3);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Q4PanelScratch scratch;
  for (const int64_t m : {1, 2, 3, 7, 8, 9, 16, 17, 135})
    for (const int64_t n : {5, 16, 37, 100})
      for (const int64_t k : {64, 192, 768}) {
        if (m > 17 && k > 192) continue;  // the long rows and the row blocks, apart
        SCOPED_TRACE(::testing::Message()
                     << cpu_isa_name(isa) << " m=" << m << " n=" << n << " k=" << k);
        const Packed w(n, k, rng);
        const std::vector<float> x = uniform(static_cast<size_t>(m * k), -2.0f, 2.0f, rng);
        const std::vector<float> bias = uniform(static_cast<size_t>(n), -1.0f, 1.0f, rng);
        const float* b = (m + n) % 2 == 0 ? bias.data() : nullptr;
        std::vector<float> y(static_cast<size_t>(m * n) + 16, nan);  // 16 past the end: untouched
        q4_panel_linear(x.data(), m, w.panels.view, b, y.data(), scratch, isa);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t row = 0; row < n; ++row) {
            const Expected e = reference(w, x, b, i, row);
            ASSERT_NEAR(y[static_cast<size_t>(i * n + row)], e.value, e.bound)
                << "y[" << i << ", " << row << "]";
          }
        for (size_t j = static_cast<size_t>(m * n); j < y.size(); ++j)
          ASSERT_TRUE(std::isnan(y[j]));
      }
}

// A NaN or infinity in a group of x makes its row's outputs NaN (the split's scale is NaN),
// and the other rows keep their values.
TEST_P(Q4PanelIsaTest, NonFiniteActivationPoisonsOnlyItsRow) {
  const CpuIsa isa = GetParam();
  if (isa > detected_cpu_isa()) GTEST_SKIP() << "this CPU has " << cpu_isa_name(detected_cpu_isa());
  if (isa == CpuIsa::kAvx512 && !q4_panels_pay(isa)) GTEST_SKIP() << "no AVX-512 VNNI here";
  std::mt19937 rng(4);
  const int64_t m = 3, n = 20, k = 128;
  const Packed w(n, k, rng);
  for (const float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> x = uniform(static_cast<size_t>(m * k), -1.0f, 1.0f, rng);
    x[static_cast<size_t>(k + 70)] = bad;
    std::vector<float> y(static_cast<size_t>(m * n));
    Q4PanelScratch scratch;
    q4_panel_linear(x.data(), m, w.panels.view, nullptr, y.data(), scratch, isa);
    for (int64_t row = 0; row < n; ++row) {
      EXPECT_TRUE(std::isnan(y[static_cast<size_t>(n + row)])) << "row " << row;
      for (const int64_t i : {0, 2}) {
        const Expected e = reference(w, x, nullptr, i, row);
        EXPECT_NEAR(y[static_cast<size_t>(i * n + row)], e.value, e.bound);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, Q4PanelIsaTest,
                         ::testing::Values(CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const ::testing::TestParamInfo<CpuIsa>& p) {
                           return std::string(cpu_isa_name(p.param));
                         });

TEST(Q4Panel, RefusesOtherLayouts) {
  std::mt19937 rng(5);
  const Packed w(16, 64, rng);
  OwnedTensor rows(DType::kQ4, Shape{16, 64});
  write_q4_blob(w.q, rows.storage.data());
  std::vector<float> x(64, 1.0f), y(16);
  Q4PanelScratch scratch;
  EXPECT_THROW(
      q4_panel_linear(x.data(), 1, rows.view, nullptr, y.data(), scratch, active_cpu_isa()), Error);
  const std::vector<float> square(64 * 64, 0.5f);
  const QuantizedTensor by_columns =
      quantize_4bit(square.data(), {64, 64, kQuantGroupSize, QuantAxis::kAlongColumn});
  std::vector<uint8_t> out(by_columns.bytes());
  EXPECT_THROW(pack_q4_panels(by_columns.view(), out.data()), Error);
}

}  // namespace
}  // namespace strata
