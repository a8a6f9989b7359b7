// The CPU kernels of vgraph::packed_linear and vgraph::rowmajor_linear as torch dispatcher
// kernels in C++, so that a call reaches the packed tiles (linear_cpu.cpp) without Python.
//
// Why: registered from Python, every call went dispatcher -> Python kernel -> checks, reshape,
// output allocation -> ctypes -> C++, about 15 us for a one-row call whose tiles take 3-6 us.
// A decode step of a small model makes dozens of these calls (four projections a layer and
// the head), so on the demo model at batch 1 the Python around them was a sixth of the step.
// Here the same call costs under a microsecond of dispatch.
//
// Only the fast case runs here: float32 everywhere, the shapes valid, the tiles loaded. Every
// other call (another dtype, a prefill-sized call with a dense copy, a bad shape) goes on to
// the Python kernel unchanged, through the private ops vgraph::packed_linear_python and
// vgraph::rowmajor_linear_python, so fallbacks and error messages have one home: ops/linear.py.
// That module builds this library and loads it (its kernels then take the ops' CPU calls in
// place of the Python ones), then hands it the tiles' entry points and the dense threshold
// (vgraph_linear_dispatch_configure); until then every call takes the Python path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

using LinearFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                          float*, int64_t, int32_t);
using RowsFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                        const float*, float*, int64_t, int32_t);

LinearFn g_linear = nullptr;  // vgraph_linear (linear_cpu.cpp), set before the library loads
RowsFn g_rows = nullptr;      // vgraph_linear_rows
int64_t g_panel = 0;          // ops/linear.py PANEL
int64_t g_dense_min_rows = 0; // ops/linear.py DENSE_MIN_ROWS

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

}  // namespace

extern "C" {

// Called by ops/linear.py right after loading this library (whose registrations below ran
// at the load); the function pointers are the already loaded tiles of linear_cpu.cpp.
void vgraph_linear_dispatch_configure(void* linear, void* rows, int64_t panel, int64_t dense_min_rows) {
  g_linear = reinterpret_cast<LinearFn>(linear);
  g_rows = reinterpret_cast<RowsFn>(rows);
  g_panel = panel;
  g_dense_min_rows = dense_min_rows;
}

}  // extern "C"

TORCH_LIBRARY_IMPL(vgraph, CPU, m) {
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("rowmajor_linear", &rowmajor_linear_cpu);
}
