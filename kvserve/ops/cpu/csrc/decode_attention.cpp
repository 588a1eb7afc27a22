// Attention of B queries (single-token decodes, or the rows of verify steps) over a paged fp32
// KV cache, read in place.
//
// torch's path for this gathers each layer's context into a padded copy, concatenates the new
// key/value and runs SDPA: ~80 us a layer for SmolLM2 at batch 1, where the bytes (~200 KB of
// K/V at 128 positions) take a few. Here each (sequence, KV head) reads its rows through the
// slot table, scores eight keys per step (eight FMA chains, one horizontal sum), takes a
// vectorized exp and accumulates the values: one pass, no copies.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kKeysPerStep = 8;
// Multiply-adds below which a thread is not worth waking: batch-1 steps of SmolLM2 (~50k per
// KV head at 128 positions) ran no faster on two threads than on one.
constexpr int64_t kMinWorkPerThread = 1 << 16;

#if KVSERVE_AVX2
// exp(x) for x <= 0: Cephes' expf polynomial (~1 ulp), 0 below -87 (where expf underflows),
// so -inf scores give exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, low, _CMP_GE_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln 2, in two parts
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(two_n)), keep);
}

// The lane sums of acc[0..7], as one vector.
inline __m256 lane_sums(const __m256 acc[8]) {
  const __m256 a = _mm256_hadd_ps(acc[0], acc[1]), b = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 c = _mm256_hadd_ps(acc[4], acc[5]), d = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

// scores[i] = scale * q . keys[i] for kKeysPerStep key rows of `dim` floats.
inline void score_keys(const float* q, const float* const* keys, int64_t dim, float scale, float* scores) {
#if KVSERVE_AVX2
  if (dim % 8 == 0) {
    __m256 acc[kKeysPerStep];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int64_t i = 0; i < kKeysPerStep; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(keys[i] + d), qv, acc[i]);
    }
    _mm256_storeu_ps(scores, _mm256_mul_ps(lane_sums(acc), _mm256_set1_ps(scale)));
    return;
  }
#endif
  for (int64_t i = 0; i < kKeysPerStep; ++i) {
    float sum = 0.f;
    for (int64_t d = 0; d < dim; ++d) sum += q[d] * keys[i][d];
    scores[i] = sum * scale;
  }
}

// s = softmax(s) in place; n is a multiple of kKeysPerStep and s holds at least one finite score.
inline void softmax(float* s, int64_t n) {
  float largest = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) largest = std::max(largest, s[t]);
  float sum = 0.f;
#if KVSERVE_AVX2
  const __m256 shift = _mm256_set1_ps(largest);
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  for (const float lane : lanes) sum += lane;
#else
  for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - largest));
#endif
  const float inverse = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) s[t] *= inverse;
}

inline void add_scaled(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// query [B, H, D]; kv_cache [2, ..., KVH, D] (a layer's keys then values, rows addressed by
// slot); slots/valid [B, C]: the cache slot of each context position and whether the query
// sees it; key/value [N, KVH, D]: the step's new tokens, not yet in the cache, seen after the
// context (the compiled decode step), or absent; new_valid [B, N]: which new tokens each query
// sees (a verify step's causal or tree mask), absent: N == B and query b sees new token b.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& slots,
                            const at::Tensor& valid, const std::optional<at::Tensor>& key,
                            const std::optional<at::Tensor>& value, double scale,
                            const std::optional<at::Tensor>& new_valid) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat, "decode_attention: query must be fp32 [B, H, D]");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous() && kv_cache.size(0) == 2,
              "decode_attention: kv_cache must be a contiguous fp32 [2, ..., KVH, D]");
  const at::Tensor q = query.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(-2);
  TORCH_CHECK(kv_cache.size(-1) == dim && heads % kv_heads == 0, "decode_attention: ", heads, " query heads of ",
              dim, " over a cache of ", kv_heads, " heads of ", kv_cache.size(-1));
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == batch && slots.scalar_type() == at::kLong,
              "decode_attention: slots must be int64 [B, C]");
  TORCH_CHECK(valid.sizes() == slots.sizes() && valid.scalar_type() == at::kBool, "decode_attention: valid must be bool [B, C]");
  TORCH_CHECK(key.has_value() == value.has_value(), "decode_attention: key and value come together");
  const int64_t group = heads / kv_heads, context = slots.size(1);
  const int64_t row_floats = kv_heads * dim, num_slots = kv_cache.numel() / 2 / row_floats;
  const float* cache_keys = kv_cache.data_ptr<float>();
  const float* cache_values = cache_keys + num_slots * row_floats;
  const at::Tensor slots_c = slots.contiguous(), valid_c = valid.contiguous();
  const int64_t* slot = slots_c.data_ptr<int64_t>();
  const bool* seen_by = valid_c.data_ptr<bool>();
  at::Tensor new_keys, new_values, new_valid_c;
  const float* new_key = nullptr;
  const float* new_value = nullptr;
  const bool* new_seen_by = nullptr;
  int64_t num_new = 0;
  if (key.has_value()) {
    new_keys = key->contiguous();
    new_values = value->contiguous();
    num_new = new_keys.numel() / row_floats;
    TORCH_CHECK(new_keys.scalar_type() == at::kFloat && new_keys.numel() == num_new * row_floats &&
                new_values.scalar_type() == at::kFloat && new_values.numel() == num_new * row_floats,
                "decode_attention: key and value must be fp32 [N, KVH, D]");
    new_key = new_keys.data_ptr<float>();
    new_value = new_values.data_ptr<float>();
    if (new_valid.has_value()) {
      new_valid_c = new_valid->contiguous();
      TORCH_CHECK(new_valid_c.scalar_type() == at::kBool && new_valid_c.dim() == 2 && new_valid_c.size(0) == batch &&
                  new_valid_c.size(1) == num_new, "decode_attention: new_valid must be bool [B, N]");
      new_seen_by = new_valid_c.data_ptr<bool>();
    } else {
      TORCH_CHECK(num_new == batch, "decode_attention: without new_valid, key and value must be [B, KVH, D]");
    }
  } else {
    TORCH_CHECK(!new_valid.has_value(), "decode_attention: new_valid needs key and value");
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float score_scale = static_cast<float>(scale);
  const int64_t positions = context + (new_seen_by != nullptr ? num_new : (new_key != nullptr ? 1 : 0));
  const int64_t padded = (positions + kKeysPerStep - 1) / kKeysPerStep * kKeysPerStep;
  const int64_t work = std::max<int64_t>(1, 2 * positions * group * dim);
  at::parallel_for(0, batch * kv_heads, std::max<int64_t>(1, kMinWorkPerThread / work), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(padded);
    std::vector<const float*> key_rows(padded), value_rows(padded);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      // The rows this query sees, in order; the padding up to whole steps repeats a row and
      // gets a score of -inf.
      int64_t seen = 0;
      for (int64_t t = 0; t < context; ++t) {
        if (!seen_by[b * context + t]) continue;
        const int64_t s = slot[b * context + t];
        TORCH_CHECK(s >= 0 && s < num_slots, "decode_attention: slot ", s, " outside the cache's ", num_slots);
        key_rows[seen] = cache_keys + s * row_floats + h * dim;
        value_rows[seen++] = cache_values + s * row_floats + h * dim;
      }
      for (int64_t n = 0; n < num_new; ++n) {
        if (new_seen_by != nullptr ? !new_seen_by[b * num_new + n] : n != b) continue;
        key_rows[seen] = new_key + (n * kv_heads + h) * dim;
        value_rows[seen++] = new_value + (n * kv_heads + h) * dim;
      }
      float* outputs = op + (b * heads + h * group) * dim;
      std::fill(outputs, outputs + group * dim, 0.f);
      if (seen == 0) continue;  // nothing to attend to: zeros, not NaN
      const int64_t steps_end = (seen + kKeysPerStep - 1) / kKeysPerStep * kKeysPerStep;
      std::fill(key_rows.begin() + seen, key_rows.begin() + steps_end, key_rows[0]);
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = qp + (b * heads + h * group + g) * dim;
        for (int64_t t = 0; t < steps_end; t += kKeysPerStep)
          score_keys(qh, key_rows.data() + t, dim, score_scale, scores.data() + t);
        std::fill(scores.begin() + seen, scores.begin() + steps_end, -std::numeric_limits<float>::infinity());
        softmax(scores.data(), steps_end);
        for (int64_t t = 0; t < seen; ++t) add_scaled(outputs + g * dim, scores[t], value_rows[t], dim);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor kv_cache, Tensor slots, Tensor valid, Tensor? key, Tensor? value, "
        "float scale, Tensor? new_valid=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("decode_attention", decode_attention);
}
