// Multi-LoRA deltas for a CPU step, added in place to the base linear's output:
// y[t, offset_i + o] += sum_r B_i[s, r, o] * (A[s, i * R + r] . x[t]) for each token t whose
// slot s = slots[t] is not -1 (-1: the base model, left alone), every slice i of y.
//
// Tokens are grouped by slot, so each slot's A and B are read once for all of its tokens
// (from memory for the first pass of up to kTokensPerPass tokens, from the cache after) and
// each token is computed against its own slot only: a dense GEMM against every slot, masked
// afterwards, did slots x the useful work, and MKL's GEMMs at these narrow shapes (16 rows,
// 64-192 columns) ran far below the memory bandwidth.
//
// Each token's sums run in the same order whatever else is in the batch (its own accumulator
// lanes, the same column and rank order), so its result does not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kTokensPerPass = 4;
// Output columns a thread takes at a time in the expand (a multiple of 32).
constexpr int64_t kColumnGrain = 256;
// How many rows of A ahead the shrink prefetches.
constexpr int64_t kPrefetchRows = 4;

// sums[p * X + j] = a[p] . x[j] over columns [0, k) for P consecutive rows a[p] (stride k) and
// the X tokens at xs, the row P ahead prefetched; each sum takes its columns in the same
// order (16 lanes, then the lane total, then the scalar tail) for every P and X.
template <int64_t P, int64_t X>
void row_dots(const float* const* xs, const float* a, int64_t k, const float* ahead, float* sums) {
  int64_t c = 0;
#if defined(__AVX512F__)
  __m512 acc[P][X];
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 0; j < X; ++j) acc[p][j] = _mm512_setzero_ps();
  for (; c + 16 <= k; c += 16) {
    if (ahead != nullptr)
      for (int64_t p = 0; p < P; ++p) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * k + c), _MM_HINT_T0);
    __m512 w[P];
    for (int64_t p = 0; p < P; ++p) w[p] = _mm512_loadu_ps(a + p * k + c);
    for (int64_t j = 0; j < X; ++j) {
      const __m512 xv = _mm512_loadu_ps(xs[j] + c);
      for (int64_t p = 0; p < P; ++p) acc[p][j] = _mm512_fmadd_ps(w[p], xv, acc[p][j]);
    }
  }
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 0; j < X; ++j) sums[p * X + j] = _mm512_reduce_add_ps(acc[p][j]);
#else
  for (int64_t e = 0; e < P * X; ++e) sums[e] = 0.f;
#endif
  for (; c < k; ++c)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t j = 0; j < X; ++j) sums[p * X + j] = std::fma(a[p * k + c], xs[j][c], sums[p * X + j]);
}

// h[j * h_stride + r] = a[r] . x[j] for the X tokens at xs, every row r < rows of a [rows, k]:
// two rows at a time (2 X independent FMA chains, two weight loads per X activation loads),
// the rows kPrefetchRows ahead prefetched. The rows are one contiguous block, read once.
template <int64_t X>
void shrink_rows(const float* const* xs, const float* a, int64_t rows, int64_t k, float* h, int64_t h_stride) {
  float sums[2 * X];
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float* ahead = r + kPrefetchRows + 2 <= rows ? a + (r + kPrefetchRows) * k : nullptr;
    row_dots<2, X>(xs, a + r * k, k, ahead, sums);
    for (int64_t p = 0; p < 2; ++p)
      for (int64_t j = 0; j < X; ++j) h[j * h_stride + r + p] = sums[p * X + j];
  }
  for (; r < rows; ++r) {
    row_dots<1, X>(xs, a + r * k, k, nullptr, sums);
    for (int64_t j = 0; j < X; ++j) h[j * h_stride + r] = sums[j];
  }
}

// ys[j][o] += sum_r h[j * h_stride + r] * b[r * n + o] for the X tokens, columns begin <= o < end
// of b [rank, n] (the same columns of each y row): blocks of 64 columns held in registers for
// every rank row, each row's next block prefetched (measured ~10% faster than streaming whole
// rank rows through y in L1). Each y value takes its rank products in rank order, one FMA
// each, in every block size and the scalar tail alike.
template <int64_t X>
void expand_columns(float* const* ys, const float* h, int64_t h_stride, const float* b, int64_t rank, int64_t n,
                    int64_t begin, int64_t end) {
  int64_t o = begin;
#if defined(__AVX512F__)
  constexpr int64_t V = 4;  // column vectors a block: V x X accumulators
  for (; o + 16 * V <= end; o += 16 * V) {
    __m512 acc[X][V];
    for (int64_t j = 0; j < X; ++j)
      for (int64_t v = 0; v < V; ++v) acc[j][v] = _mm512_loadu_ps(ys[j] + o + 16 * v);
    for (int64_t r = 0; r < rank; ++r) {
      const float* row = b + r * n + o;
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * V * 2), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * V * 2 + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * V * 2 + 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + 16 * V * 2 + 48), _MM_HINT_T0);
      __m512 w[V];
      for (int64_t v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(row + 16 * v);
      for (int64_t j = 0; j < X; ++j) {
        const __m512 scale = _mm512_set1_ps(h[j * h_stride + r]);
        for (int64_t v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(scale, w[v], acc[j][v]);
      }
    }
    for (int64_t j = 0; j < X; ++j)
      for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(ys[j] + o + 16 * v, acc[j][v]);
  }
  for (; o + 16 <= end; o += 16) {
    __m512 acc[X];
    for (int64_t j = 0; j < X; ++j) acc[j] = _mm512_loadu_ps(ys[j] + o);
    for (int64_t r = 0; r < rank; ++r) {
      const __m512 w = _mm512_loadu_ps(b + r * n + o);
      for (int64_t j = 0; j < X; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(h[j * h_stride + r]), w, acc[j]);
    }
    for (int64_t j = 0; j < X; ++j) _mm512_storeu_ps(ys[j] + o, acc[j]);
  }
#endif
  for (; o < end; ++o)
    for (int64_t j = 0; j < X; ++j) {
      float value = ys[j][o];
      for (int64_t r = 0; r < rank; ++r) value = std::fma(h[j * h_stride + r], b[r * n + o], value);
      ys[j][o] = value;
    }
}

// One pass: up to kTokensPerPass tokens of one slot.
struct Pass {
  int64_t slot;
  int64_t first;  // index into the tokens grouped by slot
  int64_t count;
};

template <typename Fn>
void for_token_count(int64_t count, const Fn& fn) {
  switch (count) {
    case 4: fn(std::integral_constant<int64_t, 4>{}); break;
    case 3: fn(std::integral_constant<int64_t, 3>{}); break;
    case 2: fn(std::integral_constant<int64_t, 2>{}); break;
    default: fn(std::integral_constant<int64_t, 1>{}); break;
  }
}

void lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a, at::TensorList b) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "lora_add_: x must be contiguous fp32 [T, in]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0),
              "lora_add_: y must be contiguous fp32 [T, out]");
  TORCH_CHECK(a.dim() == 3 && a.scalar_type() == at::kFloat && a.is_contiguous() && a.size(2) == x.size(1),
              "lora_add_: a must be contiguous fp32 [slots, slices x rank, in]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kInt && slots.size(0) >= x.size(0),
              "lora_add_: slots must be int32 [>= T]");
  const int64_t num_tokens = x.size(0), k = x.size(1), num_slots = a.size(0), rows = a.size(1);
  const int64_t num_slices = static_cast<int64_t>(b.size());
  TORCH_CHECK(num_slices > 0 && rows % num_slices == 0, "lora_add_: a's rows are not slices x rank");
  const int64_t rank = rows / num_slices;
  std::vector<int64_t> offsets(num_slices + 1, 0);
  for (int64_t i = 0; i < num_slices; ++i) {
    TORCH_CHECK(b[i].dim() == 2 && b[i].scalar_type() == at::kFloat && b[i].is_contiguous() &&
                    b[i].size(0) == num_slots * rank,
                "lora_add_: b[", i, "] must be contiguous fp32 [slots x rank, out]");
    offsets[i + 1] = offsets[i] + b[i].size(1);
  }
  TORCH_CHECK(offsets[num_slices] == y.size(1), "lora_add_: y has ", y.size(1), " columns, the slices ",
              offsets[num_slices]);

  // Tokens grouped by slot (counting sort, batch order kept within a slot).
  const int32_t* slot_of = slots.data_ptr<int32_t>();
  std::vector<int64_t> starts(num_slots + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t s = slot_of[t];
    TORCH_CHECK(s >= -1 && s < num_slots, "lora_add_: token ", t, " has slot ", s, " of ", num_slots);
    if (s >= 0) ++starts[s + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) starts[s + 1] += starts[s];
  std::vector<int64_t> grouped(starts[num_slots]);
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slot_of[t] >= 0) grouped[fill[slot_of[t]]++] = t;
  std::vector<Pass> passes;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t first = starts[s]; first < starts[s + 1]; first += kTokensPerPass)
      passes.push_back({s, first, std::min(kTokensPerPass, starts[s + 1] - first)});
  if (passes.empty()) return;

  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t out = y.size(1);
  // h[g * rows + i * rank + r]: grouped token g's shrunk activations.
  std::vector<float> h(grouped.size() * rows);
  at::parallel_for(0, static_cast<int64_t>(passes.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const Pass& pass = passes[p];
      const float* xs[kTokensPerPass];
      for (int64_t j = 0; j < pass.count; ++j) xs[j] = xp + grouped[pass.first + j] * k;
      for_token_count(pass.count, [&](auto tokens) {
        shrink_rows<decltype(tokens)::value>(xs, ap + pass.slot * rows * k, rows, k, h.data() + pass.first * rows, rows);
      });
    }
  });
  for (int64_t i = 0; i < num_slices; ++i) {
    const int64_t n = offsets[i + 1] - offsets[i];
    const float* bp = b[i].data_ptr<float>();
    at::parallel_for(0, n, kColumnGrain, [&](int64_t begin, int64_t end) {
      for (const Pass& pass : passes) {
        float* ys[kTokensPerPass];
        for (int64_t j = 0; j < pass.count; ++j) ys[j] = yp + grouped[pass.first + j] * out + offsets[i];
        for_token_count(pass.count, [&](auto tokens) {
          expand_columns<decltype(tokens)::value>(ys, h.data() + pass.first * rows + i * rank, rows,
                                                  bp + pass.slot * rank * n, rank, n, begin, end);
        });
      }
    });
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor slots, Tensor a, Tensor[] b) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("lora_add_", lora_add_); }
