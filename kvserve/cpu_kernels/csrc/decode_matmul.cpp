// y = x @ (q * scale[:, None])^T for a few fp32 rows x [M, K], int8 q [N, K], fp32 scale [N].
//
// Decode reads each weight once per step, and converting int8 weights to fp32 for FMAs costs
// more instructions than the memory system leaves time for (measured: ~5 GMAC/s a core on an
// AVX2 EPYC, well under its bandwidth). So the activations are quantized instead: each row of
// x to int16 with its own scale (relative error 2^-16 of the row's largest |x|, 256x finer
// than the bf16 activations torch's int8 kernel takes), and the dot products run as int16
// multiply-adds (vpmaddwd: 16 products per instruction) into int32 lanes, flushed to fp32
// every kFlushColumns columns, before a lane could overflow.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kRowsPerTile = 4;   // weight rows that share each load of x
constexpr int64_t kXRowsPerPass = 2;  // rows of x that share each load of a weight tile
constexpr int64_t kLanes = 16;        // int16 activations per vector
// Tiles ahead whose weight rows the first row of x prefetches, a cache line per vector step.
// The hardware prefetcher alone streams a tile's rows poorly when they are short (SmolLM2's
// 576 columns: nine cache lines a row, four rows at once): measured on the 2-core EPYC, one
// row of x, int8 3072x576 9 -> 15 GB/s and 57344x576 9-11 -> 20-22; fp32 960x576 11-16 ->
// 19; 1, 2, 4 and 8 tiles ahead were tried, 4 is kept.
constexpr int64_t kPrefetchTiles = 4;
// An int32 lane adds one vpmaddwd result (two products, |q * xq| <= 128 * 32767 each) per
// kLanes columns: 255 of them stay below 2^31 (kFlushColumns, a multiple of kLanes).
constexpr int64_t kFlushColumns = 255 * kLanes;

// Rows of x as int16 with one fp32 scale each, padded with zeros to a multiple of kLanes.
struct QuantizedRows {
  std::vector<int16_t> values;
  std::vector<float> scales;
  int64_t padded;
};

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k) {
  QuantizedRows out;
  out.padded = (k + kLanes - 1) / kLanes * kLanes;
  out.values.assign(m * out.padded, 0);
  out.scales.resize(m);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    float amax = 0.f;
    for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
    const float scale = amax > 0.f ? amax / 32767.f : 1.f;
    const float inverse = 1.f / scale;
    int16_t* dst = out.values.data() + i * out.padded;
    for (int64_t c = 0; c < k; ++c) dst[c] = static_cast<int16_t>(std::nearbyint(row[c] * inverse));
    out.scales[i] = scale;
  }
  return out;
}

// Sums of q[r, c] * xq[j][c] over c in [begin, end) for R rows of q and X rows of x (rows of
// xq `x_stride` apart), into sums[j * R + r]: each weight vector is widened once and serves X
// rows of x, and X * R independent accumulators hide the multiply-add latency. The int32
// lanes of the vector loop stay in range (kFlushColumns) and go to fp32 before they are
// added together: the sum of all eight lanes would not fit an int32. Columns past the last
// whole vector (zero in xq, but not readable in q) are done one by one.
template <int64_t X, int64_t R>
void dot_chunk(const int16_t* xq, int64_t x_stride, const int8_t* q, int64_t k, int64_t begin, int64_t end,
               float* sums, const int8_t* prefetch) {
  const int64_t vector_end = begin + (end - begin) / kLanes * kLanes;
#if defined(__AVX2__)
  __m256i acc[X][R];
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_si256();
  for (int64_t c = begin; c < vector_end; c += kLanes) {
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * R), _MM_HINT_T0);
    __m256i weights[R];
    for (int64_t r = 0; r < R; ++r)
      weights[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * k + c)));
    for (int64_t j = 0; j < X; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * x_stride + c));
      for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_add_epi32(acc[j][r], _mm256_madd_epi16(weights[r], xv));
    }
  }
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      const __m256 lanes = _mm256_cvtepi32_ps(acc[j][r]);
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
      const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
      sums[j * R + r] = _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
    }
  }
#else
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      int64_t sum = 0;
      for (int64_t c = begin; c < vector_end; ++c) sum += static_cast<int64_t>(q[r * k + c]) * xq[j * x_stride + c];
      sums[j * R + r] = static_cast<float>(sum);
    }
  }
#endif
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      int64_t tail = 0;
      for (int64_t c = vector_end; c < end; ++c) tail += static_cast<int64_t>(q[r * k + c]) * xq[j * x_stride + c];
      sums[j * R + r] += static_cast<float>(tail);
    }
  }
}

template <int64_t X, int64_t R>
void dot_rows(const int16_t* xq, int64_t x_stride, const int8_t* q, int64_t k, float* out,
              const int8_t* prefetch) {
  float total[X * R] = {};
  float sums[X * R];
  for (int64_t begin = 0; begin < k; begin += kFlushColumns) {
    dot_chunk<X, R>(xq, x_stride, q, k, begin, std::min(begin + kFlushColumns, k), sums, prefetch);
    for (int64_t e = 0; e < X * R; ++e) total[e] += sums[e];
  }
  for (int64_t e = 0; e < X * R; ++e) out[e] = total[e];
}

// y[i + j, row + r] = partial[j * kRowsPerTile + r] for every pass over up to kXRowsPerPass rows
// of x [m, ...] and every tile of kRowsPerTile weight rows (the last may hold fewer), tiles
// split over threads: `dots(i, x_rows, row, count, partial)` fills it for j < x_rows and
// r < count. A tile is read from memory in the first pass and from the cache in the others.
template <typename Dots>
void over_row_tiles(int64_t m, int64_t n, float* y, const Dots& dots) {
  const int64_t tiles = (n + kRowsPerTile - 1) / kRowsPerTile;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    float partial[kXRowsPerPass * kRowsPerTile];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t row = tile * kRowsPerTile;
      const int64_t count = std::min(kRowsPerTile, n - row);
      for (int64_t i = 0; i < m; i += kXRowsPerPass) {
        const int64_t x_rows = std::min(kXRowsPerPass, m - i);
        dots(i, x_rows, row, count, partial);
        for (int64_t j = 0; j < x_rows; ++j)
          for (int64_t r = 0; r < count; ++r) y[(i + j) * n + row + r] = partial[j * kRowsPerTile + r];
      }
    }
  });
}

// The weight rows `ahead` tiles past `row` for the first pass over x to prefetch, or nullptr
// (other passes, or past the end).
template <typename T>
const T* prefetch_target(const T* w, int64_t i, int64_t row, int64_t n, int64_t k) {
  const int64_t ahead = row + kPrefetchTiles * kRowsPerTile;
  return i == 0 && ahead + kRowsPerTile <= n ? w + ahead * k : nullptr;
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_matmul: x must be 2-D fp32");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_matmul: q must be contiguous int8 [N, K]");
  TORCH_CHECK(q.size(1) == x.size(1), "int8_matmul: x has ", x.size(1), " columns, q ", q.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == q.size(0),
              "int8_matmul: scale must be fp32 [N]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor sc = scale.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = q.size(0);
  at::Tensor y = at::empty({m, n}, xc.options());
  const QuantizedRows rows = quantize_rows(xc.data_ptr<float>(), m, k);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  over_row_tiles(m, n, y.data_ptr<float>(), [&](int64_t i, int64_t x_rows, int64_t row, int64_t count, float* partial) {
    const int16_t* xq = rows.values.data() + i * rows.padded;
    const int8_t* tile = qp + row * k;
    const int8_t* prefetch = prefetch_target(qp, i, row, n, k);
    if (count == kRowsPerTile && x_rows == kXRowsPerPass) {
      dot_rows<kXRowsPerPass, kRowsPerTile>(xq, rows.padded, tile, k, partial, prefetch);
    } else if (count == kRowsPerTile) {  // the last, partial pass over x
      for (int64_t j = 0; j < x_rows; ++j)
        dot_rows<1, kRowsPerTile>(xq + j * rows.padded, rows.padded, tile, k, partial + j * kRowsPerTile, prefetch);
    } else {
      for (int64_t j = 0; j < x_rows; ++j)
        for (int64_t r = 0; r < count; ++r)
          dot_rows<1, 1>(xq + j * rows.padded, rows.padded, tile + r * k, k, partial + j * kRowsPerTile + r, nullptr);
    }
    for (int64_t j = 0; j < x_rows; ++j)
      for (int64_t r = 0; r < count; ++r) partial[j * kRowsPerTile + r] *= rows.scales[i + j] * sp[row + r];
  });
  return y;
}

// y = x @ w^T for a few fp32 rows x [M, K] and fp32 w [N, K] (an LM head at decode): each
// tile of kRowsPerTile weight rows is read from memory once, with FMAs into fp32 lanes, and
// serves every row of x from the cache. MKL's sgemv read SmolLM2's 113 MB head at ~8 GB/s
// of the 18.5 a plain sum reaches on the 2-core EPYC (BENCHMARKS.md).
template <int64_t X, int64_t R>
void float_dot_rows(const float* x, int64_t x_stride, const float* w, int64_t k, float* out, const float* prefetch) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[X][R];
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (; c + 8 <= k; c += 8) {
    if (prefetch != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * R), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * R + 16), _MM_HINT_T0);
    }
    __m256 weights[R];
    for (int64_t r = 0; r < R; ++r) weights[r] = _mm256_loadu_ps(w + r * k + c);
    for (int64_t j = 0; j < X; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * x_stride + c);
      for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_fmadd_ps(weights[r], xv, acc[j][r]);
    }
  }
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[j][r]), _mm256_extractf128_ps(acc[j][r], 1));
      const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
      out[j * R + r] = _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
    }
  }
#else
  for (int64_t e = 0; e < X * R; ++e) out[e] = 0.f;
#endif
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t t = c; t < k; ++t) out[j * R + r] += w[r * k + t] * x[j * x_stride + t];
    }
  }
}

at::Tensor float_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "float_matmul: x must be 2-D fp32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "float_matmul: w must be contiguous fp32 [N, K]");
  TORCH_CHECK(w.size(1) == x.size(1), "float_matmul: x has ", x.size(1), " columns, w ", w.size(1));
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = w.size(0);
  at::Tensor y = at::empty({m, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  over_row_tiles(m, n, y.data_ptr<float>(), [&](int64_t i, int64_t x_rows, int64_t row, int64_t count, float* partial) {
    const float* xi = xp + i * k;
    const float* tile = wp + row * k;
    const float* prefetch = prefetch_target(wp, i, row, n, k);
    if (count == kRowsPerTile && x_rows == kXRowsPerPass) {
      float_dot_rows<kXRowsPerPass, kRowsPerTile>(xi, k, tile, k, partial, prefetch);
    } else if (count == kRowsPerTile) {  // the last, partial pass over x
      for (int64_t j = 0; j < x_rows; ++j)
        float_dot_rows<1, kRowsPerTile>(xi + j * k, k, tile, k, partial + j * kRowsPerTile, prefetch);
    } else {
      for (int64_t j = 0; j < x_rows; ++j)
        for (int64_t r = 0; r < count; ++r)
          float_dot_rows<1, 1>(xi + j * k, k, tile + r * k, k, partial + j * kRowsPerTile + r, nullptr);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("int8_matmul(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("float_matmul(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("int8_matmul", int8_matmul);
  m.impl("float_matmul", float_matmul);
}
