#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <algorithm>
constexpr int64_t kInt4Chunk = 32;
inline float int16_scale_scalar(const float* row, int64_t k) {
  float amax = 0.f;
  for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
  return amax > 0.f ? amax / 32767.f : 1.f;
}
struct Int4Rows { std::vector<int16_t> values; std::vector<float> scales; std::vector<float> group_sums; };
Int4Rows int4_rows_scalar(const float* x, int64_t m, int64_t k, int64_t group) {
  Int4Rows out;
  out.values.resize(m * k); out.scales.resize(m);
  const int64_t groups = k / group;
  out.group_sums.assign(m * groups, 0.f);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    const float scale = int16_scale_scalar(row, k);
    const float inverse = 1.f / scale;
    int16_t* dst = out.values.data() + i * k;
    for (int64_t c = 0; c < k; c += 2) {
      const int64_t chunk = c - c % kInt4Chunk, lane = (c % kInt4Chunk) / 2;
      dst[chunk + lane] = static_cast<int16_t>(std::nearbyint(row[c] * inverse));
      dst[chunk + kInt4Chunk / 2 + lane] = static_cast<int16_t>(std::nearbyint(row[c + 1] * inverse));
    }
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) sum += row[c];
      out.group_sums[i * groups + g] = sum;
    }
    out.scales[i] = scale;
  }
  return out;
}
// ---- vector
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float int16_scale(const float* row, int64_t k) {
  int64_t c = 0;
  float amax = 0.f;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 acc = _mm256_setzero_ps();
  for (; c + 8 <= k; c += 8) acc = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(row + c), magnitude), acc);
  amax = hmax(acc);
  for (; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
  return amax > 0.f ? amax / 32767.f : 1.f;
}
// 16 int16 of the even (or odd) columns of 32 floats, scaled and rounded to nearest even.
inline void store_deinterleaved(const float* x, __m256 inverse, int16_t* even, int16_t* odd) {
  const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x), inverse), b = _mm256_mul_ps(_mm256_loadu_ps(x + 8), inverse);
  const __m256 c = _mm256_mul_ps(_mm256_loadu_ps(x + 16), inverse), d = _mm256_mul_ps(_mm256_loadu_ps(x + 24), inverse);
  // Per 128-bit lane: a0 a2 b0 b2 | a4 a6 b4 b6; the 64-bit pairs reordered: a0 a2 a4 a6 b0 b2 b4 b6.
  auto pick = [](__m256 lo, __m256 hi, bool odd_columns) {
    const __m256 mixed = odd_columns ? _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1))
                                     : _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    return _mm256_cvtps_epi32(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(mixed), _MM_SHUFFLE(3, 1, 2, 0))));
  };
  for (int parity = 0; parity < 2; ++parity) {
    const __m256i packed = _mm256_packs_epi32(pick(a, b, parity), pick(c, d, parity));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(parity ? odd : even),
                        _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
  }
}
const Int4Rows& int4_rows(const float* x, int64_t m, int64_t k, int64_t group) {
  thread_local Int4Rows out;
  out.values.resize(m * k); out.scales.resize(m);
  const int64_t groups = k / group;
  out.group_sums.resize(m * groups);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    const float scale = int16_scale(row, k);
    const __m256 inverse = _mm256_set1_ps(1.f / scale);
    int16_t* dst = out.values.data() + i * k;
    for (int64_t c = 0; c < k; c += kInt4Chunk) store_deinterleaved(row + c, inverse, dst + c, dst + c + kInt4Chunk / 2);
    // Each group's sum in column order, as the scalar loop: 8 groups' chains side by side.
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t t = 0; t < group; ++t)
        for (int64_t u = 0; u < 8; ++u) s[u] += row[(g + u) * group + t];
      for (int64_t u = 0; u < 8; ++u) out.group_sums[i * groups + g + u] = s[u];
    }
    for (; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t c = g * group; c < (g + 1) * group; ++c) sum += row[c];
      out.group_sums[i * groups + g] = sum;
    }
    out.scales[i] = scale;
  }
  return out;
}
template <typename F> double time_us(F&& f, int64_t k, std::vector<float>& x) {
  volatile float sink = 0;
  for (int w = 0; w < 1000; ++w) sink = sink + f(x.data(), 1, k, 64).scales[0];
  auto t = std::chrono::steady_clock::now();
  const int n = 200000;
  for (int w = 0; w < n; ++w) { x[w % k] += 1e-9f; sink = sink + f(x.data(), 1, k, 64).values[5]; }
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count() / n;
}
int main() {
  for (int64_t k : {64, 576, 1536}) {
    for (int64_t m : {1, 3}) {
      std::vector<float> x(m * k);
      for (int64_t i = 0; i < m * k; ++i) x[i] = std::sin(i * 0.37f) * (i % 7 == 0 ? 30.f : 3.f) + 0.5f;
      x[5] = 0.f;
      Int4Rows s = int4_rows_scalar(x.data(), m, k, 32), v = int4_rows(x.data(), m, k, 32);
      bool same_values = s.values == v.values, same_scales = s.scales == v.scales;
      double worst = 0;
      for (size_t g = 0; g < s.group_sums.size(); ++g) worst = std::max(worst, (double)std::fabs(s.group_sums[g] - v.group_sums[g]));
      printf("k=%ld m=%ld values %s scales %s sums max diff %.3g\n", (long)k, (long)m, same_values ? "same" : "DIFFER", same_scales ? "same" : "DIFFER", worst);
    }
    std::vector<float> x(k);
    for (int64_t i = 0; i < k; ++i) x[i] = std::sin(i * 0.37f) * 3.f;
    printf("k=%ld scalar %.3f us, vector %.3f us\n", (long)k, time_us(int4_rows_scalar, k, x), time_us(int4_rows, k, x));
  }
}
