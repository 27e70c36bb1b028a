// Decode attention over a paged KV cache on the CPU: one query token per sequence, each over its own context.
//
// paged_decode_attention(q [B, heads, d], keys/values [slots, kv_heads, d], slots [sum of lengths], offsets [B + 1],
// k_scale?, v_scale?, scale) -> [B, heads, d] in q's dtype. Sequence b reads slots[offsets[b] .. offsets[b + 1]); query
// head h uses KV head h / (heads / kv_heads) (grouped-query attention, as repeat_kv). Keys and values are bf16, fp16,
// fp32, or FP8 (read as code * scale, the scale [] or one per KV head, rounded to q's dtype as the Python path
// reads them). Everything else is float32, in an order fixed per (sequence, head): the dot product over d in 8
// lanes (lane j sums elements j, j + 8, ...) then a fixed tree, the softmax's sum in position order, and each
// output element summed in position order. So a sequence's result is the same bits alone or in any batch, on any
// thread split: what the engine's batch invariance needs. One call per layer replaces a Python loop of ~15 tensor
// ops per sequence.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#ifndef HQT_OPS_NS
#define HQT_OPS_NS hqtflow
#endif

namespace {

// A KV row (d values of one slot and head) as float32; FP8 (scaled) rows are code * scale rounded to `round_to`.
template <typename T>
void load_row(const T* src, int64_t d, const float* scale, at::ScalarType round_to, float* dst) {
  if (scale == nullptr) {
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(src[i]) * *scale;
    dst[i] = round_to == at::kBFloat16 ? static_cast<float>(c10::BFloat16(v))
           : round_to == at::kHalf     ? static_cast<float>(c10::Half(v)) : v;
  }
}

float dot(const float* a, const float* b, int64_t d) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  for (int j = 0; i < d; ++i, ++j) lane[j] += a[i] * b[i];
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

template <typename Q, typename KV>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* slots,
            const int64_t* offsets, const float* ks, const float* vs, int64_t scales_per_head, float scale,
            at::Tensor& out) {
  const int64_t B = q.size(0), heads = q.size(1), d = q.size(2), kvh = keys.size(1), group = heads / kvh;
  const Q* qp = q.data_ptr<Q>();
  const KV* kp = keys.data_ptr<KV>();
  const KV* vp = values.data_ptr<KV>();
  Q* op = out.data_ptr<Q>();
  const at::ScalarType hp = q.scalar_type();
  at::parallel_for(0, B * heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(d), row(d), acc(d), p;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / heads, h = t % heads, g = h / group, n = offsets[b + 1] - offsets[b];
      const int64_t* seq = slots + offsets[b];
      const float* k_s = ks ? ks + (scales_per_head ? g : 0) : nullptr;
      const float* v_s = vs ? vs + (scales_per_head ? g : 0) : nullptr;
      for (int64_t i = 0; i < d; ++i) qf[i] = static_cast<float>(qp[(b * heads + h) * d + i]);
      p.resize(n);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        load_row(kp + (seq[j] * kvh + g) * d, d, k_s, hp, row.data());
        p[j] = dot(qf.data(), row.data(), d) * scale;
        top = std::max(top, p[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - top));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        load_row(vp + (seq[j] * kvh + g) * d, d, v_s, hp, row.data());
        const float w = p[j] / sum;
        for (int64_t i = 0; i < d; ++i) acc[i] += w * row[i];
      }
      for (int64_t i = 0; i < d; ++i) op[(b * heads + h) * d + i] = static_cast<Q>(acc[i]);
    }
  });
}

template <typename Q>
void by_cache(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* slots,
              const int64_t* offsets, const float* ks, const float* vs, int64_t per_head, float scale, at::Tensor& out) {
  switch (keys.scalar_type()) {
    case at::kFloat: return attend<Q, float>(q, keys, values, slots, offsets, ks, vs, per_head, scale, out);
    case at::kBFloat16: return attend<Q, c10::BFloat16>(q, keys, values, slots, offsets, ks, vs, per_head, scale, out);
    case at::kHalf: return attend<Q, c10::Half>(q, keys, values, slots, offsets, ks, vs, per_head, scale, out);
    case at::kFloat8_e4m3fn: return attend<Q, c10::Float8_e4m3fn>(q, keys, values, slots, offsets, ks, vs, per_head, scale, out);
    case at::kFloat8_e5m2: return attend<Q, c10::Float8_e5m2>(q, keys, values, slots, offsets, ks, vs, per_head, scale, out);
    default: TORCH_CHECK(false, "paged_decode_attention: KV cache dtype ", keys.scalar_type(), " is not supported");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& slots_in, const at::Tensor& offsets_in,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                                  double scale) {
  TORCH_CHECK(q_in.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "paged_decode_attention: q [B, heads, d], keys/values [slots, kv_heads, d]");
  TORCH_CHECK(q_in.size(2) == keys.size(2) && q_in.size(1) % keys.size(1) == 0, "paged_decode_attention: head shapes do not match");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == values.scalar_type(), "paged_decode_attention: keys and values must be contiguous, of one dtype");
  const at::Tensor q = q_in.contiguous(), slots = slots_in.to(at::kLong).contiguous(), offsets = offsets_in.to(at::kLong).contiguous();
  TORCH_CHECK(offsets.numel() == q.size(0) + 1, "paged_decode_attention: offsets must have B + 1 entries");
  const int64_t* o = offsets.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[q.size(0)] == slots.numel(), "paged_decode_attention: offsets must cover slots");
  for (int64_t b = 0; b < q.size(0); ++b) TORCH_CHECK(o[b + 1] > o[b], "paged_decode_attention: every sequence needs a context");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) TORCH_CHECK(s[i] >= 0 && s[i] < keys.size(0), "paged_decode_attention: slot out of range");
  at::Tensor ksf, vsf;
  int64_t per_head = 0;
  if (k_scale.has_value() != v_scale.has_value()) TORCH_CHECK(false, "paged_decode_attention: give both scales or neither");
  if (k_scale.has_value()) {
    ksf = k_scale->to(at::kFloat).contiguous().reshape(-1);
    vsf = v_scale->to(at::kFloat).contiguous().reshape(-1);
    TORCH_CHECK(ksf.numel() == vsf.numel() && (ksf.numel() == 1 || ksf.numel() == keys.size(1)), "paged_decode_attention: scales are [] or one per KV head");
    per_head = ksf.numel() > 1;
  }
  const float* ks = k_scale.has_value() ? ksf.data_ptr<float>() : nullptr;
  const float* vs = k_scale.has_value() ? vsf.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: by_cache<float>(q, keys, values, s, o, ks, vs, per_head, sc, out); break;
    case at::kBFloat16: by_cache<c10::BFloat16>(q, keys, values, s, o, ks, vs, per_head, sc, out); break;
    case at::kHalf: by_cache<c10::Half>(q, keys, values, s, o, ks, vs, per_head, sc, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: query dtype ", q.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(HQT_OPS_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor offsets, Tensor? k_scale, "
        "Tensor? v_scale, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(HQT_OPS_NS, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
