// Paged attention for short query segments (decode rows, short chunks), reading the paged
// KV cache in place.
//
// Why C++: the batched torch path gathers every sequence's K/V into a padded copy and runs
// SDPA over it, so each decode step passes over the KV cache about three times (gather
// write, gather read, SDPA read) plus mask traffic. Here each work item (one segment, one KV
// head) walks the sequence's blocks through the block table and reads every K and V row
// once, scoring it against all query heads of the GQA group while the row is in L1. An
// online softmax (running max and sum, rescaled once per block) keeps the whole thing one
// pass. Long prefills stay on the SDPA path, whose GEMM-shaped flash kernel wins there.
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

enum CacheDType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Mirrored field for field by the ctypes Structure in ops/cpu_attention_native.py;
// vgraph_paged_attention_args_size() lets the loader check the layout agrees.
struct PagedAttentionArgs {
  const float* q;            // [tokens, q_heads, head_dim], contiguous
  float* out;                // same shape; rows of the segments are overwritten
  const void* k_cache;
  const void* v_cache;
  int64_t k_strides[3];      // block, slot-in-block, kv head (elements); head_dim is unit-stride
  int64_t v_strides[3];
  const void* block_table;   // [sequences, width], int32 or int64
  int64_t block_table_stride;
  const int64_t* segments;   // [num_segments, 4]: sequence, first query row, query rows, seq_len
  int64_t num_segments;
  int64_t num_blocks;
  int32_t q_heads;
  int32_t kv_heads;
  int32_t head_dim;
  int32_t block_size;
  int32_t cache_dtype;       // CacheDType
  int32_t block_table_is_int64;
  int32_t num_threads;
  float scale;
};

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline float f16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t wide;
  if (exponent == 0x1fu) {                 // inf / nan
    wide = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {              // normal
    wide = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {              // signed zero
    wide = sign;
  } else {                                 // subnormal: normalise the mantissa
    exponent = 113u;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    wide = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// A K or V row as float32: the cache itself for float32, else converted into `scratch`.
inline const float* row_as_float(const void* cache, int64_t offset, int32_t dtype, int head_dim,
                                 float* scratch) {
  if (dtype == kFloat32) return static_cast<const float*>(cache) + offset;
  const uint16_t* src = static_cast<const uint16_t*>(cache) + offset;
  if (dtype == kBFloat16) {
    for (int d = 0; d < head_dim; ++d) scratch[d] = bf16_to_float(src[d]);
  } else {
    for (int d = 0; d < head_dim; ++d) scratch[d] = f16_to_float(src[d]);
  }
  return scratch;
}

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

inline void axpy(float* __restrict y, float alpha, const float* __restrict x, int n) {
  const __m256 scale = _mm256_set1_ps(alpha);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
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
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float sum = 0.f;
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float* __restrict y, float alpha, const float* __restrict x, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
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

inline int64_t block_id(const PagedAttentionArgs& a, int64_t seq, int64_t index) {
  const int64_t at = seq * a.block_table_stride + index;
  return a.block_table_is_int64 ? static_cast<const int64_t*>(a.block_table)[at]
                                : static_cast<const int32_t*>(a.block_table)[at];
}

// Per-thread buffers, kept across calls so the hot path never allocates.
struct Scratch {
  std::vector<float> q, acc, scores, row_max, row_sum, k_row, v_row;
  std::vector<int64_t> row_pos;

  void fit(int rows, int head_dim, int block_size) {
    const size_t vectors = static_cast<size_t>(rows) * head_dim;
    if (q.size() < vectors) { q.resize(vectors); acc.resize(vectors); }
    if (scores.size() < static_cast<size_t>(rows) * block_size) scores.resize(rows * block_size);
    if (row_max.size() < static_cast<size_t>(rows)) {
      row_max.resize(rows); row_sum.resize(rows); row_pos.resize(rows);
    }
    if (k_row.size() < static_cast<size_t>(head_dim)) { k_row.resize(head_dim); v_row.resize(head_dim); }
  }
};

// The query vectors of one work item: `rows` = query tokens x query heads of the item's KV
// heads [kv_begin, kv_end), token-major. Row r is token r / heads of the segment and query
// head q_begin + r % heads, which reads KV head (q_begin + r % heads) / group.
struct Item {
  int64_t seq, first_row, q_len, seq_len;
  int kv_begin, kv_end, group, heads, rows;
};

// Scores of one block's keys for every query vector, then the online-softmax update: the
// running max moves, the accumulator and sum are rescaled once, and the block's scores are
// replaced by their unnormalised probabilities. The block's K rows are read token by token
// across the item's KV heads, i.e. in address order.
void score_block(const PagedAttentionArgs& a, const Item& it, Scratch& s, int64_t block,
                 int64_t first_key, int keys) {
  const int d = a.head_dim, bs = a.block_size;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < keys; ++t) {
    for (int kv = it.kv_begin; kv < it.kv_end; ++kv) {
      const int64_t offset = block * a.k_strides[0] + t * a.k_strides[1] + kv * a.k_strides[2];
      const float* k = row_as_float(a.k_cache, offset, a.cache_dtype, d, s.k_row.data());
      const int local = (kv - it.kv_begin) * it.group;
      for (int64_t j = 0; j < it.q_len; ++j) {
        const bool visible = first_key + t <= it.seq_len - it.q_len + j;  // causal
        for (int g = 0; g < it.group; ++g) {
          const int r = static_cast<int>(j) * it.heads + local + g;
          s.scores[r * bs + t] = visible ? dot(&s.q[static_cast<size_t>(r) * d], k, d) * a.scale
                                         : neg_inf;
        }
      }
    }
  }
  for (int r = 0; r < it.rows; ++r) {
    float* score = &s.scores[r * bs];
    float block_max = neg_inf;
    for (int t = 0; t < keys; ++t) block_max = std::max(block_max, score[t]);
    if (block_max == neg_inf) {  // every key of this block is in this row's future
      std::fill_n(score, keys, 0.f);
      continue;
    }
    const float new_max = std::max(s.row_max[r], block_max);
    const float rescale = std::exp(s.row_max[r] - new_max);  // 0 on the row's first block
    const float sum = exp_shifted(score, keys, new_max);
    if (rescale != 1.f) {
      float* acc = &s.acc[static_cast<size_t>(r) * d];
      for (int i = 0; i < d; ++i) acc[i] *= rescale;
    }
    s.row_sum[r] = s.row_sum[r] * rescale + sum;
    s.row_max[r] = new_max;
  }
}

void accumulate_block(const PagedAttentionArgs& a, const Item& it, Scratch& s, int64_t block,
                      int keys) {
  const int d = a.head_dim, bs = a.block_size;
  for (int t = 0; t < keys; ++t) {
    for (int kv = it.kv_begin; kv < it.kv_end; ++kv) {
      const int64_t offset = block * a.v_strides[0] + t * a.v_strides[1] + kv * a.v_strides[2];
      const float* v = row_as_float(a.v_cache, offset, a.cache_dtype, d, s.v_row.data());
      const int local = (kv - it.kv_begin) * it.group;
      for (int64_t j = 0; j < it.q_len; ++j) {
        for (int g = 0; g < it.group; ++g) {
          const int r = static_cast<int>(j) * it.heads + local + g;
          const float p = s.scores[r * bs + t];
          if (p != 0.f) axpy(&s.acc[static_cast<size_t>(r) * d], p, v, d);
        }
      }
    }
  }
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
  for (int64_t first_key = 0, index = 0; first_key < it.seq_len;
       first_key += a.block_size, ++index) {
    const int64_t block = block_id(a, it.seq, index);
    if (block < 0 || block >= a.num_blocks) return 1 + it.seq;
    const int keys = static_cast<int>(std::min<int64_t>(a.block_size, it.seq_len - first_key));
    score_block(a, it, s, block, first_key, keys);
    accumulate_block(a, it, s, block, keys);
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
  int64_t chunks = 1;
  if (a.num_threads > 1 && a.num_segments < 2 * a.num_threads) {
    chunks = std::min<int64_t>(a.kv_heads, (2 * a.num_threads + a.num_segments - 1) /
                                               std::max<int64_t>(a.num_segments, 1));
  }
  const int64_t per_chunk = (a.kv_heads + chunks - 1) / chunks;
  chunks = (a.kv_heads + per_chunk - 1) / per_chunk;
  const int64_t items = a.num_segments * chunks;
  int64_t error = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(a.num_threads) if (a.num_threads > 1 && items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int begin = static_cast<int>((item % chunks) * per_chunk);
    const int end = static_cast<int>(std::min<int64_t>(a.kv_heads, begin + per_chunk));
    const int64_t failed = attend(a, item / chunks, begin, end, tls_scratch);
    if (failed != 0) {
#pragma omp critical(vgraph_paged_attention_error)
      error = error == 0 ? failed : std::min(error, failed);
    }
  }
  return error;
}

}  // extern "C"
