// One table of every Backend op (kernels/backend.h), 4-bit ones included, each run on every
// backend against a naive reference written here (double precision, from the op's
// definition; not another backend). Inputs go through the backend's own memory (allocate /
// copy), outputs sit between guard elements that must survive the op, and the error is
// normalised: max |got - ref| / max(1, max |ref|), against a bound per op and backend.
// The CPU backend always runs; the CUDA rows skip (GTEST_SKIP) without a usable device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/dtype.h"
#include "kernels/error.h"
#include "kernels/gemm_q4_panel.h"
#include "kernels/quant.h"
#include "support/guarded.h"

namespace strata {
namespace {

using testing::random_floats;
using Ref = std::vector<double>;

// ---- buffers in the backend's memory, with guard elements ----------------------------

constexpr size_t kGuard = 16;  // elements each side

template <typename T>
T guard_value() {
  T v;
  std::memset(&v, 0xA5, sizeof(T));
  return v;
}

template <typename T>
class DevVec {
 public:
  DevVec(Backend& b, const std::vector<T>& host) : b_(b), n_(host.size()) {
    std::vector<T> all(n_ + 2 * kGuard, guard_value<T>());
    std::copy(host.begin(), host.end(), all.begin() + kGuard);
    buf_ = DeviceBuffer(b, all.size() * sizeof(T));
    b.copy(buf_.data(), all.data(), all.size() * sizeof(T), CopyKind::kHostToDevice);
  }
  T* data() const { return static_cast<T*>(buf_.data()) + kGuard; }
  std::vector<T> all() const {
    std::vector<T> out(n_ + 2 * kGuard);
    b_.synchronize();
    b_.copy(out.data(), buf_.data(), out.size() * sizeof(T), CopyKind::kDeviceToHost);
    return out;
  }
  std::vector<T> download() const {
    const std::vector<T> a = all();
    return std::vector<T>(a.begin() + kGuard, a.begin() + static_cast<std::ptrdiff_t>(kGuard + n_));
  }
  bool guards_intact() const {
    const std::vector<T> a = all();
    const T g = guard_value<T>();
    for (size_t i = 0; i < kGuard; ++i)
      if (std::memcmp(&a[i], &g, sizeof(T)) != 0 ||
          std::memcmp(&a[kGuard + n_ + i], &g, sizeof(T)) != 0)
        return false;
    return true;
  }

 private:
  Backend& b_;
  size_t n_;
  DeviceBuffer buf_;
};

// A weight tensor in the backend's memory.
struct DevTensor {
  DeviceBuffer buf;
  Tensor t;
  DevTensor(Backend& b, DType dtype, Shape shape, const void* host, size_t bytes) : buf(b, bytes) {
    b.copy(buf.data(), host, bytes, CopyKind::kHostToDevice);
    t.data = buf.data();
    t.dtype = dtype;
    t.shape = shape;
    t.device = b.device();
  }
};

struct Outcome {
  double err = std::numeric_limits<double>::infinity();
  bool guards = false;
};

double norm_err(const std::vector<float>& got, const Ref& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    max_diff = std::max(max_diff, std::fabs(got[i] - ref[i]));
  }
  return max_diff / std::max(1.0, max_ref);
}

Outcome outcome(const DevVec<float>& out, const Ref& ref) {
  return {norm_err(out.download(), ref), out.guards_intact()};
}

// Values k / 256 in [-1, 1]: exact in f16 and bf16, so those weights lose nothing.
std::vector<float> grid_floats(size_t n, uint32_t seed) {
  std::vector<float> v = random_floats(n, seed);
  for (float& x : v) x = std::round(x * 256.0f) / 256.0f;
  return v;
}

// y[m, n] = x[m, k] * W^T (+ bias) in double, with W's element (o, c) = w(o * k + c).
Ref linear_ref(const std::vector<float>& x, int64_t m, int64_t k, int64_t n,
               const std::vector<float>* bias, const std::function<double(size_t)>& w) {
  Ref ref(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t o = 0; o < n; ++o) {
      double s = bias != nullptr ? (*bias)[static_cast<size_t>(o)] : 0.0;
      for (int64_t c = 0; c < k; ++c)
        s += static_cast<double>(x[static_cast<size_t>(i * k + c)]) *
             w(static_cast<size_t>(o * k + c));
      ref[static_cast<size_t>(i * n + o)] = s;
    }
  return ref;
}

// The 4-bit round trip from its definition (quant.h): one min and scale per group,
// scale = (max - min) / 15, q = clamp(round((x - min) / scale), 0, 15), x' = q * scale + min.
Ref naive_q4(const std::vector<float>& x, size_t group) {
  Ref out(x.size());
  for (size_t g = 0; g < x.size(); g += group) {
    const float mn = *std::min_element(x.begin() + g, x.begin() + g + group);
    const float mx = *std::max_element(x.begin() + g, x.begin() + g + group);
    const double scale = (static_cast<double>(mx) - mn) / 15.0;
    for (size_t i = g; i < g + group; ++i) {
      const double q =
          scale == 0
              ? 0
              : std::clamp(std::nearbyint((x[i] - static_cast<double>(mn)) / scale), 0.0, 15.0);
      out[i] = q * scale + mn;
    }
  }
  return out;
}

// ---- the ops ---------------------------------------------------------------------------

Outcome op_copy(Backend& b) {
  const std::vector<float> x = random_floats(1000, 1);
  DevVec<float> a(b, x), c(b, std::vector<float>(x.size(), 0.0f));
  b.copy(c.data(), a.data(), x.size() * sizeof(float), CopyKind::kDeviceToDevice);
  return outcome(c, Ref(x.begin(), x.end()));
}

Outcome op_transfer(Backend& b) {
  // Host (transfer-ready) -> device -> host again, each waited for as the contract says.
  const std::vector<float> x = random_floats(4096, 2);
  const size_t bytes = x.size() * sizeof(float);
  DeviceBuffer host = DeviceBuffer::host(b, bytes), back = DeviceBuffer::host(b, bytes);
  std::memcpy(host.data(), x.data(), bytes);
  DevVec<float> dev(b, std::vector<float>(x.size(), 0.0f));
  const TransferTicket in = b.transfer(dev.data(), host.data(), bytes, CopyKind::kHostToDevice);
  b.compute_waits(in);
  b.host_waits(in);
  const TransferTicket out = b.transfer(back.data(), dev.data(), bytes, CopyKind::kDeviceToHost);
  b.host_waits(out);
  b.synchronize();
  std::vector<float> got(x.size());
  std::memcpy(got.data(), back.data(), bytes);
  return {norm_err(got, Ref(x.begin(), x.end())), dev.guards_intact()};
}

constexpr int64_t kM = 5, kK = 128, kN = 24;

// A linear's inputs for `dtype`: x [m, kK], weights [kN, kK] stored as `dtype`, a bias, and
// the weights' values as the reference reads them.
struct LinearInputs {
  std::vector<float> x, bias;
  Ref wref;
  std::vector<uint8_t> blob;
};

LinearInputs linear_inputs(DType dtype, int64_t m, uint32_t w_seed = 4) {
  LinearInputs in;
  in.x = random_floats(static_cast<size_t>(m * kK), 3);
  // On the k / 256 grid (exact in f16 / bf16), except for 4-bit: there grid values would
  // put codes on rounding ties, which f32 and double break differently.
  const auto nk = static_cast<size_t>(kN * kK);
  const std::vector<float> w =
      dtype == DType::kQ4 ? random_floats(nk, w_seed) : grid_floats(nk, w_seed);
  in.bias = random_floats(static_cast<size_t>(kN), w_seed + 1);
  in.wref = Ref(w.begin(), w.end());
  if (dtype == DType::kF32) {
    in.blob.resize(w.size() * 4);
    std::memcpy(in.blob.data(), w.data(), in.blob.size());
  } else if (dtype == DType::kF16 || dtype == DType::kBF16) {
    std::vector<uint16_t> h(w.size());
    for (size_t i = 0; i < w.size(); ++i)
      h[i] = dtype == DType::kF16 ? f32_to_f16(w[i]) : f32_to_bf16(w[i]);
    in.blob.resize(h.size() * 2);
    std::memcpy(in.blob.data(), h.data(), in.blob.size());
  } else {  // kQ4: rows grouped by 64
    const QuantizedTensor q =
        quantize_4bit(w.data(), {kN, kK, kQuantGroupSize, QuantAxis::kAlongRow});
    Tensor shape_only;
    shape_only.dtype = DType::kQ4;
    shape_only.shape = {kN, kK};
    in.blob.resize(shape_only.bytes());
    write_q4_blob(q, in.blob.data());
    in.wref = naive_q4(w, kQuantGroupSize);
  }
  return in;
}

Outcome linear_case(Backend& b, DType dtype) {
  const LinearInputs in = linear_inputs(dtype, kM);
  DevTensor dw(b, dtype, {kN, kK}, in.blob.data(), in.blob.size());
  DevVec<float> dx(b, in.x), db(b, in.bias),
      dy(b, std::vector<float>(static_cast<size_t>(kM * kN)));
  b.linear(dx.data(), kM, dw.t, db.data(), dy.data());
  return outcome(dy, linear_ref(in.x, kM, kK, kN, &in.bias, [&](size_t j) { return in.wref[j]; }));
}

// linear_then as the transformer calls it: where the backend folds the op (true), y is
// relu(x w^T + b) or y0 + x w^T + b; where it declines (false), y is untouched and the
// caller's linear and relu / add give the same.
Outcome linear_then_case(Backend& b, DType dtype, int64_t m, LinearThen then) {
  const LinearInputs in = linear_inputs(dtype, m);
  const std::vector<float> y0 = random_floats(static_cast<size_t>(m * kN), 6, -2.0f, 2.0f);
  DevTensor dw(b, dtype, {kN, kK}, in.blob.data(), in.blob.size());
  DevVec<float> dx(b, in.x), db(b, in.bias), dy(b, y0);
  const int64_t n = m * kN;
  if (!b.linear_then(dx.data(), m, dw.t, db.data(), then, dy.data())) {
    if (dy.download() != y0) return {};  // declined but wrote
    if (then == LinearThen::kRelu) {
      b.linear(dx.data(), m, dw.t, db.data(), dy.data());
      b.relu(dy.data(), n);
    } else {
      DevVec<float> h(b, std::vector<float>(static_cast<size_t>(n)));
      b.linear(dx.data(), m, dw.t, db.data(), h.data());
      b.add(dy.data(), h.data(), n);
    }
  }
  Ref ref = linear_ref(in.x, m, kK, kN, &in.bias, [&](size_t j) { return in.wref[j]; });
  for (size_t i = 0; i < ref.size(); ++i)
    ref[i] = then == LinearThen::kRelu ? std::max(ref[i], 0.0) : ref[i] + y0[i];
  return outcome(dy, ref);
}

// linears as the transformer calls it: three matrices of one width over the same x (q, k
// and v), with Llama's pre-norm (RMS) and OPT's ReLU where asked. Where the backend takes
// the set in one pass (true), each y is [relu](norm(x) w^T + b); where it declines, nothing
// is written and the caller's rms_norm, linear and relu give the same.
Outcome linears_case(Backend& b, DType dtype, int64_t m, bool norm, bool relu) {
  constexpr int kParts = 3;
  constexpr float kEps = 1e-5f;
  std::vector<LinearInputs> in;
  std::vector<std::unique_ptr<DevTensor>> dw;
  std::vector<std::unique_ptr<DevVec<float>>> db, dy;
  std::vector<LinearOut> outs;
  const std::vector<float> y0(static_cast<size_t>(m * kN), 12345.0f);
  for (int p = 0; p < kParts; ++p) {
    in.push_back(linear_inputs(dtype, m, 40 + 2 * static_cast<uint32_t>(p)));
    dw.push_back(std::make_unique<DevTensor>(b, dtype, Shape{kN, kK}, in.back().blob.data(),
                                             in.back().blob.size()));
    db.push_back(std::make_unique<DevVec<float>>(b, in.back().bias));
    dy.push_back(std::make_unique<DevVec<float>>(b, y0));
    outs.push_back({&dw.back()->t, db.back()->data(), dy.back()->data()});
  }
  const std::vector<float>& x = in[0].x;  // the same x for every part
  const std::vector<float> nw = random_floats(static_cast<size_t>(kK), 46, 0.5f, 1.5f);
  DevVec<float> dx(b, x), dnw(b, nw), dn(b, std::vector<float>(x.size()));
  const NormSpec spec{false, dnw.data(), nullptr, kEps};
  if (!b.linears(dx.data(), m, outs, LinearsFold{norm ? &spec : nullptr, relu})) {
    for (const auto& y : dy)
      if (y->download() != y0) return {};  // declined but wrote
    if (norm) b.rms_norm(dx.data(), m, kK, dnw.data(), kEps, dn.data());
    for (int p = 0; p < kParts; ++p) {
      b.linear(norm ? dn.data() : dx.data(), m, dw[p]->t, db[p]->data(), dy[p]->data());
      if (relu) b.relu(dy[p]->data(), m * kN);
    }
  }
  std::vector<float> xn = x;  // rms_norm's definition, in double
  for (int64_t r = 0; norm && r < m; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < kK; ++c) ss += double(x[r * kK + c]) * x[r * kK + c];
    const double inv = 1.0 / std::sqrt(ss / kK + kEps);
    for (int64_t c = 0; c < kK; ++c)
      xn[r * kK + c] = static_cast<float>(x[r * kK + c] * inv * nw[c]);
  }
  Outcome all{0.0, true};
  for (int p = 0; p < kParts; ++p) {
    Ref ref = linear_ref(xn, m, kK, kN, &in[p].bias, [&](size_t j) { return in[p].wref[j]; });
    if (relu)
      for (double& r : ref) r = std::max(r, 0.0);
    const Outcome o = outcome(*dy[p], ref);
    all = {std::max(all.err, o.err), all.guards && o.guards};
  }
  return all;
}

Outcome embedding_case(Backend& b, DType dtype) {
  constexpr int64_t vocab = 17, h = 40;
  const std::vector<float> table = grid_floats(static_cast<size_t>(vocab * h), 6);
  std::vector<uint8_t> blob(table.size() * dtype_size(dtype));
  for (size_t i = 0; i < table.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(blob.data() + 4 * i, &table[i], 4);
    } else {
      const uint16_t v = dtype == DType::kF16 ? f32_to_f16(table[i]) : f32_to_bf16(table[i]);
      std::memcpy(blob.data() + 2 * i, &v, 2);
    }
  }
  const std::vector<int32_t> ids = {3, 0, 16, 3, 9};
  DevTensor dt(b, dtype, {vocab, h}, blob.data(), blob.size());
  DevVec<int32_t> did(b, ids);
  DevVec<float> dy(b, std::vector<float>(ids.size() * h));
  b.embedding(did.data(), static_cast<int64_t>(ids.size()), dt.t, dy.data());
  Ref ref;
  for (int32_t id : ids)
    for (int64_t i = 0; i < h; ++i) ref.push_back(table[static_cast<size_t>(id * h + i)]);
  return outcome(dy, ref);
}

// A kQ4 blob (quant.h q4_view: codes, then mins, then scales, groups of 64 along rows) from
// given codes and group parameters, and what it decodes to: code * scale + min.
struct Q4Blob {
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> codes;  // one per element
  std::vector<float> mins, scales;
  double value(size_t i) const {
    const size_t g = i / kQuantGroupSize;
    return static_cast<double>(codes[i]) * scales[g] + mins[g];
  }
};

Q4Blob random_q4(int64_t rows, int64_t cols, uint32_t seed) {
  Q4Blob q;
  const auto n = static_cast<size_t>(rows * cols);
  std::mt19937 rng(seed);
  q.codes.resize(n);
  for (uint8_t& c : q.codes) c = static_cast<uint8_t>(rng() & 0x0f);
  q.mins = random_floats(n / kQuantGroupSize, seed + 1, -1.0f, 0.0f);
  q.scales = random_floats(n / kQuantGroupSize, seed + 2, 0.0f, 2.0f / 15.0f);
  q.bytes.resize(n / 2 + 8 * q.mins.size());
  for (size_t i = 0; i < n; i += 2)
    q.bytes[i / 2] = static_cast<uint8_t>(q.codes[i] | (q.codes[i + 1] << 4));
  std::memcpy(q.bytes.data() + n / 2, q.mins.data(), 4 * q.mins.size());
  std::memcpy(q.bytes.data() + n / 2 + 4 * q.mins.size(), q.scales.data(), 4 * q.scales.size());
  return q;
}

// The host's 4-bit panels (kernels/gemm_q4_panel.h, what the loader makes of kQ4 weights
// for CPU compute): a blob packed from random codes, at m rows (n = 40: the last panel has 8
// rows).
DevTensor q4_panel_tensor(Backend& b, const Q4Blob& q, int64_t rows, int64_t cols) {
  Tensor rowwise;
  rowwise.data = const_cast<uint8_t*>(q.bytes.data());
  rowwise.dtype = DType::kQ4;
  rowwise.shape = {rows, cols};
  std::vector<uint8_t> packed(q.bytes.size());  // the same bytes reordered
  pack_q4_panels(q4_view(rowwise), packed.data());
  return DevTensor(b, DType::kQ4Panel, {rows, cols}, packed.data(), packed.size());
}

// A compressed embedding table (compress_weight): each looked-up row decoded. Packed for
// the host, it is a tied 4-bit head.
Outcome op_embedding_q4(Backend& b, bool panels) {
  constexpr int64_t vocab = 17, h = 128;
  const Q4Blob q = random_q4(vocab, h, 30);
  const std::vector<int32_t> ids = {3, 0, 16, 3, 9};
  const DevTensor dt = panels
                           ? q4_panel_tensor(b, q, vocab, h)
                           : DevTensor(b, DType::kQ4, {vocab, h}, q.bytes.data(), q.bytes.size());
  DevVec<int32_t> did(b, ids);
  DevVec<float> dy(b, std::vector<float>(ids.size() * h));
  b.embedding(did.data(), static_cast<int64_t>(ids.size()), dt.t, dy.data());
  Ref ref;
  for (int32_t id : ids)
    for (int64_t i = 0; i < h; ++i) ref.push_back(q.value(static_cast<size_t>(id * h + i)));
  return outcome(dy, ref);
}

// A 4-bit matrix larger than the reserved dequantisation scratch, as a compressed head is
// (KernelBounds::max_q4_elems): an accelerator dequantises it in blocks of 10 rows here,
// the last one short.
Outcome op_linear_q4_row_blocks(Backend& b) {
  constexpr int64_t m = 2, k = 192, n = 103;
  KernelBounds bounds;
  bounds.max_rows = m;
  bounds.max_in_features = k;
  bounds.half_weights = true;
  bounds.max_q4_elems = 10 * k;
  b.reserve(bounds);
  const Q4Blob q = random_q4(n, k, 31);
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 32);
  DevTensor dw(b, DType::kQ4, {n, k}, q.bytes.data(), q.bytes.size());
  DevVec<float> dx(b, x), dy(b, std::vector<float>(static_cast<size_t>(m * n)));
  b.linear(dx.data(), m, dw.t, nullptr, dy.data());
  return outcome(dy, linear_ref(x, m, k, n, nullptr, [&](size_t j) { return q.value(j); }));
}

Outcome op_linear_q4_panel(Backend& b, int64_t m) {
  constexpr int64_t k = 192, n = 40;
  const Q4Blob q = random_q4(n, k, 33);
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k), 34);
  const std::vector<float> bias = random_floats(static_cast<size_t>(n), 35);
  const DevTensor dw = q4_panel_tensor(b, q, n, k);
  DevVec<float> dx(b, x), db(b, bias), dy(b, std::vector<float>(static_cast<size_t>(m * n)));
  b.linear(dx.data(), m, dw.t, db.data(), dy.data());
  return outcome(dy, linear_ref(x, m, k, n, &bias, [&](size_t j) { return q.value(j); }));
}

constexpr int64_t kRows = 4, kH = 96;

Outcome op_rms_norm(Backend& b) {
  const std::vector<float> x = random_floats(static_cast<size_t>(kRows * kH), 7, -3, 3);
  const std::vector<float> w = random_floats(static_cast<size_t>(kH), 8, 0.5f, 1.5f);
  DevVec<float> dx(b, x), dw(b, w), dy(b, std::vector<float>(x.size()));
  b.rms_norm(dx.data(), kRows, kH, dw.data(), 1e-5f, dy.data());
  Ref ref(x.size());
  for (int64_t r = 0; r < kRows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < kH; ++i)
      ss += double(x[static_cast<size_t>(r * kH + i)]) * x[static_cast<size_t>(r * kH + i)];
    const double inv = 1.0 / std::sqrt(ss / kH + 1e-5);
    for (int64_t i = 0; i < kH; ++i)
      ref[static_cast<size_t>(r * kH + i)] =
          x[static_cast<size_t>(r * kH + i)] * inv * w[static_cast<size_t>(i)];
  }
  return outcome(dy, ref);
}

Outcome op_layer_norm(Backend& b) {
  const std::vector<float> x = random_floats(static_cast<size_t>(kRows * kH), 9, -3, 4);
  const std::vector<float> w = random_floats(static_cast<size_t>(kH), 10, 0.5f, 1.5f);
  const std::vector<float> bias = random_floats(static_cast<size_t>(kH), 11);
  DevVec<float> dx(b, x), dw(b, w), db(b, bias), dy(b, std::vector<float>(x.size()));
  b.layer_norm(dx.data(), kRows, kH, dw.data(), db.data(), 1e-5f, dy.data());
  Ref ref(x.size());
  for (int64_t r = 0; r < kRows; ++r) {
    const float* row = x.data() + r * kH;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < kH; ++i) mean += row[i];
    mean /= kH;
    for (int64_t i = 0; i < kH; ++i) var += (row[i] - mean) * (row[i] - mean);
    var /= kH;
    for (int64_t i = 0; i < kH; ++i)
      ref[static_cast<size_t>(r * kH + i)] =
          (row[i] - mean) / std::sqrt(var + 1e-5) * w[static_cast<size_t>(i)] +
          bias[static_cast<size_t>(i)];
  }
  return outcome(dy, ref);
}

Outcome op_rope(Backend& b) {
  constexpr int32_t heads = 3, hd = 16, half = hd / 2, max_pos = 32;
  std::vector<float> cos_t(max_pos * half), sin_t(cos_t.size());
  for (int32_t p = 0; p < max_pos; ++p)
    for (int32_t j = 0; j < half; ++j) {
      const double a = p * std::pow(10000.0, -2.0 * j / hd);
      cos_t[static_cast<size_t>(p * half + j)] = static_cast<float>(std::cos(a));
      sin_t[static_cast<size_t>(p * half + j)] = static_cast<float>(std::sin(a));
    }
  const std::vector<int32_t> pos = {0, 7, 31, 2};
  const auto m = static_cast<int64_t>(pos.size());
  const std::vector<float> x = random_floats(static_cast<size_t>(m * heads * hd), 12, -2, 2);
  DevVec<float> dx(b, x), dc(b, cos_t), ds(b, sin_t);
  DevVec<int32_t> dp(b, pos);
  b.rope(dx.data(), m, heads, hd, dp.data(), RopeTables{dc.data(), ds.data(), max_pos, half});
  Ref ref(x.begin(), x.end());
  for (int64_t r = 0; r < m; ++r)
    for (int32_t h = 0; h < heads; ++h)
      for (int32_t j = 0; j < half; ++j) {
        const size_t i0 = static_cast<size_t>((r * heads + h) * hd + j), i1 = i0 + half;
        const double a = pos[static_cast<size_t>(r)] * std::pow(10000.0, -2.0 * j / hd);
        ref[i0] = x[i0] * std::cos(a) - x[i1] * std::sin(a);
        ref[i1] = x[i1] * std::cos(a) + x[i0] * std::sin(a);
      }
  return outcome(dx, ref);
}

constexpr int64_t kElems = 1000;

Outcome op_silu_mul(Backend& b) {
  const std::vector<float> g = random_floats(kElems, 13, -6, 6),
                           u = random_floats(kElems, 14, -2, 2);
  DevVec<float> dg(b, g), du(b, u), dout(b, std::vector<float>(kElems));
  b.silu_mul(dg.data(), du.data(), dout.data(), kElems);
  Ref ref(kElems);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
  return outcome(dout, ref);
}

// A MoE expert's rows: rows 5, 0 and 3 of a 6-row matrix gathered in that order.
constexpr int64_t kExpertWidth = 300;

Outcome op_gather_rows(Backend& b) {
  const std::vector<int32_t> rows = {5, 0, 3};
  const std::vector<float> x = random_floats(6 * kExpertWidth, 41);
  DevVec<float> dx(b, x), dout(b, std::vector<float>(rows.size() * kExpertWidth));
  DevVec<int32_t> dr(b, rows);
  b.gather_rows(dx.data(), kExpertWidth, dr.data(), static_cast<int64_t>(rows.size()), dout.data());
  Ref ref(rows.size() * kExpertWidth);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t j = 0; j < kExpertWidth; ++j)
      ref[i * kExpertWidth + j] = x[static_cast<size_t>(rows[i] * kExpertWidth + j)];
  return outcome(dout, ref);
}

// Its output added back with the router's weights: out[rows[i]] += w[i] * y[i]; row 1 and
// row 4 untouched.
Outcome op_scatter_add_rows(Backend& b) {
  const std::vector<int32_t> rows = {5, 0, 3, 2};
  const std::vector<float> w = {0.25f, 0.75f, 1.0f, -0.5f};
  const std::vector<float> y = random_floats(rows.size() * kExpertWidth, 42);
  const std::vector<float> out = random_floats(6 * kExpertWidth, 43);
  DevVec<float> dy(b, y), dw(b, w), dout(b, out);
  DevVec<int32_t> dr(b, rows);
  b.scatter_add_rows(dy.data(), kExpertWidth, dr.data(), dw.data(),
                     static_cast<int64_t>(rows.size()), dout.data());
  Ref ref(out.begin(), out.end());
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t j = 0; j < kExpertWidth; ++j)
      ref[static_cast<size_t>(rows[i] * kExpertWidth + j)] +=
          double(w[i]) * y[i * kExpertWidth + static_cast<size_t>(j)];
  return outcome(dout, ref);
}

Outcome op_relu(Backend& b) {
  const std::vector<float> x = random_floats(kElems, 15, -2, 2);
  DevVec<float> dx(b, x);
  b.relu(dx.data(), kElems);
  Ref ref(kElems);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = std::max(0.0, double(x[i]));
  return outcome(dx, ref);
}

Outcome op_add(Backend& b) {
  const std::vector<float> y = random_floats(kElems, 16), x = random_floats(kElems, 17);
  DevVec<float> dy(b, y), dx(b, x);
  b.add(dy.data(), dx.data(), kElems);
  Ref ref(kElems);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = double(y[i]) + x[i];
  return outcome(dy, ref);
}

Outcome op_softmax(Backend& b) {
  constexpr int64_t m = 6, n = 77;
  const std::vector<float> x = random_floats(static_cast<size_t>(m * n), 18, -8, 8);
  DevVec<float> dx(b, x);
  b.softmax(dx.data(), m, n);
  Ref ref(x.size());
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x.data() + r * n;
    const double mx = *std::max_element(row, row + n);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += std::exp(row[i] - mx);
    for (int64_t i = 0; i < n; ++i) ref[static_cast<size_t>(r * n + i)] = std::exp(row[i] - mx) / s;
  }
  return outcome(dx, ref);
}

// Attention shape: 4 query heads over 2 kv heads (GQA), head_dim 16, two sequences in two
// slots of capacity 12: slot 1 gets 3 new rows after 5 cached, slot 0 one row after 8.
constexpr int32_t kHeads = 4, kKvHeads = 2, kHd = 16, kSlots = 2, kCap = 12;
const std::vector<SeqSlice> kSeqs = {{0, 3, 5, 1}, {3, 1, 8, 0}};
constexpr int64_t kNewRows = 4, kKvW = kKvHeads * kHd;

KvLayerView view_of(void* k, void* v, DType dtype = DType::kF32) {
  return {k, v, kSlots, kCap, kKvHeads, kHd, dtype};
}
size_t cache_elems() {
  return static_cast<size_t>(kSlots) * kKvHeads * kCap * kHd;
}
// The references' view of a cache layer: kv heads, head_dim and capacity (the cases' own
// shape above, or a decode kernel's), indexed as KvLayerView lays it out.
struct RefCache {
  int32_t kv_heads = kKvHeads, hd = kHd, cap = kCap;
  size_t index(int32_t slot, int32_t head, int32_t pos, int32_t d) const {
    return ((static_cast<size_t>(slot) * kv_heads + head) * cap + pos) * hd + d;
  }
};

// The step's rows as the engine hands them over: the slices and, with `table`, the row
// table filled on the host and copied into the backend's memory (`holder` keeps it).
StepRows step_rows(Backend& b, bool table, DeviceBuffer& holder) {
  StepRows rows(kSeqs);
  if (!table) return rows;
  std::vector<RowEntry> host(kNewRows);
  rows.n_rows = fill_row_table(kSeqs, kSlots, kCap, host.data(), kNewRows);
  holder = DeviceBuffer(b, host.size() * sizeof(RowEntry));
  b.copy(holder.data(), host.data(), host.size() * sizeof(RowEntry), CopyKind::kHostToDevice);
  rows.table = static_cast<const RowEntry*>(holder.data());
  return rows;
}

// Rows k, v ([rows, kv_heads * hd]) of each of `seqs` written into the reference caches rk,
// rv at their positions, as kv_store defines it.
template <class Rows>
void place_rows(const std::vector<SeqSlice>& seqs, const Rows& k, const Rows& v, Ref& rk, Ref& rv,
                const RefCache& c = {}) {
  for (const SeqSlice& s : seqs)
    for (int32_t t = 0; t < s.n_new; ++t)
      for (int32_t h = 0; h < c.kv_heads; ++h)
        for (int32_t d = 0; d < c.hd; ++d) {
          const auto src = static_cast<size_t>(((s.row_begin + t) * c.kv_heads + h) * c.hd + d);
          rk[c.index(s.slot, h, s.n_past + t, d)] = k[src];
          rv[c.index(s.slot, h, s.n_past + t, d)] = v[src];
        }
}

Outcome op_kv_store(Backend& b, bool table) {
  const std::vector<float> k = random_floats(kNewRows * kKvW, 19),
                           v = random_floats(kNewRows * kKvW, 20);
  const std::vector<float> k0 = random_floats(cache_elems(), 21),
                           v0 = random_floats(cache_elems(), 22);
  DevVec<float> dk(b, k), dv(b, v), ck(b, k0), cv(b, v0);
  DeviceBuffer holder;
  b.kv_store(dk.data(), dv.data(), step_rows(b, table, holder), view_of(ck.data(), cv.data()));
  Ref rk(k0.begin(), k0.end()), rv(v0.begin(), v0.end());
  place_rows(kSeqs, k, v, rk, rv);
  const Outcome a = outcome(ck, rk), c = outcome(cv, rv);
  return {std::max(a.err, c.err), a.guards && c.guards};
}

// Causal attention of the new rows of `seqs` (kSeqs unless given) by its definition, with
// `heads` query heads over caches kc, vc laid out as `c`.
template <class Cache>
Ref attention_ref(const std::vector<float>& q, const Cache& kc, const Cache& vc, float scale,
                  const std::vector<SeqSlice>& seqs = kSeqs, int32_t heads = kHeads,
                  const RefCache& c = {}) {
  Ref ref(q.size());
  for (const SeqSlice& s : seqs)
    for (int32_t t = 0; t < s.n_new; ++t)
      for (int32_t h = 0; h < heads; ++h) {
        const int32_t kh = h / (heads / c.kv_heads), n = s.n_past + t + 1;  // causal
        const float* qr = q.data() + ((s.row_begin + t) * heads + h) * c.hd;
        std::vector<double> p(static_cast<size_t>(n));
        double mx = -1e300, sum = 0;
        for (int32_t u = 0; u < n; ++u) {
          double d = 0;
          for (int32_t j = 0; j < c.hd; ++j) d += double(qr[j]) * kc[c.index(s.slot, kh, u, j)];
          p[static_cast<size_t>(u)] = d * scale;
          mx = std::max(mx, d * scale);
        }
        for (double& e : p) sum += (e = std::exp(e - mx));
        for (int32_t j = 0; j < c.hd; ++j) {
          double o = 0;
          for (int32_t u = 0; u < n; ++u)
            o += p[static_cast<size_t>(u)] / sum * vc[c.index(s.slot, kh, u, j)];
          ref[static_cast<size_t>(((s.row_begin + t) * heads + h) * c.hd + j)] = o;
        }
      }
  return ref;
}

constexpr float kAttnScale = 1.0f / 4.0f;  // 1 / sqrt(kHd)

Outcome op_attention(Backend& b, bool table) {
  const std::vector<float> kc = random_floats(cache_elems(), 23),
                           vc = random_floats(cache_elems(), 24);
  const std::vector<float> q = random_floats(kNewRows * kHeads * kHd, 25, -2, 2);
  DevVec<float> dq(b, q), ck(b, kc), cv(b, vc), dout(b, std::vector<float>(q.size()));
  DeviceBuffer holder;
  b.attention(dq.data(), step_rows(b, table, holder), view_of(ck.data(), cv.data()),
              {kHeads, kKvHeads, kHd, kAttnScale}, dout.data());
  return outcome(dout, attention_ref(q, kc, vc, kAttnScale));
}

// An f16 cache (policy cf16) holds each element rounded to nearest even (f32_to_f16, checked
// against the format's definition in test_cpu_backend); the reference reads those values.
std::vector<uint16_t> as_f16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = f32_to_f16(x[i]);
  return h;
}
Ref f16_values(const std::vector<uint16_t>& h) {
  Ref r(h.size());
  for (size_t i = 0; i < h.size(); ++i) r[i] = f16_to_f32(h[i]);
  return r;
}
Outcome outcome(const DevVec<uint16_t>& out, const Ref& ref) {
  const std::vector<uint16_t> h = out.download();
  std::vector<float> got(h.size());
  for (size_t i = 0; i < h.size(); ++i) got[i] = f16_to_f32(h[i]);
  return {norm_err(got, ref), out.guards_intact()};
}

// kv_store into an f16 cache: the new rows rounded, every other element as it was.
Outcome op_kv_store_f16(Backend& b, bool table) {
  const std::vector<float> k = random_floats(kNewRows * kKvW, 33, -3, 3),
                           v = random_floats(kNewRows * kKvW, 34);
  const std::vector<uint16_t> k0 = as_f16(random_floats(cache_elems(), 35)),
                              v0 = as_f16(random_floats(cache_elems(), 36));
  DevVec<float> dk(b, k), dv(b, v);
  DevVec<uint16_t> ck(b, k0), cv(b, v0);
  DeviceBuffer holder;
  b.kv_store(dk.data(), dv.data(), step_rows(b, table, holder),
             view_of(ck.data(), cv.data(), DType::kF16));
  Ref rk = f16_values(k0), rv = f16_values(v0);
  place_rows(kSeqs, f16_values(as_f16(k)), f16_values(as_f16(v)), rk, rv);
  const Outcome a = outcome(ck, rk), c = outcome(cv, rv);
  return {std::max(a.err, c.err), a.guards && c.guards};
}

// Attention over an f16 cache: the definition over the values the cache holds.
Outcome op_attention_f16(Backend& b, bool table) {
  const std::vector<uint16_t> kc = as_f16(random_floats(cache_elems(), 37, -3, 3)),
                              vc = as_f16(random_floats(cache_elems(), 38));
  const std::vector<float> q = random_floats(kNewRows * kHeads * kHd, 39, -2, 2);
  DevVec<float> dq(b, q), dout(b, std::vector<float>(q.size()));
  DevVec<uint16_t> ck(b, kc), cv(b, vc);
  DeviceBuffer holder;
  b.attention(dq.data(), step_rows(b, table, holder), view_of(ck.data(), cv.data(), DType::kF16),
              {kHeads, kKvHeads, kHd, kAttnScale}, dout.data());
  return outcome(dout, attention_ref(q, f16_values(kc), f16_values(vc), kAttnScale));
}

// kv_store_q4 then kv_dequantize: the stored rows come back as the naive round trip of
// their groups (head_dim 16 < 64: one group per cached row); the rest of the cache stays 0.
Outcome op_kv_q4(Backend& b, bool table) {
  const std::vector<float> k = random_floats(kNewRows * kKvW, 26, -3, 3),
                           v = random_floats(kNewRows * kKvW, 27);
  KvQ4LayerView q{nullptr, nullptr, kSlots, kCap, kKvHeads, kHd, KvQ4LayerView::group_for(kHd)};
  DeviceBuffer qk(b, q.tensor_bytes()), qv(b, q.tensor_bytes());
  const std::vector<uint8_t> zeros(q.tensor_bytes(), 0);
  b.copy(qk.data(), zeros.data(), zeros.size(), CopyKind::kHostToDevice);
  b.copy(qv.data(), zeros.data(), zeros.size(), CopyKind::kHostToDevice);
  q.k = qk.data();
  q.v = qv.data();
  DevVec<float> dk(b, k), dv(b, v);
  DevVec<float> ok(b, std::vector<float>(cache_elems(), 7.0f)),
      ov(b, std::vector<float>(cache_elems(), 7.0f));
  DeviceBuffer holder;
  b.kv_store_q4(dk.data(), dv.data(), step_rows(b, table, holder), q);
  b.kv_dequantize(q, view_of(ok.data(), ov.data()));
  const Ref nk = naive_q4(k, static_cast<size_t>(q.group)),
            nv = naive_q4(v, static_cast<size_t>(q.group));
  Ref rk(cache_elems(), 0.0), rv(cache_elems(), 0.0);
  place_rows(kSeqs, nk, nv, rk, rv);
  const Outcome a = outcome(ok, rk), c = outcome(ov, rv);
  return {std::max(a.err, c.err), a.guards && c.guards};
}

// attention_q4 over a 4-bit cache: each sequence's history is stored first (a prefill of
// kSeqs' n_past rows), then the step's rows; the reference attends over the naive round
// trip of both, so a kernel that reads a position or a group's min and scale wrongly fails.
Outcome op_attention_q4(Backend& b, bool table) {
  KvQ4LayerView q4{nullptr, nullptr, kSlots, kCap, kKvHeads, kHd, KvQ4LayerView::group_for(kHd)};
  DeviceBuffer qk(b, q4.tensor_bytes()), qv(b, q4.tensor_bytes());
  q4.k = qk.data();
  q4.v = qv.data();
  std::vector<SeqSlice> history;
  int32_t hist_rows = 0;
  for (const SeqSlice& s : kSeqs) {
    history.push_back({hist_rows, s.n_past, 0, s.slot});
    hist_rows += s.n_past;
  }
  const std::vector<float> hk = random_floats(static_cast<size_t>(hist_rows * kKvW), 28, -3, 3),
                           hv = random_floats(static_cast<size_t>(hist_rows * kKvW), 29),
                           k = random_floats(kNewRows * kKvW, 30, -3, 3),
                           v = random_floats(kNewRows * kKvW, 31),
                           q = random_floats(kNewRows * kHeads * kHd, 32, -2, 2);
  DevVec<float> dhk(b, hk), dhv(b, hv), dk(b, k), dv(b, v), dq(b, q),
      dout(b, std::vector<float>(q.size()));
  b.kv_store_q4(dhk.data(), dhv.data(), StepRows(history), q4);
  DeviceBuffer holder;
  const StepRows step = step_rows(b, table, holder);
  b.kv_store_q4(dk.data(), dv.data(), step, q4);
  b.attention_q4(dq.data(), step, q4, {kHeads, kKvHeads, kHd, kAttnScale}, dout.data());

  const size_t g = static_cast<size_t>(q4.group);
  const Ref nhk = naive_q4(hk, g), nhv = naive_q4(hv, g), nk = naive_q4(k, g), nv = naive_q4(v, g);
  Ref rk(cache_elems(), 0.0), rv(cache_elems(), 0.0);
  place_rows(history, nhk, nhv, rk, rv);
  place_rows(kSeqs, nk, nv, rk, rv);
  return outcome(dout, attention_ref(q, rk, rv, kAttnScale));
}

// store_and_attend as the transformer calls it at a decode step: one new row a sequence, at
// head_dim 64 with 4 query heads a kv head (the shapes the CUDA one-kernel decode takes).
// Where a backend takes it, the cache holds the new rows (rounded as it stores them) and out
// their attention over it; where it declines, nothing is written and the caller's kv_store
// and attention give the same.
Outcome store_and_attend_case(Backend& b, DType cache_dtype) {
  constexpr int32_t heads = 8, kv = 2, hd = 64, slots = 2, cap = 40;
  const std::vector<SeqSlice> seqs = {{0, 1, 20, 1}, {1, 1, 33, 0}};
  const auto rows = static_cast<int64_t>(seqs.size());
  const auto elems = static_cast<size_t>(slots) * kv * cap * hd;
  const RefCache layout{kv, hd, cap};
  const bool half = cache_dtype == DType::kF16;
  const auto stored = [&](const std::vector<float>& x) {  // the values the cache holds
    return half ? f16_values(as_f16(x)) : Ref(x.begin(), x.end());
  };
  const std::vector<float> k0 = random_floats(elems, 47, -2, 2), v0 = random_floats(elems, 48),
                           k = random_floats(static_cast<size_t>(rows * kv * hd), 49, -2, 2),
                           v = random_floats(static_cast<size_t>(rows * kv * hd), 50),
                           q = random_floats(static_cast<size_t>(rows * heads * hd), 51, -2, 2);
  DevVec<float> dk(b, k), dv(b, v), dq(b, q), dout(b, std::vector<float>(q.size(), 7.0f));
  // The caches, as stored: f32 values, or their f16 bits.
  DevVec<float> fk(b, half ? std::vector<float>() : k0), fv(b, half ? std::vector<float>() : v0);
  DevVec<uint16_t> hk(b, half ? as_f16(k0) : std::vector<uint16_t>()),
      hv(b, half ? as_f16(v0) : std::vector<uint16_t>());
  const KvLayerView view{half ? static_cast<void*>(hk.data()) : fk.data(),
                         half ? static_cast<void*>(hv.data()) : fv.data(),
                         slots,
                         cap,
                         kv,
                         hd,
                         cache_dtype};
  const AttentionDims dims{heads, kv, hd, 0.125f};
  if (!b.store_and_attend(dq.data(), dk.data(), dv.data(), StepRows(seqs), view, dims,
                          dout.data())) {
    if (dout.download() != std::vector<float>(q.size(), 7.0f)) return {};  // declined but wrote
    b.kv_store(dk.data(), dv.data(), StepRows(seqs), view);
    b.attention(dq.data(), StepRows(seqs), view, dims, dout.data());
  }
  Ref rk = stored(k0), rv = stored(v0);
  place_rows(seqs, stored(k), stored(v), rk, rv, layout);
  const Ref ref = attention_ref(q, rk, rv, dims.scale, seqs, heads, layout);
  Outcome caches{0.0, true};
  for (const auto& [got_f32, got_f16, want] :
       {std::tuple{&fk, &hk, &rk}, std::tuple{&fv, &hv, &rv}}) {
    const Outcome c = half ? outcome(*got_f16, *want) : outcome(*got_f32, *want);
    caches = {std::max(caches.err, c.err), caches.guards && c.guards};
  }
  const Outcome o = outcome(dout, ref);
  return {std::max(o.err, caches.err), o.guards && caches.guards};
}

// ---- the table -------------------------------------------------------------------------

struct OpCase {
  std::string name;
  std::function<Outcome(Backend&)> run;
  double cpu_tol;
  double cuda_tol;           // f16/bf16/q4 weights: the CUDA GEMM rounds x to f16 (cuda_backend.h)
  bool host_layout = false;  // a weight layout only the CPU computes with (never uploaded)
};

const std::vector<OpCase>& op_table() {
  static const std::vector<OpCase> table = {
      {"copy", op_copy, 0, 0},
      {"transfer", op_transfer, 0, 0},
      {"linear_f32", [](Backend& b) { return linear_case(b, DType::kF32); }, 1e-5, 1e-3},
      {"linear_f16", [](Backend& b) { return linear_case(b, DType::kF16); }, 1e-5, 1e-2},
      {"linear_bf16", [](Backend& b) { return linear_case(b, DType::kBF16); }, 1e-5, 2e-2},
      {"linear_q4", [](Backend& b) { return linear_case(b, DType::kQ4); }, 1e-4, 1e-2},
      // Folded where a backend has the kernel (the CUDA GEMV: one row of half weights, up to
      // 8 of 4-bit; x stays f32 there), declined elsewhere.
      {"linear_then_f16_relu",
       [](Backend& b) { return linear_then_case(b, DType::kF16, 1, LinearThen::kRelu); }, 1e-5,
       1e-4},
      {"linear_then_bf16_accumulate",
       [](Backend& b) { return linear_then_case(b, DType::kBF16, 1, LinearThen::kAccumulate); },
       1e-5, 1e-4},
      {"linear_then_q4_accumulate",
       [](Backend& b) { return linear_then_case(b, DType::kQ4, kM, LinearThen::kAccumulate); },
       1e-4, 1e-4},
      {"linear_then_f32_relu",
       [](Backend& b) { return linear_then_case(b, DType::kF32, kM, LinearThen::kRelu); }, 1e-5,
       1e-3},
      // Three matrices over one x in one pass where a backend has the kernel (the CUDA GEMV;
      // the norm folded in with STRATA_CUDA_NORM=fused), declined elsewhere.
      {"linears_f16", [](Backend& b) { return linears_case(b, DType::kF16, 1, false, false); },
       1e-5, 1e-4},
      {"linears_q4", [](Backend& b) { return linears_case(b, DType::kQ4, 3, false, false); }, 1e-4,
       1e-4},
      {"linears_bf16_norm_relu",
       [](Backend& b) { return linears_case(b, DType::kBF16, 1, true, true); }, 1e-5, 1e-4},
      {"linears_q4_norm", [](Backend& b) { return linears_case(b, DType::kQ4, 1, true, false); },
       1e-4, 1e-4},
      {"embedding_f32", [](Backend& b) { return embedding_case(b, DType::kF32); }, 0, 0},
      {"embedding_f16", [](Backend& b) { return embedding_case(b, DType::kF16); }, 0, 0},
      {"embedding_bf16", [](Backend& b) { return embedding_case(b, DType::kBF16); }, 0, 0},
      {"embedding_q4", [](Backend& b) { return op_embedding_q4(b, false); }, 1e-6, 1e-6},
      {"linear_q4_row_blocks", op_linear_q4_row_blocks, 1e-4, 1e-2},
      {"linear_q4_panel", [](Backend& b) { return op_linear_q4_panel(b, 5); }, 1e-4, 0, true},
      {"linear_q4_panel_rows", [](Backend& b) { return op_linear_q4_panel(b, 37); }, 1e-4, 0, true},
      {"embedding_q4_panel", [](Backend& b) { return op_embedding_q4(b, true); }, 1e-6, 0, true},
      {"rms_norm", op_rms_norm, 1e-5, 1e-5},
      {"layer_norm", op_layer_norm, 1e-5, 1e-5},
      {"rope", op_rope, 1e-5, 1e-5},
      {"silu_mul", op_silu_mul, 1e-5, 1e-5},
      {"relu", op_relu, 0, 0},
      {"gather_rows", op_gather_rows, 0, 0},
      {"scatter_add_rows", op_scatter_add_rows, 1e-6, 1e-6},
      {"add", op_add, 1e-6, 1e-6},
      {"softmax", op_softmax, 1e-5, 1e-5},
      {"kv_store", [](Backend& b) { return op_kv_store(b, false); }, 0, 0},
      {"attention", [](Backend& b) { return op_attention(b, false); }, 1e-5, 1e-4},
      {"kv_store_f16", [](Backend& b) { return op_kv_store_f16(b, false); }, 0, 0},
      {"attention_f16", [](Backend& b) { return op_attention_f16(b, false); }, 1e-5, 1e-4},
      {"kv_store_q4+kv_dequantize", [](Backend& b) { return op_kv_q4(b, false); }, 1e-5, 1e-5},
      {"attention_q4", [](Backend& b) { return op_attention_q4(b, false); }, 1e-5, 1e-4},
      // kv_store, attention and the split combine as one kernel where a backend has it (CUDA
      // with STRATA_CUDA_DECODE=fused), the two ops elsewhere.
      {"store_and_attend_f32", [](Backend& b) { return store_and_attend_case(b, DType::kF32); },
       1e-5, 1e-4},
      {"store_and_attend_f16", [](Backend& b) { return store_and_attend_case(b, DType::kF16); },
       1e-5, 1e-4},
      // The same with the step's row table in the backend's memory (the engine's path).
      {"kv_store_table", [](Backend& b) { return op_kv_store(b, true); }, 0, 0},
      {"attention_table", [](Backend& b) { return op_attention(b, true); }, 1e-5, 1e-4},
      {"kv_store_f16_table", [](Backend& b) { return op_kv_store_f16(b, true); }, 0, 0},
      {"attention_f16_table", [](Backend& b) { return op_attention_f16(b, true); }, 1e-5, 1e-4},
      {"kv_store_q4+kv_dequantize_table", [](Backend& b) { return op_kv_q4(b, true); }, 1e-5, 1e-5},
      {"attention_q4_table", [](Backend& b) { return op_attention_q4(b, true); }, 1e-5, 1e-4},
  };
  return table;
}

TEST(BackendOps, TheTableCoversEveryOpOfTheInterface) {
  // Backend's compute and memory ops as backend.h declares them (allocate, deallocate,
  // allocate_host, compute_waits, host_waits, synchronize run inside the cases above).
  const std::set<std::string> interface = {"copy",
                                           "transfer",
                                           "linear",
                                           "linear_then",
                                           "embedding",
                                           "rms_norm",
                                           "layer_norm",
                                           "rope",
                                           "silu_mul",
                                           "relu",
                                           "add",
                                           "softmax",
                                           "kv_store",
                                           "kv_store_q4",
                                           "kv_dequantize",
                                           "attention",
                                           "attention_q4",
                                           "linears",
                                           "store_and_attend",
                                           "gather_rows",
                                           "scatter_add_rows"};
  std::set<std::string> covered;
  for (const OpCase& c : op_table()) {
    std::string n = c.name;
    if (n.ends_with("_table")) n = n.substr(0, n.size() - std::strlen("_table"));
    for (const char* variant : {"_row_blocks", "_rows", "_relu", "_norm", "_accumulate"})
      if (n.ends_with(variant) && !interface.contains(n))
        n = n.substr(0, n.size() - std::strlen(variant));
    for (const char* suffix : {"_f32", "_f16", "_bf16", "_q4_panel", "_q4"})
      if (n.size() > std::strlen(suffix) && n.ends_with(suffix) && !interface.contains(n))
        n = n.substr(0, n.size() - std::strlen(suffix));
    if (n == "kv_store_q4+kv_dequantize") {
      covered.insert("kv_store_q4");
      covered.insert("kv_dequantize");
    } else {
      covered.insert(n);
    }
  }
  EXPECT_EQ(covered, interface);
}

class BackendOpTest : public ::testing::TestWithParam<size_t> {};

void run_case(Backend& b, const OpCase& c, double tol) {
  const Outcome o = c.run(b);
  EXPECT_LE(o.err, tol) << b.name() << " " << c.name;
  EXPECT_TRUE(o.guards) << b.name() << " " << c.name << ": wrote outside its output";
}

TEST_P(BackendOpTest, Cpu) {
  CpuBackend cpu(2);
  const OpCase& c = op_table()[GetParam()];
  run_case(cpu, c, c.cpu_tol);
}

TEST_P(BackendOpTest, Cuda) {
  std::unique_ptr<Backend> gpu;
  try {
    gpu = make_cuda_backend(0);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kInvalidInput) throw;  // a mistyped STRATA_CUDA_* switch
    GTEST_SKIP() << "no CUDA device: " << e.what();
  }
  const OpCase& c = op_table()[GetParam()];
  if (c.host_layout) GTEST_SKIP() << c.name << ": a layout the loader makes only for the CPU";
  run_case(*gpu, c, c.cuda_tol);
}

INSTANTIATE_TEST_SUITE_P(Ops, BackendOpTest, ::testing::Range(size_t{0}, op_table().size()),
                         [](const ::testing::TestParamInfo<size_t>& i) {
                           std::string n = op_table()[i.param].name;
                           for (char& ch : n)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// The row table by hand: kSeqs-like slices {row 0: 2 new at 3 in slot 1}, {row 2: 1 new at
// 0 in slot 0} give (0,1,3) (1,1,4) (2,0,0); a slot outside the cache, a sequence past its
// capacity or more rows than the table holds are refused.
TEST(RowTable, OneEntryPerNewRowCheckedAgainstTheCache) {
  const std::vector<SeqSlice> seqs = {{0, 2, 3, 1}, {2, 1, 0, 0}};
  std::vector<RowEntry> t(3);
  ASSERT_EQ(fill_row_table(seqs, 2, 8, t.data(), 3), 3);
  const int32_t want[3][3] = {{0, 1, 3}, {1, 1, 4}, {2, 0, 0}};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(t[i].row, want[i][0]) << i;
    EXPECT_EQ(t[i].slot, want[i][1]) << i;
    EXPECT_EQ(t[i].pos, want[i][2]) << i;
  }
  EXPECT_THROW(fill_row_table(seqs, 1, 8, t.data(), 3), Error);  // slot 1 of 1
  EXPECT_THROW(fill_row_table(seqs, 2, 4, t.data(), 3), Error);  // 3 + 2 > 4 positions
  EXPECT_THROW(fill_row_table(seqs, 2, 8, t.data(), 2), Error);  // 3 rows, room for 2
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

TEST(KvWindowRows, FormulaByHand) {
  // W = 16, C = 40: S = ceil(16 / 8) = 2, rows = 16 - 1 + 40 + 2 = 57.
  const KvWindow w = KvWindow::of(16, 4096, 40);
  ASSERT_TRUE(w.active());
  EXPECT_EQ(w.rows, 57);
  EXPECT_EQ(w.slack, 2);
  // first_held(p) = S * ceil((p - rows) / S) past the slot's rows, 0 before.
  EXPECT_EQ(w.first_held(40), 0);
  EXPECT_EQ(w.first_held(57), 0);
  EXPECT_EQ(w.first_held(58), 2);
  EXPECT_EQ(w.first_held(59), 2);
  EXPECT_EQ(w.first_held(60), 4);
  EXPECT_EQ(w.first_held(157), 100);
  // Whatever a step adds, the held rows keep the window: a query at p - 1 sees p - W .. p - 1.
  for (int32_t p = 1; p < 400; ++p) {
    EXPECT_LE(p - w.first_held(p), w.rows) << p;
    EXPECT_LE(w.first_held(p), std::max(0, p - 16 - 40)) << p;
  }
  // W = 4096, C = 1: S = 512.
  EXPECT_EQ(KvWindow::of(4096, 32768, 1).rows, 4096 - 1 + 1 + 512);
  // No window, or one that holds the whole context: nothing to bound.
  EXPECT_FALSE(KvWindow::of(0, 4096, 40).active());
  EXPECT_FALSE(KvWindow::of(16, 57, 40).active());
  EXPECT_TRUE(KvWindow::of(16, 58, 40).active());
}

}  // namespace
}  // namespace strata
