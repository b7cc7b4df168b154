// The message of the InputError `f` throws, or "(no error)": tests check that bad input is
// refused with a message naming the problem.
#pragma once

#include <string>

#include "kernels/error.h"

namespace strata::testing {

template <class F>
std::string input_error(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace strata::testing
