// What every harness shares: an InputError is the parser doing its job; anything else that
// escapes (a STRATA_CHECK, std::out_of_range, nlohmann's type_error) is a finding, and so is
// a result that breaks the invariant the parser promises (fuzz_require).
#pragma once

#include <cstdio>
#include <cstdlib>

#include "kernels/error.h"

namespace strata::fuzz {

// Aborts (a libFuzzer finding, with the input saved) when `ok` is false.
inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
  std::abort();
}

// Runs `f`; swallows InputError only.
template <typename F>
void expect_input_error_or_success(F&& f) {
  try {
    f();
  } catch (const InputError&) {
  }
}

}  // namespace strata::fuzz
