// reshape_and_cache on CPU: copies each new token's K and V rows into its cache slot.
//
// Why C++: the torch form (mask, gather of valid rows, two advanced-index assignments) is
// eight small ops per layer per step, about 40 us of dispatch for a few KiB of copying.
// This is a plain row copy, so the result is bit-identical to the torch form.
//
// Rows are (kv_heads x head_dim) elements; within a row heads are `head stride` apart and
// head_dim is contiguous. Key and value may be laid out differently (k is often a fresh
// tensor after RoPE, v a view into the fused qkv projection). Slot -1 is padding and writes nothing.

#include <cstdint>
#include <cstring>

extern "C" {

// Returns 0, or 1 + the first token whose slot lies outside the cache (nothing is written
// for that token or any later one).
int64_t vgraph_reshape_and_cache(const char* key, const char* value, int64_t key_token_stride,
                                 int64_t key_head_stride, int64_t value_token_stride,
                                 int64_t value_head_stride, char* k_cache, char* v_cache,
                                 int64_t cache_block_stride, int64_t cache_slot_stride,
                                 int64_t cache_head_stride, const void* slots,
                                 int32_t slots_are_int64, int64_t tokens, int64_t heads,
                                 int64_t head_dim, int64_t elem_size, int64_t block_size,
                                 int64_t num_blocks) {
  const int64_t row_bytes = head_dim * elem_size;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots_are_int64 ? static_cast<const int64_t*>(slots)[t]
                                         : static_cast<const int32_t*>(slots)[t];
    if (slot < 0) continue;
    if (slot >= num_blocks * block_size) return 1 + t;
    const int64_t dst = (slot / block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t k_src = t * key_token_stride + h * key_head_stride;
      const int64_t v_src = t * value_token_stride + h * value_head_stride;
      char* row = k_cache + (dst + h * cache_head_stride) * elem_size;
      std::memcpy(row, key + k_src * elem_size, row_bytes);
      row = v_cache + (dst + h * cache_head_stride) * elem_size;
      std::memcpy(row, value + v_src * elem_size, row_bytes);
    }
  }
  return 0;
}

}  // extern "C"
