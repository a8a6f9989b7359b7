// float32 y = x @ W^T (+ bias) on CPU over a weight packed once into column panels.
//
// Why: a decode step multiplies a few rows (one per running sequence) by every weight, so
// the step is bound by streaming the weights, and the BLAS call torch makes for F.linear
// reaches well under the memory bandwidth at 2-16 rows on the CPUs measured (perf/README.md).
// Packed as [panel][k][16] (ops/linear.py pack_weight) (16 output columns per panel, contiguous along k), the weight is
// read front to back exactly once per call, and a 6x16 tile of outputs lives in 12 AVX2
// registers while one k step costs two loads, six broadcasts and twelve FMAs; further row
// tiles re-read the panel from cache. Calls with many rows (prefill) are not sent here: a
// fully blocked BLAS GEMM is as fast there and keeps big weights out of DRAM re-reads.
//
// Each output is a plain float32 sum over k in order (fused multiply-adds), so results agree
// with any other float32 GEMM to rounding, not bit for bit.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kPanel = 16;     // output columns per packed panel
constexpr int kTileRows = 6;   // rows of x per register tile
constexpr int64_t kParallelWork = int64_t{1} << 18;  // multiply-adds

#if defined(__AVX2__) && defined(__FMA__)
template <int Rows>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k_size,
                 const float* bias, float* y, int64_t ldy, int cols) {
  __m256 lo[Rows], hi[Rows];
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 w_lo = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w_hi = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m256 xm = _mm256_broadcast_ss(x + m * ldx + k);
      lo[m] = _mm256_fmadd_ps(xm, w_lo, lo[m]);
      hi[m] = _mm256_fmadd_ps(xm, w_hi, hi[m]);
    }
  }
  alignas(32) float bias_tile[kPanel] = {};
  if (bias != nullptr) std::memcpy(bias_tile, bias, sizeof(float) * cols);
  const __m256 b_lo = _mm256_load_ps(bias_tile), b_hi = _mm256_load_ps(bias_tile + 8);
  if (cols == kPanel) {
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      _mm256_storeu_ps(y + m * ldy, _mm256_add_ps(lo[m], b_lo));
      _mm256_storeu_ps(y + m * ldy + 8, _mm256_add_ps(hi[m], b_hi));
    }
    return;
  }
  alignas(32) float out[Rows][kPanel];
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) {
    _mm256_store_ps(out[m], _mm256_add_ps(lo[m], b_lo));
    _mm256_store_ps(out[m] + 8, _mm256_add_ps(hi[m], b_hi));
  }
  for (int m = 0; m < Rows; ++m) std::memcpy(y + m * ldy, out[m], sizeof(float) * cols);
}
#else
template <int Rows>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t k_size,
                 const float* bias, float* y, int64_t ldy, int cols) {
  float acc[Rows][kPanel] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    for (int m = 0; m < Rows; ++m) {
      const float xm = x[m * ldx + k];
      for (int j = 0; j < kPanel; ++j) acc[m][j] += xm * panel[k * kPanel + j];
    }
  }
  for (int m = 0; m < Rows; ++m) {
    for (int j = 0; j < cols; ++j) y[m * ldy + j] = acc[m][j] + (bias ? bias[j] : 0.f);
  }
}
#endif

// Rows [0, rows) of x against one panel.
void panel_rows(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t k_size,
                const float* bias, float* y, int64_t ldy, int cols) {
  int64_t m = 0;
  for (; m + kTileRows <= rows; m += kTileRows) {
    tile<kTileRows>(x + m * ldx, ldx, panel, k_size, bias, y + m * ldy, ldy, cols);
  }
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  switch (rows - m) {
    case 5: tile<5>(xm, ldx, panel, k_size, bias, ym, ldy, cols); break;
    case 4: tile<4>(xm, ldx, panel, k_size, bias, ym, ldy, cols); break;
    case 3: tile<3>(xm, ldx, panel, k_size, bias, ym, ldy, cols); break;
    case 2: tile<2>(xm, ldx, panel, k_size, bias, ym, ldy, cols); break;
    case 1: tile<1>(xm, ldx, panel, k_size, bias, ym, ldy, cols); break;
    default: break;
  }
}

}  // namespace

extern "C" {

int64_t vgraph_linear_panel_width() { return kPanel; }

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T + bias (nullable). Each panel
// is read from memory once and takes every row in tiles of six while it sits in cache; the
// caller keeps m small (ops/linear.py sends many-row calls to torch's blocked GEMM). Panels
// are shared out among threads.
void vgraph_linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* packed,
                   int64_t n, const float* bias, float* y, int64_t ldy, int32_t num_threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // A parallel region costs microseconds (and far more when another process holds a core
  // and the team waits for it); below this much work one thread is faster.
  const bool parallel = num_threads > 1 && panels > 1 && m * n * k >= kParallelWork;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
  for (int64_t p = 0; p < panels; ++p) {
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
    panel_rows(x, ldx, m, packed + p * k * kPanel, k, bias ? bias + p * kPanel : nullptr,
               y + p * kPanel, ldy, cols);
  }
}

}  // extern "C"
