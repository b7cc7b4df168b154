// The table of STRATA_* environment variables (kernels/tunables.h): each type's parsing, the
// defaults, the error for a value a tunable does not take, and the table's list of names.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>

#include "kernels/error.h"
#include "kernels/tunables.h"
#include "support/scoped_variable.h"

namespace strata {
namespace {

// The tunable's text before the test (nullopt: unset), which ScopedVariable puts back.
std::optional<std::string> old_text(const std::string& name) {
  for (const Tunable& t : tunables())
    if (!t.family() && t.name == name) return tunable_text(t.id);
  return std::nullopt;
}

// Sets one variable for a test's length and puts the old value back.
struct ScopedVariable : testing::ScopedVariable {
  ScopedVariable(const std::string& name, const char* value)
      : testing::ScopedVariable(name, value, old_text(name)) {}
};

std::string error_of(void (*read)()) {
  try {
    read();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "the read accepted the value";
  return "";
}

// Every variable the tree reads, written out here by hand: a new one joins the table and
// this list together, and `strata limits --tunables` shows it.
TEST(Tunables, TheTableListsEveryName) {
  const std::set<std::string_view> expected = {
      "STRATA_CPU_ISA",         "STRATA_CPU_WEIGHTS",    "STRATA_LOG_LEVEL",
      "STRATA_CUDA_GEMV",       "STRATA_CUDA_EPILOGUE",  "STRATA_CUDA_PDL",
      "STRATA_CUDA_NORM",       "STRATA_CUDA_NORM_ROWS", "STRATA_CUDA_ATTENTION",
      "STRATA_CUDA_DECODE",     "STRATA_LIMIT_<NAME>",   "STRATA_PROFILE_DIR",
      "STRATA_RANK_STATUS_DIR", "STRATA_MPI_VERDICT",    "STRATA_BENCH_THREADS"};
  std::set<std::string_view> names;
  for (size_t i = 0; i < tunables().size(); ++i) {
    const Tunable& t = tunables()[i];
    EXPECT_EQ(static_cast<size_t>(t.id), i) << t.name << ": the id is its row";
    EXPECT_EQ(&tunable(t.id), &t) << t.name;
    EXPECT_TRUE(t.name.starts_with("STRATA_")) << t.name;
    EXPECT_FALSE(t.what.empty()) << t.name;
    EXPECT_TRUE(names.insert(t.name).second) << t.name << " is declared twice";
    EXPECT_EQ(t.type == TunableType::kChoice, !t.choices.empty()) << t.name;
  }
  EXPECT_EQ(names, expected);
}

TEST(Tunables, ChoicesParseToTheirIndexAndUnsetIsTheDefault) {
  const ScopedVariable pdl("STRATA_CUDA_PDL", nullptr);
  EXPECT_EQ(tunable(TunableId::kCudaPdl).choice_list(),
            (std::vector<std::string_view>{"on", "off", "early", "all"}));
  EXPECT_EQ(tunable_choice_if_set(TunableId::kCudaPdl), std::nullopt);
  EXPECT_EQ(tunable_choice(TunableId::kCudaPdl), 0);
  setenv("STRATA_CUDA_PDL", "early", 1);
  EXPECT_EQ(tunable_choice(TunableId::kCudaPdl), 2);
  setenv("STRATA_CUDA_PDL", "", 1);  // empty is unset
  EXPECT_EQ(tunable_choice(TunableId::kCudaPdl), 0);

  const ScopedVariable rows("STRATA_CUDA_NORM_ROWS", "4");
  EXPECT_EQ(tunable_choice(TunableId::kCudaNormRows), 2);
  // A default that is no choice (the CPU's own ISA) leaves the reader to say what unset means.
  const ScopedVariable isa("STRATA_CPU_ISA", nullptr);
  EXPECT_EQ(tunable_choice_if_set(TunableId::kCpuIsa), std::nullopt);
}

TEST(Tunables, AChoiceOutsideTheListNamesTheVariableValueAndChoices) {
  const ScopedVariable weights("STRATA_CPU_WEIGHTS", "columns");
  EXPECT_EQ(error_of([] { (void)tunable_choice(TunableId::kCpuWeights); }),
            "STRATA_CPU_WEIGHTS='columns': expected panels or rows");
  const ScopedVariable isa("STRATA_CPU_ISA", "sse9");
  EXPECT_EQ(error_of([] { (void)tunable_choice_if_set(TunableId::kCpuIsa); }),
            "STRATA_CPU_ISA='sse9': expected portable, avx2 or avx512");
  const ScopedVariable decode("STRATA_CUDA_DECODE", "Fused");  // case matters
  EXPECT_EQ(error_of([] { (void)tunable_choice(TunableId::kCudaDecode); }),
            "STRATA_CUDA_DECODE='Fused': expected apart or fused");
}

TEST(Tunables, WholeNumbersParseAllTheirText) {
  const ScopedVariable threads("STRATA_BENCH_THREADS", nullptr);
  EXPECT_EQ(tunable_int(TunableId::kBenchThreads), 2);
  setenv("STRATA_BENCH_THREADS", "12", 1);
  EXPECT_EQ(tunable_int(TunableId::kBenchThreads), 12);
  for (const char* bad : {"12x", " 12", "1.5", "many", "99999999999999999999"}) {
    setenv("STRATA_BENCH_THREADS", bad, 1);
    EXPECT_EQ(error_of([] { (void)tunable_int(TunableId::kBenchThreads); }),
              std::string("STRATA_BENCH_THREADS='") + bad + "': expected a whole number");
  }
}

TEST(Tunables, AFamilyNamesEachMember) {
  const Tunable& limit = tunable(TunableId::kInputLimit);
  EXPECT_TRUE(limit.family());
  EXPECT_EQ(limit.variable("step_tokens"), "STRATA_LIMIT_STEP_TOKENS");
  const ScopedVariable layers("STRATA_LIMIT_LAYERS", "12");
  const ScopedVariable heads("STRATA_LIMIT_HEADS", "lots");
  EXPECT_EQ(tunable_int_if_set(TunableId::kInputLimit, "layers"), 12);
  EXPECT_EQ(tunable_int_if_set(TunableId::kInputLimit, "vocab"), std::nullopt);
  EXPECT_EQ(error_of([] { (void)tunable_int_if_set(TunableId::kInputLimit, "heads"); }),
            "STRATA_LIMIT_HEADS='lots': expected a whole number");
  const auto set = tunable_family_values(TunableId::kInputLimit);
  EXPECT_NE(std::find(set.begin(), set.end(),
                      std::pair<std::string, std::string>("STRATA_LIMIT_LAYERS", "12")),
            set.end());
}

TEST(Tunables, TextAndPathsAreTheVariablesText) {
  const ScopedVariable dir("STRATA_PROFILE_DIR", "/tmp/profiles here");
  EXPECT_EQ(tunable_text(TunableId::kProfileDir), "/tmp/profiles here");
  const ScopedVariable level("STRATA_LOG_LEVEL", "");
  EXPECT_EQ(tunable_text(TunableId::kLogLevel), std::nullopt);
}

TEST(Tunables, ForeignVariablesAreReadRawAndStrataNamesAreRefused) {
  setenv("TUNABLES_TEST_FOREIGN", "", 1);
  EXPECT_EQ(foreign_variable("TUNABLES_TEST_FOREIGN"), "");  // empty is kept: callers decide
  unsetenv("TUNABLES_TEST_FOREIGN");
  EXPECT_EQ(foreign_variable("TUNABLES_TEST_FOREIGN"), std::nullopt);
  EXPECT_THROW((void)foreign_variable("STRATA_CPU_ISA"), Error);
}

}  // namespace
}  // namespace strata
