// The vector kernel of gemm_q4_panel.h, compiled for AVX-512 with VNNI in
// gemm_q4_panel_avx512.cpp. Internal to kernels/.
#pragma once

#include <cstdint>

namespace strata::q4_panel_detail {

struct Q4PanelArgs {
  const int8_t* xq;     // [m, 2k]: Q4PanelScratch's layout
  const float* xscale;  // [m, k / 64]: d / 256 of each group of x
  const float* xsum;    // [m, k / 64]: sum of each group of x
  int64_t m;
  int64_t k;
  const uint8_t* w;  // packed [n, k]
  int64_t n;
  const float* bias;  // [n] or null
  float* y;           // [m, n]
};

// Activation rows a thread takes at a time: their split x (2k bytes a row, 256 KiB at
// k = 1024) stays in L2 while each of the thread's panels passes over it.
constexpr int64_t kQ4PanelMc = 128;

// Panels [p0, p1) of y for every activation row. Needs AVX-512 F, BW and VNNI.
void q4_panel_gemm_avx512(const Q4PanelArgs& a, int64_t p0, int64_t p1);

}  // namespace strata::q4_panel_detail
