// Paged attention for short query segments (decode rows, short chunks), reading the paged
// KV cache in place.
//
// Why C++: the batched torch path gathers every sequence's K/V into a padded copy and runs
// SDPA over it, so each decode step passes over the KV cache about three times (gather
// write, gather read, SDPA read) plus mask traffic. Here each work item (one segment, one KV
// head) walks the sequence's blocks through the block table and reads every K and V row
// once, scoring it against all query heads of the GQA group while the row is in L1. An
// online softmax (running max and sum, rescaled once per chunk of blocks) keeps the whole
// thing one pass. Long segments go to prefill_attention_cpu.cpp instead.
//
// Contract (checked by the Python caller, ops/cpu_attention_native.py): q and out are
// contiguous float32 [tokens, q_heads, head_dim]; the caches are [blocks, block_size,
// kv_heads, head_dim] with any strides, in float32, bfloat16 or float16; accumulation is
// float32. Only keys 0..seq_len-1 are read, so table entries past a sequence's end may be
// stale. A block id outside [0, num_blocks) is reported, never read.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_attention_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace vgraph_attention;

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 forms of the three inner loops. The compiler's own vectorisation of the dot product
// kept its accumulator in memory; these keep two in registers.
inline float hsum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
}

inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out[r * out_stride + t] = q_r . k_t for R query rows (q_stride apart: the query heads of
// one GQA group) and `keys` K rows `stride` apart, four K rows per pass: 4R independent
// accumulators hide the FMA latency, each K load serves all R query rows and each q load
// all four keys. Every (row, key) sum is formed the same way whatever R is.
template <int R>
inline void dot_rows(const float* __restrict q, int64_t q_stride, const float* __restrict k,
                     int64_t stride, int keys, int n, float* __restrict out, int64_t out_stride) {
  int t = 0;
  for (; t + 4 <= keys; t += 4) {
    const float* k0 = k + t * stride;
    const float *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
    __m256 acc[4 * R];
#pragma GCC unroll 8
    for (int j = 0; j < 4 * R; ++j) acc[j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 kv0 = _mm256_loadu_ps(k0 + i), kv1 = _mm256_loadu_ps(k1 + i);
      const __m256 kv2 = _mm256_loadu_ps(k2 + i), kv3 = _mm256_loadu_ps(k3 + i);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * q_stride + i);
        acc[4 * r] = _mm256_fmadd_ps(qv, kv0, acc[4 * r]);
        acc[4 * r + 1] = _mm256_fmadd_ps(qv, kv1, acc[4 * r + 1]);
        acc[4 * r + 2] = _mm256_fmadd_ps(qv, kv2, acc[4 * r + 2]);
        acc[4 * r + 3] = _mm256_fmadd_ps(qv, kv3, acc[4 * r + 3]);
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      // [a0 a1 a2 a3] from the four 8-lane sums: two rounds of pairwise adds, then the halves.
      const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(acc[4 * r], acc[4 * r + 1]),
                                          _mm256_hadd_ps(acc[4 * r + 2], acc[4 * r + 3]));
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
      alignas(16) float four[4];
      _mm_store_ps(four, sums);
      const float* qr = q + r * q_stride;
      for (int tail = i; tail < n; ++tail) {
        four[0] += qr[tail] * k0[tail]; four[1] += qr[tail] * k1[tail];
        four[2] += qr[tail] * k2[tail]; four[3] += qr[tail] * k3[tail];
      }
      std::memcpy(out + r * out_stride + t, four, sizeof(four));
    }
  }
  for (; t < keys; ++t) {
    for (int r = 0; r < R; ++r) out[r * out_stride + t] = dot(q + r * q_stride, k + t * stride, n);
  }
}

// acc_r += sum_t p_r[t] * v_t for R rows (acc_stride / p_stride apart) over `keys` V rows
// `stride` apart. The accumulators are held in registers 32 lanes at a time across all the
// V rows, instead of loaded and stored once per row, and each V load serves all R rows.
template <int R>
inline void accumulate_rows(float* __restrict acc, int64_t acc_stride, const float* __restrict p,
                            int64_t p_stride, const float* __restrict v, int64_t stride, int keys,
                            int n) {
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256 c[4 * R];
#pragma GCC unroll 8
    for (int j = 0; j < 4 * R; ++j) c[j] = _mm256_loadu_ps(acc + (j / 4) * acc_stride + i + (j % 4) * 8);
    for (int t = 0; t < keys; ++t) {
      const float* vt = v + t * stride + i;
      const __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8);
      const __m256 v2 = _mm256_loadu_ps(vt + 16), v3 = _mm256_loadu_ps(vt + 24);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256 pt = _mm256_set1_ps(p[r * p_stride + t]);
        c[4 * r] = _mm256_fmadd_ps(pt, v0, c[4 * r]);
        c[4 * r + 1] = _mm256_fmadd_ps(pt, v1, c[4 * r + 1]);
        c[4 * r + 2] = _mm256_fmadd_ps(pt, v2, c[4 * r + 2]);
        c[4 * r + 3] = _mm256_fmadd_ps(pt, v3, c[4 * r + 3]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < 4 * R; ++j) _mm256_storeu_ps(acc + (j / 4) * acc_stride + i + (j % 4) * 8, c[j]);
  }
  for (int r = 0; r < R; ++r) {
    float* acc_r = acc + r * acc_stride;
    const float* p_r = p + r * p_stride;
    for (int j = i; j + 8 <= n; j += 8) {
      __m256 c = _mm256_loadu_ps(acc_r + j);
      for (int t = 0; t < keys; ++t) {
        c = _mm256_fmadd_ps(_mm256_set1_ps(p_r[t]), _mm256_loadu_ps(v + t * stride + j), c);
      }
      _mm256_storeu_ps(acc_r + j, c);
    }
    for (int j = i + (n - i) / 8 * 8; j < n; ++j) {
      for (int t = 0; t < keys; ++t) acc_r[j] += p_r[t] * v[t * stride + j];
    }
  }
}

// The largest of score[0..n).
inline float max_of(const float* score, int n) {
  float best = -std::numeric_limits<float>::infinity();
  int t = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(score);
    for (t = 8; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(score + t));
    const __m128 half = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
    best = _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
  }
  for (; t < n; ++t) best = std::max(best, score[t]);
  return best;
}

// exp(x) for x <= 0 (scores minus their running max), 8 lanes: n = round(x / ln 2),
// r = x - n ln 2 in two parts, exp(r) by a degree-7 polynomial (~1 ulp), times 2^n. Lanes
// below -87.3 (including -inf, the causal mask) give 0: such a weight is < 2^-126 of the
// row's largest and cannot change a float32 sum.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.3f);
  const __m256 vanish = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(vanish, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// score[t] = exp(score[t] - max) in place; returns their sum.
inline float exp_shifted(float* score, int n, float max) {
  const __m256 shift = _mm256_set1_ps(max);
  __m256 total = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(score + t), shift));
    _mm256_storeu_ps(score + t, p);
    total = _mm256_add_ps(total, p);
  }
  float sum = hsum(total);
  for (; t < n; ++t) {
    score[t] = std::exp(score[t] - max);
    sum += score[t];
  }
  return sum;
}
#else
template <int R>
inline void dot_rows(const float* q, int64_t q_stride, const float* k, int64_t stride, int keys,
                     int n, float* out, int64_t out_stride) {
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < keys; ++t) {
      float sum = 0.f;
      for (int i = 0; i < n; ++i) sum += q[r * q_stride + i] * k[t * stride + i];
      out[r * out_stride + t] = sum;
    }
  }
}

template <int R>
inline void accumulate_rows(float* acc, int64_t acc_stride, const float* p, int64_t p_stride,
                            const float* v, int64_t stride, int keys, int n) {
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < keys; ++t) {
      for (int i = 0; i < n; ++i) acc[r * acc_stride + i] += p[r * p_stride + t] * v[t * stride + i];
    }
  }
}

inline float max_of(const float* score, int n) {
  float best = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) best = std::max(best, score[t]);
  return best;
}

inline float exp_shifted(float* score, int n, float max) {
  float sum = 0.f;
  for (int t = 0; t < n; ++t) {
    score[t] = std::exp(score[t] - max);
    sum += score[t];
  }
  return sum;
}
#endif

// Keys per softmax update: a row's blocks are scored and accumulated in chunks of this many
// keys, so the online-softmax bookkeeping (block max, exponentials' sum, rescale of the
// accumulator) runs once per chunk, not once per block, and a chunk's blocks are swept into
// cache together (more misses in flight). Measured against one block per update on 8 layers
// of 64 decode rows of ~200 keys (2 threads, cache not in CPU caches): 1.02-1.09x on the
// perf Llama's heads (4 KV heads, groups of 2), 1.00-1.05x on the 0.5B shape's (2 KV, 7).
constexpr int kChunkKeys = 64;

inline int chunk_blocks(int block_size) { return std::max(1, kChunkKeys / block_size); }

// A run of consecutive blocks of one sequence: keys first_key .. first_key + keys - 1.
struct Chunk {
  int64_t blocks[kChunkKeys];
  int count;
  int64_t first_key;
  int keys;
};

// Per-thread buffers, kept across calls so the hot path never allocates.
struct Scratch {
  std::vector<float> q, acc, scores, row_max, row_sum, k_block, v_block;
  float sink = 0.f;  // keeps touch_block's loads from being optimised away

  void fit(int rows, int head_dim, int block_size) {
    const size_t vectors = static_cast<size_t>(rows) * head_dim;
    if (q.size() < vectors) { q.resize(vectors); acc.resize(vectors); }
    const size_t chunk = static_cast<size_t>(chunk_blocks(block_size)) * block_size;
    if (scores.size() < 2 * chunk) scores.resize(2 * chunk);
    if (row_max.size() < static_cast<size_t>(rows)) { row_max.resize(rows); row_sum.resize(rows); }
    const size_t block = chunk * head_dim;
    if (k_block.size() < block) { k_block.resize(block); v_block.resize(block); }
  }
};

// The query vectors of one work item: `rows` = query tokens x query heads of the item's KV
// heads [kv_begin, kv_end), token-major. Row r is token r / heads of the segment and query
// head q_begin + r % heads, which reads KV head (q_begin + r % heads) / group.
struct Item {
  int64_t seq, first_row, q_len, seq_len;
  int kv_begin, kv_end, group, heads, rows;
};

// One row's scores of a chunk's keys -> unnormalised probabilities, with the online-softmax
// update: the running max moves, and the accumulator and sum are rescaled once per chunk.
void softmax_update(Scratch& s, int r, float* score, int keys, int head_dim) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float block_max = max_of(score, keys);
  if (block_max == neg_inf) {  // every key of this block is in this row's future
    std::fill_n(score, keys, 0.f);
    return;
  }
  const float new_max = std::max(s.row_max[r], block_max);
  const float rescale = std::exp(s.row_max[r] - new_max);  // 0 on the row's first block
  const float sum = exp_shifted(score, keys, new_max);
  if (rescale != 1.f) {
    float* acc = &s.acc[static_cast<size_t>(r) * head_dim];
    for (int i = 0; i < head_dim; ++i) acc[i] *= rescale;
  }
  s.row_sum[r] = s.row_sum[r] * rescale + sum;
  s.row_max[r] = new_max;
}

// One chunk of keys for every row of one KV head: every block's K rows scored against the
// group's query heads two at a time, one softmax update per row, then every block's V rows
// accumulated, while the chunk's rows for this head are in L1/L2 (touch_block swept them in).
void attend_chunk(const PagedAttentionArgs& a, const Item& it, Scratch& s, const Chunk& c, int kv) {
  const int d = a.head_dim, bs = a.block_size, cap = chunk_blocks(bs) * bs;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float* k[kChunkKeys];
  const float* v[kChunkKeys];
  int64_t k_stride = 0, v_stride = 0;
  for (int b = 0; b < c.count; ++b) {
    const int keys = std::min(bs, c.keys - b * bs);
    const size_t at = static_cast<size_t>(b) * bs * d;
    k[b] = rows_as_float(a.k_cache, c.blocks[b] * a.k_strides[0] + kv * a.k_strides[2],
                         a.k_strides[1], a.cache_dtype, keys, d, s.k_block.data() + at, &k_stride, a.k_scale);
    v[b] = rows_as_float(a.v_cache, c.blocks[b] * a.v_strides[0] + kv * a.v_strides[2],
                         a.v_strides[1], a.cache_dtype, keys, d, s.v_block.data() + at, &v_stride, a.v_scale);
  }
  const int local = (kv - it.kv_begin) * it.group;
  for (int64_t j = 0; j < it.q_len; ++j) {
    const int64_t last_visible = it.seq_len - it.q_len + j - c.first_key;  // causal
    const int visible = static_cast<int>(std::min<int64_t>(c.keys, last_visible + 1));
    for (int g = 0; g < it.group; g += 2) {
      const int r = static_cast<int>(j) * it.heads + local + g;
      const int pair = g + 1 < it.group ? 2 : 1;
      float* q = &s.q[static_cast<size_t>(r) * d];
      float* acc = &s.acc[static_cast<size_t>(r) * d];
      float* scores = s.scores.data();
      for (int b = 0; b < c.count; ++b) {
        const int seen = std::min(bs, visible - b * bs);
        if (seen <= 0) break;
        if (pair == 2) dot_rows<2>(q, d, k[b], k_stride, seen, d, scores + b * bs, cap);
        else dot_rows<1>(q, d, k[b], k_stride, seen, d, scores + b * bs, cap);
      }
      for (int p = 0; p < pair; ++p) {
        float* score = scores + p * cap;
        for (int t = 0; t < visible; ++t) score[t] *= a.scale;
        for (int t = std::max(visible, 0); t < c.keys; ++t) score[t] = neg_inf;
        softmax_update(s, r + p, score, c.keys, d);
      }
      for (int b = 0; b < c.count; ++b) {
        const int seen = std::min(bs, visible - b * bs);
        if (seen <= 0) break;
        if (pair == 2) accumulate_rows<2>(acc, d, scores + b * bs, cap, v[b], v_stride, seen, d);
        else accumulate_rows<1>(acc, d, scores + b * bs, cap, v[b], v_stride, seen, d);
      }
    }
  }
}

inline float touch_rows(const char* base, int64_t token_bytes, int keys, int64_t bytes) {
  float sum = 0.f;
  for (int t = 0; t < keys; ++t) {
    const char* row = base + t * token_bytes;
    for (int64_t line = 0; line < bytes; line += 64) sum += *reinterpret_cast<const float*>(row + line);
  }
  return sum;
}

// Reads one word of every cache line of the block's K and V rows (the item's heads), front
// to back, before the per-head passes. Those passes walk the block once per KV head at a
// token stride, which the hardware prefetcher follows poorly; this sequential sweep pulls
// the block in at close to streaming bandwidth (measured: 1.12 -> 0.87 ms per layer for 8
// sequences of 400 tokens whose cache is not in any CPU cache). Tried instead and slower on
// a Zen 4 VM: software prefetch of the next one or two blocks (any hint), and sweeping the
// next block in slices between the current block's head passes.
void touch_block(const PagedAttentionArgs& a, const Item& it, Scratch& s, int64_t block, int keys) {
  const int elem = element_bytes(a.cache_dtype);
  const int64_t bytes = static_cast<int64_t>(it.kv_end - it.kv_begin) * a.head_dim * elem;
  const char* k = static_cast<const char*>(a.k_cache) +
                  (block * a.k_strides[0] + it.kv_begin * a.k_strides[2]) * elem;
  const char* v = static_cast<const char*>(a.v_cache) +
                  (block * a.v_strides[0] + it.kv_begin * a.v_strides[2]) * elem;
  s.sink += touch_rows(k, a.k_strides[1] * elem, keys, bytes) +
            touch_rows(v, a.v_strides[1] * elem, keys, bytes);
}

// One segment's query rows for the query heads of KV heads [kv_begin, kv_end). Returns 0,
// or 1 + the sequence index when its block table points outside the cache.
int64_t attend(const PagedAttentionArgs& a, int64_t segment, int kv_begin, int kv_end,
               Scratch& s) {
  const int64_t* seg = a.segments + 4 * segment;
  Item it;
  it.seq = seg[0]; it.first_row = seg[1]; it.q_len = seg[2]; it.seq_len = seg[3];
  it.kv_begin = kv_begin; it.kv_end = kv_end;
  it.group = a.q_heads / a.kv_heads;
  it.heads = (kv_end - kv_begin) * it.group;
  it.rows = static_cast<int>(it.q_len) * it.heads;
  const int d = a.head_dim, q_begin = kv_begin * it.group;
  s.fit(it.rows, d, a.block_size);
  for (int r = 0; r < it.rows; ++r) {
    const int64_t token = it.first_row + r / it.heads, head = q_begin + r % it.heads;
    std::memcpy(&s.q[static_cast<size_t>(r) * d], a.q + (token * a.q_heads + head) * d,
                sizeof(float) * d);
    std::fill_n(&s.acc[static_cast<size_t>(r) * d], d, 0.f);
    s.row_max[r] = -std::numeric_limits<float>::infinity();
    s.row_sum[r] = 0.f;
  }
  const int per_chunk = chunk_blocks(a.block_size);
  Chunk c;
  for (int64_t index = 0, first_key = 0; first_key < it.seq_len; first_key += c.keys) {
    c.first_key = first_key;
    c.keys = static_cast<int>(std::min<int64_t>(int64_t{per_chunk} * a.block_size, it.seq_len - first_key));
    c.count = (c.keys + a.block_size - 1) / a.block_size;
    for (int b = 0; b < c.count; ++b, ++index) {
      c.blocks[b] = block_id(a, it.seq, index);
      if (c.blocks[b] < 0 || c.blocks[b] >= a.num_blocks) return 1 + it.seq;
      touch_block(a, it, s, c.blocks[b], std::min(a.block_size, c.keys - b * a.block_size));
    }
    for (int kv = it.kv_begin; kv < it.kv_end; ++kv) attend_chunk(a, it, s, c, kv);
  }
  for (int r = 0; r < it.rows; ++r) {
    const int64_t token = it.first_row + r / it.heads, head = q_begin + r % it.heads;
    float* out = a.out + (token * a.q_heads + head) * d;
    const float inv = 1.f / s.row_sum[r];  // row_sum > 0: key 0 is never in a row's future
    for (int i = 0; i < d; ++i) out[i] = s.acc[static_cast<size_t>(r) * d + i] * inv;
  }
  return 0;
}

thread_local Scratch tls_scratch;

}  // namespace

extern "C" {

int64_t vgraph_paged_attention_args_size() { return sizeof(PagedAttentionArgs); }

// Returns 0, or 1 + the index of a sequence whose block table points outside the cache (its
// rows are then unspecified). A work item is a segment with all its KV heads, so a block is
// read front to back; with several threads and few segments the heads are split into
// chunks, so that every thread has work.
int64_t vgraph_paged_attention(const PagedAttentionArgs* args) {
  const PagedAttentionArgs& a = *args;
  // A parallel region costs microseconds (far more when another process holds a core and
  // the team waits for it): small batches run on one thread.
  int64_t work = 0;
  for (int64_t i = 0; i < a.num_segments; ++i) work += a.segments[4 * i + 2] * a.segments[4 * i + 3];
  const int num_threads = work * a.q_heads * a.head_dim >= (int64_t{1} << 18) ? a.num_threads : 1;
  int64_t chunks = 1;
  if (num_threads > 1 && a.num_segments < 2 * num_threads) {
    chunks = std::min<int64_t>(a.kv_heads, (2 * num_threads + a.num_segments - 1) /
                                               std::max<int64_t>(a.num_segments, 1));
  }
  const int64_t per_chunk = (a.kv_heads + chunks - 1) / chunks;
  chunks = (a.kv_heads + per_chunk - 1) / per_chunk;
  return run_items(a.num_segments * chunks, num_threads, [&](int64_t item) {
    const int begin = static_cast<int>((item % chunks) * per_chunk);
    const int end = static_cast<int>(std::min<int64_t>(a.kv_heads, begin + per_chunk));
    return attend(a, item / chunks, begin, end, tls_scratch);
  });
}

}  // extern "C"
