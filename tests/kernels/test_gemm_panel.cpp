// The panel GEMM (kernels/gemm_panel.h) of every instruction set this CPU has, each called
// directly: the packed layout as the header defines it (written here by its formula, not by
// pack_panels), shapes with and without tail rows, k across the kernels' k slices, m across
// the micro-kernels' row tiles and the kMc row blocks, sub-ranges of panels, against a
// double-precision reference. Weights and activations are multiples of 2^-10 in [-1, 1], so
// every product is exact in f32 and only the order of the sums differs from the reference.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <ostream>
#include <random>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/error.h"
#include "kernels/gemm_panel.h"

namespace strata {

[[maybe_unused]] static void PrintTo(CpuIsa isa, std::ostream* os) {
  *os << cpu_isa_name(isa);
}

namespace {

// Where element (r, c) of an [n, k] matrix lives in the packed layout: panel r / 32 holds
// its 32 rows k-major; the last n % 32 rows follow row-major.
size_t packed_index(int64_t n, int64_t k, int64_t r, int64_t c) {
  const int64_t full = n / 32 * 32;
  if (r >= full) return static_cast<size_t>(r * k + c);
  return static_cast<size_t>(((r / 32) * k + c) * 32 + r % 32);
}

std::vector<float> grid_values(size_t count, std::mt19937& rng) {
  std::uniform_int_distribution<int> d(-1024, 1024);
  std::vector<float> v(count);
  for (float& x : v) x = std::ldexp(static_cast<float>(d(rng)), -10);
  return v;
}

struct Packed {
  std::vector<float> rows;  // row-major, the reference's view
  std::vector<float> packed;
  Tensor t;
  Packed(int64_t n, int64_t k, std::mt19937& rng)
      : rows(grid_values(static_cast<size_t>(n * k), rng)), packed(rows.size()) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c)
        packed[packed_index(n, k, r, c)] = rows[static_cast<size_t>(r * k + c)];
    t.data = packed.data();
    t.dtype = DType::kF32Panel;
    t.shape = Shape{n, k};
  }
};

class PanelIsaTest : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(PanelIsaTest, EveryShapeAndPanelRangeMatchesTheReference) {
  const CpuIsa isa = GetParam();
  if (isa > detected_cpu_isa()) GTEST_SKIP() << "this CPU has " << cpu_isa_name(detected_cpu_isa());
  std::mt19937 rng(7);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t m : {1, 2, 3, 7, 8, 9, 17, 65})
    for (int64_t n : {5, 32, 64, 100, 160})
      for (int64_t k : {int64_t{1}, int64_t{3}, int64_t{64}, kPanelKSlice - 1, kPanelKSlice,
                        kPanelKSlice + 44, 2 * kPanelKSlice + 5}) {
        SCOPED_TRACE(::testing::Message()
                     << cpu_isa_name(isa) << " m=" << m << " n=" << n << " k=" << k);
        const Packed w(n, k, rng);
        const std::vector<float> x = grid_values(static_cast<size_t>(m * k), rng);
        const std::vector<float> bias = grid_values(static_cast<size_t>(n), rng);
        const int64_t panels = n / 32;
        const int64_t p0 = panels > 0 ? std::uniform_int_distribution<int64_t>(0, panels)(rng) : 0;
        const int64_t p1 = panels > 0 ? std::uniform_int_distribution<int64_t>(p0, panels)(rng) : 0;
        const bool tail = (m + k) % 2 == 0;
        const bool with_bias = (n + k) % 2 == 1;
        // Some outputs are a block of a wider matrix: columns past n must stay untouched.
        const int64_t ldy = n + (k % 3 == 0 ? 7 : 0);
        std::vector<float> y(static_cast<size_t>(m * ldy), nan);
        panel_linear_with(isa, x.data(), m, w.t, with_bias ? bias.data() : nullptr, y.data(), ldy,
                          p0, p1, tail);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t c = n; c < ldy; ++c)
            ASSERT_TRUE(std::isnan(y[static_cast<size_t>(i * ldy + c)]))
                << "column " << c << " past n";
        for (int64_t i = 0; i < m; ++i)
          for (int64_t c = 0; c < n; ++c) {
            const float got = y[static_cast<size_t>(i * ldy + c)];
            const bool written = (c >= p0 * 32 && c < p1 * 32) || (tail && c >= panels * 32);
            if (!written) {
              ASSERT_TRUE(std::isnan(got)) << "column " << c << " outside panels [" << p0 << ", "
                                           << p1 << ") tail " << tail << " was written";
              continue;
            }
            double ref = with_bias ? bias[static_cast<size_t>(c)] : 0.0;
            for (int64_t j = 0; j < k; ++j)
              ref += static_cast<double>(x[static_cast<size_t>(i * k + j)]) *
                     w.rows[static_cast<size_t>(c * k + j)];
            ASSERT_NEAR(got, ref, 1e-6 * (1.0 + static_cast<double>(k)))
                << "y[" << i << ", " << c << "]";
          }
      }
}

INSTANTIATE_TEST_SUITE_P(Isa, PanelIsaTest,
                         ::testing::Values(CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const auto& p) { return std::string(cpu_isa_name(p.param)); });

TEST(PackPanels, PlacesEveryElementWhereTheLayoutSays) {
  std::mt19937 rng(3);
  for (int64_t n : {1, 31, 32, 33, 96, 101})
    for (int64_t k : {1, 63, 64, 65, 130}) {
      const Packed want(n, k, rng);
      std::vector<float> got(want.rows.size(), std::numeric_limits<float>::quiet_NaN());
      pack_panels(want.rows.data(), n, k, got.data());
      ASSERT_EQ(got, want.packed) << "n=" << n << " k=" << k;
      std::vector<float> row(static_cast<size_t>(k));
      for (int64_t r = 0; r < n; ++r) {
        panel_row(want.packed.data(), n, k, r, row.data());
        const auto* first = want.rows.data() + r * k;
        ASSERT_EQ(row, std::vector<float>(first, first + k)) << "row " << r << " of n=" << n;
      }
    }
}

TEST(PackPanels, RefusesARangeOrDtypeItCannotTake) {
  std::mt19937 rng(4);
  Packed w(64, 8, rng);
  std::vector<float> x(8, 1.0f), y(64);
  EXPECT_THROW(panel_linear(x.data(), 1, w.t, nullptr, y.data(), 64, 0, 3, false), Error);
  EXPECT_THROW(panel_linear(x.data(), 1, w.t, nullptr, y.data(), 63, 0, 2, false), Error);
  EXPECT_THROW(panel_row(w.packed.data(), 64, 8, 64, y.data()), Error);
  w.t.dtype = DType::kF32;
  EXPECT_THROW(panel_linear(x.data(), 1, w.t, nullptr, y.data(), 64, 0, 2, false), Error);
}

}  // namespace
}  // namespace strata
