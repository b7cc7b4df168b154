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

// The CUDA backend's kernel choices (docs/GPU.md, "Switches"), so that one
// build measures each fused kernel against what it replaced. from_env() reads them from
// STRATA_CUDA_*; a value it does not know is an input error naming the variable.
struct CudaOptions {
  bool fused_gemv = true;      // STRATA_CUDA_GEMV=off: cuBLAS for every linear
  bool fuse_epilogues = true;  // STRATA_CUDA_EPILOGUE=off: linear_then and linears decline
  // STRATA_CUDA_PDL: GEMVs start while the kernel before them finishes (programmatic
  // dependent launch, compute capability 9.0 on), waiting for it before any load (on), or
  // with their first weight loads before the wait (early); or not at all (off). With all,
  // the norms, kv_store and attention's kernels too.
  enum class Pdl { kOn, kOff, kEarly, kAll };
  Pdl pdl = Pdl::kOn;
  // STRATA_CUDA_NORM=fused: linears folds a pre-norm layer's norm into its GEMV.
  bool fuse_norms = false;
  // STRATA_CUDA_NORM_ROWS=1|2|4: weight rows a warp of such a GEMV takes, so that 4, 8 or 16
  // rows share a block's norm prologue (GemvMode::warp_rows).
  int norm_warp_rows = 1;
  // STRATA_CUDA_ATTENTION: decode rows by warps over keys where a kernel fits (warps), the
  // tiled kernel for every row (tiled), or one block per (row, head) (simple).
  enum class Attention { kWarps, kTiled, kSimple };
  Attention attention = Attention::kWarps;
  // STRATA_CUDA_DECODE=fused: a decode step's kv_store, attention and split combine are one
  // kernel (store_and_attend), launched as PDL says; apart (the default): three.
  bool fuse_decode_attention = false;

  static CudaOptions from_env();
  // Throws Error(kInvalidInput) naming a field whose value no kernel takes.
  void check() const;
};

// A backend on CUDA device `device_index`, with CudaOptions::from_env() or `options`. Throws
// Error: kUnimplemented when this binary was built without CUDA, kFailed (naming the CUDA
// error) when the device cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device_index);
std::unique_ptr<Backend> make_cuda_backend(int device_index, const CudaOptions& options);

}  // namespace strata
