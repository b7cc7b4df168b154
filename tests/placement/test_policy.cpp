// FlexGen's policy struct: printing in FlexGen's tuple style, the compact command-line form
// and its refusals, each naming the key, the value and what is allowed.
#include <gtest/gtest.h>

#include <string>

#include "kernels/error.h"
#include "placement/policy.h"

namespace strata {
namespace {

std::string parse_error(const std::string& text) {
  try {
    Policy::parse(text);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

std::string validate_error(const Policy& p) {
  try {
    p.validate();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

// FlexGen's policy for OPT-30B on the T4 machine (Tables 4, 15, 21).
Policy paper_opt30b() {
  Policy p;
  p.gpu_batch_size = 48;
  p.num_gpu_batches = 3;
  p.w_gpu_percent = 20;
  p.w_cpu_percent = 80;
  p.cache_gpu_percent = 0;
  p.cache_cpu_percent = 100;
  p.act_gpu_percent = 0;
  p.act_cpu_percent = 100;
  p.cpu_cache_compute = true;
  return p;
}

TEST(Policy, DefaultKeepsEverythingOnTheGpu) {
  const Policy p;
  EXPECT_EQ(p.block_size(), 1);
  EXPECT_EQ(p.w_disk_percent(), 0);
  EXPECT_EQ(p.cache_disk_percent(), 0);
  EXPECT_EQ(p.act_disk_percent(), 0);
  EXPECT_NO_THROW(p.validate());
}

TEST(Policy, BlockSizeIsGpuBatchSizeTimesNumberOfGpuBatches) {
  EXPECT_EQ(paper_opt30b().block_size(), 144);
}

TEST(Policy, DiskSharesAreTheRest) {
  Policy p;
  p.w_gpu_percent = 0, p.w_cpu_percent = 50;
  p.cache_gpu_percent = 10, p.cache_cpu_percent = 20;
  p.act_gpu_percent = 0, p.act_cpu_percent = 100;
  EXPECT_EQ(p.w_disk_percent(), 50);
  EXPECT_EQ(p.cache_disk_percent(), 70);
  EXPECT_EQ(p.act_disk_percent(), 0);
}

TEST(Policy, StrIsFlexGenTupleStyle) {
  EXPECT_EQ(paper_opt30b().str(),
            "Policy(gpu_batch_size=48, num_gpu_batches=3, w=(20,80,0), c=(0,100,0), "
            "h=(0,100,0), compress_weight=0, compress_cache=0, cpu_attention=1, overlap=1)");
}

TEST(Policy, ParsesTheCompactForm) {
  EXPECT_EQ(Policy::parse("gbs=48,ngb=3,w=20/80/0,c=0/100/0,h=0/100/0,cpu_attn=1"), paper_opt30b());
}

TEST(Policy, ParseAllowsSpacesAndAnyKeyOrder) {
  EXPECT_EQ(Policy::parse(" cpu_attn=1, h = 0/100/0 ,c=0/100/0, w=20/80/0, ngb=3, gbs=48 "),
            paper_opt30b());
}

TEST(Policy, ParseKeepsDefaultsForKeysLeftOut) {
  const Policy p = Policy::parse("gbs=8");
  Policy expected;
  expected.gpu_batch_size = 8;
  EXPECT_EQ(p, expected);
}

TEST(Policy, ParseReadsEveryFlag) {
  const Policy p = Policy::parse("cw=1,cc=1,cpu_attn=0,overlap=0");
  EXPECT_TRUE(p.compress_weight);
  EXPECT_TRUE(p.compress_cache);
  EXPECT_FALSE(p.cpu_cache_compute);
  EXPECT_FALSE(p.overlap);
}

TEST(Policy, CompactRoundTripsThroughParse) {
  Policy p = paper_opt30b();
  p.w_gpu_percent = 5, p.w_cpu_percent = 60;  // 35 on disk
  p.cache_gpu_percent = 1, p.cache_cpu_percent = 2;
  p.act_gpu_percent = 33, p.act_cpu_percent = 0;
  p.compress_weight = true;
  p.overlap = false;
  EXPECT_EQ(p.compact(),
            "gbs=48,ngb=3,w=5/60/35,c=1/2/97,h=33/0/67,cw=1,cc=0,cpu_attn=1,overlap=0");
  EXPECT_EQ(Policy::parse(p.compact()), p);
}

TEST(Policy, PieAndHeteGenRoundTripAndAreOffByDefault) {
  EXPECT_EQ(Policy{}.pie_host_layers, 0);
  EXPECT_EQ(Policy{}.hetegen_alpha_percent, 0);
  EXPECT_EQ(Policy{}.compact().find("pie"), std::string::npos);
  EXPECT_EQ(Policy{}.compact().find("hetegen"), std::string::npos);
  const Policy p = Policy::parse("gbs=4,w=20/80/0,c=100/0/0,pie=3,hetegen=45");
  EXPECT_EQ(p.pie_host_layers, 3);
  EXPECT_EQ(p.hetegen_alpha_percent, 45);
  EXPECT_EQ(p.compact(),
            "gbs=4,w=20/80/0,c=100/0/0,h=100/0/0,cw=0,cc=0,cpu_attn=0,overlap=1,pie=3,hetegen=45");
  EXPECT_EQ(Policy::parse(p.compact()), p);
  EXPECT_NE(p.str().find("pie_host_layers=3, hetegen_alpha_percent=45)"), std::string::npos)
      << p.str();
}

TEST(Policy, HalfCacheRoundTripsIsOffByDefaultAndExcludesCompression) {
  EXPECT_FALSE(Policy{}.cache_f16);
  EXPECT_EQ(Policy{}.compact().find("cf16"), std::string::npos);
  const Policy p = Policy::parse("w=0/100/0,c=0/100/0,cf16=1,cpu_attn=1");
  EXPECT_TRUE(p.cache_f16);
  EXPECT_EQ(p.compact(), "w=0/100/0,c=0/100/0,h=100/0/0,cw=0,cc=0,cpu_attn=1,overlap=1,cf16=1");
  EXPECT_EQ(Policy::parse(p.compact()), p);
  EXPECT_NE(p.str().find("cache_f16=1"), std::string::npos) << p.str();
  EXPECT_FALSE(Policy::parse("cf16=0").cache_f16);
  const std::string e = parse_error("cc=1,cf16=1");
  EXPECT_NE(e.find("compress_cache=1 with cache_f16=1"), std::string::npos) << e;
  EXPECT_NE(parse_error("cf16=2").find("cf16"), std::string::npos);
}

TEST(Policy, PieNeedsTheCacheOnTheGpuTierAndHeteGenAPercentage) {
  EXPECT_NE(parse_error("c=50/50/0,pie=2").find("Pie swaps a cache that lives on the GPU tier"),
            std::string::npos);
  EXPECT_NE(parse_error("pie=-1").find("pie=-1: host layers must be a whole number >= 0"),
            std::string::npos);
  EXPECT_NE(parse_error("hetegen=101").find("hetegen=101: alpha is a percentage in [0, 100]"),
            std::string::npos);
  EXPECT_NE(parse_error("hetegen=0.5").find("is not an integer"), std::string::npos);
}

TEST(Policy, RejectsPercentagesThatDoNotSumTo100) {
  const std::string e = parse_error("w=20/90/0");
  EXPECT_NE(e.find("w=20/90/0"), std::string::npos) << e;
  EXPECT_NE(e.find("sum to 110"), std::string::npos) << e;
  EXPECT_NE(e.find("must sum to 100"), std::string::npos) << e;
}

TEST(Policy, RejectsPercentagesOutsideZeroToHundred) {
  const std::string e = parse_error("c=120/-20/0");
  EXPECT_NE(e.find("c=120/-20/0"), std::string::npos) << e;
  EXPECT_NE(e.find("120 is outside [0, 100]"), std::string::npos) << e;
}

TEST(Policy, RejectsASplitWithoutThreeParts) {
  const std::string e = parse_error("h=20/80");
  EXPECT_NE(e.find("h=20/80"), std::string::npos) << e;
  EXPECT_NE(e.find("three percentages GPU/CPU/DISK"), std::string::npos) << e;
}

TEST(Policy, RejectsNonIntegers) {
  for (const char* text :
       {"gbs=4.5", "gbs=abc", "gbs=", "ngb=+3", "w=20/8O/0", "gbs=99999999999999999999"}) {
    const std::string e = parse_error(text);
    EXPECT_NE(e.find("is not an integer"), std::string::npos) << text << ": " << e;
  }
}

TEST(Policy, RejectsBatchSizesBelowOne) {
  for (const char* text : {"gbs=0", "gbs=-4", "ngb=0"}) {
    const std::string e = parse_error(text);
    EXPECT_NE(e.find(text), std::string::npos) << e;
    EXPECT_NE(e.find("must be a positive integer"), std::string::npos) << e;
  }
}

TEST(Policy, RejectsUnknownKeysListingTheAllowedOnes) {
  const std::string e = parse_error("gbs=4,wg=20");
  EXPECT_NE(e.find("unknown key 'wg'"), std::string::npos) << e;
  EXPECT_NE(e.find("gbs, ngb, w, c, h, cw, cc, cf16, cpu_attn, overlap"), std::string::npos) << e;
}

TEST(Policy, RejectsFlagsOtherThanZeroOrOne) {
  const std::string e = parse_error("cpu_attn=yes");
  EXPECT_NE(e.find("cpu_attn=yes"), std::string::npos) << e;
  EXPECT_NE(e.find("must be 0 or 1"), std::string::npos) << e;
}

TEST(Policy, RejectsRepeatedKeysItemsWithoutEqualsAndEmptyText) {
  EXPECT_NE(parse_error("gbs=4,gbs=8").find("given twice"), std::string::npos);
  EXPECT_NE(parse_error("gbs4").find("'gbs4' is not key=value"), std::string::npos);
  EXPECT_NE(parse_error("gbs=4,,ngb=2").find("is not key=value"), std::string::npos);
  EXPECT_NE(parse_error("  ").find("empty"), std::string::npos);
}

TEST(Policy, RejectsCompressedCacheWithCpuAttention) {
  const std::string e = parse_error("cc=1,cpu_attn=1");
  EXPECT_NE(e.find("compress_cache=1 with cpu_attention=1"), std::string::npos) << e;
  EXPECT_NO_THROW(Policy::parse("cc=1,cpu_attn=0"));
  EXPECT_NO_THROW(Policy::parse("cw=1,cpu_attn=1"));
}

TEST(Policy, ValidateChecksAStructBuiltInCode) {
  Policy p;
  p.w_gpu_percent = 60, p.w_cpu_percent = 50;
  EXPECT_NE(validate_error(p).find("w=(60,50,-10)"), std::string::npos) << validate_error(p);
  p = Policy{};
  p.act_cpu_percent = -1, p.act_gpu_percent = 0;
  EXPECT_NE(validate_error(p).find("h=(0,-1,101)"), std::string::npos) << validate_error(p);
  p = Policy{};
  p.gpu_batch_size = 0;
  EXPECT_NE(validate_error(p).find("gpu_batch_size=0"), std::string::npos);
  p = Policy{};
  p.num_gpu_batches = Policy::kMaxBatch + 1;
  EXPECT_NE(validate_error(p).find("num_gpu_batches"), std::string::npos);
}

TEST(Policy, TheBlockIsOptionalAndReadNotReparsed) {
  const Policy none = Policy::parse("w=20/80/0");
  EXPECT_FALSE(none.gpu_batch_size.has_value());
  EXPECT_FALSE(none.num_gpu_batches.has_value());
  EXPECT_FALSE(none.names_block());
  EXPECT_EQ(none.block_size(), 1);
  const Policy ngb = Policy::parse("ngb=3");
  EXPECT_TRUE(ngb.names_block());
  EXPECT_FALSE(ngb.gpu_batch_size.has_value());
  EXPECT_EQ(ngb.block_size(), 3);
  // compact() names only what was given, so it parses back to the same policy.
  EXPECT_EQ(none.compact().find("gbs="), std::string::npos) << none.compact();
  EXPECT_EQ(Policy::parse(none.compact()), none);
  EXPECT_EQ(Policy::parse(ngb.compact()), ngb);
  EXPECT_EQ(Policy::parse(paper_opt30b().compact()), paper_opt30b());
}

}  // namespace
}  // namespace strata
