// FP8 Linear for CPUs, batch-invariant: y = QDQ(x) @ dequantize(W_fp8, s_w)^T + bias computes, for every output
// element, the same sequence of floating-point operations whatever M is, whichever rows sit beside it and however
// the work is split between threads. It is the function of hqtflow's QDQ reference (hqtflow/scales.py,
// FP8Linear's "qdq" backend):
//   x_q = hp(cast(clamp(x / s_x, -F, F)) * s_x)      (static W8A8; weight-only and dynamic inputs skip this)
//   w_q = hp(W_fp8 * s_w)                             (s_w per tensor or per output row; fp32 multiply, one rounding)
//   y   = hp(hp(sum_k x_q[k] * w_q[k]) + bias)        (products exact in fp32 for bf16/fp16; sums in fp32)
// with hp the high-precision dtype (bf16, fp16 or fp32). Only the order of the fp32 sum differs from the reference's
// GEMM (which changes its order with M); here it is fixed per output, the same on every path and for every M:
// - bf16 path (bf16 models on CPUs with AVX512-BF16): each output owns one fp32 vector lane and adds its products
//   pair of k after pair of k in ascending k (one vdpbf16ps lane per pair: acc + x[k+1] w[k+1], then + x[k] w[k],
//   each rounded to nearest even, denormals flushed), with no reduction across lanes (outer products: 16 outputs per
//   vector, the input pair broadcast); on Intel CPUs the panels do each as two FMAs with the same bits;
// - AMX path (bf16 models on CPUs with AMX-BF16, every M): each output is an element of a 16 x 16 fp32 tile that
//   one TDPBF16PS updates with 32 products at a time, 32 k after 32 k in ascending order; row m of the tile depends
//   only on row m of the input tile. The hardware adds the 32 products and the accumulator in its own way (not a
//   sequence of fp32 additions: its bits differ from the bf16 path's), the same way for every M;
// - fp32 path on AVX2 (and the one-lane build without vector instructions): each output owns one fp32 vector lane
//   and adds its products k after k in ascending k, one FMA each (outer products over a packed weight: 8 rows per
//   vector, the input value broadcast); AVX2 and the one-lane build give the same bits;
// - fp32 path on AVX-512F: each output accumulates its products in vector lanes over k in ascending steps, then one
//   halving tree across the lanes (`hsum`).
// So a row's output is bit-identical whether it is computed alone, padded or inside a batch of 512.
//
// Compute paths, picked at compile time from the CPU's flags (the kernel is built with -march=native):
// - AMX tiles (AMX-BF16, bf16 models, when Linux grants the process the tile state): the bf16 path's widened weights
//   (pair-major blocks of 16 rows: exactly a B tile's layout) times 16-row tiles of the input, 32 x 32 outputs per
//   step in four accumulator tiles; decode pads the input to 16 rows (zeros, never stored).
// - bf16 dot products (AVX512-BF16 + AVX512-VBMI, bf16 models): 64 FP8 bytes become 64 bf16 values of w_q with two
//   128-entry byte-table lookups (vpermi2b, high and low bytes of hp(v * s_w) for the 128 non-negative codes), one
//   OR for the sign and two unpacks. The bytes of 16 weight rows are first transposed so that each widened vector
//   holds one pair of k of 16 rows: once per layer by `fp8_pack`, which stores every chunk of 64 columns so (else in
//   each call). vdpbf16ps does 32 exact multiply-adds per instruction into fp32; on Intel cores
//   (where it issues at a quarter of the FMA rate) the panels (M > 12) run it as two FMAs under DAZ and FTZ, its
//   bits checked at load (`outer_steps_fma`).
// - fp32 FMA (AVX-512F or AVX2+F16C; fp32 and fp16 models, and bf16 models on CPUs without bf16 dot products): the
//   byte is sign-extended, shifted and masked into an IEEE half (E4M3 value * 2^-8, subnormals included), widened
//   by vcvtph2ps, multiplied by s_w * 2^8 (exactly the fp32 product v * s_w) and rounded to hp.
// The weights of a few rows are widened in registers for decode-sized M; for larger M each thread widens a panel of
// rows once into an L2-sized buffer and sweeps every input row over it (the weight streams from memory once).
// On AVX2 the weight is read packed (`fp8_pack`: groups of 8 rows, column after column), made once per layer; on the
// bf16 path it is read arranged (`fp8_pack`: chunks of 64 columns of 16 rows transposed), also made once per layer.
// Measured on a 2-core Zen 4, interleaved, cold, against transposing per call: 4096^2 2.24 / 3.23 / 1.80 / 1.23x at
// M = 1 / 4 / 8 / 32, SmolLM2's shapes 1.07-1.17x at M = 1-32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HQT_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HQT_AVX2 1
#endif
#if HQT_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define HQT_BF16 1
#endif
#if HQT_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HQT_AMX 1
#endif
#ifndef HQT_REG_MAX_M
#define HQT_REG_MAX_M 2
#endif
#ifndef HQT_OPS_NS
#define HQT_OPS_NS hqtflow  // the torch op namespace (tests build an AVX2-only twin under another name)
#endif

#define HQT_INLINE inline __attribute__((always_inline))
#define HQT_INLINE_LAMBDA __attribute__((always_inline))
#define HQT_UNROLL _Pragma("GCC unroll 16")

namespace {

// Widened weight panel per thread: half of a 1 MB L2 for short rows (every input row is swept over each panel, so
// fewer panels mean fewer passes over the input), a quarter for long rows (the input rows' slivers need L2 too).
inline int64_t panel_bytes(int64_t K) { return K <= 2048 ? 512 * 1024 : 256 * 1024; }

// A thread's scratch buffer of at least `bytes`, 64-byte aligned, kept for its later calls (no page faults per call).
template <int Slot>
void* scratch(int64_t bytes) {
  thread_local std::unique_ptr<void, decltype(&std::free)> buf(nullptr, &std::free);
  thread_local int64_t size = 0;
  if (size < bytes) {
    buf.reset(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    size = bytes;
  }
  return buf.get();
}

// ---- scalar definitions (the vector forms are tested against these) -----------------------------------------
// E4M3: value * 2^-8 as an IEEE half (sign-extend, shift, clear bit 14); E5M2: the byte is the top of a half.
inline float widen_scalar(uint8_t b, bool e4m3) {
  uint16_t h = e4m3 ? static_cast<uint16_t>((static_cast<uint16_t>(static_cast<int8_t>(b)) << 7) & 0xBFFF)
                    : static_cast<uint16_t>(b << 8);
  c10::Half half;
  std::memcpy(&half, &h, sizeof(h));
  return static_cast<float>(half);
}

inline float fp8_value(uint8_t b, bool e4m3) { return widen_scalar(b, e4m3) * (e4m3 ? 256.f : 1.f); }

inline float round_to(float v, at::ScalarType hp) {
  if (hp == at::kBFloat16) return static_cast<float>(c10::BFloat16(v));
  if (hp == at::kHalf) return static_cast<float>(c10::Half(v));
  return v;
}

// ---- fp32 vectors: one type per ISA, same operations ---------------------------------------------------------
#if HQT_AVX512
struct F32 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float s) { return _mm512_set1_ps(s); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static HQT_INLINE V widen(const uint8_t* p, bool e4m3) {  // W bytes -> fp32 (E4M3 scaled by 2^-8)
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m256i h = e4m3 ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                        _mm256_set1_epi16(static_cast<short>(0xBFFF)))
                     : _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
    return _mm512_cvtph_ps(h);
  }
  static HQT_INLINE void widen2(const uint8_t* p, bool e4m3, V& lo, V& hi) { lo = widen(p, e4m3), hi = widen(p + W, e4m3); }
  static HQT_INLINE V round_bf16(V v) {  // round to nearest even at 16 bits (finite values)
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static V round_fp16(V v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
  static HQT_INLINE float hsum(V v) {  // the halving tree: lanes j + j+8, then j + j+4, j + j+2, j + j+1
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
  }
};
#elif HQT_AVX2
struct F32 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float s) { return _mm256_set1_ps(s); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static HQT_INLINE V widen(const uint8_t* p, bool e4m3) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    __m128i h = e4m3 ? _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(static_cast<short>(0xBFFF)))
                     : _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
    return _mm256_cvtph_ps(h);
  }
  static HQT_INLINE void widen2(const uint8_t* p, bool e4m3, V& lo, V& hi) {  // 2W bytes in one integer pass
    widen2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), e4m3, lo, hi);
  }
  static HQT_INLINE void widen2(__m128i b, bool e4m3, V& lo, V& hi) {
    __m256i h = e4m3 ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                        _mm256_set1_epi16(static_cast<short>(0xBFFF)))
                     : _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  static HQT_INLINE V round_bf16(V v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static V round_fp16(V v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
  static HQT_INLINE float hsum(V v) {  // lanes j + j+4, then j + j+2, j + j+1
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
  }
};
#else
struct F32 {  // portable fallback: one lane
  using V = float;
  static constexpr int W = 1;
  static V zero() { return 0.f; }
  static V set1(float s) { return s; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V mul(V a, V b) { return a * b; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static HQT_INLINE V widen(const uint8_t* p, bool e4m3) { return widen_scalar(*p, e4m3); }
  static HQT_INLINE void widen2(const uint8_t* p, bool e4m3, V& lo, V& hi) { lo = widen(p, e4m3), hi = widen(p + 1, e4m3); }
  static HQT_INLINE V round_bf16(V v) { return round_to(v, at::kBFloat16); }
  static V round_fp16(V v) { return round_to(v, at::kHalf); }
  static HQT_INLINE float hsum(V v) { return v; }
};
#endif

// ---- the weight, as the reference dequantizes it ---------------------------------------------------------------
struct Weight {
  const uint8_t* w;  // [N, K] FP8 bytes
  int64_t N, K;
  const float* scale;  // 1 or N values
  bool per_channel, e4m3;
  at::ScalarType hp;
  const uint8_t* chunks = nullptr;  // bf16 path: the same bytes already in widen_chunk_shared's order (`fp8_pack`)
  float s(int64_t n) const { return per_channel ? scale[n] : scale[0]; }
};

// The last, partial vector of a row, zero past K.
__attribute__((noinline)) F32::V widen_tail(const uint8_t* p, int64_t n, bool e4m3) {
  alignas(64) uint8_t tail[64] = {0};
  std::memcpy(tail, p, n);
  return F32::widen(tail, e4m3);
}

// Widened values (v * 2^-8 for E4M3) times s * 2^8: the exact product v * s, rounded once to fp32, then to hp.
template <at::ScalarType HP>
HQT_INLINE F32::V scale_to(F32::V v, F32::V sv) {
  v = F32::mul(v, sv);
  if constexpr (HP == at::kBFloat16) return F32::round_bf16(v);
  else if constexpr (HP == at::kHalf) return F32::round_fp16(v);
  else return v;
}

// fp32 path: W fp32 values of w_q starting at row n, column k (bytes past K read as 0).
HQT_INLINE F32::V widen_f32(const Weight& wt, int64_t n, int64_t k, F32::V sv) {
  const uint8_t* p = wt.w + n * wt.K + k;
  const F32::V v = k + F32::W <= wt.K ? F32::widen(p, wt.e4m3) : widen_tail(p, wt.K - k, wt.e4m3);
  if (wt.hp == at::kBFloat16) return scale_to<at::kBFloat16>(v, sv);
  if (wt.hp == at::kHalf) return scale_to<at::kHalf>(v, sv);
  return scale_to<at::kFloat>(v, sv);
}

inline float widen_factor(const Weight& wt) { return wt.e4m3 ? 256.f : 1.f; }

// widen_f32 for one and for two full vectors, with the format and hp fixed at compile time (branch-free loops).
template <bool E4M3, at::ScalarType HP>
HQT_INLINE F32::V widen_full(const uint8_t* p, F32::V sv) { return scale_to<HP>(F32::widen(p, E4M3), sv); }

template <bool E4M3, at::ScalarType HP>
HQT_INLINE void widen_full2(const uint8_t* p, F32::V sv, F32::V& lo, F32::V& hi) {
  F32::widen2(p, E4M3, lo, hi);
  lo = scale_to<HP>(lo, sv);
  hi = scale_to<HP>(hi, sv);
}

#if HQT_BF16
// bf16 path: the high and low bytes of hp(v * s) for the 128 non-negative codes, for vpermi2b.
struct Widener {
  __m512i hi0, hi1, lo0, lo1, sign;
  Widener(bool e4m3, float s) {
    static const std::array<std::array<float, 128>, 2> values = [] {  // the 128 non-negative codes, E5M2 and E4M3
      std::array<std::array<float, 128>, 2> v{};
      for (int j = 0; j < 128; ++j) {
        v[0][j] = fp8_value(static_cast<uint8_t>(j), false);
        v[1][j] = j == 127 ? 0.f : fp8_value(static_cast<uint8_t>(j), true);  // 0x7f: E4M3's NaN, never a weight
      }
      return v;
    }();
    alignas(64) uint8_t hi[128], lo[128];
    for (int j = 0; j < 128; ++j) {
      const uint16_t b = c10::BFloat16(values[e4m3][j] * s).x;
      hi[j] = static_cast<uint8_t>(b >> 8);
      lo[j] = static_cast<uint8_t>(b);
    }
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  // 64 FP8 bytes -> two vectors of 32 bf16 (lane-interleaved order, see permuted_source).
  inline void widen64(const uint8_t* p, __m512bh& w0, __m512bh& w1) const { widen64(p, w0, w1, _mm512_loadu_si512(p)); }
  inline void widen64(const uint8_t*, __m512bh& w0, __m512bh& w1, __m512i b) const {
    __m512i h = _mm512_permutex2var_epi8(hi0, b, hi1);  // index bits 6..0; the sign bit is ignored
    __m512i l = _mm512_permutex2var_epi8(lo0, b, lo1);
    h = _mm512_ternarylogic_epi32(h, b, sign, 0xF8);    // h | (b & 0x80)
    w0 = (__m512bh)_mm512_unpacklo_epi8(l, h);
    w1 = (__m512bh)_mm512_unpackhi_epi8(l, h);
  }
  // Bytes [k, k + 64) of a row of length K, zero past K.
  inline void widen64_row(const uint8_t* row, int64_t k, int64_t K, __m512bh& w0, __m512bh& w1) const {
    if (k + 64 <= K) return widen64(row + k, w0, w1);
    alignas(64) uint8_t tail[64] = {0};
    std::memcpy(tail, row + k, K - k);
    widen64(tail, w0, w1);
  }
};

// Position j of widen64's output holds byte permuted_source(j) of the 64.
inline int64_t permuted_source(int64_t j) {
  const int64_t half = j / 32, i = j % 32;
  return 16 * (i / 8) + 8 * half + i % 8;
}

#endif

// ---- the input, in the compute layout ------------------------------------------------------------------------
// x [M, K] -> QDQ'd (static scale) -> [M, Kp] fp32 (fp32 path), bf16 in widen64's order (bf16 dot path) or bf16 A
// tiles in natural k order (AMX), zero past K.
// A normal power of two: x / s == x * (1 / s) bit for bit (1 / s is exact, both are x * 2^-e correctly rounded), and
// a multiply is several times cheaper than a divide (maxabs_pow2 and unit scales are powers of two).
inline bool power_of_two(float s) {
  uint32_t u;
  std::memcpy(&u, &s, sizeof(u));
  const uint32_t exponent = (u >> 23) & 0xFF;
  return (u & 0x7FFFFF) == 0 && exponent != 0 && exponent != 0xFF;
}

#if HQT_AVX512
// cast(clamp(v / s, -F, F)) to the FP8 grid, as a float (16 lanes; 8 on AVX2), exactly like c10's Float8
// conversions: |v| clamped to F, then rounded to the grid by one float addition and subtraction of c, a power of two
// 2^20 (E4M3; 2^21 for E5M2) times |v|'s binade (at least the smallest normal's): |v| + c has the FP8 step of |v|'s
// binade as its ulp (the subnormal step below the normal range), so the fp32 addition rounds to the nearest FP8
// value, ties to even, and the subtraction is exact. Then the sign. A NaN stays NaN, as torch's clamp and cast keep
// it: the vector min returns its second operand when one is NaN, so NaN lanes are put back after the rounding (one
// compare and one blend per vector; the byte of a NaN is 0x7F | sign, c10's). +-inf and huge values saturate to +-F.
// Bit for bit the integer rounding it replaced (mantissa add-and-mask, scaled rint of subnormals) for all 2^32 fp32
// values, both formats, AVX-512 and AVX2: 11 operations a vector where that took 19.
struct Fp8Rounder {
  __m512 sv, inv, Fv, min_normal, sub_up, lift;
  bool pow2;
  __m512i abs_mask, exp_mask;
  Fp8Rounder(float s, bool e4m3) {
    sv = _mm512_set1_ps(s);
    inv = _mm512_set1_ps(1.f / s);
    pow2 = power_of_two(s);
    Fv = _mm512_set1_ps(e4m3 ? 448.f : 57344.f);
    min_normal = _mm512_set1_ps(e4m3 ? 0.015625f : 6.103515625e-05f);  // 2^-6, 2^-14
    sub_up = _mm512_set1_ps(e4m3 ? 512.f : 65536.f);                     // 1 / the subnormal step
    lift = _mm512_set1_ps(e4m3 ? 1048576.f : 2097152.f);                 // 2^(23 - mantissa bits)
    abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    exp_mask = _mm512_set1_epi32(0x7F800000);
  }
  inline __m512 operator()(__m512 x) const {
    const __m512 d = pow2 ? _mm512_mul_ps(x, inv) : _mm512_div_ps(x, sv);
    const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(d), abs_mask)), Fv);
    const __m512 binade = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), exp_mask));
    const __m512 c = _mm512_mul_ps(_mm512_max_ps(binade, min_normal), lift);
    const __m512 r = _mm512_sub_ps(_mm512_add_ps(a, c), c);
    const __m512i q = _mm512_ternarylogic_epi32(_mm512_castps_si512(r), _mm512_castps_si512(d), abs_mask, 0xF4);  // r | (d & ~abs)
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(q), _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q), d);  // NaN stays NaN
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
    b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));  // NaN: 0x7F | sign
    b = _mm512_or_si512(b, _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80)));
    return _mm512_cvtepi32_epi8(b);
  }
  static void store_bits(uint8_t* p, __m128i b) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b); }
};
#elif HQT_AVX2
// The same rounding on 8 lanes (AVX2 has no mask registers: compares give lane masks, blends pick).
struct Fp8Rounder {
  __m256 sv, inv, Fv, min_normal, sub_up, lift;
  bool pow2;
  __m256i abs_mask, exp_mask;
  Fp8Rounder(float s, bool e4m3) {
    sv = _mm256_set1_ps(s);
    inv = _mm256_set1_ps(1.f / s);
    pow2 = power_of_two(s);
    Fv = _mm256_set1_ps(e4m3 ? 448.f : 57344.f);
    min_normal = _mm256_set1_ps(e4m3 ? 0.015625f : 6.103515625e-05f);
    sub_up = _mm256_set1_ps(e4m3 ? 512.f : 65536.f);
    lift = _mm256_set1_ps(e4m3 ? 1048576.f : 2097152.f);
    abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    exp_mask = _mm256_set1_epi32(0x7F800000);
  }
  inline __m256 operator()(__m256 x) const {
    const __m256 d = pow2 ? _mm256_mul_ps(x, inv) : _mm256_div_ps(x, sv);
    const __m256 abs = _mm256_castsi256_ps(abs_mask);
    const __m256 a = _mm256_min_ps(_mm256_and_ps(d, abs), Fv);
    const __m256 c = _mm256_mul_ps(_mm256_max_ps(_mm256_and_ps(a, _mm256_castsi256_ps(exp_mask)), min_normal), lift);
    const __m256 q = _mm256_or_ps(_mm256_sub_ps(_mm256_add_ps(a, c), c), _mm256_andnot_ps(abs, d));
    return _mm256_blendv_ps(q, d, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));  // NaN stays NaN
  }
  // The FP8 bytes of 8 values already on the grid, in the low 8 bytes.
  inline __m128i bits(__m256 q, bool e4m3) const {
    __m256i u = _mm256_castps_si256(q);
    __m256i au = _mm256_and_si256(u, abs_mask);
    __m256 a = _mm256_castsi256_ps(au);
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 120 : 112;
    __m256i normal = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(au, 23), _mm256_set1_epi32(bias)), mbits),
        _mm256_and_si256(_mm256_srli_epi32(au, 23 - mbits), _mm256_set1_epi32((1 << mbits) - 1)));
    __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, sub_up));
    __m256i b = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(_mm256_cmp_ps(a, min_normal, _CMP_LT_OQ)));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7F), _mm256_castps_si256(_mm256_cmp_ps(q, q, _CMP_UNORD_Q)));  // NaN
    b = _mm256_or_si256(b, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));  // 0..255: exact
    return _mm_packus_epi16(w, w);
  }
  static void store_bits(uint8_t* p, __m128i b) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), b); }
};
#endif

// x rounded to the FP8 grid with scale s and back, then to the high-precision dtype (the reference's
// dequantize(quantize(x, s), s, hp)); in place is fine.
void qdq_row(const float* x, int64_t n, float s, bool e4m3, at::ScalarType hp, float* out) {
  const float F = e4m3 ? 448.f : 57344.f;
  int64_t i = 0;
#if HQT_AVX512 || HQT_AVX2
  const Fp8Rounder round(s, e4m3);
  for (; i + F32::W <= n; i += F32::W) {
    F32::V d = F32::mul(round(F32::load(x + i)), round.sv);
    if (hp == at::kBFloat16) d = F32::round_bf16(d);
    else if (hp == at::kHalf) d = F32::round_fp16(d);
    F32::store(out + i, d);
  }
#endif
  for (; i < n; ++i) {
    float v = x[i] / s;
    v = v > F ? F : (v < -F ? -F : v);
    const float q = e4m3 ? static_cast<float>(c10::Float8_e4m3fn(v)) : static_cast<float>(c10::Float8_e5m2(v));
    out[i] = round_to(q * s, hp);
  }
}

#if HQT_AVX512 || HQT_AVX2
// One vector of fp32, bf16 (c10::BFloat16) or fp16 values as fp32 (exact: a shift for bf16, vcvtph2ps for fp16).
template <typename T>
HQT_INLINE F32::V load_as_float(const T* p) {
#if HQT_AVX512
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else if constexpr (std::is_same_v<T, c10::Half>) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
#else
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  else if constexpr (std::is_same_v<T, c10::Half>) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
#endif
}
#endif

// One row of FP8 bytes: cast(clamp(x / s, -F, F)), the reference's `quantize`.
template <typename T>
void quantize_row(const T* x, int64_t n, float s, bool e4m3, uint8_t* out) {
  const float F = e4m3 ? 448.f : 57344.f;
  int64_t i = 0;
#if HQT_AVX512 || HQT_AVX2
  const Fp8Rounder round(s, e4m3);
  for (; i + F32::W <= n; i += F32::W) Fp8Rounder::store_bits(out + i, round.bits(round(load_as_float(x + i)), e4m3));
#endif
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]) / s;
    v = v > F ? F : (v < -F ? -F : v);
    out[i] = e4m3 ? c10::Float8_e4m3fn(v).x : c10::Float8_e5m2(v).x;
  }
}

// Small tensors (scales, bias) read as float straight from their storage: no ATen op per call.
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

// n bf16 or fp16 values as floats (exact), a vector at a time.
template <typename T>
void floats_from(const T* p, int64_t n, float* out) {
  int64_t k = 0;
#if HQT_AVX512 || HQT_AVX2
  for (; k + F32::W <= n; k += F32::W) F32::store(out + k, load_as_float(p + k));
#endif
  for (; k < n; ++k) out[k] = static_cast<float>(p[k]);
}

// ---- the input rows ------------------------------------------------------------------------------------------
inline float hp_value(uint16_t b, bool bf16) {  // a bf16 or fp16 value's bits as float (exact)
  if (!bf16) return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// A gated MLP's row hp(act(g) * u) from the rows g and u (bf16 or fp16 bits): act(g) looked up in `act`, act's hp
// output for each of the 65536 bit patterns (65537 entries: the vector lookup reads 4 bytes), the product of two hp
// values exact in fp32 and rounded once to hp, as torch's `mul` rounds it.
void gated_row(const uint16_t* g, const uint16_t* u, const uint16_t* act, int64_t K, bool bf16, uint16_t* out) {
  int64_t k = 0;
#if HQT_AVX512
  const auto widen = [bf16](__m256i h) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
  };
  for (; k + 16 <= K; k += 16) {
    const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + k)));
    const __m256i a = _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(idx, act, 2));
    const __m512 p = _mm512_mul_ps(widen(a), widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + k))));
    const __m256i h = bf16 ? _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(F32::round_bf16(p)), 16))
                           : _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), h);
  }
#endif
  for (; k < K; ++k) {
    const float p = hp_value(act[g[k]], bf16) * hp_value(u[k], bf16);
    out[k] = bf16 ? c10::BFloat16(p).x : c10::Half(p).x;
  }
}

// Where the product's input rows come from: x ([M, K] in hp), or, for a gated MLP's down projection
// (`fp8_linear_gated`), hp(act(gate) * up) made a row at a time into the reader's buffer, never stored whole.
struct Rows {
  const void* x;  // the input, or the gate
  int64_t K;
  at::ScalarType hp;
  const uint16_t* up = nullptr;
  const uint16_t* act = nullptr;  // with `up`: the gated row's table (`gated_row`)

  Rows from(int64_t m) const {  // rows m, m + 1, ...
    return Rows{static_cast<const char*>(x) + m * K * (hp == at::kFloat ? 4 : 2), K, hp, up ? up + m * K : nullptr, act};
  }
  // A thread's buffer for the rows `bits` makes (none when it makes none).
  uint16_t* buffer() const { return act ? static_cast<uint16_t*>(scratch<6>(K * sizeof(uint16_t))) : nullptr; }
  // Row m's bf16 or fp16 bits: x's own, or the gated row made in `buf`.
  const uint16_t* bits(int64_t m, uint16_t* buf) const {
    const uint16_t* row = static_cast<const uint16_t*>(x) + m * K;
    if (!act) return row;
    gated_row(row, up + m * K, act, K, hp == at::kBFloat16, buf);
    return buf;
  }
};

// Row m as floats, QDQ'd when there is a static input scale.
void input_row(const Rows& r, int64_t m, const float* s_x, bool e4m3, float* out) {
  const int64_t K = r.K;
  if (r.hp == at::kFloat) {
    std::memcpy(out, static_cast<const float*>(r.x) + m * K, K * sizeof(float));
  } else {
    const uint16_t* row = r.bits(m, r.buffer());
    if (r.hp == at::kBFloat16) floats_from(reinterpret_cast<const c10::BFloat16*>(row), K, out);
    else floats_from(reinterpret_cast<const c10::Half*>(row), K, out);
  }
  if (s_x) qdq_row(out, K, *s_x, e4m3, r.hp, out);
}

#if HQT_BF16
// A bf16 row for the bf16 path: QDQ'd when there is a static input scale (the same rounding as qdq_row), zero past
// K (Kp, a multiple of 64). Its pieces of 32 values go `piece` values apart (32: one row; AMX tiles: 512).
void bf16_input_row(const uint16_t* x, int64_t K, int64_t Kp, const float* s_x, bool e4m3, uint16_t* out,
                    int64_t piece = 32) {
  const Fp8Rounder round(s_x ? *s_x : 1.f, e4m3);
  for (int64_t k = 0; k < Kp; k += 64) {
    const int64_t left = K - k;
    const __mmask32 m0 = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const __mmask32 m1 = left >= 64 ? ~__mmask32(0) : (left <= 32 ? 0 : (__mmask32(1) << (left - 32)) - 1);
    __m512i lo = _mm512_maskz_loadu_epi16(m0, x + k), hi = _mm512_maskz_loadu_epi16(m1, x + k + 32);
    if (s_x) {
      // 32 bf16 -> QDQ'd -> 32 bf16: widened by interleaving with zeros (values 0-3, 8-11, .. and 4-7, 12-15, ..),
      // converted back in one instruction, their groups of four put back in order by one permute
      const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
      auto qdq32 = [&](__m512i v) {
        const __m512 a = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), v));
        const __m512 b = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), v));
        const __m512bh q = _mm512_cvtne2ps_pbh(_mm512_mul_ps(round(b), round.sv), _mm512_mul_ps(round(a), round.sv));
        return _mm512_permutexvar_epi64(order, (__m512i)q);
      };
      lo = qdq32(lo);
      hi = qdq32(hi);
    }
    _mm512_storeu_si512(out + k / 32 * piece, lo);
    _mm512_storeu_si512(out + (k / 32 + 1) * piece, hi);
  }
}
#endif

// ---- the tile: MR input rows x NR weight rows, full K ---------------------------------------------------------
// Every output's accumulator sees the same operations in the same order in every tile shape and path.
struct Out {  // the epilogue: y = hp(hp(acc) + bias)
  void* y;
  int64_t N;
  at::ScalarType hp;
  const float* bias;
  inline void put(int64_t m, int64_t n, float acc) const {
    float v = round_to(acc, hp);
    if (bias) v = round_to(v + bias[n], hp);
    if (hp == at::kBFloat16) static_cast<c10::BFloat16*>(y)[m * N + n] = c10::BFloat16(v);
    else if (hp == at::kHalf) static_cast<c10::Half*>(y)[m * N + n] = c10::Half(v);
    else static_cast<float*>(y)[m * N + n] = v;
  }
  Out from_row(int64_t m) const {  // the same epilogue for rows m.. of y
    Out o = *this;
    o.y = static_cast<char*>(y) + m * N * (hp == at::kFloat ? 4 : 2);
    return o;
  }
};

#if HQT_AVX512
// The 16 accumulators of a 4 x 4 tile reduced together with the same halving tree as F32::hsum (lanes j + j+8,
// j + j+4, j + j+2, j + j+1, per accumulator), returned with lane 4 * m + r holding tile element (m, r).
HQT_INLINE __m512 hsum_4x4(const __m512 (&a)[4][4]) {
  __m512 s[8], t[4], u[2];
  HQT_UNROLL for (int i = 0; i < 8; ++i) {  // s_i: a[2i] level 1 in the low half, a[2i+1] in the high half
    const __m512 A = a[(2 * i) / 4][(2 * i) % 4], B = a[(2 * i + 1) / 4][(2 * i + 1) % 4];
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, 0x44), _mm512_shuffle_f32x4(A, B, 0xEE));
  }
  HQT_UNROLL for (int j = 0; j < 4; ++j)  // t_j: quarter c holds a[4j + c] level 2
    t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88), _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
  HQT_UNROLL for (int j = 0; j < 2; ++j) {  // level 3, 64-bit pairs
    const __m512d P = _mm512_castps_pd(t[2 * j]), Q = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(P, Q)), _mm512_castpd_ps(_mm512_unpackhi_pd(P, Q)));
  }
  const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  // lane 4c + e holds a[4e + c] = (m = e, r = c): transpose to 4m + r
  const __m512i to_rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(to_rows, v);
}

HQT_INLINE __m512 round_hp(__m512 v, at::ScalarType hp) {
#if HQT_BF16
  if (hp == at::kBFloat16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
  if (hp == at::kBFloat16) return F32::round_bf16(v);
#endif
  if (hp == at::kHalf) return F32::round_fp16(v);
  return v;
}

// A tile of up to 4 x 4 (missing accumulators are zeros, never stored): reduce, round, add the bias, round, store,
// all in one vector.
HQT_INLINE void store_4x4(const __m512 (&acc)[4][4], int64_t m0, int64_t n0, int mr, int nr, const Out& out) {
  __m512 v = round_hp(hsum_4x4(acc), out.hp);
  if (out.bias) {
    alignas(16) float b[4] = {0.f, 0.f, 0.f, 0.f};
    std::memcpy(b, out.bias + n0, nr * sizeof(float));
    v = round_hp(_mm512_add_ps(v, _mm512_broadcast_f32x4(_mm_load_ps(b))), out.hp);
  }
  if (out.hp == at::kFloat) {
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    for (int m = 0; m < mr; ++m) std::memcpy(static_cast<float*>(out.y) + (m0 + m) * out.N + n0, f + 4 * m, nr * sizeof(float));
    return;
  }
  // bf16: the top halves (already rounded); fp16: a rounding conversion of values already on the fp16 grid (exact)
  const __m256i h = out.hp == at::kBFloat16
                        ? _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16))
                        : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  alignas(32) uint16_t f[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(f), h);
  for (int m = 0; m < mr; ++m) std::memcpy(static_cast<uint16_t*>(out.y) + (m0 + m) * out.N + n0, f + 4 * m, nr * sizeof(uint16_t));
}
#endif

// Reduced first, stored after: no call may see `acc`, so the compiler keeps it in registers.
template <int MR, int NR, class V>
HQT_INLINE void store_tile(const V (&acc)[MR][NR], int64_t m0, int64_t n0, const Out& out) {
#if HQT_AVX512
  HQT_UNROLL for (int b = 0; b < MR; b += 4)      // 4 x 4 blocks
    HQT_UNROLL for (int c = 0; c < NR; c += 4) {
      __m512 full[4][4];
      HQT_UNROLL for (int m = 0; m < 4; ++m)
        HQT_UNROLL for (int r = 0; r < 4; ++r)
          full[m][r] = (b + m < MR && c + r < NR) ? acc[b + m < MR ? b + m : 0][c + r < NR ? c + r : 0] : _mm512_setzero_ps();
      store_4x4(full, m0 + b, n0 + c, MR - b < 4 ? MR - b : 4, NR - c < 4 ? NR - c : 4, out);
    }
#else
  float res[MR][NR];
  HQT_UNROLL for (int m = 0; m < MR; ++m)
    HQT_UNROLL for (int r = 0; r < NR; ++r) res[m][r] = F32::hsum(acc[m][r]);
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) out.put(m0 + m, n0 + r, res[m][r]);
#endif
}

// fp32 path. Weights come from `src(r, k)` for k < Kfull and from `tail(r, k)` after: widened in registers (the
// last, partial vector of a row by `tail`; decode-sized tiles take two vectors at a time from `pair`) or loaded
// from a widened panel.
template <int MR, int NR, class Src, class Tail, class Pair = std::nullptr_t>
HQT_INLINE void tile_f32(const float* x, int64_t Kp, int64_t Kfull, int64_t m0, int64_t n0, const Src& src,
                         const Tail& tail, const Out& out, const Pair& pair = nullptr) {
  F32::V acc[MR][NR];
  HQT_UNROLL for (int m = 0; m < MR; ++m)
    HQT_UNROLL for (int r = 0; r < NR; ++r) acc[m][r] = F32::zero();
  auto step = [&](int64_t k, const auto& src) HQT_INLINE_LAMBDA {
    if constexpr (MR <= 2) {  // few input rows (decode): each weight vector widened and used at once
      F32::V xv[MR];
      HQT_UNROLL for (int m = 0; m < MR; ++m) xv[m] = F32::load(x + (m0 + m) * Kp + k);
      HQT_UNROLL for (int r = 0; r < NR; ++r) {
        const F32::V w = src(r, k);
        HQT_UNROLL for (int m = 0; m < MR; ++m) acc[m][r] = F32::fma(xv[m], w, acc[m][r]);
      }
    } else {  // the same operations per accumulator, weights loaded first
      F32::V w[NR];
      HQT_UNROLL for (int r = 0; r < NR; ++r) w[r] = src(r, k);
      HQT_UNROLL for (int m = 0; m < MR; ++m) {
        const F32::V xv = F32::load(x + (m0 + m) * Kp + k);
        HQT_UNROLL for (int r = 0; r < NR; ++r) acc[m][r] = F32::fma(xv, w[r], acc[m][r]);
      }
    }
  };
  int64_t k = 0;
  if constexpr (MR <= 2 && !std::is_same_v<Pair, std::nullptr_t>) {  // two vectors of a row widened at once
    for (; k + 2 * F32::W <= Kfull; k += 2 * F32::W) {
      F32::V xv[MR][2];
      HQT_UNROLL for (int m = 0; m < MR; ++m) {
        xv[m][0] = F32::load(x + (m0 + m) * Kp + k);
        xv[m][1] = F32::load(x + (m0 + m) * Kp + k + F32::W);
      }
      HQT_UNROLL for (int r = 0; r < NR; ++r) {
        F32::V w0, w1;
        pair(r, k, w0, w1);
        HQT_UNROLL for (int m = 0; m < MR; ++m) acc[m][r] = F32::fma(xv[m][1], w1, F32::fma(xv[m][0], w0, acc[m][r]));
      }
    }
  }
  for (; k < Kfull; k += F32::W) step(k, src);
  for (; k < Kp; k += F32::W) step(k, tail);
  store_tile<MR, NR>(acc, m0, n0, out);
}

// Runs `tile<mr, nr>` for a block of up to MR x NR with the remainder shapes instantiated.
template <int MR, int NR, class Tile>
inline void dispatch(int64_t mr, int64_t nr, const Tile& tile) {
  if constexpr (MR > 1) {
    if (mr < MR) return dispatch<MR - 1, NR>(mr, nr, tile);
  }
  if constexpr (NR > 1) {
    if (nr < NR) return dispatch<MR, NR - 1>(mr, nr, tile);
  }
  tile(std::integral_constant<int, MR>{}, std::integral_constant<int, NR>{});
}

// Tile shapes: kMR x kNR in general; one input row takes kNR1 weight rows, enough independent accumulators to hide
// the latency of the multiply-add chains.
#if HQT_AVX512
constexpr int kMR = 4, kNR = 4, kNR1 = 4;
#else
constexpr int kMR = 4, kNR = 3, kNR1 = 6;  // 16 ymm registers: 12 accumulators, 3 weights, 1 input
#endif

constexpr int64_t kRegisterMaxM = HQT_REG_MAX_M;

// ---- the product over a range of output rows (one thread's share) --------------------------------------------
struct Problem {
  Weight wt;
  const void* x;  // [M, Kp] float or bf16
  int64_t M, Kp;
  bool bf16;
  Out out;
  const uint32_t* bw = nullptr;  // bf16 weights already in pair-major blocks (`bf16_pack`), instead of wt's FP8 bytes
  const float* xf = nullptr;     // the FMA panels' input: x's tiles in fp32 (`bf16_tiles`)
  const float* oscale = nullptr;  // per-row powers of two applied to the sums, wt's scale being 1 (`scales_commute`)
};

// Whether per-row weight scales may multiply each row's sum instead of its weights, with the same bits: every scale a
// power of two, the input static W8A8 (x_q = hp(v * s_x), v an FP8 code), and fp32's normal range never left. Then
// x_q[k] * hp(v * s) = (x_q[k] * v) * s exactly, and each rounded sum of the row's products scales by s exactly, as
// long as no partial sum is subnormal (flushed or rounded otherwise) or overflows, with s or without it. Every nonzero
// partial sum is a multiple of g = ulp(2^e * c_min) * c_min (x_q >= 2^e * c_min, e = floor(log2 s_x), c_min the
// smallest FP8 code; sums of multiples of a power of two stay multiples of it), so |sum| >= g; and |sum| <= K *
// 2 * c_max * s_x * c_max (the input clamped to +-c_max, rounded up at most once); none of this depends on the order
// of the sums, so it holds for vdpbf16ps and AMX tiles alike. The bf16 and AMX paths use it at decode-sized M, where a
// table per row costs the most (per-channel weights 0.46-0.67x per-tensor at M = 1, hot): one shared table of the
// codes times 1, one multiply per 16 outputs (AMX, cold, 2-core Xeon: 1.14-1.67x faster at M = 1-32 on SmolLM2 shapes
// and 4096^2). The panels keep their tables: the same bits.
bool scales_commute(const std::vector<float>& sc, bool e4m3, bool has_sx, float s_x, int64_t K) {
  if (!has_sx || !(s_x > 0.f) || !std::isfinite(s_x) || !std::isnormal(s_x)) return false;
  const int c_min = e4m3 ? -9 : -16, c_max = e4m3 ? 9 : 16;  // log2: smallest subnormal code, above the largest code
  int e_min = 1000, e_max = -1000;
  for (float s : sc) {
    uint32_t bits;
    std::memcpy(&bits, &s, 4);
    if (!(s > 0.f) || !std::isnormal(s) || (bits & 0x7FFFFF) != 0) return false;
    const int e = static_cast<int>(bits >> 23) - 127;
    e_min = std::min(e_min, e), e_max = std::max(e_max, e);
  }
  const int e = std::ilogb(s_x), g = e + c_min - 8 + c_min;  // ulp of a bf16 >= 2^(e + c_min): 2^(e + c_min - 7)
  int log_k = 0;
  while ((int64_t(1) << log_k) < K) ++log_k;
  const bool normal = g + std::min(0, e_min) >= -126;                           // every nonzero sum, scaled or not
  const bool finite = log_k + 1 + (e + 1) + 2 * c_max + std::max(0, e_max) <= 126;  // every sum, scaled or not
  const bool table = c_min + e_min >= -126 && c_max + e_max <= 127;              // hp(v * s) = v * s, every code
  return normal && finite && table;
}

// Calls f(e4m3, hp) with the weight's FP8 format and hp as compile-time constants.
template <class F>
inline void with_format(const Weight& wt, const F& f) {
  auto run = [&](auto e4m3) {
    switch (wt.hp) {
      case at::kBFloat16: return f(e4m3, std::integral_constant<at::ScalarType, at::kBFloat16>{});
      case at::kHalf: return f(e4m3, std::integral_constant<at::ScalarType, at::kHalf>{});
      default: return f(e4m3, std::integral_constant<at::ScalarType, at::kFloat>{});
    }
  };
  wt.e4m3 ? run(std::true_type{}) : run(std::false_type{});
}

// Row n of w_q into out[0, Kp) (zero past K).
template <bool E4M3, at::ScalarType HP>
void widen_row(const Weight& wt, int64_t n, int64_t Kp, float* out) {
  const F32::V sv = F32::set1(wt.s(n) * widen_factor(wt));
  const uint8_t* row = wt.w + n * wt.K;
  const int64_t Kfull = wt.K / F32::W * F32::W;
  int64_t k = 0;
  for (; k + 2 * F32::W <= Kfull; k += 2 * F32::W) {
    F32::V lo, hi;
    widen_full2<E4M3, HP>(row + k, sv, lo, hi);
    F32::store(out + k, lo);
    F32::store(out + k + F32::W, hi);
  }
  for (; k < Kfull; k += F32::W) F32::store(out + k, widen_full<E4M3, HP>(row + k, sv));
  for (; k < Kp; k += F32::W) F32::store(out + k, widen_f32(wt, n, k, sv));
}

// Decode-sized M (at most kRegisterMaxM rows): weights widened in registers, each group of NR rows once. The FP8
// format and hp are template parameters, so the widening of full vectors is branch-free.
template <int NR, bool E4M3, at::ScalarType HP>
void rows_in_registers(const Problem& p, int64_t n0, int64_t n1) {
  const Weight& wt = p.wt;
  const float* x = static_cast<const float*>(p.x);
  const int64_t K = wt.K, Kfull = K / F32::W * F32::W;
  const F32::V s0 = F32::set1(wt.s(0) * widen_factor(wt));  // per-tensor: one scale register for every row
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    const uint8_t* rows = wt.w + n * K;
    // the next group's bytes (contiguous after these rows) requested now: short rows end before a stream
    // prefetcher has caught on, so cold weights would otherwise arrive one miss at a time
    for (int64_t b = nr * K; b < std::min<int64_t>(2 * NR, n1 - n) * K; b += 64) __builtin_prefetch(rows + b, 0, 3);
    F32::V sv[NR];
    for (int64_t r = 0; r < nr; ++r) sv[r] = F32::set1(wt.s(n + r) * widen_factor(wt));
    dispatch<kRegisterMaxM, NR>(p.M, nr, [&](auto MR, auto R) {
      constexpr int mr = decltype(MR)::value, rr = decltype(R)::value;
      auto tail = [&](int r, int64_t k) { return widen_f32(wt, n + r, k, sv[r]); };
      auto run = [&](const auto& scale) {  // scale(r): the row's scale register
        auto full = [&](int r, int64_t k) { return widen_full<E4M3, HP>(rows + r * K + k, scale(r)); };
        auto pair = [&](int r, int64_t k, F32::V& lo, F32::V& hi) { widen_full2<E4M3, HP>(rows + r * K + k, scale(r), lo, hi); };
        tile_f32<mr, rr>(x, p.Kp, Kfull, 0, n, full, tail, p.out, pair);
      };
      wt.per_channel ? run([&](int r) { return sv[r]; }) : run([&](int) { return s0; });
    });
  }
}

template <int NR>
void rows_in_registers(const Problem& p, int64_t n0, int64_t n1) {
  with_format(p.wt, [&](auto e4m3, auto hp) {
    rows_in_registers<NR, decltype(e4m3)::value, decltype(hp)::value>(p, n0, n1);
  });
}

// Larger M: a panel of rows widened once into `buf`, then every input row swept over it.
void rows_from_panels(const Problem& p, int64_t n0, int64_t n1) {
  const Weight& wt = p.wt;
  const int64_t elem = 4;
  const int64_t panel = std::max<int64_t>(kNR, panel_bytes(p.Kp) / (elem * p.Kp) / kNR * kNR);
  std::vector<uint8_t> storage(std::min(panel, n1 - n0) * p.Kp * elem + 64);
  void* buf = storage.data();
  for (int64_t nb = n0; nb < n1; nb += panel) {
    const int64_t ne = std::min(n1, nb + panel);
    float* wb = static_cast<float*>(buf);
    with_format(wt, [&](auto e4m3, auto hp) {
      for (int64_t n = nb; n < ne; ++n) widen_row<decltype(e4m3)::value, decltype(hp)::value>(wt, n, p.Kp, wb + (n - nb) * p.Kp);
    });
    const float* x = static_cast<const float*>(p.x);
    for (int64_t m = 0; m < p.M; m += kMR)
      for (int64_t n = nb; n < ne; n += kNR)
        dispatch<kMR, kNR>(std::min<int64_t>(kMR, p.M - m), std::min<int64_t>(kNR, ne - n), [&](auto MR, auto NR) {
          const float* rows = wb + (n - nb) * p.Kp;
          auto src = [&](int r, int64_t k) { return F32::load(rows + r * p.Kp + k); };
          tile_f32<decltype(MR)::value, decltype(NR)::value>(x, p.Kp, p.Kp, m, n, src, src, p.out);
        });
  }
}

#if HQT_AVX2
// ---- the AVX2 fp32 path: outer products over a packed weight -------------------------------------------------
// Each output (m, n) owns one fp32 lane and adds its products k after k in ascending k, one FMA each: the order of
// the scalar build (one lane), so AVX2 and scalar outputs are bit-identical. The weight is read packed (`fp8_pack`,
// made once per layer when the backend is set): groups of 8 rows, column after column, so 16 contiguous bytes
// widen into columns k and k + 1 of 8 rows and the input value x[m, k] is broadcast. Decode-sized M widens each
// pair of columns and uses it at once (each group one contiguous stream); larger M widen a panel (rows x a block of
// columns) once per thread into L2 and sweep tiles of 6 input rows over it, 16 rows at a time, the sums waiting in
// fp32 (exactly) between column blocks.
constexpr int kGroup = F32::W;  // weight rows per vector, per packed group
constexpr int kPanelMR = 6, kPanelNG = 2;  // panel tile: 6 input rows x 2 groups (12 accumulators, 2 weights, 1 input)
// Decode tiles: M = 2 reads 2 packed groups side by side (4 sums per column); M = 1 reads as many as its group type
// says (`Group::kDecode`, `Group::kDecodeLong` for rows of 4096 or more): more groups keep more streams of cold weight
// bytes in flight.
constexpr int kColumnGroups = 2;
#ifndef HQT_INPUT_CHUNK
#define HQT_INPUT_CHUNK (2 << 20)
#endif
constexpr int64_t kInputChunkBytes = HQT_INPUT_CHUNK;  // larger inputs are taken in chunks of rows (`run_columns`)

// [N, K] -> [ceil(N / 8), K, 8], rows past N zero (FP8 bytes, or bf16 for high-precision weights).
at::Tensor pack_rows(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), G = (N + kGroup - 1) / kGroup;
  return at::constant_pad_nd(w, {0, 0, 0, G * kGroup - N}).view({G, kGroup, K}).transpose(1, 2).contiguous();
}

// The scale register of group g (rows past N: 0): s_i * widen_factor in lane i.
inline F32::V group_scale(const Weight& wt, int64_t g) {
  alignas(32) float s[kGroup];
  for (int i = 0; i < kGroup; ++i) {
    const int64_t n = g * kGroup + i;
    s[i] = (n < wt.N ? wt.s(n) : 0.f) * widen_factor(wt);
  }
  return F32::load(s);
}

// Columns k and k + 1 of a group (16 packed bytes) as w_q.
template <bool E4M3, at::ScalarType HP>
HQT_INLINE void widen_pair(const uint8_t* p, F32::V sv, F32::V& a, F32::V& b) {
  F32::widen2(p, E4M3, a, b);
  a = scale_to<HP>(a, sv);
  b = scale_to<HP>(b, sv);
}

// A packed group as a source of columns: `pair(k, a, b)` columns k and k + 1, `one(k)` column k, as fp32 vectors.
template <bool E4M3, at::ScalarType HP>
struct Fp8Group {  // w_q = hp(W * s) of FP8 bytes
  // M = 1, measured on the AVX2 EPYC: a SmolLM2 token's 210 calls 9.97 -> 9.25 ms with 6 groups instead of 4 (no
  // gain past 6), a 4096^2 call 0.88 -> 0.85 ms with 8
  static constexpr int kDecode = 6, kDecodeLong = 8;
  const uint8_t* p;
  F32::V sv;
  Fp8Group(const Weight& wt, const void* packed, int64_t g)
      : p(static_cast<const uint8_t*>(packed) + g * wt.K * kGroup), sv(group_scale(wt, g)) {}
  HQT_INLINE void pair(int64_t k, F32::V& a, F32::V& b) const { widen_pair<E4M3, HP>(p + k * kGroup, sv, a, b); }
  HQT_INLINE F32::V one(int64_t k) const { return scale_to<HP>(F32::widen(p + k * kGroup, E4M3), sv); }
};

struct Bf16Group {  // bf16 values, exact in fp32
  // M = 1: SmolLM2's lm_head (49152 x 576) 1.92 -> 1.69 / 1.55 / 1.37 ms with 6 / 8 / 12 groups instead of 4
  static constexpr int kDecode = 12, kDecodeLong = 12;
  const uint16_t* p;
  Bf16Group(const Weight& wt, const void* packed, int64_t g) : p(static_cast<const uint16_t*>(packed) + g * wt.K * kGroup) {}
  HQT_INLINE F32::V one(int64_t k) const { return load_as_float(reinterpret_cast<const c10::BFloat16*>(p + k * kGroup)); }
  HQT_INLINE void pair(int64_t k, F32::V& a, F32::V& b) const { a = one(k), b = one(k + 1); }
};

// Calls f(static_cast<Group*>(nullptr)) with the FP8 group type of the weight's format and hp.
template <class F>
inline void with_fp8_group(const Weight& wt, const F& f) {
  with_format(wt, [&](auto e4m3, auto hp) { f(static_cast<Fp8Group<decltype(e4m3)::value, decltype(hp)::value>*>(nullptr)); });
}

HQT_INLINE F32::V round_hp(F32::V v, at::ScalarType hp) {
  if (hp == at::kBFloat16) return F32::round_bf16(v);
  if (hp == at::kHalf) return F32::round_fp16(v);
  return v;
}

// The epilogue of 8 outputs (Out::put's operations, in lanes): y = hp(hp(acc) + bias); `nr` of them stored.
// `out.bias` holds 8 readable values past N (zeros).
HQT_INLINE void store8(F32::V acc, int64_t m, int64_t n, int64_t nr, const Out& out) {
  F32::V v = round_hp(acc, out.hp);
  if (out.bias) v = round_hp(_mm256_add_ps(v, F32::load(out.bias + n)), out.hp);
  const int64_t at = m * out.N + n;
  if (out.hp == at::kFloat) {
    if (nr >= kGroup) return F32::store(static_cast<float*>(out.y) + at, v);
    alignas(32) float f[kGroup];
    F32::store(f, v);
    std::memcpy(static_cast<float*>(out.y) + at, f, nr * sizeof(float));
    return;
  }
  // bf16: the top halves (already rounded); fp16: a rounding conversion of values already on the fp16 grid (exact)
  __m128i h;
  if (out.hp == at::kBFloat16) {
    const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  } else {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
  }
  uint16_t* y = static_cast<uint16_t*>(out.y) + at;
  if (nr >= kGroup) return _mm_storeu_si128(reinterpret_cast<__m128i*>(y), h);
  alignas(16) uint16_t f[kGroup];
  _mm_store_si128(reinterpret_cast<__m128i*>(f), h);
  std::memcpy(y, f, nr * sizeof(uint16_t));
}

template <int MR, int G>
HQT_INLINE void store_groups(const F32::V (&acc)[MR][G], int64_t m0, int64_t n, int64_t nr, const Out& out) {
  HQT_UNROLL for (int m = 0; m < MR; ++m)
    HQT_UNROLL for (int g = 0; g < G; ++g)
      if (nr > g * kGroup) store8(acc[m][g], m0 + m, n + g * kGroup, nr - g * kGroup, out);
}

// Decode-sized M: MR input rows x G groups from group g0 (rows [8 g0, 8 g0 + nr)), each pair of columns widened and
// used at once.
template <int MR, int G, class Group>
HQT_INLINE void columns_tile(const Problem& p, const void* packed, int64_t g0, int64_t nr) {
  const float* x = static_cast<const float*>(p.x);
  const int64_t K = p.wt.K;
  const auto src = [&]<size_t... I>(std::index_sequence<I...>) {
    return std::array<Group, G>{Group(p.wt, packed, g0 + static_cast<int64_t>(I))...};
  }(std::make_index_sequence<G>{});
  F32::V acc[MR][G];
  HQT_UNROLL for (int m = 0; m < MR; ++m)
    HQT_UNROLL for (int g = 0; g < G; ++g) acc[m][g] = F32::zero();
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    HQT_UNROLL for (int g = 0; g < G; ++g) {
      F32::V a, b;
      src[g].pair(k, a, b);
      HQT_UNROLL for (int m = 0; m < MR; ++m)
        acc[m][g] = F32::fma(F32::set1(x[m * p.Kp + k + 1]), b, F32::fma(F32::set1(x[m * p.Kp + k]), a, acc[m][g]));
    }
  }
  if (k < K) {  // odd K: the last column
    HQT_UNROLL for (int g = 0; g < G; ++g) {
      const F32::V a = src[g].one(k);
      HQT_UNROLL for (int m = 0; m < MR; ++m) acc[m][g] = F32::fma(F32::set1(x[m * p.Kp + k]), a, acc[m][g]);
    }
  }
  store_groups<MR, G>(acc, 0, g0 * kGroup, nr, p.out);
}

// Row blocks of the weight, handed out one at a time to whichever thread asks next: a thread slowed by other work on
// its core (a server's HTTP loop, another process) takes fewer blocks instead of holding the others up, as a static
// split would. Blocks are near-equal runs of `unit` rows. Which thread computes an output does not change how.
class Blocks {
 public:
  Blocks(int64_t N, int64_t unit, int64_t count, int64_t rounds = 1)
      : N_(N), unit_(unit), units_((N + unit - 1) / unit), count_(std::clamp<int64_t>(count, 1, units_)), rounds_(rounds) {}
  int64_t count() const { return count_; }
  int64_t max_rows() const { return (units_ + count_ - 1) / count_ * unit_; }
  bool take(int64_t& n0, int64_t& n1) {
    int64_t round;
    return take(round, n0, n1);
  }
  // With `rounds` > 1 the blocks are handed out `rounds` times, one pass after the other: `round` says which pass.
  bool take(int64_t& round, int64_t& n0, int64_t& n1) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= count_ * rounds_) return false;
    const int64_t b = i % count_;
    round = i / count_;
    n0 = b * units_ / count_ * unit_;
    n1 = std::min(N_, (b + 1) * units_ / count_ * unit_);
    return true;
  }

 private:
  const int64_t N_, unit_, units_, count_, rounds_;
  std::atomic<int64_t> next_{0};
};

template <int G, class Group>
void columns_rows(const Problem& p, const void* packed, Blocks& blocks) {
  constexpr int64_t rows = G * kGroup;
  for (int64_t n0, n1; blocks.take(n0, n1);)
    for (int64_t n = n0; n < n1; n += rows) {
      const int64_t nr = std::min(rows, n1 - n);
      dispatch<kRegisterMaxM, G>(p.M, (nr + kGroup - 1) / kGroup, [&](auto MR, auto NG) {
        columns_tile<decltype(MR)::value, decltype(NG)::value, Group>(p, packed, n / kGroup, nr);
      });
    }
}

// Larger M: MR input rows x G groups over columns [kb, kb + kc) of a widened panel (`w`: column after column, 8 rows
// each; groups `gstride` floats apart). Sums of column blocks before the last wait in `partial` (row stride `ldp`).
template <int MR, int G>
HQT_INLINE void panel_tile(const Problem& p, int64_t m0, int64_t n, int64_t nr, const float* w, int64_t gstride,
                           int64_t kb, int64_t kc, float* partial, int64_t ldp) {
  const float* x = static_cast<const float*>(p.x) + m0 * p.Kp + kb;
  F32::V acc[MR][G];
  HQT_UNROLL for (int m = 0; m < MR; ++m)
    HQT_UNROLL for (int g = 0; g < G; ++g) acc[m][g] = kb == 0 ? F32::zero() : F32::load(partial + m * ldp + g * kGroup);
  for (int64_t t = 0; t < kc; ++t, w += kGroup) {
    F32::V wv[G];
    HQT_UNROLL for (int g = 0; g < G; ++g) wv[g] = F32::load(w + g * gstride);
    HQT_UNROLL for (int m = 0; m < MR; ++m) {
      const F32::V xb = F32::set1(x[m * p.Kp + t]);
      HQT_UNROLL for (int g = 0; g < G; ++g) acc[m][g] = F32::fma(xb, wv[g], acc[m][g]);
    }
  }
  if (kb + kc < p.wt.K) {
    HQT_UNROLL for (int m = 0; m < MR; ++m)
      HQT_UNROLL for (int g = 0; g < G; ++g) F32::store(partial + m * ldp + g * kGroup, acc[m][g]);
    return;
  }
  store_groups<MR, G>(acc, m0, n, nr, p.out);
}

// Larger M: each item of `blocks` is a block of weight rows for one chunk of input rows; its rows are widened into a
// panel and the chunk's rows swept over it in tiles.
template <class Group>
void columns_panels(const Problem& full, const void* packed, Blocks& blocks, int64_t chunk, int64_t kc_max) {
  const Weight& wt = full.wt;
  const int64_t K = wt.K, unit = kPanelNG * kGroup, rows = blocks.max_rows();
  std::unique_ptr<float, decltype(&std::free)> panel(
      static_cast<float*>(std::aligned_alloc(64, rows * kc_max * sizeof(float))), &std::free);
  std::unique_ptr<float[]> partial(kc_max < K ? new float[std::min(chunk, full.M) * rows] : nullptr);
  for (int64_t c, nb, ne; blocks.take(c, nb, ne);) {
    Problem p = full;  // this chunk's input rows
    const int64_t m0 = c * chunk;
    p.x = static_cast<const float*>(full.x) + m0 * full.Kp;
    p.M = std::min(chunk, full.M - m0);
    p.out = full.out.from_row(m0);
    for (int64_t kb = 0; kb < K; kb += kc_max) {
      const int64_t kc = std::min(kc_max, K - kb), gstride = kc * kGroup;
      for (int64_t n = nb; n < ne; n += kGroup) {  // widen the block, group after group
        const Group src(wt, packed, n / kGroup);
        float* dst = panel.get() + (n - nb) / kGroup * gstride;
        int64_t t = 0;
        for (; t + 2 <= kc; t += 2) {
          F32::V a, b;
          src.pair(kb + t, a, b);
          F32::store(dst + t * kGroup, a);
          F32::store(dst + (t + 1) * kGroup, b);
        }
        if (t < kc) F32::store(dst + t * kGroup, src.one(kb + t));
      }
      for (int64_t m = 0; m < p.M; m += kPanelMR)
        for (int64_t n = nb; n < ne; n += unit) {
          const int64_t nr = std::min(unit, ne - n);
          dispatch<kPanelMR, kPanelNG>(std::min<int64_t>(kPanelMR, p.M - m), (nr + kGroup - 1) / kGroup, [&](auto MR, auto NG) {
            panel_tile<decltype(MR)::value, decltype(NG)::value>(p, m, n, nr, panel.get() + (n - nb) / kGroup * gstride,
                                                                 gstride, kb, kc, partial.get() + m * rows + (n - nb), rows);
          });
        }
    }
  }
}

// The AVX2 fp32 path over all rows, in parallel: each thread takes row blocks (`Blocks`) until none is left; 8 blocks
// per thread (2 for inputs larger than a panel), fewer threads for small decode layers. Larger M: a block's widened
// panel (rows x a column block of ~512 for rows longer than 2048, all of a shorter row) fits the panel budget in L2.
// A large input is taken in chunks of rows so that each block of weight rows sweeps a chunk that stays in cache, not
// the whole input from memory; each chunk reads and widens the weight again, so a chunk's input is at least
// kInputChunkBytes and at least the weight's bytes. Chunks are passes of the same blocks, handed out chunk after
// chunk in one parallel region: no thread waits for the others at the end of a chunk (a thread that lost its core
// for a moment held every chunk up when each was a parallel region of its own). A row's operations do not depend on
// its chunk.
template <class Group>
void run_columns(const Problem& p, const void* packed) {
  const int64_t N = p.wt.N, K = p.wt.K, threads = at::get_num_threads();
  if (p.M <= kRegisterMaxM) {
    const bool long_rows = K >= 4096;
    const int64_t tile = (p.M > 1 ? kColumnGroups : long_rows ? Group::kDecodeLong : Group::kDecode) * kGroup;
    const int64_t team = std::clamp<int64_t>((N + 127) / 128, 1, threads);  // up to 128 rows need no second thread
    Blocks blocks(N, tile, 8 * team);
    at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
      if (p.M > 1) columns_rows<kColumnGroups, Group>(p, packed, blocks);
      else if (long_rows) columns_rows<Group::kDecodeLong, Group>(p, packed, blocks);
      else columns_rows<Group::kDecode, Group>(p, packed, blocks);
    });
    return;
  }
  const int64_t chunk_rows = std::max<int64_t>(64, std::max(kInputChunkBytes, N * K) / (4 * p.Kp));
  const int64_t chunk = p.M > 2 * chunk_rows ? chunk_rows : p.M, rounds = (p.M + chunk - 1) / chunk;
  const int64_t splits = K <= 2048 ? 1 : (K + 511) / 512;  // column blocks
  const int64_t kc_max = ((K + splits - 1) / splits + 1) / 2 * 2, unit = kPanelNG * kGroup;
  const int64_t fit = std::max<int64_t>(1, panel_bytes(K) / 2 / (4 * kc_max) / unit);  // units a panel holds
  const int64_t units = (N + unit - 1) / unit;
  // each block sweeps its chunk: a chunk that stays in cache allows many small blocks (balance when a thread is
  // slowed), a larger one is read again per block, so blocks stay as large as the panel holds (2 per thread)
  const int64_t per_thread = chunk * p.Kp * 4 <= panel_bytes(K) ? 8 : 2;
  Blocks blocks(N, unit, std::max((units + fit - 1) / fit, per_thread * threads), rounds);
  at::parallel_for(0, std::min(threads, blocks.count() * rounds), 1, [&](int64_t, int64_t) {
    columns_panels<Group>(p, packed, blocks, chunk, kc_max);
  });
}
#endif

#if HQT_BF16
// ---- the bf16 path: outer products, one output per vector lane ------------------------------------------------
// Each output (m, n) owns one fp32 lane and adds its input/weight pairs of k with one vdpbf16ps lane each, pair after
// pair in widen64's order (chunk by chunk of 64, pairs 0..31 of each chunk); nothing is reduced across lanes. The
// weights of 16 rows are widened and transposed into pair vectors (pair t of the 16 rows, one 32-bit lane per row),
// the input pair is broadcast. Every M uses this one order: decode widens a chunk of 16 or 32 rows at a time and
// uses it at once (up to three input tiles of a small layer: tile after tile), larger M widen a panel of rows once and
// sweep every input row over it.
constexpr int kBlock = 16;               // weight rows per pair vector
#ifndef HQT_OUTER_MR
#define HQT_OUTER_MR 12
#endif
constexpr int kOuterMR = HQT_OUTER_MR;   // panel tile: 12 input rows x 2 blocks (24 accumulators, 2 weights, 1 input)
// Up to one input tile of rows, each chunk is widened in registers and used at once rather than stored in a panel:
// measured on a 2-core AVX512-BF16 EPYC (Zen 4), cold, bf16 inputs, against panels: a SmolLM2 token's 210 calls
// 18.0 -> 11.0 ms at M = 8 and 23.9 -> 15.3 ms at M = 12 (per-channel scales, M = 8: 23.1 -> 20.3 ms), 4096^2
// 0.96 -> 0.85 ms at M = 3 and 1.52 -> 1.36 ms at M = 12; M = 1-2 are unchanged
constexpr int64_t kOuterDecodeMaxM = kOuterMR;
// Up to three tiles (M <= 36) of FP8 weights with one scale, where a thread's share of the bytes fits half an L2, the
// register path runs tile after tile (the bytes read again from L2; tiles of kOuterMR rows, or wide ones: see
// wide_rows) instead of panels. Measured there, cold, against panels: a SmolLM2 token's 210 calls at M = 16 / 24 /
// 32 25.7 / 27.7 / 30.4 -> 22.2 / 22.6 / 26.7 ms (bf16 `F.linear` 26.0 / 29.4 / 37.4); not where it is slower:
// per-channel scales (M = 24: 27.3 -> 31.1 ms, a table per row and tile), bf16 weights (the `lm_head`, read from
// memory per tile), 4096^2 (8 MB a thread; M = 32: 3.04 -> 3.71 ms), M = 64.
constexpr int64_t kOuterTilesMaxM = 3 * kOuterMR, kOuterTilesMaxBytes = 512 << 10;

// 16 vectors of 16 dwords, transposed in place (out[j] lane i = in[i] lane j).
HQT_INLINE void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  HQT_UNROLL for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  HQT_UNROLL for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + j] holds, in each 128-bit lane c, element j of rows 4q .. 4q+3 at columns 4c + j: gather the lanes
  HQT_UNROLL for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);       // lanes 0, 2 of rows 0-3 | lanes 0, 2 of rows 4-7
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);   // lanes 1, 3
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
  }
  HQT_UNROLL for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);          // column lane 0
    r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);  // column lane 1
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);      // column lane 2
    r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xDD);  // column lane 3
  }
}

// The per-row tables of a block (one shared table for a per-tensor scale).
struct BlockWideners {
  std::vector<Widener> rows;
  const Widener* shared = nullptr;
  const Widener& of(int r) const { return shared ? *shared : rows[r]; }
  void set(const Weight& wt, const Widener* one, int64_t n, int nr) {
    shared = one;
    if (one) return;
    rows.clear();
    for (int r = 0; r < nr; ++r) rows.emplace_back(wt.e4m3, wt.s(n + r));
  }
};

// Decode reads 64 bytes of each of 16 or 32 rows per step. Rows shorter than a 4 KiB page are too short for the hardware
// prefetchers, so each step also prefetches its share of the next rows: bytes [from, to) of the rows from `n` on
// (measured cold at M=1-8 on an AMX Xeon: 1.1-1.4x faster at K=576..3072, 0.9x at K=4096, where it is not used).
inline bool prefetches(const Weight& wt) { return wt.K < 4096; }
HQT_INLINE void prefetch_rows(const Weight& wt, int64_t n, int64_t from, int64_t to) {
  const char* base = reinterpret_cast<const char*>(wt.w + n * wt.K);
  for (int64_t b = from; b < std::min(to, std::max<int64_t>(0, wt.N - n) * wt.K); b += 64) _mm_prefetch(base + b, _MM_HINT_T0);
}

// Rows [n, n + nr) (nr <= 16, missing rows zero), bytes [k, k + 64) of the [N, K] bytes `w`, transposed (16 x 16
// dwords) and each vector's 16-bit pairs put where widen64's unpacks take them: r[j] widens to pairs 2j and 2j + 1 of
// the 16 rows. `fp8_pack` stores every chunk so once per layer; decode then skips this per call.
HQT_INLINE void arrange_chunk(const uint8_t* w, int64_t K, int64_t n, int nr, int64_t k, __m512i (&r)[16]) {
  static const __m512i to_unpack = [] {  // per 128-bit lane: words lo0 hi0 lo1 hi1 .. -> lo0 lo1 lo2 lo3 hi0 .. hi3
    alignas(64) uint8_t idx[64];
    for (int c = 0; c < 4; ++c)
      for (int e = 0; e < 4; ++e)
        for (int h = 0; h < 2; ++h)
          for (int b = 0; b < 2; ++b) idx[16 * c + 8 * h + 2 * e + b] = static_cast<uint8_t>(4 * e + 2 * h + b);
    return _mm512_load_si512(idx);
  }();
  const int64_t left = K - k;
  const __mmask64 mask = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
  HQT_UNROLL for (int i = 0; i < kBlock; ++i)
    r[i] = i < nr ? _mm512_maskz_loadu_epi8(mask, w + (n + i) * K + k) : _mm512_setzero_si512();
  transpose16(r);  // r[j] lane i: bytes 4j .. 4j + 3 of row i (pairs 2j and 2j + 1)
  HQT_UNROLL for (int j = 0; j < 16; ++j) r[j] = _mm512_shuffle_epi8(r[j], to_unpack);
}

constexpr int64_t kChunkBytes = kBlock * 64;  // one arranged chunk: 64 columns of 16 rows

// The arranged chunk of the block of rows from n (a multiple of kBlock) at column k (`arrange_weight`'s layout).
HQT_INLINE const uint8_t* chunk_at(const Weight& wt, int64_t n, int64_t k) {
  return wt.chunks + ((n / kBlock) * ((wt.K + 63) / 64) + k / 64) * kChunkBytes;
}

// The pair vectors of a chunk with one table (per-tensor scale, or the codes' table of `scales_commute`), pair t at
// use(t, w): from the arranged copy when the layer has one (blocks start at multiples of kBlock), else arranged here.
template <class Use>
HQT_INLINE void widen_chunk_shared(const Weight& wt, const Widener& wd, int64_t n, int nr, int64_t k, const Use& use) {
  if (wt.chunks && n % kBlock == 0) {  // each vector loaded as it is widened (16 held at once would spill at M = 12)
    const uint8_t* c = chunk_at(wt, n, k);
    HQT_UNROLL for (int j = 0; j < 16; ++j) {
      __m512bh w0, w1;
      wd.widen64(nullptr, w0, w1, _mm512_loadu_si512(c + 64 * j));
      use(2 * j, w0);
      use(2 * j + 1, w1);
    }
    return;
  }
  __m512i r[16];
  arrange_chunk(wt.w, wt.K, n, nr, k, r);
  HQT_UNROLL for (int j = 0; j < 16; ++j) {
    __m512bh w0, w1;
    wd.widen64(nullptr, w0, w1, r[j]);
    use(2 * j, w0);
    use(2 * j + 1, w1);
  }
}

// [N, K] FP8 bytes -> [ceil(N / 16), ceil(K / 64), 1024]: every chunk as arrange_chunk leaves it (zeros past N and K).
at::Tensor arrange_weight(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kBlock - 1) / kBlock, KC = (K + 63) / 64;
  at::Tensor out = at::empty({NB, KC, kChunkBytes}, w.options().dtype(at::kByte));
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < KC; ++c) {
        __m512i r[16];
        arrange_chunk(src, K, b * kBlock, static_cast<int>(std::min<int64_t>(kBlock, N - b * kBlock)), c * 64, r);
        HQT_UNROLL for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (b * KC + c) * kChunkBytes + 64 * j, r[j]);
      }
  });
  return out;
}

// The next rows fetched ahead on the decode paths (`prefetches`): their chunk at column k in the arranged copy when
// they are widened from it (one table), else bytes [from, to) of the rows from `n` on in [N, K].
HQT_INLINE void prefetch_next(const Weight& wt, const Widener* one, int64_t n, int64_t k, int64_t from, int64_t to) {
  if (!(one && wt.chunks)) return prefetch_rows(wt, n, from, to);
  if (n >= wt.N || n % kBlock) return;
  const char* c = reinterpret_cast<const char*>(chunk_at(wt, n, k));
  for (int64_t b = 0; b < kChunkBytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// A table per row (per-channel scales): each row widened, then the bf16 pairs transposed.
HQT_INLINE void widen_chunk_rows(const Weight& wt, const BlockWideners& wd, int64_t n, int nr, int64_t k, uint32_t* out) {
  __m512i lo[16];
  alignas(64) uint32_t hi[16][16];
  for (int r = 0; r < kBlock; ++r) {
    if (r < nr) {
      __m512bh w0, w1;
      wd.of(r).widen64_row(wt.w + (n + r) * wt.K, k, wt.K, w0, w1);
      lo[r] = (__m512i)w0;
      _mm512_store_si512(hi[r], (__m512i)w1);
    } else {
      lo[r] = _mm512_setzero_si512();
      _mm512_store_si512(hi[r], _mm512_setzero_si512());
    }
  }
  transpose16(lo);  // lo[j]: dword j of w0, which holds bytes permuted_source(2j), + 1
  HQT_UNROLL for (int j = 0; j < 16; ++j) _mm512_store_si512(out + (permuted_source(2 * j) / 2) * 16, lo[j]);
  HQT_UNROLL for (int r = 0; r < 16; ++r) lo[r] = _mm512_load_si512(hi[r]);
  transpose16(lo);
  HQT_UNROLL for (int j = 0; j < 16; ++j) _mm512_store_si512(out + (permuted_source(32 + 2 * j) / 2) * 16, lo[j]);
}

HQT_INLINE void widen_chunk(const Weight& wt, const BlockWideners& wd, int64_t n, int nr, int64_t k, uint32_t* out) {
  if (wd.shared)
    return widen_chunk_shared(wt, *wd.shared, n, nr, k, [&](int t, __m512bh w) { _mm512_store_si512(out + t * 16, (__m512i)w); });
  widen_chunk_rows(wt, wd, n, nr, k, out);
}

// y = hp(hp(acc) + bias) of 16 outputs before the last rounding, which the conversion to bf16 does.
HQT_INLINE __m512 with_bias(__m512 acc, int64_t n, __mmask16 mask, const Out& out) {
  return out.bias ? _mm512_add_ps(round_hp(acc, at::kBFloat16), _mm512_maskz_loadu_ps(mask, out.bias + n)) : acc;
}

// The epilogue of 16 outputs of a row, `nr` of them stored.
HQT_INLINE void store16(__m512 acc, int64_t m, int64_t n, int nr, const Out& out) {
  const __mmask16 mask = nr >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nr) - 1);
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.y) + m * out.N + n, mask,
                           (__m256i)_mm512_cvtneps_pbh(with_bias(acc, n, mask, out)));
}

// 32 outputs of a row: two conversions in one instruction, one store.
HQT_INLINE void store32(__m512 lo, __m512 hi, int64_t m, int64_t n, const Out& out) {
  const __m512bh v = _mm512_cvtne2ps_pbh(with_bias(hi, n + 16, 0xFFFF, out), with_bias(lo, n, 0xFFFF, out));
  _mm512_storeu_si512(static_cast<uint16_t*>(out.y) + m * out.N + n, (__m512i)v);
}

// MR input rows x NB blocks over pairs [t0, t1). `xt`: the input tile, pair-major (pair t of its row i at
// xt[t * MR + i]); `w` points at pair t0 of the first block, blocks `bstride` apart.
template <int MR, int NB>
HQT_INLINE void outer_steps(const uint32_t* xt, const uint32_t* w, int64_t bstride, int64_t t0, int64_t t1,
                            __m512 (&acc)[MR][NB], const char* pf = nullptr, const char* pf_end = nullptr) {
  xt += t0 * MR;
  for (int64_t t = t0; t < t1; ++t, w += kBlock, xt += MR) {
    if (pf < pf_end) {
      _mm_prefetch(pf, _MM_HINT_T1);
      pf += 64;
    }
    __m512bh wv[NB];
    HQT_UNROLL for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_load_si512(w + b * bstride);
    HQT_UNROLL for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[m]));
      HQT_UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xb, wv[b]);
    }
  }
}

// VDPBF16PS as fp32 FMAs: acc + x[2t+1] w[2t+1], then + x[2t] w[2t], each rounded to nearest even, denormal inputs
// read as zero and denormal results flushed (the caller sets MXCSR's DAZ and FTZ): the instruction's bits (equal on
// 32M random lanes, tiny and denormal values included, on an Emerald Rapids; checked at load, `fma_is_dpbf16`). Where
// VDPBF16PS issues at a quarter of the FMA rate (Intel cores without AMX: 0.78 vs 0.19 ns an instruction on a 2-core
// Emerald Rapids VM, where fp32 `F.linear` beats bf16's by 1.6x at M >= 256), the panels take it: half the products
// per cycle of two FMAs each is still twice VDPBF16PS's. `xf`: the tile in fp32, value k of row i at xf[k * MR + i].
template <int MR, int NB>
HQT_INLINE void outer_steps_fma(const float* xf, const uint32_t* w, int64_t bstride, int64_t pairs, __m512 (&acc)[MR][NB]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t = 0; t < pairs; ++t, w += kBlock, xf += 2 * MR) {
    __m512 odd[NB], even[NB];
    HQT_UNROLL for (int b = 0; b < NB; ++b) {
      const __m512i v = _mm512_load_si512(w + b * bstride);
      odd[b] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
    HQT_UNROLL for (int m = 0; m < MR; ++m) {
      const __m512 xo = _mm512_set1_ps(xf[MR + m]);
      HQT_UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xo, odd[b], acc[m][b]);
    }
    HQT_UNROLL for (int m = 0; m < MR; ++m) {
      const __m512 xe = _mm512_set1_ps(xf[m]);
      HQT_UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xe, even[b], acc[m][b]);
    }
  }
}

// MXCSR with denormals read as zero and results flushed (VDPBF16PS's arithmetic) for the life of the guard.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// Whether outer_steps_fma computes VDPBF16PS's bits on this CPU: 16 weight pairs and one broadcast input pair of bf16
// with exponents over the whole range (zeros, denormals, cancellations) and accumulators of any bits, through both,
// 4096 times, once per process. Only then may the panels use it.
bool fma_is_dpbf16() {
  static const bool same = [] {
    uint64_t r = 0x9E3779B97F4A7C15ull;
    const auto next = [&r] { r ^= r << 13, r ^= r >> 7, r ^= r << 17; return r; };
    const auto bf16 = [&next] {
      const uint64_t q = next();
      const uint32_t e = (q & 3) == 0 ? (q >> 8) & 0xFF : (q & 3) == 1 ? (q >> 8) & 3 : 0x60 + (q >> 8) % 0x40;
      return static_cast<uint32_t>(((q >> 20) & 1) << 15 | e << 7 | ((q >> 24) & 0x7F));
    };
    for (int round = 0; round < 4096; ++round) {
      alignas(64) uint32_t w[kBlock], acc[kBlock];
      alignas(64) float got[kBlock], want[kBlock];
      for (int i = 0; i < kBlock; ++i) w[i] = bf16() | bf16() << 16, acc[i] = static_cast<uint32_t>(next() >> 16);
      const uint32_t even = bf16(), odd = bf16(), x[2] = {even << 16, odd << 16};  // x as outer_steps_fma reads it
      __m512 a[1][1] = {{_mm512_load_ps(reinterpret_cast<const float*>(acc))}};
      _mm512_store_ps(want, _mm512_dpbf16_ps(a[0][0], (__m512bh)_mm512_load_si512(w),
                                             (__m512bh)_mm512_set1_epi32(static_cast<int>(even | odd << 16))));
      {
        FlushDenormals flush;
        outer_steps_fma<1, 1>(reinterpret_cast<const float*>(x), w, 0, 1, a);
      }
      _mm512_store_ps(got, a[0][0]);
      for (int i = 0; i < kBlock; ++i)
        if (std::memcmp(&got[i], &want[i], 4) != 0 && !(std::isnan(got[i]) && std::isnan(want[i]))) return false;
    }
    return true;
  }();
  return same;
}

// The panels' arithmetic: two FMAs a pair on Intel CPUs (see outer_steps_fma) where they are VDPBF16PS's bits.
bool fma_panels() {
  static const bool use = (__builtin_cpu_init(), __builtin_cpu_is("intel")) && fma_is_dpbf16();
  return use;
}

// `oscale`: the rows' scales, each output's sum multiplied by its own (`scales_commute`), or none.
template <int MR, int NB>
HQT_INLINE void outer_store(__m512 (&acc)[MR][NB], int64_t m0, int64_t n, int64_t nr, const Out& out,
                            const float* oscale = nullptr) {
  if (oscale) {
    HQT_UNROLL for (int b = 0; b < NB; ++b) {
      const int64_t left = nr - b * kBlock;
      const __mmask16 mask = left >= kBlock ? __mmask16(0xFFFF) : left > 0 ? __mmask16((1u << left) - 1) : 0;
      const __m512 s = _mm512_maskz_loadu_ps(mask, oscale + n + b * kBlock);
      HQT_UNROLL for (int m = 0; m < MR; ++m) acc[m][b] = _mm512_mul_ps(acc[m][b], s);
    }
  }
  if constexpr (NB == 2) {
    if (nr == 2 * kBlock) {
      HQT_UNROLL for (int m = 0; m < MR; ++m) store32(acc[m][0], acc[m][1], m0 + m, n, out);
      return;
    }
  }
  HQT_UNROLL for (int m = 0; m < MR; ++m)
    HQT_UNROLL for (int b = 0; b < NB; ++b)
      if (nr > b * kBlock) store16(acc[m][b], m0 + m, n + b * kBlock, static_cast<int>(std::min<int64_t>(kBlock, nr - b * kBlock)), out);
}

// NB whole blocks of rows [n, n + 16 NB) with one table, from the arranged copy: the chunks at each k widened side by
// side, so that NB * MR sums advance at once (block after block, at M = 1 one chain of vdpbf16ps, each waiting for the
// last, bounded a block). Each output's sum keeps its order, pair after pair: the same bits. Measured on a 2-core Zen 5
// against block after block, in one process: hot, SmolLM2's shapes 1.3-2.0x at M = 1-2 and 1.2-1.4x at M = 8; cold,
// 4096^2 1.04-1.32x at M = 1-2 and 1.3-2.2x at M = 8-12, SmolLM2's shapes 0.90-1.31x at M = 1-2 (runs differ) and
// 1.1-1.2x at M = 8; a token's 210 calls (106 MB) 1.06 / 1.13 / 1.01x at M = 1 / 8 / 32. A layout with the pair's
// chunks side by side (one stream) was no faster.
template <int MR, int NB>
HQT_INLINE void decode_blocks(const Problem& p, const Widener& wd, int64_t n, const uint32_t* xt, bool prefetch) {
  const Weight& wt = p.wt;
  const uint8_t* c = chunk_at(wt, n, 0);
  const int64_t stride = chunk_at(wt, n + kBlock, 0) - c;  // from one block's chunks to the next's
  __m512 acc[MR][NB];
  HQT_UNROLL for (int m = 0; m < MR; ++m)
    HQT_UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.Kp; k += 64, c += kChunkBytes) {
    if (prefetch)
      HQT_UNROLL for (int b = 0; b < NB; ++b) prefetch_next(wt, &wd, n + (NB + b) * kBlock, k, 0, 0);
    HQT_UNROLL for (int j = 0; j < 16; ++j) {
      __m512bh w[NB][2];
      HQT_UNROLL for (int b = 0; b < NB; ++b) wd.widen64(nullptr, w[b][0], w[b][1], _mm512_loadu_si512(c + b * stride + 64 * j));
      HQT_UNROLL for (int h = 0; h < 2; ++h)
        HQT_UNROLL for (int m = 0; m < MR; ++m) {
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[(k / 2 + 2 * j + h) * MR + m]));
          HQT_UNROLL for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xb, w[b][h]);
        }
    }
  }
  outer_store<MR, NB>(acc, 0, n, NB * kBlock, p.out, p.oscale);
}

// The pairs of whole blocks of [n0, n1) that decode_blocks takes: where the rest starts. (Four blocks at a time ran
// 1.9x faster than one hot at M = 1, but 0.86x cold on SmolLM2's up 576 -> 1536, where two are 1.27x.)
int64_t decode_whole_blocks(const Problem& p, const Widener& wd, int64_t n0, int64_t n1, bool prefetch) {
  int64_t n = n0;
  dispatch<kOuterDecodeMaxM, 1>(p.M, 1, [&](auto MR, auto) {
    constexpr int mr = decltype(MR)::value;
    const uint32_t* xt = static_cast<const uint32_t*>(p.x);
    for (; n + 2 * kBlock <= n1; n += 2 * kBlock) decode_blocks<mr, 2>(p, wd, n, xt, prefetch);
  });
  return n;
}

// Decode-sized M (one input tile): each chunk of 64 columns of 16 rows widened and used at once (per-channel scales:
// 32 rows through an L1 buffer), the next 32 rows prefetched meanwhile.
void outer_decode(const Problem& p, int64_t n0, int64_t n1) {
  const Weight& wt = p.wt;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  if (p.bw) {  // bf16 weights: every pair straight from the packed blocks
    const int64_t bstride = p.Kp / 2 * kBlock;
    for (int64_t n = n0; n < n1; n += 2 * kBlock) {
      const int64_t nr = std::min<int64_t>(2 * kBlock, n1 - n);
      dispatch<kOuterDecodeMaxM, 2>(p.M, nr > kBlock ? 2 : 1, [&](auto MR, auto NB) {
        constexpr int mr = decltype(MR)::value, bn = decltype(NB)::value;
        __m512 acc[mr][bn];
        HQT_UNROLL for (int m = 0; m < mr; ++m)
          HQT_UNROLL for (int b = 0; b < bn; ++b) acc[m][b] = _mm512_setzero_ps();
        outer_steps<mr, bn>(reinterpret_cast<const uint32_t*>(x), p.bw + (n / kBlock) * bstride, bstride, 0, p.Kp / 2, acc);
        outer_store<mr, bn>(acc, 0, n, nr, p.out);
      });
    }
    return;
  }
  std::unique_ptr<Widener> one(wt.per_channel ? nullptr : new Widener(wt.e4m3, wt.s(0)));
  BlockWideners wd[2];
  alignas(64) uint32_t chunk[2][32 * kBlock];
  const bool prefetch = prefetches(wt);
  if (one && wt.chunks && n0 % kBlock == 0) n0 = decode_whole_blocks(p, *one, n0, n1, prefetch);
  for (int64_t n = n0; n < n1; n += 2 * kBlock) {
    const int64_t nr = std::min<int64_t>(2 * kBlock, n1 - n);
    const int nb = nr > kBlock ? 2 : 1;
    for (int b = 0; b < nb; ++b) wd[b].set(wt, one.get(), n + b * kBlock, static_cast<int>(std::min<int64_t>(kBlock, nr - b * kBlock)));
    dispatch<kOuterDecodeMaxM, 2>(p.M, nb, [&](auto MR, auto NB) {
      constexpr int mr = decltype(MR)::value, bn = decltype(NB)::value;
      const uint32_t* xt = reinterpret_cast<const uint32_t*>(x);  // one tile of M rows
      __m512 acc[mr][bn];
      HQT_UNROLL for (int m = 0; m < mr; ++m)
        HQT_UNROLL for (int b = 0; b < bn; ++b) acc[m][b] = _mm512_setzero_ps();
      if (one) {  // one table: each pair vector used as it is widened, block after block
        HQT_UNROLL for (int b = 0; b < bn; ++b) {
          __m512 a[mr];
          HQT_UNROLL for (int m = 0; m < mr; ++m) a[m] = _mm512_setzero_ps();
          const int rows = static_cast<int>(std::min<int64_t>(kBlock, nr - b * kBlock));
          for (int64_t k = 0; k < p.Kp; k += 64) {
            if (prefetch) prefetch_next(wt, one.get(), n + 2 * kBlock + b * kBlock, k, k * kBlock, (k + 64) * kBlock);
            widen_chunk_shared(wt, *one, n + b * kBlock, rows, k, [&](int t, __m512bh w) {
              HQT_UNROLL for (int m = 0; m < mr; ++m)
                a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(xt[(k / 2 + t) * mr + m])), w);
            });
          }
          HQT_UNROLL for (int m = 0; m < mr; ++m) acc[m][b] = a[m];
        }
        return outer_store<mr, bn>(acc, 0, n, nr, p.out, p.oscale);
      }
      for (int64_t k = 0; k < p.Kp; k += 64) {
        if (prefetch) prefetch_rows(wt, n + 2 * kBlock, k * 2 * kBlock, (k + 64) * 2 * kBlock);
        HQT_UNROLL for (int b = 0; b < bn; ++b)
          widen_chunk(wt, wd[b], n + b * kBlock, static_cast<int>(std::min<int64_t>(kBlock, nr - b * kBlock)), k, chunk[b]);
        outer_steps<mr, bn>(xt, chunk[0], chunk[1] - chunk[0], k / 2, k / 2 + 32, acc);
      }
      outer_store<mr, bn>(acc, 0, n, nr, p.out, p.oscale);
    });
  }
}

// A wide tile (kOuterMR < rows <= kWideMaxM) of FP8 weights with one scale: each chunk of 64 columns of 16 rows is
// widened once into L1 and swept by every row of the tile (MR accumulators, one weight vector, one input vector),
// where tiles of kOuterMR rows widened each chunk once per tile. The same order of sums per output.
constexpr int64_t kWideMaxM = 16;
// Tiles of up to kWideMaxM rows (as even as can be) where they take fewer tiles than kOuterMR rows would (M = 13-16,
// 25-32): one widening of the weights fewer; else kOuterMR. Measured on a 2-core Zen 4, a SmolLM2 token's 210 calls,
// cold, against tiles of kOuterMR: M = 13 15.9 -> 13.1 ms, 14 16.3 -> 13.6, 16 19.7 -> 16.8, 25 33.5 -> 27.9, 28
// 30.5 -> 25.5, 32 28.5 -> 26.7. Not where the count is the same: with one weight vector per step (two for kOuterMR
// rows) a wide tile is the slower (M = 18 / 20 / 24 in one tile: 0.88 / 0.94 / 0.90x).
inline int64_t wide_rows(int64_t M) {
  const int64_t tiles = (M + kWideMaxM - 1) / kWideMaxM;
  return tiles < (M + kOuterMR - 1) / kOuterMR ? (M + tiles - 1) / tiles : kOuterMR;
}
template <int MR>
void outer_wide_rows(const Problem& p, const Widener* one, int64_t n0, int64_t n1) {
  const Weight& wt = p.wt;
  const uint32_t* xt = static_cast<const uint32_t*>(p.x);
  alignas(64) uint32_t chunk[32 * kBlock];
  BlockWideners wd;
  const bool prefetch = prefetches(wt);
  for (int64_t n = n0; n < n1; n += kBlock) {
    const int nr = static_cast<int>(std::min<int64_t>(kBlock, n1 - n));
    wd.set(wt, one, n, nr);
    __m512 acc[MR][1];
    HQT_UNROLL for (int m = 0; m < MR; ++m) acc[m][0] = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.Kp; k += 64) {
      if (prefetch) prefetch_next(wt, one, n + kBlock, k, k * kBlock, (k + 64) * kBlock);
      widen_chunk(wt, wd, n, nr, k, chunk);
      outer_steps<MR, 1>(xt, chunk, 0, k / 2, k / 2 + 32, acc);
    }
    outer_store<MR, 1>(acc, 0, n, nr, p.out, p.oscale);
  }
}
// p.M must be in (kOuterMR, kWideMaxM]: fewer rows take outer_decode (the caller's choice, tile by tile).
template <int MR = kWideMaxM>
void outer_wide(const Problem& p, const Widener* one, int64_t n0, int64_t n1) {
  if constexpr (MR > kOuterMR + 1) {
    if (p.M < MR) return outer_wide<MR - 1>(p, one, n0, n1);
  }
  outer_wide_rows<MR>(p, one, n0, n1);
}

// A pair-major bf16 input tile of `mr` rows as outer_steps_fma reads it: value k of row i at xf[k * mr + i], in fp32.
void tile_to_f32(const uint32_t* xt, int mr, int64_t pairs, float* xf) {
  const __mmask16 rows = static_cast<__mmask16>((1u << mr) - 1);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t t = 0; t < pairs; ++t) {
    const __m512i v = _mm512_maskz_loadu_epi32(rows, xt + t * mr);
    _mm512_mask_storeu_epi32(xf + 2 * t * mr, rows, _mm512_slli_epi32(v, 16));
    _mm512_mask_storeu_epi32(xf + (2 * t + 1) * mr, rows, _mm512_and_si512(v, high));
  }
}

// The input of the bf16 path: tiles of `rows` rows (kOuterMR, or wide tiles; fewer for the last), pair-major (pair t
// of row i of a tile at t * rows + i), each row QDQ'd (`bf16_input_row`) into a buffer in L1 and laid out from there,
// tiles in parallel: one pass over the input, where there were two (QDQ into a row-major buffer, then the move into
// tiles). Measured on a 2-core Zen 4: 576 x 1536 at M = 8192 (warm) 40.1 -> 39.6 ms, 192 x 576 6.39 -> 6.14 ms; a
// SmolLM2 token's 210 calls at M = 1 (cold) 9.68 -> 9.18 ms. With `xf`, each tile is also laid out in fp32 there
// while it is in L1 (`tile_to_f32`, at xf + m0 * Kp): the FMA panels' input, made once for every thread.
uint32_t* bf16_tiles(const Rows& x, int64_t M, int64_t Kp, const float* s_x, bool e4m3, int64_t rows, float* xf = nullptr) {
  uint32_t* tiled = static_cast<uint32_t*>(scratch<4>(M * Kp * sizeof(uint16_t)));
  const int64_t pairs = Kp / 2;
  at::parallel_for(0, (M + rows - 1) / rows, 1, [&](int64_t t0, int64_t t1) {
    uint32_t* row = static_cast<uint32_t*>(scratch<5>(Kp * sizeof(uint16_t)));
    uint16_t* made = x.buffer();
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t m0 = tile * rows, n = std::min<int64_t>(rows, M - m0);
      uint32_t* dst = tiled + m0 * pairs;
      for (int64_t i = 0; i < n; ++i) {
        bf16_input_row(x.bits(m0 + i, made), x.K, Kp, s_x, e4m3, reinterpret_cast<uint16_t*>(row));
        for (int64_t t = 0; t < pairs; ++t) dst[t * n + i] = row[t];
      }
      if (xf) tile_to_f32(dst, static_cast<int>(n), pairs, xf + m0 * Kp);
    }
  });
  return tiled;
}

// Larger M: a panel of rows widened once (blocks of 16 rows, pair-major) and every input row swept over it.
void outer_panels(const Problem& p, int64_t n0, int64_t n1) {
  const Weight& wt = p.wt;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  const int64_t pairs = p.Kp / 2, bstride = pairs * kBlock;  // dwords per block
  const int64_t panel = std::max<int64_t>(2 * kBlock, panel_bytes(p.Kp) / (2 * p.Kp) / (2 * kBlock) * (2 * kBlock));
  const int64_t blocks = (std::min(panel, n1 - n0) + kBlock - 1) / kBlock;
  std::unique_ptr<uint32_t, decltype(&std::free)> buf(
      static_cast<uint32_t*>(std::aligned_alloc(64, blocks * bstride * sizeof(uint32_t))), &std::free);
  std::unique_ptr<Widener> one(wt.per_channel || p.bw ? nullptr : new Widener(wt.e4m3, wt.s(0)));
  BlockWideners wd;
  const bool fma = p.xf != nullptr;
  for (int64_t nb = n0; nb < n1; nb += panel) {
    const int64_t ne = std::min(n1, nb + panel);
    for (int64_t n = nb; n < ne; n += kBlock) {
      const int nr = static_cast<int>(std::min<int64_t>(kBlock, ne - n));
      uint32_t* blk = buf.get() + ((n - nb) / kBlock) * bstride;
      if (p.bw) {  // bf16 weights: their packed pairs copied
        std::memcpy(blk, p.bw + (n / kBlock) * bstride, bstride * 4);
        continue;
      }
      wd.set(wt, one.get(), n, nr);
      for (int64_t k = 0; k < p.Kp; k += 64) widen_chunk(wt, wd, n, nr, k, blk + (k / 2) * kBlock);
    }
    for (int64_t m = 0; m < p.M; m += kOuterMR)
      for (int64_t n = nb; n < ne; n += 2 * kBlock) {
        const int64_t nr = std::min<int64_t>(2 * kBlock, ne - n);
        dispatch<kOuterMR, 2>(std::min<int64_t>(kOuterMR, p.M - m), nr > kBlock ? 2 : 1, [&](auto MR, auto NB) {
          constexpr int mr = decltype(MR)::value, bn = decltype(NB)::value;
          __m512 acc[mr][bn];
          HQT_UNROLL for (int i = 0; i < mr; ++i)
            HQT_UNROLL for (int b = 0; b < bn; ++b) acc[i][b] = _mm512_setzero_ps();
          const uint32_t* w = buf.get() + ((n - nb) / kBlock) * bstride;
          if (fma) {  // the tile of rows m .. m + mr in fp32, laid out by bf16_tiles
            FlushDenormals flush;
            outer_steps_fma<mr, bn>(p.xf + m * p.Kp, w, bstride, pairs, acc);
          } else {
            // The first sweep of a tile prefetches the next tile into L2, one line a step (a step reads 4 mr <= 48 bytes
            // of its own tile). Measured warm at M = 8192 on a 2-core Zen 4: 576^2 13.96 -> 13.52 ms, 192 x 576 5.76 ->
            // 5.42, 576 x 1536 38.3 -> 36.8, 1536 x 576 unchanged (into L1 instead: about the same).
            const uint32_t* xt = reinterpret_cast<const uint32_t*>(x + m * p.Kp);  // the tile of rows m .. m + mr
            const char* next = reinterpret_cast<const char*>(x + (m + mr) * p.Kp);
            const char* next_end = n == nb ? reinterpret_cast<const char*>(x + std::min(p.M, m + mr + kOuterMR) * p.Kp) : next;
            outer_steps<mr, bn>(xt, w, bstride, 0, pairs, acc, next, next_end);
          }
          outer_store<mr, bn>(acc, m, n, nr, p.out);
        });
      }
  }
}
#endif

#if HQT_AMX
// ---- the AMX path: 16 x 16 fp32 tiles, 32 k per TDPBF16PS ------------------------------------------------------
// The weights are widened into a panel exactly as for outer_panels (blocks of 16 rows, pair after pair: 16 pairs of a
// block are one B tile, 64 bytes a row), the input is laid out in A tiles (`amx_a_tile`: 32 bf16 of 16 rows, 1 KB),
// padded with zero rows to a multiple of 16. Tiles 0-3 accumulate 2 x 2 blocks of 16 x 16 outputs over all of K,
// tiles 4-5 hold two input row blocks, 6-7 two weight blocks. Every M, decode included, takes this path, so a row's
// operations are the same whatever M is.
constexpr int64_t kTile = 16;  // rows of an input tile, outputs per accumulator row

// Linux hands the AMX tile state (8 KB of registers) to a process only on request, once.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct TileConfig {  // ldtilecfg's 64-byte operand (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight 16-row x 64-byte tiles, for this thread (the configuration is per thread; oneDNN sets its own before use).
inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// The input in A tiles: 16 rows x 32 values (1 KB, rows 64 bytes apart), the tiles of 16 rows one after another
// along k, the next 16 rows after them. A tile load reads 1 KB in a row (rows of a row-major input were 16 streams).
constexpr int64_t kAmxTileValues = kTile * 32;
inline uint16_t* amx_a_tile(uint16_t* x, int64_t Kp, int64_t m, int64_t k) {
  return x + ((m / kTile) * (Kp / 32) + k / 32) * kAmxTileValues + (m % kTile) * 32;
}
inline const uint16_t* amx_a_tile(const uint16_t* x, int64_t Kp, int64_t m, int64_t k) {
  return amx_a_tile(const_cast<uint16_t*>(x), Kp, m, k);
}

// Rows [m0, m1) of an input of M rows (`x`, bf16 [M, K]) into A tiles `xt`, QDQ'd when there is a static input scale;
// the range that ends at M also zeroes the last tile's rows past M.
void amx_input_tiles(const Rows& x, int64_t m0, int64_t m1, int64_t M, int64_t Kp, const float* s_x, bool e4m3,
                     uint16_t* xt) {
  uint16_t* made = x.buffer();
  for (int64_t m = m0; m < m1; ++m)
    bf16_input_row(x.bits(m, made), x.K, Kp, s_x, e4m3, amx_a_tile(xt, Kp, m, 0), kAmxTileValues);
  if (m1 == M)
    for (int64_t m = M; m % kTile; ++m)
      for (int64_t k = 0; k < Kp; k += 32) std::fill_n(amx_a_tile(xt, Kp, m, k), 32, uint16_t(0));
}
constexpr int64_t kAmxDecodeMaxM = 2 * kTile;  // up to this M, chunks are widened per step rather than per panel
constexpr int64_t kAmxKc = 512;                 // k per pass over a panel (up to 576)

// Accumulator tiles 0 .. (MB x NB) - 1 (block (i, b) in tile 2 i + b) from c (row stride ldc floats), or zeros.
template <int MB, int NB>
HQT_INLINE void amx_load_acc(const float* c, int64_t ldc) {
  const int64_t s = ldc * 4;
  if (!c) {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (MB > 1) _tile_zero(2);
    if constexpr (MB > 1 && NB > 1) _tile_zero(3);
    return;
  }
  _tile_loadd(0, c, s);
  if constexpr (NB > 1) _tile_loadd(1, c + kTile, s);
  if constexpr (MB > 1) _tile_loadd(2, c + kTile * ldc, s);
  if constexpr (MB > 1 && NB > 1) _tile_loadd(3, c + kTile * ldc + kTile, s);
}

template <int MB, int NB>
HQT_INLINE void amx_store_acc(float* c, int64_t ldc) {
  const int64_t s = ldc * 4;
  _tile_stored(0, c, s);
  if constexpr (NB > 1) _tile_stored(1, c + kTile, s);
  if constexpr (MB > 1) _tile_stored(2, c + kTile * ldc, s);
  if constexpr (MB > 1 && NB > 1) _tile_stored(3, c + kTile * ldc + kTile, s);
}

// 32 k (pairs t .. t + 15): MB input tiles (`x`; the second 16 rows `next` values on) times NB weight tiles (`w0`,
// `w1`: 16 pairs of 16 rows each, 64 bytes a pair). A weight tile serves this step only, while an input tile serves
// every weight block of a panel in turn: with `Stream`, the weight is loaded with the streaming hint (TILELOADDT1, as
// oneDNN loads the operand it streams), which keeps it from evicting the input tiles from L1. A/B on a 2-core AMX
// Xeon, W8A8: 3-18% faster at M = 256-8192 for N up to 16384 (SmolLM2's shapes, 4096^2, 8192 and 16384 x 576), the
// same at M = 1-32; 4-13% slower for a vocabulary's 32768-49152 rows, which keep the plain load (kStreamMaxN). There
// the output, tens of MB a call, sets the pace: a step's time doubles from 16384 rows to 32768, bf16 F.linear's too.
constexpr int64_t kStreamMaxN = 16384;
template <int MB, int NB, bool Stream>
HQT_INLINE void amx_step(const uint16_t* x, int64_t next, const uint32_t* w0, const uint32_t* w1) {
  _tile_loadd(4, x, 64);
  if constexpr (Stream) _tile_stream_loadd(6, w0, 64); else _tile_loadd(6, w0, 64);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NB > 1) {
    if constexpr (Stream) _tile_stream_loadd(7, w1, 64); else _tile_loadd(7, w1, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if constexpr (MB > 1) {
    _tile_loadd(5, x + next, 64);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
  }
}

// Calls f(MB, NB, S) with the tile counts (MB input, NB weight blocks of 16 rows) and whether the weight tiles are
// streamed (`amx_step`) as compile-time constants.
template <class F>
HQT_INLINE void amx_dispatch(int64_t mr, int64_t nr, bool stream, const F& f) {
  using one = std::integral_constant<int, 1>;
  using two = std::integral_constant<int, 2>;
  const auto by_tiles = [&](auto S) {
    if (mr > kTile) nr > kBlock ? f(two{}, two{}, S) : f(two{}, one{}, S);
    else nr > kBlock ? f(one{}, two{}, S) : f(one{}, one{}, S);
  };
  stream ? by_tiles(std::true_type{}) : by_tiles(std::false_type{});
}

// The epilogue of an mr x nr block of fp32 sums (row stride ldc); `oscale`: the weight rows' scales multiplying the
// sums (`scales_commute`), or none.
HQT_INLINE void amx_epilogue(float* c, int64_t ldc, int64_t m, int64_t n, int64_t mr, int64_t nr, const Out& out,
                             const float* oscale = nullptr) {
  if (oscale) {
    for (int64_t b = 0; b * kBlock < nr; ++b) {
      const int64_t left = nr - b * kBlock;
      const __m512 s = _mm512_maskz_loadu_ps(left >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1), oscale + n + b * kBlock);
      for (int64_t i = 0; i < mr; ++i) _mm512_store_ps(c + i * ldc + b * kBlock, _mm512_mul_ps(_mm512_load_ps(c + i * ldc + b * kBlock), s));
    }
  }
  if (nr == 2 * kBlock) {
    for (int64_t i = 0; i < mr; ++i) store32(_mm512_load_ps(c + i * ldc), _mm512_load_ps(c + i * ldc + kBlock), m + i, n, out);
    return;
  }
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t b = 0; b * kBlock < nr; ++b)
      store16(_mm512_load_ps(c + i * ldc + b * kBlock), m + i, n + b * kBlock,
              static_cast<int>(std::min<int64_t>(kBlock, nr - b * kBlock)), out);
}

// Decode-sized M (one or two input tiles): each chunk of 64 columns of 32 weight rows widened into L1 and used at once,
// the sums kept in the tiles over all of K, the next 32 rows prefetched meanwhile.
void amx_decode(const Problem& p, int64_t n0, int64_t n1) {
  const Weight& wt = p.wt;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);
  const int64_t next = p.Kp / 32 * kAmxTileValues;  // from a tile of rows 0-15 to its rows 16-31
  std::unique_ptr<Widener> one(wt.per_channel || p.bw ? nullptr : new Widener(wt.e4m3, wt.s(0)));
  const bool prefetch = !p.bw && prefetches(wt);
  BlockWideners wd[2];
  alignas(64) uint32_t chunk[2][32 * kBlock];
  alignas(64) float c[2 * kTile * 2 * kBlock];
  amx_configure();
  for (int64_t n = n0; n < n1; n += 2 * kBlock) {
    const int64_t nr = std::min<int64_t>(2 * kBlock, n1 - n);
    const int nb = p.bw ? 0 : nr > kBlock ? 2 : 1;
    for (int b = 0; b < nb; ++b) wd[b].set(wt, one.get(), n + b * kBlock, static_cast<int>(std::min<int64_t>(kBlock, nr - b * kBlock)));
    amx_dispatch(p.M, nr, p.wt.N <= kStreamMaxN, [&](auto MB, auto NB, auto S) {
      constexpr int mb = decltype(MB)::value, bn = decltype(NB)::value;
      constexpr bool st = decltype(S)::value;
      amx_load_acc<mb, bn>(nullptr, 0);
      const int64_t bstride = p.Kp / 2 * kBlock;
      for (int64_t k = 0; k < p.Kp; k += 64) {
        const uint32_t* w = chunk[0];
        int64_t ws = chunk[1] - chunk[0];
        if (p.bw) {  // bf16 weights: the tiles straight from the packed blocks
          w = p.bw + (n / kBlock) * bstride + (k / 2) * kBlock, ws = bstride;
        } else {
          if (prefetch && one && wt.chunks) {  // the next 32 rows' chunks at this k
            prefetch_next(wt, one.get(), n + 2 * kBlock, k, 0, 0);
            prefetch_next(wt, one.get(), n + 3 * kBlock, k, 0, 0);
          } else if (prefetch) {
            prefetch_rows(wt, n + 2 * kBlock, k * 2 * kBlock, (k + 64) * 2 * kBlock);  // all by the last k
          }
          HQT_UNROLL for (int b = 0; b < bn; ++b)
            widen_chunk(wt, wd[b], n + b * kBlock, static_cast<int>(std::min<int64_t>(kBlock, nr - b * kBlock)), k, chunk[b]);
        }
        HQT_UNROLL for (int h = 0; h < 2; ++h)
          amx_step<mb, bn, st>(amx_a_tile(x, p.Kp, 0, k + 32 * h), next, w + h * kTile * kBlock, w + ws + h * kTile * kBlock);
      }
      amx_store_acc<mb, bn>(c, 2 * kBlock);
    });
    amx_epilogue(c, 2 * kBlock, 0, n, p.M, nr, p.out, p.oscale);
  }
  _tile_release();
}

// Larger M, blocked like a GEMM: for each chunk of input rows and each panel of weight rows, passes over K of up to
// kAmxKc + 64 k: the panel's rows x those k widened into L2 once, then every block of 32 input rows times every pair of
// weight blocks. Between passes the sums wait in `cb` (fp32, exact), sized with the panel to stay in L2; after the
// last pass they go through L1 to the epilogue at once.
constexpr int64_t kAmxSumsBytes = 1024 * 1024;  // the partial sums of a chunk of rows x a panel, between passes
void amx_panels(const Problem& p, int64_t n0, int64_t n1) {
  const Weight& wt = p.wt;
  const uint16_t* x = static_cast<const uint16_t*>(p.x);  // A tiles (`amx_a_tile`), k in natural order
  const int64_t next = p.Kp / 32 * kAmxTileValues;
  const int64_t passes = (p.Kp + kAmxKc + 64 - 1) / (kAmxKc + 64);        // K up to 576 in one pass
  const int64_t kc = (p.Kp / 64 + passes - 1) / passes * 64;              // k per pass, a multiple of 64
  const int64_t nc = std::max<int64_t>(2 * kBlock, 512 * 1024 / (2 * kc) / (2 * kBlock) * (2 * kBlock));
  const int64_t panel = std::min(nc, (n1 - n0 + 2 * kBlock - 1) / (2 * kBlock) * (2 * kBlock)), ldc = panel;
  const int64_t bstride = kc / 2 * kBlock;  // dwords per block of 16 rows in the panel
  const int64_t blocks32 = (p.M + 2 * kTile - 1) / (2 * kTile);  // blocks of 32 input rows
  // one chunk when K takes one pass (no sums wait); else as few as keep a chunk's sums within kAmxSumsBytes (each
  // chunk widens the weights again)
  const int64_t chunks = passes == 1 ? 1 : std::max<int64_t>(1, (blocks32 * 2 * kTile * ldc * 4 + kAmxSumsBytes - 1) / kAmxSumsBytes);
  const int64_t mc = (blocks32 + chunks - 1) / chunks * (2 * kTile);
  uint32_t* buf = static_cast<uint32_t*>(scratch<0>(panel / kBlock * bstride * sizeof(uint32_t)));
  float* cb = passes > 1 ? static_cast<float*>(scratch<1>(mc * ldc * sizeof(float))) : nullptr;
  alignas(64) float last[2 * kTile * 2 * kBlock];  // a block's final sums on their way to the epilogue
  std::unique_ptr<Widener> one(wt.per_channel || p.bw ? nullptr : new Widener(wt.e4m3, wt.s(0)));
  BlockWideners wd;
  amx_configure();
  for (int64_t m0 = 0; m0 < p.M; m0 += mc) {
    const int64_t m1 = std::min(p.M, m0 + mc);
    for (int64_t nb = n0; nb < n1; nb += panel) {
      const int64_t ne = std::min(n1, nb + panel);
      for (int64_t k0 = 0; k0 < p.Kp; k0 += kc) {
        const int64_t k1 = std::min(p.Kp, k0 + kc);
        for (int64_t n = nb; n < ne; n += kBlock) {
          const int nr = static_cast<int>(std::min<int64_t>(kBlock, ne - n));
          uint32_t* blk = buf + ((n - nb) / kBlock) * bstride;
          if (p.bw) {  // bf16 weights: their packed pairs copied
            std::memcpy(blk, p.bw + (n / kBlock) * (p.Kp / 2 * kBlock) + (k0 / 2) * kBlock, (k1 - k0) / 2 * kBlock * 4);
            continue;
          }
          wd.set(wt, one.get(), n, nr);
          for (int64_t k = k0; k < k1; k += 64) widen_chunk(wt, wd, n, nr, k, blk + ((k - k0) / 2) * kBlock);
        }
        for (int64_t m = m0; m < m1; m += 2 * kTile) {
          const int64_t mr = std::min<int64_t>(2 * kTile, m1 - m);
          for (int64_t n = nb; n < ne; n += 2 * kBlock) {
            const int64_t nr = std::min<int64_t>(2 * kBlock, ne - n);
            const uint32_t* w = buf + ((n - nb) / kBlock) * bstride;
            float* c = cb ? cb + (m - m0) * ldc + (n - nb) : nullptr;
            amx_dispatch(mr, nr, p.wt.N <= kStreamMaxN, [&](auto MB, auto NB, auto S) {
              constexpr int mb = decltype(MB)::value, bn = decltype(NB)::value;
              constexpr bool st = decltype(S)::value;
              amx_load_acc<mb, bn>(k0 ? c : nullptr, ldc);
              for (int64_t k = k0; k < k1; k += 32)
                amx_step<mb, bn, st>(amx_a_tile(x, p.Kp, m, k), next, w + ((k - k0) / 2) * kBlock, w + bstride + ((k - k0) / 2) * kBlock);
              if (k1 < p.Kp) return amx_store_acc<mb, bn>(c, ldc);
              amx_store_acc<mb, bn>(last, 2 * kBlock);
              amx_epilogue(last, 2 * kBlock, m, n, mr, nr, p.out);
            });
          }
        }
      }
    }
  }
  _tile_release();
}
#endif

bool is_e4m3(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn || w.scalar_type() == at::kFloat8_e5m2,
              "fp8_linear: weight must be float8_e4m3fn or float8_e5m2, not ", w.scalar_type());
  return w.scalar_type() == at::kFloat8_e4m3fn;
}

}  // namespace

// The weight in the layout this machine's kernel reads (`fp8_linear`'s `packed`): [ceil(N / 8), K, 8] bytes on AVX2
// (groups of 8 rows, column after column); on the bf16 path [ceil(N / 16), ceil(K / 64), 1024], the chunks in the
// order the bf16 path widens them (`arrange_weight`: without it each call transposes them again); an empty tensor
// where the kernel reads [N, K] as it is.
at::Tensor fp8_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "fp8_pack: weight must be a contiguous 2-D tensor");
  is_e4m3(w);
#if HQT_AVX2
  return pack_rows(w.view(at::kByte));
#elif HQT_BF16
  return arrange_weight(w.view(at::kByte));
#else
  return at::empty({0}, w.options().dtype(at::kByte));
#endif
}

// A new output over glibc's 32 MiB mmap ceiling is a fresh mapping. Its pages are first written here, one byte per
// 4 KiB page, by row ranges in parallel, so each page faults once on one thread. The kernel's threads split
// columns and would write each page side by side: 1.4-1.8 faults per page. Measured on an AVX2 EPYC: `gate`/`up` at
// M = 8192 115 -> 105 ms.
void fault_in(const at::Tensor& t) {
  const int64_t n = t.nbytes();
  if (n < (int64_t(32) << 20)) return;
  char* p = static_cast<char*>(t.data_ptr());
  at::parallel_for(0, (n + 4095) / 4096, 256, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) p[std::min(i * 4096, n - 1)] = 0;
  });
}

// The input is taken in slices of rows whose compute layout fits 8 MiB, in a buffer kept by the calling thread
// (`scratch`): a large input costs no page faults per call (a fresh 50 MB buffer was 12k of them, a fifth of a
// `down_proj` at M = 8192 on an AVX2 EPYC), memory stays bounded, and a slice's rows are still in cache when the
// weight is swept over them. A row's result does not depend on its slice.
inline int64_t slice_rows(int64_t row_bytes) { return std::max<int64_t>(64, (int64_t(8) << 20) / row_bytes / 64 * 64); }

// The product of the ops: FP8 bytes `w` ([N, K]), or on the bf16 paths bf16 weights already packed (`bw`, w undefined);
// the input x, or with `up` and `act` the gated rows hp(act(x) * up) (`Rows`).
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, const std::vector<float>& sc,
                       const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& packed, const uint32_t* bw, const at::Tensor* up = nullptr,
                       const uint16_t* act = nullptr) {
  const bool e4m3 = bw ? true : is_e4m3(w);
  const uint8_t* w8 = bw ? nullptr : reinterpret_cast<const uint8_t*>(w.data_ptr());
  TORCH_CHECK(x.size(-1) == K, "fp8_linear: input has ", x.size(-1), " features, weight expects ", K);
  const auto hp = x.scalar_type();
  TORCH_CHECK(hp == at::kBFloat16 || hp == at::kHalf || hp == at::kFloat, "fp8_linear: unsupported input dtype ", hp);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const at::Tensor x2d = x.reshape({-1, K}).contiguous();
  const at::Tensor up2d = up ? up->reshape({-1, K}).contiguous() : at::Tensor();
  const Rows src{x2d.data_ptr(), K, hp, up ? static_cast<const uint16_t*>(up2d.data_ptr()) : nullptr, act};
  const int64_t rows = x2d.size(0);
  TORCH_CHECK(sc.size() == 1 || static_cast<int64_t>(sc.size()) == N, "fp8_linear: weight_scale must have 1 or ", N, " values");
  std::vector<float> b = bias.has_value() ? floats_of(*bias) : std::vector<float>();
  TORCH_CHECK(b.empty() || static_cast<int64_t>(b.size()) == N, "fp8_linear: bias must have ", N, " values");
  if (!b.empty()) b.resize(N + 16, 0.f);  // vector epilogues read whole vectors past N
  const bool has_sx = input_scale.has_value();
  const float s_x = has_sx ? load_float(input_scale->data_ptr(), input_scale->scalar_type(), 0) : 0.f;
  at::Tensor out = at::empty({rows, N}, x.options());
  if (rows == 0 || N == 0) return out.reshape(out_shape);
  fault_in(out);
  const Out all{out.data_ptr(), N, hp, b.empty() ? nullptr : b.data()};  // the epilogue of every row

#if HQT_BF16
  const bool bf16 = hp == at::kBFloat16;
#else
  const bool bf16 = false;
#endif
#if HQT_AMX
  const bool amx = bf16 && amx_granted();
#else
  const bool amx = false;
#endif
  const int64_t step = bf16 ? 64 : F32::W;
  const int64_t Kp = (K + step - 1) / step * step;
#if HQT_AVX2
  // the packed weight: the caller's (made once per layer), else packed here for this call
  at::Tensor own;
  if (packed.has_value() && packed->numel() > 0) {
    TORCH_CHECK(packed->scalar_type() == at::kByte && packed->is_contiguous() && packed->dim() == 3 &&
                    packed->size(0) == (N + kGroup - 1) / kGroup && packed->size(1) == K && packed->size(2) == kGroup,
                "fp8_linear: packed must be fp8_pack(weight)");
  } else {
    own = fp8_pack(w);
  }
  const uint8_t* pw = (own.defined() ? own : *packed).data_ptr<uint8_t>();
#endif
  Weight wt{w8, N, K, sc.data(), sc.size() > 1, e4m3, hp};
#if HQT_BF16
  if (!bw && packed.has_value() && packed->numel() > 0) {  // the chunks as fp8_pack arranged them (bf16 inputs only)
    TORCH_CHECK(packed->scalar_type() == at::kByte && packed->is_contiguous() && packed->dim() == 3 &&
                    packed->size(0) == (N + kBlock - 1) / kBlock && packed->size(1) == (K + 63) / 64 &&
                    packed->size(2) == kChunkBytes,
                "fp8_linear: packed must be fp8_pack(weight)");
    wt.chunks = packed->data_ptr<uint8_t>();
  }
#endif
  const int64_t threads = at::get_num_threads(), slice = slice_rows((bf16 ? 2 : 4) * Kp);

  // rows [first, first + M) of the input and the output
  const auto product = [&](int64_t first, int64_t M) {
#if HQT_AMX
    const int64_t Mp = amx ? (M + kTile - 1) / kTile * kTile : M;  // whole input tiles, zero rows past M
#else
    const int64_t Mp = M;
#endif
#if HQT_BF16
    if (bf16 && !amx) {  // the bf16 path: each input tile QDQ'd and laid out in one pass, then the outer products
      // a few input tiles take the register path tile after tile when a thread's share of the FP8 bytes stays in its
      // L2 (see kOuterTilesMaxM): tiles of kOuterMR rows, or wide tiles of up to kWideMaxM rows (one or two)
      // per-channel powers of two on the register paths: one table of the codes, the scales applied to the sums
      const bool scaled_sums = !bw && wt.per_channel && scales_commute(sc, e4m3, has_sx, s_x, K);
      const bool per_row = wt.per_channel && !scaled_sums;  // a table per weight row
      const bool tiles = !bw && M <= (per_row ? kWideMaxM : kOuterTilesMaxM) &&
                         (N + threads - 1) / threads * K <= kOuterTilesMaxBytes;
      const bool decode = M <= kOuterDecodeMaxM || tiles;
      const int64_t rows = tiles ? wide_rows(M) : kOuterMR;
      // the FMA panels' input (tiles of kOuterMR rows, as `rows` is off the decode path) in fp32, made with the tiles
      float* xf = !decode && fma_panels() ? static_cast<float*>(scratch<7>(M * Kp * sizeof(float))) : nullptr;
      static const float unit_scale = 1.f;
      const bool oscaled = decode && scaled_sums;
      const Weight wp = oscaled ? Weight{w8, N, K, &unit_scale, false, e4m3, hp} : wt;
      const Problem p{wp, bf16_tiles(src.from(first), M, Kp, has_sx ? &s_x : nullptr, e4m3, rows, xf), M, Kp, true,
                      all.from_row(first), bw, xf, oscaled ? sc.data() : nullptr};
      const int64_t unit = 2 * kBlock, grain = decode ? unit : std::max<int64_t>(unit, (N + threads - 1) / threads);
      at::parallel_for(0, (N + unit - 1) / unit, (grain + unit - 1) / unit, [&](int64_t g0, int64_t g1) {
        const int64_t n0 = g0 * unit, n1 = std::min(N, g1 * unit);
        if (!decode) return outer_panels(p, n0, n1);
        std::unique_ptr<Widener> one(rows > kOuterMR && !wp.per_channel ? new Widener(wp.e4m3, wp.s(0)) : nullptr);
        for (int64_t m0 = 0; m0 < M; m0 += rows) {  // the tiles of the input, each over this thread's rows
          Problem tile = p;
          tile.x = static_cast<const uint16_t*>(p.x) + m0 * Kp;
          tile.M = std::min<int64_t>(rows, M - m0);
          tile.out = p.out.from_row(m0);
          tile.M > kOuterMR ? outer_wide(tile, one.get(), n0, n1) : outer_decode(tile, n0, n1);  // (M = 25: 13 + 12 rows)
        }
      });
      return;
    }
#endif
#if HQT_AMX
    if (amx && M > kAmxDecodeMaxM && 2 * M >= N && threads > 1) {
      // rows split between threads: each lays out its own rows' A tiles in its own buffer, then multiplies them by
      // every weight row. Each thread widens all the weight rows, where a split of the weight rows widens each once
      // but has every thread read every input row, half of them laid out by the other core: at M >= N / 2 the
      // input is the larger share (A/B on a 2-core AMX Xeon: q/o 576^2 and down 1536->576 5-20% faster at
      // M = 512-2048, up 576->1536 3-9% slower at M = 256-512, where M < N / 2).
      const int64_t unit = 2 * kTile;
      at::parallel_for(0, (M + unit - 1) / unit, 1, [&](int64_t b0, int64_t b1) {
        const int64_t m0 = b0 * unit, rows = std::min(M, b1 * unit) - m0;
        uint16_t* xt = static_cast<uint16_t*>(scratch<3>((rows + kTile - 1) / kTile * kTile * Kp * sizeof(uint16_t)));
        amx_input_tiles(src.from(first + m0), 0, rows, rows, Kp, has_sx ? &s_x : nullptr, e4m3, xt);
        const Problem p{wt, xt, rows, Kp, true, all.from_row(first + m0), bw};
        amx_panels(p, 0, N);
      });
      return;
    }
#endif
    // the input in the compute layout (AMX: A tiles, the last tile's rows past M zero), rows in parallel
    float* xf = amx ? nullptr : static_cast<float*>(scratch<2>(M * Kp * sizeof(float)));
    uint16_t* xb = amx ? static_cast<uint16_t*>(scratch<3>(Mp * Kp * sizeof(uint16_t))) : nullptr;
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
#if HQT_AMX
      if (amx)
        return amx_input_tiles(src.from(first), m0, m1, M, Kp, has_sx ? &s_x : nullptr, e4m3, xb);
#endif
      for (int64_t m = m0; m < m1; ++m) {
        float* row = xf + m * Kp;
        input_row(src, first + m, has_sx ? &s_x : nullptr, e4m3, row);
        std::fill(row + K, row + Kp, 0.f);
      }
    });
    const Out o = all.from_row(first);

#if HQT_AMX
    if (amx) {  // every M: input tiles of 16 rows over panels of widened weight rows
      const int64_t unit = 2 * kBlock, grain = std::max<int64_t>(unit, (N + threads - 1) / threads);
      const bool decode = M <= kAmxDecodeMaxM;
      // per-channel powers of two at decode: one table of the codes, the scales applied to the sums (as the bf16 path)
      static const float unit_scale = 1.f;
      const bool oscaled = decode && !bw && wt.per_channel && scales_commute(sc, e4m3, has_sx, s_x, K);
      const Weight wp = oscaled ? Weight{w8, N, K, &unit_scale, false, e4m3, hp} : wt;
      const Problem p{wp, xb, M, Kp, true, o, bw, nullptr, oscaled ? sc.data() : nullptr};
      at::parallel_for(0, (N + unit - 1) / unit, decode ? 1 : (grain + unit - 1) / unit, [&](int64_t g0, int64_t g1) {
        const int64_t n0 = g0 * unit, n1 = std::min(N, g1 * unit);
        decode ? amx_decode(p, n0, n1) : amx_panels(p, n0, n1);
      });
      return;
    }
#endif
    const Problem p{wt, xf, M, Kp, false, o, bw};
#if HQT_AVX2
    with_fp8_group(wt, [&](auto* group) { run_columns<std::remove_pointer_t<decltype(group)>>(p, pw); });
#else
    const bool registers = M <= kRegisterMaxM;
    const int64_t unit = 8;  // weight rows per work unit
    const int64_t grain = registers ? 16 : std::max<int64_t>(unit, (N + threads - 1) / threads);
    at::parallel_for(0, (N + unit - 1) / unit, (grain + unit - 1) / unit, [&](int64_t g0, int64_t g1) {
      const int64_t n0 = g0 * unit, n1 = std::min(N, g1 * unit);
      if (!registers) return rows_from_panels(p, n0, n1);
      M == 1 ? rows_in_registers<kNR1>(p, n0, n1) : rows_in_registers<kNR>(p, n0, n1);
    });
#endif
  };
  for (int64_t first = 0; first < rows; first += slice) product(first, std::min(slice, rows - first));
  return out.reshape(out_shape);
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& weight_scale,
                      const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias,
                      const c10::optional<at::Tensor>& packed) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "fp8_linear: weight must be a contiguous 2-D tensor");
  return linear_impl(x, w, w.size(0), w.size(1), floats_of(weight_scale), input_scale, bias, packed, nullptr);
}

// A gated MLP's down projection: fp8_linear(hp(act(gate) * up), ...) with the gated input made a row at a time as the
// kernel lays its input out (`gated_row`), never written to memory: the two element-wise passes of torch's
// `act(gate) * up` (and the tensor between them) are saved. `act` is act's output for every bf16 or fp16 bit pattern
// (the Python side's `act_table`), so the input is bit for bit the model's own `act_fn(gate) * up`.
at::Tensor fp8_linear_gated(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& act, const at::Tensor& w,
                            const at::Tensor& weight_scale, const c10::optional<at::Tensor>& input_scale,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& packed) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "fp8_linear_gated: weight must be a contiguous 2-D tensor");
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 || gate.scalar_type() == at::kHalf,
              "fp8_linear_gated: gate must be bfloat16 or float16, not ", gate.scalar_type());
  TORCH_CHECK(up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(),
              "fp8_linear_gated: up must have gate's shape and dtype");
  TORCH_CHECK(act.scalar_type() == gate.scalar_type() && act.dim() == 1 && act.size(0) == 65537 && act.is_contiguous(),
              "fp8_linear_gated: act must be the 65537-entry table of gate's dtype (act_table)");
  return linear_impl(gate, w, w.size(0), w.size(1), floats_of(weight_scale), input_scale, bias, packed, nullptr, &up,
                     static_cast<const uint16_t*>(act.data_ptr()));
}

// High-precision weights (an `lm_head` kept in bf16), for fp32 compute on AVX2 and bf16 compute on the bf16 paths
// (AMX, AVX512-BF16; `bf16_pack` gives the pair-major blocks FP8 weights are widened into, read as they are).
// On AVX2: the bf16 values packed like FP8
// weights (`bf16_pack`: [ceil(N / 8), K, 8]; an empty tensor without the AVX2 path) and `bf16_linear(x, packed, N,
// bias)` = x @ W^T + bias in fp32, reading half of fp32's bytes, each output's products added k ascending like the
// FP8 path's: batch-invariant, the function of fp32 `F.linear` up to the order of its sums.
at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_pack: weight must be a 2-D bf16 tensor");
#if HQT_AVX2
  return pack_rows(w);
#elif HQT_BF16
  // [ceil(N / 16), Kp / 2, 16] dwords, Kp = K rounded up to 64: pair t of 16 rows (k = 2t low, 2t + 1 high), zeros
  // past N and K; the layout the FP8 weights are widened into, so the bf16 paths read it as they read those.
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 63) / 64 * 64;
  at::Tensor padded = at::zeros({(N + kBlock - 1) / kBlock * kBlock, Kp}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({-1, kBlock, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous().view(at::kInt).view({-1, Kp / 2, kBlock});
#else
  return at::empty({0}, w.options());
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
#if HQT_AVX2
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16_linear: input must be float32, not ", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + kGroup - 1) / kGroup && packed.size(1) == K && packed.size(2) == kGroup,
              "bf16_linear: packed must be bf16_pack(weight) of a weight with ", N, " rows and ", K, " columns");
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const at::Tensor x2d = x.reshape({-1, K}).contiguous();
  const int64_t M = x2d.size(0), Kp = (K + F32::W - 1) / F32::W * F32::W;
  std::vector<float> b = bias.has_value() ? floats_of(*bias) : std::vector<float>();
  TORCH_CHECK(b.empty() || static_cast<int64_t>(b.size()) == N, "bf16_linear: bias must have ", N, " values");
  if (!b.empty()) b.resize(N + 16, 0.f);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.reshape(out_shape);
  fault_in(out);
  const Weight wt{nullptr, N, K, nullptr, false, true, at::kFloat};
  const int64_t slice = slice_rows(4 * Kp);
  for (int64_t first = 0; first < M; first += slice) {
    const int64_t rows = std::min(slice, M - first);
    float* xf = static_cast<float*>(scratch<2>(rows * Kp * sizeof(float)));
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        std::memcpy(xf + m * Kp, x2d.data_ptr<float>() + (first + m) * K, K * sizeof(float));
        std::fill(xf + m * Kp + K, xf + (m + 1) * Kp, 0.f);
      }
    });
    const Out o = Out{out.data_ptr(), N, at::kFloat, b.empty() ? nullptr : b.data()}.from_row(first);
    run_columns<Bf16Group>(Problem{wt, xf, rows, Kp, false, o}, packed.data_ptr());
  }
  return out.reshape(out_shape);
#elif HQT_BF16
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16_linear: input must be bfloat16 here, not ", x.scalar_type());
  const int64_t K = x.size(-1), Kp = (K + 63) / 64 * 64;
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + kBlock - 1) / kBlock && packed.size(1) == Kp / 2 && packed.size(2) == kBlock,
              "bf16_linear: packed must be bf16_pack(weight) of a weight with ", N, " rows and ", K, " columns");
  return linear_impl(x, at::Tensor(), N, K, {1.f}, c10::nullopt, bias, c10::nullopt,
                     reinterpret_cast<const uint32_t*>(packed.data_ptr()));
#else
  TORCH_CHECK(false, "bf16_linear: this build has no bf16 path (bf16_pack returns an empty tensor here)");
  return at::Tensor();
#endif
}

// The dequantized weight in `dtype`: hp(W * scale) (the reference's `dequantize`), rows in parallel.
at::Tensor fp8_dequantize(const at::Tensor& w, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "fp8_dequantize: weight must be a contiguous 2-D tensor");
  const bool e4m3 = is_e4m3(w);
  const int64_t N = w.size(0), K = w.size(1);
  const std::vector<float> sc = floats_of(scale);
  TORCH_CHECK(sc.size() == 1 || static_cast<int64_t>(sc.size()) == N, "fp8_dequantize: weight_scale must have 1 or ", N, " values");
  at::Tensor out = at::empty({N, K}, w.options().dtype(dtype));
  const Weight wt{reinterpret_cast<const uint8_t*>(w.data_ptr()), N, K, sc.data(), sc.size() > 1, e4m3, dtype};
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    alignas(64) float v[F32::W];
    for (int64_t n = n0; n < n1; ++n) {
      const F32::V sv = F32::set1(wt.s(n) * widen_factor(wt));
      for (int64_t k = 0; k < K; k += F32::W) {
        F32::store(v, widen_f32(wt, n, k, sv));
        for (int64_t j = 0; j < F32::W && k + j < K; ++j) {
          if (dtype == at::kBFloat16) out.data_ptr<c10::BFloat16>()[n * K + k + j] = c10::BFloat16(v[j]);
          else if (dtype == at::kHalf) out.data_ptr<c10::Half>()[n * K + k + j] = c10::Half(v[j]);
          else out.data_ptr<float>()[n * K + k + j] = v[j];
        }
      }
    }
  });
  return out;
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

// The reference QDQ of a tensor, exposed for tests of the vector rounding against torch's casts.
at::Tensor fp8_qdq(const at::Tensor& x, const at::Tensor& scale, bool e4m3) {
  at::Tensor xf = x.to(at::kFloat).contiguous().clone();
  qdq_row(xf.data_ptr<float>(), xf.numel(), scale.to(at::kFloat).item<float>(), e4m3, x.scalar_type(), xf.data_ptr<float>());
  return xf.to(x.scalar_type());
}

// Which compute path a bf16 model takes here: "amx-bf16", "bf16-dot" (AVX512-BF16), "avx512-fma", "avx2-fma" or "scalar".
std::string fp8_isa() {
#if HQT_AMX
  return amx_granted() ? "amx-bf16" : "bf16-dot";
#elif HQT_BF16
  return "bf16-dot";
#elif HQT_AVX512
  return "avx512-fma";
#elif HQT_AVX2
  return "avx2-fma";
#else
  return "scalar";
#endif
}

TORCH_LIBRARY(HQT_OPS_NS, m) {
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, Tensor? packed=None) -> Tensor");
  m.def("fp8_linear_gated(Tensor gate, Tensor up, Tensor act, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, Tensor? packed=None) -> Tensor");
  m.def("fp8_pack(Tensor weight) -> Tensor");
  m.def("bf16_pack(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("fp8_dequantize(Tensor weight, Tensor weight_scale, ScalarType dtype) -> Tensor");
  m.def("fp8_qdq(Tensor x, Tensor scale, bool e4m3) -> Tensor");
  m.def("fp8_quantize(Tensor x, Tensor scale, bool e4m3) -> Tensor");
  m.def("fp8_isa() -> str", &fp8_isa);
}

TORCH_LIBRARY_IMPL(HQT_OPS_NS, CPU, m) {
  m.impl("fp8_linear", &fp8_linear);
  m.impl("fp8_linear_gated", &fp8_linear_gated);
  m.impl("fp8_pack", &fp8_pack);
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("fp8_dequantize", &fp8_dequantize);
  m.impl("fp8_qdq", &fp8_qdq);
  m.impl("fp8_quantize", &fp8_quantize);
}
