// vgraph::lora_add on CPU: out = base + x @ A[slot]^T @ B[slot]^T, each row by its own slot.
//
// Why C++: the torch form (ops/lora.py lora_add_grouped) is a sort, a bincount with a host
// sync, an index_select, then per adapter in use one shrink and one expand GEMM per slice
// and a final index_add: some twenty small ops per projection, 4 projections per layer.
// At a decode step of 32 rows the FLOPs are ~5% of the base model's, so the dispatch is what
// a step paid (1.8x the base step through the compiled engine, perf/README.md `lora`). Here
// one call does the whole op: rows are counted into slot order (no sort), then, in one
// OpenMP region, work items slot-major so each thread streams its adapters' weights once:
//   shrink: (slot, pair of A rows) items; the slot's rows take their dot products with both
//           A rows in tiles of 4 rows x 2 A rows (8 independent 16-lane accumulators);
//   expand: (slot, block of kBlock output columns) items; the block's B rows are transposed
//           in registers into [R][kBlock] floats, so each row of the slot costs R broadcast
//           FMAs of kBlock-wide vectors on top of its base row.
// Each item prefetches the weights of the next one (they come from DRAM during a step).
// Accumulation is float32 (lanes summed at the end of a dot product); operands are float32
// or bfloat16 (one dtype for all of x, base, A, B, out), so results agree with the
// reference to rounding.
// Slot -1 rows copy base. A slot outside [-1, slots) is reported and nothing is written.

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxSlices = 4;   // q|k|v is 3; room for one more
constexpr int kMaxRank = 256;   // the transposed B block lives on the stack
constexpr int64_t kBlock = 64;  // output columns per expand block (4 AVX-512 registers)
constexpr int64_t kParallelWork = int64_t{1} << 17;  // multiply-adds below which one thread runs

struct LoraArgs {
  const void* x;
  const void* base;
  void* out;
  const void* lora_a;                 // [slots, slices * rank, in], contiguous
  const void* lora_b[kMaxSlices];     // each [slots, out_s, rank], contiguous
  int64_t slice_out[kMaxSlices];
  const void* token_slots;
  int64_t x_stride, base_stride, out_stride;  // row strides (elements); columns are unit-stride
  int64_t tokens, in_features, out_features, rank, slices, num_slots;
  int32_t token_slots_are_int64;
  int32_t is_bf16;
  int32_t num_threads;
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  const uint32_t wide = static_cast<uint32_t>(p[i]) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) {  // round to nearest even, NaN kept a NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    p[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

// Rows in slot order: order[group_start[s + 1] .. group_start[s + 2]) are slot s's rows,
// the first group the rows of slot -1. Returns 1 + the first row with a slot out of range.
int64_t group_rows(const LoraArgs& a, std::vector<int64_t>& order, std::vector<int64_t>& group_start) {
  std::vector<int64_t> slot_of(a.tokens);
  group_start.assign(a.num_slots + 2, 0);
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t s = a.token_slots_are_int64 ? static_cast<const int64_t*>(a.token_slots)[t]
                                              : static_cast<const int32_t*>(a.token_slots)[t];
    if (s < -1 || s >= a.num_slots) return 1 + t;
    slot_of[t] = s;
    ++group_start[s + 2];
  }
  for (int64_t g = 1; g < a.num_slots + 2; ++g) group_start[g] += group_start[g - 1];
  std::vector<int64_t> next(group_start.begin(), group_start.end() - 1);
  order.resize(a.tokens);
  for (int64_t t = 0; t < a.tokens; ++t) order[next[slot_of[t] + 1]++] = t;
  return 0;
}

// x's rows as float32 (a copy only for bfloat16).
template <typename T>
const float* x_as_float(const LoraArgs& a, std::vector<float>& copy) {
  const T* x = static_cast<const T*>(a.x);
  if constexpr (sizeof(T) == sizeof(float)) {
    if (a.x_stride == a.in_features) return reinterpret_cast<const float*>(x);
  }
  copy.resize(a.tokens * a.in_features);
  for (int64_t t = 0; t < a.tokens; ++t)
    for (int64_t k = 0; k < a.in_features; ++k) copy[t * a.in_features + k] = load(x, t * a.x_stride + k);
  return copy.data();
}

// A's row `r` of slot `s` as float32: the weights themselves, or a bfloat16 row widened into `copy`.
template <typename T>
const float* a_row(const LoraArgs& a, int64_t s, int64_t r, float* copy) {
  const int64_t rows = a.slices * a.rank, in = a.in_features;
  const T* src = static_cast<const T*>(a.lora_a) + (s * rows + r) * in;
  if constexpr (sizeof(T) == sizeof(float)) {
    return reinterpret_cast<const float*>(src);
  } else {
    for (int64_t k = 0; k < in; ++k) copy[k] = load(src, k);
    return copy;
  }
}

// GCC/Clang vector extensions: 16 floats, one AVX-512 register (two AVX2 ones elsewhere).
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // an unaligned v16 in memory
typedef int32_t v16i __attribute__((vector_size(64)));

// Dot products of NT rows of x with NR rows of A, 16 lanes at a time: NT * NR independent
// accumulators, so the FMAs do not wait on each other (one accumulator per dot product was
// latency-bound), and each load of x or A feeds NR or NT of them.
// `ahead` (or 0): how far past each A row to prefetch, the rows the next work item reads.
template <int NT, int NR>
void dot_tile(const float* const* xs, const float* const* ws, int64_t in, float* result, int64_t result_stride,
              int64_t ahead) {
  v16 acc[NT][NR] = {};
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    if (ahead)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(ws[r] + ahead + k);
    v16 w[NR];
    for (int r = 0; r < NR; ++r) w[r] = *reinterpret_cast<const v16u*>(ws[r] + k);
    for (int t = 0; t < NT; ++t) {
      const v16 xv = *reinterpret_cast<const v16u*>(xs[t] + k);
      for (int r = 0; r < NR; ++r) acc[t][r] += xv * w[r];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) {
      float sum = 0.0f;
      for (int lane = 0; lane < 16; ++lane) sum += acc[t][r][lane];
      for (int64_t kk = k; kk < in; ++kk) sum += xs[t][kk] * ws[r][kk];
      result[t * result_stride + r] = sum;
    }
}

// Rows begin .. end of a slot group (x rows in `order`) against NR rows of A, four x rows per
// tile; shrunk[t][r0 .. r0+NR) of each. The first tile prefetches the next NR rows of A: the
// weights stream from DRAM during a step, and a software prefetch one item ahead measured
// faster than leaving the jumps between items to the hardware prefetcher.
template <int NR>
void shrink_group(const float* x, int64_t in, const int64_t* order, int64_t count, const float* const* ws,
                  float* shrunk, int64_t rows, int64_t r0) {
  for (int64_t i = 0; i < count; i += 4) {
    const float* xs[4];
    const int64_t n = count - i < 4 ? count - i : 4;
    for (int64_t j = 0; j < n; ++j) xs[j] = x + order[i + j] * in;
    float result[4 * NR];
    const int64_t ahead = i == 0 ? NR * in : 0;
    switch (n) {
      case 4: dot_tile<4, NR>(xs, ws, in, result, NR, ahead); break;
      case 3: dot_tile<3, NR>(xs, ws, in, result, NR, ahead); break;
      case 2: dot_tile<2, NR>(xs, ws, in, result, NR, ahead); break;
      default: dot_tile<1, NR>(xs, ws, in, result, NR, ahead); break;
    }
    for (int64_t j = 0; j < n; ++j)
      for (int r = 0; r < NR; ++r) shrunk[order[i + j] * rows + r0 + r] = result[j * NR + r];
  }
}

// shrunk[t][r] = dot(x[t], A[slot(t)][r]) for every row t of a slot (r over slices * rank).
// The work is (slot in use, pair of A rows), slot-major, shared out in contiguous runs, so each
// thread streams through its slots' A front to back (the weights come from DRAM in a step).
// Called by every thread of the op's parallel region (or by one thread alone).
template <typename T>
void shrink(const LoraArgs& a, const float* x, const std::vector<int64_t>& order,
            const std::vector<int64_t>& group_start, const std::vector<int64_t>& used, float* shrunk) {
  const int64_t rows = a.slices * a.rank, in = a.in_features, pairs = (rows + 1) / 2;
  const int64_t items = static_cast<int64_t>(used.size()) * pairs;
  std::vector<float> copy(sizeof(T) == sizeof(float) ? 0 : 2 * in);
#pragma omp for schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t s = used[item / pairs], r = 2 * (item % pairs);
    const int64_t begin = group_start[s + 1], count = group_start[s + 2] - begin;
    const float* ws[2] = {a_row<T>(a, s, r, copy.data()), nullptr};
    if (rows - r < 2) {
      shrink_group<1>(x, in, order.data() + begin, count, ws, shrunk, rows, r);
    } else {
      ws[1] = a_row<T>(a, s, r + 1, copy.data() + (copy.empty() ? 0 : in));
      shrink_group<2>(x, in, order.data() + begin, count, ws, shrunk, rows, r);
    }
  }
}

// A 16 x 16 float tile (rows `src_stride` apart) transposed into `dst` (rows `dst_stride`
// apart). Four rounds of the perfect shuffle (row i and row i + 8 interleaved into rows 2i
// and 2i + 1) transpose a 16 x 16 matrix: 64 two-register shuffles instead of 256 scalar
// strided moves, which were most of the op's time before.
// `ahead`: how far past each source row to prefetch (the next block's rows).
inline void transpose16(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t ahead) {
  for (int i = 0; i < 16; ++i) __builtin_prefetch(src + i * src_stride + ahead);
  const v16i lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  const v16i hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  v16 rows[16], next[16];
  for (int i = 0; i < 16; ++i) rows[i] = *reinterpret_cast<const v16u*>(src + i * src_stride);
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 8; ++i) {
      next[2 * i] = __builtin_shuffle(rows[i], rows[i + 8], lo);
      next[2 * i + 1] = __builtin_shuffle(rows[i], rows[i + 8], hi);
    }
    for (int i = 0; i < 16; ++i) rows[i] = next[i];
  }
  for (int i = 0; i < 16; ++i) *reinterpret_cast<v16u*>(dst + i * dst_stride) = rows[i];
}

// B rows c0 .. c0+width of one slot ([width, rank], rank apart) as bt[k][c] (kBlock apart,
// zero past width): the expand then reads kBlock consecutive outputs' weights per k.
template <typename T>
void transpose_b(const T* b, int64_t rank, int64_t width, float* bt) {
  if constexpr (sizeof(T) == sizeof(float)) {
    if (rank % 16 == 0 && width == kBlock) {
      const float* src = reinterpret_cast<const float*>(b);
      for (int64_t k0 = 0; k0 < rank; k0 += 16)
        for (int64_t c0 = 0; c0 < kBlock; c0 += 16)
          transpose16(src + c0 * rank + k0, rank, bt + k0 * kBlock + c0, kBlock, kBlock * rank);
      return;
    }
  }
  for (int64_t k = 0; k < rank; ++k) {
    for (int64_t c = 0; c < width; ++c) bt[k * kBlock + c] = load(b, c * rank + k);
    for (int64_t c = width; c < kBlock; ++c) bt[k * kBlock + c] = 0.0f;  // a last, narrower block
  }
}

// out[t][col .. col+width) = base[t][...] + shrunk[t][0 .. rank) @ bt: kBlock outputs in four
// 16-wide accumulators, one broadcast FMA each per k.
template <typename T>
void expand_row(const LoraArgs& a, int64_t t, const float* st, const float* bt, int64_t col, int64_t width) {
  v16 acc[kBlock / 16] = {};
  for (int64_t k = 0; k < a.rank; ++k) {
    const float sk = st[k];
    for (int q = 0; q < kBlock / 16; ++q) acc[q] += sk * *reinterpret_cast<const v16*>(bt + k * kBlock + q * 16);
  }
  float sum[kBlock];
  std::memcpy(sum, acc, sizeof(sum));
  const T* base = static_cast<const T*>(a.base) + t * a.base_stride + col;
  T* out = static_cast<T*>(a.out) + t * a.out_stride + col;
  for (int64_t c = 0; c < width; ++c) store(out, c, load(base, c) + sum[c]);
}

// Columns c0 .. c0+width of slice `slice` (whose columns start at `column`) for slot s's rows.
template <typename T>
void expand_block(const LoraArgs& a, const std::vector<int64_t>& order, const std::vector<int64_t>& group_start,
                  const float* shrunk, int64_t s, int slice, int64_t column, int64_t c0, int64_t width) {
  const int64_t rank = a.rank, rows = a.slices * rank, out_s = a.slice_out[slice];
  alignas(64) float bt[kMaxRank * kBlock];
  transpose_b<T>(static_cast<const T*>(a.lora_b[slice]) + (s * out_s + c0) * rank, rank, width, bt);
  for (int64_t i = group_start[s + 1]; i < group_start[s + 2]; ++i)
    expand_row<T>(a, order[i], shrunk + order[i] * rows + slice * rank, bt, column + c0, width);
}

// Rows without an adapter (slot -1) are their base row.
template <typename T>
void copy_base_rows(const LoraArgs& a, const std::vector<int64_t>& order, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const T* base = static_cast<const T*>(a.base) + order[i] * a.base_stride;
    std::memcpy(static_cast<T*>(a.out) + order[i] * a.out_stride, base, a.out_features * sizeof(T));
  }
}

// Every slice's columns in blocks of kBlock for every slot in use: the work is (slot, block),
// slot-major like the shrink's, shared out in contiguous runs among the threads of the op's
// parallel region (whose barrier after the shrink makes every row's shrunk values ready).
template <typename T>
void expand(const LoraArgs& a, const std::vector<int64_t>& order, const std::vector<int64_t>& group_start,
            const std::vector<int64_t>& used, const float* shrunk) {
  std::vector<int64_t> first_block(a.slices + 1, 0), column(a.slices + 1, 0);
  for (int i = 0; i < a.slices; ++i) {
    first_block[i + 1] = first_block[i] + (a.slice_out[i] + kBlock - 1) / kBlock;
    column[i + 1] = column[i] + a.slice_out[i];
  }
  const int64_t blocks = first_block[a.slices], items = static_cast<int64_t>(used.size()) * blocks;
#pragma omp for schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t block = item % blocks;
    int slice = 0;
    while (block >= first_block[slice + 1]) ++slice;
    const int64_t c0 = (block - first_block[slice]) * kBlock;
    const int64_t width = a.slice_out[slice] - c0 < kBlock ? a.slice_out[slice] - c0 : kBlock;
    expand_block<T>(a, order, group_start, shrunk, used[item / blocks], slice, column[slice], c0, width);
  }
}

template <typename T>
int64_t lora_add(const LoraArgs& a) {
  std::vector<int64_t> order, group_start;
  const int64_t bad = group_rows(a, order, group_start);
  if (bad) return bad;
  std::vector<float> x_copy, shrunk(a.tokens * a.slices * a.rank, 0.0f);
  const float* x = x_as_float<T>(a, x_copy);
  const int64_t work = a.tokens * a.slices * a.rank * (a.in_features + a.out_features / a.slices);
  const bool parallel = a.num_threads > 1 && work >= kParallelWork;
  std::vector<int64_t> used;  // the slots some row uses
  for (int64_t slot = 0; slot < a.num_slots; ++slot)
    if (group_start[slot + 2] > group_start[slot + 1]) used.push_back(slot);
  copy_base_rows<T>(a, order, group_start[1]);
  // One parallel region for both phases: on a shared machine every region is a chance to wait
  // for a descheduled thread, so the op opens one, not two.
#pragma omp parallel num_threads(a.num_threads) if (parallel)
  {
    shrink<T>(a, x, order, group_start, used, shrunk.data());
    expand<T>(a, order, group_start, used, shrunk.data());
  }
  return 0;
}

}  // namespace

extern "C" {

int64_t vgraph_lora_add_args_size() { return sizeof(LoraArgs); }

int64_t vgraph_lora_add_max_rank() { return kMaxRank; }

// Returns 0, or 1 + the first row whose slot is outside [-1, num_slots) (nothing written);
// -1 when the operands break the kernel's limits (slices, rank: the caller checks them).
int64_t vgraph_lora_add(const LoraArgs* args) {
  if (args->slices < 1 || args->slices > kMaxSlices || args->rank < 1 || args->rank > kMaxRank) return -1;
  if (args->tokens == 0) return 0;
  return args->is_bf16 ? lora_add<uint16_t>(*args) : lora_add<float>(*args);
}

}  // extern "C"
