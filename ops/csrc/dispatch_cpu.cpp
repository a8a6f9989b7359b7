// The CPU kernels of vgraph::packed_linear, vgraph::rowmajor_linear, vgraph::reshape_and_cache
// and vgraph::paged_attention as torch dispatcher kernels in C++, so that a call reaches the
// C++ kernels (linear_cpu.cpp, kv_cache_cpu.cpp, paged_attention_cpu.cpp) without Python.
//
// Why: registered from Python, every call went dispatcher -> Python kernel -> checks, reshape,
// output allocation -> ctypes -> C++, about 15 us for a one-row projection whose tiles take
// 3-6 us, and more for an attention call (its Python plans the batch). A decode step of a small
// model makes dozens of these calls (four projections and an attention a layer, and the head),
// so on the demo model at batch 1 the Python around them was a large part of the step. Here
// the same call costs under a microsecond of dispatch.
//
// Only the plain case runs here: float32 everywhere, no fp8 scales, valid shapes, the C++
// kernels loaded, and for attention a pure decode (one query row per sequence). Every other
// call (another dtype, a prefill, a dense copy in use, a bad shape or bad metadata) goes on to
// the Python kernel unchanged, through the private ops vgraph::<op>_python, so fallbacks and
// error messages have one home: the op's module. The one error raised here, a block table or
// a slot outside the cache (found by the kernels themselves), says what the Python kernel says.
// ops/cpu_dispatch.py builds this library and loads it (its kernels then take the ops' CPU
// calls in place of the Python ones), then hands it the kernels' entry points
// (vgraph_dispatch_configure); until then every call takes the Python path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include <strings.h>

#include "paged_attention_common.h"

namespace {

using LinearFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                          float*, int64_t, int32_t);
using RowsFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                        const float*, float*, int64_t, int32_t);
using CacheWriteFn = int64_t (*)(const void*, const void*, int64_t, int64_t, int64_t, int64_t, void*, void*,
                                 int64_t, int64_t, int64_t, const void*, int32_t, int64_t, int64_t, int64_t,
                                 int64_t, int64_t, int64_t);
using AttentionFn = int64_t (*)(const vgraph_attention::PagedAttentionArgs*);

// Set once by vgraph_dispatch_configure, right after the load (a CPU runner's startup, before its
// first forward); null until then, and each op takes its Python path meanwhile.
LinearFn g_linear = nullptr;  // vgraph_linear (linear_cpu.cpp)
RowsFn g_rows = nullptr;      // vgraph_linear_rows
int64_t g_panel = 0;          // ops/linear.py PANEL
int64_t g_dense_min_rows = 0; // ops/linear.py DENSE_MIN_ROWS
CacheWriteFn g_cache_write = nullptr;  // vgraph_reshape_and_cache (kv_cache_cpu.cpp)
AttentionFn g_attention = nullptr;     // vgraph_paged_attention (paged_attention_cpu.cpp)
int64_t g_max_head_dim = 0;            // ops/cpu_attention_native.py MAX_HEAD_DIM

bool is_f32(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

bool bias_fits(const std::optional<at::Tensor>& bias, int64_t n) {
  return !bias.has_value() ||
         (is_f32(*bias) && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous());
}

// x as the tiles read it, [rows, k] with unit-stride rows and a row stride of at least k
// (ops/linear.py _as_rows): a view where it already is one.
at::Tensor as_rows(const at::Tensor& x, int64_t k) {
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(1) != 1 || (rows.size(0) > 1 && rows.stride(0) < k)) rows = rows.contiguous();
  return rows;
}

// A dense copy is only used from DENSE_MIN_ROWS rows on (BLAS measured faster there); below
// that the tiles run, but its shape is still checked (by the Python kernel, when wrong).
bool dense_unused(const std::optional<at::Tensor>& dense, const at::Tensor& x, int64_t n, int64_t k) {
  return !dense.has_value() ||
         (dense->dim() == 2 && dense->size(0) == n && dense->size(1) == k && x.numel() < g_dense_min_rows * k);
}

at::Tensor output(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return at::empty(shape, x.options());
}

at::Tensor packed_linear_python(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t out_features, const std::optional<at::Tensor>& dense) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("vgraph::packed_linear_python", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                        const std::optional<at::Tensor>&)>();
  return op.call(x, packed, bias, out_features, dense);
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t out_features, const std::optional<at::Tensor>& dense) {
  const bool fast = g_linear != nullptr && is_f32(x) && is_f32(packed) && packed.dim() == 3 &&
                    packed.size(2) == g_panel && packed.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0 &&
                    x.size(-1) == packed.size(1) && (packed.size(0) - 1) * g_panel < out_features &&
                    out_features <= packed.size(0) * g_panel && bias_fits(bias, out_features) &&
                    dense_unused(dense, x, out_features, packed.size(1));
  if (!fast) return packed_linear_python(x, packed, bias, out_features, dense);
  const int64_t k = x.size(-1);
  const at::Tensor rows = as_rows(x, k);
  at::Tensor out = output(x, out_features);
  if (rows.size(0) > 0) {
    g_linear(rows.const_data_ptr<float>(), rows.stride(0), rows.size(0), k, packed.const_data_ptr<float>(),
             out_features, bias.has_value() ? bias->const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(),
             out_features, static_cast<int32_t>(at::get_num_threads()));
  }
  return out;
}

at::Tensor rowmajor_linear_python(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("vgraph::rowmajor_linear_python", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(x, weight, bias);
}

at::Tensor rowmajor_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool fast = g_rows != nullptr && is_f32(x) && is_f32(weight) && weight.dim() == 2 && x.dim() >= 1 &&
                    x.size(-1) > 0 && x.size(-1) == weight.size(1) && weight.size(0) > 0 &&
                    bias_fits(bias, weight.size(0));
  if (!fast) return rowmajor_linear_python(x, weight, bias);
  const int64_t k = x.size(-1), n = weight.size(0);
  const at::Tensor rows = as_rows(x, k);
  const at::Tensor w = as_rows(weight, k);
  at::Tensor out = output(x, n);
  if (rows.size(0) > 0) {
    g_rows(rows.const_data_ptr<float>(), rows.stride(0), rows.size(0), k, w.const_data_ptr<float>(), w.stride(0), n,
           bias.has_value() ? bias->const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(), n,
           static_cast<int32_t>(at::get_num_threads()));
  }
  return out;
}

// ---------------------------------------------------------------------- KV cache write

bool is_index(const at::Tensor& t, int64_t dims) {
  return t.dim() == dims && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong) && t.device().is_cpu();
}

bool f32_cache_pair(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  return is_f32(k_cache) && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && is_f32(v_cache) &&
         v_cache.strides() == k_cache.strides() && k_cache.stride(3) == 1;
}

void reshape_and_cache_python(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("vgraph::reshape_and_cache_python", "")
      .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  op.call(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const bool fast = g_cache_write != nullptr && !k_scale.has_value() && !v_scale.has_value() &&
                    f32_cache_pair(k_cache, v_cache) && is_f32(key) && is_f32(value) && key.dim() == 3 &&
                    value.sizes() == key.sizes() && key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3) &&
                    key.stride(2) == 1 && value.stride(2) == 1 && is_index(slot_mapping, 1) &&
                    slot_mapping.size(0) == key.size(0) && slot_mapping.is_contiguous();
  if (!fast) return reshape_and_cache_python(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  const int64_t failed = g_cache_write(
      key.const_data_ptr(), value.const_data_ptr(), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
      k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
      slot_mapping.const_data_ptr(), slot_mapping.scalar_type() == at::kLong ? 1 : 0, key.size(0), key.size(1),
      key.size(2), key.element_size(), k_cache.size(1), k_cache.size(0));
  if (failed) {
    const int64_t token = failed - 1;
    const int64_t slot = slot_mapping.scalar_type() == at::kLong ? slot_mapping.const_data_ptr<int64_t>()[token]
                                                                  : slot_mapping.const_data_ptr<int32_t>()[token];
    TORCH_CHECK_VALUE(false, "slot ", slot, " of token ", token, " is outside the cache's ",
                      k_cache.size(0) * k_cache.size(1), " slots");
  }
}

// ---------------------------------------------------------------------- decode attention

at::Tensor paged_attention_python(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& query_start_loc,
                                  const at::Tensor& seq_lens, int64_t max_query_len, double softmax_scale,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("vgraph::paged_attention_python", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, int64_t, double, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&)>();
  return op.call(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, max_query_len, softmax_scale, k_scale,
                 v_scale);
}

int64_t index_at(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kLong ? t.const_data_ptr<int64_t>()[i] : t.const_data_ptr<int32_t>()[i];
}

// ops/cpu_attention.py's switch: VGRAPH_CPU_ATTENTION=torch keeps every call on the SDPA path
// (read per call, as there).
bool attention_switched_off() {
  const char* value = std::getenv("VGRAPH_CPU_ATTENTION");
  return value != nullptr && strcasecmp(value, "torch") == 0;
}

// One segment (sequence, row, 1, seq_len) per sequence with a query row, as
// cpu_attention.sequence_segments and plan_batch make them for a decode; false where those
// would raise (rows outside q, a query longer than one row or than its sequence, a sequence
// past its block table), so that the Python kernel raises it.
bool decode_segments(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t rows, int64_t block_size,
                     int64_t table_width, std::vector<int64_t>& segments, int64_t& covered) {
  const int64_t num_seqs = seq_lens.size(0);
  covered = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t start = index_at(query_start_loc, i), end = index_at(query_start_loc, i + 1);
    const int64_t seq_len = index_at(seq_lens, i);
    if (start < 0 || start > end || end > rows || end - start > 1) return false;
    if (seq_len == 0 || end == start) continue;
    if (seq_len < end - start || (seq_len + block_size - 1) / block_size > table_width) return false;
    segments.insert(segments.end(), {i, start, 1, seq_len});
    covered += 1;
  }
  return true;
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_table, const at::Tensor& query_start_loc,
                               const at::Tensor& seq_lens, int64_t max_query_len, double softmax_scale,
                               const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  bool fast = g_attention != nullptr && max_query_len == 1 && !k_scale.has_value() && !v_scale.has_value() &&
              f32_cache_pair(k_cache, v_cache) && is_f32(q) && q.dim() == 3 && q.is_contiguous() &&
              q.size(2) == k_cache.size(3) && q.size(2) <= g_max_head_dim && k_cache.size(2) > 0 &&
              q.size(1) % k_cache.size(2) == 0 && is_index(block_table, 2) && block_table.stride(1) == 1 &&
              is_index(seq_lens, 1) && seq_lens.is_contiguous() && block_table.size(0) == seq_lens.size(0) &&
              is_index(query_start_loc, 1) && query_start_loc.is_contiguous() &&
              query_start_loc.size(0) == seq_lens.size(0) + 1 && !attention_switched_off();
  std::vector<int64_t> segments;
  int64_t covered = 0;
  fast = fast && decode_segments(query_start_loc, seq_lens, q.size(0), k_cache.size(1), block_table.size(1), segments,
                                 covered);
  if (!fast) {
    return paged_attention_python(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, max_query_len,
                                  softmax_scale, k_scale, v_scale);
  }
  // Rows no segment covers (padding) read zero, as in cpu_attention.attend_native_in_place.
  at::Tensor out = covered == q.size(0) ? at::empty(q.sizes(), q.options()) : at::zeros(q.sizes(), q.options());
  if (covered == 0) return out;
  vgraph_attention::PagedAttentionArgs args{};
  args.q = q.const_data_ptr<float>();
  args.out = out.mutable_data_ptr<float>();
  args.k_cache = k_cache.const_data_ptr();
  args.v_cache = v_cache.const_data_ptr();
  for (int d = 0; d < 3; ++d) {
    args.k_strides[d] = k_cache.stride(d);
    args.v_strides[d] = v_cache.stride(d);
  }
  args.block_table = block_table.const_data_ptr();
  args.block_table_stride = block_table.stride(0);
  args.segments = segments.data();
  args.num_segments = covered;
  args.num_blocks = k_cache.size(0);
  args.q_heads = static_cast<int32_t>(q.size(1));
  args.kv_heads = static_cast<int32_t>(k_cache.size(2));
  args.head_dim = static_cast<int32_t>(q.size(2));
  args.block_size = static_cast<int32_t>(k_cache.size(1));
  args.cache_dtype = vgraph_attention::kFloat32;
  args.block_table_is_int64 = block_table.scalar_type() == at::kLong ? 1 : 0;
  args.num_threads = static_cast<int32_t>(at::get_num_threads());
  args.scale = static_cast<float>(softmax_scale);
  args.k_scale = 1.f;
  args.v_scale = 1.f;
  const int64_t failed = g_attention(&args);
  TORCH_CHECK_VALUE(failed == 0, "sequence ", failed - 1, ": its block table points outside the cache's ",
                    k_cache.size(0), " blocks");
  return out;
}

}  // namespace

extern "C" {

// Called by ops/cpu_dispatch.py right after loading this library (whose registrations below
// ran at the load), with the already loaded kernels' entry points (any may be null: its op
// then keeps to the Python kernel) and the Python side's constants.
void vgraph_dispatch_configure(void* linear, void* rows, void* cache_write, void* attention, int64_t panel,
                               int64_t dense_min_rows, int64_t max_head_dim) {
  g_linear = reinterpret_cast<LinearFn>(linear);
  g_rows = reinterpret_cast<RowsFn>(rows);
  g_cache_write = reinterpret_cast<CacheWriteFn>(cache_write);
  g_attention = reinterpret_cast<AttentionFn>(attention);
  g_panel = panel;
  g_dense_min_rows = dense_min_rows;
  g_max_head_dim = max_head_dim;
}

}  // extern "C"

TORCH_LIBRARY_IMPL(vgraph, CPU, m) {
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("rowmajor_linear", &rowmajor_linear_cpu);
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
}
