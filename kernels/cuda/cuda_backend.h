// The CUDA backend: the Backend interface on one GPU's memory. Plain C++ (no CUDA headers)
// so host code can include it whether or not CUDA was built.
//
// Contract differences from the CPU backend, all pointers being device pointers:
//  - every op is enqueued on the backend's own stream and returns without waiting; copy()
//    to or from the host and synchronize() wait for the stream, so results read back through
//    copy() are complete;
//  - token ids (embedding) and positions (rope) live in device memory and are not
//    validated on the host: an id outside the vocabulary gives a zero row, a position
//    outside the rope table leaves that row unrotated;
//  - kv_store/attention read the step's row table in device memory when the caller gives
//    one (StepRows::table, checked on the host by fill_row_table when it was built);
//    otherwise they check the SeqSlice spans on the host and upload a table per call;
//  - reserve() allocates the linear scratch (accelerator_scratch_bytes) up front; without
//    it the first call of each kind allocates it;
//  - linear with f16/bf16 weights over more than kMaxGemvRowsHalf rows rounds x to the
//    weight's type before the GEMM (see cuda_backend.cpp), so it is accurate to that type's
//    precision, not to f32; one row (decode) goes through the fused GEMV, which uses x as f32.
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace strata {

// A backend on CUDA device `device_index`. Throws Error: kUnimplemented when this binary
// was built without CUDA, kFailed (naming the CUDA error) when the device cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device_index);

}  // namespace strata
