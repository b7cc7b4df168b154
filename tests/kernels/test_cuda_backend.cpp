// The CUDA backend against the CPU reference backend: every op runs on the same random
// inputs on both (the CUDA side through host<->device copies), results are compared under
// a normalised error bound  max |gpu - cpu| / max(1, max |cpu|),  and every device output
// buffer sits between canary guard bytes that must survive the op. Device outputs start
// as NaN (all bits set) so an element a kernel forgets to write fails the comparison.
//
// Without a GPU every test but CudaAvailability skips with probe_accelerators()'s reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/accelerator.h"
#include "kernels/backend.h"
#include "kernels/clock.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "kernels/tunables.h"
#include "support/guarded.h"

namespace strata {

// Readable parameter names in gtest output (found by ADL for DType).
[[maybe_unused]] static void PrintTo(DType t, std::ostream* os) {
  *os << dtype_name(t);
}

namespace {

using testing::canary;
using testing::kGuardBytes;
using testing::random_floats;

const AcceleratorInfo& probe() {
  static const AcceleratorInfo info = probe_accelerators();
  return info;
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// max |got - ref| / max(1, max |ref|); infinity when got is not finite where ref is.
double norm_err(const std::vector<float>& got, const std::vector<float>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double max_ref = 0.0;
  double max_diff = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(ref[i]))
      return std::numeric_limits<double>::infinity();
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - ref[i]));
  }
  return max_diff / std::max(1.0, max_ref);
}

::testing::AssertionResult same_bits(const std::vector<float>& got,
                                     const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < want.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i]))
      return ::testing::AssertionFailure()
             << "element " << i << ": got " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

constexpr double kTolF32 = 1e-5;
// linear with f16/bf16 weights rounds x to the weight type on the GPU (cuda_backend.cpp),
// the CPU keeps x in f32: the difference is x's rounding error summed over k.
constexpr double kTolLinearF16 = 2e-3;
constexpr double kTolLinearBF16 = 1.5e-2;
// With x pre-rounded on both sides only the accumulation differs (tensor cores may
// accumulate with truncation).
constexpr double kTolLinearHalfSameInputs = 1e-4;

// n elements of T in device memory between canary guard regions.
template <typename T>
class DeviceGuarded {
 public:
  DeviceGuarded(Backend& backend, size_t n)
      : backend_(&backend),
        n_(n),
        buf_(backend, 2 * kGuardBytes + std::max<size_t>(n, 1) * sizeof(T)) {
    std::vector<uint8_t> image(buf_.size(), 0xffu);  // payload: all bits set (NaN for f32)
    for (size_t i = 0; i < kGuardBytes; ++i) {
      image[i] = canary(i);
      image[kGuardBytes + n_ * sizeof(T) + i] = canary(i + kGuardBytes);
    }
    backend.copy(buf_.data(), image.data(), image.size(), CopyKind::kHostToDevice);
  }
  DeviceGuarded(Backend& backend, const std::vector<T>& values)
      : DeviceGuarded(backend, values.size()) {
    upload(values);
  }

  T* data() const { return reinterpret_cast<T*>(static_cast<uint8_t*>(buf_.data()) + kGuardBytes); }
  size_t size() const { return n_; }

  void upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    if (n_ > 0) backend_->copy(data(), v.data(), n_ * sizeof(T), CopyKind::kHostToDevice);
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    if (n_ > 0) backend_->copy(v.data(), data(), n_ * sizeof(T), CopyKind::kDeviceToHost);
    return v;
  }
  ::testing::AssertionResult guards_intact() const {
    std::vector<uint8_t> image(buf_.size());
    backend_->copy(image.data(), buf_.data(), image.size(), CopyKind::kDeviceToHost);
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (image[i] != canary(i))
        return ::testing::AssertionFailure()
               << "device guard byte " << (kGuardBytes - i) << " before the buffer was overwritten";
      if (image[kGuardBytes + n_ * sizeof(T) + i] != canary(i + kGuardBytes))
        return ::testing::AssertionFailure()
               << "device guard byte " << i << " after the buffer (of " << n_
               << " elements) was overwritten";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  Backend* backend_;
  size_t n_;
  DeviceBuffer buf_;
};

// A weight stored as `dtype` in host memory (for the CPU backend) and on the device.
struct DualWeight {
  std::vector<uint8_t> host_bytes;
  Tensor host;
  std::unique_ptr<DeviceGuarded<uint8_t>> dev;
  Tensor device;

  DualWeight(Backend& gpu, DType dtype, int64_t rows, int64_t cols,
             const std::vector<float>& values) {
    host_bytes.resize(values.size() * dtype_size(dtype));
    convert_from_f32(dtype, values.data(), host_bytes.data(), values.size());
    host.data = host_bytes.data();
    host.dtype = dtype;
    host.shape = Shape{rows, cols};
    host.device = Device::kHost;
    dev = std::make_unique<DeviceGuarded<uint8_t>>(gpu, host_bytes);
    device = host;
    device.data = dev->data();
    device.device = Device::kCuda;
  }
};

// Every GPU test: skipped with the probe's reason when there is no device.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!probe().available()) GTEST_SKIP() << "no CUDA device: " << probe().reason;
    gpu_ = make_cuda_backend(0);
    cpu_ = std::make_unique<CpuBackend>(2);
  }
  Backend& gpu() { return *gpu_; }
  CpuBackend& cpu() { return *cpu_; }

  std::unique_ptr<Backend> gpu_;
  std::unique_ptr<CpuBackend> cpu_;
};

template <typename P>
class CudaParamTest : public CudaTest, public ::testing::WithParamInterface<P> {};

// ---------------------------------------------------------------------------------------
// Runs without a GPU too.
// ---------------------------------------------------------------------------------------

TEST(CudaAvailability, ProbeAndFactoryFailCleanlyWithoutDevice) {
  const AcceleratorInfo& info = probe();
  EXPECT_TRUE(info.cuda_built) << "test_cuda_backend is only built with CUDA";
  if (!info.available()) {
    EXPECT_FALSE(info.reason.empty());
    EXPECT_NE(info.str().find(info.reason), std::string::npos);
    try {
      auto backend = make_cuda_backend(0);
      ADD_FAILURE() << "make_cuda_backend(0) succeeded without a device";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kFailed) << e.what();
      EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
    }
    // Asking again still fails cleanly (no sticky state, no crash).
    EXPECT_THROW(make_cuda_backend(0), Error);
  } else {
    const auto count = static_cast<int>(info.devices.size());
    EXPECT_NO_THROW(make_cuda_backend(0));
    EXPECT_THROW(make_cuda_backend(count), Error);
    EXPECT_THROW(make_cuda_backend(-1), Error);
  }
}

// The named tunables as they were, put back on destruction: gpu-run.sh runs this binary once
// with the STRATA_CUDA_* switches unset and once with them set, and a test that changes them
// must leave the tests after it the run's own.
class EnvRestore {
 public:
  explicit EnvRestore(std::initializer_list<TunableId> ids) {
    for (const TunableId id : ids) saved_.emplace_back(tunable(id).variable(), tunable_text(id));
  }
  EnvRestore(const EnvRestore&) = delete;
  EnvRestore& operator=(const EnvRestore&) = delete;
  ~EnvRestore() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        setenv(name.c_str(), value->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// The benchmark switches as CudaOptions reads them: unset is the measured default, each
// documented value sets its field, and a value outside the list is an input error that
// names the variable and the values it takes.
TEST(CudaAvailability, OptionsFromTheEnvironment) {
  const auto vars = {TunableId::kCudaGemv,  TunableId::kCudaEpilogue, TunableId::kCudaPdl,
                     TunableId::kCudaNorm,  TunableId::kCudaNormRows, TunableId::kCudaAttention,
                     TunableId::kCudaDecode};
  const EnvRestore restore(vars);
  for (const TunableId v : vars) unsetenv(tunable(v).variable().c_str());
  using Pdl = CudaOptions::Pdl;
  using Attention = CudaOptions::Attention;
  const auto fields = [](const CudaOptions& o) {
    return std::tuple(o.fused_gemv, o.fuse_epilogues, o.pdl, o.fuse_norms, o.norm_warp_rows,
                      o.attention, o.fuse_decode_attention);
  };
  EXPECT_EQ(fields(CudaOptions::from_env()),
            std::tuple(true, true, Pdl::kOn, false, 1, Attention::kWarps, false));
  setenv("STRATA_CUDA_GEMV", "off", 1);
  setenv("STRATA_CUDA_EPILOGUE", "off", 1);
  setenv("STRATA_CUDA_PDL", "all", 1);
  setenv("STRATA_CUDA_NORM", "fused", 1);
  setenv("STRATA_CUDA_NORM_ROWS", "4", 1);
  setenv("STRATA_CUDA_ATTENTION", "tiled", 1);
  setenv("STRATA_CUDA_DECODE", "fused", 1);
  EXPECT_EQ(fields(CudaOptions::from_env()),
            std::tuple(false, false, Pdl::kAll, true, 4, Attention::kTiled, true));
  setenv("STRATA_CUDA_PDL", "early", 1);
  setenv("STRATA_CUDA_NORM_ROWS", "2", 1);
  setenv("STRATA_CUDA_ATTENTION", "simple", 1);
  EXPECT_EQ(CudaOptions::from_env().pdl, Pdl::kEarly);
  EXPECT_EQ(CudaOptions::from_env().norm_warp_rows, 2);
  EXPECT_EQ(CudaOptions::from_env().attention, Attention::kSimple);
  setenv("STRATA_CUDA_NORM_ROWS", "3", 1);
  try {
    (void)CudaOptions::from_env();
    ADD_FAILURE() << "STRATA_CUDA_NORM_ROWS=3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("STRATA_CUDA_NORM_ROWS='3'"), std::string::npos)
        << e.what();
  }
  unsetenv("STRATA_CUDA_NORM_ROWS");

  setenv("STRATA_CUDA_DECODE", "yes", 1);
  try {
    (void)CudaOptions::from_env();
    ADD_FAILURE() << "STRATA_CUDA_DECODE=yes was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    const std::string what = e.what();
    EXPECT_NE(what.find("STRATA_CUDA_DECODE='yes'"), std::string::npos) << what;
    EXPECT_NE(what.find("apart or fused"), std::string::npos) << what;
  }
}

// Rows a warp takes under a folded norm other than 1, 2 or 4 is refused before any device
// is touched (so this runs on every machine), naming the field and the value.
TEST(CudaAvailability, NormWarpRowsOutsideOneTwoFourIsAnInputError) {
  for (const int rows : {0, 3, 8}) {
    CudaOptions options;
    options.fuse_norms = true;
    options.norm_warp_rows = rows;
    try {
      (void)make_cuda_backend(0, options);
      ADD_FAILURE() << "norm_warp_rows " << rows << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
      EXPECT_NE(std::string(e.what()).find("norm_warp_rows " + std::to_string(rows)),
                std::string::npos)
          << e.what();
    }
  }
}

// ---------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------

TEST_F(CudaTest, AllocateCopySynchronize) {
  EXPECT_EQ(gpu().device(), Device::kCuda);
  EXPECT_FALSE(gpu().name().empty());
  DeviceBuffer a(gpu(), 4000), b(gpu(), 4000);
  std::vector<float> back(1000, 1.0f);
  gpu().copy(back.data(), a.data(), 4000, CopyKind::kDeviceToHost);
  for (float v : back) ASSERT_EQ(v, 0.0f) << "allocate() memory is zeroed";
  const std::vector<float> src = random_floats(1000, 1);
  gpu().copy(a.data(), src.data(), 4000, CopyKind::kHostToDevice);
  gpu().copy(b.data(), a.data(), 4000, CopyKind::kDeviceToDevice);
  gpu().synchronize();
  gpu().copy(back.data(), b.data(), 4000, CopyKind::kDeviceToHost);
  EXPECT_EQ(back, src);
  DeviceGuarded<float> g(gpu(), src);
  EXPECT_EQ(g.download(), src);
  EXPECT_TRUE(g.guards_intact());
}

// ---------------------------------------------------------------------------------------
// linear
// ---------------------------------------------------------------------------------------

using LinearParam = std::tuple<DType, int64_t /*m*/, int64_t /*n*/, int64_t /*k*/, bool /*bias*/>;
using CudaLinearTest = CudaParamTest<LinearParam>;

TEST_P(CudaLinearTest, MatchesCpu) {
  const auto [dtype, m, n, k, with_bias] = GetParam();
  DualWeight w(gpu(), dtype, n, k, random_floats(static_cast<size_t>(n * k), 11));
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 12);
  const std::vector<float> bias = random_floats(static_cast<size_t>(n), 13, -2.0f, 2.0f);
  DeviceGuarded<float> dx(gpu(), x), dbias(gpu(), bias), dy(gpu(), static_cast<size_t>(m * n));

  std::vector<float> want(static_cast<size_t>(m * n));
  cpu().linear(x.data(), m, w.host, with_bias ? bias.data() : nullptr, want.data());
  gpu().linear(dx.data(), m, w.device, with_bias ? dbias.data() : nullptr, dy.data());
  const std::vector<float> got = dy.download();

  // Decode rows of half weights go through the fused GEMV, which keeps x in f32: then only
  // the accumulation order differs from the CPU.
  const bool fused = dtype != DType::kF32 && m <= cuda_kernels::kMaxGemvRowsHalf && k % 8 == 0;
  const double tol = dtype == DType::kF32 || fused ? (fused ? kTolLinearHalfSameInputs : kTolF32)
                     : dtype == DType::kF16        ? kTolLinearF16
                                                   : kTolLinearBF16;
  EXPECT_LT(norm_err(got, want), tol);
  EXPECT_TRUE(dy.guards_intact());
  EXPECT_EQ(dx.download(), x) << "linear modified its input";
  EXPECT_TRUE(w.dev->guards_intact());

  if (dtype != DType::kF32 && !fused) {
    // Same inputs on both sides (x rounded to the weight type first): only the
    // accumulation order may differ.
    std::vector<uint8_t> packed(x.size() * 2);
    convert_from_f32(dtype, x.data(), packed.data(), x.size());
    std::vector<float> xr(x.size());
    convert_to_f32(dtype, packed.data(), xr.data(), x.size());
    cpu().linear(xr.data(), m, w.host, with_bias ? bias.data() : nullptr, want.data());
    gpu().linear(dx.data(), m, w.device, with_bias ? dbias.data() : nullptr, dy.data());
    EXPECT_LT(norm_err(dy.download(), want), kTolLinearHalfSameInputs);
  }
}

std::string linear_name(const ::testing::TestParamInfo<LinearParam>& tp) {
  return std::string(dtype_name(std::get<0>(tp.param))) + "_m" +
         std::to_string(std::get<1>(tp.param)) + "_n" + std::to_string(std::get<2>(tp.param)) +
         "_k" + std::to_string(std::get<3>(tp.param)) +
         (std::get<4>(tp.param) ? "_bias" : "_nobias");
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaLinearTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                       ::testing::Values(int64_t{1}, int64_t{3}, int64_t{16}),
                       ::testing::Values(int64_t{37}, int64_t{300}),
                       ::testing::Values(int64_t{1}, int64_t{53}, int64_t{129}), ::testing::Bool()),
    linear_name);

// Model-sized shapes: cuBLAS picks other kernels (split-K, other tiles) at k = 4096.
INSTANTIATE_TEST_SUITE_P(
    CudaLarge, CudaLinearTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                       ::testing::Values(int64_t{1}, int64_t{17}, int64_t{64}),
                       ::testing::Values(int64_t{520}), ::testing::Values(int64_t{4096}),
                       ::testing::Values(true)),
    linear_name);

// The fused GEMV (m <= kMaxGemvRowsHalf, k % 8 == 0) and the rows past it, n odd, a k that is
// not a multiple of the 256 weights a warp reads per step.
INSTANTIATE_TEST_SUITE_P(CudaGemv, CudaLinearTest,
                         ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16),
                                            ::testing::Values(int64_t{1}, int64_t{2}, int64_t{4},
                                                              int64_t{7}, int64_t{8}, int64_t{9}),
                                            ::testing::Values(int64_t{37}, int64_t{300}),
                                            ::testing::Values(int64_t{136}, int64_t{1024},
                                                              int64_t{1352}),
                                            ::testing::Values(true)),
                         linear_name);

// 4-bit weights (groups of 64 along rows) against the CPU backend's 4-bit linear, which
// dequantises in registers in f32: the fused GEMV (m <= kMaxGemvRowsQ4) differs only in the
// order of accumulation; more rows are dequantised to f16 and multiplied with x in f16.
using Q4LinearParam = std::tuple<int64_t /*m*/, int64_t /*n*/, int64_t /*k*/>;
using CudaQ4LinearTest = CudaParamTest<Q4LinearParam>;

TEST_P(CudaQ4LinearTest, MatchesCpu) {
  const auto [m, n, k] = GetParam();
  const std::vector<float> wf = random_floats(static_cast<size_t>(n * k), 21);
  const QuantizedTensor qt =
      quantize_4bit(wf.data(), {n, k, kQuantGroupSize, QuantAxis::kAlongRow});
  Tensor host;
  host.dtype = DType::kQ4;
  host.shape = Shape{n, k};
  host.device = Device::kHost;
  std::vector<uint8_t> blob(host.bytes());
  write_q4_blob(qt, blob.data());
  host.data = blob.data();
  DeviceGuarded<uint8_t> dblob(gpu(), blob);
  Tensor dev = host;
  dev.data = dblob.data();
  dev.device = Device::kCuda;
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 22);
  const std::vector<float> bias = random_floats(static_cast<size_t>(n), 23);
  DeviceGuarded<float> dx(gpu(), x), dbias(gpu(), bias), dy(gpu(), static_cast<size_t>(m * n));
  std::vector<float> want(static_cast<size_t>(m * n));
  cpu().linear(x.data(), m, host, bias.data(), want.data());
  gpu().linear(dx.data(), m, dev, dbias.data(), dy.data());
  const double tol = m <= cuda_kernels::kMaxGemvRowsQ4 ? kTolLinearHalfSameInputs : kTolLinearF16;
  EXPECT_LT(norm_err(dy.download(), want), tol);
  EXPECT_TRUE(dy.guards_intact());
  EXPECT_TRUE(dblob.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaQ4LinearTest,
                         ::testing::Combine(::testing::Values(int64_t{1}, int64_t{2}, int64_t{3},
                                                              int64_t{8}, int64_t{9}),
                                            ::testing::Values(int64_t{37}, int64_t{520}),
                                            ::testing::Values(int64_t{128}, int64_t{2368},
                                                              int64_t{4096})),
                         [](const auto& tp) {
                           return "m" + std::to_string(std::get<0>(tp.param)) + "_n" +
                                  std::to_string(std::get<1>(tp.param)) + "_k" +
                                  std::to_string(std::get<2>(tp.param));
                         });

// linear_then: the fused GEMV's store does the ReLU or the residual add. Compared with the
// CPU backend's linear followed by its relu / add; shapes cover n not a multiple of the
// block's rows and k with and without a tail past the loads a lane keeps in flight.
using ThenParam = std::tuple<DType, int64_t /*m*/, int64_t /*n*/, int64_t /*k*/, LinearThen>;
using CudaLinearThenTest = CudaParamTest<ThenParam>;

// A kQ4 weight (groups of 64 along rows) or a half one, on both backends.
struct AnyWeight {
  std::vector<uint8_t> blob;
  Tensor host;
  std::unique_ptr<DeviceGuarded<uint8_t>> dev;
  Tensor device;
  AnyWeight(Backend& gpu, DType dtype, int64_t n, int64_t k, const std::vector<float>& values) {
    host.dtype = dtype;
    host.shape = Shape{n, k};
    host.device = Device::kHost;
    blob.resize(host.bytes());
    if (dtype == DType::kQ4) {
      write_q4_blob(quantize_4bit(values.data(), {n, k, kQuantGroupSize, QuantAxis::kAlongRow}),
                    blob.data());
    } else {
      convert_from_f32(dtype, values.data(), blob.data(), values.size());
    }
    host.data = blob.data();
    dev = std::make_unique<DeviceGuarded<uint8_t>>(gpu, blob);
    device = host;
    device.data = dev->data();
    device.device = Device::kCuda;
  }
};

TEST_P(CudaLinearThenTest, MatchesLinearThenOp) {
  const auto [dtype, m, n, k, then] = GetParam();
  AnyWeight w(gpu(), dtype, n, k, random_floats(static_cast<size_t>(n * k), 31));
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 32);
  const std::vector<float> bias = random_floats(static_cast<size_t>(n), 33, -1.0f, 1.0f);
  const std::vector<float> y0 = random_floats(static_cast<size_t>(m * n), 34, -3.0f, 3.0f);
  DeviceGuarded<float> dx(gpu(), x), dbias(gpu(), bias), dy(gpu(), y0);

  std::vector<float> want(static_cast<size_t>(m * n));
  cpu().linear(x.data(), m, w.host, bias.data(), want.data());
  if (then == LinearThen::kRelu) {
    cpu().relu(want.data(), m * n);
  } else {
    std::vector<float> sum = y0;
    cpu().add(sum.data(), want.data(), m * n);
    want = sum;
  }
  ASSERT_TRUE(gpu().linear_then(dx.data(), m, w.device, dbias.data(), then, dy.data()));
  const std::vector<float> got = dy.download();
  EXPECT_LT(norm_err(got, want), kTolLinearHalfSameInputs);
  if (then == LinearThen::kRelu) {
    const auto zeros = std::count(got.begin(), got.end(), 0.0f);
    EXPECT_GT(zeros, 0) << "no output was clipped: the ReLU did not run";
  }
  EXPECT_TRUE(dy.guards_intact());
  EXPECT_TRUE(w.dev->guards_intact());
}

std::string then_name(const ::testing::TestParamInfo<ThenParam>& tp) {
  return std::string(dtype_name(std::get<0>(tp.param))) + "_m" +
         std::to_string(std::get<1>(tp.param)) + "_n" + std::to_string(std::get<2>(tp.param)) +
         "_k" + std::to_string(std::get<3>(tp.param)) +
         (std::get<4>(tp.param) == LinearThen::kRelu ? "_relu" : "_accumulate");
}

INSTANTIATE_TEST_SUITE_P(
    CudaHalf, CudaLinearThenTest,
    ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16), ::testing::Values(int64_t{1}),
                       ::testing::Values(int64_t{37}, int64_t{300}),
                       ::testing::Values(int64_t{136}, int64_t{1024}, int64_t{1352}),
                       ::testing::Values(LinearThen::kRelu, LinearThen::kAccumulate)),
    then_name);
INSTANTIATE_TEST_SUITE_P(
    CudaQ4, CudaLinearThenTest,
    ::testing::Combine(::testing::Values(DType::kQ4), ::testing::Values(int64_t{1}, int64_t{3}),
                       ::testing::Values(int64_t{37}, int64_t{300}),
                       ::testing::Values(int64_t{128}, int64_t{2368}, int64_t{4096}),
                       ::testing::Values(LinearThen::kRelu, LinearThen::kAccumulate)),
    then_name);

// Where no fused kernel fits, linear_then declines and leaves y as it was: f32 weights, half
// weights over more rows than the GEMV takes, and every call on the CPU backend.
TEST_F(CudaTest, LinearThenDeclinesWhatItCannotFuse) {
  const std::vector<float> wf = random_floats(64 * 64, 35);
  const std::vector<float> x = random_floats(4 * 64, 36);
  const std::vector<float> y0 = random_floats(4 * 64, 37);
  AnyWeight f32(gpu(), DType::kF32, 64, 64, wf);
  AnyWeight f16(gpu(), DType::kF16, 64, 64, wf);
  DeviceGuarded<float> dx(gpu(), x), dy(gpu(), y0);
  EXPECT_FALSE(gpu().linear_then(dx.data(), 1, f32.device, nullptr, LinearThen::kRelu, dy.data()));
  EXPECT_FALSE(
      gpu().linear_then(dx.data(), 2, f16.device, nullptr, LinearThen::kAccumulate, dy.data()));
  EXPECT_EQ(dy.download(), y0);
  std::vector<float> hy = y0;
  EXPECT_FALSE(
      cpu().linear_then(x.data(), 1, f16.host, nullptr, LinearThen::kAccumulate, hy.data()));
  EXPECT_EQ(hy, y0);
}

// ---------------------------------------------------------------------------------------
// embedding
// ---------------------------------------------------------------------------------------

using CudaEmbeddingTest = CudaParamTest<DType>;

TEST_P(CudaEmbeddingTest, MatchesCpuExactly) {
  constexpr int64_t vocab = 50;
  for (const int64_t h : {int64_t{1}, int64_t{37}, int64_t{300}}) {
    SCOPED_TRACE("h=" + std::to_string(h));
    DualWeight table(gpu(), GetParam(), vocab, h,
                     random_floats(static_cast<size_t>(vocab * h), 21, -4.0f, 4.0f));
    const std::vector<int32_t> ids = {0, 49, 7, 7, 13, 0, 48, 25, 1};
    const auto n = static_cast<int64_t>(ids.size());
    DeviceGuarded<int32_t> dids(gpu(), ids);
    DeviceGuarded<float> dy(gpu(), static_cast<size_t>(n * h));
    std::vector<float> want(static_cast<size_t>(n * h));
    cpu().embedding(ids.data(), n, table.host, want.data());
    gpu().embedding(dids.data(), n, table.device, dy.data());
    EXPECT_TRUE(same_bits(dy.download(), want));
    EXPECT_TRUE(dy.guards_intact());
  }
}

TEST_P(CudaEmbeddingTest, IdOutsideVocabularyGivesZeroRow) {
  DualWeight table(gpu(), GetParam(), 10, 8, random_floats(80, 22));
  const std::vector<int32_t> ids = {3, -1, 10};
  DeviceGuarded<int32_t> dids(gpu(), ids);
  DeviceGuarded<float> dy(gpu(), 24);
  gpu().embedding(dids.data(), 3, table.device, dy.data());
  const std::vector<float> got = dy.download();
  for (size_t i = 8; i < 24; ++i) EXPECT_EQ(got[i], 0.0f) << i;
  std::vector<float> row3(8);
  cpu().embedding(&ids[0], 1, table.host, row3.data());
  EXPECT_TRUE(same_bits(std::vector<float>(got.begin(), got.begin() + 8), row3));
  EXPECT_TRUE(dy.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaEmbeddingTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& tp) { return std::string(dtype_name(tp.param)); });

// ---------------------------------------------------------------------------------------
// rms_norm, layer_norm
// ---------------------------------------------------------------------------------------

using NormParam = std::tuple<int64_t /*m*/, int64_t /*h*/>;
using CudaNormTest = CudaParamTest<NormParam>;

TEST_P(CudaNormTest, RmsNorm) {
  const auto [m, h] = GetParam();
  const std::vector<float> x = random_floats(static_cast<size_t>(m * h), 31, -3.0f, 3.0f);
  const std::vector<float> w = random_floats(static_cast<size_t>(h), 32, 0.5f, 1.5f);
  DeviceGuarded<float> dx(gpu(), x), dw(gpu(), w), dy(gpu(), x.size());
  std::vector<float> want(x.size());
  cpu().rms_norm(x.data(), m, h, w.data(), 1e-5f, want.data());
  gpu().rms_norm(dx.data(), m, h, dw.data(), 1e-5f, dy.data());
  EXPECT_LT(norm_err(dy.download(), want), kTolF32);
  EXPECT_TRUE(dy.guards_intact());
  gpu().rms_norm(dx.data(), m, h, dw.data(), 1e-5f, dx.data());  // in place
  EXPECT_LT(norm_err(dx.download(), want), kTolF32);
}

TEST_P(CudaNormTest, LayerNorm) {
  const auto [m, h] = GetParam();
  const std::vector<float> x = random_floats(static_cast<size_t>(m * h), 41, 2.0f, 6.0f);
  const std::vector<float> w = random_floats(static_cast<size_t>(h), 42, 0.5f, 1.5f);
  const std::vector<float> b = random_floats(static_cast<size_t>(h), 43, -1.0f, 1.0f);
  DeviceGuarded<float> dx(gpu(), x), dw(gpu(), w), db(gpu(), b), dy(gpu(), x.size());
  std::vector<float> want(x.size());
  cpu().layer_norm(x.data(), m, h, w.data(), b.data(), 1e-5f, want.data());
  gpu().layer_norm(dx.data(), m, h, dw.data(), db.data(), 1e-5f, dy.data());
  EXPECT_LT(norm_err(dy.download(), want), 4 * kTolF32);
  EXPECT_TRUE(dy.guards_intact());
  gpu().layer_norm(dx.data(), m, h, dw.data(), db.data(), 1e-5f, dx.data());  // in place
  EXPECT_LT(norm_err(dx.download(), want), 4 * kTolF32);
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaNormTest,
                         // Rows held in registers (h % 4 == 0, up to 8192) with 1, 2, 4 and
                         // 8 float4s a thread, part-filled; and the looping kernels past them.
                         ::testing::Values(NormParam{1, 1}, NormParam{1, 64}, NormParam{4, 67},
                                           NormParam{33, 1024}, NormParam{2, 5000},
                                           NormParam{1, 12}, NormParam{5, 2048}, NormParam{1, 4096},
                                           NormParam{3, 8192}, NormParam{2, 8196}),
                         [](const auto& tp) {
                           return "m" + std::to_string(std::get<0>(tp.param)) + "_h" +
                                  std::to_string(std::get<1>(tp.param));
                         });

// ---------------------------------------------------------------------------------------
// rope
// ---------------------------------------------------------------------------------------

TEST_F(CudaTest, RopeMatchesCpu) {
  constexpr int32_t n_heads = 3, max_pos = 64;
  constexpr double theta = 10000.0;
  for (const int32_t head_dim : {16, 128}) {
    SCOPED_TRACE("head_dim=" + std::to_string(head_dim));
    const int32_t half = head_dim / 2;
    std::vector<float> cos_t(static_cast<size_t>(max_pos * half)), sin_t(cos_t.size());
    for (int32_t p = 0; p < max_pos; ++p)
      for (int32_t j = 0; j < half; ++j) {
        const double a = p * std::pow(theta, -2.0 * j / head_dim);
        cos_t[static_cast<size_t>(p * half + j)] = static_cast<float>(std::cos(a));
        sin_t[static_cast<size_t>(p * half + j)] = static_cast<float>(std::sin(a));
      }
    const std::vector<int32_t> positions = {0, 1, 5, 63, 17, 5};
    const auto m = static_cast<int64_t>(positions.size());
    std::vector<float> x =
        random_floats(static_cast<size_t>(m * n_heads * head_dim), 51, -2.0f, 2.0f);
    DeviceGuarded<float> dx(gpu(), x), dcos(gpu(), cos_t), dsin(gpu(), sin_t);
    DeviceGuarded<int32_t> dpos(gpu(), positions);
    cpu().rope(x.data(), m, n_heads, head_dim, positions.data(),
               RopeTables{cos_t.data(), sin_t.data(), max_pos, half});
    gpu().rope(dx.data(), m, n_heads, head_dim, dpos.data(),
               RopeTables{dcos.data(), dsin.data(), max_pos, half});
    EXPECT_LT(norm_err(dx.download(), x), kTolF32);
    EXPECT_TRUE(dx.guards_intact());
  }
}

// cuda_backend.h: a position outside the table leaves its row unrotated (no host check).
TEST_F(CudaTest, RopePositionOutsideTableLeavesRow) {
  constexpr int32_t n_heads = 2, head_dim = 8, half = 4, max_pos = 4;
  std::vector<float> cos_t(max_pos * half, 0.0f), sin_t(max_pos * half, 1.0f);
  const std::vector<int32_t> positions = {-1, max_pos, 2};
  const auto m = static_cast<int64_t>(positions.size());
  const std::vector<float> x = random_floats(static_cast<size_t>(m * n_heads * head_dim), 52);
  DeviceGuarded<float> dx(gpu(), x), dcos(gpu(), cos_t), dsin(gpu(), sin_t);
  DeviceGuarded<int32_t> dpos(gpu(), positions);
  gpu().rope(dx.data(), m, n_heads, head_dim, dpos.data(),
             RopeTables{dcos.data(), dsin.data(), max_pos, half});
  const std::vector<float> got = dx.download();
  const size_t w = n_heads * head_dim;
  EXPECT_TRUE(same_bits(std::vector<float>(got.begin(), got.begin() + 2 * w),
                        std::vector<float>(x.begin(), x.begin() + 2 * w)));
  // Row 2 with cos 0, sin 1: (a, b) -> (-b, a).
  for (int32_t h = 0; h < n_heads; ++h)
    for (int32_t j = 0; j < half; ++j) {
      const size_t e = 2 * w + static_cast<size_t>(h * head_dim + j);
      EXPECT_EQ(got[e], -x[e + half]);
      EXPECT_EQ(got[e + half], x[e]);
    }
  EXPECT_TRUE(dx.guards_intact());
}

// ---------------------------------------------------------------------------------------
// elementwise, softmax
// ---------------------------------------------------------------------------------------

using CudaElementwiseTest = CudaParamTest<int64_t>;

TEST_P(CudaElementwiseTest, SiluMul) {
  const auto n = static_cast<size_t>(GetParam());
  std::vector<float> gate = random_floats(n, 61, -8.0f, 8.0f);
  const std::vector<float> up = random_floats(n, 62, -2.0f, 2.0f);
  if (n >= 3) {
    gate[0] = -100.0f;
    gate[1] = 100.0f;
    gate[2] = 0.0f;
  }
  DeviceGuarded<float> dg(gpu(), gate), du(gpu(), up), dout(gpu(), n);
  std::vector<float> want(n);
  cpu().silu_mul(gate.data(), up.data(), want.data(), GetParam());
  gpu().silu_mul(dg.data(), du.data(), dout.data(), GetParam());
  EXPECT_LT(norm_err(dout.download(), want), kTolF32);
  EXPECT_TRUE(dout.guards_intact());
  EXPECT_EQ(dg.download(), gate);
}

TEST_P(CudaElementwiseTest, Relu) {
  const auto n = static_cast<size_t>(GetParam());
  std::vector<float> x = random_floats(n, 71);
  if (n >= 3) {
    x[0] = -0.0f;
    x[1] = 1e-30f;
    x[2] = -1e-30f;
  }
  DeviceGuarded<float> dx(gpu(), x);
  cpu().relu(x.data(), GetParam());
  gpu().relu(dx.data(), GetParam());
  const std::vector<float> got = dx.download();
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], x[i]) << i;
  EXPECT_TRUE(dx.guards_intact());
}

TEST_P(CudaElementwiseTest, Add) {
  const auto n = static_cast<size_t>(GetParam());
  std::vector<float> y = random_floats(n, 81, -10.0f, 10.0f);
  const std::vector<float> x = random_floats(n, 82, -10.0f, 10.0f);
  DeviceGuarded<float> dy(gpu(), y), dx(gpu(), x);
  cpu().add(y.data(), x.data(), GetParam());
  gpu().add(dy.data(), dx.data(), GetParam());
  EXPECT_TRUE(same_bits(dy.download(), y));  // one correctly rounded add on both sides
  EXPECT_TRUE(dy.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaElementwiseTest,
                         ::testing::Values(int64_t{1}, int64_t{1000}, int64_t{(1 << 15) + 7},
                                           int64_t{3000001}),
                         [](const auto& tp) { return "n" + std::to_string(tp.param); });

// More elements than one sweep of the largest grid (2^20 blocks x 256 threads = 2^28), so
// the grid-stride loops go round twice. Exact arithmetic on a cheap pattern; 1 GiB per
// buffer, skipped on devices with less than 8 GiB.
TEST_F(CudaTest, ElementwiseBeyondOneGridSweep) {
  if (probe().devices.empty() || probe().devices[0].memory_bytes < (size_t{8} << 30))
    GTEST_SKIP() << "needs 8 GiB of device memory";
  const size_t n = (size_t{1} << 28) + 4099;
  std::vector<float> y(n), x(n);
  for (size_t i = 0; i < n; ++i) {
    y[i] = static_cast<float>(i % 1000) - 500.0f;
    x[i] = static_cast<float>(i % 7) - 3.0f;
  }
  DeviceGuarded<float> dy(gpu(), y), dx(gpu(), x);
  gpu().add(dy.data(), dx.data(), static_cast<int64_t>(n));
  gpu().relu(dy.data(), static_cast<int64_t>(n));
  const std::vector<float> got = dy.download();
  for (size_t i = 0; i < n; ++i) {
    const float want = std::max(0.0f, y[i] + x[i]);
    ASSERT_EQ(got[i], want) << "element " << i << " of " << n;
  }
  EXPECT_TRUE(dy.guards_intact());
}

// Masked logits (-inf) get probability 0; the rest sums to 1, as on the CPU.
TEST_F(CudaTest, SoftmaxWithMaskedEntries) {
  constexpr int64_t m = 3, n = 77;
  std::vector<float> x = random_floats(static_cast<size_t>(m * n), 92, -5.0f, 5.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = r; i < n; i += 3) x[static_cast<size_t>(r * n + i)] = -INFINITY;
  DeviceGuarded<float> dx(gpu(), x);
  cpu().softmax(x.data(), m, n);
  gpu().softmax(dx.data(), m, n);
  const std::vector<float> got = dx.download();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = r; i < n; i += 3) EXPECT_EQ(got[static_cast<size_t>(r * n + i)], 0.0f);
  EXPECT_LT(norm_err(got, x), kTolF32);
  EXPECT_TRUE(dx.guards_intact());
}

using SoftmaxParam = std::tuple<int64_t /*m*/, int64_t /*n*/>;
using CudaSoftmaxTest = CudaParamTest<SoftmaxParam>;

TEST_P(CudaSoftmaxTest, MatchesCpu) {
  const auto [m, n] = GetParam();
  std::vector<float> x = random_floats(static_cast<size_t>(m * n), 91, -10.0f, 10.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < n; ++i)
      x[static_cast<size_t>(r * n + i)] += (r % 3 == 0 ? 500.0f : r % 3 == 1 ? -500.0f : 0.0f);
  DeviceGuarded<float> dx(gpu(), x);
  cpu().softmax(x.data(), m, n);
  gpu().softmax(dx.data(), m, n);
  EXPECT_LT(norm_err(dx.download(), x), kTolF32);
  EXPECT_TRUE(dx.guards_intact());
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaSoftmaxTest,
                         ::testing::Values(SoftmaxParam{1, 1}, SoftmaxParam{3, 17},
                                           SoftmaxParam{5, 1000}, SoftmaxParam{40, 1024},
                                           SoftmaxParam{2, 32000}),
                         [](const auto& tp) {
                           return "m" + std::to_string(std::get<0>(tp.param)) + "_n" +
                                  std::to_string(std::get<1>(tp.param));
                         });

// linears: q, k and v (or gate and up) as one GEMV launch. Each part against the CPU
// backend's linear of its own weight: parts of different row counts (a block never spans
// two, so 37 and 5 leave partial blocks at both joins), with and without a bias; a middle
// part of 8200 rows puts the third part's first block past 2048.
using LinearsParam = std::tuple<DType, int64_t /*m*/, int /*parts*/, int64_t /*middle rows*/>;
using CudaLinearsTest = CudaParamTest<LinearsParam>;

TEST_P(CudaLinearsTest, EveryPartMatchesItsLinear) {
  const auto [dtype, m, count, middle] = GetParam();
  constexpr int64_t k = 320;
  const int64_t rows[] = {37, middle, 5};
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 41);
  DeviceGuarded<float> dx(gpu(), x);
  std::vector<std::unique_ptr<AnyWeight>> w;
  std::vector<std::vector<float>> bias, want;
  std::vector<std::unique_ptr<DeviceGuarded<float>>> dbias, dy;
  std::vector<LinearOut> outs;
  for (int p = 0; p < count; ++p) {
    const int64_t n = rows[p];
    w.push_back(std::make_unique<AnyWeight>(gpu(), dtype, n, k,
                                            random_floats(static_cast<size_t>(n * k), 42 + p)));
    bias.push_back(p == 1 ? std::vector<float>{} : random_floats(static_cast<size_t>(n), 50 + p));
    want.emplace_back(static_cast<size_t>(m * n));
    cpu().linear(x.data(), m, w.back()->host, bias.back().empty() ? nullptr : bias.back().data(),
                 want.back().data());
    dbias.push_back(
        bias.back().empty() ? nullptr : std::make_unique<DeviceGuarded<float>>(gpu(), bias.back()));
    dy.push_back(std::make_unique<DeviceGuarded<float>>(
        gpu(), std::vector<float>(static_cast<size_t>(m * n), 12345.0f)));
    outs.push_back(
        {&w.back()->device, dbias.back() ? dbias.back()->data() : nullptr, dy.back()->data()});
  }
  ASSERT_TRUE(gpu().linears(dx.data(), m, outs, LinearsFold{}));
  for (int p = 0; p < count; ++p) {
    SCOPED_TRACE("part " + std::to_string(p));
    EXPECT_LT(norm_err(dy[static_cast<size_t>(p)]->download(), want[static_cast<size_t>(p)]),
              kTolLinearHalfSameInputs);
    EXPECT_TRUE(dy[static_cast<size_t>(p)]->guards_intact());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaLinearsTest,
    ::testing::Values(LinearsParam{DType::kF16, 1, 3, 300}, LinearsParam{DType::kBF16, 1, 3, 300},
                      LinearsParam{DType::kF16, 1, 3, 8200}, LinearsParam{DType::kBF16, 1, 2, 8200},
                      LinearsParam{DType::kF16, 1, 2, 300}, LinearsParam{DType::kF16, 1, 1, 300},
                      LinearsParam{DType::kQ4, 1, 3, 300}, LinearsParam{DType::kQ4, 3, 3, 300},
                      LinearsParam{DType::kQ4, 8, 2, 8200}),
    [](const auto& tp) {
      return std::string(dtype_name(std::get<0>(tp.param))) + "_m" +
             std::to_string(std::get<1>(tp.param)) + "_parts" +
             std::to_string(std::get<2>(tp.param)) + "_rows" +
             std::to_string(std::get<3>(tp.param));
    });

// A set the fused GEMV cannot take in one launch declines and writes nothing: mixed weight
// types, different in-features, four parts, half weights over two rows, and the CPU backend.
TEST_F(CudaTest, LinearsDeclineWhatOneLaunchCannotTake) {
  const std::vector<float> x = random_floats(2 * 128, 43);
  const std::vector<float> y0 = random_floats(64, 44);
  AnyWeight f16(gpu(), DType::kF16, 64, 64, random_floats(64 * 64, 45));
  AnyWeight bf16(gpu(), DType::kBF16, 64, 64, random_floats(64 * 64, 46));
  AnyWeight wide(gpu(), DType::kF16, 64, 128, random_floats(64 * 128, 47));
  DeviceGuarded<float> dx(gpu(), x), dy(gpu(), y0);
  const LinearOut a{&f16.device, nullptr, dy.data()};
  const LinearOut mixed[] = {a, {&bf16.device, nullptr, dy.data()}};
  const LinearOut widths[] = {a, {&wide.device, nullptr, dy.data()}};
  const LinearOut four[] = {a, a, a, a};
  const LinearOut one[] = {a};
  EXPECT_FALSE(gpu().linears(dx.data(), 1, mixed, LinearsFold{}));
  EXPECT_FALSE(gpu().linears(dx.data(), 1, widths, LinearsFold{}));
  EXPECT_FALSE(gpu().linears(dx.data(), 1, four, LinearsFold{}));
  EXPECT_FALSE(gpu().linears(dx.data(), 2, one, LinearsFold{}));
  EXPECT_EQ(dy.download(), y0);
  std::vector<float> hy = y0;
  const LinearOut host_one[] = {{&f16.host, nullptr, hy.data()}};
  EXPECT_FALSE(cpu().linears(x.data(), 1, host_one, LinearsFold{}));
  EXPECT_EQ(hy, y0);
}

// linears with the pre-norm layer's norm folded in (STRATA_CUDA_NORM=fused): each part
// against the CPU backend's layer or RMS norm, then its linear (and ReLU). x is offset from
// zero so a norm that skipped the mean would show; widths from 320 to the kernel's 8192.
using NormLinearsParam = std::tuple<DType, bool /*layer*/, int64_t /*k*/, int /*parts*/,
                                    bool /*relu*/, int /*warp rows*/>;
using CudaNormLinearsTest = CudaParamTest<NormLinearsParam>;

// A CUDA backend with the run's switches (STRATA_CUDA_*) but the norm folded or not, and
// where given, the weight rows a warp of such a GEMV takes.
std::unique_ptr<Backend> backend_folding_norms(bool fold = true, int warp_rows = 0) {
  CudaOptions options = CudaOptions::from_env();
  options.fuse_norms = fold;
  if (warp_rows > 0) options.norm_warp_rows = warp_rows;
  return make_cuda_backend(0, options);
}

TEST_P(CudaNormLinearsTest, EveryPartMatchesNormThenLinear) {
  const auto [dtype, layer, k, count, relu, warp_rows] = GetParam();
  gpu_ = backend_folding_norms(true, warp_rows);
  const int64_t rows[] = {37, 300, 5};
  const std::vector<float> x = random_floats(static_cast<size_t>(k), 61, 0.5f, 2.5f);
  const std::vector<float> nw = random_floats(static_cast<size_t>(k), 62, 0.5f, 1.5f);
  const std::vector<float> nb = random_floats(static_cast<size_t>(k), 63, -0.5f, 0.5f);
  constexpr float kEps = 1e-5f;
  std::vector<float> normed(static_cast<size_t>(k));
  if (layer) {
    cpu().layer_norm(x.data(), 1, k, nw.data(), nb.data(), kEps, normed.data());
  } else {
    cpu().rms_norm(x.data(), 1, k, nw.data(), kEps, normed.data());
  }
  DeviceGuarded<float> dx(gpu(), x), dnw(gpu(), nw), dnb(gpu(), nb);
  std::vector<std::unique_ptr<AnyWeight>> w;
  std::vector<std::vector<float>> want;
  std::vector<std::unique_ptr<DeviceGuarded<float>>> dy;
  std::vector<LinearOut> outs;
  for (int p = 0; p < count; ++p) {
    const int64_t n = rows[p];
    w.push_back(std::make_unique<AnyWeight>(gpu(), dtype, n, k,
                                            random_floats(static_cast<size_t>(n * k), 64 + p)));
    want.emplace_back(static_cast<size_t>(n));
    cpu().linear(normed.data(), 1, w.back()->host, nullptr, want.back().data());
    if (relu) cpu().relu(want.back().data(), n);
    dy.push_back(std::make_unique<DeviceGuarded<float>>(
        gpu(), std::vector<float>(static_cast<size_t>(n), 12345.0f)));
    outs.push_back({&w.back()->device, nullptr, dy.back()->data()});
  }
  const NormSpec norm{layer, dnw.data(), layer ? dnb.data() : nullptr, kEps};
  ASSERT_TRUE(gpu().linears(dx.data(), 1, outs, LinearsFold{&norm, relu}));
  for (int p = 0; p < count; ++p) {
    SCOPED_TRACE("part " + std::to_string(p));
    EXPECT_LT(norm_err(dy[static_cast<size_t>(p)]->download(), want[static_cast<size_t>(p)]),
              kTolLinearHalfSameInputs);
    EXPECT_TRUE(dy[static_cast<size_t>(p)]->guards_intact());
  }
  EXPECT_EQ(dx.download(), x) << "the norm wrote x";
}

INSTANTIATE_TEST_SUITE_P(
    Cuda, CudaNormLinearsTest,
    ::testing::Combine(::testing::Values(DType::kF16, DType::kBF16, DType::kQ4), ::testing::Bool(),
                       ::testing::Values(int64_t{320}, int64_t{4096}, int64_t{8192}),
                       ::testing::Values(1, 3), ::testing::Bool(), ::testing::Values(1, 2, 4)),
    [](const auto& tp) {
      return std::string(dtype_name(std::get<0>(tp.param))) +
             (std::get<1>(tp.param) ? "_layer" : "_rms") + "_k" +
             std::to_string(std::get<2>(tp.param)) + "_parts" +
             std::to_string(std::get<3>(tp.param)) + (std::get<4>(tp.param) ? "_relu" : "") +
             "_rows" + std::to_string(std::get<5>(tp.param));
    });

// The norm folds in only where the kernel takes it: one row, at most 8192 wide, and only with
// STRATA_CUDA_NORM=fused; declined sets write nothing.
TEST_F(CudaTest, NormLinearsDeclineWhatTheKernelCannotTake) {
  const std::vector<float> x = random_floats(2 * 8256, 65);
  const std::vector<float> nw = random_floats(8256, 66, 0.5f, 1.5f);
  const std::vector<float> y0 = random_floats(64, 67);
  AnyWeight narrow(gpu(), DType::kF16, 32, 64, random_floats(32 * 64, 68));
  AnyWeight wide(gpu(), DType::kQ4, 32, 8256, random_floats(32 * 8256, 69));
  DeviceGuarded<float> dx(gpu(), x), dnw(gpu(), nw), dy(gpu(), y0);
  const NormSpec rms{false, dnw.data(), nullptr, 1e-5f};
  const LinearOut on_narrow[] = {{&narrow.device, nullptr, dy.data()}};
  const LinearOut on_wide[] = {{&wide.device, nullptr, dy.data()}};
  // Backends beside the fixture's, which owns the buffers above and must outlive them.
  EXPECT_FALSE(
      backend_folding_norms(false)->linears(dx.data(), 1, on_narrow, LinearsFold{&rms, false}));
  const std::unique_ptr<Backend> folding = backend_folding_norms();
  EXPECT_FALSE(folding->linears(dx.data(), 2, on_narrow, LinearsFold{&rms, false}));  // m 1
  EXPECT_FALSE(folding->linears(dx.data(), 1, on_wide, LinearsFold{&rms, false}));    // 8256 wide
  EXPECT_FALSE(folding->linears(dx.data(), 2, on_wide, LinearsFold{&rms, false}));
  EXPECT_EQ(dy.download(), y0);
  EXPECT_TRUE(folding->linears(dx.data(), 1, on_narrow, LinearsFold{&rms, false}));
}

// ---------------------------------------------------------------------------------------
// kv_store + attention over a ragged batch
// ---------------------------------------------------------------------------------------

struct AttnCase {
  std::string name;
  int32_t n_heads, n_kv_heads, head_dim, n_slots, capacity;
  std::vector<SeqSlice> seqs;
  int32_t rows;  // activation rows; row 4 of the small batch belongs to no sequence
};

[[maybe_unused]] void PrintTo(const AttnCase& c, std::ostream* os) {
  *os << c.name;
}

std::vector<SeqSlice> small_batch() {
  return {SeqSlice{0, 3, 0, 2}, SeqSlice{3, 1, 7, 0}, SeqSlice{5, 4, 5, 3}, SeqSlice{9, 0, 3, 1}};
}

std::vector<AttnCase> attn_cases() {
  return {
      {"gqa_4q_2kv", 4, 2, 8, 4, 16, small_batch(), 9},
      {"mha_4q_4kv", 4, 4, 8, 4, 16, small_batch(), 9},
      {"mqa_4q_1kv", 4, 1, 8, 4, 16, small_batch(), 9},
      {"gqa_hd64",
       4,
       2,
       64,
       3,
       64,
       {SeqSlice{0, 20, 0, 1}, SeqSlice{20, 1, 40, 0}, SeqSlice{21, 7, 30, 2}},
       28},
      // Context longer than one 128-key tile of the kernel, head_dim over 128 and odd.
      {"gqa_long_hd160", 8, 2, 160, 2, 400, {SeqSlice{0, 2, 300, 1}, SeqSlice{2, 130, 0, 0}}, 132},
      // Llama-sized heads: decode rows at 2048 context (16 key tiles), a prefill chunk on
      // top of history, a first token; tile edges at 127/128/129 keys.
      {"llama_32q_8kv_hd128",
       32,
       8,
       128,
       6,
       2112,
       {SeqSlice{0, 1, 2047, 0}, SeqSlice{1, 1, 127, 1}, SeqSlice{2, 1, 128, 2},
        SeqSlice{3, 40, 1000, 3}, SeqSlice{43, 1, 0, 4}, SeqSlice{44, 2, 126, 5}},
       46},
      // The largest head_dim the kernel takes, and an odd one.
      {"mha_hd512", 2, 2, 512, 2, 300, {SeqSlice{0, 3, 200, 1}, SeqSlice{3, 1, 0, 0}}, 4},
      {"gqa_hd33", 6, 3, 33, 2, 300, {SeqSlice{0, 5, 250, 0}, SeqSlice{5, 1, 17, 1}}, 6},
      // head_dim 12 over 7 rows: a 4-bit cache's mins start past 2 bytes of padding.
      {"hd12_odd_rows", 2, 1, 12, 1, 7, {SeqSlice{0, 2, 4, 0}}, 2},
      // Decode rows the tiled kernel splits over the context (flash-decoding) once the
      // backend has split scratch: one long row; rows of very different lengths, some shorter
      // than a split; 32 query heads on one kv head (two blocks per group); head_dim 512.
      {"decode_batch1_ctx3000", 32, 8, 128, 1, 3008, {SeqSlice{0, 1, 2999, 0}}, 1},
      {"decode_mixed_ctx_mqa_32q",
       32,
       1,
       64,
       4,
       2100,
       {SeqSlice{0, 1, 0, 0}, SeqSlice{1, 1, 32, 1}, SeqSlice{2, 1, 700, 2},
        SeqSlice{3, 1, 2047, 3}},
       4},
      {"decode_hd512", 4, 2, 512, 2, 1200, {SeqSlice{0, 1, 1100, 0}, SeqSlice{1, 1, 5, 1}}, 2},
      // The warps-over-keys decode kernel (head_dim 64 and 128, groups 1, 2, 4 and 8): OPT-6.7B
      // at 528 positions (17 splits of one tile); rows whose contexts end inside a chunk, a
      // warp's keys, a split, or before some splits begin (empty splits and idle warps); two
      // new rows of one sequence; a row that belongs to no sequence between them.
      {"decode_warps_mha_hd128_ctx528", 32, 32, 128, 1, 544, {SeqSlice{0, 1, 527, 0}}, 1},
      {"decode_warps_gqa2_hd64_mixed",
       8,
       4,
       64,
       4,
       700,
       {SeqSlice{0, 1, 0, 0}, SeqSlice{1, 1, 30, 1}, SeqSlice{3, 1, 33, 2}, SeqSlice{4, 1, 650, 3}},
       5},
      {"decode_warps_gqa8_hd128_two_new",
       16,
       2,
       128,
       2,
       300,
       {SeqSlice{0, 2, 100, 1}, SeqSlice{2, 2, 5, 0}},
       4},
      {"decode_warps_gqa4_hd64_one_kv", 4, 1, 64, 2, 200, {SeqSlice{0, 1, 77, 1}}, 1},
      // Groups of 8, one new row a sequence: a first token (its own key the only one), a
      // context ending on a tile's last key, and a long one split many ways (17 splits on an H200
      // with the scratch reserve_split_scratch gives), so the short rows' later splits are empty.
      {"decode_warps_gqa8_hd128_one_new",
       16,
       2,
       128,
       3,
       1100,
       {SeqSlice{0, 1, 1030, 2}, SeqSlice{1, 1, 0, 0}, SeqSlice{2, 1, 63, 1}},
       3},
      // Prefill rows whose tiles of query rows span three sequences' slots.
      {"prefill_tiles_span_slots",
       4,
       2,
       64,
       3,
       128,
       {SeqSlice{0, 5, 0, 1}, SeqSlice{5, 3, 10, 0}, SeqSlice{8, 20, 0, 2}},
       28},
  };
}

constexpr float kUntouched = 12345.0f;

using CudaAttentionTest = CudaParamTest<AttnCase>;

// A case's inputs: caches whose unwritten positions are NaN (reading one poisons the
// output) around random histories, the step's new k and v rows, and q.
struct AttnInputs {
  std::vector<float> kc, vc, k_new, v_new, q;
  KvLayerView view(void* k, void* v, const AttnCase& c, DType dtype = DType::kF32) const {
    return KvLayerView{k, v, c.n_slots, c.capacity, c.n_kv_heads, c.head_dim, dtype};
  }
};

// A cache's elements as stored in a cache of `dtype`: f32 as they are, or f16 rounded to
// nearest even (NaN stays NaN), as kernels/dtype.h's f32_to_f16 rounds.
std::vector<uint8_t> cache_bytes(const std::vector<float>& elems, DType dtype) {
  std::vector<uint8_t> out(elems.size() * dtype_size(dtype));
  for (size_t i = 0; i < elems.size(); ++i) {
    if (dtype == DType::kF16) {
      const uint16_t h = f32_to_f16(elems[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &elems[i], 4);
    }
  }
  return out;
}

// Both element types of an uncompressed cache: f32, and f16 (policy cf16).
constexpr DType kCacheTypes[] = {DType::kF32, DType::kF16};

AttnInputs attn_inputs(const AttnCase& c) {
  AttnInputs in;
  const size_t cache_elems =
      static_cast<size_t>(c.n_slots) * c.n_kv_heads * c.capacity * c.head_dim;
  auto idx = [&](int32_t slot, int32_t h, int32_t p, int32_t d) {
    return ((static_cast<size_t>(slot) * c.n_kv_heads + h) * c.capacity + p) * c.head_dim + d;
  };
  in.kc.assign(cache_elems, std::numeric_limits<float>::quiet_NaN());
  in.vc = in.kc;
  std::mt19937 rng(101);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (const SeqSlice& s : c.seqs)
    for (int32_t h = 0; h < c.n_kv_heads; ++h)
      for (int32_t p = 0; p < s.n_past; ++p)
        for (int32_t d = 0; d < c.head_dim; ++d) {
          in.kc[idx(s.slot, h, p, d)] = dist(rng);
          in.vc[idx(s.slot, h, p, d)] = dist(rng);
        }
  const size_t kv_width = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  const size_t q_width = static_cast<size_t>(c.n_heads) * c.head_dim;
  in.k_new = random_floats(static_cast<size_t>(c.rows) * kv_width, 102);
  in.v_new = random_floats(static_cast<size_t>(c.rows) * kv_width, 103);
  in.q = random_floats(static_cast<size_t>(c.rows) * q_width, 104, -3.0f, 3.0f);
  return in;
}

AttentionDims attn_dims(const AttnCase& c) {
  return {c.n_heads, c.n_kv_heads, c.head_dim,
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)))};
}

// Rows of some sequence within kTolF32 of `want`; every other row still the sentinel.
void expect_attention_rows(const AttnCase& c, const std::vector<float>& got,
                           const std::vector<float>& want) {
  const size_t q_width = static_cast<size_t>(c.n_heads) * c.head_dim;
  std::vector<bool> used(static_cast<size_t>(c.rows), false);
  for (const SeqSlice& s : c.seqs)
    for (int32_t t = 0; t < s.n_new; ++t) used[static_cast<size_t>(s.row_begin + t)] = true;
  // The sentinel rows are kept out of the comparison so they do not inflate the
  // normalisation.
  std::vector<float> got_used, want_used;
  for (int32_t r = 0; r < c.rows; ++r)
    for (size_t i = 0; i < q_width; ++i) {
      const size_t e = static_cast<size_t>(r) * q_width + i;
      if (used[static_cast<size_t>(r)]) {
        got_used.push_back(got[e]);
        want_used.push_back(want[e]);
      } else {
        ASSERT_EQ(bits_of(got[e]), bits_of(kUntouched)) << "row " << r << " belongs to no sequence";
      }
    }
  EXPECT_LT(norm_err(got_used, want_used), kTolF32);
}

// Split decode attention borrows linear's x scratch for its partial results: without it a
// context is never split, with it long ones are.
void reserve_split_scratch(Backend& b) {
  KernelBounds bounds;
  bounds.max_rows = 64;
  bounds.max_in_features = 4096;
  bounds.half_weights = true;
  b.reserve(bounds);
}

// Runs `attend` on a backend of each attention kernel (STRATA_CUDA_ATTENTION: warps over keys
// where a decode kernel has the shape, tiled, one block per (row, head)), twice: without split
// scratch (one split), then with it (long contexts split, the splits joined).
template <class Attend>
void on_each_attention_kernel(const Attend& attend) {
  for (const auto kind : {CudaOptions::Attention::kWarps, CudaOptions::Attention::kTiled,
                          CudaOptions::Attention::kSimple}) {
    SCOPED_TRACE("attention kernel " + std::to_string(static_cast<int>(kind)));
    CudaOptions options = CudaOptions::from_env();  // the run's PDL
    options.attention = kind;
    const std::unique_ptr<Backend> b = make_cuda_backend(0, options);
    for (int round = 0; round < 2; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      if (round == 1) reserve_split_scratch(*b);
      attend(*b);
    }
  }
}

// kv_store and attention over an f32 and an f16 cache: the device's cache bytes equal the
// CPU's (f16 rounded to nearest even by both), and the attention of each of its kernels the
// CPU's over them.
TEST_P(CudaAttentionTest, KvStoreThenAttentionMatchCpu) {
  const AttnCase& c = GetParam();
  const AttnInputs in = attn_inputs(c);
  DeviceGuarded<float> dk(gpu(), in.k_new), dv(gpu(), in.v_new), dq(gpu(), in.q);
  const AttentionDims dims = attn_dims(c);
  for (const DType dtype : kCacheTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<uint8_t> kc = cache_bytes(in.kc, dtype), vc = cache_bytes(in.vc, dtype);
    DeviceGuarded<uint8_t> dkc(gpu(), kc), dvc(gpu(), vc);
    const KvLayerView host_view = in.view(kc.data(), vc.data(), c, dtype);
    const KvLayerView dev_view = in.view(dkc.data(), dvc.data(), c, dtype);

    cpu().kv_store(in.k_new.data(), in.v_new.data(), c.seqs, host_view);
    gpu().kv_store(dk.data(), dv.data(), c.seqs, dev_view);
    EXPECT_TRUE(dkc.download() == kc) << "K cache";
    EXPECT_TRUE(dvc.download() == vc) << "V cache";
    EXPECT_TRUE(dkc.guards_intact());
    EXPECT_TRUE(dvc.guards_intact());

    std::vector<float> want(in.q.size(), kUntouched);
    cpu().attention(in.q.data(), c.seqs, host_view, dims, want.data());
    on_each_attention_kernel([&](Backend& b) {
      DeviceGuarded<float> dout(b, std::vector<float>(in.q.size(), kUntouched));
      b.attention(dq.data(), c.seqs, dev_view, dims, dout.data());
      expect_attention_rows(c, dout.download(), want);
      EXPECT_TRUE(dout.guards_intact());
    });
    EXPECT_TRUE(dkc.download() == kc) << "attention modified the cache";
  }
}

// The decode step's kv_store, attention and split combine as one kernel
// (CudaOptions::fuse_decode_attention): it stores the new rows, attends to them from the
// step's rows (rounded as the cache stores them), and the last split to finish joins the
// others. Taken exactly where every sequence has one new row and the warps-over-keys kernel
// has the shape (head_dim 64 or 128, a group of 1, 2, 4 or 8): then the cache equals the
// CPU's kv_store bit for bit and the output the CPU's attention. Anywhere else the call
// declines and writes nothing. Three rounds: no split scratch (one split); splits joined in
// the kernel; again on the same counters, which the joins before must have left at zero.
// For an f32 and an f16 cache.
TEST_P(CudaAttentionTest, StoreAndAttendAsOneKernelMatchCpu) {
  const AttnCase& c = GetParam();
  CudaOptions options = CudaOptions::from_env();  // the run's PDL
  options.attention = CudaOptions::Attention::kWarps;
  options.fuse_decode_attention = true;
  const AttnInputs in = attn_inputs(c);
  const AttentionDims dims = attn_dims(c);
  bool one_new = true;
  for (const SeqSlice& s : c.seqs) one_new = one_new && s.n_new == 1;
  const int32_t group = c.n_heads / c.n_kv_heads;
  const bool has_kernel = (c.head_dim == 64 || c.head_dim == 128) &&
                          (group == 1 || group == 2 || group == 4 || group == 8);
  DeviceGuarded<float> dk(gpu(), in.k_new), dv(gpu(), in.v_new), dq(gpu(), in.q);
  for (const DType dtype : kCacheTypes) {
    SCOPED_TRACE(dtype_name(dtype));
    // A backend for each cache, so that round 0 runs without split scratch for both.
    const std::unique_ptr<Backend> fused = make_cuda_backend(0, options);
    const std::vector<uint8_t> kc0 = cache_bytes(in.kc, dtype), vc0 = cache_bytes(in.vc, dtype);
    std::vector<uint8_t> kc = kc0, vc = vc0;
    const KvLayerView host_view = in.view(kc.data(), vc.data(), c, dtype);
    cpu().kv_store(in.k_new.data(), in.v_new.data(), c.seqs, host_view);
    std::vector<float> want(in.q.size(), kUntouched);
    cpu().attention(in.q.data(), c.seqs, host_view, dims, want.data());
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      if (round == 1) reserve_split_scratch(*fused);
      DeviceGuarded<uint8_t> dkc(*fused, kc0), dvc(*fused, vc0);
      DeviceGuarded<float> dout(*fused, std::vector<float>(in.q.size(), kUntouched));
      const bool took =
          fused->store_and_attend(dq.data(), dk.data(), dv.data(), c.seqs,
                                  in.view(dkc.data(), dvc.data(), c, dtype), dims, dout.data());
      ASSERT_EQ(took, one_new && has_kernel);
      if (took) {
        EXPECT_TRUE(dkc.download() == kc) << "K cache";
        EXPECT_TRUE(dvc.download() == vc) << "V cache";
        expect_attention_rows(c, dout.download(), want);
      } else {
        EXPECT_TRUE(dkc.download() == kc0) << "a declined call wrote the K cache";
        EXPECT_TRUE(dvc.download() == vc0) << "a declined call wrote the V cache";
        for (float v : dout.download()) ASSERT_EQ(bits_of(v), bits_of(kUntouched));
      }
      EXPECT_TRUE(dkc.guards_intact());
      EXPECT_TRUE(dvc.guards_intact());
      EXPECT_TRUE(dout.guards_intact());
    }
  }
}

// A 4-bit cache read as stored (attention_q4, policy cc=1). The CPU stores each sequence's
// history (a prefill of its n_past rows) and then the step's rows; the device attends over a
// copy of those bytes and must give the CPU's attention_q4 output, itself checked against a
// double-precision reference in test_cpu_backend. Rows of one to eight groups (head_dim 160
// takes four of 40, 512 eight of 64), so a min and scale taken from the wrong group or row
// shows; positions past a sequence's context hold zeros. Through each kernel that reads it:
// warps over keys (decode rows of head_dim 64 or 128), tiled, one block per (row, head).
TEST_P(CudaAttentionTest, FourBitCacheReadAsStoredMatchesCpu) {
  const AttnCase& c = GetParam();
  if (c.head_dim % 2 != 0) GTEST_SKIP() << "a 4-bit cache needs an even head_dim";
  const AttnInputs in = attn_inputs(c);
  const size_t kv_width = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
  std::vector<SeqSlice> history;
  std::vector<float> hk, hv;
  for (const SeqSlice& s : c.seqs) {
    history.push_back({static_cast<int32_t>(hk.size() / kv_width), s.n_past, 0, s.slot});
    for (int32_t p = 0; p < s.n_past; ++p)
      for (int32_t h = 0; h < c.n_kv_heads; ++h) {
        const size_t at =
            ((static_cast<size_t>(s.slot) * c.n_kv_heads + h) * c.capacity + p) * c.head_dim;
        hk.insert(hk.end(), in.kc.begin() + at, in.kc.begin() + at + c.head_dim);
        hv.insert(hv.end(), in.vc.begin() + at, in.vc.begin() + at + c.head_dim);
      }
  }
  const AttentionDims dims = attn_dims(c);
  DeviceGuarded<float> dq(gpu(), in.q);
  // The engine's groups; groups of 8 where they divide head_dim (two lanes a group for
  // head_dim 128 in the warps-over-keys kernel, two quads of a tile in the tiled one, so a
  // lane's or a quad's group index must be right); and groups of 2, which neither reads at
  // head_dim 128 (the simple kernel then takes every row) but warps over keys do at 64.
  std::vector<int32_t> groups = {KvQ4LayerView::group_for(c.head_dim)};
  for (const int32_t g : {8, 2})
    if (c.head_dim % g == 0 && groups[0] != g) groups.push_back(g);
  for (const int32_t group : groups) {
    SCOPED_TRACE("group " + std::to_string(group));
    KvQ4LayerView view{nullptr, nullptr, c.n_slots, c.capacity, c.n_kv_heads, c.head_dim, group};
    std::vector<uint8_t> kb(view.tensor_bytes(), 0), vb(kb.size(), 0);
    view.k = kb.data();
    view.v = vb.data();
    cpu().kv_store_q4(hk.data(), hv.data(), history, view);
    cpu().kv_store_q4(in.k_new.data(), in.v_new.data(), c.seqs, view);
    std::vector<float> want(in.q.size(), kUntouched);
    cpu().attention_q4(in.q.data(), c.seqs, view, dims, want.data());

    DeviceGuarded<uint8_t> dkb(gpu(), kb), dvb(gpu(), vb);
    KvQ4LayerView dev = view;
    dev.k = dkb.data();
    dev.v = dvb.data();
    on_each_attention_kernel([&](Backend& b) {
      DeviceGuarded<float> dout(b, std::vector<float>(in.q.size(), kUntouched));
      b.attention_q4(dq.data(), c.seqs, dev, dims, dout.data());
      expect_attention_rows(c, dout.download(), want);
      EXPECT_TRUE(dout.guards_intact());
    });
    EXPECT_TRUE(dkb.download() == kb) << "attention modified the K cache";
    EXPECT_TRUE(dvb.download() == vb) << "attention modified the V cache";
    EXPECT_TRUE(dkb.guards_intact());
    EXPECT_TRUE(dvb.guards_intact());
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaAttentionTest, ::testing::ValuesIn(attn_cases()),
                         [](const auto& tp) { return tp.param.name; });

TEST_F(CudaTest, KvStoreRejectsBadSlotAndOverflow) {
  DeviceGuarded<float> kc(gpu(), 2 * 4 * 2), vc(gpu(), 2 * 4 * 2), k(gpu(), 2), v(gpu(), 2);
  const KvLayerView view{kc.data(), vc.data(), 2, 4, 1, 2};
  const std::vector<SeqSlice> bad_slot = {SeqSlice{0, 1, 0, 2}};
  EXPECT_THROW(gpu().kv_store(k.data(), v.data(), bad_slot, view), Error);
  const std::vector<SeqSlice> overflow = {SeqSlice{0, 1, 4, 0}};
  EXPECT_THROW(gpu().kv_store(k.data(), v.data(), overflow, view), Error);
  // The backend is still usable afterwards.
  const std::vector<SeqSlice> ok = {SeqSlice{0, 1, 3, 1}};
  EXPECT_NO_THROW(gpu().kv_store(k.data(), v.data(), ok, view));
  EXPECT_NO_THROW(gpu().synchronize());
}

// ---------------------------------------------------------------------------------------
// Throughput of linear (not a correctness test; disabled by default). Run with
//   test_cuda_backend --gtest_also_run_disabled_tests --gtest_filter='*DISABLED_Linear*'
// Prints one JSON object per (dtype, m) on stdout. Each call reads a different copy of the
// weight, the copies together several times the GPU's L2, so decode (m = 1) is timed at
// device-memory bandwidth rather than from cache.
// ---------------------------------------------------------------------------------------

TEST_F(CudaTest, DISABLED_LinearThroughput) {
  constexpr int64_t n = 4096, k = 4096;
  constexpr int kCopies = 8;  // 8 x 32 MiB (f16) > 4 x the H100's 50 MB L2
  constexpr int kIters = 200;
  const std::vector<float> wf = random_floats(static_cast<size_t>(n * k), 201, -0.05f, 0.05f);
  for (const DType dtype : {DType::kF16, DType::kBF16, DType::kF32, DType::kQ4}) {
    Tensor shape_only;
    shape_only.dtype = dtype;
    shape_only.shape = Shape{n, k};
    const size_t wbytes = shape_only.bytes();
    std::vector<uint8_t> packed(wbytes);
    if (dtype == DType::kQ4) {
      write_q4_blob(quantize_4bit(wf.data(), {n, k, kQuantGroupSize, QuantAxis::kAlongRow}),
                    packed.data());
    } else {
      convert_from_f32(dtype, wf.data(), packed.data(), wf.size());
    }
    std::vector<DeviceBuffer> copies;
    std::vector<Tensor> ws;
    for (int c = 0; c < kCopies; ++c) {
      copies.emplace_back(gpu(), wbytes);
      gpu().copy(copies.back().data(), packed.data(), wbytes, CopyKind::kHostToDevice);
      Tensor t;
      t.data = copies.back().data();
      t.dtype = dtype;
      t.shape = Shape{n, k};
      t.device = Device::kCuda;
      ws.push_back(t);
    }
    for (const int64_t m :
         {int64_t{1}, int64_t{4}, int64_t{8}, int64_t{16}, int64_t{64}, int64_t{512}}) {
      const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 202);
      DeviceBuffer dx(gpu(), x.size() * 4), dy(gpu(), static_cast<size_t>(m * n) * 4);
      gpu().copy(dx.data(), x.data(), x.size() * 4, CopyKind::kHostToDevice);
      for (int i = 0; i < 2 * kCopies; ++i)  // warm-up: cuBLAS heuristics, scratch growth
        gpu().linear(dx.f32(), m, ws[static_cast<size_t>(i % kCopies)], nullptr, dy.f32());
      gpu().synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kIters; ++i)
        gpu().linear(dx.f32(), m, ws[static_cast<size_t>(i % kCopies)], nullptr, dy.f32());
      gpu().synchronize();
      const double sec = seconds_since(t0) / kIters;
      const double bytes = static_cast<double>(wbytes) + static_cast<double>(m * k + m * n) * 4.0;
      const double flops = 2.0 * static_cast<double>(m) * n * k;
      std::printf(
          "{\"bench\": \"cuda_linear\", \"device\": \"%s\", \"dtype\": \"%s\", \"m\": %lld, "
          "\"n\": %lld, \"k\": %lld, \"us_per_call\": %.2f, \"gb_per_s\": %.1f, "
          "\"tflop_per_s\": %.2f}\n",
          gpu().name().c_str(), std::string(dtype_name(dtype)).c_str(), static_cast<long long>(m),
          static_cast<long long>(n), static_cast<long long>(k), sec * 1e6, bytes / sec / 1e9,
          flops / sec / 1e12);
      std::fflush(stdout);
    }
  }
}

// Copies of one weight in device memory, at least `at_least` and together past 256 MiB
// (several times the L2), so a benchmark that rotates over them reads device memory.
struct WeightCopies {
  std::vector<std::unique_ptr<DeviceGuarded<uint8_t>>> buffers;
  std::vector<Tensor> tensors;
  WeightCopies(Backend& gpu, const AnyWeight& first, size_t at_least) : tensors{first.device} {
    while (tensors.size() * first.blob.size() < (size_t{256} << 20) || tensors.size() < at_least) {
      buffers.push_back(std::make_unique<DeviceGuarded<uint8_t>>(gpu, first.blob));
      tensors.push_back(first.device);
      tensors.back().data = buffers.back()->data();
    }
  }
};

// One decode row (m = 1) through the weight shapes of a 7B-class decode step: OPT-6.7B's
// q/k/v/o [4096, 4096], fc1 [16384, 4096], fc2 [4096, 16384] and its LM head [50272, 4096],
// f16 and 4-bit, stored and with the residual add folded in (linear_then). JSON lines on
// stdout; run once per STRATA_CUDA_GEMV setting to compare kernels. The copies of each
// weight together pass 256 MiB, several times the L2, so every call reads device memory.
TEST_F(CudaTest, DISABLED_DecodeLinearShapesThroughput) {
  struct WShape {
    int64_t n, k;
  };
  for (const DType dtype : {DType::kF16, DType::kQ4}) {
    for (const WShape sh :
         {WShape{4096, 4096}, WShape{16384, 4096}, WShape{4096, 16384}, WShape{50272, 4096}}) {
      const std::vector<float> wf =
          random_floats(static_cast<size_t>(sh.n * sh.k), 203, -0.05f, 0.05f);
      const AnyWeight first(gpu(), dtype, sh.n, sh.k, wf);
      const size_t wbytes = first.blob.size();
      const WeightCopies copies(gpu(), first, 2);
      const std::vector<Tensor>& ws = copies.tensors;
      const std::vector<float> x = random_floats(static_cast<size_t>(sh.k), 204);
      DeviceBuffer dx(gpu(), x.size() * 4), dy(gpu(), static_cast<size_t>(sh.n) * 4);
      gpu().copy(dx.data(), x.data(), x.size() * 4, CopyKind::kHostToDevice);
      for (const bool accumulate : {false, true}) {
        const auto call = [&](int i) {
          const Tensor& w = ws[static_cast<size_t>(i) % ws.size()];
          if (!accumulate ||
              !gpu().linear_then(dx.f32(), 1, w, nullptr, LinearThen::kAccumulate, dy.f32()))
            gpu().linear(dx.f32(), 1, w, nullptr, dy.f32());
        };
        constexpr int kIters = 100;
        for (int i = 0; i < 2 * static_cast<int>(ws.size()); ++i) call(i);
        gpu().synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kIters; ++i) call(i);
        gpu().synchronize();
        const double sec = seconds_since(t0) / kIters;
        const double bytes = static_cast<double>(wbytes) +
                             static_cast<double>(sh.k + (accumulate ? 2 : 1) * sh.n) * 4.0;
        std::printf(
            "{\"bench\": \"cuda_decode_linear\", \"dtype\": \"%s\", \"n\": %lld, \"k\": %lld, "
            "\"accumulate\": %s, \"us_per_call\": %.2f, \"gb_per_s\": %.1f}\n",
            std::string(dtype_name(dtype)).c_str(), static_cast<long long>(sh.n),
            static_cast<long long>(sh.k), accumulate ? "true" : "false", sec * 1e6,
            bytes / sec / 1e9);
        std::fflush(stdout);
      }
    }
  }
}

// A pre-norm layer's layer norm and the GEMVs that read it, at one decode row, in OPT-6.7B's
// shapes: q/k/v (three [4096, 4096] in one launch) and fc1 ([16384, 4096] with its ReLU),
// f16 and 4-bit. "apart" is the norm kernel and then the linears' launch; "folded_rowsR" is
// one launch with the norm in its prologue, each warp taking R weight rows
// (STRATA_CUDA_NORM_ROWS), so a block's prologue serves 4R rows. JSON lines on stdout; the
// copies of each set of weights pass 256 MiB, so every call reads device memory.
TEST_F(CudaTest, DISABLED_NormLinearsThroughput) {
  constexpr int64_t k = 4096;
  constexpr int kIters = 100;
  struct Set {
    const char* name;
    int64_t n;
    int parts;
    bool relu;
  };
  const std::vector<float> x = random_floats(static_cast<size_t>(k), 211, 0.5f, 2.5f);
  DeviceGuarded<float> dx(gpu(), x), normed(gpu(), static_cast<size_t>(k));
  DeviceGuarded<float> dnw(gpu(), random_floats(static_cast<size_t>(k), 212, 0.5f, 1.5f));
  DeviceGuarded<float> dnb(gpu(), random_floats(static_cast<size_t>(k), 213, -0.5f, 0.5f));
  const NormSpec norm{true, dnw.data(), dnb.data(), 1e-5f};
  // Backends beside the fixture's, which owns the buffers and outlives them.
  std::vector<std::pair<std::string, std::unique_ptr<Backend>>> ways;
  ways.emplace_back("apart", backend_folding_norms(false));
  for (const int rows : {1, 2, 4})
    ways.emplace_back("folded_rows" + std::to_string(rows), backend_folding_norms(true, rows));
  for (const DType dtype : {DType::kF16, DType::kQ4}) {
    for (const Set set : {Set{"qkv", 4096, 3, false}, Set{"fc1", 16384, 1, true}}) {
      const AnyWeight first(gpu(), dtype, set.n, k,
                            random_floats(static_cast<size_t>(set.n * k), 214, -0.05f, 0.05f));
      const size_t wbytes = first.blob.size();
      const WeightCopies copies(gpu(), first, 2 * static_cast<size_t>(set.parts));
      const std::vector<Tensor>& ws = copies.tensors;
      DeviceGuarded<float> dy(gpu(), static_cast<size_t>(set.n * set.parts));
      gpu().synchronize();
      for (const auto& [way, backend] : ways) {
        const bool folded = way != "apart";
        const auto call = [&, &b = *backend](int i) {
          std::vector<LinearOut> outs;
          for (int p = 0; p < set.parts; ++p)
            outs.push_back({&ws[static_cast<size_t>(i * set.parts + p) % ws.size()], nullptr,
                            dy.data() + p * set.n});
          if (!folded)
            b.layer_norm(dx.data(), 1, k, dnw.data(), dnb.data(), norm.eps, normed.data());
          const bool taken = b.linears(folded ? dx.data() : normed.data(), 1, outs,
                                       LinearsFold{folded ? &norm : nullptr, set.relu});
          ASSERT_TRUE(taken) << way << " " << set.name << " declined";
        };
        for (int i = 0; i < 2 * static_cast<int>(ws.size()); ++i) call(i);
        backend->synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kIters; ++i) call(i);
        backend->synchronize();
        const double sec = seconds_since(t0) / kIters;
        const double bytes = static_cast<double>(wbytes) * set.parts;
        std::printf(
            "{\"bench\": \"cuda_norm_linears\", \"dtype\": \"%s\", \"set\": \"%s\", "
            "\"way\": \"%s\", \"us_per_call\": %.2f, \"weight_gb_per_s\": %.1f}\n",
            std::string(dtype_name(dtype)).c_str(), set.name, way.c_str(), sec * 1e6,
            bytes / sec / 1e9);
        std::fflush(stdout);
      }
    }
  }
}

// Decode attention (one new row per sequence over its whole cache) and a device-to-device
// copy for the memory roofline. JSON on stdout; disabled by default like the one above.
TEST_F(CudaTest, DISABLED_AttentionDecodeThroughput) {
  constexpr int kIters = 20;
  CudaOptions options;
  options.fuse_decode_attention = true;
  const std::unique_ptr<Backend> one_kernel = make_cuda_backend(0, options);
  {
    const size_t bytes = size_t{1} << 30;
    DeviceBuffer a(gpu(), bytes), b(gpu(), bytes);
    gpu().copy(b.data(), a.data(), bytes, CopyKind::kDeviceToDevice);
    gpu().synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i)
      gpu().copy(b.data(), a.data(), bytes, CopyKind::kDeviceToDevice);
    gpu().synchronize();
    const double sec = seconds_since(t0) / kIters;
    std::printf(
        "{\"bench\": \"cuda_copy_d2d\", \"bytes\": %zu, \"gb_per_s_read_plus_write\": %.1f}\n",
        bytes, 2.0 * static_cast<double>(bytes) / sec / 1e9);
  }
  {
    // A model with half weights reserves linear's x scratch, which split decode borrows.
    KernelBounds b;
    b.max_rows = 512;
    b.max_in_features = 4096;
    b.half_weights = true;
    gpu().reserve(b);
    one_kernel->reserve(b);
  }
  // Caches of 64 MiB and more, so K and V come from device memory, not the 50 MB L2. The
  // last row is a prefill: one sequence's 512 new rows over its own keys (OPT-6.7B's heads).
  struct AttnShape {
    int32_t batch, ctx, n_heads, n_kv, new_rows;
  };
  for (const AttnShape sh : {AttnShape{32, 512, 32, 8, 1}, AttnShape{32, 2048, 32, 8, 1},
                             AttnShape{1, 32768, 32, 8, 1}, AttnShape{16, 544, 32, 32, 1},
                             AttnShape{4, 4096, 32, 32, 1}, AttnShape{1, 512, 32, 32, 512}}) {
    const int32_t batch = sh.batch, ctx = sh.ctx, n_heads = sh.n_heads, n_kv = sh.n_kv;
    const int32_t new_rows = sh.new_rows;
    constexpr int32_t hd = 128;
    const KvLayerView shape{nullptr, nullptr, batch, ctx, n_kv, hd};
    const size_t cache_bytes = shape.slot_stride() * batch * sizeof(float);
    DeviceBuffer k(gpu(), cache_bytes), v(gpu(), cache_bytes);
    const size_t rows = static_cast<size_t>(batch) * new_rows;
    DeviceBuffer q(gpu(), rows * n_heads * hd * 4), out(gpu(), rows * n_heads * hd * 4);
    KvLayerView view = shape;
    view.k = k.f32();
    view.v = v.f32();
    std::vector<SeqSlice> seqs;
    for (int32_t s = 0; s < batch; ++s)
      seqs.push_back(SeqSlice{s * new_rows, new_rows, ctx - new_rows, s});
    const AttentionDims dims{n_heads, n_kv, hd, 1.0f / std::sqrt(static_cast<float>(hd))};
    // Seconds a call of `attend` takes, and its line: K and V's bytes over that time.
    const auto time_attention = [&](const char* cache, size_t kv_bytes, const auto& attend) {
      attend();
      gpu().synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < kIters; ++i) attend();
      gpu().synchronize();
      const double sec = seconds_since(t0) / kIters;
      std::printf(
          "{\"bench\": \"cuda_attention\", \"cache\": \"%s\", \"batch\": %d, \"new_rows\": "
          "%d, \"ctx\": %d, \"n_heads\": %d, \"n_kv_heads\": %d, \"head_dim\": %d, "
          "\"us_per_call\": %.1f, \"kv_gb_per_s\": %.1f}\n",
          cache, batch, new_rows, ctx, n_heads, n_kv, hd, sec * 1e6,
          2.0 * static_cast<double>(kv_bytes) / sec / 1e9);
      std::fflush(stdout);
    };
    // The f32 cache, then the same buffers read as an f16 cache (half the bytes a call).
    for (const DType dtype : kCacheTypes) {
      KvLayerView as = view;
      as.dtype = dtype;
      time_attention(dtype_name(dtype), as.tensor_bytes(),
                     [&] { gpu().attention(q.f32(), seqs, as, dims, out.f32()); });
    }
    {
      // The same positions as a 4-bit cache (policy cc), zeros: codes, mins and scales.
      KvQ4LayerView q4{nullptr, nullptr, batch, ctx, n_kv, hd, KvQ4LayerView::group_for(hd)};
      DeviceBuffer qk(gpu(), q4.tensor_bytes()), qv(gpu(), q4.tensor_bytes());
      const std::vector<uint8_t> zeros(q4.tensor_bytes(), 0);
      gpu().copy(qk.data(), zeros.data(), zeros.size(), CopyKind::kHostToDevice);
      gpu().copy(qv.data(), zeros.data(), zeros.size(), CopyKind::kHostToDevice);
      q4.k = qk.data();
      q4.v = qv.data();
      time_attention("q4", q4.tensor_bytes(),
                     [&] { gpu().attention_q4(q.f32(), seqs, q4, dims, out.f32()); });
    }
    if (new_rows == 1) {
      // A decode step's whole attention: kv_store, attention and combine as the engine runs
      // them by default, against store_and_attend's one kernel.
      DeviceBuffer kn(gpu(), rows * n_kv * hd * 4), vn(gpu(), rows * n_kv * hd * 4);
      const auto step_time = [&](Backend& be, bool one) {
        const auto step = [&] {
          if (one) {
            EXPECT_TRUE(
                be.store_and_attend(q.f32(), kn.f32(), vn.f32(), seqs, view, dims, out.f32()));
          } else {
            be.kv_store(kn.f32(), vn.f32(), seqs, view);
            be.attention(q.f32(), seqs, view, dims, out.f32());
          }
        };
        step();
        be.synchronize();
        const auto t1 = std::chrono::steady_clock::now();
        for (int i = 0; i < kIters; ++i) step();
        be.synchronize();
        return seconds_since(t1) / kIters;
      };
      const double apart = step_time(gpu(), false), one = step_time(*one_kernel, true);
      std::printf(
          "{\"bench\": \"cuda_decode_attention_step\", \"batch\": %d, \"ctx\": %d, "
          "\"n_heads\": %d, \"n_kv_heads\": %d, \"head_dim\": %d, \"us_apart\": %.1f, "
          "\"us_one_kernel\": %.1f}\n",
          batch, ctx, n_heads, n_kv, hd, apart * 1e6, one * 1e6);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace strata
