// HeteGen's split linear (worker/split_linear.h) with two CPU backends standing in for the
// device and the host: the first ceil(alpha x out) output rows on one, the rest on the other.
// A row split leaves every output element's dot product whole. Checked for alphas 0 .. 1,
// odd shapes, vector tails, one row and GEMM-sized row counts, with and without bias, f32,
// f16, bf16 and 4-bit weights: bit for bit against each share computed alone and joined by
// hand; bit for bit against the unsplit linear on the decode path, within rounding on the
// GEMM path (see expect_split_matches); with transfers that only land when waited for (a
// missing wait shows); and whole models: greedy ids of stories260K (llama2.c's) and of a
// dummy OPT, f32 and 4-bit, split exactly as unsplit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "coordinator/run/local_stages.h"
#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "kernels/gemv.h"
#include "kernels/quant.h"
#include "support/forwarding_backend.h"
#include "support/guarded.h"
#include "support/stories_reference.h"
#include "worker/hetegen_bench.h"
#include "worker/loader.h"
#include "worker/model.h"
#include "worker/split_linear.h"

namespace strata {
namespace {

// HeteGen splits row-major weights (it runs with a device, where the host never packs them);
// these tests stand a CPU backend in for the device, so they load the weights as stored.
LoadOptions row_major() {
  LoadOptions lo;
  lo.cpu_panels = false;
  return lo;
}

using testing::Guarded;
using testing::random_floats;

// A backend whose transfers land only when someone waits for them (or at synchronize), in
// issue order: the latest a real copy engine may finish. A split linear that reads a
// transfer's destination before compute_waits / host_waits, or rewrites its source before
// host_waits, computes from stale memory here.
class DeferredTransfers final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string name() const override { return "deferred-transfers"; }
  TransferTicket transfer(void* dst, const void* src, size_t bytes, CopyKind) override {
    pending_.push_back({next_, dst, src, bytes});
    return {next_++};
  }
  void compute_waits(TransferTicket t) override { land(t.id); }
  void host_waits(TransferTicket t) override { land(t.id); }
  void synchronize() override { land(next_); }
  size_t pending() const { return pending_.size(); }

 private:
  struct Copy {
    uint64_t id;
    void* dst;
    const void* src;
    size_t bytes;
  };
  void land(uint64_t id) {
    while (!pending_.empty() && pending_.front().id <= id) {
      std::memcpy(pending_.front().dst, pending_.front().src, pending_.front().bytes);
      pending_.pop_front();
    }
  }
  std::deque<Copy> pending_;
  uint64_t next_ = 1;
};

// Counts the linears the CPU side runs.
class CountingCpu final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string name() const override { return "counting-cpu"; }
  void linear(const float* x, int64_t m, const Tensor& w, const float* b, float* y) override {
    ++linears;
    inner_.linear(x, m, w, b, y);
  }
  int64_t linears = 0;
};

// Rows [r0, r0 + n) of the values `v` ([*, in] row-major) as a tensor of `dtype` (kQ4:
// quantised along rows by groups of 64, so rows quantise alone and a slice of a quantised
// matrix is the quantised slice).
OwnedTensor make_rows(const std::vector<float>& v, int64_t r0, int64_t n, int64_t in, DType dtype) {
  OwnedTensor t(dtype, Shape{n, in});
  const float* src = v.data() + r0 * in;
  if (n == 0) return t;
  if (dtype == DType::kQ4) {
    write_q4_blob(quantize_4bit(src, QuantLayout{n, in, kQuantGroupSize, QuantAxis::kAlongRow}),
                  t.view.data);
  } else {
    convert_from_f32(dtype, src, t.view.data, static_cast<size_t>(n * in));
  }
  return t;
}

TEST(SplitLinear, GpuRowsAreCeilAlphaTimesOut) {
  // Worked by hand: ceil(0.3 x 37) = ceil(11.1) = 12, ceil(0.5 x 37) = ceil(18.5) = 19,
  // ceil(0.77 x 37) = ceil(28.49) = 29.
  EXPECT_EQ(split_gpu_rows(0.0, 37), 0);
  EXPECT_EQ(split_gpu_rows(0.3, 37), 12);
  EXPECT_EQ(split_gpu_rows(0.5, 37), 19);
  EXPECT_EQ(split_gpu_rows(0.77, 37), 29);
  EXPECT_EQ(split_gpu_rows(1.0, 37), 37);
  EXPECT_EQ(split_gpu_rows(0.5, 64), 32);
  // 0.3 x 10 is 3.0000000000000004 in doubles: still 3 rows, not 4.
  EXPECT_EQ(split_gpu_rows(0.3, 10), 3);
  EXPECT_EQ(split_gpu_rows(0.01, 1), 1);
}

struct Case {
  int64_t out, in;
  DType dtype;
  bool bias;
};

// The split linear (on `gpu` and `cpu`) against two references, with guard bytes around y:
//  - each share's rows cut from the values here, each run through the CPU backend's linear
//    alone and joined by hand: equal bit for bit at every row count (the split's slicing,
//    bias halves, transfers and join);
//  - the unsplit linear: equal bit for bit on the decode path (<= kGemvMaxRows rows: the GEMV
//    and 4-bit kernels give each weight row one accumulator, whatever rows share its tile).
//    On the GEMM path OpenBLAS's sgemm (0.3.21, Haswell kernels here) sums an element in an
//    order that depends on where its column falls in the kernel's tiles of the output width,
//    so a narrower matrix may round differently in the last bit: there, within rounding.
void expect_split_matches(const Case& k, double alpha, int64_t m, Backend& gpu, CpuBackend& cpu) {
  SCOPED_TRACE(::testing::Message() << dtype_name(k.dtype) << " [" << k.out << ", " << k.in
                                    << "] bias " << k.bias << " alpha " << alpha << " m " << m);
  const std::vector<float> wv = random_floats(static_cast<size_t>(k.out * k.in), 7);
  const OwnedTensor w = make_rows(wv, 0, k.out, k.in, k.dtype);
  const std::vector<float> bias = random_floats(static_cast<size_t>(k.out), 99);
  OwnedTensor b;
  if (k.bias) {
    b = OwnedTensor(DType::kF32, Shape{k.out});
    std::memcpy(b.view.data, bias.data(), bias.size() * sizeof(float));
  }
  const std::vector<float> x = random_floats(static_cast<size_t>(m * k.in), 1234);

  Guarded<float> whole(static_cast<size_t>(m * k.out), NAN);
  cpu.linear(x.data(), m, w.view, k.bias ? bias.data() : nullptr, whole.data());
  const int64_t g = split_gpu_rows(alpha, k.out), c = k.out - g;
  std::vector<float> shares(static_cast<size_t>(m * k.out)), part;
  for (const auto& [r0, n] : {std::pair{int64_t{0}, g}, std::pair{g, c}}) {
    if (n == 0) continue;
    const OwnedTensor rows = make_rows(wv, r0, n, k.in, k.dtype);
    part.assign(static_cast<size_t>(m * n), NAN);
    cpu.linear(x.data(), m, rows.view, k.bias ? bias.data() + r0 : nullptr, part.data());
    for (int64_t r = 0; r < m; ++r)
      std::copy_n(part.begin() + r * n, n, shares.begin() + r * k.out + r0);
  }

  const SplitLinearWeights split(w.view, b.view, alpha, gpu, cpu);
  ASSERT_EQ(split.gpu_rows(), g);
  ASSERT_EQ(split.cpu_rows(), c);
  SplitLinearScratch scratch(gpu, 64, k.in, k.out);
  Guarded<float> got(static_cast<size_t>(m * k.out), NAN);
  // Twice: the second call reuses staging the first one left (its upload must have landed).
  for (int rep = 0; rep < 2; ++rep) {
    std::fill(got.data(), got.data() + got.size(), NAN);
    split_linear(split, x.data(), m, got.data(), gpu, cpu, scratch);
    ASSERT_TRUE(got.guards_intact());
    for (size_t i = 0; i < got.size(); ++i) {
      const int64_t row = static_cast<int64_t>(i) / k.out, col = static_cast<int64_t>(i) % k.out;
      const char* side = col < g ? " (gpu share)" : " (cpu share)";
      ASSERT_EQ(std::memcmp(&got[i], &shares[i], sizeof(float)), 0)
          << "y[" << row << ", " << col << "] = " << got[i] << ", shares alone " << shares[i]
          << side << " rep " << rep;
      if (m <= kGemvMaxRows) {
        ASSERT_EQ(std::memcmp(&got[i], &whole[i], sizeof(float)), 0)
            << "y[" << row << ", " << col << "] = " << got[i] << ", unsplit " << whole[i] << side;
      } else {
        // Two summation orders of `in` products differ by at most ~in x eps x sum |x w|.
        double mag = std::fabs(k.bias ? bias[static_cast<size_t>(col)] : 0.0f);
        for (int64_t j = 0; j < k.in; ++j)
          mag += std::fabs(x[static_cast<size_t>(row * k.in + j)] *
                           wv[static_cast<size_t>(col * k.in + j)]);
        ASSERT_NEAR(got[i], whole[i], static_cast<double>(k.in) * 1.2e-7 * mag)
            << "y[" << row << ", " << col << "]" << side;
      }
    }
  }
}

const double kAlphas[] = {0.0, 0.3, 0.5, 0.77, 1.0};
// 1: decode at batch 1 (shares written straight into y); 3: a GEMV tile tail; 17 and 40: the
// GEMM path (more than kGemvMaxRows rows).
const int64_t kRows[] = {1, 3, 17, 40};

TEST(SplitLinear, F32OddShapesMatchUnsplit) {
  CpuBackend gpu(2), cpu(2);
  for (const Case& k : {Case{37, 19, DType::kF32, true}, Case{37, 19, DType::kF32, false},
                        Case{5, 70, DType::kF32, true}, Case{64, 64, DType::kF32, false}})
    for (double alpha : kAlphas)
      for (int64_t m : kRows) expect_split_matches(k, alpha, m, gpu, cpu);
}

TEST(SplitLinear, HalfAndFourBitMatchUnsplit) {
  CpuBackend gpu(2), cpu(2);
  for (const Case& k : {Case{45, 128, DType::kQ4, true}, Case{37, 64, DType::kQ4, false},
                        Case{33, 40, DType::kF16, true}, Case{33, 40, DType::kBF16, false}})
    for (double alpha : kAlphas)
      for (int64_t m : kRows) expect_split_matches(k, alpha, m, gpu, cpu);
}

TEST(SplitLinear, WaitsForEveryTransfer) {
  CpuBackend inner(2), cpu(2);
  DeferredTransfers gpu(inner);
  for (const Case& k : {Case{37, 19, DType::kF32, true}, Case{45, 128, DType::kQ4, true}})
    for (double alpha : kAlphas)
      for (int64_t m : kRows) expect_split_matches(k, alpha, m, gpu, cpu);
  EXPECT_EQ(gpu.pending(), 0u);
}

// The 4-bit halves are the original rows: codes, mins and scales each cut at the split row.
TEST(SplitLinear, FourBitHalvesHoldTheOriginalRows) {
  CpuBackend gpu(2), cpu(2);
  const OwnedTensor w = make_rows(random_floats(45 * 128, 5), 0, 45, 128, DType::kQ4);
  const SplitLinearWeights split(w.view, Tensor{}, 0.3, gpu, cpu);  // 14 + 31 rows
  ASSERT_EQ(split.gpu_rows(), 14);
  ASSERT_EQ(split.cpu_weight().bytes(), 31u * (64 + 2 * 2 * 4));
  std::vector<float> whole(45 * 128), top(14 * 128), bottom(31 * 128);
  dequantize_rows(q4_view(w.view), 0, 45, whole.data());
  dequantize_rows(q4_view(split.gpu_weight()), 0, 14, top.data());
  dequantize_rows(q4_view(split.cpu_weight()), 0, 31, bottom.data());
  EXPECT_EQ(0, std::memcmp(top.data(), whole.data(), top.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(bottom.data(), whole.data() + 14 * 128, bottom.size() * sizeof(float)));
}

TEST(SplitLinear, BadInputIsNamed) {
  CpuBackend gpu(2), cpu(2);
  const OwnedTensor w = make_rows(random_floats(64, 1), 0, 8, 8, DType::kF32);
  try {
    SplitLinearWeights(w.view, Tensor{}, 1.5, gpu, cpu);
    ADD_FAILURE() << "alpha 1.5 accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("alpha must be in [0, 1], got 1.5"), std::string::npos);
  }
  Tensor on_disk = w.view;
  on_disk.data = nullptr;
  EXPECT_THROW(SplitLinearWeights(on_disk, Tensor{}, 0.5, gpu, cpu), InputError);
  hetegen::HeteGenOptions o;
  o.enabled = true;
  o.alpha = -0.5;
  EXPECT_THROW(SplitLinearTable({}, o, gpu, cpu, 4), InputError);
}

// --- whole models --------------------------------------------------------------------------

GenerationRequest greedy(std::string id, std::vector<int32_t> prompt, int32_t tokens) {
  GenerationRequest q;
  q.id = std::move(id);
  q.prompt_ids = std::move(prompt);
  q.max_new_tokens = tokens;
  return q;
}

std::vector<std::vector<int32_t>> run_ids(Model& model, const std::vector<GenerationRequest>& reqs,
                                          int32_t batch) {
  LocalCluster gen(model, LocalOptions{batch, model.max_rows(), 0});
  std::vector<std::vector<int32_t>> out;
  for (const auto& r : gen.run(reqs)) out.push_back(r.output_ids);
  return out;
}

int count_dtype(const Model& m, DType dtype) {
  int n = 0;
  for (const LayerWeights& L : m.weights().layers)
    for (int s = 0; s < kLinearSlots; ++s)
      n += slot_weight(L, static_cast<LinearSlot>(s)).dtype == dtype;
  return n;
}

// Every layer linear split at each alpha; the greedy ids of one-at-a-time and batched runs
// (prefill over many rows, decode over one and several) must be the unsplit run's. One
// forward step also counts the CPU side's linears: every split linear, once per layer.
void expect_splits_keep_ids(Model& model, const std::vector<GenerationRequest>& reqs,
                            int linears_per_layer, std::span<const double> alphas = kAlphas) {
  const auto one = run_ids(model, reqs, 1);
  const auto many = run_ids(model, reqs, 8);
  for (size_t i = 0; i < reqs.size(); ++i)
    ASSERT_EQ(one[i].size(), static_cast<size_t>(reqs[i].max_new_tokens)) << reqs[i].id;
  CpuBackend cpu_inner(2);
  for (double alpha : alphas) {
    SCOPED_TRACE(::testing::Message() << "alpha " << alpha);
    CountingCpu cpu(cpu_inner);
    hetegen::HeteGenOptions o;
    o.enabled = true;
    o.alpha = alpha;
    SplitLinearTable table(model.weights().layers, o, model.backend(), cpu, model.max_rows());
    model.set_split_linears(&table);
    EXPECT_EQ(run_ids(model, reqs, 1), one);
    EXPECT_EQ(run_ids(model, reqs, 8), many);

    auto cache = model.make_cache(1, 8);
    StepBatch step;
    step.add(0, 0, std::vector<int32_t>{1, 5, 9}, true);
    std::vector<float> logits(static_cast<size_t>(model.config().vocab));
    cpu.linears = 0;
    model.forward(step, *cache, logits.data());
    // alpha 1 leaves the CPU nothing; otherwise every linear of every layer has a CPU share
    // (the smallest has 32 rows, so even alpha 0.77 leaves it 7).
    EXPECT_EQ(cpu.linears, alpha == 1.0 ? 0 : linears_per_layer * model.config().n_layers);
    model.set_split_linears(nullptr);
  }
}

TEST(SplitLinearModel, Stories260KGreedyIdsUnchanged) {
  const auto refs = testing::load_stories_references();
  ASSERT_FALSE(refs.empty());
  std::vector<GenerationRequest> reqs;
  for (const auto& r : refs)
    reqs.push_back(greedy(r.name, r.prompt_ids, static_cast<int32_t>(r.output_ids.size())));
  CpuBackend gpu(2);
  LoadedModel m = load_model(testing::stories_dir(), row_major());
  Model model(m.config, std::move(m.weights), gpu, 512);
  // Unsplit, the ids are llama2.c's; split they must stay so.
  const auto base = run_ids(model, reqs, 1);
  for (size_t i = 0; i < refs.size(); ++i) ASSERT_EQ(base[i], refs[i].output_ids) << refs[i].name;
  expect_splits_keep_ids(model, reqs, 7);
}

TEST(SplitLinearModel, Stories260KFourBitGreedyIdsUnchanged) {
  const auto refs = testing::load_stories_references();
  std::vector<GenerationRequest> reqs;
  for (const auto& r : refs) reqs.push_back(greedy(r.name, r.prompt_ids, 24));
  CpuBackend gpu(2);
  LoadOptions lo = row_major();
  lo.compress_weight = true;
  LoadedModel m = load_model(testing::stories_dir(), lo);
  Model model(m.config, std::move(m.weights), gpu, 512);
  // q, k, v, o, gate, up have 64 columns and go 4-bit; down's 172 do not split into groups.
  ASSERT_EQ(count_dtype(model, DType::kQ4), 6 * model.config().n_layers);
  expect_splits_keep_ids(model, reqs, 7);
}

// OPT: biases on every linear, fc1 / fc2 without a gate, LayerNorm; prompts over 16 tokens
// take the GEMM path in prefill.
std::vector<GenerationRequest> opt_requests() {
  std::vector<int32_t> longer;
  for (int32_t t = 0; t < 21; ++t) longer.push_back(2 + 37 * t);
  return {greedy("a", {2, 100, 200, 300}, 5), greedy("b", longer, 5), greedy("c", {2, 7}, 5)};
}

// 0 and 1 are covered on stories260K; a 50k-word f32 head makes each OPT run cost.
const double kOptAlphas[] = {0.3, 0.5, 0.77};

// The first 3 of dummy:opt-125m's 12 layers (with its embeddings and head) keep the test short.
LoadOptions opt_options(bool compress) {
  LoadOptions lo = row_major();
  lo.layer_end = 3;
  lo.compress_weight = compress;
  return lo;
}

TEST(SplitLinearModel, DummyOptGreedyIdsUnchanged) {
  CpuBackend gpu(2);
  LoadedModel m = load_model("dummy:opt-125m", opt_options(false));
  Model model(m.config, std::move(m.weights), gpu, 64);
  expect_splits_keep_ids(model, opt_requests(), 6, kOptAlphas);
}

TEST(SplitLinearModel, DummyOptFourBitGreedyIdsUnchanged) {
  CpuBackend gpu(2);
  LoadedModel m = load_model("dummy:opt-125m", opt_options(true));
  Model model(m.config, std::move(m.weights), gpu, 64);
  ASSERT_EQ(count_dtype(model, DType::kQ4), 6 * model.config().n_layers);
  expect_splits_keep_ids(model, opt_requests(), 6, kOptAlphas);
}

TEST(SplitLinearModel, TableNamesItsSplitsAndTheirMemory) {
  CpuBackend gpu(2), cpu(2);
  LoadedModel m = load_model(testing::stories_dir(), row_major());
  Model model(m.config, std::move(m.weights), gpu, 16);
  // Only the MLP's up and down split, at different alphas: the others run unsplit.
  SplitLinearTable table(
      model.weights().layers,
      [](int32_t, LinearSlot s) {
        return s == LinearSlot::kUp ? 0.5 : s == LinearSlot::kDown ? 0.25 : -1.0;
      },
      gpu, cpu, 16);
  EXPECT_EQ(table.find(0, LinearSlot::kQ), nullptr);
  ASSERT_NE(table.find(4, LinearSlot::kUp), nullptr);
  EXPECT_EQ(table.find(4, LinearSlot::kUp)->gpu_rows(), 86);    // ceil(0.5 x 172)
  EXPECT_EQ(table.find(4, LinearSlot::kDown)->gpu_rows(), 16);  // ceil(0.25 x 64)
  EXPECT_NE(table.str().find("layer 4: up 86+86 (alpha 0.500) down 16+48 (alpha 0.250)"),
            std::string::npos)
      << table.str();
  // Weights: up [172, 64] and down [64, 172] f32 per layer, 5 layers, split between the sides.
  const TierBytes mem = table.memory();
  const int64_t staging_gpu = 16 * 172 * 4, staging_cpu = 16 * 172 * 4 * 2;
  EXPECT_EQ(mem.gpu - staging_gpu, 5 * (86 * 64 + 16 * 172) * 4);
  EXPECT_EQ(mem.cpu - staging_cpu, 5 * (86 * 64 + 48 * 172) * 4);
  EXPECT_EQ(hetegen_module_name(3, LinearSlot::kDown), "layer.3.down");
}

// Records what it allocates and counts each transfer that reads or writes past the end of
// the allocation its pointer lies in (the allocator rounds host memory up to whole pages, so
// a small overrun would go unseen by the sanitizers).
class BoundedTransferBackend final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  std::string name() const override { return "bounded-transfers"; }
  void* allocate(size_t bytes) override { return record(inner_.allocate(bytes), bytes); }
  void* allocate_host(size_t bytes) override { return record(inner_.allocate_host(bytes), bytes); }
  TransferTicket transfer(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    if (!fits(dst, bytes) || !fits(src, bytes)) ++overruns;
    return inner_.transfer(dst, src, bytes, kind);
  }
  int overruns = 0;

 private:
  void* record(void* p, size_t bytes) {
    sizes_[static_cast<const std::byte*>(p)] = bytes;
    return p;
  }
  bool fits(const void* p, size_t bytes) const {
    const auto* b = static_cast<const std::byte*>(p);
    auto it = sizes_.upper_bound(b);
    if (it == sizes_.begin()) return false;
    --it;
    return b + bytes <= it->first + it->second;
  }
  std::map<const std::byte*, size_t> sizes_;
};

// The alpha benchmark copies each alpha share into buffers that hold it, bias rows included:
// an OPT module has a bias, and at alpha 1 the share is the whole matrix and all its bias.
TEST(AlphaBenchmark, EveryShareFitsTheBuffersItIsCopiedBetween) {
  CpuBackend inner(1);
  CpuBackend cpu(1);
  BoundedTransferBackend device(inner);
  for (const DType dtype : {DType::kF32, DType::kF16, DType::kQ4}) {
    for (const bool bias : {false, true}) {
      const ModuleShapeKey shape{96, 128, dtype, bias};
      SCOPED_TRACE(shape.str());
      auto measure = module_alpha_measure(device, cpu, shape, 1, 1);
      for (const double alpha : {0.0, 0.3, 1.0}) {
        const hetegen::AlphaTiming t = measure(alpha);
        EXPECT_EQ(t.t_trans > 0, alpha > 0) << alpha;
        EXPECT_EQ(t.t_cpu > 0, alpha < 1) << alpha;
      }
      EXPECT_EQ(device.overruns, 0);
    }
  }
}

}  // namespace
}  // namespace strata
