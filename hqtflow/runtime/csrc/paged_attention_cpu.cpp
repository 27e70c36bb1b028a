// Decode attention over a paged KV cache on the CPU: one query token per sequence, each over its own context.
//
// paged_decode_attention(q [B, heads, d], keys/values [slots, kv_heads, d], slots [sum of lengths], offsets [B + 1],
// k_scale?, v_scale?, scale, softcap = 0, sinks? [heads]) -> [B, heads, d] in q's dtype. Sequence b reads
// slots[offsets[b] .. offsets[b + 1]); query head h uses KV head h / (heads / kv_heads) (grouped-query attention, as
// repeat_kv). Keys and values are bf16, fp16, fp32, or FP8 (read as code * scale, the scale [] or one per KV head,
// rounded to q's dtype as the Python path reads them). `softcap` > 0: each score (q . k * scale) becomes
// softcap * tanh(score / softcap) (Gemma 2); `sinks`: one logit per query head that joins the softmax's denominator
// and adds no value (gpt-oss); both as transformers' eager attention computes them (tanh as a polynomial of float32
// lane operations, `tanh8`: within a few float32 ulps of torch's, the same bits in every build of this file).
//
// The work is split into tasks of (sequence, KV head, CHUNK context positions): a task reads each KV row once for all
// the query heads that share it, and keeps, per head, its chunk's score maximum, exp-sum and exp-weighted values; a
// second pass merges a sequence's chunks in order (as flash-decoding does). Everything is float32 in an order fixed
// by the sequence alone: the dot product over d in 8 lanes (lane j sums elements j, j + 8, ...) then a fixed tree,
// exp as a polynomial of float32 operations, sums in position order, chunks merged in order. So a sequence's result
// is the same bits alone or in any batch, on any number of threads, in the vector and the one-lane builds: what the
// engine's batch invariance needs. One call per layer replaces a Python loop of ~15 tensor ops per sequence.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifndef HQT_OPS_NS
#define HQT_OPS_NS hqtflow
#endif

namespace {

constexpr int64_t CHUNK = 128;  // context positions per task: parallel work for one long sequence too

// Eight float32 lanes (GCC/Clang vector extensions): element-wise IEEE operations, so every build (AVX-512, AVX2, SSE)
// computes the same bits; -ffp-contract=off keeps a * b + c two roundings everywhere.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }
inline f8 splat(float s) { return f8{s, s, s, s, s, s, s, s}; }

// exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n; ~2 ulp), 0 below -87.3.
inline f8 exp8(f8 x) {
  const f8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer, kept in the low mantissa bits
  const f8 t = x * splat(1.44269504088896341f) + magic;
  const f8 n = t - magic;
  const f8 r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  f8 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * (r * r) + r + splat(1.0f);
  i8 tb, pow2b;
  std::memcpy(&tb, &t, sizeof(t));
  pow2b = ((tb - 0x4B400000) + 127) << 23;  // 2^n, n >= -126 in the range kept
  f8 pow2;
  std::memcpy(&pow2, &pow2b, sizeof(pow2));
  const i8 keep = x >= splat(-87.3f);
  f8 out = y * pow2;
  i8 ob;
  std::memcpy(&ob, &out, sizeof(out));
  ob &= keep;
  std::memcpy(&out, &ob, sizeof(out));
  return out;
}

inline float exp1(float x) { return exp8(splat(x))[0]; }

// tanh(x) (Cephes' tanhf, ~2 ulp): x + x^3 P(x^2) for |x| < 0.625, else sign(x) (1 - 2 / (exp(2|x|) + 1)) from exp8 of
// -2|x| (so 1 - 2 e / (1 + e), e <= 1); element-wise lane operations, so every build gives the same bits.
inline f8 tanh8(f8 x) {
  i8 xb, sign;
  std::memcpy(&xb, &x, sizeof(x));
  sign = xb & (int32_t)0x80000000;
  i8 ab = xb & 0x7FFFFFFF;
  f8 a;
  std::memcpy(&a, &ab, sizeof(a));
  const f8 s = x * x;
  f8 p = splat(-5.70498872745e-3f);
  p = p * s + splat(2.06390887954e-2f);
  p = p * s + splat(-5.37397155531e-2f);
  p = p * s + splat(1.33314422036e-1f);
  p = p * s + splat(-3.33332819422e-1f);
  const f8 small = p * s * x + x;
  const f8 e = exp8(splat(-2.0f) * a);
  const f8 t = splat(1.0f) - splat(2.0f) * e / (splat(1.0f) + e);
  i8 tb, sb, out;
  std::memcpy(&tb, &t, sizeof(t));
  tb |= sign;
  std::memcpy(&sb, &small, sizeof(small));
  sb |= sign;  // -0 stays -0
  const i8 use_large = a >= splat(0.625f);  // NaN takes the polynomial, which keeps it NaN (exp8 maps NaN to 0)
  out = (tb & use_large) | (sb & ~use_large);
  f8 r;
  std::memcpy(&r, &out, sizeof(r));
  return r;
}

// Eight dot products q . k[r] over d: lane j of each sums elements j, j + 8, ... (a tail past the last full 8 adds
// zeros), then the halving tree ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), done for the 8 rows at once.
f8 dot8(const float* q, const float* const* k, int64_t d) {
  f8 a[8] = {};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const f8 qi = load8(q + i);
    for (int r = 0; r < 8; ++r) a[r] += qi * load8(k[r] + i);
  }
  if (i < d) {
    float qt[8] = {}, kt[8] = {};
    std::memcpy(qt, q + i, (d - i) * sizeof(float));
    const f8 qi = load8(qt);
    for (int r = 0; r < 8; ++r) {
      std::memcpy(kt, k[r] + i, (d - i) * sizeof(float));
      a[r] += qi * load8(kt);
    }
  }
  f8 b[4], c[2];
  for (int r = 0; r < 4; ++r)  // [x0 + x4, x1 + x5, x2 + x6, x3 + x7] of rows 2r and 2r + 1
    b[r] = __builtin_shufflevector(a[2 * r], a[2 * r + 1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(a[2 * r], a[2 * r + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int r = 0; r < 2; ++r)  // [(x0 + x4) + (x2 + x6), (x1 + x5) + (x3 + x7)] of rows 4r .. 4r + 3
    c[r] = __builtin_shufflevector(b[2 * r], b[2 * r + 1], 0, 1, 4, 5, 8, 9, 12, 13)
         + __builtin_shufflevector(b[2 * r], b[2 * r + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14)
       + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

// out[0 .. 8 NV) = the sum over positions j, in order, of p[j] * row[j][..]: NV independent vector sums per position
// (a loop over d outside a loop over j would make each vector one long chain of dependent adds); returns 8 NV.
template <int NV>
int64_t value_sums(const float* p, const float* const* row, int64_t m, float* out) {
  f8 acc[NV] = {};
  for (int64_t j = 0; j < m; ++j) {
    const f8 pj = splat(p[j]);
    for (int v = 0; v < NV; ++v) acc[v] += pj * load8(row[j] + 8 * v);
  }
  for (int v = 0; v < NV; ++v) store8(out + 8 * v, acc[v]);
  return 8 * NV;
}

float round_to(float v, at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? static_cast<float>(c10::BFloat16(v))
       : dtype == at::kHalf     ? static_cast<float>(c10::Half(v)) : v;
}

// Sixteen lanes for widening FP8 rows (one AVX-512 register; two on AVX2; integer operations, exact in every build).
typedef float f16 __attribute__((vector_size(64)));
typedef uint32_t u16 __attribute__((vector_size(64)));

// Sixteen E4M3 codes as float32, exactly (sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent 0: m * 2^-9;
// 0x7F/0xFF: NaN), by integer operations on the lanes. (The bytes are loaded by an initializer list: converting a
// 16-byte vector with __builtin_convertvector compiled to code ~1.8x slower here.)
inline f16 e4m3_16(const uint8_t* p) {
  const u16 u = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]};
  const u16 sign = (u & 0x80u) << 24, e = (u >> 3) & 0xFu, m = u & 7u;
  const f16 sub = __builtin_convertvector(m, f16) * (1.0f / 512);
  u16 bits = e == 0u ? (reinterpret_cast<const u16&>(sub) | sign) : (sign | ((e + 120u) << 23) | (m << 20));
  bits = (u & 0x7Fu) == 0x7Fu ? u16{} + 0x7FC00000u : bits;
  return reinterpret_cast<const f16&>(bits);
}

// Floats rounded to bf16 (round to nearest even, NaN to bf16's quiet NaN: c10::BFloat16's rule), as floats.
inline f16 round_bf16_16(f16 x) {
  const u16 b = reinterpret_cast<const u16&>(x);
  u16 r = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  r = (b & 0x7FFFFFFFu) > 0x7F800000u ? u16{} + 0x7FC00000u : r;
  return reinterpret_cast<const f16&>(r);
}

// One KV tensor's rows as float32: fp32 rows in place, others widened into a buffer. FP8: code * scale rounded to the
// query's dtype; E4M3 with a bf16 or fp32 query 16 codes at a time (`e4m3_16`), the rest through a 256-entry table
// per KV head (one load per code), which gives the same bits.
template <typename T>
struct Rows {
  const T* base;
  int64_t kvh, d;
  const float* table;   // [kv_heads, 256] for FP8, else null
  const float* scales;  // per KV head (FP8 E4M3 lanes path), else null
  bool bf16;            // lanes path: round to bf16 (else the query is fp32)

  const float* row(int64_t slot, int64_t g, float* buf) const {
    const T* src = base + (slot * kvh + g) * d;
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else if constexpr (sizeof(T) == 1) {
      const uint8_t* codes = reinterpret_cast<const uint8_t*>(src);
      const float* t = table + g * 256;
      int64_t i = 0;
      if (scales) {
        const float s = scales[g];
        for (; i + 16 <= d; i += 16) {
          f16 v = e4m3_16(codes + i) * s;
          if (bf16) v = round_bf16_16(v);
          std::memcpy(buf + i, &v, sizeof(v));
        }
      }
      for (; i < d; ++i) buf[i] = t[codes[i]];
    } else {  // bf16, fp16: a loop the compiler vectorizes (1.3x faster for bf16 than the 8-lane widening it replaced)
      for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
    }
    return buf;
  }
};

// KV head g's scale: one for all heads, one per head, or 1 without scales.
inline float head_scale(const float* scales, int64_t per_head, int64_t g) {
  return scales ? scales[per_head ? g : 0] : 1.0f;
}

template <typename T>
std::vector<float> fp8_table(const float* scales, int64_t per_head, int64_t kvh, at::ScalarType round) {
  std::vector<float> t(kvh * 256);
  for (int64_t g = 0; g < kvh; ++g)
    for (int c = 0; c < 256; ++c) {
      T code;
      const uint8_t byte = static_cast<uint8_t>(c);
      std::memcpy(&code, &byte, 1);
      const float s = head_scale(scales, per_head, g);
      t[g * 256 + c] = round_to(static_cast<float>(code) * s, round);
    }
  return t;
}

// Pass 1, one task per (sequence, KV head, chunk): per query head of the group, the chunk's score maximum, sum of
// exp(score - maximum) and the exp-weighted sum of values, into part[chunk][head] = [max, sum, d values].
template <typename Q, typename KV>
void chunks(const Q* qp, const Rows<KV>& keys, const Rows<KV>& values, const int64_t* slots, const int64_t* offsets,
            const std::vector<int64_t>& chunk_seq, const std::vector<int64_t>& first_chunk, int64_t heads, float scale,
            float softcap, float* part) {
  const int64_t kvh = keys.kvh, d = keys.d, group = heads / kvh, n_chunks = static_cast<int64_t>(chunk_seq.size());
  at::parallel_for(0, n_chunks * kvh, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(group * d), p(group * CHUNK), rows(CHUNK * d), zeros(d, 0.0f);
    const float* row[CHUNK];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / kvh, g = t % kvh, b = chunk_seq[c];
      const int64_t start = offsets[b] + (c - first_chunk[b]) * CHUNK, m = std::min(CHUNK, offsets[b + 1] - start);
      for (int64_t i = 0; i < group * d; ++i) qf[i] = static_cast<float>(qp[(b * heads + g * group) * d + i]);
      for (int64_t j = 0; j < m; ++j) row[j] = keys.row(slots[start + j], g, rows.data() + j * d);
      for (int64_t j = m; j % 8; ++j) row[j] = zeros.data();  // whole blocks of 8 rows; these scores are not used
      for (int64_t j = 0; j < m; j += 8)
        for (int64_t h = 0; h < group; ++h) {
          const f8 s = dot8(qf.data() + h * d, row + j, d) * splat(scale);
          std::memcpy(p.data() + h * CHUNK + j, &s, std::min<int64_t>(8, m - j) * sizeof(float));
        }
      for (int64_t h = 0; h < group; ++h) {
        float* ph = p.data() + h * CHUNK;
        float* out = part + (c * heads + g * group + h) * (d + 2);
        if (softcap > 0.0f) {  // padded to whole lanes: ph holds CHUNK (a multiple of 8) floats
          for (int64_t j = 0; j < m; j += 8)
            store8(ph + j, tanh8(load8(ph + j) / splat(softcap)) * splat(softcap));
        }
        float top = -std::numeric_limits<float>::infinity();
        bool nan = false;  // a NaN score makes the sequence's output NaN, as torch's softmax does (merge reads it)
        for (int64_t j = 0; j < m; ++j) {
          top = std::max(top, ph[j]);
          nan |= ph[j] != ph[j];
        }
        if (nan) top = std::numeric_limits<float>::quiet_NaN();
        int64_t j = 0;
        for (; j + 8 <= m; j += 8) store8(ph + j, exp8(load8(ph + j) - splat(top)));
        for (; j < m; ++j) ph[j] = exp1(ph[j] - top);
        float sum = 0.0f;
        for (j = 0; j < m; ++j) sum += ph[j];
        out[0] = top;
        out[1] = sum;
      }
      for (int64_t j = 0; j < m; ++j) row[j] = values.row(slots[start + j], g, rows.data() + j * d);
      for (int64_t h = 0; h < group; ++h) {  // out[i] = sum over positions j, in order, of p[j] * v[j][i]
        const float* ph = p.data() + h * CHUNK;
        float* out = part + (c * heads + g * group + h) * (d + 2) + 2;
        int64_t i = 0;
        if (d == 64) i = value_sums<8>(ph, row, m, out);  // the common head dims: d / 8 sums side by side
        else if (d == 128) i = value_sums<16>(ph, row, m, out);
        for (; i + 8 <= d; i += 8) {
          f8 acc = {};
          for (int64_t j = 0; j < m; ++j) acc += splat(ph[j]) * load8(row[j] + i);
          store8(out + i, acc);
        }
        for (; i < d; ++i) {
          float acc = 0.0f;
          for (int64_t j = 0; j < m; ++j) acc += ph[j] * row[j][i];
          out[i] = acc;
        }
      }
    }
  });
}

// Pass 2, one task per (sequence, head): merge its chunks in order, rescaled to the largest maximum (and the head's
// sink logit, whose exp joins the sum last).
template <typename Q>
void merge(const float* part, const std::vector<int64_t>& first_chunk, int64_t B, int64_t heads, int64_t d,
           const float* sinks, Q* op) {
  at::parallel_for(0, B * heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(d), w;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / heads, h = t % heads, c0 = first_chunk[b], nc = first_chunk[b + 1] - c0;
      float top = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (int64_t c = 0; c < nc; ++c) {
        const float chunk_top = part[((c0 + c) * heads + h) * (d + 2)];
        top = std::max(top, chunk_top);
        nan |= chunk_top != chunk_top;
      }
      if (nan) {
        for (int64_t i = 0; i < d; ++i) op[t * d + i] = static_cast<Q>(std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      if (sinks) top = std::max(top, sinks[h]);
      w.resize(nc);
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < nc; ++c) {
        const float* pc = part + ((c0 + c) * heads + h) * (d + 2);
        w[c] = exp1(pc[0] - top);
        sum += pc[1] * w[c];
        for (int64_t i = 0; i < d; ++i) acc[i] += w[c] * pc[2 + i];
      }
      if (sinks) sum += exp1(sinks[h] - top);
      for (int64_t i = 0; i < d; ++i) op[t * d + i] = static_cast<Q>(acc[i] / sum);
    }
  });
}

template <typename Q, typename KV>
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* slots,
            const int64_t* offsets, const float* ks, const float* vs, int64_t per_head, float scale, float softcap,
            const float* sinks, at::Tensor& out) {
  const int64_t B = q.size(0), heads = q.size(1), d = q.size(2), kvh = keys.size(1);
  std::vector<float> k_table, v_table, k_scales, v_scales;
  const bool lanes = std::is_same_v<KV, c10::Float8_e4m3fn> &&
                     (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat);
  if constexpr (sizeof(KV) == 1) {
    k_table = fp8_table<KV>(ks, per_head, kvh, q.scalar_type());
    v_table = fp8_table<KV>(vs, per_head, kvh, q.scalar_type());
    for (int64_t g = 0; lanes && g < kvh; ++g) {
      k_scales.push_back(head_scale(ks, per_head, g));
      v_scales.push_back(head_scale(vs, per_head, g));
    }
  }
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const Rows<KV> k_rows{keys.data_ptr<KV>(), kvh, d, k_table.data(), lanes ? k_scales.data() : nullptr, bf16};
  const Rows<KV> v_rows{values.data_ptr<KV>(), kvh, d, v_table.data(), lanes ? v_scales.data() : nullptr, bf16};
  std::vector<int64_t> first_chunk(B + 1, 0), chunk_seq;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = (offsets[b + 1] - offsets[b] + CHUNK - 1) / CHUNK;
    first_chunk[b + 1] = first_chunk[b] + n;
    chunk_seq.insert(chunk_seq.end(), n, b);
  }
  at::Tensor part = at::empty({first_chunk[B], heads, d + 2}, q.options().dtype(at::kFloat));
  chunks<Q, KV>(q.data_ptr<Q>(), k_rows, v_rows, slots, offsets, chunk_seq, first_chunk, heads, scale, softcap,
                  part.data_ptr<float>());
  merge<Q>(part.data_ptr<float>(), first_chunk, B, heads, d, sinks, out.data_ptr<Q>());
}

template <typename Q>
void by_cache(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* slots,
              const int64_t* offsets, const float* ks, const float* vs, int64_t per_head, float scale, float softcap,
              const float* sinks, at::Tensor& out) {
  switch (keys.scalar_type()) {
    case at::kFloat: return attend<Q, float>(q, keys, values, slots, offsets, ks, vs, per_head, scale, softcap, sinks, out);
    case at::kBFloat16: return attend<Q, c10::BFloat16>(q, keys, values, slots, offsets, ks, vs, per_head, scale, softcap, sinks, out);
    case at::kHalf: return attend<Q, c10::Half>(q, keys, values, slots, offsets, ks, vs, per_head, scale, softcap, sinks, out);
    case at::kFloat8_e4m3fn: return attend<Q, c10::Float8_e4m3fn>(q, keys, values, slots, offsets, ks, vs, per_head, scale, softcap, sinks, out);
    case at::kFloat8_e5m2: return attend<Q, c10::Float8_e5m2>(q, keys, values, slots, offsets, ks, vs, per_head, scale, softcap, sinks, out);
    default: TORCH_CHECK(false, "paged_decode_attention: KV cache dtype ", keys.scalar_type(), " is not supported");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& slots_in, const at::Tensor& offsets_in,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                                  double scale, double softcap, const c10::optional<at::Tensor>& sinks_in) {
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
  const bool fp8 = keys.scalar_type() == at::kFloat8_e4m3fn || keys.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "paged_decode_attention: give both scales or neither");
  TORCH_CHECK(fp8 || !k_scale.has_value(), "paged_decode_attention: scales are for an FP8 cache");
  at::Tensor ksf, vsf;
  int64_t per_head = 0;
  if (k_scale.has_value()) {
    ksf = k_scale->to(at::kFloat).contiguous().reshape(-1);
    vsf = v_scale->to(at::kFloat).contiguous().reshape(-1);
    TORCH_CHECK(ksf.numel() == vsf.numel() && (ksf.numel() == 1 || ksf.numel() == keys.size(1)), "paged_decode_attention: scales are [] or one per KV head");
    per_head = ksf.numel() > 1;
  }
  const float* ks = k_scale.has_value() ? ksf.data_ptr<float>() : nullptr;
  const float* vs = k_scale.has_value() ? vsf.data_ptr<float>() : nullptr;
  TORCH_CHECK(softcap >= 0.0, "paged_decode_attention: softcap must be >= 0 (0: none)");
  at::Tensor sinks_f;
  if (sinks_in.has_value()) {
    sinks_f = sinks_in->to(at::kFloat).contiguous().reshape(-1);
    TORCH_CHECK(sinks_f.numel() == q.size(1), "paged_decode_attention: sinks are one per query head");
  }
  const float* sinks = sinks_in.has_value() ? sinks_f.data_ptr<float>() : nullptr;
  const float cap = static_cast<float>(softcap);
  at::Tensor out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: by_cache<float>(q, keys, values, s, o, ks, vs, per_head, sc, cap, sinks, out); break;
    case at::kBFloat16: by_cache<c10::BFloat16>(q, keys, values, s, o, ks, vs, per_head, sc, cap, sinks, out); break;
    case at::kHalf: by_cache<c10::Half>(q, keys, values, s, o, ks, vs, per_head, sc, cap, sinks, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: query dtype ", q.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(HQT_OPS_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor slots, Tensor offsets, Tensor? k_scale, "
        "Tensor? v_scale, float scale, float softcap=0., Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(HQT_OPS_NS, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
