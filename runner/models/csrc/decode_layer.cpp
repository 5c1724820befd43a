// One Llama decoder layer over a step of short query rows (decodes, speculative rows) on
// the CPU: the residual add and RMSNorm, q/k/v, rotary embedding, the KV cache write,
// paged attention, o_proj, the second add and RMSNorm, gate/up, SiLU and down in one call.
// At batch 1 a layer's arithmetic takes tens of microseconds, and the eager layer's
// twenty-odd operator calls from Python cost as much again: here the elementwise parts are
// plain loops (split over rows between threads) and the linears and the attention are the
// operators the eager layer calls, through the dispatcher, so the arithmetic is theirs
// exactly: a quantized linear is torch.ops.raylm_quant.linear, a dense one oneDNN's linear
// over its packed weight (mkldnn::_linear_pointwise, bits 0), the attention
// torch.ops.raylm.paged_attention.
//
// Every intermediate is rounded to the activations' dtype where the eager layer's
// operators round it (runner/models/fused_ops.py, llama.py): products and sums of
// bfloat16 tensors are computed in float32 and rounded once per operator.
//
// Registered as torch.ops.raylm_decode.llama_layer; built on first use
// (runner/models/fused_decode_layer.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                            int64_t, int64_t);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                               int64_t, double);

const c10::TypedOperatorHandle<LinearFn>& linear_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("raylm_quant::linear", "")
                             .typed<LinearFn>();
  return op;
}

const c10::OperatorHandle& dense_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

// x W^T over oneDNN's packed W, as parallel/layers.py ``linear`` calls it (no bias).
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed) {
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  dense_op().callBoxed(&stack);
  return stack[0].toTensor();
}

// Rows [0, rows) split between the threads, a few rows per task.
template <typename F>
void over_rows(int64_t rows, const F& body) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

const c10::TypedOperatorHandle<AttentionFn>& attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("raylm::paged_attention", "")
                             .typed<AttentionFn>();
  return op;
}

// exp(x) as plain arithmetic, so that a loop of it vectorises (std::exp is a library call
// per element): Cody-Waite range reduction and Cephes' degree-6 polynomial, within 2 ulp of
// expf; x is clamped to [-87, 88] (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
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

// v rounded to T and back (identity for float32).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// out = weight * T(x * rsqrt(mean(x^2) + eps)) for row r of width h (fused_ops.rms_norm).
template <typename T>
void rms_norm_row(const T* x, const T* weight, int64_t r, int64_t h, double eps, T* out) {
  const T* xr = x + r * h;
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < h; ++i) {
    const float v = static_cast<float>(xr[i]);
    sq += v * v;
  }
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + static_cast<float>(eps));
  for (int64_t i = 0; i < h; ++i)
    out[r * h + i] = static_cast<T>(static_cast<float>(weight[i]) *
                                    round_to<T>(static_cast<float>(xr[i]) * inv));
}

// out = T(a + b) for row r of width h (the residual add), then its RMSNorm into normed.
template <typename T>
void add_norm_row(const T* a, const T* b, const T* weight, int64_t r, int64_t h, double eps,
                  T* out, T* normed) {
  for (int64_t i = r * h; i < (r + 1) * h; ++i)
    out[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  rms_norm_row<T>(out, weight, r, h, eps, normed);
}

// Heads [heads, d] of row r of ``x`` (row stride ``stride``) rotated in place by cos and
// sin [rows, d] (fused_ops.rotary over the whole head: x * cos + rotate_half(x) * sin).
template <typename T>
void rotate_row(T* x, int64_t stride, int64_t r, int64_t heads, int64_t d, const T* cos,
                const T* sin) {
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* v = x + r * stride + hd * d;
    float a[512];
    for (int64_t i = 0; i < d; ++i) a[i] = static_cast<float>(v[i]);
    for (int64_t i = 0; i < d; ++i) {
      const float turned = i < half ? -a[i + half] : a[i - half];
      const float c = static_cast<float>(cos[r * d + i]), s = static_cast<float>(sin[r * d + i]);
      v[i] = static_cast<T>(round_to<T>(a[i] * c) + round_to<T>(turned * s));
    }
  }
}

// Linear i: quantized codes (bits 4 or 8), or oneDNN's packed dense weight (bits 0).
at::Tensor linear(const at::Tensor& x, at::TensorList codes, at::TensorList scales,
                  at::IntArrayRef n, at::IntArrayRef bits, at::IntArrayRef groups, int i) {
  if (bits[i] == 0) return dense_linear(x, codes[i]);
  return linear_op().call(x, codes[i], scales[i], n[i], bits[i], groups[i]);
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    at::TensorList codes, at::TensorList scales, at::IntArrayRef n, at::IntArrayRef bits,
    at::IntArrayRef groups, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& write_index,
    const at::Tensor& block_table, const at::Tensor& token_row, const at::Tensor& kv_len,
    int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window) {
  const int64_t rows = hidden.size(0), h = hidden.size(1);
  const int64_t d = key_cache.size(3), q_size = num_heads * d, kv_size = num_kv_heads * d;
  // The residual stream after the add (eager: x + residual, rounded to T), and its norm.
  at::Tensor stream = residual.has_value() ? at::empty_like(hidden) : hidden;
  at::Tensor normed = at::empty_like(hidden);
  {
    const T* x = hidden.data_ptr<T>();
    const T* res = residual.has_value() ? residual->data_ptr<T>() : nullptr;
    const T* w = input_norm.data_ptr<T>();
    T* s = stream.data_ptr<T>();
    T* out = normed.data_ptr<T>();
    over_rows(rows, [&](int64_t r) {
      if (res != nullptr) add_norm_row<T>(x, res, w, r, h, eps, s, out);
      else rms_norm_row<T>(x, w, r, h, eps, out);
    });
  }

  // q/k/v, rotated; k and v into the cache.
  at::Tensor qkv = linear(normed, codes, scales, n, bits, groups, 0);
  {
    T* qkv_p = qkv.data_ptr<T>();
    const int64_t width = q_size + 2 * kv_size;
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const int64_t* write = write_index.data_ptr<int64_t>();
    T* kc = key_cache.data_ptr<T>();
    T* vc = value_cache.data_ptr<T>();
    over_rows(rows, [&](int64_t r) {
      rotate_row<T>(qkv_p, width, r, num_heads, d, cp, sp);
      rotate_row<T>(qkv_p + q_size, width, r, num_kv_heads, d, cp, sp);
      for (int64_t hd = 0; hd < num_kv_heads; ++hd) {
        const int64_t slot = write[r * num_kv_heads + hd] * d;
        const T* k = qkv_p + r * width + q_size + hd * d;
        std::copy(k, k + d, kc + slot);
        std::copy(k + kv_size, k + kv_size + d, vc + slot);
      }
    });
  }
  at::Tensor query = qkv.narrow(1, 0, q_size).contiguous().view({rows, num_heads, d});
  at::Tensor attn = attention_op().call(query, key_cache, value_cache, block_table, token_row,
                                        kv_len, scale, window, 0.0);
  at::Tensor o = linear(attn, codes, scales, n, bits, groups, 1);

  // Second add and norm, then the MLP.
  at::Tensor stream2 = at::empty_like(hidden);
  {
    const T* a = o.data_ptr<T>();
    const T* b = stream.data_ptr<T>();
    const T* w = post_norm.data_ptr<T>();
    T* s = stream2.data_ptr<T>();
    T* out = normed.data_ptr<T>();
    over_rows(rows, [&](int64_t r) { add_norm_row<T>(a, b, w, r, h, eps, s, out); });
  }
  at::Tensor gate_up = linear(normed, codes, scales, n, bits, groups, 2);
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, inter}, hidden.options());
  {
    const T* g = gate_up.data_ptr<T>();
    T* a = act.data_ptr<T>();
    over_rows(rows, [&](int64_t r) {
      const T* gate = g + r * 2 * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float x = static_cast<float>(gate[i]);
        const float silu = round_to<T>(x / (1.f + exp_approx(-x)));
        a[r * inter + i] = static_cast<T>(silu * static_cast<float>(gate[inter + i]));
      }
    });
  }
  return {linear(act, codes, scales, n, bits, groups, 3), stream2};
}

std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    at::TensorList codes, at::TensorList scales, at::IntArrayRef n, at::IntArrayRef bits,
    at::IntArrayRef groups, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& write_index,
    const at::Tensor& block_table, const at::Tensor& token_row, const at::Tensor& kv_len,
    int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window) {
  TORCH_CHECK(codes.size() == 4 && scales.size() == 4 && n.size() == 4 && bits.size() == 4 &&
                  groups.size() == 4,
              "four linears: qkv, o, gate_up, down");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be [rows, hidden]");
  TORCH_CHECK(!residual.has_value() || (residual->sizes() == hidden.sizes() &&
                                        residual->is_contiguous() &&
                                        residual->scalar_type() == hidden.scalar_type()),
              "residual must match hidden");
  const int64_t d = key_cache.size(3);
  TORCH_CHECK(d % 2 == 0 && d <= 512 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.size(1) == num_kv_heads,
              "caches must be contiguous [blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(n[0] == (num_heads + 2 * num_kv_heads) * d && n[1] == hidden.size(1) &&
                  n[3] == hidden.size(1) && n[2] % 2 == 0,
              "linear widths do not match the heads and the hidden size");
  TORCH_CHECK(cos.numel() == hidden.size(0) * d && sin.numel() == cos.numel() &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be [rows, 1, head_dim]");
  TORCH_CHECK(write_index.scalar_type() == at::kLong &&
                  write_index.numel() == hidden.size(0) * num_kv_heads,
              "write_index must hold rows x num_kv_heads int64 cache rows");
  for (const at::Tensor* t : {&input_norm, &post_norm, &cos, &sin, &key_cache, &value_cache})
    TORCH_CHECK(t->scalar_type() == hidden.scalar_type(), "every tensor must share hidden's dtype");
  if (hidden.scalar_type() == at::kFloat)
    return layer<float>(hidden, residual, input_norm, post_norm, eps, codes, scales, n, bits,
                        groups, cos, sin, key_cache, value_cache, write_index, block_table,
                        token_row, kv_len, num_heads, num_kv_heads, scale, window);
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "hidden must be float32 or bfloat16");
  return layer<c10::BFloat16>(hidden, residual, input_norm, post_norm, eps, codes, scales, n,
                              bits, groups, cos, sin, key_cache, value_cache, write_index,
                              block_table, token_row, kv_len, num_heads, num_kv_heads, scale,
                              window);
}

}  // namespace

TORCH_LIBRARY(raylm_decode, m) {
  m.def("llama_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, "
        "float eps, Tensor[] codes, Tensor[] scales, int[] out_features, int[] bits, "
        "int[] groups, Tensor cos, Tensor sin, Tensor key_cache, Tensor value_cache, "
        "Tensor write_index, Tensor block_table, Tensor token_row, Tensor kv_len, "
        "int num_heads, int num_kv_heads, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(raylm_decode, CPU, m) { m.impl("llama_layer", &llama_layer); }
// oneDNN's packed dense weights are MkldnnCPU tensors: a call with one dispatches here.
TORCH_LIBRARY_IMPL(raylm_decode, MkldnnCPU, m) { m.impl("llama_layer", &llama_layer); }
