// Limits, declared once: every size that a model file, a prompt or a command-line option
// controls has a bound here, checked before anything of that size is allocated. A value past
// its limit is refused with the file, the field, the value and the limit, never met as a bare
// std::bad_alloc. Like NCCL_PARAM, one line declares each limit's name, default, ceiling and
// what it bounds; `strata limits --input` prints them all.
//
// The defaults are generous for real models: Llama-3.1-405B (126 layers, hidden 16384, 128
// heads, intermediate 53248, vocab 128256, context 131072) and OPT-175B (96 layers, hidden
// 12288, 96 heads, ffn 49152) pass with room to spare. Each limit can be raised (or lowered)
// with the environment variable STRATA_LIMIT_<NAME> or, on engine commands, --limit NAME=N.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "kernels/tensor.h"

namespace strata {

// X(name, default, ceiling, what it bounds). The ceiling is the most a limit may be raised to:
// the range of the type the value is stored in, or what the code can represent at all.
#define STRATA_INPUT_LIMITS(X)                                                                   \
  X(safetensors_header_bytes, 100000000, int64_t{1} << 40,                                       \
    "bytes of one safetensors JSON header (the format's reference implementation caps it at "    \
    "100 MB)")                                                                                   \
  X(safetensors_tensors, 1000000, INT32_MAX,                                                     \
    "tensors in one safetensors file, and entries of a model.safetensors.index.json weight_map") \
  X(tensor_rank, kMaxDims, kMaxDims, "dimensions of one tensor (Strata's Shape holds 4)")        \
  X(tensor_dim, int64_t{1} << 26, INT64_MAX, "elements along any one dimension of a tensor")     \
  X(json_file_bytes, int64_t{64} << 20, int64_t{1} << 40,                                        \
    "bytes of config.json, tokenizer_config.json or model.safetensors.index.json")               \
  X(tokenizer_file_bytes, int64_t{64} << 20, INT32_MAX, "bytes of tokenizer.model")              \
  X(layers, 1024, INT32_MAX, "num_hidden_layers")                                                \
  X(heads, 1024, INT32_MAX, "num_attention_heads and num_key_value_heads")                       \
  X(head_dim, 4096, INT32_MAX, "head_dim")                                                       \
  X(hidden, 131072, INT32_MAX, "hidden_size and word_embed_proj_dim")                            \
  X(intermediate, 1048576, INT32_MAX, "intermediate_size (Llama) and ffn_dim (OPT)")             \
  X(vocab, 2097152, INT32_MAX, "vocab_size")                                                     \
  X(context, 1048576, INT32_MAX,                                                                 \
    "max_position_embeddings and rope_scaling.original_max_position_embeddings")                 \
  X(batch, 65536, INT32_MAX, "sequences in one step (--max-batch, bench --batch)")               \
  X(step_tokens, 65536, INT32_MAX, "rows of one prefill step (--max-step-tokens)")               \
  X(prompt_bytes, int64_t{4} << 20, INT32_MAX, "bytes of one prompt")                            \
  X(prompt_file_bytes, int64_t{256} << 20, int64_t{1} << 40,                                     \
    "bytes of a --prompt-file or a submit --file")                                               \
  X(prompts, 1000000, INT32_MAX, "prompts in one generate run")                                  \
  X(request_bytes, int64_t{1} << 20, INT32_MAX,                                                  \
    "bytes of one request: a JSONL line, or all fields of one queue entry")                      \
  X(json_depth, 16, 1024,                                                                        \
    "nesting depth of a request's JSON (a request needs 3; deeper is refused unparsed)")

struct InputLimits {
#define STRATA_INPUT_LIMIT_MEMBER(name, def, ceiling, what) int64_t name = def;
  STRATA_INPUT_LIMITS(STRATA_INPUT_LIMIT_MEMBER)
#undef STRATA_INPUT_LIMIT_MEMBER

  using Member = int64_t InputLimits::*;
  struct Field {
    const char* name;
    Member member;
    int64_t default_value;
    int64_t ceiling;
    const char* what;
  };
  static std::span<const Field> fields();

  // The defaults with every STRATA_LIMIT_<NAME> environment variable applied. Throws
  // InputError naming the variable when one is not a valid value.
  static InputLimits from_env();

  // Sets one limit by name; throws InputError for an unknown name or a value outside
  // [1, ceiling]. `origin` says where the value came from ("--limit", "STRATA_LIMIT_LAYERS").
  void set(std::string_view name, int64_t value, std::string_view origin);
  // "NAME=VALUE", as --limit takes it.
  void set_from_text(std::string_view assignment, std::string_view origin);

  // Throws InputError "<where>: <field> = <value> is above the limit <limit> (...)" when
  // value > this->*limit; says how to raise it.
  void check(Member limit, int64_t value, std::string_view where, std::string_view field) const;

  std::string str() const;   // one line per limit: name = value (default ...): what
  std::string json() const;  // [{"name", "value", "default", "max", "env", "bounds"}, ...]
};

// Reads a file of at most `limits.*limit` bytes chunk by chunk, handing each to `consume`
// (which may refuse early by throwing); refuses a larger file as read_file_bounded does.
void read_bounded(const std::string& path, const InputLimits& limits, InputLimits::Member limit,
                  std::string_view what, const std::function<void(std::string_view)>& consume);

// Reads a whole file of at most `limits.*limit` bytes, refusing larger ones before reading
// them: regular files by their size, pipes and devices (/dev/zero) after limit + 1 bytes.
// `what` names the file's role in messages ("prompt file", "config.json").
std::string read_file_bounded(const std::string& path, const InputLimits& limits,
                              InputLimits::Member limit, std::string_view what);

}  // namespace strata
