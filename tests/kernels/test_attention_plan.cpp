// The tiled attention's launch decisions (kernels/cuda/cuda_kernels.h plan_attention), host
// code that runs without a GPU: which rows and heads a block takes, the key tile, and how
// many blocks split one context, each against a hand calculation from the rules in its
// comments; and that no tiling it makes asks for more than the 48 KiB of shared memory a
// launch gets without an opt-in.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace strata::cuda_kernels {
namespace {

constexpr int32_t kSms = 132;  // an H100
constexpr size_t kKiB = 1024;

// Llama-70B's heads, one decode row at 3000 positions: group 8, one block of the
// warps-over-keys kernel per kv head, 8 blocks. Eight per SM wants ceil(1056 / 8) = 132
// splits, the context allows ceil(3000 / 32) = 94 (one key tile each), at most 64, and
// 512 KiB of scratch holds 524288 / (1 * 64 * 130 * 4) = 15. A split of 15 is
// ceil(3000 / 15) = 200 keys, 224 in whole tiles of 32, so ceil(3000 / 224) = 14 splits.
TEST(AttentionPlan, OneLongDecodeRowSplitsWithinTheScratch) {
  const AttentionTiling t = plan_attention(1, 1, 3000, 64, 8, 128, kSms, 512 * kKiB);
  EXPECT_TRUE(t.decode_warps);
  EXPECT_EQ(t.heads_per_block, 8);
  EXPECT_EQ(t.rows_per_tile, 1);
  EXPECT_EQ(t.key_tile, 32);
  EXPECT_EQ(t.splits, 14);
  // With room for all: 64 splits of ceil(3000 / 64) = 47 keys, 64 in whole tiles, so
  // ceil(3000 / 64) = 47.
  EXPECT_EQ(plan_attention(1, 1, 3000, 64, 8, 128, kSms, 64 * kKiB * kKiB).splits, 47);
}

// One decode row of OPT-6.7B (32 MHA heads, head_dim 128) at 528 positions: 32 blocks,
// eight per SM wants ceil(1056 / 32) = 33, the context allows ceil(528 / 32) = 17; 17 splits
// of ceil(528 / 17) = 32 keys are one tile each, so ceil(528 / 32) = 17 splits, 544 blocks.
TEST(AttentionPlan, AShortDecodeContextStillFillsTheGpu) {
  const AttentionTiling t = plan_attention(1, 1, 528, 32, 32, 128, kSms, 4 * kKiB * kKiB);
  EXPECT_TRUE(t.decode_warps);
  EXPECT_EQ(t.splits, 17);
  // The tiled kernel's rule (head_dim 96 has no warps-over-keys kernel): four per SM wants
  // ceil(528 / 32) = 17, the context allows floor(528 / 32) = 16; 16 splits of 33 keys are
  // 64 in whole tiles, so ceil(528 / 64) = 9.
  const AttentionTiling tiled = plan_attention(1, 1, 528, 32, 32, 96, kSms, 4 * kKiB * kKiB);
  EXPECT_FALSE(tiled.decode_warps);
  EXPECT_EQ(tiled.splits, 9);
}

// 32 decode rows of a 32q/8kv model at 2048: 32 * 8 = 256 blocks, ceil(1056 / 256) = 5;
// ceil(2048 / 5) = 410 keys, 416 in whole tiles, ceil(2048 / 416) = 5.
TEST(AttentionPlan, ABatchOfDecodeRowsSplitsLess) {
  const AttentionTiling t = plan_attention(32, 32, 2048, 32, 8, 128, kSms, 4 * kKiB * kKiB);
  EXPECT_EQ(t.heads_per_block, 4);
  EXPECT_EQ(t.rows_per_tile, 1);
  EXPECT_EQ(t.splits, 5);
}

TEST(AttentionPlan, NoSplitWithoutScratchOrSmCount) {
  EXPECT_EQ(plan_attention(1, 1, 3000, 64, 8, 128, kSms, 0).splits, 1);
  EXPECT_EQ(plan_attention(1, 1, 3000, 64, 8, 128, 0, 512 * kKiB).splits, 1);
  // The warps-over-keys kernel splits down to one tile: 40 keys are ceil(40 / 32) = 2
  // splits, 100 keys 4 of 25, one tile of 32 each, ceil(100 / 32) = 4.
  EXPECT_EQ(plan_attention(1, 1, 40, 64, 8, 128, kSms, 512 * kKiB).splits, 2);
  EXPECT_EQ(plan_attention(1, 1, 100, 64, 8, 128, kSms, 512 * kKiB).splits, 4);
  // The tiled kernel (head_dim 96) makes no second split below two whole tiles (40 / 32 =
  // 1); 100 keys make 3 of at most 34, 64 in whole tiles: 2.
  EXPECT_EQ(plan_attention(1, 1, 40, 64, 8, 96, kSms, 512 * kKiB).splits, 1);
  EXPECT_EQ(plan_attention(1, 1, 100, 64, 8, 96, kSms, 512 * kKiB).splits, 2);
}

// The warps-over-keys kernel exists for head_dim 64 and 128 and groups of 1, 2, 4 and 8;
// it takes decode rows only, a whole group a block.
TEST(AttentionPlan, WarpsOverKeysOnlyWhereTheyHaveAKernel) {
  for (int32_t hd : {64, 128})
    for (int32_t group : {1, 2, 4, 8}) {
      const AttentionTiling t = plan_attention(3, 3, 700, 8 * group, 8, hd, kSms, 1 << 20);
      EXPECT_TRUE(t.decode_warps) << hd << " " << group;
      EXPECT_EQ(t.heads_per_block, group);
    }
  EXPECT_FALSE(plan_attention(3, 3, 700, 24, 8, 128, kSms, 1 << 20).decode_warps);   // group 3
  EXPECT_FALSE(plan_attention(3, 3, 700, 128, 8, 128, kSms, 1 << 20).decode_warps);  // 16
  EXPECT_FALSE(plan_attention(3, 3, 700, 32, 8, 96, kSms, 1 << 20).decode_warps);
  EXPECT_FALSE(plan_attention(3, 3, 700, 32, 8, 256, kSms, 1 << 20).decode_warps);
  EXPECT_FALSE(plan_attention(40, 2, 700, 32, 8, 128, kSms, 1 << 20).decode_warps);  // prefill
}

// A prefill chunk (more rows than twice its sequences) shares its slot's tiles: 16 query
// rows of head_dim 128 a block, so 16 token rows of one MHA head or 4 of a group of 4.
TEST(AttentionPlan, PrefillRowsShareABlockAndNeverSplit) {
  const AttentionTiling mha = plan_attention(512, 1, 512, 32, 32, 128, kSms, 512 * kKiB);
  EXPECT_EQ(mha.heads_per_block, 1);
  EXPECT_EQ(mha.rows_per_tile, 16);
  EXPECT_EQ(mha.splits, 1);
  const AttentionTiling gqa = plan_attention(40, 2, 1040, 32, 8, 128, kSms, 512 * kKiB);
  EXPECT_EQ(gqa.heads_per_block, 4);
  EXPECT_EQ(gqa.rows_per_tile, 4);
  EXPECT_EQ(gqa.splits, 1);
  // Two rows per sequence still count as decode rows.
  EXPECT_EQ(plan_attention(8, 4, 64, 4, 2, 8, kSms, 0).rows_per_tile, 1);
}

// 32 query heads on one kv head: two blocks of 16 heads each.
TEST(AttentionPlan, AGroupLargerThanABlockIsCutInTwo) {
  const AttentionTiling t = plan_attention(4, 4, 2048, 32, 1, 64, kSms, 0);
  EXPECT_EQ(t.heads_per_block, 16);
  EXPECT_EQ(t.rows_per_tile, 1);
}

// The key tile shrinks with head_dim so a tile stays 4096 floats; query rows a block takes
// shrink so they hold 2048 outputs.
TEST(AttentionPlan, TilesFollowTheHeadDim) {
  const AttentionTiling h512 = plan_attention(64, 1, 64, 4, 2, 512, kSms, 0);
  EXPECT_EQ(h512.key_tile, 8);
  EXPECT_EQ(h512.heads_per_block * h512.rows_per_tile, 4);  // 2048 / 512
  const AttentionTiling h200 = plan_attention(64, 1, 64, 4, 2, 200, kSms, 0);
  EXPECT_EQ(h200.key_tile, 16);
  EXPECT_EQ(h200.heads_per_block * h200.rows_per_tile, 10);  // 2 heads x 5 rows (of 2048 / 200)
  const AttentionTiling h33 = plan_attention(64, 1, 64, 6, 3, 33, kSms, 0);
  EXPECT_EQ(h33.key_tile, 32);
  EXPECT_EQ(h33.heads_per_block * h33.rows_per_tile, 16);
}

// Every head_dim the kernel takes, decode and prefill, MHA to MQA: at most 48 KiB. By hand
// for head_dim 128 prefill (16 query rows, 32 keys): (16 * 128 + 2 * 32 * 129 + 16 * 32 +
// 3 * 16) * 4 = 43456 bytes.
TEST(AttentionPlan, SharedMemoryFitsALaunchForEveryHeadDim) {
  EXPECT_EQ(attention_tiled_shared_bytes(plan_attention(512, 1, 512, 32, 32, 128, kSms, 0), 128),
            43456u);
  for (int32_t hd = 1; hd <= kMaxAttentionHeadDim; ++hd)
    for (int32_t group : {1, 4, 32})
      for (int64_t rows : {int64_t{1}, int64_t{300}}) {
        const AttentionTiling t = plan_attention(rows, 1, 300, group, 1, hd, kSms, 1 << 20);
        EXPECT_LE(attention_tiled_shared_bytes(t, hd), 48 * kKiB)
            << "head_dim " << hd << " group " << group << " rows " << rows;
        EXPECT_LE(t.rows_per_tile * t.heads_per_block * hd, 2048) << hd;
        EXPECT_LE(int64_t{t.key_tile} * hd, 4096) << hd;
      }
}

// Which steps the one-kernel decode attention takes (decode_fusion_fits, host code): the
// warps-over-keys kernel's (head_dim 64 or 128, a group of 1, 2, 4 or 8, decode rows), with
// q and the cache 16-byte aligned, and the new k and v both given, aligned, or neither.
// The pointers are addresses only: nothing reads them.
TEST(AttentionPlan, DecodeFusionFitsOnlyTheWarpsOverKeysKernel) {
  const auto at = [](uintptr_t a) { return reinterpret_cast<float*>(a); };
  const KvCacheDesc cache{at(0x10000), at(0x20000), 8, 128, 0, 0};
  const DecodeFusion both{at(0x30000), at(0x40000), nullptr};
  const AttentionTiling opt = plan_attention(1, 1, 528, 32, 8, 128, kSms, 4 * kKiB * kKiB);
  EXPECT_TRUE(decode_fusion_fits(opt, at(0x50000), cache, 32, both));
  EXPECT_TRUE(decode_fusion_fits(opt, at(0x50000), cache, 32, DecodeFusion{}));
  // One of k and v, or one off 16 bytes: not.
  EXPECT_FALSE(decode_fusion_fits(opt, at(0x50000), cache, 32, {at(0x30000), nullptr, nullptr}));
  EXPECT_FALSE(
      decode_fusion_fits(opt, at(0x50000), cache, 32, {at(0x30004), at(0x40000), nullptr}));
  EXPECT_FALSE(decode_fusion_fits(opt, at(0x50008), cache, 32, both));  // q
  KvCacheDesc off = cache;
  off.v = at(0x20004);
  EXPECT_FALSE(decode_fusion_fits(opt, at(0x50000), off, 32, both));
  // A tiling of the tiled kernel: prefill rows, a group of 16, head_dim 96.
  const AttentionTiling prefill = plan_attention(40, 2, 528, 32, 8, 128, kSms, 4 * kKiB * kKiB);
  EXPECT_FALSE(decode_fusion_fits(prefill, at(0x50000), cache, 32, both));
  const AttentionTiling g16 = plan_attention(1, 1, 528, 128, 8, 128, kSms, 4 * kKiB * kKiB);
  EXPECT_FALSE(decode_fusion_fits(g16, at(0x50000), cache, 128, both));
  KvCacheDesc hd96 = cache;
  hd96.head_dim = 96;
  const AttentionTiling t96 = plan_attention(1, 1, 528, 32, 8, 96, kSms, 4 * kKiB * kKiB);
  EXPECT_FALSE(decode_fusion_fits(t96, at(0x50000), hd96, 32, both));
  // The benchmark switch that keeps decode rows on the tiled kernel.
  const AttentionTiling tiled = plan_attention(1, 1, 528, 32, 8, 128, kSms, 4 * kKiB, false);
  EXPECT_FALSE(decode_fusion_fits(tiled, at(0x50000), cache, 32, both));
  // A tiling made for other heads than the step's: its block would not hold a whole group.
  EXPECT_FALSE(decode_fusion_fits(opt, at(0x50000), cache, 64, both));
}

// Which steps over a 4-bit cache the warps-over-keys kernel takes (takes_q4_decode_kernel,
// host code): decode rows of head_dim 64 or 128 and a group it has, a lane's head_dim / 32
// elements inside one of the cache's groups, q and both blobs 16-byte aligned.
TEST(AttentionPlan, FourBitDecodeKernelTakesWhatItsLanesCanRead) {
  const auto at = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  const float* q = reinterpret_cast<const float*>(uintptr_t{0x50000});
  // OPT-6.7B's decode step: head_dim 128, groups of 64 (KvQ4LayerView::group_for).
  const KvQ4Desc cache{at(0x10000), at(0x20000), 32 * 544, 32, 544, 128, 64, 32 * 544 * 64};
  const AttentionTiling decode = plan_attention(1, 1, 528, 32, 32, 128, kSms, 4 * kKiB * kKiB);
  EXPECT_TRUE(takes_q4_decode_kernel(decode, q, cache, 32));
  KvQ4Desc g = cache;
  for (int32_t group : {4, 8, 32, 128}) {
    g.group = group;
    EXPECT_TRUE(takes_q4_decode_kernel(decode, q, g, 32)) << group;
  }
  g.group = 2;  // a lane's 4 elements would span two groups
  EXPECT_FALSE(takes_q4_decode_kernel(decode, q, g, 32));
  g.group = 6;  // does not divide head_dim
  EXPECT_FALSE(takes_q4_decode_kernel(decode, q, g, 32));
  KvQ4Desc hd64 = cache;  // two elements a lane: groups of 2 are whole
  hd64.head_dim = 64;
  hd64.group = 2;
  const AttentionTiling t64 = plan_attention(1, 1, 528, 32, 32, 64, kSms, 4 * kKiB * kKiB);
  EXPECT_TRUE(takes_q4_decode_kernel(t64, q, hd64, 32));
  KvQ4Desc hd96 = cache;
  hd96.head_dim = 96;
  hd96.group = 48;
  const AttentionTiling t96 = plan_attention(1, 1, 528, 32, 32, 96, kSms, 4 * kKiB * kKiB);
  EXPECT_FALSE(takes_q4_decode_kernel(t96, q, hd96, 32));
  // Prefill rows, the benchmark switch, another step's heads, misaligned pointers: not.
  const AttentionTiling prefill = plan_attention(40, 2, 528, 32, 32, 128, kSms, 4 * kKiB * kKiB);
  EXPECT_FALSE(takes_q4_decode_kernel(prefill, q, cache, 32));
  const AttentionTiling tiled = plan_attention(1, 1, 528, 32, 32, 128, kSms, 4 * kKiB, false);
  EXPECT_FALSE(takes_q4_decode_kernel(tiled, q, cache, 32));
  EXPECT_FALSE(takes_q4_decode_kernel(decode, q, cache, 64));
  EXPECT_FALSE(takes_q4_decode_kernel(decode, q + 1, cache, 32));
  KvQ4Desc off = cache;
  off.v = at(0x20008);
  EXPECT_FALSE(takes_q4_decode_kernel(decode, q, off, 32));
}

// Which 4-bit caches the tiled kernel reads (q4_tiles_fit): each 4 elements of a tile one
// 2-byte load inside one group, so head_dim and the group multiples of 4; aligned blobs.
TEST(AttentionPlan, FourBitTilesNeedQuadsInsideAGroup) {
  const auto at = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  const KvQ4Desc c{at(0x10000), at(0x20000), 64, 2, 32, 160, 40, 64 * 80};
  EXPECT_TRUE(q4_tiles_fit(c));
  KvQ4Desc d = c;
  d.group = 2;
  EXPECT_FALSE(q4_tiles_fit(d));
  d = c;
  d.head_dim = 34;  // group_for(34) = 34: quads would cross rows
  d.group = 34;
  EXPECT_FALSE(q4_tiles_fit(d));
  d = c;
  d.group = 12;  // does not divide 160
  EXPECT_FALSE(q4_tiles_fit(d));
  d = c;
  d.k = at(0x10008);
  EXPECT_FALSE(q4_tiles_fit(d));
}

}  // namespace
}  // namespace strata::cuda_kernels
