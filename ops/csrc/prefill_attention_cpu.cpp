// Causal attention for long query segments (prefills, long chunks, prefix-cache hits), reading
// the paged KV cache in place, every segment of a batch in one call.
//
// Why C++: the torch path runs one scaled_dot_product_attention per prefill per layer from
// Python (one parallel region each, and a gathered K/V copy for a segment with cached
// context); on a batch of short prompts that costs more than the attention's arithmetic
// (measured at 15-38 GFLOP/s on 64-256-token prompts, 2 cores). Here the whole batch is one
// parallel loop over work items (segment, KV head, tile of query tokens).
//
// Layout: an item's rows (its query tokens x the heads of one GQA group) are the vector
// lanes. Its queries are packed once, transposed and pre-scaled, as qt[d][row]; then per tile
// of keys
//   st[t][row] = sum_d K[t][d] * qt[d][row]        (scores, transposed)
//   online softmax per lane (running max and sum, the accumulator rescaled once per tile)
//   ot[d][row] += sum_t V[t][d] * st[t][row]       (output, transposed)
// K and V values are broadcast straight from the cache rows, so neither is packed or
// transposed, and every FMA is a full vector of query rows: GEMM-shaped on both sides.
// Key tiles past the item's last query position are never touched (the causal triangle);
// the tiles on the diagonal are computed in full and masked.
//
// Contract: as paged_attention_cpu.cpp (paged_attention_common.h). Accumulation is float32,
// rows are scored in a different order from SDPA, so results agree to rounding, not bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_attention_common.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using namespace vgraph_attention;

// One vector of query rows: 16 lanes with AVX-512, 8 with AVX2, 4 elsewhere. kVecs of them
// make a micro-tile's width, sized so its kBroadcasts x kVecs accumulators, kVecs loads and
// one broadcast fit the register file (32 zmm, 16 ymm).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVecs = 4;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kVecs = 2;
#else
constexpr int kLanes = 4;
constexpr int kVecs = 2;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
constexpr int kBroadcasts = 6;  // keys (scores) or head-dim values (output) per micro-tile
constexpr int kKeyTile = 64;    // keys per softmax step
constexpr int kTileRows = 64;   // query rows an item aims for (tokens x group heads)

// x in every lane: one broadcast (`vfloat{} + x` would also add +0.0, an extra instruction
// in the inner loops).
inline vfloat splat(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_set1_ps(x);
#else
  return vfloat{x, x, x, x};
#endif
}

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// a * b + c, one rounding (the ISO dialect the kernels build with does not contract a * b + c).
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// exp(x) for x <= 0 (scores minus their running max): n = round(x / ln 2), r = x - n ln 2 in
// two parts, exp(r) by a degree-7 polynomial (~1 ulp), times 2^n. Lanes below -87.3
// (including -inf, the causal mask) give 0: such a weight is < 2^-126 of the row's largest.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat floor = splat(-87.3f);
  const vint vanish = x < floor;
  x = vmax(x, floor);
  const vfloat round_magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vfloat n = (x * splat(1.44269504088896341f) + round_magic) - round_magic;
  vfloat r = fmadd(n, splat(-0.693359375f), x);
  r = fmadd(n, splat(2.12194440e-4f), r);
  vfloat p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p, r * r, r + splat(1.f));
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return reinterpret_cast<vfloat>(reinterpret_cast<vint>(p * reinterpret_cast<vfloat>(bits)) & ~vanish);
}

// st[t][r0 + ...] = sum_d K_t[d] * qt[d][r0 + ...] for N keys and C row vectors.
template <int N, int C>
inline void score_tile(const float* const* keys, const float* qt, int rp, int head_dim,
                       float* st, int r0) {
  vfloat acc[N][C];
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) acc[n][c] = vfloat{};
  for (int d = 0; d < head_dim; ++d) {
    vfloat q[C];
    for (int c = 0; c < C; ++c) q[c] = load(qt + static_cast<int64_t>(d) * rp + r0 + c * kLanes);
    for (int n = 0; n < N; ++n) {
      const vfloat k = splat(keys[n][d]);
      for (int c = 0; c < C; ++c) acc[n][c] = fmadd(k, q[c], acc[n][c]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) store(st + static_cast<int64_t>(n) * rp + r0 + c * kLanes, acc[n][c]);
}

// ot[d0 + n][r0 + ...] += sum_t V_t[d0 + n] * st[t][r0 + ...] for N head-dim values and C
// row vectors, over `count` keys.
template <int N, int C>
inline void value_tile(const float* const* values, int count, int d0, const float* st, int rp,
                       float* ot, int r0) {
  vfloat acc[N][C];
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) acc[n][c] = load(ot + static_cast<int64_t>(d0 + n) * rp + r0 + c * kLanes);
  for (int t = 0; t < count; ++t) {
    vfloat p[C];
    for (int c = 0; c < C; ++c) p[c] = load(st + static_cast<int64_t>(t) * rp + r0 + c * kLanes);
    for (int n = 0; n < N; ++n) {
      const vfloat v = splat(values[t][d0 + n]);
      for (int c = 0; c < C; ++c) acc[n][c] = fmadd(v, p[c], acc[n][c]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) store(ot + static_cast<int64_t>(d0 + n) * rp + r0 + c * kLanes, acc[n][c]);
}

// Runs F<N, C> over rows [0, rp) in micro-tiles of kVecs vectors, C smaller at the tail.
template <int N, template <int, int> class F, typename... Args>
inline void over_rows(int rp, Args... args) {
  int r0 = 0;
  for (; r0 + kVecs * kLanes <= rp; r0 += kVecs * kLanes) F<N, kVecs>::run(args..., r0);
  const int tail = (rp - r0) / kLanes;
  if (kVecs > 3 && tail == 3) F<N, (kVecs > 3 ? 3 : 1)>::run(args..., r0);
  else if (kVecs > 2 && tail == 2) F<N, (kVecs > 2 ? 2 : 1)>::run(args..., r0);
  else if (tail > 0) for (; r0 < rp; r0 += kLanes) F<N, 1>::run(args..., r0);
}

template <int N, int C>
struct Scores {
  static void run(const float* const* keys, const float* qt, int rp, int head_dim, float* st, int r0) {
    score_tile<N, C>(keys, qt, rp, head_dim, st, r0);
  }
};

template <int N, int C>
struct Values {
  static void run(const float* const* values, int count, int d0, const float* st, int rp, float* ot, int r0) {
    value_tile<N, C>(values, count, d0, st, rp, ot, r0);
  }
};

// Runs F<N, C> for a runtime N in [1, kBroadcasts] (the tail of a loop in steps of kBroadcasts,
// which would run at a quarter of the speed one broadcast at a time).
template <template <int, int> class F, typename... Args>
inline void over_rows_n(int n, int rp, Args... args) {
  switch (n) {
    case 1: over_rows<1, F>(rp, args...); break;
    case 2: over_rows<2, F>(rp, args...); break;
    case 3: over_rows<3, F>(rp, args...); break;
    case 4: over_rows<4, F>(rp, args...); break;
    case 5: over_rows<5, F>(rp, args...); break;
    default: over_rows<kBroadcasts, F>(rp, args...); break;
  }
}

// Scores of `count` keys, kBroadcasts at a time.
void scores(const float* const* keys, int count, const float* qt, int rp, int head_dim, float* st) {
  for (int t = 0; t < count; t += kBroadcasts) {
    over_rows_n<Scores>(std::min(kBroadcasts, count - t), rp, keys + t, qt, rp, head_dim,
                        st + static_cast<int64_t>(t) * rp);
  }
}

// The output's update by `count` keys' weights, kBroadcasts head-dim values at a time.
void accumulate(const float* const* values, int count, const float* st, int rp, int head_dim, float* ot) {
  for (int d = 0; d < head_dim; d += kBroadcasts) {
    over_rows_n<Values>(std::min(kBroadcasts, head_dim - d), rp, values, count, d, st, rp, ot);
  }
}

#if defined(__AVX512F__)
// The 16x16 block at m (rows `stride` apart) transposed in registers: v[i] = column i.
inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]);
  }
  __m512 u[16];
  for (int k = 0; k < 4; ++k) {
    const __m512d t0 = _mm512_castps_pd(t[4 * k]), t1 = _mm512_castps_pd(t[4 * k + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * k + 2]), t3 = _mm512_castps_pd(t[4 * k + 3]);
    u[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  // u[4k + j], 128-bit lane L: column 4L + j of rows 4k..4k+3.
  for (int j = 0; j < 4; ++j) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88), w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    v[j] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    v[8 + j] = _mm512_shuffle_f32x4(v0, w0, 0xdd);
    v[4 + j] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    v[12 + j] = _mm512_shuffle_f32x4(v1, w1, 0xdd);
  }
}
#endif

// The queries and outputs move between their [token][head][d] rows and the item's transposed
// [d][row] buffers. Done element by element that costs about as much as the arithmetic on a
// short prompt, so with AVX-512 and head_dim a multiple of 16 it goes 16x16 blocks at a time.
// `row_ptr(r)` is row r's head_dim floats.
template <typename RowPtr>
void pack_queries(RowPtr row_ptr, int rows, int rp, int head_dim, float scale, float* qt) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) {
    const __m512 factor = _mm512_set1_ps(scale);
    for (int r0 = 0; r0 < rp; r0 += 16) {
      for (int d0 = 0; d0 < head_dim; d0 += 16) {
        __m512 v[16];
        for (int i = 0; i < 16; ++i) {
          v[i] = r0 + i < rows ? _mm512_mul_ps(_mm512_loadu_ps(row_ptr(r0 + i) + d0), factor) : _mm512_setzero_ps();
        }
        transpose16(v);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(qt + static_cast<int64_t>(d0 + i) * rp + r0, v[i]);
      }
    }
    return;
  }
#endif
  std::fill_n(qt, static_cast<int64_t>(rp) * head_dim, 0.f);  // padding lanes: zero queries
  for (int r = 0; r < rows; ++r) {
    const float* q = row_ptr(r);
    for (int i = 0; i < head_dim; ++i) qt[static_cast<int64_t>(i) * rp + r] = q[i] * scale;
  }
}

template <typename RowPtr>
void unpack_outputs(const float* ot, const float* row_sum, int rows, int rp, int head_dim, RowPtr row_ptr) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) {
    for (int r0 = 0; r0 < rp; r0 += 16) {
      for (int d0 = 0; d0 < head_dim; d0 += 16) {
        __m512 v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(ot + static_cast<int64_t>(d0 + i) * rp + r0);
        transpose16(v);
        for (int i = 0; i < 16 && r0 + i < rows; ++i) {
          _mm512_storeu_ps(row_ptr(r0 + i) + d0, _mm512_mul_ps(v[i], _mm512_set1_ps(1.f / row_sum[r0 + i])));
        }
      }
    }
    return;
  }
#endif
  for (int r = 0; r < rows; ++r) {
    float* out = row_ptr(r);
    const float inv = 1.f / row_sum[r];
    for (int i = 0; i < head_dim; ++i) out[i] = ot[static_cast<int64_t>(i) * rp + r] * inv;
  }
}

// One item: query tokens [j0, j1) of a segment, with the query heads of one KV head.
struct Item {
  int64_t segment;
  int64_t j0, j1;
  int kv;
};

// Per-thread buffers, kept across calls so the hot path never allocates.
struct Scratch {
  std::vector<float> qt, st, ot, row_max, row_sum, k_rows, v_rows;
  std::vector<const float*> keys, values;

  void fit(int rp, int head_dim) {
    const size_t rows = static_cast<size_t>(rp);
    qt.resize(rows * head_dim); ot.resize(rows * head_dim); st.resize(rows * kKeyTile);
    row_max.resize(rows); row_sum.resize(rows);
    k_rows.resize(static_cast<size_t>(kKeyTile) * head_dim); v_rows.resize(k_rows.size());
    keys.resize(kKeyTile); values.resize(kKeyTile);
  }
};

// Pointers to the float32 rows of keys [t0, t0 + count) of one KV head (the cache's own rows,
// or converted copies). Returns false when a block id is outside the cache.
bool key_rows(const PagedAttentionArgs& a, int64_t seq, int64_t t0, int count, int kv, Scratch& s) {
  for (int t = 0; t < count;) {
    const int64_t index = (t0 + t) / a.block_size, slot = (t0 + t) % a.block_size;
    const int64_t block = block_id(a, seq, index);
    if (block < 0 || block >= a.num_blocks) return false;
    const int run = static_cast<int>(std::min<int64_t>(count - t, a.block_size - slot));
    int64_t k_stride, v_stride;
    const float* k = rows_as_float(a.k_cache, block * a.k_strides[0] + slot * a.k_strides[1] + kv * a.k_strides[2],
                                   a.k_strides[1], a.cache_dtype, run, a.head_dim,
                                   &s.k_rows[static_cast<size_t>(t) * a.head_dim], &k_stride, a.k_scale);
    const float* v = rows_as_float(a.v_cache, block * a.v_strides[0] + slot * a.v_strides[1] + kv * a.v_strides[2],
                                   a.v_strides[1], a.cache_dtype, run, a.head_dim,
                                   &s.v_rows[static_cast<size_t>(t) * a.head_dim], &v_stride, a.v_scale);
    for (int i = 0; i < run; ++i) {
      s.keys[t + i] = k + i * k_stride;
      s.values[t + i] = v + i * v_stride;
    }
    t += run;
  }
  return true;
}

// Scores of keys past a row's own position -> -inf. Row r (token j0 + r / group) sits at
// position pos0 + r / group; key t0 + t is hidden from the rows before (t0 + t - pos0) * group.
void mask_future(float* st, int count, int64_t t0, int64_t pos0, int group, int rows, int rp) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < count; ++t) {
    const int64_t first_seeing = (t0 + t - pos0) * group;
    if (first_seeing <= 0) continue;
    std::fill_n(st + static_cast<int64_t>(t) * rp, std::min<int64_t>(first_seeing, rows), neg_inf);
  }
}

// The online-softmax step for one tile of `count` keys, lane by lane: new running max, the
// scores turned into weights, the running sum and the output rescaled.
void softmax_step(Scratch& s, int count, int rp, int head_dim) {
  for (int r0 = 0; r0 < rp; r0 += kLanes) {
    float* st = s.st.data() + r0;
    vfloat tile_max = load(st);
    for (int t = 1; t < count; ++t) tile_max = vmax(tile_max, load(st + static_cast<int64_t>(t) * rp));
    const vfloat old_max = load(&s.row_max[r0]);
    const vfloat new_max = vmax(old_max, tile_max);  // finite: every row sees key 0 in tile 0
    const vfloat rescale = exp_nonpositive(old_max - new_max);  // 0 on the first tile
    vfloat sum = vfloat{};
    for (int t = 0; t < count; ++t) {
      const vfloat p = exp_nonpositive(load(st + static_cast<int64_t>(t) * rp) - new_max);
      store(st + static_cast<int64_t>(t) * rp, p);
      sum += p;
    }
    store(&s.row_sum[r0], load(&s.row_sum[r0]) * rescale + sum);
    store(&s.row_max[r0], new_max);
    for (int d = 0; d < head_dim; ++d) {
      float* o = s.ot.data() + static_cast<int64_t>(d) * rp + r0;
      store(o, load(o) * rescale);
    }
  }
}

// Returns 0, or 1 + the sequence index when its block table points outside the cache.
int64_t attend(const PagedAttentionArgs& a, const Item& item, Scratch& s) {
  const int64_t* seg = a.segments + 4 * item.segment;
  const int64_t seq = seg[0], first_row = seg[1], q_len = seg[2], seq_len = seg[3];
  const int group = a.q_heads / a.kv_heads, d = a.head_dim;
  const int rows = static_cast<int>(item.j1 - item.j0) * group;
  const int rp = (rows + kLanes - 1) / kLanes * kLanes;
  s.fit(rp, d);
  // Row r: token j0 + r / group, query head kv * group + r % group (padding lanes: zero
  // queries, harmless finite scores, never written out).
  const int64_t first = (first_row + item.j0) * a.q_heads + item.kv * group;
  const auto head_row = [&](int r) { return (first + (r / group) * a.q_heads + r % group) * d; };
  pack_queries([&](int r) { return a.q + head_row(r); }, rows, rp, d, a.scale, s.qt.data());
  std::fill(s.ot.begin(), s.ot.end(), 0.f);
  std::fill(s.row_max.begin(), s.row_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.end(), 0.f);
  const int64_t pos0 = seq_len - q_len + item.j0;  // position of the item's first token
  const int64_t key_end = pos0 + (item.j1 - item.j0);  // keys its last token sees
  for (int64_t t0 = 0; t0 < key_end; t0 += kKeyTile) {
    const int count = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - t0));
    if (!key_rows(a, seq, t0, count, item.kv, s)) return 1 + seq;
    scores(s.keys.data(), count, s.qt.data(), rp, d, s.st.data());
    if (t0 + count - 1 > pos0) mask_future(s.st.data(), count, t0, pos0, group, rows, rp);
    softmax_step(s, count, rp, d);
    accumulate(s.values.data(), count, s.st.data(), rp, d, s.ot.data());
  }
  // row_sum > 0: key 0 is never in a row's future.
  unpack_outputs(s.ot.data(), s.row_sum.data(), rows, rp, d, [&](int r) { return a.out + head_row(r); });
  return 0;
}

// Every segment's items, each segment's last (longest) query tiles first, so the dynamic
// schedule starts the big items early and the small ones fill the end.
std::vector<Item> plan_items(const PagedAttentionArgs& a) {
  const int group = a.q_heads / a.kv_heads;
  const int64_t tile_tokens = std::max(1, kTileRows / group);
  std::vector<Item> items;
  for (int64_t segment = 0; segment < a.num_segments; ++segment) {
    const int64_t q_len = a.segments[4 * segment + 2];
    for (int64_t j0 = (q_len - 1) / tile_tokens * tile_tokens; j0 >= 0; j0 -= tile_tokens) {
      for (int kv = 0; kv < a.kv_heads; ++kv) items.push_back({segment, j0, std::min(q_len, j0 + tile_tokens), kv});
    }
  }
  return items;
}

thread_local Scratch tls_scratch;

}  // namespace

extern "C" {

int64_t vgraph_prefill_attention_args_size() { return sizeof(PagedAttentionArgs); }

// Returns 0, or 1 + the index of a sequence whose block table points outside the cache (its
// rows are then unspecified).
int64_t vgraph_prefill_attention(const PagedAttentionArgs* args) {
  const PagedAttentionArgs& a = *args;
  const std::vector<Item> items = plan_items(a);
  return run_items(static_cast<int64_t>(items.size()), a.num_threads,
                   [&](int64_t i) { return attend(a, items[i], tls_scratch); });
}

}  // extern "C"
