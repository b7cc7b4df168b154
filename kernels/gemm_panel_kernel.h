// The panel GEMM (gemm_panel.h) written once over a vector traits type V;
// gemm_panel_avx2.cpp and gemm_panel_avx512.cpp instantiate it, each compiled for its own
// instruction set. Internal to kernels/.
//
// V provides: Vec, kWidth (floats a vector), kMr (activation rows a micro-kernel keeps in
// registers: MR x 32 outputs), zero(), load(p), load_once(p) (a panel row's weights, loaded
// into a register that every row's FMA reads), bcast(p) (one float to every lane),
// fma(a, b, c), store(p, v).
//
// The loops over rows and vectors carry `GCC unroll`: at -O3 GCC 12 unrolls them only
// partly and then stores the accumulators to the stack on every k (a store per FMA), which
// halved the AVX2 kernel (docs/BENCHMARKS.md, "Panel GEMM on AVX2").
//
// Blocking: a thread walks its panels once per kMc activation rows (those rows stay in L2
// while every panel passes), and each panel in slices of kKc values of k (gemm_panel.h's
// kPanelKSlice: 128 KiB of weights, in L2 while every MR-row tile of the kMc rows passes
// over it). A slice after the first adds to the outputs the one before stored.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/gemm_panel.h"

namespace strata::panel_detail {

struct PanelArgs {
  const float* x;  // [m, k]
  int64_t m;
  int64_t k;
  const float* w;  // packed [n, k]
  int64_t n;
  const float* bias;  // [n] or null
  float* y;           // [m, ldy]: column c of the matrix at y[i * ldy + c]
  int64_t ldy;
};

constexpr int64_t kKc = kPanelKSlice;
constexpr int64_t kMc = 64;
// Tiles of rows up to which the tiles after the first prefetch the next slice. Beyond, the
// slice's one read from memory is a small part of its time and the prefetch's extra load
// and address a step cost more than it hides (panels against OpenBLAS at m = 128 on Zen 3,
// interleaved: 0.88 with it, 0.96 without).
constexpr int64_t kAheadMaxTiles = 8;

// Compiled into each instruction set's file: internal linkage (see gemv_kernel.h).
namespace {

// The share of the next slice one micro-kernel prefetches while it computes from L2: at
// step kk the byte (kk - k0) * rate / 2^16 past `begin`, so its steps walk the share once
// (each line is fetched by the first step that reaches it).
struct Ahead {
  const char* begin = nullptr;  // null: none
  int64_t rate = 0;
};

// MR activation rows from i against panel p, over k in [k0, k1).
template <class V, int MR>
void micro(const PanelArgs& a, int64_t p, int64_t i, int64_t k0, int64_t k1, Ahead ahead = {}) {
  constexpr int kVecs = static_cast<int>(kPanelRows) / V::kWidth;
  using Vec = typename V::Vec;
  Vec acc[MR][kVecs];
  const int64_t col = p * kPanelRows;
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) {
      const int64_t c = col + v * V::kWidth;
      if (k0 > 0) {
        acc[r][v] = V::load(a.y + (i + r) * a.ldy + c);
      } else {
        acc[r][v] = a.bias != nullptr ? V::load(a.bias + c) : V::zero();
      }
    }
  const float* panel = a.w + p * a.k * kPanelRows;
  const float* x = a.x + i * a.k;
  for (int64_t kk = k0; kk < k1; ++kk) {
    if (ahead.begin != nullptr)
      __builtin_prefetch(ahead.begin + (((kk - k0) * ahead.rate) >> 16), 0, 2);
    Vec w[kVecs];
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) w[v] = V::load_once(panel + kk * kPanelRows + v * V::kWidth);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const Vec xv = V::bcast(x + r * a.k + kk);
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) acc[r][v] = V::fma(xv, w[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v)
      V::store(a.y + (i + r) * a.ldy + col + v * V::kWidth, acc[r][v]);
}

// `rows` (< R + 1) activation rows from i: the micro-kernel of exactly that many.
template <class V, int R>
void micro_rows(const PanelArgs& a, int64_t p, int64_t i, int64_t rows, int64_t k0, int64_t k1,
                Ahead ahead) {
  if constexpr (R > 0) {
    if (rows == R) {
      micro<V, R>(a, p, i, k0, k1, ahead);
    } else {
      micro_rows<V, R - 1>(a, p, i, rows, k0, k1, ahead);
    }
  }
}

// The output columns of panels [p0, p1) for every activation row. One panel streams at a
// time: a decode GEMV (m = 1) reads weights at the machine's read bandwidth with one stream
// a thread, and loses 10-25% with several panels' streams interleaved or with software
// prefetch (docs/journal/benchmarks-history.md, "Panel GEMM, huge pages"), so a single
// tile prefetches nothing. With several tiles (a MoE expert's 8 rows at batch 32: 4 on
// AVX2) the first reads the slice from memory and the others from L2, and without the
// prefetch memory idles while they compute (docs/BENCHMARKS.md, "Panel GEMM on AVX2").
template <class V>
void panel_gemm(const PanelArgs& a, int64_t p0, int64_t p1) {
  for (int64_t i0 = 0; i0 < a.m; i0 += kMc) {
    const int64_t i1 = std::min(a.m, i0 + kMc);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k0 = 0; k0 < a.k; k0 += kKc) {
        const int64_t k1 = std::min(a.k, k0 + kKc);
        // The slice after this one (the next panel's first, where this is the panel's last)
        // lies right after it; tiles after the first read this one from L2 and prefetch
        // that one, an equal share each, so memory streams while they compute.
        const int64_t tiles = (i1 - i0 + V::kMr - 1) / V::kMr;
        const bool last = p + 1 == p1 && k1 == a.k;
        const int64_t next_k = k1 < a.k ? std::min(a.k - k1, kKc) : std::min(a.k, kKc);
        const bool ahead_pays = tiles > 1 && tiles <= kAheadMaxTiles && !last;
        const auto share =
            ahead_pays ? next_k * kPanelRows * int64_t{sizeof(float)} / (tiles - 1) : 0;
        const char* next = reinterpret_cast<const char*>(a.w + (p * a.k + k1) * kPanelRows);
        const auto ahead = [&](int64_t t) {
          return t > 0 && share > 0 ? Ahead{next + (t - 1) * share, (share << 16) / (k1 - k0)}
                                    : Ahead{};
        };
        int64_t i = i0, t = 0;
        for (; i + V::kMr <= i1; i += V::kMr, ++t) micro<V, V::kMr>(a, p, i, k0, k1, ahead(t));
        micro_rows<V, V::kMr - 1>(a, p, i, i1 - i, k0, k1, ahead(t));
      }
  }
}

}  // namespace

// The instruction-set entry points (absent ones are never called: see active_cpu_isa()).
void panel_gemm_avx2(const PanelArgs& a, int64_t p0, int64_t p1);
void panel_gemm_avx512(const PanelArgs& a, int64_t p0, int64_t p1);

}  // namespace strata::panel_detail
