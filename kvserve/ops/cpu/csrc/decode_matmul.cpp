// y = x @ (q * scale[:, None])^T for a few fp32 rows x [M, K], int8 q [N, K], fp32 scale [N]
// (one per output channel) or [N, G] (one per group of K / G columns, a multiple of 16: GGUF's
// Q8_0 and Q6_K grids, 32 and 16 wide, held exactly), plus an optional offset per group.
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
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

// The int4 kernel on 128-column blocks (int4_dot_blocks) needs AVX-512 BW, DQ and VL.
#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KVSERVE_INT4_BLOCKS 1
#else
#define KVSERVE_INT4_BLOCKS 0
#endif

namespace {

#if defined(__AVX2__)
// The sum of a vector's eight lanes.
inline float horizontal_sum(__m256 lanes) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_movehdup_ps(quad)));
}

#if defined(__FMA__)
// Group-scaled dot products (int8 with group scales, int4): group g's int32 lane sums
// isum[j][r] take weight row r's scale in fp32, into acc[j][r].
template <int64_t X, int64_t R>
inline void add_scaled_group(__m256i (&isum)[X][R], const float* scale, int64_t groups, int64_t g,
                             __m256 (&acc)[X][R]) {
  for (int64_t r = 0; r < R; ++r) {
    const __m256 s = _mm256_set1_ps(scale[r * groups + g]);
    for (int64_t j = 0; j < X; ++j) acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j][r]), s, acc[j][r]);
  }
}
#endif

// sums[j * R + r] = the sum of acc[j][r]'s eight lanes.
template <int64_t X, int64_t R>
inline void store_lane_sums(__m256 (&acc)[X][R], float* sums) {
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) sums[j * R + r] = horizontal_sum(acc[j][r]);
}
#endif

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

// The fp32 scale that maps a row of x onto int16: its largest magnitude to 32767.
inline float int16_scale(const float* row, int64_t k) {
  float amax = 0.f;
  int64_t c = 0;
#if defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 lanes = _mm256_setzero_ps();
  for (; c + 8 <= k; c += 8) lanes = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(row + c), magnitude), lanes);
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  amax = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
#endif
  for (; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
  return amax > 0.f ? amax / 32767.f : 1.f;
}

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
    const float scale = int16_scale(row, k);
    const float inverse = 1.f / scale;
    int16_t* dst = out.values.data() + i * out.padded;
    int64_t c = 0;
#if defined(__AVX2__)
    // 16 columns at a time, rounded to nearest even as std::nearbyint; packs interleaves its
    // inputs' 128-bit lanes, so they go back in column order.
    const __m256 scaled = _mm256_set1_ps(inverse);
    for (; c + 16 <= k; c += 16) {
      const __m256i low = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + c), scaled));
      const __m256i high = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + c + 8), scaled));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(low, high), _MM_SHUFFLE(3, 1, 2, 0)));
    }
#endif
    for (; c < k; ++c) dst[c] = static_cast<int16_t>(std::nearbyint(row[c] * inverse));
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
#if defined(__AVX2__)
// acc[j][r] = the int32 lane sums of q[r, c] * xq[j][c] over the whole vectors of columns
// [begin, end): each weight vector is widened once and serves X rows of x.
template <int64_t X, int64_t R>
inline void int8_lane_sums(const int16_t* xq, int64_t x_stride, const int8_t* q, int64_t k, int64_t begin,
                           int64_t end, const int8_t* prefetch, __m256i (&acc)[X][R]) {
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_si256();
  for (int64_t c = begin; c < end; c += kLanes) {
    if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * R), _MM_HINT_T0);
    __m256i weights[R];
    for (int64_t r = 0; r < R; ++r)
      weights[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * k + c)));
    for (int64_t j = 0; j < X; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * x_stride + c));
      for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_add_epi32(acc[j][r], _mm256_madd_epi16(weights[r], xv));
    }
  }
}
#endif

template <int64_t X, int64_t R>
void dot_chunk(const int16_t* xq, int64_t x_stride, const int8_t* q, int64_t k, int64_t begin, int64_t end,
               float* sums, const int8_t* prefetch) {
  const int64_t vector_end = begin + (end - begin) / kLanes * kLanes;
#if defined(__AVX2__)
  __m256i acc[X][R];
  int8_lane_sums<X, R>(xq, x_stride, q, k, begin, vector_end, prefetch, acc);
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      sums[j * R + r] = horizontal_sum(_mm256_cvtepi32_ps(acc[j][r]));
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

// The portable form of the group-scaled dots (no AVX2): sums[j * R + r] = sum over groups g of
// scale[r, g] * (weight(r, c) . xq[j, c] over the group's columns), int64 within a group.
template <int64_t X, int64_t R, typename Weight>
void scalar_group_dots(const int16_t* xq, int64_t x_stride, const float* scale, int64_t groups, int64_t group,
                       float* sums, const Weight& weight) {
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int64_t dot = 0;
        for (int64_t c = g * group; c < (g + 1) * group; ++c) dot += weight(r, c) * xq[j * x_stride + c];
        total += scale[r * groups + g] * static_cast<float>(dot);
      }
      sums[j * R + r] = total;
    }
  }
}

// sums[j * R + r] = sum over groups g of scale[r * groups + g] * (q[r, group g] . xq[j, group g])
// for R rows of q and X rows of xq (`k` apart; `group` a multiple of kLanes, so no column
// tail): int32 within a group (at most kFlushColumns wide), fp32 across.
template <int64_t X, int64_t R>
void group_dot_rows(const int16_t* xq, int64_t x_stride, const int8_t* q, int64_t k, const float* scale,
                    int64_t groups, int64_t group, float* sums, const int8_t* prefetch) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[X][R];
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i isum[X][R];
    int8_lane_sums<X, R>(xq, x_stride, q, k, g * group, (g + 1) * group, prefetch, isum);
    add_scaled_group<X, R>(isum, scale, groups, g, acc);
  }
  store_lane_sums<X, R>(acc, sums);
#else
  scalar_group_dots<X, R>(xq, x_stride, scale, groups, group, sums,
                          [&](int64_t r, int64_t c) { return static_cast<int64_t>(q[r * k + c]); });
#endif
}

// Scales and minimums are fp32, or fp16 where that holds them exactly (GGUF Q4_1's d and m):
// a g32 layer's are a third of its bytes in fp32, a fifth in fp16.
inline float as_float(float value) { return value; }
inline float as_float(at::Half value) {
#if defined(__F16C__)
  return _cvtsh_ss(value.x);
#else
  return static_cast<float>(value);
#endif
}

// count fp16 values at `from` as fp32 at `to`.
inline void widen_fp16(const at::Half* from, int64_t count, float* to) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= count; c += 16)
    _mm512_storeu_ps(to + c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + c))));
#endif
  for (; c < count; ++c) to[c] = as_float(from[c]);
}

// A tile's `count` values as fp32 for the kernels that take fp32 scales: fp32 ones as they are;
// fp16 ones widened into `buffer` (when `widen`: the tile's first pass over x).
inline const float* fp32_values(const float* values, int64_t, bool, std::vector<float>&) { return values; }
inline const float* fp32_values(const at::Half* values, int64_t count, bool widen, std::vector<float>& buffer) {
  buffer.resize(count);
  if (widen) widen_fp16(values, count, buffer.data());
  return buffer.data();
}

#if defined(__AVX512F__)
inline __m512 load16(const float* values) { return _mm512_loadu_ps(values); }
inline __m512 load16(const at::Half* values) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
}
#endif

// sum over groups g of minimum[g] * sums[g], a row's minimums against x's group sums: one
// order of the adds for either storage, so that fp16 and fp32 copies of the same values give
// the same sum.
template <typename Scale>
inline float minimum_offset(const Scale* minimum, const float* sums, int64_t groups) {
  int64_t g = 0;
  float offset = 0.f;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_setzero_ps();
  for (; g + 16 <= groups; g += 16) lanes = _mm512_fmadd_ps(load16(minimum + g), _mm512_loadu_ps(sums + g), lanes);
  offset = _mm512_reduce_add_ps(lanes);
#endif
  // An explicit fma: left to the compiler, the fp16 and fp32 instantiations contract
  // differently (seen on AVX2 builds), and the two storages would disagree in the last bit.
  for (; g < groups; ++g) offset = std::fma(as_float(minimum[g]), sums[g], offset);
  return offset;
}

// A row of x's per-group sums, in column order; eight groups' chains of adds side by side, so
// that they overlap (one chain at a time waited on every add: 4.7 us of k = 1536).
inline void row_group_sums(const float* row, int64_t group, int64_t groups, float* out) {
  constexpr int64_t kChains = 8;
  int64_t g = 0;
  for (; g + kChains <= groups; g += kChains) {
    float sums[kChains] = {};
    for (int64_t c = 0; c < group; ++c)
      for (int64_t u = 0; u < kChains; ++u) sums[u] += row[(g + u) * group + c];
    std::copy(sums, sums + kChains, out + g);
  }
  for (; g < groups; ++g) {
    float sum = 0.f;
    for (int64_t c = g * group; c < (g + 1) * group; ++c) sum += row[c];
    out[g] = sum;
  }
}

// With `offset` [N, G] (GGUF Q4_K/Q5_K grids held as int8): w = q * scale + offset per group, and
// each group's offset meets that group's sum of x (fp32, unrounded), as the int4 kernel's minimums.
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_matmul: x must be 2-D fp32");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_matmul: q must be contiguous int8 [N, K]");
  TORCH_CHECK(q.size(1) == x.size(1), "int8_matmul: x has ", x.size(1), " columns, q ", q.size(1));
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  const int64_t groups = n > 0 ? scale.numel() / n : 1;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n * groups && groups >= 1,
              "int8_matmul: scale must be fp32 [N] or [N, G]");
  const int64_t group = k / std::max<int64_t>(groups, 1);
  TORCH_CHECK(groups == 1 || (k % groups == 0 && group % kLanes == 0 && group <= kFlushColumns),
              "int8_matmul: ", groups, " scale groups a row need groups of a multiple of ", kLanes,
              " columns (at most ", kFlushColumns, ") that divide the ", k, " input columns");
  TORCH_CHECK(!offset || (offset->scalar_type() == at::kFloat && offset->numel() == n * groups),
              "int8_matmul: offset must be fp32 shaped as scale");
  const at::Tensor xc = x.contiguous();
  const at::Tensor sc = scale.contiguous();
  const at::Tensor oc = offset ? offset->contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, n}, xc.options());
  const QuantizedRows rows = quantize_rows(xc.data_ptr<float>(), m, k);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* op = offset ? oc.data_ptr<float>() : nullptr;
  std::vector<float> sums(op ? m * groups : 0);
  for (int64_t i = 0; op && i < m; ++i)
    row_group_sums(xc.data_ptr<float>() + i * k, group, groups, sums.data() + i * groups);
  // partial[j, r] (x row i + j, weight row `row` + r) += that weight row's offsets against x's group sums.
  const auto add_offsets = [&](int64_t i, int64_t x_rows, int64_t row, int64_t count, float* partial) {
    for (int64_t j = 0; op && j < x_rows; ++j)
      for (int64_t r = 0; r < count; ++r)
        partial[j * kRowsPerTile + r] +=
            minimum_offset(op + (row + r) * groups, sums.data() + (i + j) * groups, groups);
  };
  if (groups > 1) {
    over_row_tiles(m, n, y.data_ptr<float>(), [&](int64_t i, int64_t x_rows, int64_t row, int64_t count,
                                                  float* partial) {
      const int16_t* xq = rows.values.data() + i * rows.padded;
      const int8_t* tile = qp + row * k;
      const float* tile_scale = sp + row * groups;
      // X * R int32 and X * R fp32 sums must stay in the 16 vector registers: one row of x takes
      // the tile whole, two rows take it in halves.
      constexpr int64_t kHalf = kRowsPerTile / 2;
      if (count == kRowsPerTile && x_rows == 1) {
        group_dot_rows<1, kRowsPerTile>(xq, rows.padded, tile, k, tile_scale, groups, group, partial,
                                        prefetch_target(qp, i, row, n, k));
      } else if (count == kRowsPerTile) {
        float half[kXRowsPerPass * kHalf];
        for (int64_t h = 0; h < kRowsPerTile; h += kHalf) {
          const int8_t* prefetch = h == 0 ? prefetch_target(qp, i, row, n, k) : nullptr;
          group_dot_rows<kXRowsPerPass, kHalf>(xq, rows.padded, tile + h * k, k, tile_scale + h * groups, groups,
                                               group, half, prefetch);
          for (int64_t j = 0; j < x_rows; ++j)
            for (int64_t r = 0; r < kHalf; ++r) partial[j * kRowsPerTile + h + r] = half[j * kHalf + r];
        }
      } else {
        for (int64_t j = 0; j < x_rows; ++j)
          for (int64_t r = 0; r < count; ++r)
            group_dot_rows<1, 1>(xq + j * rows.padded, rows.padded, tile + r * k, k, tile_scale + r * groups,
                                 groups, group, partial + j * kRowsPerTile + r, nullptr);
      }
      for (int64_t j = 0; j < x_rows; ++j)
        for (int64_t r = 0; r < count; ++r) partial[j * kRowsPerTile + r] *= rows.scales[i + j];
      add_offsets(i, x_rows, row, count, partial);
    });
    return y;
  }
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
    add_offsets(i, x_rows, row, count, partial);
  });
  return y;
}

// y = x @ W^T for a few fp32 rows x [M, K] and 4-bit weights W[n, k] = q[n, k] * scale[n, g] +
// minimum[n, g] (g = k / group, group a multiple of 32), q stored as nibble pairs (byte j of a
// row: k = 2j in the low nibble, 2j + 1 in the high one; the GPU kernel's layout). As the int8
// kernel, x goes to int16 per row; its columns are deinterleaved per 32 (the 16 even ones,
// then the 16 odd ones), so a 16-byte load of q widens into two int16 vectors, low and high
// nibbles, that meet their x lanes with one vpmaddwd each. A group's int32 sums take its
// scale in fp32; the minimums meet per-group sums of x.
constexpr int64_t kInt4Chunk = 32;  // columns a 16-byte load holds

// Rows of x as int16, each 32-column chunk deinterleaved (even columns, then odd), with
// per-row scales, and each row's per-group sums of x (fp32, unrounded).
struct Int4Rows {
  std::vector<int16_t> values;
  std::vector<float> scales;
  std::vector<float> group_sums;  // [M, K / group]
};

#if defined(__AVX2__)
// One chunk (kInt4Chunk columns) of a row of x times `inverse`, rounded to the nearest int16
// (ties to even, as std::nearbyint): its even columns to `even`, its odd ones to `odd`.
inline void store_int16_chunk(const float* x, __m256 inverse, int16_t* even, int16_t* odd) {
  __m256 v[4];
  for (int64_t q = 0; q < 4; ++q) v[q] = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * q), inverse);
  for (int64_t parity = 0; parity < 2; ++parity) {
    __m256i words[2];
    for (int64_t h = 0; h < 2; ++h) {
      // Per 128-bit lane a0 a2 b0 b2 | a4 a6 b4 b6 (odd: a1 a3 ...), then the 64-bit pairs in order.
      const __m256 mixed = parity ? _mm256_shuffle_ps(v[2 * h], v[2 * h + 1], _MM_SHUFFLE(3, 1, 3, 1))
                                  : _mm256_shuffle_ps(v[2 * h], v[2 * h + 1], _MM_SHUFFLE(2, 0, 2, 0));
      const __m256d ordered = _mm256_permute4x64_pd(_mm256_castps_pd(mixed), _MM_SHUFFLE(3, 1, 2, 0));
      words[h] = _mm256_cvtps_epi32(_mm256_castpd_ps(ordered));
    }
    // packs interleaves its inputs' 128-bit lanes: put them back in column order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(words[0], words[1]), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(parity ? odd : even), packed);
  }
}
#endif

#if KVSERVE_INT4_BLOCKS
// Rows of x against packed weights (int4_dot_blocks) take the columns of whole blocks of
// kInt4Block in this order: a 64-byte load of a weight row is 32 int16 lanes, lane l holding
// columns 4l .. 4l + 3 (bytes 2l, 2l + 1), and nibble i of every lane meets x's vector i,
// columns 4l + i. The columns past the last whole block keep the 32-column chunk order.
constexpr bool kBlockedInt4 = true;
constexpr int64_t kInt4Block = 128;

// kInt4Block columns of a row of x times `inverse`, rounded to the nearest int16 (ties to even,
// as std::nearbyint), stored as four vectors: vector i holds columns 4l + i in lane l.
inline void store_int16_block(const float* x, __m512 inverse, int16_t* dst) {
  __m512i natural[4];  // columns 32 v .. 32 v + 31 as int16, in order
  for (int64_t v = 0; v < 4; ++v) {
    const __m256i low = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * v), inverse)));
    const __m256i high =
        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * v + 16), inverse)));
    natural[v] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  // Lanes 0-7 of vector i take columns 4l + i of the first 32, lanes 8-15 those of the next 32
  // (32 on in vpermt2w's index); the last 64 columns fill lanes 16-31 the same way.
  struct Picks {
    alignas(64) int16_t index[4][32] = {};
    Picks() {
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t l = 0; l < 16; ++l) index[i][l] = static_cast<int16_t>(l < 8 ? 4 * l + i : 32 + 4 * (l - 8) + i);
    }
  };
  static const Picks picks;
  for (int64_t i = 0; i < 4; ++i) {
    const __m512i pick = _mm512_load_si512(picks.index[i]);
    const __m512i first = _mm512_permutex2var_epi16(natural[0], pick, natural[1]);
    const __m512i second = _mm512_permutex2var_epi16(natural[2], pick, natural[3]);
    _mm512_storeu_si512(dst + 32 * i, _mm512_inserti64x4(first, _mm512_castsi512_si256(second), 1));
  }
}
#else
constexpr bool kBlockedInt4 = false;
constexpr int64_t kInt4Block = 1;
#endif

// x's rows as int16 in the int4 kernel's chunk order (with `blocked`, whole kInt4Block blocks
// in int4_dot_blocks' order first), with their scales and group sums; held per thread and
// reused by the next call (a decode step makes 120 of them on SmolLM2).
const Int4Rows& int4_rows(const float* x, int64_t m, int64_t k, int64_t group, bool blocked) {
  thread_local Int4Rows out;
  out.values.resize(m * k);
  out.scales.resize(m);
  const int64_t groups = k / group;
  out.group_sums.resize(m * groups);
  [[maybe_unused]] const int64_t block_end = blocked ? k / kInt4Block * kInt4Block : 0;
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    const float scale = int16_scale(row, k);
    const float inverse = 1.f / scale;
    int16_t* dst = out.values.data() + i * k;
#if KVSERVE_INT4_BLOCKS
    for (int64_t c = 0; c < block_end; c += kInt4Block) store_int16_block(row + c, _mm512_set1_ps(inverse), dst + c);
#endif
#if defined(__AVX2__)
    for (int64_t c = block_end; c < k; c += kInt4Chunk)
      store_int16_chunk(row + c, _mm256_set1_ps(inverse), dst + c, dst + c + kInt4Chunk / 2);
#else
    for (int64_t c = 0; c < k; c += 2) {
      const int64_t chunk = c - c % kInt4Chunk, lane = (c % kInt4Chunk) / 2;
      dst[chunk + lane] = static_cast<int16_t>(std::nearbyint(row[c] * inverse));
      dst[chunk + kInt4Chunk / 2 + lane] = static_cast<int16_t>(std::nearbyint(row[c + 1] * inverse));
    }
#endif
    row_group_sums(row, group, groups, out.group_sums.data() + i * groups);
    out.scales[i] = scale;
  }
  return out;
}

// The nibbles of 32 columns (16 bytes) as int16 in x's deinterleaved order: even, odd. Each
// byte widens to an int16 first, so the high nibble is one shift and the low one a mask.
#if defined(__AVX2__)
inline void widen_nibbles(const uint8_t* bytes, __m256i& even, __m256i& odd) {
  const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  even = _mm256_and_si256(words, _mm256_set1_epi16(0x0F));
  odd = _mm256_srli_epi16(words, 4);
}
#endif

// 5-bit weights (GGUF Q5_0/Q5_1/Q5_K) are the nibble pairs plus a plane of their high bits,
// 16 bytes a row per 128 columns, in the order the kernels read them: for each whole block of
// 128 columns four uint32 masks, bit L of mask i the high bit of the block's column 4L + i (the
// lanes int4_dot_blocks gives nibble i); for each 32-column chunk past the last whole block
// (x's chunk order) two uint16 masks, bit b the high bit of the chunk's column 2b, then of
// column 2b + 1; zeros to the row's end. A masked add of 16 puts them on the nibbles.
constexpr int64_t kHighBlock = 128, kHighBlockBytes = 16;

inline uint32_t high_mask(const uint8_t* block, int64_t i) {
  uint32_t mask;
  std::memcpy(&mask, block + 4 * i, sizeof(mask));
  return mask;
}

// The 8 bits of `byte` at the even bit positions of a 16-bit value.
inline uint32_t spread_bits(uint32_t byte) {
  uint32_t v = byte & 0xFF;
  v = (v | (v << 4)) & 0x0F0F;
  v = (v | (v << 2)) & 0x3333;
  return (v | (v << 1)) & 0x5555;
}

// The high bits of the 32-column chunk at column c of a row (`row_high`, k columns) in x's
// chunk order: bit b of `even` is column c + 2b's, of `odd` column c + 2b + 1's. In a whole
// block, chunk j's column 4L + i (L = 8j + b / 2) has nibble i = 2b mod 4 (even) or 2b + 1 mod
// 4 (odd); past the last whole block the plane holds the chunk order itself.
inline void chunk_high_bits(const uint8_t* row_high, int64_t k, int64_t c, uint32_t& even, uint32_t& odd) {
  const int64_t whole = k / kHighBlock * kHighBlock;
  if (c >= whole) {
    const uint32_t masks = high_mask(row_high + whole / kHighBlock * kHighBlockBytes, (c - whole) / kInt4Chunk);
    even = masks & 0xFFFF;
    odd = masks >> 16;
    return;
  }
  const uint8_t* block = row_high + c / kHighBlock * kHighBlockBytes;
  const int64_t j = c % kHighBlock / kInt4Chunk;
  const auto byte = [&](int64_t i) { return high_mask(block, i) >> (8 * j); };
  even = spread_bits(byte(0)) | (spread_bits(byte(2)) << 1);
  odd = spread_bits(byte(1)) | (spread_bits(byte(3)) << 1);
}

#if defined(__AVX2__)
// 16 in each int16 lane of `values` whose bit of `bits` is set.
inline __m256i add_high_bits(__m256i values, uint32_t bits) {
  const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                             static_cast<int16_t>(0x8000));
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), lane_bit),
                                         lane_bit);
  return _mm256_add_epi16(values, _mm256_and_si256(set, _mm256_set1_epi16(16)));
}
#endif

// The nibbles of `rows` rows of q (`row_bytes` apart) as int16 in x's order, into w [rows, k];
// `prefetch` (or nullptr): the same rows of a later tile, one cache line per 64 bytes read.
// With `high` (rows `high_bytes` apart), the 5-bit values.
void unpack_int4_rows(const uint8_t* q, int64_t row_bytes, int64_t rows, int64_t k, int16_t* w,
                      const uint8_t* prefetch, const uint8_t* high = nullptr, int64_t high_bytes = 0) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; c += kInt4Chunk) {
      const uint8_t* bytes = q + r * row_bytes + c / 2;
      int16_t* dst = w + r * k + c;
      if (prefetch != nullptr && (c / 2) % 64 == 0)
        __builtin_prefetch(prefetch + r * row_bytes + c / 2);
      uint32_t even_high = 0, odd_high = 0;
      if (high != nullptr) chunk_high_bits(high + r * high_bytes, k, c, even_high, odd_high);
#if defined(__AVX2__)
      __m256i even, odd;
      widen_nibbles(bytes, even, odd);
      if (high != nullptr) {
        even = add_high_bits(even, even_high);
        odd = add_high_bits(odd, odd_high);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), even);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kInt4Chunk / 2), odd);
#else
      for (int64_t b = 0; b < kInt4Chunk / 2; ++b) {
        dst[b] = static_cast<int16_t>((bytes[b] & 15) + 16 * ((even_high >> b) & 1));
        dst[kInt4Chunk / 2 + b] = static_cast<int16_t>((bytes[b] >> 4) + 16 * ((odd_high >> b) & 1));
      }
#endif
    }
  }
}

// sums[j * R + r] = sum over groups g of scale[r, g] * (w[r, group g] . xq[j, group g]) for R
// rows of weights and X rows of xq (both `k` apart), int32 within a group, fp32 across. The
// weights are read as 4-bit (PACKED: q's nibble pairs, rows `row_bytes` apart) or as int16
// (unpacked once by unpack_int4_rows for several passes of x). Few accumulators on purpose:
// X * R int32 and X * R fp32 vectors must stay in the 16 registers.
template <int64_t X, int64_t R, bool PACKED>
void int4_dot(const int16_t* xq, int64_t k, const void* weights, int64_t row_bytes, const float* scale,
              int64_t groups, int64_t group, float* sums, const uint8_t* prefetch) {
#if defined(__AVX2__) && defined(__FMA__)
  const uint8_t* q = static_cast<const uint8_t*>(weights);
  const int16_t* w = static_cast<const int16_t*>(weights);
  __m256 acc[X][R];
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i isum[X][R];
    for (int64_t j = 0; j < X; ++j)
      for (int64_t r = 0; r < R; ++r) isum[j][r] = _mm256_setzero_si256();
    for (int64_t c = g * group; c < (g + 1) * group; c += kInt4Chunk) {
      if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c / 2 * R), _MM_HINT_T0);
      __m256i xe[X], xo[X];
      for (int64_t j = 0; j < X; ++j) {
        xe[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * k + c));
        xo[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * k + c + 16));
      }
      for (int64_t r = 0; r < R; ++r) {
        __m256i even, odd;
        if constexpr (PACKED) {
          widen_nibbles(q + r * row_bytes + c / 2, even, odd);
        } else {
          even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + c));
          odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + c + 16));
        }
        for (int64_t j = 0; j < X; ++j)
          isum[j][r] = _mm256_add_epi32(isum[j][r], _mm256_add_epi32(_mm256_madd_epi16(even, xe[j]),
                                                                     _mm256_madd_epi16(odd, xo[j])));
      }
    }
    add_scaled_group<X, R>(isum, scale, groups, g, acc);
  }
  store_lane_sums<X, R>(acc, sums);
#else
  scalar_group_dots<X, R>(xq, k, scale, groups, group, sums, [&](int64_t r, int64_t c) -> int64_t {
    if constexpr (PACKED) {
      const int64_t lane = c % kInt4Chunk;
      const uint8_t byte = static_cast<const uint8_t*>(weights)[r * row_bytes + (c - lane) / 2 + lane % 16];
      return lane < 16 ? (byte & 15) : (byte >> 4);
    } else {
      return static_cast<const int16_t*>(weights)[r * k + c];
    }
  });
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512DQ__)
// int4_dot on 512-bit vectors: two weight rows a vector, row 2p's 32 columns in the low half and
// row 2p + 1's in the high half, against each row of x broadcast to both halves. That halves
// the instructions a weight of AVX2's 256-bit form (measured on the 2-core AVX-512 Xeon: one
// row of x is bound by them, not by memory: a layer's weights hot in cache run no faster).
// With VNNI each multiply-add and its accumulation are one instruction (vpdpwssd).
template <int64_t X, int64_t R, bool PACKED>
void int4_dot_row_pairs(const int16_t* xq, int64_t k, const void* weights, int64_t row_bytes, const float* scale,
                        int64_t groups, int64_t group, float* sums, const uint8_t* prefetch) {
  static_assert(R % 2 == 0, "rows come in pairs");
  constexpr int64_t P = R / 2;
  const uint8_t* q = static_cast<const uint8_t*>(weights);
  const int16_t* w = static_cast<const int16_t*>(weights);
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  __m512 acc[X][P];
  for (int64_t j = 0; j < X; ++j)
    for (int64_t p = 0; p < P; ++p) acc[j][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i isum[X][P];
    for (int64_t j = 0; j < X; ++j)
      for (int64_t p = 0; p < P; ++p) isum[j][p] = _mm512_setzero_si512();
    for (int64_t c = g * group; c < (g + 1) * group; c += kInt4Chunk) {
      if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + c / 2 * R), _MM_HINT_T0);
      __m512i xe[X], xo[X];
      for (int64_t j = 0; j < X; ++j) {
        xe[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * k + c)));
        xo[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * k + c + 16)));
      }
      for (int64_t p = 0; p < P; ++p) {
        __m512i even, odd;
        if constexpr (PACKED) {
          const uint8_t* bytes = q + 2 * p * row_bytes + c / 2;
          const __m256i pair = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))),
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + row_bytes)), 1);
          const __m512i words = _mm512_cvtepu8_epi16(pair);
          even = _mm512_and_si512(words, low_nibble);
          odd = _mm512_srli_epi16(words, 4);
        } else {
          const int16_t* low = w + 2 * p * k + c;
          even = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low))),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + k)), 1);
          odd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + 16))),
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + k + 16)), 1);
        }
        for (int64_t j = 0; j < X; ++j) {
#if defined(__AVX512VNNI__)
          isum[j][p] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[j][p], even, xe[j]), odd, xo[j]);
#else
          isum[j][p] = _mm512_add_epi32(isum[j][p], _mm512_add_epi32(_mm512_madd_epi16(even, xe[j]),
                                                                     _mm512_madd_epi16(odd, xo[j])));
#endif
        }
      }
    }
    for (int64_t p = 0; p < P; ++p) {
      const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(scale[2 * p * groups + g]),
                                          _mm256_set1_ps(scale[(2 * p + 1) * groups + g]), 1);
      for (int64_t j = 0; j < X; ++j) acc[j][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j][p]), s, acc[j][p]);
    }
  }
  for (int64_t j = 0; j < X; ++j) {
    for (int64_t p = 0; p < P; ++p) {
      sums[j * R + 2 * p] = horizontal_sum(_mm512_castps512_ps256(acc[j][p]));
      sums[j * R + 2 * p + 1] = horizontal_sum(_mm512_extractf32x8_ps(acc[j][p], 1));
    }
  }
}
#endif

#if KVSERVE_INT4_BLOCKS
// The int32 sums of two int16 vectors' products, added to `acc` (vpdpwssd with VNNI).
inline __m512i multiply_add(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

inline __m256i multiply_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// The scales of a block's groups (lanes 0 .. 3 at most, masked: never past a row's last
// group), stored as fp32 or fp16.
inline __m512 block_scales(const float* scale, __mmask16 live) { return _mm512_maskz_loadu_ps(live, scale); }
inline __m512 block_scales(const at::Half* scale, __mmask16 live) {
  return _mm512_castps128_ps512(_mm_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>(live), scale)));
}

// sums[j * R + r] = sum over groups g of scale[r, g] * (q[r, group g] . xq[j, group g]) for R
// rows of packed weights and X rows of x (`k` apart) in int4_rows' blocked order. A block's
// 64-byte load of a row gives its four nibbles a lane by shifts and masks, no widening shuffle
// (against int4_dot_row_pairs' 16-byte loads, each widened by vpmovzxbw): on the 2-core Xeon one
// row of x is bound by instructions, not by memory; the nibbles a load gives serve all X rows.
// Lane L of a block's int32 sums covers columns 8L .. 8L + 7, inside one group (groups are
// multiples of 32 columns that divide or are multiples of kInt4Block), so each block takes its
// scales (fp32 or fp16, as stored) as one vector, lane L the scale of group 8L / group of the
// block. Columns past the last whole block go 32 at a time, in the chunk order.
// Each row of x meets the same operations in the same order whatever X is, so a row's result
// does not depend on how many rows the call has (greedy decoding stays batch-invariant).
// With `high` (5-bit weights; rows `high_bytes` apart), each nibble vector takes its block's
// high-bit mask as a masked add of 16.
template <int64_t X, int64_t R, typename Scale>
void int4_dot_blocks(const int16_t* xq, int64_t k, const uint8_t* q, int64_t row_bytes, const Scale* scale,
                     int64_t groups, int64_t group, float* sums, const uint8_t* prefetch,
                     const uint8_t* high = nullptr, int64_t high_bytes = 0) {
  const int64_t block_end = k / kInt4Block * kInt4Block;
  const __m512i low_nibble = _mm512_set1_epi16(0x0F), sixteen = _mm512_set1_epi16(16);
  // Group of lane L within its block (0 where a group spans whole blocks), and the scales a
  // block loads (a masked load: never past a row's last group).
  const int64_t groups_per_block = group < kInt4Block ? kInt4Block / group : 1;
  const __m512i lane_group = _mm512_srli_epi32(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                                   6, 5, 4, 3, 2, 1, 0),
                                                                  _mm512_set1_epi32(8)),
                                               __builtin_ctzll(std::min(group, kInt4Block)));
  const __mmask16 live = static_cast<__mmask16>((1u << groups_per_block) - 1);
  __m512 acc[X][R];
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < block_end; c += kInt4Block) {
    if (prefetch != nullptr)
      for (int64_t line = 0; line < R; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + c / 2 * R + 64 * line), _MM_HINT_T0);
    __m512i x[X][4];
    for (int64_t j = 0; j < X; ++j)
      for (int64_t i = 0; i < 4; ++i) x[j][i] = _mm512_loadu_si512(xq + j * k + c + 32 * i);
    const int64_t first_group = c / group;
    for (int64_t r = 0; r < R; ++r) {
      const __m512i w = _mm512_loadu_si512(q + r * row_bytes + c / 2);
      __m512i nibbles[4] = {_mm512_and_si512(w, low_nibble), _mm512_and_si512(_mm512_srli_epi16(w, 4), low_nibble),
                            _mm512_and_si512(_mm512_srli_epi16(w, 8), low_nibble), _mm512_srli_epi16(w, 12)};
      if (high != nullptr) {
        const uint8_t* block = high + r * high_bytes + c / kHighBlock * kHighBlockBytes;
        for (int64_t i = 0; i < 4; ++i)
          nibbles[i] = _mm512_mask_add_epi16(nibbles[i], _cvtu32_mask32(high_mask(block, i)), nibbles[i], sixteen);
      }
      const __m512 scales = _mm512_permutexvar_ps(lane_group, block_scales(scale + r * groups + first_group, live));
      for (int64_t j = 0; j < X; ++j) {
        __m512i dots = multiply_add(_mm512_setzero_si512(), nibbles[0], x[j][0]);
        for (int64_t i = 1; i < 4; ++i) dots = multiply_add(dots, nibbles[i], x[j][i]);
        acc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scales, acc[j][r]);
      }
    }
  }
  __m256 tail[X][R];
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) tail[j][r] = _mm256_setzero_ps();
  for (int64_t c = block_end; c < k; c += kInt4Chunk) {
    for (int64_t r = 0; r < R; ++r) {
      __m256i even, odd;
      widen_nibbles(q + r * row_bytes + c / 2, even, odd);
      if (high != nullptr) {
        uint32_t even_high, odd_high;
        chunk_high_bits(high + r * high_bytes, k, c, even_high, odd_high);
        even = _mm256_mask_add_epi16(even, static_cast<__mmask16>(even_high), even, _mm256_set1_epi16(16));
        odd = _mm256_mask_add_epi16(odd, static_cast<__mmask16>(odd_high), odd, _mm256_set1_epi16(16));
      }
      const __m256 group_scale = _mm256_set1_ps(as_float(scale[r * groups + c / group]));
      for (int64_t j = 0; j < X; ++j) {
        const __m256i even_x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * k + c));
        const __m256i odd_x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * k + c + kInt4Chunk / 2));
        const __m256i dots = multiply_add(multiply_add(_mm256_setzero_si256(), even, even_x), odd, odd_x);
        tail[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), group_scale, tail[j][r]);
      }
    }
  }
  for (int64_t j = 0; j < X; ++j)
    for (int64_t r = 0; r < R; ++r) sums[j * R + r] = _mm512_reduce_add_ps(acc[j][r]) + horizontal_sum(tail[j][r]);
}
#endif

// int4_dot in the widest vectors this build has.
template <int64_t X, int64_t R, bool PACKED>
inline void int4_dots(const int16_t* xq, int64_t k, const void* weights, int64_t row_bytes, const float* scale,
                      int64_t groups, int64_t group, float* sums, const uint8_t* prefetch) {
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
  int4_dot_row_pairs<X, R, PACKED>(xq, k, weights, row_bytes, scale, groups, group, sums, prefetch);
#else
  int4_dot<X, R, PACKED>(xq, k, weights, row_bytes, scale, groups, group, sums, prefetch);
#endif
}

// The int4 matmul over tiles of rows, with scales and minimums stored as Scale (fp32 or fp16);
// with `hp` (rows `high_bytes` apart) the 5-bit one. Outside the blocked kernel 5-bit tiles
// are unpacked to int16 once, in the first pass, for any number of rows of x.
template <typename Scale>
void int4_tiles(const Int4Rows& rows, int64_t m, int64_t n, int64_t k, int64_t group, bool blocked, const uint8_t* qp,
                const Scale* sp, const Scale* mp, const uint8_t* hp, int64_t high_bytes, float* y) {
  const int64_t groups = k / group;
  const int64_t row_bytes = k / 2;
  constexpr int64_t kHalf = kRowsPerTile / 2;
  over_row_tiles(m, n, y, [&](int64_t i, int64_t x_rows, int64_t row, int64_t count, float* partial) {
    const int16_t* xq = rows.values.data() + i * k;
    const uint8_t* tile = qp + row * row_bytes;
    const uint8_t* tile_high = hp == nullptr ? nullptr : hp + row * high_bytes;
#if KVSERVE_INT4_BLOCKS
    if (blocked) {  // scales as stored; every row of x by the same operations
      if (count == kRowsPerTile && x_rows == kXRowsPerPass) {
        int4_dot_blocks<kXRowsPerPass, kRowsPerTile>(xq, k, tile, row_bytes, sp + row * groups, groups, group,
                                                     partial, prefetch_target(qp, i, row, n, row_bytes), tile_high,
                                                     high_bytes);
      } else if (count == kRowsPerTile) {  // the last, partial pass over x
        int4_dot_blocks<1, kRowsPerTile>(xq, k, tile, row_bytes, sp + row * groups, groups, group, partial,
                                         prefetch_target(qp, i, row, n, row_bytes), tile_high, high_bytes);
      } else {
        for (int64_t j = 0; j < x_rows; ++j)
          for (int64_t r = 0; r < count; ++r)
            int4_dot_blocks<1, 1>(xq + j * k, k, tile + r * row_bytes, row_bytes, sp + (row + r) * groups, groups,
                                  group, partial + j * kRowsPerTile + r, nullptr,
                                  tile_high == nullptr ? nullptr : tile_high + r * high_bytes, high_bytes);
      }
    } else
#endif
    {
      thread_local std::vector<float> widened;
      const float* tile_scale = fp32_values(sp + row * groups, count * groups, i == 0, widened);
      // One row of x reads the nibbles directly; more unpack each tile once, in the first
      // pass, for all passes, and take the tile in halves (the registers hold 2 x 2 sums).
      thread_local std::vector<int16_t> unpacked;
      if (count == kRowsPerTile && m == 1 && hp == nullptr) {
        int4_dots<1, kRowsPerTile, true>(xq, k, tile, row_bytes, tile_scale, groups, group, partial,
                                         prefetch_target(qp, i, row, n, row_bytes));
      } else if (count == kRowsPerTile) {
        if (i == 0) {
          unpacked.resize(kRowsPerTile * k);
          unpack_int4_rows(tile, row_bytes, kRowsPerTile, k, unpacked.data(), prefetch_target(qp, i, row, n, row_bytes),
                           tile_high, high_bytes);
        }
        float half[kXRowsPerPass * kHalf];
        for (int64_t h = 0; h < kRowsPerTile; h += kHalf) {
          const int16_t* w = unpacked.data() + h * k;
          if (x_rows == kXRowsPerPass) {
            int4_dots<kXRowsPerPass, kHalf, false>(xq, k, w, 0, tile_scale + h * groups, groups, group, half,
                                                   nullptr);
          } else {
            for (int64_t j = 0; j < x_rows; ++j)
              int4_dots<1, kHalf, false>(xq + j * k, k, w, 0, tile_scale + h * groups, groups, group,
                                         half + j * kHalf, nullptr);
          }
          for (int64_t j = 0; j < x_rows; ++j)
            for (int64_t r = 0; r < kHalf; ++r) partial[j * kRowsPerTile + h + r] = half[j * kHalf + r];
        }
      } else if (hp == nullptr) {
        for (int64_t j = 0; j < x_rows; ++j)
          for (int64_t r = 0; r < count; ++r)
            int4_dot<1, 1, true>(xq + j * k, k, tile + r * row_bytes, row_bytes, tile_scale + r * groups, groups,
                                 group, partial + j * kRowsPerTile + r, nullptr);
      } else {  // the last tile's rows, 5-bit
        if (i == 0) {
          unpacked.resize(count * k);
          unpack_int4_rows(tile, row_bytes, count, k, unpacked.data(), nullptr, tile_high, high_bytes);
        }
        for (int64_t j = 0; j < x_rows; ++j)
          for (int64_t r = 0; r < count; ++r)
            int4_dot<1, 1, false>(xq + j * k, k, unpacked.data() + r * k, 0, tile_scale + r * groups, groups, group,
                                  partial + j * kRowsPerTile + r, nullptr);
      }
    }
    for (int64_t j = 0; j < x_rows; ++j) {
      const float* sums = rows.group_sums.data() + (i + j) * groups;
      for (int64_t r = 0; r < count; ++r) {
        const float offset = minimum_offset(mp + (row + r) * groups, sums, groups);
        partial[j * kRowsPerTile + r] = std::fma(partial[j * kRowsPerTile + r], rows.scales[i + j], offset);
      }
    }
  });
}

// With `high` (uint8 [N, ceil(K / 128) * 16], the plane described at kHighBlockBytes), q holds
// the low four bits of 5-bit weights: W[n, k] = (q + 16 * high bit) * scale + minimum.
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minimum,
                       int64_t group, const std::optional<at::Tensor>& high) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_matmul: x must be 2-D fp32");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(group > 0 && group % kInt4Chunk == 0 && k % group == 0, "int4_matmul: group size ", group,
              " must be a multiple of 32 that divides the ", k, " input columns");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) == k / 2,
              "int4_matmul: q must be contiguous uint8 nibble pairs [N, K / 2]");
  const int64_t groups = k / group;
  const bool fp16 = scale.scalar_type() == at::kHalf;
  TORCH_CHECK((fp16 || scale.scalar_type() == at::kFloat) && minimum.scalar_type() == scale.scalar_type() &&
              scale.numel() == n * groups && minimum.numel() == n * groups,
              "int4_matmul: scale and minimum must be both fp32 or both fp16 [N, K / group]");
  const int64_t high_bytes = (k + kHighBlock - 1) / kHighBlock * kHighBlockBytes;
  if (high.has_value()) {
    TORCH_CHECK(high->scalar_type() == at::kByte && high->is_contiguous() && high->dim() == 2 && high->size(0) == n &&
                high->size(1) == high_bytes, "int4_matmul: high must be contiguous uint8 [N, ", high_bytes, "]");
    // A group's int32 lanes add 2 * 31 * 32767 a chunk (unpacked path): 4096 columns stay in range.
    TORCH_CHECK(group <= 4096, "int4_matmul: 5-bit groups are at most 4096 columns, got ", group);
  }
  const uint8_t* hp = high.has_value() ? high->data_ptr<uint8_t>() : nullptr;
  const at::Tensor xc = x.contiguous(), sc = scale.contiguous(), mc = minimum.contiguous();
  at::Tensor y = at::empty({m, n}, xc.options());
  // Whole blocks (int4_dot_blocks) where the groups line up with them, for any number of rows:
  // a row's result is then the same at every row count.
  const bool blocked = kBlockedInt4 && (group % kInt4Block == 0 || kInt4Block % group == 0);
  const Int4Rows& rows = int4_rows(xc.data_ptr<float>(), m, k, group, blocked);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  if (fp16) {
    int4_tiles(rows, m, n, k, group, blocked, qp, sc.data_ptr<at::Half>(), mc.data_ptr<at::Half>(), hp, high_bytes,
               y.data_ptr<float>());
  } else {
    int4_tiles(rows, m, n, k, group, blocked, qp, sc.data_ptr<float>(), mc.data_ptr<float>(), hp, high_bytes,
               y.data_ptr<float>());
  }
  return y;
}

// y = x @ w^T for a few fp32 rows x [M, K] and fp32 w [N, K] (an LM head at decode): each
// tile of kRowsPerTile weight rows is read from memory once, with FMAs into fp32 lanes, and
// serves every row of x from the cache. MKL's sgemv read SmolLM2's 113 MB head at ~8 GB/s
// of the 18.5 a plain sum reaches on a 2-core EPYC.
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
  store_lane_sums<X, R>(acc, out);
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
  m.def("int8_matmul(Tensor x, Tensor q, Tensor scale, Tensor? offset=None) -> Tensor");
  m.def("float_matmul(Tensor x, Tensor w) -> Tensor");
  m.def("int4_matmul(Tensor x, Tensor q, Tensor scale, Tensor minimum, int group, Tensor? high=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("int8_matmul", int8_matmul);
  m.impl("float_matmul", float_matmul);
  m.impl("int4_matmul", int4_matmul);
}
