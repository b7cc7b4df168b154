// Every STRATA_* environment variable, declared once (name, type, default, what it changes)
// and read only through this table, as NCCL's NCCL_PARAM table does; `strata limits
// --tunables` prints it. Variables that belong to others (HOME, SLURM_*, OMPI_*, GOMP_*)
// are read through foreign_variable(), so that tunables.cpp holds the one read of the
// environment in the tree.
//
// One rule for every tunable: unset and empty mean the default; any other value must parse
// as its type, or the read throws InputError naming the variable, the value and what it
// takes (a mistyped switch never measures the wrong path).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata {

enum class TunableType {
  kChoice,  // one of a fixed list of words
  kInt,     // a decimal whole number
  kText,    // any text, parsed by its reader
  kPath,    // a file or directory
};

const char* tunable_type_name(TunableType type);

// X(id, name, type, default, choices, what): `choices` lists a kChoice tunable's values as
// "a|b|c"; a name ending in <NAME> is a family, one variable per member (STRATA_LIMIT_LAYERS).
#define STRATA_TUNABLES(X)                                                                      \
  X(kCpuIsa, "STRATA_CPU_ISA", kChoice, "detected", "portable|avx2|avx512",                     \
    "caps the CPU kernels' instruction set below the widest the CPU has (for comparisons)")     \
  X(kCpuWeights, "STRATA_CPU_WEIGHTS", kChoice, "panels", "panels|rows",                        \
    "the host's weight layout: packed GEMM panels, or the checkpoint's rows")                   \
  X(kLogLevel, "STRATA_LOG_LEVEL", kText, "info", "",                                           \
    "log level: trace, debug, info, warn, error, critical or off (spdlog's names; other text "  \
    "is off)")                                                                                  \
  X(kCudaGemv, "STRATA_CUDA_GEMV", kChoice, "on", "on|off",                                     \
    "the fused GEMV kernel for one-row linears (on), or cuBLAS for every linear (off)")         \
  X(kCudaEpilogue, "STRATA_CUDA_EPILOGUE", kChoice, "on", "on|off",                             \
    "linear_then and linears fuse their epilogues (on), or decline (off)")                      \
  X(kCudaPdl, "STRATA_CUDA_PDL", kChoice, "on", "on|off|early|all",                             \
    "programmatic dependent launch: GEMVs wait before any load (on), load weights before the "  \
    "wait (early), norms, kv_store and attention too (all), or none (off)")                     \
  X(kCudaNorm, "STRATA_CUDA_NORM", kChoice, "kernel", "kernel|fused",                           \
    "a pre-norm layer's norm as its own kernel, or folded into the GEMV of linears")            \
  X(kCudaNormRows, "STRATA_CUDA_NORM_ROWS", kChoice, "1", "1|2|4",                              \
    "weight rows a warp takes in a GEMV with a folded norm")                                    \
  X(kCudaAttention, "STRATA_CUDA_ATTENTION", kChoice, "warps", "warps|tiled|simple",            \
    "decode attention by warps over keys where a kernel fits, the tiled kernel, or one "        \
    "block per (row, head)")                                                                    \
  X(kCudaDecode, "STRATA_CUDA_DECODE", kChoice, "apart", "apart|fused",                         \
    "a decode step's kv_store, attention and split combine as three kernels, or one")           \
  X(kInputLimit, "STRATA_LIMIT_<NAME>", kInt, "see strata limits --input", "",                  \
    "overrides input limit <name> (worker/input_limits.h), as --limit NAME=N does")             \
  X(kProfileDir, "STRATA_PROFILE_DIR", kPath, "~/.cache/strata/profiles", "",                   \
    "where serve keeps layer profiles, one file per model, dtype, placement and hosts")         \
  X(kRankStatusDir, "STRATA_RANK_STATUS_DIR", kPath, "", "",                                    \
    "where a rank that fails before MPI starts leaves its exit status (local-cluster.sh)")      \
  X(kMpiVerdict, "STRATA_MPI_VERDICT", kPath, "", "",                                           \
    "where the MPI tests' surviving rank leaves its verdict after a peer crashed (run_mpi.sh)") \
  X(kBenchThreads, "STRATA_BENCH_THREADS", kInt, "2", "", "threads of the kernel benchmarks")

enum class TunableId {
#define STRATA_TUNABLE_ID(id, name, type, def, choices, what) id,
  STRATA_TUNABLES(STRATA_TUNABLE_ID)
#undef STRATA_TUNABLE_ID
};

struct Tunable {
  TunableId id;
  std::string_view name;
  TunableType type;
  std::string_view default_value;
  std::string_view choices;  // kChoice: "a|b|c"
  std::string_view what;

  bool family() const { return name.ends_with("<NAME>"); }
  // The variable of family member `member`: STRATA_LIMIT_<NAME> and "layers" give
  // STRATA_LIMIT_LAYERS. Without a member, the tunable's own name.
  std::string variable(std::string_view member = {}) const;
  std::vector<std::string_view> choice_list() const;
};

std::span<const Tunable> tunables();
const Tunable& tunable(TunableId id);

// The variable's text; nullopt when it is unset or empty (the default applies).
std::optional<std::string> tunable_text(TunableId id, std::string_view member = {});
// A kChoice tunable's value as its index in the choices; nullopt when unset.
std::optional<int> tunable_choice_if_set(TunableId id);
// The same, with the default's index when unset.
int tunable_choice(TunableId id);
// A kInt tunable's value; nullopt when unset.
std::optional<int64_t> tunable_int_if_set(TunableId id, std::string_view member = {});
// The same, with the default when unset (not for a family, whose default is per member).
int64_t tunable_int(TunableId id);
// Every member of a family that the environment sets, as (variable, value).
std::vector<std::pair<std::string, std::string>> tunable_family_values(TunableId id);

// A variable that is not Strata's (HOME, SLURM_JOB_ID, OMPI_COMM_WORLD_RANK, GOMP_SPINCOUNT),
// as the environment holds it (empty included); nullopt when unset. A STRATA_* name here is
// a programming error: Strata's own variables are declared in STRATA_TUNABLES.
std::optional<std::string> foreign_variable(const char* name);

}  // namespace strata
