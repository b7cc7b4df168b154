// The decode GEMV of every instruction set this CPU has (portable, AVX2, AVX-512), each
// called directly: odd shapes and k tails, sub-ranges of output rows that split the
// kernels' row tiles, every weight dtype, against a double-precision reference written
// here. Weights are values exactly representable in their dtype, so the reference knows
// them exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/gemv.h"

namespace strata {

[[maybe_unused]] static void PrintTo(CpuIsa isa, std::ostream* os) {
  *os << cpu_isa_name(isa);
}

namespace {

// A random weight [n, k] of exactly representable values: integers in [-1024, 1024]
// times 2^-10 (11 significant bits: exact in f16; bf16 keeps 8, so there the integer is
// cut to a multiple of 8 first).
struct Weight {
  std::vector<unsigned char> storage;
  std::vector<double> exact;
  Tensor t;
  Weight(DType dt, int64_t n, int64_t k, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> d(-1024, 1024);
    const auto count = static_cast<size_t>(n * k);
    storage.resize(count * dtype_size(dt));
    exact.resize(count);
    for (size_t i = 0; i < count; ++i) {
      int q = d(rng);
      if (dt == DType::kBF16) q = q / 8 * 8;
      const float v = std::ldexp(static_cast<float>(q), -10);
      exact[i] = v;
      if (dt == DType::kF32) {
        std::memcpy(storage.data() + 4 * i, &v, 4);
      } else {
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        // bf16 is the top half of the f32 (exact here); f16 is built from its definition.
        uint16_t h = static_cast<uint16_t>(bits >> 16);
        if (dt == DType::kF16) h = f16_bits(v);
        std::memcpy(storage.data() + 2 * i, &h, 2);
      }
    }
    t.dtype = dt;
    t.shape = Shape{n, k};
    t.data = storage.data();
  }
  // An exactly representable normal or zero f32 as f16 bits: sign, biased exponent,
  // the top 10 fraction bits.
  static uint16_t f16_bits(float v) {
    if (v == 0.0f) return 0;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const uint32_t sign = bits >> 31;
    const int exp = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
    return static_cast<uint16_t>((sign << 15) | (static_cast<uint32_t>(exp) << 10) |
                                 ((bits >> 13) & 0x3ff));
  }
};

std::vector<CpuIsa> isas_here() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (isa <= detected_cpu_isa()) out.push_back(isa);
  return out;
}

class GemvIsaTest : public ::testing::TestWithParam<CpuIsa> {};

TEST_P(GemvIsaTest, EveryShapeDtypeAndRowRangeMatchesTheReference) {
  const CpuIsa isa = GetParam();
  if (isa > detected_cpu_isa()) GTEST_SKIP() << "this CPU has " << cpu_isa_name(detected_cpu_isa());
  std::mt19937 rng(5);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (int64_t m : {1, 2, 3, 4, 5, 8, 16})
      for (int64_t n : {1, 3, 4, 15, 16, 17, 33, 70})
        for (int64_t k : {1, 7, 8, 16, 17, 53, 96}) {
          SCOPED_TRACE(::testing::Message() << cpu_isa_name(isa) << " " << dtype_name(dt)
                                            << " m=" << m << " n=" << n << " k=" << k);
          const Weight w(dt, n, k, static_cast<uint32_t>(rng()));
          std::vector<float> x(static_cast<size_t>(m * k)), bias(static_cast<size_t>(n));
          std::uniform_real_distribution<float> u(-1.0f, 1.0f);
          for (float& v : x) v = u(rng);
          for (float& v : bias) v = u(rng);
          const int64_t n0 = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
          const int64_t n1 = std::uniform_int_distribution<int64_t>(n0 + 1, n)(rng);
          const bool with_bias = (n + k) % 2 == 0;
          std::vector<float> y(static_cast<size_t>(m * n), nan);
          gemv_rows_with(isa, x.data(), m, w.t, with_bias ? bias.data() : nullptr, y.data(), n0,
                         n1);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t c = 0; c < n; ++c) {
              const float got = y[static_cast<size_t>(i * n + c)];
              if (c < n0 || c >= n1) {
                ASSERT_TRUE(std::isnan(got))
                    << "row " << c << " outside [" << n0 << ", " << n1 << ") was written";
                continue;
              }
              double ref = with_bias ? bias[static_cast<size_t>(c)] : 0.0;
              for (int64_t j = 0; j < k; ++j)
                ref += static_cast<double>(x[static_cast<size_t>(i * k + j)]) *
                       w.exact[static_cast<size_t>(c * k + j)];
              ASSERT_NEAR(got, ref, 1e-5 * (1.0 + static_cast<double>(k)))
                  << "y[" << i << ", " << c << "]";
            }
        }
}

INSTANTIATE_TEST_SUITE_P(Isa, GemvIsaTest,
                         ::testing::Values(CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const auto& p) { return std::string(cpu_isa_name(p.param)); });

// The names STRATA_CPU_ISA takes are parsed by the tunables table (test_tunables.cpp).
TEST(CpuIsa, TheActiveOneIsOneThisCpuHas) {
  EXPECT_LE(active_cpu_isa(), detected_cpu_isa());
  EXPECT_FALSE(isas_here().empty());
}

TEST(CpuIsa, AnInstructionSetTheCpuLacksIsRefused) {
  if (detected_cpu_isa() == CpuIsa::kAvx512) GTEST_SKIP() << "this CPU has every one";
  const Weight w(DType::kF32, 4, 16, 1);
  std::vector<float> x(16, 1.0f), y(4);
  EXPECT_THROW(gemv_rows_with(CpuIsa::kAvx512, x.data(), 1, w.t, nullptr, y.data(), 0, 4), Error);
}

}  // namespace
}  // namespace strata
