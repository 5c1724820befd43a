// Paged attention for query tokens that each see a prefix of their sequence (decodes,
// speculative rows, short chunks), reading K/V in place from the block-major cache
// [num_blocks, num_kv_heads, block_size, head_dim]. One task per (token, KV head): the G
// query heads that share the KV head walk the token's blocks together with an online
// softmax (running max, normaliser and output rescaled per block), so nothing is gathered
// or materialised per (token, block) pair. Scores, softmax and the output accumulate in
// float32 whatever the cache dtype.
//
// Registered as torch.ops.raylm.paged_attention; built on first use
// (raylm/runner/attention/cpu_kernel.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// exp(x) for x <= 0 (scores less their running max) as plain arithmetic, so that a loop of
// it vectorises (std::exp is a library call per element): Cody-Waite range reduction and
// Cephes' degree-6 polynomial, within 2 ulp of expf; x below -87 gives ~0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// A block's keys or values as float32: the cache itself when it is float32, else
// converted into ``scratch``.
template <typename T>
inline const float* as_float(const T* in, int64_t count, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return in;
  } else {
    for (int64_t i = 0; i < count; ++i) scratch[i] = static_cast<float>(in[i]);
    return scratch;
  }
}

template <typename T>
void attend(const T* query, const T* key_cache, const T* value_cache,
            const int64_t* block_table, int64_t table_stride, const int64_t* token_row,
            const int64_t* kv_len, T* out, int64_t num_tokens, int64_t num_kv_heads,
            int64_t group, int64_t block_size, int64_t head_dim, float scale, int64_t window,
            float softcap) {
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), k_buf(block_size * head_dim),
        v_buf(block_size * head_dim), p(block_size), row_max(group), row_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / num_kv_heads, h = task % num_kv_heads;
      const T* q_in = query + (t * num_kv_heads + h) * group * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(q_in[i]);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      const int64_t len = kv_len[t];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t* blocks = block_table + token_row[t] * table_stride;
      for (int64_t start = first / block_size * block_size; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t j0 = std::max<int64_t>(0, first - start);  // keys before the window
        const int64_t offset = blocks[start / block_size] * block_stride + h * block_size * head_dim;
        const float* k = as_float(key_cache + offset, n * head_dim, k_buf.data());
        const float* v = as_float(value_cache + offset, n * head_dim, v_buf.data());
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t j = j0; j < n; ++j) {
            const float* kj = k + j * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kj[d];
            p[j] = dot * scale;
            // Gemma 2's soft-capped logits: softcap * tanh(score / softcap).
            if (softcap > 0.f) p[j] = softcap * std::tanh(p[j] / softcap);
            block_max = std::max(block_max, p[j]);
          }
          const float new_max = std::max(row_max[g], block_max);
          const float rescale = std::exp(row_max[g] - new_max);  // 0 on the first block
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = j0; j < n; ++j) {
            p[j] = exp_nonpositive(p[j] - new_max);
            sum += p[j];
          }
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= rescale;
          for (int64_t j = j0; j < n; ++j) {
            const float w = p[j];
            const float* vj = v + j * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += w * vj[d];
          }
          row_sum[g] = row_sum[g] * rescale + sum;
          row_max[g] = new_max;
        }
      }
      T* o = out + (t * num_kv_heads + h) * group * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          o[g * head_dim + d] = static_cast<T>(acc[g * head_dim + d] / row_sum[g]);
    }
  });
}

#ifdef __AVX512F__
#include <immintrin.h>

// 16 consecutive cache values as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once (a transpose-and-add tree:
// ~3 instructions per sum instead of a horizontal reduction each).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s halves summed, 8-15: v[2i+1]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: v[4i + L]'s quarters summed
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  // Lane L now holds, at 4L + m, the sum of v[4m + L].
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// The kernel above for head_dim D (a multiple of 16) with AVX-512: keys 16 at a time,
// their 16 scores in one register; each query head's output accumulates in registers.
template <typename T, int D>
void attend_avx512(const T* query, const T* key_cache, const T* value_cache,
                   const int64_t* block_table, int64_t table_stride, const int64_t* token_row,
                   const int64_t* kv_len, T* out, int64_t num_tokens, int64_t num_kv_heads,
                   int64_t group, int64_t block_size, float scale, int64_t window) {
  constexpr int NV = D / 16;
  const int64_t block_stride = num_kv_heads * block_size * D;
  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * D), acc_out(group * D);
    alignas(64) float p[16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / num_kv_heads, h = task % num_kv_heads;
      const T* q_in = query + (t * num_kv_heads + h) * group * D;
      for (int64_t i = 0; i < group * D; ++i) qs[i] = static_cast<float>(q_in[i]) * scale;
      const int64_t len = kv_len[t];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t* blocks = block_table + token_row[t] * table_stride;
      for (int64_t g = 0; g < group; ++g) {
        __m512 q[NV], acc[NV];
        for (int i = 0; i < NV; ++i) {
          q[i] = _mm512_loadu_ps(qs.data() + g * D + 16 * i);
          acc[i] = _mm512_setzero_ps();
        }
        float row_max = -std::numeric_limits<float>::infinity(), row_sum = 0.f;
        for (int64_t start = first / block_size * block_size; start < len; start += block_size) {
          const int64_t n = std::min(block_size, len - start);
          const int64_t lo = std::max<int64_t>(0, first - start);  // keys before the window
          const int64_t offset = blocks[start / block_size] * block_stride + h * block_size * D;
          const T* k = key_cache + offset;
          const T* v = value_cache + offset;
          if (g == 0 && start + block_size < len) {
            // The next block is elsewhere in the cache: no hardware prefetcher guesses
            // it, so ask for its lines while this block is computed (the first query
            // head's pass reads the row from memory, the others find it in L2).
            const int64_t next = blocks[start / block_size + 1] * block_stride + h * block_size * D;
            const int64_t m = std::min(block_size, len - start - block_size) * D;
            const char* kn = reinterpret_cast<const char*>(key_cache + next);
            const char* vn = reinterpret_cast<const char*>(value_cache + next);
            for (int64_t b = 0; b < m * static_cast<int64_t>(sizeof(T)); b += 64) {
              _mm_prefetch(kn + b, _MM_HINT_T0);
              _mm_prefetch(vn + b, _MM_HINT_T0);
            }
          }
          for (int64_t j0 = lo / 16 * 16; j0 < n; j0 += 16) {
            const int m = static_cast<int>(std::min<int64_t>(16, n - j0));
            const int skip = static_cast<int>(std::max<int64_t>(0, lo - j0));  // < 16
            __m512 dots[16];
            for (int j = 0; j < 16; ++j) {
              if (j >= skip && j < m) {
                const T* kj = k + (j0 + j) * D;
                __m512 d = _mm512_mul_ps(q[0], load16(kj));
                for (int i = 1; i < NV; ++i) d = _mm512_fmadd_ps(q[i], load16(kj + 16 * i), d);
                dots[j] = d;
              } else {
                dots[j] = _mm512_setzero_ps();
              }
            }
            const __mmask16 live = static_cast<__mmask16>(((1u << m) - 1u) & ~((1u << skip) - 1u));
            const __m512 scores = _mm512_mask_blend_ps(
                live, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sum_lanes16(dots));
            const float new_max = std::max(row_max, _mm512_reduce_max_ps(scores));
            const float rescale = std::exp(row_max - new_max);  // 0 on the first keys
            _mm512_store_ps(p, _mm512_sub_ps(scores, _mm512_set1_ps(new_max)));
            float sum = 0.f;
#pragma omp simd reduction(+ : sum) aligned(p : 64)
            for (int j = 0; j < 16; ++j) {
              p[j] = exp_nonpositive(p[j]);  // masked keys: exp(-inf) clamps to ~0
              sum += p[j];
            }
            for (int j = 0; j < skip; ++j) sum -= p[j];  // drop the clamped ~0s exactly
            for (int j = m; j < 16; ++j) sum -= p[j];
            const __m512 r = _mm512_set1_ps(rescale);
            for (int i = 0; i < NV; ++i) acc[i] = _mm512_mul_ps(acc[i], r);
            for (int j = skip; j < m; ++j) {
              const __m512 w = _mm512_set1_ps(p[j]);
              const T* vj = v + (j0 + j) * D;
              for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(w, load16(vj + 16 * i), acc[i]);
            }
            row_sum = row_sum * rescale + sum;
            row_max = new_max;
          }
        }
        const __m512 inv = _mm512_set1_ps(1.f / row_sum);
        for (int i = 0; i < NV; ++i)
          _mm512_storeu_ps(acc_out.data() + g * D + 16 * i, _mm512_mul_ps(acc[i], inv));
      }
      T* o = out + (t * num_kv_heads + h) * group * D;
      for (int64_t i = 0; i < group * D; ++i) o[i] = static_cast<T>(acc_out[i]);
    }
  });
}
#endif

// query [N, Hq, D]; caches [num_blocks, Hkv, bs, D]; block_table [R, max_blocks] int64;
// token_row, kv_len [N] int64 (token i attends to keys 0..kv_len[i]-1 of row token_row[i];
// with window > 0 only to its last `window` keys, itself included; softcap > 0 caps each
// score to softcap * tanh(score / softcap)) -> [N, Hq * D] in the query's dtype.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_table,
                           const at::Tensor& token_row, const at::Tensor& kv_len,
                           double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [N, Hq, D], cache [B, H, bs, D]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && token_row.scalar_type() == at::kLong &&
                  kv_len.scalar_type() == at::kLong,
              "index tensors must be int64");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const at::Tensor q = query.contiguous();
  const at::Tensor table = block_table.contiguous();
  const at::Tensor rows = token_row.contiguous();
  const at::Tensor lens = kv_len.contiguous();
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "head_dim or head counts disagree");
  TORCH_CHECK(rows.numel() == num_tokens && lens.numel() == num_tokens,
              "token_row and kv_len need one entry per query token");
  at::Tensor out = at::empty({num_tokens, num_heads * head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
#ifdef __AVX512F__
    // The AVX-512 kernels score 16 keys per register without a cap: capped scores (Gemma
    // 2) take the generic kernel.
    if constexpr (!std::is_same_v<scalar_t, double>) if (softcap <= 0.0) {
      const auto args = std::make_tuple(
          q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
          table.data_ptr<int64_t>(), table.size(1), rows.data_ptr<int64_t>(),
          lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), num_tokens, num_kv_heads,
          num_heads / num_kv_heads, block_size, static_cast<float>(scale), window);
      if (head_dim == 32) return std::apply(attend_avx512<scalar_t, 32>, args);
      if (head_dim == 64) return std::apply(attend_avx512<scalar_t, 64>, args);
      if (head_dim == 128) return std::apply(attend_avx512<scalar_t, 128>, args);
    }
#endif
    attend<scalar_t>(q.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                     value_cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(),
                     table.size(1), rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                     out.data_ptr<scalar_t>(), num_tokens, num_kv_heads,
                     num_heads / num_kv_heads, block_size, head_dim, static_cast<float>(scale),
                     window, static_cast<float>(softcap));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(raylm, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor token_row, Tensor kv_len, float scale, int window=0, float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) { m.impl("paged_attention", &paged_attention); }
