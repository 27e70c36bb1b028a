// FP8 Linear for CPUs: y = QDQ(x) @ (W_fp8 * s_w)^T + bias, with the FP8 weight read as FP8 (one byte per weight)
// and widened in registers, never materialised per call on the decode path. Numerics follow hqtflow's QDQ
// reference (hqtflow/scales.py): the input is quantized as cast(clamp(x / s_x, -F, F)) (round to nearest even,
// saturating) and dequantized to the high-precision dtype; products are exact and sums are fp32.
//
// Two decode (small M) paths, picked at compile time from the CPU's flags:
// - bf16 (AVX512-BF16 + AVX512-VBMI, bf16 activations): 64 weight bytes become 64 exact bf16 weights with two
//   128-entry byte-table lookups (vpermi2b: high and low bytes), one OR for the sign and two unpacks; the unpack
//   order interleaves 128-bit lanes, so the input rows are permuted the same way once per call. vdpbf16ps does
//   32 multiply-adds per instruction into fp32.
// - fp32 (any AVX2+F16C CPU): sign-extend the byte to 16 bits, shift left 7, clear bit 14: for E4M3 that is an
//   IEEE half whose value is the E4M3 value * 2^-8 (subnormals included; the 2^8 goes into the output scale);
//   for E5M2 the byte is the top half of an IEEE half. vcvtph2ps widens, fp32 FMAs accumulate.
// Large M (prefill) widens the weight into the high-precision dtype in parallel blocks and calls ATen's GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HQT_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HQT_AVX2 1
#endif
#if HQT_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define HQT_BF16 1
#endif

namespace {

constexpr int64_t kGemvMaxM = 16;  // above this, widen the weight and use ATen's GEMM
constexpr int64_t kL1Bytes = 16 * 1024;  // half of a 32 KB L1D: x blocks leave room for the weights

// ---- widening one byte (reference for the vector paths, and tails) ------------------------------------------
inline float widen_scalar(uint8_t b, bool e4m3) {  // E4M3: value * 2^-8
  uint16_t h = e4m3 ? static_cast<uint16_t>((static_cast<uint16_t>(static_cast<int8_t>(b)) << 7) & 0xBFFF)
                    : static_cast<uint16_t>(b << 8);
  c10::Half half;
  std::memcpy(&half, &h, sizeof(h));
  return static_cast<float>(half);
}

inline float fp8_value(uint8_t b, bool e4m3) { return widen_scalar(b, e4m3) * (e4m3 ? 256.f : 1.f); }

#if HQT_AVX512
constexpr int kVec = 16;
inline __m512 widen16(const uint8_t* p, bool e4m3) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i h = e4m3 ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                      _mm256_set1_epi16(static_cast<short>(0xBFFF)))
                   : _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
  return _mm512_cvtph_ps(h);
}
#elif HQT_AVX2
constexpr int kVec = 8;
inline __m256 widen8(const uint8_t* p, bool e4m3) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m128i h = e4m3 ? _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(static_cast<short>(0xBFFF)))
                   : _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
  return _mm256_cvtph_ps(h);
}
#else
constexpr int kVec = 1;
#endif

// ---- fp32 path ----------------------------------------------------------------------------------------------
// y[m, r] (+)= sum_k x[m, k] * widen(w[r, k]) for NR weight rows and MB input rows: NR * MB independent
// accumulators hide the FMA latency, and each widened weight vector feeds MB FMAs.
template <int MB, int NR>
inline void dot_f32(const float* x, int64_t ldx, int64_t K, const uint8_t* w, int64_t ldw, bool e4m3, float* y,
                    int64_t ldy, bool accumulate) {
  float out[NR][MB];
  int64_t k = 0;
#if HQT_AVX512
  __m512 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (; k + kVec <= K; k += kVec) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = widen16(w + r * ldw + k, e4m3);
    for (int m = 0; m < MB; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm512_fmadd_ps(xv, wv[r], acc[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
#elif HQT_AVX2
  __m256 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (; k + kVec <= K; k += kVec) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = widen8(w + r * ldw + k, e4m3);
    for (int m = 0; m < MB; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm256_fmadd_ps(xv, wv[r], acc[r][m]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][m]), _mm256_extractf128_ps(acc[r][m], 1));
      s = _mm_hadd_ps(s, s);
      out[r][m] = _mm_cvtss_f32(_mm_hadd_ps(s, s));
    }
#else
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < NR; ++r) {
      const float wk = widen_scalar(w[r * ldw + k], e4m3);
      for (int m = 0; m < MB; ++m) out[r][m] += x[m * ldx + k] * wk;
    }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) y[m * ldy + r] = accumulate ? y[m * ldy + r] + out[r][m] : out[r][m];
}

// ---- bf16 path ----------------------------------------------------------------------------------------------
#if HQT_BF16
// bf16 bits of every non-negative FP8 code (0..127), split into high and low bytes for vpermi2b.
struct Bf16Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  explicit Bf16Tables(bool e4m3) {
    for (int j = 0; j < 128; ++j) {
      float v = (e4m3 && j == 127) ? 0.f : fp8_value(static_cast<uint8_t>(j), e4m3);  // 0x7f is E4M3's NaN
      uint32_t u;
      std::memcpy(&u, &v, 4);
      hi[j] = static_cast<uint8_t>(u >> 24);
      lo[j] = static_cast<uint8_t>(u >> 16);  // exact: FP8 values have at most 3 mantissa bits
    }
  }
};
const Bf16Tables& tables(bool e4m3) {
  static const Bf16Tables e4(true), e5(false);
  return e4m3 ? e4 : e5;
}

struct Widener {
  __m512i hi0, hi1, lo0, lo1, sign;
  explicit Widener(bool e4m3) {
    const Bf16Tables& t = tables(e4m3);
    hi0 = _mm512_load_si512(t.hi);
    hi1 = _mm512_load_si512(t.hi + 64);
    lo0 = _mm512_load_si512(t.lo);
    lo1 = _mm512_load_si512(t.lo + 64);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  // 64 FP8 bytes -> two vectors of 32 bf16 (lane-interleaved order, see permute_row).
  inline void widen64(const uint8_t* p, __m512bh& w0, __m512bh& w1) const {
    __m512i b = _mm512_loadu_si512(p);
    __m512i h = _mm512_permutex2var_epi8(hi0, b, hi1);  // index bits 6..0; the sign bit is ignored
    __m512i l = _mm512_permutex2var_epi8(lo0, b, lo1);
    h = _mm512_ternarylogic_epi32(h, b, sign, 0xF8);    // h | (b & 0x80)
    w0 = (__m512bh)_mm512_unpacklo_epi8(l, h);
    w1 = (__m512bh)_mm512_unpackhi_epi8(l, h);
  }
};

// The order widen64 produces: position j < 32 holds byte 16 * (j / 8) + j % 8, position 32 + j byte 16 * (j / 8) + 8 + j % 8.
inline int64_t permuted_source(int64_t j) {
  const int64_t half = j / 32, i = j % 32;
  return 16 * (i / 8) + 8 * half + i % 8;
}

template <int MB, int NR>
inline void dot_bf16(const uint16_t* x, int64_t ldx, int64_t K, const uint8_t* w, int64_t ldw, const Widener& wd,
                     float* y, int64_t ldy, bool accumulate) {
  __m512 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 64) {
    __m512bh w0[NR], w1[NR];
    for (int r = 0; r < NR; ++r) wd.widen64(w + r * ldw + k, w0[r], w1[r]);
    for (int m = 0; m < MB; ++m) {
      __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
      __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32);
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][m], x0, w0[r]), x1, w1[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MB; ++m) {
      const float s = _mm512_reduce_add_ps(acc[r][m]);
      y[m * ldy + r] = accumulate ? y[m * ldy + r] + s : s;
    }
}
#endif

// ---- blocking over N (threads), K (L1) and M (registers) -----------------------------------------------------
struct Problem {
  const void* x;  // float [M, K] (fp32 path) or uint16 bf16 [M, K] permuted (bf16 path)
  const uint8_t* w;
  float* y;       // fp32 [M, N]
  int64_t M, N, K;
  bool e4m3, bf16;
};

struct Block {  // the part of the problem one dot call covers
  int64_t m0, n, k0, kl;
  bool accumulate;
};

template <int MB, int NR>
inline void dot(const Problem& p, const Block& b, const void* widener) {
  const uint8_t* w = p.w + b.n * p.K + b.k0;
  float* y = p.y + b.m0 * p.N + b.n;
#if HQT_BF16
  if (p.bf16) {
    dot_bf16<MB, NR>(static_cast<const uint16_t*>(p.x) + b.m0 * p.K + b.k0, p.K, b.kl, w, p.K,
                     *static_cast<const Widener*>(widener), y, p.N, b.accumulate);
    return;
  }
#endif
  dot_f32<MB, NR>(static_cast<const float*>(p.x) + b.m0 * p.K + b.k0, p.K, b.kl, w, p.K, p.e4m3, y, p.N, b.accumulate);
}

template <int NR>
inline void dot_rows(const Problem& p, int64_t mb, const Block& b, const void* widener) {
  switch (mb) {
    case 1: return dot<1, NR>(p, b, widener);
    case 2: return dot<2, NR>(p, b, widener);
    case 3: return dot<3, NR>(p, b, widener);
    case 4: return dot<4, NR>(p, b, widener);
    case 5: return dot<5, NR>(p, b, widener);
    case 6: return dot<6, NR>(p, b, widener);
    case 7: return dot<7, NR>(p, b, widener);
    default: return dot<8, NR>(p, b, widener);
  }
}

// Output columns [n0, n1) for all M rows (one thread's share). K is walked in blocks small enough that the block
// of x (all M rows) stays in L1; for each group of NR weight rows every chunk of <= 8 input rows runs while those
// weight bytes are still in L1, so the weights stream from memory once whatever M is.
void gemv(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t elem = p.bf16 ? 2 : 4;
  const int64_t kb = std::max<int64_t>(256, kL1Bytes / (elem * p.M) / 64 * 64);
  const int64_t chunks = (p.M + 7) / 8, base = p.M / chunks, extra = p.M % chunks;  // near-equal chunks
  const void* widener = nullptr;
#if HQT_BF16
  const Widener wd(p.e4m3);
  widener = &wd;
#endif
  for (int64_t k0 = 0; k0 < p.K; k0 += kb) {
    const int64_t kl = std::min(kb, p.K - k0);
    auto rows = [&](auto nr_tag, int64_t n) {
      constexpr int R = decltype(nr_tag)::value;
      for (int64_t c = 0, m0 = 0; c < chunks; ++c) {
        const int64_t mb = base + (c < extra);
        dot_rows<R>(p, mb, Block{m0, n, k0, kl, k0 > 0}, widener);
        m0 += mb;
      }
    };
    int64_t n = n0;
    if (p.M == 1) {
      for (; n + 4 <= n1; n += 4) rows(std::integral_constant<int, 4>{}, n);
    } else {
      for (; n + 2 <= n1; n += 2) rows(std::integral_constant<int, 2>{}, n);
    }
    for (; n < n1; ++n) rows(std::integral_constant<int, 1>{}, n);
  }
}

// ---- the input: QDQ with the static scale, in the layout the GEMV wants --------------------------------------
bool is_e4m3(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn || w.scalar_type() == at::kFloat8_e5m2,
              "fp8_linear: weight must be float8_e4m3fn or float8_e5m2, not ", w.scalar_type());
  return w.scalar_type() == at::kFloat8_e4m3fn;
}

inline float round_to(float v, at::ScalarType hp) {
  if (hp == at::kBFloat16) return static_cast<float>(c10::BFloat16(v));
  if (hp == at::kHalf) return static_cast<float>(c10::Half(v));
  return v;
}

// x rounded to the FP8 grid with scale s and back, in float, then to the high-precision dtype: the reference's
// dequantize(quantize(x, s), s, hp). Vectorised; the scalar form (c10's conversions) handles tails and is the
// definition the vector form is tested against.
#if HQT_AVX512
// cast(clamp(v / s, -F, F)) to the FP8 grid, as a float (16 lanes): the integer-bit round-to-nearest-even of the
// normal range and a scaled rint of the subnormal range, exactly like c10's Float8 conversions.
struct Fp8Rounder {
  __m512 sv, Fv, min_normal, sub_up, sub_down;
  __m512i half_ulp, keep, abs_mask;
  int shift;
  Fp8Rounder(float s, bool e4m3) {
    sv = _mm512_set1_ps(s);
    Fv = _mm512_set1_ps(e4m3 ? 448.f : 57344.f);
    min_normal = _mm512_set1_ps(e4m3 ? 0.015625f : 6.103515625e-05f);  // 2^-6, 2^-14
    sub_up = _mm512_set1_ps(e4m3 ? 512.f : 65536.f);
    sub_down = _mm512_set1_ps(e4m3 ? 1.f / 512 : 1.f / 65536);
    shift = e4m3 ? 20 : 21;  // fp32 mantissa bits dropped
    half_ulp = _mm512_set1_epi32((1 << (shift - 1)) - 1);
    keep = _mm512_set1_epi32(~((1 << shift) - 1));
    abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  }
  inline __m512 operator()(__m512 x) const {
    __m512 v = _mm512_div_ps(x, sv);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), Fv)), Fv);
    __m512i u = _mm512_castps_si512(v);
    __m512i sign = _mm512_andnot_si512(abs_mask, u);
    __m512i au = _mm512_and_si512(u, abs_mask);
    __m512 a = _mm512_castsi512_ps(au);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(au, shift), _mm512_set1_epi32(1));
    __m512 normal = _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(au, _mm512_add_epi32(half_ulp, odd)), keep));
    __m512 sub = _mm512_mul_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, sub_up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), sub_down);
    __m512 q = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, min_normal, _CMP_LT_OQ), normal, sub);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(q), sign));
  }
  // The FP8 byte of a value already on the grid.
  inline __m128i bits(__m512 q, bool e4m3) const {
    __m512i u = _mm512_castps_si512(q);
    __m512i au = _mm512_and_si512(u, abs_mask);
    __m512 a = _mm512_castsi512_ps(au);
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 120 : 112;  // 127 - 7, 127 - 15
    __m512i normal = _mm512_or_si512(
        _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(au, 23), _mm512_set1_epi32(bias)), mbits),
        _mm512_and_si512(_mm512_srli_epi32(au, 23 - mbits), _mm512_set1_epi32((1 << mbits) - 1)));
    __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, sub_up));  // exact: a is a multiple of the subnormal step
    __m512i b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, min_normal, _CMP_LT_OQ), normal, sub);
    b = _mm512_or_si512(b, _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80)));
    return _mm512_cvtepi32_epi8(b);
  }
};
#endif

void qdq_row(const float* x, int64_t n, float s, bool e4m3, at::ScalarType hp, float* out) {
  const float F = e4m3 ? 448.f : 57344.f;
  int64_t i = 0;
#if HQT_AVX512
  const Fp8Rounder round(s, e4m3);
  for (; i + 16 <= n; i += 16) {
    __m512 d = _mm512_mul_ps(round(_mm512_loadu_ps(x + i)), round.sv);
    if (hp == at::kBFloat16) {  // round to nearest even at 16 bits
      __m512i du = _mm512_castps_si512(d);
      __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(du, 16), _mm512_set1_epi32(1));
      du = _mm512_add_epi32(du, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
      d = _mm512_castsi512_ps(_mm512_and_si512(du, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    } else if (hp == at::kHalf) {
      d = _mm512_cvtph_ps(_mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    _mm512_storeu_ps(out + i, d);
  }
#endif
  for (; i < n; ++i) {
    float v = x[i] / s;
    v = v > F ? F : (v < -F ? -F : v);
    const float q = e4m3 ? static_cast<float>(c10::Float8_e4m3fn(v)) : static_cast<float>(c10::Float8_e5m2(v));
    out[i] = round_to(q * s, hp);
  }
}

// One row of FP8 bytes: cast(clamp(x / s, -F, F)), the reference's `quantize`.
template <typename T>
void quantize_row(const T* x, int64_t n, float s, bool e4m3, uint8_t* out) {
  const float F = e4m3 ? 448.f : 57344.f;
  int64_t i = 0;
#if HQT_AVX512
  const Fp8Rounder round(s, e4m3);
  alignas(64) float buf[16];
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) buf[j] = static_cast<float>(x[i + j]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), round.bits(round(_mm512_load_ps(buf)), e4m3));
  }
#endif
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]) / s;
    v = v > F ? F : (v < -F ? -F : v);
    out[i] = e4m3 ? c10::Float8_e4m3fn(v).x : c10::Float8_e5m2(v).x;
  }
}

// Small tensors (scales, bias, input rows) read as float straight from their storage: no ATen op per call.
inline float load_float(const void* p, at::ScalarType t, int64_t i) {
  switch (t) {
    case at::kFloat: return static_cast<const float*>(p)[i];
    case at::kBFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
    case at::kHalf: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    default: TORCH_CHECK(false, "fp8_linear: unsupported dtype ", t);
  }
}

std::vector<float> floats_of(const at::Tensor& t) {
  at::Tensor c = t.is_contiguous() ? t : t.contiguous();
  std::vector<float> v(c.numel());
  for (int64_t i = 0; i < c.numel(); ++i) v[i] = load_float(c.data_ptr(), c.scalar_type(), i);
  return v;
}

// The GEMV's input, from x [M, K] (contiguous): QDQ'd with the static scale when there is one, as fp32 [M, K]
// (fp32 path) or as bf16 [M, K] in widen64's order (bf16 path; the values are bf16 already, so exactly).
struct Input {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  const void* data() const { return bf16.empty() ? static_cast<const void*>(f32.data()) : bf16.data(); }
};

template <typename T>
void to_float(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

Input prepare_input(const at::Tensor& x2d, const c10::optional<at::Tensor>& input_scale, bool e4m3, bool bf16) {
  const int64_t M = x2d.size(0), K = x2d.size(1);
  const auto hp = x2d.scalar_type();
  Input in;
#if HQT_BF16
  static const std::array<int, 64> order = [] {
    std::array<int, 64> o{};
    for (int j = 0; j < 64; ++j) o[j] = static_cast<int>(permuted_source(j));
    return o;
  }();
  if (bf16 && !input_scale.has_value()) {  // weight-only: the bf16 input is only reordered
    const uint16_t* src = static_cast<const uint16_t*>(x2d.data_ptr());
    in.bf16.resize(M * K);
    for (int64_t i = 0; i < M * K; i += 64)
      for (int j = 0; j < 64; ++j) in.bf16[i + j] = src[i + order[j]];
    return in;
  }
#endif
  in.f32.resize(M * K);
  switch (hp) {
    case at::kBFloat16: to_float(x2d.data_ptr<c10::BFloat16>(), M * K, in.f32.data()); break;
    case at::kHalf: to_float(x2d.data_ptr<c10::Half>(), M * K, in.f32.data()); break;
    case at::kFloat: std::memcpy(in.f32.data(), x2d.data_ptr<float>(), M * K * 4); break;
    default: TORCH_CHECK(false, "fp8_linear: unsupported input dtype ", hp);
  }
  if (input_scale.has_value()) {
    const float s = load_float(input_scale->data_ptr(), input_scale->scalar_type(), 0);
    qdq_row(in.f32.data(), M * K, s, e4m3, hp, in.f32.data());  // elementwise: rows need no separate calls
  }
#if HQT_BF16
  if (bf16) {
    in.bf16.resize(M * K);
    const uint32_t* u = reinterpret_cast<const uint32_t*>(in.f32.data());
    for (int64_t i = 0; i < M * K; i += 64)
      for (int j = 0; j < 64; ++j) in.bf16[i + j] = static_cast<uint16_t>(u[i + order[j]] >> 16);  // exact
    in.f32.clear();
  }
#endif
  return in;
}

// Weight rows [n0, n1) widened and scaled (fp32).
void widen_rows(const uint8_t* w, const float* scale, bool per_channel, int64_t K, int64_t n0, int64_t n1, bool e4m3,
                float* out) {
  const float factor = e4m3 ? 256.f : 1.f;
  for (int64_t n = n0; n < n1; ++n) {
    const float s = (per_channel ? scale[n] : scale[0]) * factor;
    const uint8_t* wr = w + n * K;
    float* o = out + (n - n0) * K;
    int64_t k = 0;
#if HQT_AVX512
    const __m512 sv = _mm512_set1_ps(s);
    for (; k + kVec <= K; k += kVec) _mm512_storeu_ps(o + k, _mm512_mul_ps(widen16(wr + k, e4m3), sv));
#elif HQT_AVX2
    const __m256 sv = _mm256_set1_ps(s);
    for (; k + kVec <= K; k += kVec) _mm256_storeu_ps(o + k, _mm256_mul_ps(widen8(wr + k, e4m3), sv));
#endif
    for (; k < K; ++k) o[k] = widen_scalar(wr[k], e4m3) * s;
  }
}

}  // namespace

// The dequantized weight in `dtype`: W * scale in fp32, then cast (the reference's `dequantize`), in parallel.
at::Tensor fp8_dequantize(const at::Tensor& w, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "fp8_dequantize: weight must be a contiguous 2-D tensor");
  const bool e4m3 = is_e4m3(w);
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor sc = scale.to(at::kFloat).contiguous().reshape({-1});
  const bool per_channel = sc.numel() > 1;
  TORCH_CHECK(!per_channel || sc.numel() == N, "fp8_dequantize: weight_scale must have 1 or ", N, " values");
  at::Tensor out = at::empty({N, K}, w.options().dtype(dtype));
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* sp = sc.data_ptr<float>();
  const int64_t rows = std::max<int64_t>(1, kL1Bytes / (4 * K));
  at::parallel_for(0, (N + rows - 1) / rows, 1, [&](int64_t b, int64_t e) {
    std::vector<float> buf(rows * K);
    for (int64_t c = b; c < e; ++c) {
      const int64_t n0 = c * rows, n1 = std::min(N, n0 + rows);
      widen_rows(wp, sp, per_channel, K, n0, n1, e4m3, buf.data());
      if (dtype == at::kFloat) {
        std::memcpy(out.data_ptr<float>() + n0 * K, buf.data(), (n1 - n0) * K * 4);
      } else if (dtype == at::kBFloat16) {
        auto* o = out.data_ptr<c10::BFloat16>() + n0 * K;
        int64_t i = 0;
#if HQT_BF16
        for (; i + 16 <= (n1 - n0) * K; i += 16)  // vcvtneps2bf16 rounds to nearest even, like c10::BFloat16
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(buf.data() + i)));
#endif
        for (; i < (n1 - n0) * K; ++i) o[i] = c10::BFloat16(buf[i]);
      } else {
        auto* o = out.data_ptr<c10::Half>() + n0 * K;
        for (int64_t i = 0; i < (n1 - n0) * K; ++i) o[i] = c10::Half(buf[i]);
      }
    }
  });
  return out;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& weight_scale,
                      const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "fp8_linear: weight must be a contiguous 2-D tensor");
  const bool e4m3 = is_e4m3(w);
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.size(-1) == K, "fp8_linear: input has ", x.size(-1), " features, weight expects ", K);
  const auto hp = x.scalar_type();
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  at::Tensor x2d = x.reshape({-1, K}).contiguous();
  const int64_t M = x2d.size(0);
  const std::vector<float> sc = floats_of(weight_scale);
  const bool per_channel = sc.size() > 1;
  TORCH_CHECK(!per_channel || static_cast<int64_t>(sc.size()) == N, "fp8_linear: weight_scale must have 1 or ", N, " values");

  if (M > kGemvMaxM) {  // prefill: GEMM on the widened weight (compute-bound; widening is a small share)
    at::Tensor xin = x2d;
    if (input_scale.has_value()) {
      Input in = prepare_input(x2d, input_scale, e4m3, false);
      xin = at::from_blob(in.f32.data(), {M, K}, at::kFloat).to(hp);
    }
    at::Tensor wd = fp8_dequantize(w, weight_scale, hp);
    at::Tensor y = bias.has_value() ? at::addmm(bias->to(hp), xin, wd.t()) : at::mm(xin, wd.t());
    return y.reshape(out_shape);
  }

#if HQT_BF16
  const bool bf16 = hp == at::kBFloat16 && K % 64 == 0;
#else
  const bool bf16 = false;
#endif
  const Input in = prepare_input(x2d, input_scale, e4m3, bf16);
  std::vector<float> acc(M * N);
  const std::vector<float> b = bias.has_value() ? floats_of(*bias) : std::vector<float>();
  at::Tensor out = at::empty({M, N}, x.options());
  void* op = out.data_ptr();
  const float factor = (e4m3 && !bf16) ? 256.f : 1.f;  // the fp32 path widens E4M3 to value * 2^-8
  const Problem p{in.data(), reinterpret_cast<const uint8_t*>(w.data_ptr()), acc.data(), M, N, K, e4m3, bf16};
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    gemv(p, n0, n1);
    for (int64_t m = 0; m < M; ++m)  // epilogue: scale, bias, cast; one rounding to the output dtype
      for (int64_t n = n0; n < n1; ++n) {
        float v = acc[m * N + n] * (per_channel ? sc[n] : sc[0]) * factor;
        if (!b.empty()) v += b[n];
        if (hp == at::kBFloat16) static_cast<c10::BFloat16*>(op)[m * N + n] = c10::BFloat16(v);
        else if (hp == at::kHalf) static_cast<c10::Half*>(op)[m * N + n] = c10::Half(v);
        else static_cast<float*>(op)[m * N + n] = v;
      }
  });
  return out.reshape(out_shape);
}

// The reference's `quantize` for a whole weight (2-D; scale: one value or one per row), in parallel rows.
at::Tensor fp8_quantize(const at::Tensor& x, const at::Tensor& scale, bool e4m3) {
  TORCH_CHECK(x.dim() == 2, "fp8_quantize: expected a 2-D tensor");
  at::Tensor xc = x.contiguous();
  const int64_t R = xc.size(0), C = xc.size(1);
  const std::vector<float> sc = floats_of(scale);
  TORCH_CHECK(sc.size() == 1 || static_cast<int64_t>(sc.size()) == R, "fp8_quantize: scale must have 1 or ", R, " values");
  at::Tensor out = at::empty({R, C}, xc.options().dtype(e4m3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2));
  uint8_t* op = reinterpret_cast<uint8_t*>(out.data_ptr());
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(C, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float s = sc.size() == 1 ? sc[0] : sc[r];
      switch (xc.scalar_type()) {
        case at::kBFloat16: quantize_row(xc.data_ptr<c10::BFloat16>() + r * C, C, s, e4m3, op + r * C); break;
        case at::kHalf: quantize_row(xc.data_ptr<c10::Half>() + r * C, C, s, e4m3, op + r * C); break;
        case at::kFloat: quantize_row(xc.data_ptr<float>() + r * C, C, s, e4m3, op + r * C); break;
        default: TORCH_CHECK(false, "fp8_quantize: unsupported dtype ", xc.scalar_type());
      }
    }
  });
  return out;
}

// The reference QDQ of a row, exposed for tests of the vector rounding against torch's casts.
at::Tensor fp8_qdq(const at::Tensor& x, const at::Tensor& scale, bool e4m3) {
  at::Tensor xf = x.to(at::kFloat).contiguous().clone();
  qdq_row(xf.data_ptr<float>(), xf.numel(), scale.to(at::kFloat).item<float>(), e4m3, x.scalar_type(), xf.data_ptr<float>());
  return xf.to(x.scalar_type());
}

bool fp8_bf16_path() {
#if HQT_BF16
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY(hqtflow, m) {
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias) -> Tensor");
  m.def("fp8_dequantize(Tensor weight, Tensor weight_scale, ScalarType dtype) -> Tensor");
  m.def("fp8_qdq(Tensor x, Tensor scale, bool e4m3) -> Tensor");
  m.def("fp8_quantize(Tensor x, Tensor scale, bool e4m3) -> Tensor");
  m.def("fp8_bf16_path() -> bool", &fp8_bf16_path);
}

TORCH_LIBRARY_IMPL(hqtflow, CPU, m) {
  m.impl("fp8_linear", &fp8_linear);
  m.impl("fp8_dequantize", &fp8_dequantize);
  m.impl("fp8_qdq", &fp8_qdq);
  m.impl("fp8_quantize", &fp8_quantize);
}
