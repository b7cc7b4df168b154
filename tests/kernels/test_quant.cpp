// Group-wise 4-bit quantization (kernels/quant.h) against references written here: the
// format is decoded nibble by nibble with the test's own group indexing, the round trip is
// held to the bound the format implies (scale / 2 per group, plus float rounding), and
// linear_4bit is compared with a double-precision product over the decoded weights under
//   max |got - ref| / max(1, max |ref|),
// with canary guard bytes around every output and NaN-filled outputs (ggml test-backend-ops
// style, as tests/kernels/test_cpu_backend.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu_isa.h"
#include "kernels/error.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"

namespace strata {
namespace {

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

constexpr size_t kGuardBytes = 64;
constexpr double kTolF32 = 1e-5;
constexpr float kFloatEps = std::numeric_limits<float>::epsilon();

uint8_t canary(size_t i) {
  return static_cast<uint8_t>(0xA5u + 37u * i);
}

// n floats between two runs of canary bytes.
class GuardedFloats {
 public:
  explicit GuardedFloats(size_t n, float fill = std::numeric_limits<float>::quiet_NaN())
      : n_(n), buf_(2 * kGuardBytes + std::max<size_t>(n, 1) * sizeof(float)) {
    auto* b = buf_.as<uint8_t>();
    for (size_t i = 0; i < kGuardBytes; ++i) {
      b[i] = canary(i);
      b[kGuardBytes + n_ * sizeof(float) + i] = canary(i + kGuardBytes);
    }
    std::fill(data(), data() + n_, fill);
  }
  float* data() const { return reinterpret_cast<float*>(buf_.as<uint8_t>() + kGuardBytes); }
  float operator[](size_t i) const { return data()[i]; }
  void assign(const std::vector<float>& v) {
    ASSERT_EQ(v.size(), n_);
    std::copy(v.begin(), v.end(), data());
  }
  std::vector<float> vec() const { return {data(), data() + n_}; }

  ::testing::AssertionResult guards_intact() const {
    const auto* b = buf_.as<const uint8_t>();
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (b[i] != canary(i))
        return ::testing::AssertionFailure() << "guard byte before the buffer overwritten";
      if (b[kGuardBytes + n_ * sizeof(float) + i] != canary(i + kGuardBytes))
        return ::testing::AssertionFailure()
               << "guard byte " << i << " after the buffer (of " << n_ << " floats) overwritten";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  size_t n_;
  Buffer buf_;
};

std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// The format, decoded independently of the library.
int64_t ref_group(const QuantLayout& l, int64_t r, int64_t c) {
  if (l.axis == QuantAxis::kAlongRow) return r * (l.cols / l.group_size) + c / l.group_size;
  return (r / l.group_size) * l.cols + c;
}

int ref_code(const QuantizedTensor& t, int64_t r, int64_t c) {
  const int64_t i = r * t.layout.cols + c;
  const uint8_t byte = t.packed.as<const uint8_t>()[i / 2];
  return i % 2 == 0 ? (byte & 0x0f) : (byte >> 4);  // even index in the low nibble
}

double ref_value(const QuantizedTensor& t, int64_t r, int64_t c) {
  const int64_t g = ref_group(t.layout, r, c);
  return ref_code(t, r, c) * static_cast<double>(t.scales.as<const float>()[g]) +
         t.mins.as<const float>()[g];
}

std::string axis_label(QuantAxis a) {
  return a == QuantAxis::kAlongRow ? "rows" : "cols";
}

// ---------------------------------------------------------------------------------------
// Round trip: every value within scale / 2 of its group, on several kinds of data
// ---------------------------------------------------------------------------------------

enum class Data {
  kUniform,
  kOutliers,
  kConstantGroups,
  kNegative,
  kTinyRange,
  kTinyMagnitude,
  kLargeOffset
};

std::string data_label(Data d) {
  switch (d) {
    case Data::kUniform:
      return "uniform";
    case Data::kOutliers:
      return "outliers";
    case Data::kConstantGroups:
      return "constant";
    case Data::kNegative:
      return "negative";
    case Data::kTinyRange:
      return "tiny_range";
    case Data::kTinyMagnitude:
      return "tiny_magnitude";
    case Data::kLargeOffset:
      return "large_offset";
  }
  return "?";
}

std::vector<float> make_data(Data kind, const QuantLayout& l, uint32_t seed) {
  const auto n = static_cast<size_t>(l.numel());
  switch (kind) {
    case Data::kUniform:
      return random_floats(n, seed);
    case Data::kOutliers: {
      auto v = random_floats(n, seed, -0.1f, 0.1f);
      for (size_t i = 5; i < n; i += 37) v[i] = (i % 2 == 0) ? 50.0f : -80.0f;
      return v;
    }
    case Data::kConstantGroups: {
      std::vector<float> v(n);
      for (int64_t r = 0; r < l.rows; ++r)
        for (int64_t c = 0; c < l.cols; ++c) {
          const int64_t g = ref_group(l, r, c);
          v[static_cast<size_t>(r * l.cols + c)] =
              g % 4 == 0 ? 0.0f : 0.1f * static_cast<float>(g) - 1.7f;
        }
      return v;
    }
    case Data::kNegative:
      return random_floats(n, seed, -5.0f, -2.0f);
    case Data::kTinyRange:
      return random_floats(n, seed, 0.75f, 0.75f + 1e-5f);
    case Data::kTinyMagnitude:
      return random_floats(n, seed, 1e-30f, 2e-30f);
    case Data::kLargeOffset:
      return random_floats(n, seed, 1e4f - 1.0f, 1e4f + 1.0f);
  }
  return {};
}

struct GroupRange {
  float min = std::numeric_limits<float>::infinity();
  float max = -std::numeric_limits<float>::infinity();
};

std::vector<GroupRange> group_ranges(const QuantLayout& l, const std::vector<float>& x) {
  std::vector<GroupRange> g(static_cast<size_t>(l.n_groups()));
  for (int64_t r = 0; r < l.rows; ++r)
    for (int64_t c = 0; c < l.cols; ++c) {
      auto& gr = g[static_cast<size_t>(ref_group(l, r, c))];
      gr.min = std::min(gr.min, x[static_cast<size_t>(r * l.cols + c)]);
      gr.max = std::max(gr.max, x[static_cast<size_t>(r * l.cols + c)]);
    }
  return g;
}

using RoundTripParam =
    std::tuple<Data, QuantAxis, int64_t /*rows*/, int64_t /*cols*/, int64_t /*group*/>;
class QuantRoundTrip : public ::testing::TestWithParam<RoundTripParam> {};

// Metadata is the group's exact min and (max - min) / 15; the min codes to 0, the max to 15.
void check_metadata(const QuantizedTensor& t, const std::vector<float>& x,
                    const std::vector<GroupRange>& ranges) {
  const QuantLayout& l = t.layout;
  for (size_t g = 0; g < ranges.size(); ++g) {
    ASSERT_EQ(t.mins.as<const float>()[g], ranges[g].min) << "group " << g;
    ASSERT_EQ(t.scales.as<const float>()[g], (ranges[g].max - ranges[g].min) / 15.0f)
        << "group " << g;
  }
  for (int64_t r = 0; r < l.rows; ++r)
    for (int64_t c = 0; c < l.cols; ++c) {
      const float v = x[static_cast<size_t>(r * l.cols + c)];
      const auto& gr = ranges[static_cast<size_t>(ref_group(l, r, c))];
      if (v == gr.min) {
        ASSERT_EQ(ref_code(t, r, c), 0) << "min of its group at " << r << "," << c;
      }
      if (v == gr.max && gr.max > gr.min) {
        ASSERT_EQ(ref_code(t, r, c), 15) << "max of its group at " << r << "," << c;
      }
    }
}

TEST_P(QuantRoundTrip, ErrorWithinHalfScale) {
  const auto [kind, axis, rows, cols, group] = GetParam();
  const QuantLayout l{rows, cols, group, axis};
  const std::vector<float> x = make_data(kind, l, 7);
  const QuantizedTensor t = quantize_4bit(x.data(), l);
  GuardedFloats out(static_cast<size_t>(l.numel()));
  dequantize_4bit(t, out.data());
  EXPECT_TRUE(out.guards_intact());

  const auto ranges = group_ranges(l, x);
  check_metadata(t, x, ranges);
  int64_t checked = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const auto i = static_cast<size_t>(r * cols + c);
      const auto& gr = ranges[static_cast<size_t>(ref_group(l, r, c))];
      const double scale = (gr.max - gr.min) / 15.0f;
      const double magnitude = std::max(std::fabs(gr.min), std::fabs(gr.max));
      // Rounding to the nearest of 16 levels: scale / 2; float arithmetic adds a few ulps.
      const double bound = scale / 2 + 4 * kFloatEps * magnitude;
      ASSERT_LE(std::fabs(static_cast<double>(out[i]) - x[i]), bound) << "at " << r << "," << c;
      if (gr.max == gr.min) {
        ASSERT_EQ(out[i], x[i]) << "a constant group must round-trip exactly";
      }
      // The library's decode is the format's: q * scale + min, rounded once to f32.
      const double want = ref_value(t, r, c);
      ASSERT_LE(std::fabs(out[i] - want), 0.5 * kFloatEps * std::fabs(want))
          << "at " << r << "," << c;
      ++checked;
    }
  EXPECT_EQ(checked, rows * cols);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, QuantRoundTrip,
    ::testing::Combine(::testing::Values(Data::kUniform, Data::kOutliers, Data::kConstantGroups,
                                         Data::kNegative, Data::kTinyRange, Data::kTinyMagnitude,
                                         Data::kLargeOffset),
                       ::testing::Values(QuantAxis::kAlongRow, QuantAxis::kAlongColumn),
                       ::testing::Values(int64_t{192}), ::testing::Values(int64_t{192}),
                       ::testing::Values(int64_t{64}, int64_t{6})),
    [](const auto& tp) {
      return data_label(std::get<0>(tp.param)) + "_" + axis_label(std::get<1>(tp.param)) + "_g" +
             std::to_string(std::get<4>(tp.param));
    });

// ---------------------------------------------------------------------------------------
// Format: sizes, nibble order, layout checks
// ---------------------------------------------------------------------------------------

TEST(QuantFormat, BytesAreHalfAByteAValuePlusEightPerGroup) {
  for (const QuantLayout& l : {QuantLayout{7, 192, 64, QuantAxis::kAlongRow},
                               QuantLayout{128, 6, 64, QuantAxis::kAlongColumn},
                               QuantLayout{3, 10, 2, QuantAxis::kAlongRow}, QuantLayout{0, 64}}) {
    SCOPED_TRACE(l.str());
    const auto n = static_cast<size_t>(l.rows * l.cols);
    const size_t groups = n / static_cast<size_t>(l.group_size);
    const std::vector<float> x = random_floats(n, 3);
    const QuantizedTensor t = quantize_4bit(x.data(), l);
    EXPECT_EQ(t.packed.size(), n / 2);
    EXPECT_EQ(t.mins.size(), 4 * groups);
    EXPECT_EQ(t.scales.size(), 4 * groups);
    EXPECT_EQ(t.bytes(), n / 2 + 8 * groups);
    EXPECT_EQ(quantized_bytes(l), t.bytes());
  }
  // The planner's figure for a 4096 x 4096 weight: 8 MiB of codes + 2 MiB of metadata.
  EXPECT_EQ(quantized_bytes(QuantLayout{4096, 4096}), size_t{8 << 20} + size_t{2 << 20});
  // Per element: half a byte, and 8 bytes of min and scale shared by 64 (or 2) values.
  EXPECT_DOUBLE_EQ(quantized_bytes_per_element(), 0.5 + 8.0 / 64);
  EXPECT_DOUBLE_EQ(quantized_bytes_per_element(2), 0.5 + 8.0 / 2);
}

TEST(QuantFormat, EvenIndexInLowNibble) {
  // Values 0..15 repeating: min 0, max 15, scale 1, so each code equals its value.
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 16);
  const QuantizedTensor t = quantize_4bit(x.data(), QuantLayout{1, 64});
  ASSERT_EQ(t.scales.as<const float>()[0], 1.0f);
  const auto* p = t.packed.as<const uint8_t>();
  for (size_t b = 0; b < 32; ++b) {
    const auto want = static_cast<uint8_t>((2 * b) % 16 | (((2 * b + 1) % 16) << 4));
    ASSERT_EQ(p[b], want) << "byte " << b;
  }
  // And decoding: byte 0x0F holds 15 for element 0 and 0 for element 1.
  QuantizedTensor h = allocate_quantized(QuantLayout{1, 64});
  h.packed.as<uint8_t>()[0] = 0x0F;
  h.mins.as<float>()[0] = -1.0f;
  h.scales.as<float>()[0] = 0.5f;
  GuardedFloats out(64);
  dequantize_4bit(h, out.data());
  EXPECT_EQ(out[0], 6.5f);
  EXPECT_EQ(out[1], -1.0f);
  EXPECT_EQ(out[2], -1.0f);
  EXPECT_TRUE(out.guards_intact());
}

::testing::AssertionResult throws_input_error_naming(const QuantLayout& l,
                                                     const std::vector<std::string>& words) {
  try {
    (void)quantized_bytes(l);
  } catch (const InputError& e) {
    const std::string msg = e.what();
    for (const auto& w : words)
      if (msg.find(w) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" does not name " << w;
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << l.str() << " accepted";
}

TEST(QuantFormat, BadGroupSizeRejectedNamingTheSizes) {
  EXPECT_TRUE(
      throws_input_error_naming({4, 100, 48, QuantAxis::kAlongRow}, {"48", "100", "columns"}));
  EXPECT_TRUE(
      throws_input_error_naming({100, 64, 64, QuantAxis::kAlongColumn}, {"64", "100", "rows"}));
  EXPECT_TRUE(throws_input_error_naming({4, 64, 0, QuantAxis::kAlongRow}, {"group size 0"}));
  EXPECT_TRUE(throws_input_error_naming({4, 63, 7, QuantAxis::kAlongRow}, {"group size 7"}));
  EXPECT_TRUE(throws_input_error_naming({4, 9, 2, QuantAxis::kAlongColumn}, {"9 columns"}));
  EXPECT_TRUE(throws_input_error_naming({-1, 64, 64, QuantAxis::kAlongRow}, {"-1"}));
  std::vector<float> x(4 * 100);
  EXPECT_THROW((void)quantize_4bit(x.data(), QuantLayout{4, 100, 48}), InputError);
  EXPECT_NO_THROW((void)quantized_bytes(QuantLayout{4, 66, 2, QuantAxis::kAlongColumn}));
}

TEST(QuantFormat, NonFiniteValuesRejectedNamingTheGroup) {
  std::vector<float> x = random_floats(4 * 128, 9);
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> y = x;
    y[static_cast<size_t>(1 * 128 + 70)] = bad;  // row 1, group 1 of the row: group 3
    try {
      (void)quantize_4bit(y.data(), QuantLayout{4, 128, 64});
      ADD_FAILURE() << bad << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("group 3 (from row 1, column 64)"), std::string::npos)
          << e.what();
    }
  }
  std::vector<float> wide(64, 0.0f);
  wide[0] = -3e38f;
  wide[1] = 3e38f;  // max - min overflows f32
  EXPECT_THROW((void)quantize_4bit(wide.data(), QuantLayout{1, 64}), InputError);
}

// ---------------------------------------------------------------------------------------
// Streaming: dequantize_rows and quantize_rows
// ---------------------------------------------------------------------------------------

class QuantRows : public ::testing::TestWithParam<QuantAxis> {};

TEST_P(QuantRows, DequantizeRowsEqualsTheSlice) {
  const QuantLayout l{128, 96, 32, GetParam()};
  const std::vector<float> x = random_floats(static_cast<size_t>(l.numel()), 5, -3.0f, 2.0f);
  const QuantizedTensor t = quantize_4bit(x.data(), l);
  std::vector<float> full(static_cast<size_t>(l.numel()));
  dequantize_4bit(t, full.data());
  for (const auto& [begin, n] :
       {std::pair<int64_t, int64_t>{0, 128}, {0, 1}, {31, 2}, {64, 33}, {127, 1}, {50, 0}}) {
    SCOPED_TRACE("rows " + std::to_string(begin) + "+" + std::to_string(n));
    GuardedFloats out(static_cast<size_t>(n * l.cols));
    dequantize_rows(t, begin, n, out.data());
    for (size_t i = 0; i < static_cast<size_t>(n * l.cols); ++i)
      ASSERT_EQ(out[i], full[static_cast<size_t>(begin * l.cols) + i]) << "element " << i;
    EXPECT_TRUE(out.guards_intact());
  }
  std::vector<float> sink(static_cast<size_t>(2 * l.cols));
  EXPECT_THROW(dequantize_rows(t, 127, 2, sink.data()), Error);
  EXPECT_THROW(dequantize_rows(t, -1, 1, sink.data()), Error);
}

TEST_P(QuantRows, QuantizeRowsOverwritesOnlyItsRows) {
  const QuantLayout l{128, 64, 32, GetParam()};
  const auto n = static_cast<size_t>(l.numel());
  const std::vector<float> a = random_floats(n, 1);
  const std::vector<float> b = random_floats(n, 2, 5.0f, 9.0f);
  // Rows [32, 96) from b, the rest from a: whole groups along either axis.
  std::vector<float> mixed = a;
  std::copy(b.begin() + 32 * 64, b.begin() + 96 * 64, mixed.begin() + 32 * 64);
  QuantizedTensor t = quantize_4bit(a.data(), l);
  quantize_rows(b.data() + 32 * 64, 32, 64, t);
  const QuantizedTensor want = quantize_4bit(mixed.data(), l);
  for (size_t i = 0; i < n / 2; ++i)
    ASSERT_EQ(t.packed.as<const uint8_t>()[i], want.packed.as<const uint8_t>()[i]) << "byte " << i;
  for (size_t g = 0; g < static_cast<size_t>(l.n_groups()); ++g) {
    ASSERT_EQ(t.mins.as<const float>()[g], want.mins.as<const float>()[g]) << "group " << g;
    ASSERT_EQ(t.scales.as<const float>()[g], want.scales.as<const float>()[g]) << "group " << g;
  }
  EXPECT_THROW(quantize_rows(b.data(), 120, 16, t), Error);  // past the end
  if (GetParam() == QuantAxis::kAlongColumn) {
    EXPECT_THROW(quantize_rows(b.data(), 16, 32, t), Error);  // half a group of rows
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, QuantRows,
                         ::testing::Values(QuantAxis::kAlongRow, QuantAxis::kAlongColumn),
                         [](const auto& tp) { return axis_label(tp.param); });

// ---------------------------------------------------------------------------------------
// linear_4bit
// ---------------------------------------------------------------------------------------

using LinearParam = std::tuple<CpuIsa, int64_t /*m*/, int64_t /*n*/, int64_t /*k*/,
                               int64_t /*group*/, bool /*bias*/>;
class Linear4bit : public ::testing::TestWithParam<LinearParam> {};

// The vector kernels (groups of 64 on AVX2 / AVX-512) multiply x split into two int8 parts,
// x ~ d * (hi + lo / 256) with d = max|x_group| / 127 (quant.h): each element within
// d / 512 = max|x_group| / 65024 of itself. An output may then differ from the exact
// product by at most sum_c |w_c| * max|x_group(c)| / 65024; the scalar path by f32
// rounding alone. Either way add f32 accumulation: 1e-5 of max(1, max |ref|).
TEST_P(Linear4bit, MatchesDoubleReferenceOverDecodedWeights) {
  const auto [isa, m, n, k, group, with_bias] = GetParam();
  if (detected_cpu_isa() < isa) GTEST_SKIP() << "the CPU has no " << cpu_isa_name(isa);
  const QuantLayout l{n, k, group};
  // Offset weights, so the min term of every group matters.
  const QuantizedTensor w =
      quantize_4bit(random_floats(static_cast<size_t>(n * k), 11, -0.5f, 1.5f).data(), l);
  GuardedFloats x(static_cast<size_t>(m * k));
  std::vector<float> xv = random_floats(static_cast<size_t>(m * k), 12);
  for (size_t c = 5; c < xv.size(); c += 97) xv[c] *= 40.0f;  // outliers widen some groups
  x.assign(xv);
  GuardedFloats bias(static_cast<size_t>(n));
  bias.assign(random_floats(static_cast<size_t>(n), 13, -2.0f, 2.0f));
  GuardedFloats y(static_cast<size_t>(m * n));
  const std::vector<float> x_before = x.vec();

  Linear4bitScratch scratch;
  linear_4bit(x.data(), m, w.view(), with_bias ? bias.data() : nullptr, y.data(), scratch, isa);

  const bool split = isa != CpuIsa::kPortable && group == 64;
  std::vector<double> wd(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) wd[static_cast<size_t>(r * k + c)] = ref_value(w, r, c);
  std::vector<double> ref(static_cast<size_t>(m * n)), bound(ref.size());
  double max_ref = 1.0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < n; ++r) {
      double s = with_bias ? static_cast<double>(bias[static_cast<size_t>(r)]) : 0.0;
      double b = 0.0;
      for (int64_t c = 0; c < k; ++c) {
        const double wc = wd[static_cast<size_t>(r * k + c)];
        s += static_cast<double>(x[static_cast<size_t>(i * k + c)]) * wc;
        double amax = 0.0;
        for (int64_t g = c / 64 * 64; split && g < c / 64 * 64 + 64; ++g)
          amax = std::max(amax, std::fabs(static_cast<double>(x[static_cast<size_t>(i * k + g)])));
        b += std::fabs(wc) * amax / 65024.0;
      }
      ref[static_cast<size_t>(i * n + r)] = s;
      bound[static_cast<size_t>(i * n + r)] = b;
      max_ref = std::max(max_ref, std::fabs(s));
    }
  for (size_t o = 0; o < ref.size(); ++o)
    ASSERT_LE(std::fabs(y[o] - ref[o]), bound[o] + kTolF32 * max_ref)
        << "output " << o << " (" << cpu_isa_name(isa) << ")";
  EXPECT_TRUE(y.guards_intact());
  EXPECT_TRUE(x.guards_intact());
  EXPECT_EQ(x.vec(), x_before) << "linear_4bit modified its input";
}

// Every instruction set the CPU has: groups of 64 take the vector kernel (AVX-512 where k
// is a multiple of 128: 384; else AVX2: 192), other groups the scalar one.
INSTANTIATE_TEST_SUITE_P(
    Cpu, Linear4bit,
    ::testing::Combine(::testing::Values(CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512),
                       ::testing::Values(int64_t{1}, int64_t{3}, int64_t{33}),
                       ::testing::Values(int64_t{5}, int64_t{301}),
                       ::testing::Values(int64_t{384}, int64_t{192}),
                       ::testing::Values(int64_t{64}, int64_t{6}), ::testing::Bool()),
    [](const auto& tp) {
      return std::string(cpu_isa_name(std::get<0>(tp.param))) + "_m" +
             std::to_string(std::get<1>(tp.param)) + "_n" + std::to_string(std::get<2>(tp.param)) +
             "_k" + std::to_string(std::get<3>(tp.param)) + "_g" +
             std::to_string(std::get<4>(tp.param)) + (std::get<5>(tp.param) ? "_bias" : "_nobias");
    });

// A non-finite activation is not hidden by the int8 split: its row's outputs are NaN, as an
// f32 product would make them (the engine's checks then see it).
TEST(Linear4bitEdges, ANonFiniteActivationPoisonsItsRowOnEveryIsa) {
  const std::vector<float> wv = random_floats(8 * 128, 4);
  const QuantizedTensor w = quantize_4bit(wv.data(), QuantLayout{8, 128});
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512})
    for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
      if (detected_cpu_isa() < isa) continue;
      std::vector<float> x = random_floats(2 * 128, 5);
      x[128 + 70] = bad;
      std::vector<float> y(16);
      Linear4bitScratch scratch;
      linear_4bit(x.data(), 2, w.view(), nullptr, y.data(), scratch, isa);
      for (int r = 0; r < 8; ++r) {
        EXPECT_TRUE(std::isfinite(y[static_cast<size_t>(r)])) << cpu_isa_name(isa);
        EXPECT_FALSE(std::isfinite(y[static_cast<size_t>(8 + r)])) << cpu_isa_name(isa);
      }
    }
}

TEST(Linear4bitEdges, ZeroRowsWriteNothingAndColumnGroupsAreRejected) {
  const std::vector<float> wv = random_floats(64 * 64, 4);
  const QuantizedTensor w = quantize_4bit(wv.data(), QuantLayout{64, 64});
  GuardedFloats y(64, 7.0f);
  linear_4bit(nullptr, 0, w, nullptr, y.data());
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(y[i], 7.0f);
  EXPECT_TRUE(y.guards_intact());
  const QuantizedTensor wc =
      quantize_4bit(wv.data(), QuantLayout{64, 64, 64, QuantAxis::kAlongColumn});
  EXPECT_THROW(linear_4bit(wv.data(), 1, wc, nullptr, y.data()), Error);
}

}  // namespace
}  // namespace strata
