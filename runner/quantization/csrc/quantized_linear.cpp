// Weight-only quantized linear for CPU: y = x W^T with W held as 4- or 8-bit integer codes and
// a float32 scale and zero per group of 32 input features (w = scale * code + zero), the form
// GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks decode to, or of 16 (Q6_K's scales; a template argument,
// so each group size compiles its own loops). Activations stay float32 or bfloat16; products
// accumulate in float32.
//
// Layout (runner/quantization/packed_linear.py repacks into it): output features in tiles of
// 16; per tile and per pair of input features (k, k+1) the 16 features' codes side by side,
// one byte each for 4 bits (k in the low nibble, k+1 in the high), one uint16 for 8 bits (k
// in the low byte). Scales: [tiles, groups, 2, 16] float32 (the scale row, then the zero row).
// K is a multiple of 32 (the AMX step) whatever the group.
//
// ``linear`` is for few rows (decode), in float32 whatever x's dtype: per group it
// accumulates x . code, and adds scale * (x . code) + zero * sum(x) once per group, so codes
// are never scaled one by one. From kDotRows bfloat16 rows on a CPU with AVX512-BF16 it
// decodes each tile's strip to bfloat16 weights once (as ``linear_amx`` does) and takes
// VDPBF16PS per pair of features. ``linear_amx`` is for many bfloat16 rows on a CPU with AMX:
// each tile's strip decoded once into bfloat16 pairs (exactly the B-tile layout of
// TDPBF16PS: 16 pairs x 16 features x 2) and multiplied by 16 rows of x at a time.
// ``dequantize_transposed`` decodes W^T into a dense block for the dense matmul elsewhere.
//
// Registered as torch.ops.raylm_quant.*; built on first use (runner/cpp_build.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RAYLM_AVX512 1
#endif
#if defined(RAYLM_AVX512) && defined(__AVX512BF16__)
#define RAYLM_AVX512_BF16 1
#endif

namespace {

constexpr int64_t kTile = 16;     // output features per tile (one AVX-512 float32 vector)
constexpr int64_t kStep = 32;     // K is a multiple of it (one AMX bfloat16 tile row)
constexpr int kMaxRows = 8;       // rows of x per register block in ``linear``
// From this many bfloat16 rows, with AVX512-BF16, ``linear`` decodes each tile's strip to
// bfloat16 once and takes VDPBF16PS (one instruction per pair and row) instead of two
// float32 FMAs per pair and row (measured on the default model's shapes, AVX512-BF16
// without AMX: see docs/performance.md).
constexpr int64_t kDotRows = 8;

// Code of feature k (lo) and k+1 (hi) of a tile's lane j.
template <int Bits>
inline void codes_at(const uint8_t* codes, int64_t pair, int64_t j, float* lo, float* hi) {
  if constexpr (Bits == 4) {
    const uint8_t b = codes[pair * kTile + j];
    *lo = static_cast<float>(b & 15);
    *hi = static_cast<float>(b >> 4);
  } else {
    uint16_t v;
    std::memcpy(&v, codes + (pair * kTile + j) * 2, 2);
    *lo = static_cast<float>(static_cast<int8_t>(v & 0xff));
    *hi = static_cast<float>(static_cast<int8_t>(v >> 8));
  }
}

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

// ---- linear: few rows -------------------------------------------------------------------

// Rows [0, Rows) of x (float32) against one tile: out[r][0..16) (float32), per group
// scale * sum_k x_k code_k + zero * sum_k x_k. With few rows the products of a group
// spread over several accumulators, so the FMA latency does not serialise them.
template <int Bits, int Group, int Rows>
void tile_rows(const float* x, int64_t k, const float* xsum, const uint8_t* codes,
               const float* scales, float* out) {
  constexpr int64_t kPairs = Group / 2;
  const int64_t groups = k / Group;
#ifdef RAYLM_AVX512
  constexpr int kChains = Rows >= 4 ? 2 : (Rows >= 2 ? 4 : 8);
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 dot[Rows][kChains];
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kPairs; p += kChains / 2) {
      for (int h = 0; h < kChains / 2; ++h) {
        const int64_t pair = g * kPairs + p + h;
        __m512 qlo, qhi;
        if constexpr (Bits == 4) {
          const __m512i b = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + pair * kTile)));
          qlo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
          qhi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
        } else {
          const __m512i v = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + pair * kTile * 2)));
          qlo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
          qhi = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
        }
        for (int r = 0; r < Rows; ++r) {
          const float* xr = x + r * k + 2 * pair;
          dot[r][2 * h] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), qlo, dot[r][2 * h]);
          dot[r][2 * h + 1] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), qhi, dot[r][2 * h + 1]);
        }
      }
    }
    const __m512 scale = _mm512_loadu_ps(scales + g * 2 * kTile);
    const __m512 zero = _mm512_loadu_ps(scales + g * 2 * kTile + kTile);
    for (int r = 0; r < Rows; ++r) {
      __m512 d = dot[r][0];
      for (int c = 1; c < kChains; ++c) d = _mm512_add_ps(d, dot[r][c]);
      acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
      acc[r] = _mm512_fmadd_ps(scale, d, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
#else
  for (int r = 0; r < Rows; ++r) {
    for (int64_t j = 0; j < kTile; ++j) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (int64_t p = 0; p < kPairs; ++p) {
          const int64_t pair = g * kPairs + p;
          float lo, hi;
          codes_at<Bits>(codes, pair, j, &lo, &hi);
          dot += x[r * k + 2 * pair] * lo + x[r * k + 2 * pair + 1] * hi;
        }
        const float* s = scales + g * 2 * kTile;
        acc += s[j] * dot + s[kTile + j] * xsum[r * groups + g];
      }
      out[r * kTile + j] = acc;
    }
  }
#endif
}

template <int Bits, int Group, int Rows = kMaxRows>
void tile_rows_n(int rows, const float* x, int64_t k, const float* xsum, const uint8_t* codes,
                 const float* scales, float* out) {
  if constexpr (Rows > 0) {
    if (rows == Rows) return tile_rows<Bits, Group, Rows>(x, k, xsum, codes, scales, out);
    return tile_rows_n<Bits, Group, Rows - 1>(rows, x, k, xsum, codes, scales, out);
  }
}

template <typename Act, int Bits, int Group>
void run_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                int64_t n, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), tiles = codes.size(0), groups = k / Group;
  const int64_t tile_bytes = codes.size(1) * codes.size(2) * codes.element_size();
  // x as float32 (bfloat16 widens exactly), and per row and group the sum of x.
  std::vector<float> xf(m * k);
  const Act* xa = x.data_ptr<Act>();
  for (int64_t i = 0; i < m * k; ++i) xf[i] = as_float(xa[i]);
  const float* xp = xf.data();
  std::vector<float> xsum(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < Group; ++i) s += xp[r * k + g * Group + i];
      xsum[r * groups + g] = s;
    }
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  Act* op = out.data_ptr<Act>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cols = std::min(kTile, n - t * kTile);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
        tile_rows_n<Bits, Group>(rows, xp + r0 * k, k, xsum.data() + r0 * groups,
                               cp + t * tile_bytes, sp + t * groups * 2 * kTile, acc);
        for (int r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j)
            op[(r0 + r) * n + t * kTile + j] = static_cast<Act>(acc[r * kTile + j]);
      }
    }
  });
}

void check_codes(const at::Tensor& codes, const at::Tensor& scales, int64_t n, int64_t bits,
                 int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32, got ", group);
  TORCH_CHECK(codes.dim() == 3 && codes.size(0) * kTile >= n && codes.size(2) == kTile &&
                  (codes.size(1) * 2) % kStep == 0 && codes.is_contiguous(),
              "codes must be contiguous [ceil(N/16), K/2, 16] with K a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == (bits == 4 ? at::kByte : at::kShort),
              "codes dtype does not match bits=", bits);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == codes.size(0) * (codes.size(1) * 2 / group) * 2 * kTile,
              "scales must be contiguous float32 [tiles, K/group, 2, 16]");
}

// CALL with constexpr B (bits) and G (group) set to the runtime bits and group.
#define RAYLM_DISPATCH(bits, group, CALL)                                     \
  do {                                                                        \
    if ((bits) == 4 && (group) == 16) { constexpr int B = 4, G = 16; CALL; }  \
    else if ((bits) == 4) { constexpr int B = 4, G = 32; CALL; }              \
    else if ((group) == 16) { constexpr int B = 8, G = 16; CALL; }            \
    else { constexpr int B = 8, G = 32; CALL; }                               \
  } while (0)

// ---- dot-product rows: bfloat16 rows on a CPU with AVX512-BF16 and no AMX ---------------

#ifdef RAYLM_AVX512_BF16
// One tile's strip as bfloat16 pairs: uint32 [K/2][16], feature k in the low half.
template <int Bits, int Group>
void decode_strip_bf16(const uint8_t* codes, const float* scales, int64_t k, uint32_t* out) {
  const __m512i order = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t pair = 0; pair < k / 2; ++pair) {
    const float* s = scales + (pair / (Group / 2)) * 2 * kTile;
    __m512i qlo, qhi;
    if constexpr (Bits == 4) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + pair * kTile)));
      qlo = _mm512_and_si512(b, _mm512_set1_epi32(15));
      qhi = _mm512_srli_epi32(b, 4);
    } else {
      const __m512i v = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + pair * kTile * 2)));
      qlo = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
      qhi = _mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24);
    }
    const __m512 scale = _mm512_loadu_ps(s), zero = _mm512_loadu_ps(s + kTile);
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qlo), scale, zero);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qhi), scale, zero);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in 0..15, hi in 16..31
    _mm512_storeu_si512(out + pair * kTile, _mm512_permutexvar_epi16(order, both));
  }
}

// Rows [0, Rows) of x (bfloat16) against one tile's decoded strip: VDPBF16PS multiplies a
// pair of x's features by the pair of every lane's weights and adds both products in
// float32, so a pair costs one instruction per row where the float32 path takes two FMAs.
template <int Rows>
void strip_rows(const uint16_t* x, int64_t k, const uint32_t* strip, float* out) {
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < k / 2; ++pair) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(strip + pair * kTile);
    for (int r = 0; r < Rows; ++r) {
      uint32_t xv;
      std::memcpy(&xv, x + r * k + 2 * pair, 4);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(xv)), w);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

template <int Rows = kMaxRows>
void strip_rows_n(int rows, const uint16_t* x, int64_t k, const uint32_t* strip, float* out) {
  if constexpr (Rows > 0) {
    if (rows == Rows) return strip_rows<Rows>(x, k, strip, out);
    return strip_rows_n<Rows - 1>(rows, x, k, strip, out);
  }
}

// Each tile's strip decoded once into bfloat16 weights (rounded as the AMX path and the
// dense bfloat16 path round them), then kMaxRows rows at a time.
template <int Bits, int Group>
void run_dpbf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                int64_t n, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), tiles = codes.size(0), groups = k / Group;
  const int64_t tile_bytes = codes.size(1) * codes.size(2) * codes.element_size();
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> strip((k / 2) * kTile);
    float acc[kMaxRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      decode_strip_bf16<Bits, Group>(cp + t * tile_bytes, sp + t * groups * 2 * kTile, k,
                                     strip.data());
      const int64_t cols = std::min(kTile, n - t * kTile);
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
        strip_rows_n(rows, xp + r0 * k, k, strip.data(), acc);
        for (int r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j)
            op[(r0 + r) * n + t * kTile + j] = c10::BFloat16(acc[r * kTile + j]);
      }
    }
  });
}
#endif

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& codes,
                            const at::Tensor& scales, int64_t n, int64_t bits, int64_t group) {
  check_codes(codes, scales, n, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == codes.size(1) * 2,
              "x must be a contiguous [rows, K] matrix with K = ", codes.size(1) * 2);
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    RAYLM_DISPATCH(bits, group, (run_linear<float, B, G>(x, codes, scales, n, out)));
    return out;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
#ifdef RAYLM_AVX512_BF16
  if (x.size(0) >= kDotRows) {
    RAYLM_DISPATCH(bits, group, (run_dpbf16<B, G>(x, codes, scales, n, out)));
    return out;
  }
#endif
  RAYLM_DISPATCH(bits, group, (run_linear<c10::BFloat16, B, G>(x, codes, scales, n, out)));
  return out;
}

// ---- linear_amx: many bfloat16 rows ----------------------------------------------------

#if defined(RAYLM_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAYLM_AMX 1

// Linux hands a process the AMX tile state only when asked (once per process).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <int Bits, int Group>
void run_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
             at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), tiles = codes.size(0), groups = k / Group;
  const int64_t tile_bytes = codes.size(1) * codes.size(2) * codes.element_size();
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  auto* op = out.data_ptr<c10::BFloat16>();
  // The last block of rows, padded with zero rows to 16.
  const int64_t tail = m % 16, full = m - tail;
  std::vector<c10::BFloat16> padded(tail ? 16 * k : 0, c10::BFloat16(0.0f));
  if (tail) std::memcpy(padded.data(), xp + full * k, tail * k * sizeof(c10::BFloat16));
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    TileConfig config;
    for (int t = 0; t < 3; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
    _tile_loadconfig(&config);
    std::vector<uint32_t> strip((k / 2) * kTile);
    alignas(64) float c[16 * kTile];
    for (int64_t t = begin; t < end; ++t) {
      decode_strip_bf16<Bits, Group>(cp + t * tile_bytes, sp + t * groups * 2 * kTile, k,
                              strip.data());
      const int64_t cols = std::min(kTile, n - t * kTile);
      for (int64_t r0 = 0; r0 < m; r0 += 16) {
        const c10::BFloat16* a = r0 < full ? xp + r0 * k : padded.data();
        _tile_zero(0);
        for (int64_t s = 0; s < k / kStep; ++s) {  // the strip is decoded: steps of 32
          _tile_loadd(1, a + s * kStep, k * sizeof(c10::BFloat16));
          _tile_loadd(2, strip.data() + s * (kStep / 2) * kTile, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, c, 64);
        const int64_t rows = std::min<int64_t>(16, m - r0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < cols; ++j)
            op[(r0 + r) * n + t * kTile + j] = c10::BFloat16(c[r * kTile + j]);
      }
    }
    _tile_release();
  });
}
#endif

bool has_amx() {
#ifdef RAYLM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor quantized_linear_amx(const at::Tensor& x, const at::Tensor& codes,
                                const at::Tensor& scales, int64_t n, int64_t bits,
                                int64_t group) {
  check_codes(codes, scales, n, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == codes.size(1) * 2 &&
                  x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bfloat16 [rows, K] matrix with K = ", codes.size(1) * 2);
  TORCH_CHECK(has_amx(), "linear_amx needs AMX (see has_amx)");
  auto out = at::empty({x.size(0), n}, x.options());
#ifdef RAYLM_AMX
  if (x.size(0) > 0) {
    RAYLM_DISPATCH(bits, group, (run_amx<B, G>(x, codes, scales, n, out)));
  }
#endif
  return out;
}

// ---- dequantize_transposed: many rows ---------------------------------------------------

// Tiles [t0, t0 + count) of W^T into out [K, 16 * count] (the last tile cut to n).
template <typename Out, int Bits, int Group>
void run_dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                    at::Tensor& out) {
  const int64_t tiles = codes.size(0), k = codes.size(1) * 2;
  const int64_t tile_bytes = codes.size(1) * codes.size(2) * codes.element_size();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  Out* op = out.data_ptr<Out>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tc = cp + t * tile_bytes;
      const int64_t cols = std::min(kTile, n - t * kTile);
      for (int64_t pair = 0; pair < k / 2; ++pair) {
        const float* s = sp + (t * (k / Group) + pair / (Group / 2)) * 2 * kTile;
        Out* row_lo = op + (2 * pair) * n + t * kTile;
        Out* row_hi = row_lo + n;
#ifdef RAYLM_AVX512
        if (cols == kTile) {
          __m512i qlo, qhi;
          if constexpr (Bits == 4) {
            const __m512i b = _mm512_cvtepu8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(tc + pair * kTile)));
            qlo = _mm512_and_si512(b, _mm512_set1_epi32(15));
            qhi = _mm512_srli_epi32(b, 4);
          } else {
            const __m512i v = _mm512_cvtepu16_epi32(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tc + pair * kTile * 2)));
            qlo = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
            qhi = _mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24);
          }
          const __m512 scale = _mm512_loadu_ps(s), zero = _mm512_loadu_ps(s + kTile);
          const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qlo), scale, zero);
          const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qhi), scale, zero);
          if constexpr (std::is_same_v<Out, float>) {
            _mm512_storeu_ps(row_lo, lo);
            _mm512_storeu_ps(row_hi, hi);
          } else {
            // Round to nearest even, as c10::BFloat16 does (NaN aside: codes are finite).
            const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
            auto round = [&](__m512 v) {
              const __m512i bits = _mm512_castps_si512(v);
              const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
              return _mm512_cvtepi32_epi16(
                  _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, bias), odd), 16));
            };
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_lo), round(lo));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_hi), round(hi));
          }
          continue;
        }
#endif
        for (int64_t j = 0; j < cols; ++j) {
          float lo, hi;
          codes_at<Bits>(tc, pair, j, &lo, &hi);
          row_lo[j] = static_cast<Out>(lo * s[j] + s[kTile + j]);
          row_hi[j] = static_cast<Out>(hi * s[j] + s[kTile + j]);
        }
      }
    }
  });
}

at::Tensor dequantize_transposed(const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                                 int64_t bits, at::ScalarType dtype, int64_t group) {
  check_codes(codes, scales, n, bits, group);
  auto out = at::empty({codes.size(1) * 2, n}, codes.options().dtype(dtype));
  if (dtype == at::kFloat) {
    RAYLM_DISPATCH(bits, group, (run_dequantize<float, B, G>(codes, scales, n, out)));
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
    RAYLM_DISPATCH(bits, group, (run_dequantize<c10::BFloat16, B, G>(codes, scales, n, out)));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(raylm_quant, m) {
  m.def("linear(Tensor x, Tensor codes, Tensor scales, int n, int bits, int group=32) -> Tensor");
  m.def("has_amx() -> bool");
  m.def("linear_amx(Tensor x, Tensor codes, Tensor scales, int n, int bits, int group=32)"
        " -> Tensor");
  m.def("dequantize_transposed(Tensor codes, Tensor scales, int n, int bits, ScalarType dtype,"
        " int group=32) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylm_quant, CPU, m) {
  m.impl("linear", &quantized_linear);
  m.impl("linear_amx", &quantized_linear_amx);
  m.impl("dequantize_transposed", &dequantize_transposed);
}

TORCH_LIBRARY_IMPL(raylm_quant, CompositeExplicitAutograd, m) { m.impl("has_amx", &has_amx); }
