// float32 y = x @ W^T (+ bias) on CPU over a weight packed once into column panels.
//
// Why: a decode step multiplies a few rows (one per running sequence) by every weight, so
// the step is bound by streaming the weights, and the BLAS call torch makes for F.linear
// reaches well under the memory bandwidth at 2-16 rows on the CPUs measured (perf/README.md).
// Packed as [panel][k][16] (ops/linear.py pack_weight) (16 output columns per panel, contiguous
// along k), the weight is read front to back exactly once per call. Panels are taken in
// groups of four: a 6x16 tile of outputs lives in 12 AVX2 registers while one k step costs
// two loads, six broadcasts and twelve FMAs, and the last one to five rows use a tile that
// spans up to four panels (1x64, 2x32, 3x32), so that even one row keeps eight independent
// FMA chains in flight; those re-read the group from cache. Each tile prefetches the panels
// after its own, a whole tile ahead of the hardware prefetcher: 1.2-1.5x on 1-8 rows over
// the perf model's 93 MB of weights (which live in DRAM during a decode step). With many
// rows (prefill) the same loop is compute-bound at ~85-92 GFLOP/s on one Zen 3 core: each
// group of panels is read once and reused by every row while x (rows x K) is re-read from
// cache per group, 128 FMAs per float of x, far below any cache's bandwidth.
//
//
// On a CPU with AVX-512 (chosen at build time: -march=native defines __AVX512F__) the tiles
// are 6 rows x 4 panels, 24 zmm accumulators: per k step four weight loads and six broadcasts
// feed 24 FMAs, against two loads and six broadcasts for 12 ymm FMAs on AVX2, so the loop
// issues half the instructions per FLOP. K runs in passes of 1024 (a group's panels then stay
// in L2 for every row block: a down projection's K = 4864 group is 1.2 MiB). Measured on one
// Zen 4 core against the AVX2 tiles: 1.05-1.2x at 1 row, 1.1-1.6x at 4-16, 1.04-1.14x at 64, 1.0-1.1x at 512
// on a 0.5B model's projections. vgraph_linear_rows runs the same tiles over a row-major weight.
//
// Each output is a plain float32 sum over k in order (fused multiply-adds), so results agree
// with any other float32 GEMM to rounding, not bit for bit.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int kPanel = 16;     // output columns per packed panel
constexpr int kTileRows = 6;   // rows of x per register tile
constexpr int kGroup = 4;      // panels per unit of work (the widest tile spans all four)
constexpr int64_t kParallelWork = int64_t{1} << 18;  // multiply-adds

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
// k steps per pass over a group: the group's four panels at 1024 k (256 KiB) stay in L2
// while every row block of x reuses them; a longer K (an MLP's down projection) would
// otherwise evict its panels between row blocks. The next pass continues each output's sum
// from the float32 value stored in y, so the sum is the same in-order chain of FMAs.
constexpr int64_t kDepth = 1024;
// Rows for which the row blocks prefetch the next pass's panels (see rows_pass): from two full
// six-row blocks to a decode batch's 64, measured 1.05-1.16x at 16-64 rows with the weights
// in DRAM on the served CPU model's projections.
constexpr int64_t kPrefetchRows = 2 * kTileRows, kPrefetchMaxRows = 64;

// Lines a tile fetches into L2 for later while it computes: lines [first, last) of a region
// of `panels` panels from `start` (`stride` floats apart), `depth` 64-byte lines (k steps)
// each, walked panel by panel. The tile issues them evenly over its own k steps.
struct Prefetch {
  const float* start = nullptr;
  int64_t stride = 0, depth = 0;
  int panels = 0;
  int64_t first = 0, last = 0;
};

// Walks a Prefetch's lines at the pace of a tile's k steps (lines per step in 16.16 fixed
// point), the address kept incrementally (no division in the k loop).
class PrefetchWalk {
 public:
  PrefetchWalk(const Prefetch& ahead, int64_t steps)
      : left_(ahead.last - ahead.first),
        pace_(steps > 0 ? (left_ << 16) / steps + 1 : 0),
        panel_(ahead.depth > 0 ? ahead.first / ahead.depth : 0),
        line_(ahead.depth > 0 ? ahead.first - panel_ * ahead.depth : 0),
        ahead_(ahead) {}

  bool active() const { return left_ > 0; }

  // The lines due by the end of one more k step.
  inline void step() {
    credit_ += pace_;
    for (; credit_ >= (int64_t{1} << 16) && left_ > 0; credit_ -= int64_t{1} << 16, --left_) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead_.start + panel_ * ahead_.stride + line_ * kPanel),
                   _MM_HINT_T1);
      if (++line_ == ahead_.depth) line_ = 0, ++panel_;
    }
  }

 private:
  int64_t left_, pace_, panel_, line_, credit_ = 0;
  const Prefetch& ahead_;
};

// Rows x (16 * Panels) outputs over k in [0, depth) of rows of x against Panels consecutive
// panels: one zmm register per 16 outputs, up to 6 x 4 = 24 accumulators (independent FMA
// chains), four weight registers and one broadcast of x, within the 32 AVX-512 registers.
// A k step costs Panels loads and Rows broadcasts for Rows * Panels FMAs, twice the work per
// instruction of the AVX2 6x16 tile. `first`: start from zero (else from y, a previous pass);
// `bias` (nullable, the last pass only) is added at the end. No software prefetch: unlike the
// AVX2 tiles', it measured 4-15% slower at 1-64 rows (four prefetches per k step compete with
// the four loads), with the weights in DRAM or in cache alike.
template <int Rows, int Panels, bool Fetch>
inline void tile(const float* x, int64_t ldx, const float* panels, int64_t panel_stride, int64_t depth,
                 bool first, const float* bias, float* y, int64_t ldy, int cols, const Prefetch& ahead) {
  constexpr int kAcc = Rows * Panels;
  const __mmask16 last_mask = static_cast<__mmask16>((1u << cols) - 1u);
  __m512 acc[kAcc];  // output (m, p) in acc[m * Panels + p]
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) {
#pragma GCC unroll 4
    for (int p = 0; p < Panels; ++p) {
      const __mmask16 mask = p == Panels - 1 ? last_mask : static_cast<__mmask16>(0xffff);
      acc[m * Panels + p] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + m * ldy + p * kPanel);
    }
  }
  PrefetchWalk walk(ahead, depth);
  for (int64_t k = 0; k < depth; ++k) {
    if constexpr (Fetch) {
      if (walk.active()) walk.step();
    }
    __m512 w[Panels];
#pragma GCC unroll 4
    for (int p = 0; p < Panels; ++p) w[p] = _mm512_loadu_ps(panels + p * panel_stride + k * kPanel);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 4
      for (int p = 0; p < Panels; ++p) acc[m * Panels + p] = _mm512_fmadd_ps(xm, w[p], acc[m * Panels + p]);
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < Panels; ++p) {
    const __mmask16 mask = p == Panels - 1 ? last_mask : static_cast<__mmask16>(0xffff);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + p * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      _mm512_mask_storeu_ps(y + m * ldy + p * kPanel, mask, _mm512_add_ps(acc[m * Panels + p], b));
    }
  }
}

// One pass (k in [0, depth)) of rows [0, rows) against Panels panels: six-row tiles, then one
// tile for the last one to five rows; the row blocks after the first find the panels in L2.
// With more than one row block, the tiles also fetch `next` (the thread's next group of panels)
// into L2, each block its share by its rows: the first block alone streams this pass's
// panels from DRAM and the others compute from L2, so without it the memory sat idle through
// every block but the first, and with it DRAM streams the next group while any block computes.
// Only kPrefetchRows to kPrefetchMaxRows rows prefetch: one row block's own loads already
// stream at DRAM speed (software prefetches measured 4-15% slower there, see `tile`), at 7-11
// rows the later block is too short to hide a group's fetch (0.88-1.03x), and a prefill-sized
// call is compute-bound, its panels reused by every row block (0.92-0.97x at 2048 rows; all
// `python -m perf.linear_ab --shapes llama-24m [--cold]`).
template <int Panels, bool Fetch>
void rows_pass(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t panel_stride,
               int64_t depth, bool first, const float* bias, float* y, int64_t ldy, int cols, Prefetch next) {
  const int64_t lines = Fetch ? next.panels * next.depth : 0;
  int64_t m = 0;
  auto share = [&](int64_t block_rows) {  // the lines of the rows [m, m + block_rows)
    Prefetch part = next;
    part.first = lines * m / rows;
    part.last = lines * (m + block_rows) / rows;
    return part;
  };
  for (; m + kTileRows <= rows; m += kTileRows) {
    tile<kTileRows, Panels, Fetch>(x + m * ldx, ldx, panels, panel_stride, depth, first, bias, y + m * ldy, ldy,
                                   cols, share(kTileRows));
  }
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  const Prefetch rest = share(rows - m);
  switch (rows - m) {
    case 5: tile<5, Panels, Fetch>(xm, ldx, panels, panel_stride, depth, first, bias, ym, ldy, cols, rest); break;
    case 4: tile<4, Panels, Fetch>(xm, ldx, panels, panel_stride, depth, first, bias, ym, ldy, cols, rest); break;
    case 3: tile<3, Panels, Fetch>(xm, ldx, panels, panel_stride, depth, first, bias, ym, ldy, cols, rest); break;
    case 2: tile<2, Panels, Fetch>(xm, ldx, panels, panel_stride, depth, first, bias, ym, ldy, cols, rest); break;
    case 1: tile<1, Panels, Fetch>(xm, ldx, panels, panel_stride, depth, first, bias, ym, ldy, cols, rest); break;
    default: break;
  }
}

// rows_pass with or without the prefetch of `next` (see rows_pass and kPrefetchRows).
template <int Panels>
void rows_pass_of(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t panel_stride,
                  int64_t depth, bool first, const float* bias, float* y, int64_t ldy, int cols, Prefetch next) {
  if (next.start != nullptr && rows >= kPrefetchRows && rows <= kPrefetchMaxRows) {
    rows_pass<Panels, true>(x, ldx, rows, panels, panel_stride, depth, first, bias, y, ldy, cols, next);
  } else {
    rows_pass<Panels, false>(x, ldx, rows, panels, panel_stride, depth, first, bias, y, ldy, cols, next);
  }
}

// Rows [0, rows) of x against `count` consecutive panels (count == kGroup unless the weight
// ends first), in passes of kDepth k steps. `next`, `next_count`: the group this thread takes
// after this one (nullable), which a single-pass group prefetches (rows_pass). A deeper K
// prefetches nothing: each panel's next pass lies right after this one, where the hardware
// prefetcher already streams, and the extra requests measured 0.89-0.97x (K = 1408, 16 rows).
void panel_group(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t k_size,
                 const float* bias, float* y, int64_t ldy, int count, int last_cols, const float* next,
                 int next_count) {
  const int64_t stride = k_size * kPanel;
  Prefetch ahead;
  if (k_size <= kDepth && next != nullptr) {
    ahead.start = next;
    ahead.stride = stride;
    ahead.depth = k_size;
    ahead.panels = next_count;
  }
  for (int64_t k0 = 0; k0 < k_size; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, k_size - k0);
    const bool first = k0 == 0, last = k0 + depth == k_size;
    const float* b = last ? bias : nullptr;
    const float* xs = x + k0;
    const float* ps = panels + k0 * kPanel;
    switch (count) {
      case 4: rows_pass_of<4>(xs, ldx, rows, ps, stride, depth, first, b, y, ldy, last_cols, ahead); break;
      case 3: rows_pass_of<3>(xs, ldx, rows, ps, stride, depth, first, b, y, ldy, last_cols, ahead); break;
      case 2: rows_pass_of<2>(xs, ldx, rows, ps, stride, depth, first, b, y, ldy, last_cols, ahead); break;
      default: rows_pass_of<1>(xs, ldx, rows, ps, stride, depth, first, b, y, ldy, last_cols, ahead); break;
    }
  }
}

#else  // AVX2 + FMA, or portable C++
#if defined(__AVX2__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
// Rows x (16 * Panels) outputs: rows of x against Panels consecutive panels. The accumulators
// (2 * Rows * Panels registers) are independent FMA chains; a Zen 3 / Skylake core needs
// about eight in flight to keep both FMA pipes busy, hence the wide shapes for few rows.
template <int Rows, int Panels>
inline void tile(const float* x, int64_t ldx, const float* panels, int64_t k_size,
                 const float* bias, float* y, int64_t ldy, int cols) {
  constexpr int kAcc = Rows * Panels;
  const int64_t panel_stride = k_size * kPanel;
  __m256 lo[kAcc], hi[kAcc];  // output (m, p) in lo/hi[m * Panels + p]
#pragma GCC unroll 16
  for (int i = 0; i < kAcc; ++i) {
    lo[i] = _mm256_setzero_ps();
    hi[i] = _mm256_setzero_ps();
  }
  // The panels after this tile's, at the same k: the next tile's data (from DRAM on a decode
  // step, whose weights far exceed the caches) is requested a whole tile ahead, further than
  // the hardware prefetcher runs. Past the weight's end the hint is dropped, never faults.
  const float* ahead = panels + Panels * panel_stride;
  for (int64_t k = 0; k < k_size; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + k * kPanel), _MM_HINT_T0);
    __m256 w_lo[Panels], w_hi[Panels];
#pragma GCC unroll 4
    for (int p = 0; p < Panels; ++p) {
      w_lo[p] = _mm256_loadu_ps(panels + p * panel_stride + k * kPanel);
      w_hi[p] = _mm256_loadu_ps(panels + p * panel_stride + k * kPanel + 8);
    }
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m256 xm = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 4
      for (int p = 0; p < Panels; ++p) {
        lo[m * Panels + p] = _mm256_fmadd_ps(xm, w_lo[p], lo[m * Panels + p]);
        hi[m * Panels + p] = _mm256_fmadd_ps(xm, w_hi[p], hi[m * Panels + p]);
      }
    }
  }
  // cols < 16 only on the weight's last panel, the tile's last (see rows_across).
#pragma GCC unroll 4
  for (int p = 0; p < Panels; ++p) {
    const int width = p == Panels - 1 ? cols : kPanel;
    alignas(32) float bias_tile[kPanel] = {};
    if (bias != nullptr) std::memcpy(bias_tile, bias + p * kPanel, sizeof(float) * width);
    const __m256 b_lo = _mm256_load_ps(bias_tile), b_hi = _mm256_load_ps(bias_tile + 8);
    alignas(32) float out[Rows][kPanel];
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      _mm256_store_ps(out[m], _mm256_add_ps(lo[m * Panels + p], b_lo));
      _mm256_store_ps(out[m] + 8, _mm256_add_ps(hi[m * Panels + p], b_hi));
    }
    for (int m = 0; m < Rows; ++m) std::memcpy(y + m * ldy + p * kPanel, out[m], sizeof(float) * width);
  }
}
#else
constexpr const char* kIsa = "portable";
template <int Rows, int Panels>
inline void tile(const float* x, int64_t ldx, const float* panels, int64_t k_size,
                 const float* bias, float* y, int64_t ldy, int cols) {
  for (int p = 0; p < Panels; ++p) {
    const float* panel = panels + p * k_size * kPanel;
    const int width = p == Panels - 1 ? cols : kPanel;
    float acc[Rows][kPanel] = {};
    for (int64_t k = 0; k < k_size; ++k) {
      for (int m = 0; m < Rows; ++m) {
        const float xm = x[m * ldx + k];
        for (int j = 0; j < kPanel; ++j) acc[m][j] += xm * panel[k * kPanel + j];
      }
    }
    for (int m = 0; m < Rows; ++m) {
      for (int j = 0; j < width; ++j) {
        y[m * ldy + p * kPanel + j] = acc[m][j] + (bias ? bias[p * kPanel + j] : 0.f);
      }
    }
  }
}
#endif

// Tiles of Rows rows across a group of `count` panels, Panels at a time.
template <int Rows, int Panels>
void rows_across(const float* x, int64_t ldx, const float* panels, int64_t k_size,
                 const float* bias, float* y, int64_t ldy, int count, int last_cols) {
  for (int p = 0; p < count; p += Panels) {
    const int cols = p + Panels == count ? last_cols : kPanel;
    tile<Rows, Panels>(x, ldx, panels + p * k_size * kPanel, k_size,
                       bias ? bias + p * kPanel : nullptr, y + p * kPanel, ldy, cols);
  }
}

// The last Rows (< 6) rows of a group: `Wide` panels per tile when the group is whole (the
// multi-panel shapes need all four), one panel per tile when the weight ends first.
template <int Rows, int Wide>
void remainder_rows(const float* x, int64_t ldx, const float* panels, int64_t k_size,
                    const float* bias, float* y, int64_t ldy, int count, int last_cols) {
  if (count == kGroup) rows_across<Rows, Wide>(x, ldx, panels, k_size, bias, y, ldy, count, last_cols);
  else rows_across<Rows, 1>(x, ldx, panels, k_size, bias, y, ldy, count, last_cols);
}

// Rows [0, rows) of x against `count` consecutive panels (count == kGroup unless the weight
// ends first). Full six-row tiles take one panel at a time; the last few rows take a shape
// with at least eight accumulators, spanning several panels, which re-read from cache the
// panels the six-row tiles just streamed in. Every output is still one in-order FMA sum over
// k, so a row's result never depends on the tile (or batch) it was computed in.
// (`next` is unused here: these tiles prefetch the panels after their own themselves.)
void panel_group(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t k_size,
                 const float* bias, float* y, int64_t ldy, int count, int last_cols, const float* /*next*/,
                 int /*next_count*/) {
  int64_t m = 0;
  for (; m + kTileRows <= rows; m += kTileRows) {
    rows_across<kTileRows, 1>(x + m * ldx, ldx, panels, k_size, bias, y + m * ldy, ldy, count, last_cols);
  }
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  switch (rows - m) {
    case 5: remainder_rows<5, 1>(xm, ldx, panels, k_size, bias, ym, ldy, count, last_cols); break;
    case 4: remainder_rows<4, 1>(xm, ldx, panels, k_size, bias, ym, ldy, count, last_cols); break;
    case 3: remainder_rows<3, 2>(xm, ldx, panels, k_size, bias, ym, ldy, count, last_cols); break;
    case 2: remainder_rows<2, 2>(xm, ldx, panels, k_size, bias, ym, ldy, count, last_cols); break;
    case 1: remainder_rows<1, 4>(xm, ldx, panels, k_size, bias, ym, ldy, count, last_cols); break;
    default: break;
  }
}

#endif  // __AVX512F__

// How n output columns split into groups of kGroup panels (the unit of work a thread takes),
// and whether the call is worth a parallel region: it costs microseconds (and far more when
// another process holds a core and the team waits for it); below kParallelWork multiply-adds
// one thread is faster.
struct PanelGroups {
  int64_t panels, groups;
  int last_cols;
  bool parallel;

  PanelGroups(int64_t m, int64_t n, int64_t k, int32_t num_threads)
      : panels((n + kPanel - 1) / kPanel), groups((panels + kGroup - 1) / kGroup),
        last_cols(static_cast<int>(n - (panels - 1) * kPanel)),
        parallel(num_threads > 1 && groups > 1 && m * n * k >= kParallelWork) {}
  // Panels in group g: kGroup except where the weight ends first.
  int count(int64_t g) const { return static_cast<int>(std::min<int64_t>(kGroup, panels - g * kGroup)); }
  // Columns in group g's last panel: 16 except in the weight's last panel.
  int cols(int64_t g) const { return g * kGroup + count(g) == panels ? last_cols : kPanel; }
};

}  // namespace

extern "C" {

int64_t vgraph_linear_panel_width() { return kPanel; }

// The instruction set this build's tiles use: "avx512", "avx2" or "portable" (chosen at
// build time by -march=native; ops/linear.py logs it).
const char* vgraph_linear_isa() { return kIsa; }

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ W^T + bias (nullable). Each panel
// is read from memory once and takes every row while it sits in cache. Groups of panels
// are shared out among threads.
void vgraph_linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* packed,
                   int64_t n, const float* bias, float* y, int64_t ldy, int32_t num_threads) {
  const PanelGroups split(m, n, k, num_threads);
#pragma omp parallel num_threads(num_threads) if (split.parallel)
  {
    // Each thread takes a contiguous run of groups, so that it prefetches only its own next
    // group (prefetching another thread's would read those panels from DRAM twice).
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t end = split.groups * (t + 1) / threads;
    for (int64_t g = split.groups * t / threads; g < end; ++g) {
      const int64_t first = g * kGroup;
      const bool more = g + 1 < end;
      panel_group(x, ldx, m, packed + first * k * kPanel, k, bias ? bias + first * kPanel : nullptr,
                  y + first * kPanel, ldy, split.count(g), split.cols(g),
                  more ? packed + (first + kGroup) * k * kPanel : nullptr, more ? split.count(g + 1) : 0);
    }
  }
}

// Packs the `count` panels from row `first_row` of a row-major weight w [n, k] (row stride
// ldw) into `out` as [count][k][16], zero past row n: pack_weight's layout for one group.
static void pack_group(const float* w, int64_t ldw, int64_t n, int64_t k, int64_t first_row, int count,
                       float* out) {
  for (int p = 0; p < count; ++p) {
    float* panel = out + p * k * kPanel;
    const int64_t row0 = first_row + p * kPanel;
    const int width = static_cast<int>(std::min<int64_t>(kPanel, n - row0));
    const float* src[kPanel];
    for (int j = 0; j < kPanel; ++j) src[j] = w + (row0 + std::min(j, width - 1)) * ldw;
    // k outer: the writes run front to back and each row's cache line serves 16 steps of k.
    for (int64_t kk = 0; kk < k; ++kk) {
#pragma GCC unroll 16
      for (int j = 0; j < kPanel; ++j) panel[kk * kPanel + j] = j < width ? src[j][kk] : 0.f;
    }
  }
}

// The same product over a weight left row-major (W [n, k], row stride ldw): each thread packs
// one group of panels at a time into its own buffer (a quarter MiB at k = 1024; it stays in
// L2) and runs the packed tiles on it. For a weight that must stay unpacked: a tied lm_head
// shares the embedding's storage, and a packed copy would double what is often a small
// model's largest matrix. Packing costs one pass over the group per call, a few percent of
// the tiles' work at decode batch sizes; results are the same in-order sums as vgraph_linear.
void vgraph_linear_rows(const float* x, int64_t ldx, int64_t m, int64_t k, const float* w, int64_t ldw,
                        int64_t n, const float* bias, float* y, int64_t ldy, int32_t num_threads) {
  const PanelGroups split(m, n, k, num_threads);
#pragma omp parallel num_threads(num_threads) if (split.parallel)
  {
    std::vector<float> buffer(static_cast<size_t>(kGroup * k * kPanel));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < split.groups; ++g) {
      const int64_t first = g * kGroup;
      pack_group(w, ldw, n, k, first * kPanel, split.count(g), buffer.data());
      panel_group(x, ldx, m, buffer.data(), k, bias ? bias + first * kPanel : nullptr,
                  y + first * kPanel, ldy, split.count(g), split.cols(g), nullptr, 0);
    }
  }
}

}  // extern "C"
