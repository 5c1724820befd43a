// FP8 weight-only linear for CPU: y = x W^T with W held as float8_e4m3fn bytes and a float32
// scale per output feature and group of input features (any group length: a block of 128,
// or the whole row for per-channel and per-tensor scales). Activations stay float32 or
// bfloat16; products accumulate in float32. The weight is never decoded whole: the fused
// path decodes 16 bytes at a time into registers, the dense path one chunk of output
// features at a time (runner/quantization/fp8_linear.py picks by row count).
//
// Decoding: an e4m3 byte's sign, exponent and mantissa moved into a float16's places
// ((b & 0x80) << 8 | (b & 0x7f) << 7) is the same number times 2^-8, subnormals included
// (both formats keep 3 mantissa bits' worth of subnormal steps below their bias), so
// VCVTPH2PS turns 16 bytes into 16 exact floats; the 2^8 lives in the packed scales
// (fp8_linear.py), which is exact. Without AVX-512 a 256-entry table does the same.
//
// Layout: codes [tiles, K, 16] uint8 (per input feature, the tile's 16 output features side
// by side), scales [tiles, groups, 16] float32 (already times 2^8).
//
// Registered as torch.ops.raylm_fp8.*; built on first use (runner/cpp_build.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RAYLM_AVX512 1
#endif

namespace {

constexpr int64_t kTile = 16;
constexpr int kMaxRows = 4;  // rows of x per register block in ``linear``

// A byte's value times 2^-8 (the float16 reinterpretation), for the scalar paths.
const std::array<float, 256>& table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> out{};
    for (int b = 0; b < 256; ++b) {
      const uint16_t h = static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7));
      out[b] = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
    }
    return out;
  }();
  return t;
}

#ifdef RAYLM_AVX512
inline __m512 decode16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}
#endif

// Rows [0, Rows) of x (float32) against one tile: out[r][0..16).
template <int Rows>
void tile_rows(const float* x, int64_t k, int64_t group, const uint8_t* codes,
               const float* scales, float* out) {
  const int64_t groups = (k + group - 1) / group;
#ifdef RAYLM_AVX512
  constexpr int kChains = Rows >= 2 ? 2 : 4;  // independent FMA chains per row
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * group, k1 = std::min(k, k0 + group);
    __m512 dot[Rows][kChains];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_ps();
    int64_t i = k0;
    for (; i + kChains <= k1; i += kChains) {
      for (int c = 0; c < kChains; ++c) {
        const __m512 w = decode16(codes + (i + c) * kTile);
        for (int r = 0; r < Rows; ++r)
          dot[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i + c]), w, dot[r][c]);
      }
    }
    for (; i < k1; ++i) {
      const __m512 w = decode16(codes + i * kTile);
      for (int r = 0; r < Rows; ++r)
        dot[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i]), w, dot[r][0]);
    }
    const __m512 scale = _mm512_loadu_ps(scales + g * kTile);
    for (int r = 0; r < Rows; ++r) {
      __m512 d = dot[r][0];
      for (int c = 1; c < kChains; ++c) d = _mm512_add_ps(d, dot[r][c]);
      acc[r] = _mm512_fmadd_ps(scale, d, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
#else
  const auto& t = table();
  for (int r = 0; r < Rows; ++r) {
    for (int64_t j = 0; j < kTile; ++j) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i)
          dot += x[r * k + i] * t[codes[i * kTile + j]];
        acc += scales[g * kTile + j] * dot;
      }
      out[r * kTile + j] = acc;
    }
  }
#endif
}

template <int Rows = kMaxRows>
void tile_rows_n(int rows, const float* x, int64_t k, int64_t group, const uint8_t* codes,
                 const float* scales, float* out) {
  if constexpr (Rows > 0) {
    if (rows == Rows) return tile_rows<Rows>(x, k, group, codes, scales, out);
    return tile_rows_n<Rows - 1>(rows, x, k, group, codes, scales, out);
  }
}

void check_packed(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t group) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kTile && codes.size(0) * kTile >= n &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [ceil(N/16), K, 16]");
  TORCH_CHECK(group > 0, "group must be positive, got ", group);
  const int64_t groups = (codes.size(1) + group - 1) / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == codes.size(0) * groups * kTile,
              "scales must be contiguous float32 [tiles, ceil(K/group), 16]");
}

template <typename Act>
void run_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                int64_t n, int64_t group, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), tiles = codes.size(0);
  const int64_t groups = (k + group - 1) / group;
  std::vector<float> xf(m * k);
  const Act* xa = x.data_ptr<Act>();
  for (int64_t i = 0; i < m * k; ++i) xf[i] = static_cast<float>(xa[i]);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  Act* op = out.data_ptr<Act>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cols = std::min(kTile, n - t * kTile);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
        tile_rows_n(rows, xf.data() + r0 * k, k, group, cp + t * k * kTile,
                    sp + t * groups * kTile, acc);
        for (int r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j)
            op[(r0 + r) * n + t * kTile + j] = static_cast<Act>(acc[r * kTile + j]);
      }
    }
  });
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      int64_t n, int64_t group) {
  check_packed(codes, scales, n, group);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == codes.size(1),
              "x must be a contiguous [rows, K] matrix with K = ", codes.size(1));
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    run_linear<float>(x, codes, scales, n, group, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
    run_linear<c10::BFloat16>(x, codes, scales, n, group, out);
  }
  return out;
}

// W^T [K, n] of the given tiles, for the dense matmul (the last tile cut to n).
template <typename Out>
void run_dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                    int64_t group, at::Tensor& out) {
  const int64_t tiles = codes.size(0), k = codes.size(1);
  const int64_t groups = (k + group - 1) / group;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  Out* op = out.data_ptr<Out>();
  const auto& t = table();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t cols = std::min(kTile, n - tile * kTile);
      for (int64_t i = 0; i < k; ++i) {
        const float* s = sp + (tile * groups + i / group) * kTile;
        const uint8_t* c = cp + (tile * k + i) * kTile;
        Out* row = op + i * n + tile * kTile;
        for (int64_t j = 0; j < cols; ++j) row[j] = static_cast<Out>(t[c[j]] * s[j]);
      }
    }
  });
}

at::Tensor fp8_dequantize_transposed(const at::Tensor& codes, const at::Tensor& scales,
                                     int64_t n, int64_t group, at::ScalarType dtype) {
  check_packed(codes, scales, n, group);
  auto out = at::empty({codes.size(1), n}, codes.options().dtype(dtype));
  if (dtype == at::kFloat) {
    run_dequantize<float>(codes, scales, n, group, out);
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
    run_dequantize<c10::BFloat16>(codes, scales, n, group, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(raylm_fp8, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scales, int n, int group) -> Tensor");
  m.def("dequantize_transposed(Tensor codes, Tensor scales, int n, int group, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm_fp8, CPU, m) {
  m.impl("linear", &fp8_linear);
  m.impl("dequantize_transposed", &fp8_dequantize_transposed);
}
