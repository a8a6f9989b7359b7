// What the two paged-attention kernels share (paged_attention_cpu.cpp for short query
// segments, prefill_attention_cpu.cpp for long ones): one argument struct, so the Python side
// fills one ctypes mirror for both, and the reads of the paged cache (dtype conversion, block
// table lookup). An fp8 (e4m3) cache is read as its value times the per-tensor scale of its
// K or V cache (--kv-cache-dtype fp8), converted row by row like the 16-bit caches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace vgraph_attention {

enum CacheDType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat8E4M3 = 3 };

// Mirrored field for field by the ctypes Structure in ops/cpu_attention_native.py; each
// library exports its size (vgraph_*_args_size) so the loader can check the layouts agree.
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
  float k_scale;             // an fp8 cache's per-tensor scales (1 for other caches, unused)
  float v_scale;
};

inline int element_bytes(int32_t dtype) {
  return dtype == kFloat32 ? 4 : dtype == kFloat8E4M3 ? 1 : 2;
}

// float8_e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities, S.1111.111
// is NaN), as a 256-entry table: a lookup per element is cheaper than decoding the bits.
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
      float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                      : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 0xf && mantissa == 0x7) magnitude = std::numeric_limits<float>::quiet_NaN();
      value[bits] = bits & 0x80 ? -magnitude : magnitude;
    }
  }
};

inline const E4M3Table& e4m3_table() {
  static const E4M3Table table;
  return table;
}

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

// fp8 rows times `scale` into `scratch` (keys x head_dim).
inline void fp8_rows_to_float(const uint8_t* cache, int64_t token_stride, float scale, int keys,
                              int head_dim, float* scratch) {
  const float* table = e4m3_table().value;
  for (int t = 0; t < keys; ++t) {
    const uint8_t* src = cache + t * token_stride;
    float* dst = scratch + static_cast<int64_t>(t) * head_dim;
    for (int d = 0; d < head_dim; ++d) dst[d] = table[src[d]] * scale;
  }
}

// `keys` rows of one KV head as float32 rows `*stride` apart: the cache itself for float32,
// else converted into `scratch` (keys x head_dim); fp8 rows are multiplied by `fp8_scale`.
inline const float* rows_as_float(const void* cache, int64_t offset, int64_t token_stride,
                                  int32_t dtype, int keys, int head_dim, float* scratch,
                                  int64_t* stride, float fp8_scale) {
  if (dtype == kFloat32) {
    *stride = token_stride;
    return static_cast<const float*>(cache) + offset;
  }
  *stride = head_dim;
  if (dtype == kFloat8E4M3) {
    fp8_rows_to_float(static_cast<const uint8_t*>(cache) + offset, token_stride, fp8_scale, keys,
                      head_dim, scratch);
    return scratch;
  }
  for (int t = 0; t < keys; ++t) {
    const uint16_t* src = static_cast<const uint16_t*>(cache) + offset + t * token_stride;
    float* dst = scratch + static_cast<int64_t>(t) * head_dim;
    if (dtype == kBFloat16) {
      for (int d = 0; d < head_dim; ++d) dst[d] = bf16_to_float(src[d]);
    } else {
      for (int d = 0; d < head_dim; ++d) dst[d] = f16_to_float(src[d]);
    }
  }
  return scratch;
}

inline int64_t block_id(const PagedAttentionArgs& a, int64_t seq, int64_t index) {
  const int64_t at = seq * a.block_table_stride + index;
  return a.block_table_is_int64 ? static_cast<const int64_t*>(a.block_table)[at]
                                : static_cast<const int32_t*>(a.block_table)[at];
}

// Runs item(i) for i in [0, count) on up to `threads` OpenMP threads, dynamically scheduled.
// Returns 0, or the smallest error an item returned (1 + a sequence index), so the sequence
// named is the same whatever the thread count and order.
template <typename Item>
int64_t run_items(int64_t count, int threads, Item item) {
  int64_t error = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t failed = item(i);
    if (failed != 0) {
#pragma omp critical(vgraph_attention_error)
      error = error == 0 ? failed : std::min(error, failed);
    }
  }
  return error;
}

}  // namespace vgraph_attention
