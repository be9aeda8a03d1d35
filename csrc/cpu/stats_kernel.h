// The CPU kernel body: statistics of elements [begin, end) of one tensor, for one instruction
// set. Each stats_kernel_<isa>.cpp defines FH_ISA_NS (and FH_ISA_AVX where AVX, FMA and F16C
// conversions may be used), sets `#pragma GCC target`, and includes this file. Everything here
// has internal linkage except the entry point FH_ISA_NS::chunk_stats (and, in the benchmark's
// read-probe build only, chunk_touch), so code compiled for one ISA never leaks into another.
// No torch or standard-library header is included here, for the same reason.
//
// Reference: fasthealth/ops/reference.py. Method, per block of kBlock elements (it stays in L1):
//  - fast path (block_f32, inputs of 32 bits or fewer): vectorized min/max, zero count, and
//    float32 sums of x and x^2 folded into float64 every 16 terms per lane; its variance is kept
//    when the mean does not dominate the spread (stats.h: kCancelBudget), else the block is
//    redone with sums shifted by its first element (block_f32_shifted);
//  - wide path (block_f32_wide, block_f64): float64 sums (float64 keeps the unshifted variance
//    well conditioned: its error is ~kBlock * 1e-16 * (mean/std)^2, far inside the 1e-4 of
//    docs/spec.md section 2 for |mean|/std <= 1e3, and squares of float32 cannot overflow it),
//    for blocks the float32 lanes cannot serve (magnitudes outside [2^-40, 2^60], or
//    cancellation even after the shift);
//  - masked paths (the same functions with M = true): a block whose sums come out non-finite
//    holds a NaN or an Inf (or, for float32 lanes, finite squares beyond float32: its largest
//    |x| says which). It is redone from L1 with every vector split into its finite lanes (the
//    sums and min/max skip the others, by masks) and counted: NaN, +inf and -inf per lane, in
//    the same loop, with the same shift, fallbacks and sum order as the unmasked path, so a
//    block's result does not depend on which path read it. Once a block of a chunk held one,
//    the chunk's later blocks take the masked path first (a NaN-laden tensor is read once, not
//    twice). Only float64 blocks whose magnitudes leave [2^-480, 2^480] go to the exact scalar
//    slow path (block_slow: two-pass moments and a power-of-two scaled sum of squares);
//  - blocks merge into the chunk's Partial with Chan's formula (csrc/stats.h).
#pragma once

#include "../stats.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#ifndef FH_ISA_NS
#error "define FH_ISA_NS before including stats_kernel.h"
#endif

namespace fasthealth {
namespace FH_ISA_NS {
namespace {

// 4096 elements: 16 KB of float32 stays in L1 (32-48 KB on current x86 cores) for the range
// counts' second look, and the block is long enough that its end (horizontal reductions, a
// merge) costs little next to the stream; shorter blocks pay for more ends.
constexpr int64_t kBlock = 4096;

// Vector width: 512-bit lanes with AVX-512, 256-bit with AVX and AVX2, 128-bit (SSE2 / NEON)
// otherwise. GCC vector extensions keep one source for all; the few operations they express
// badly use intrinsics. Every variant folds its float32 sums into float64 every 16 terms per
// lane and merges in the same order, so the numerics (and their bounds) are the same; the
// roundings differ with the lane count, within the tolerances of docs/spec.md section 2.
#if defined(FH_ISA_AVX512)
constexpr int FW = 16;
typedef float vf __attribute__((vector_size(64)));
typedef double vd __attribute__((vector_size(64)));
#elif defined(FH_ISA_AVX)
constexpr int FW = 8;
typedef float vf __attribute__((vector_size(32)));
typedef double vd __attribute__((vector_size(32)));
#else
constexpr int FW = 4;
typedef float vf __attribute__((vector_size(16)));
typedef double vd __attribute__((vector_size(16)));
#endif
constexpr int DW = FW / 2;

inline vf splatf(float x) { return vf{} + x; }
inline vd splatd(double x) { return vd{} + x; }
inline vf loadf(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline vd loadd(const double* p) {
  vd v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// Software prefetch kPrefetchAhead bytes ahead of the loads: every 64-byte line of the 2 * FW
// elements one loop iteration reads (a float32 iteration under AVX-512 reads two lines, and a
// line left to the hardware prefetcher alone makes the stream wait on memory). 8 KB ahead: when
// the host's memory is at its fastest a core streams quickly enough that a shorter distance no
// longer covers memory's latency; a longer one gains nothing on large tensors and costs on many
// small ones, where more of its prefetches fall past a tensor's end.
constexpr int64_t kPrefetchAhead = 8192;
template <int64_t kBytes>
inline void prefetch_ahead(const void* p) {
  const char* c = static_cast<const char*>(p) + kPrefetchAhead;
  for (int64_t off = 0; off < kBytes; off += 64) __builtin_prefetch(c + off);
}

// Running min and max: `a < m ? a : m` (and `a > m ? a : m`), which is exactly what MINPS
// (MAXPS) computes with `a` first, NaN included (the running value is kept). Spelled with the
// instruction because GCC, given the ternary on a bfloat16 vector widened from memory, reloads
// and re-widens the input under a mask instead (four vector operations where two do, a large
// share of the bfloat16 loop's work).
inline vf vmin(vf a, vf m) {
#if defined(FH_ISA_AVX512)
  return (vf)_mm512_min_ps((__m512)a, (__m512)m);
#elif defined(FH_ISA_AVX)
  return (vf)_mm256_min_ps((__m256)a, (__m256)m);
#else
  return a < m ? a : m;
#endif
}
inline vf vmax(vf a, vf m) {
#if defined(FH_ISA_AVX512)
  return (vf)_mm512_max_ps((__m512)a, (__m512)m);
#elif defined(FH_ISA_AVX)
  return (vf)_mm256_max_ps((__m256)a, (__m256)m);
#else
  return a > m ? a : m;
#endif
}

#if defined(FH_ISA_AVX512)
inline vd lo_d(vf v) { return (vd)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)v)); }
inline vd hi_d(vf v) { return (vd)_mm512_cvtps_pd(_mm512_extractf32x8_ps((__m512)v, 1)); }
inline int count_zero(vf v) {
  return __builtin_popcount(_mm512_cmp_ps_mask((__m512)v, _mm512_setzero_ps(), _CMP_EQ_OQ));
}
inline int count_zero(vd v) {
  return __builtin_popcount(_mm512_cmp_pd_mask((__m512d)v, _mm512_setzero_pd(), _CMP_EQ_OQ));
}
#elif defined(FH_ISA_AVX)
inline vd lo_d(vf v) { return (vd)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v)); }
inline vd hi_d(vf v) { return (vd)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1)); }
inline int count_zero(vf v) {
  return __builtin_popcount(
      _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_setzero_ps(), _CMP_EQ_OQ)));
}
inline int count_zero(vd v) {
  return __builtin_popcount(
      _mm256_movemask_pd(_mm256_cmp_pd((__m256d)v, _mm256_setzero_pd(), _CMP_EQ_OQ)));
}
#elif defined(__SSE2__)
inline vd lo_d(vf v) { return (vd)_mm_cvtps_pd((__m128)v); }
inline vd hi_d(vf v) { return (vd)_mm_cvtps_pd(_mm_movehl_ps((__m128)v, (__m128)v)); }
inline int count_zero(vf v) {
  return __builtin_popcount(_mm_movemask_ps(_mm_cmpeq_ps((__m128)v, _mm_setzero_ps())));
}
inline int count_zero(vd v) {
  return __builtin_popcount(_mm_movemask_pd(_mm_cmpeq_pd((__m128d)v, _mm_setzero_pd())));
}
#else
inline vd lo_d(vf v) { return vd{v[0], v[1]}; }
inline vd hi_d(vf v) { return vd{v[2], v[3]}; }
inline int count_zero(vf v) {
  int c = 0;
  for (int k = 0; k < FW; ++k) c += v[k] == 0.0f;
  return c;
}
inline int count_zero(vd v) {
  int c = 0;
  for (int k = 0; k < DW; ++k) c += v[k] == 0.0;
  return c;
}
#endif

inline bool is_finite(double x) { return __builtin_isfinite(x); }

// ---- finite lanes, for the masked paths (blocks holding NaN or Inf) ---------------------------
//
// fin_mask(a): which lanes of a are finite. With AVX-512 a mask register (one VFPCLASS), the
// running min/max take a masked MIN/MAX and the sums a masked ADD/FMA; without it an integer
// vector from one compare of |a| (NaN compares false), and the same by bitwise selects.
// Counters are float lanes (exact far beyond a block's kBlock / FW per lane): finite, +inf and
// -inf lanes; NaN is what is left, as Partial keeps it.
typedef __typeof__(vf{} < vf{}) vi;  // what a compare of float (double) lanes gives
typedef __typeof__(vd{} < vd{}) vl;

struct CountF {  // per lane: finite, +inf, -inf elements seen
  vf fin, pos, neg;
};
struct CountD {
  vd fin, pos, neg;
};
inline CountF count_f_zero() { return {splatf(0.0f), splatf(0.0f), splatf(0.0f)}; }
inline CountD count_d_zero() { return {splatd(0.0), splatd(0.0), splatd(0.0)}; }

// A block's non-finite tally as the Partial wants it: finite, +inf and -inf elements.
struct Counts {
  int64_t finite, pos, neg;
};

#if defined(FH_ISA_AVX512)
typedef __mmask16 mf;
typedef __mmask8 md;
// VFPCLASS categories: 0x01 QNaN, 0x08 +inf, 0x10 -inf, 0x80 SNaN
inline mf fin_mask(vf a) { return (mf)~_mm512_fpclass_ps_mask((__m512)a, 0x99); }
inline md fin_mask(vd a) { return (md)~_mm512_fpclass_pd_mask((__m512d)a, 0x99); }
inline bool none2(mf a, mf b) { return (a | b) == 0; }
inline vf keep(vf a, mf k) { return (vf)_mm512_maskz_mov_ps(k, (__m512)a); }
// s + a and p + a * a over the lanes of k (others keep s, p): one masked ADD / FMA each
inline vf madd(vf s, vf a, mf k) {
  return (vf)_mm512_mask_add_ps((__m512)s, k, (__m512)s, (__m512)a);
}
inline vf mfma(vf p, vf a, mf k) {
  return (vf)_mm512_mask3_fmadd_ps((__m512)a, (__m512)a, (__m512)p, k);
}
inline vd keep(vd a, md k) { return (vd)_mm512_maskz_mov_pd(k, (__m512d)a); }
inline vf mmin(vf a, vf m, mf k) {
  return (vf)_mm512_mask_min_ps((__m512)m, k, (__m512)a, (__m512)m);
}
inline vf mmax(vf a, vf m, mf k) {
  return (vf)_mm512_mask_max_ps((__m512)m, k, (__m512)a, (__m512)m);
}
inline vd mmin(vd a, vd m, md k) {
  return (vd)_mm512_mask_min_pd((__m512d)m, k, (__m512d)a, (__m512d)m);
}
inline vd mmax(vd a, vd m, md k) {
  return (vd)_mm512_mask_max_pd((__m512d)m, k, (__m512d)a, (__m512d)m);
}
inline void count_lanes(vf a, mf k, CountF& c) {
  const __m512 one = _mm512_set1_ps(1.0f);
  c.fin = (vf)_mm512_mask_add_ps((__m512)c.fin, k, (__m512)c.fin, one);
  c.pos = (vf)_mm512_mask_add_ps((__m512)c.pos, _mm512_fpclass_ps_mask((__m512)a, 0x08),
                                 (__m512)c.pos, one);
  c.neg = (vf)_mm512_mask_add_ps((__m512)c.neg, _mm512_fpclass_ps_mask((__m512)a, 0x10),
                                 (__m512)c.neg, one);
}
inline void count_lanes(vd a, md k, CountD& c) {
  const __m512d one = _mm512_set1_pd(1.0);
  c.fin = (vd)_mm512_mask_add_pd((__m512d)c.fin, k, (__m512d)c.fin, one);
  c.pos = (vd)_mm512_mask_add_pd((__m512d)c.pos, _mm512_fpclass_pd_mask((__m512d)a, 0x08),
                                 (__m512d)c.pos, one);
  c.neg = (vd)_mm512_mask_add_pd((__m512d)c.neg, _mm512_fpclass_pd_mask((__m512d)a, 0x10),
                                 (__m512d)c.neg, one);
}
#else
typedef vi mf;
typedef vl md;
inline mf fin_mask(vf a) {
  return (vf)((vi)a & (vi{} + 0x7fffffff)) < splatf(__builtin_huge_valf());
}
inline md fin_mask(vd a) {
  return (vd)((vl)a & (vl{} + 0x7fffffffffffffffL)) < splatd(__builtin_huge_val());
}
inline bool none2(mf a, mf b) {  // no lane of a or b set
#if defined(FH_ISA_AVX)
  return _mm256_movemask_ps((__m256)(a | b)) == 0;
#elif defined(__SSE2__)
  return _mm_movemask_ps((__m128)(a | b)) == 0;
#else
  const vi o = a | b;
  int any = 0;
  for (int k = 0; k < FW; ++k) any |= o[k];
  return any == 0;
#endif
}
inline vf keep(vf a, mf k) { return (vf)((vi)a & k); }
inline vf madd(vf s, vf a, mf k) { return s + keep(a, k); }
inline vf mfma(vf p, vf a, mf k) {
  const vf z = keep(a, k);
  return p + z * z;
}
inline vd keep(vd a, md k) { return (vd)((vl)a & k); }
inline vf mmin(vf a, vf m, mf k) { return k ? vmin(a, m) : m; }
inline vf mmax(vf a, vf m, mf k) { return k ? vmax(a, m) : m; }
inline vd mmin(vd a, vd m, md k) { return (k & (a < m)) ? a : m; }
inline vd mmax(vd a, vd m, md k) { return (k & (a > m)) ? a : m; }
inline void count_lanes(vf a, mf k, CountF& c) {
  const vi one = (vi)splatf(1.0f);
  const vf inf = splatf(__builtin_huge_valf());
  c.fin += (vf)(k & one);
  c.pos += (vf)((a == inf) & one);
  c.neg += (vf)((a == -inf) & one);
}
inline void count_lanes(vd a, md k, CountD& c) {
  const vl one = (vl)splatd(1.0);
  const vd inf = splatd(__builtin_huge_val());
  c.fin += (vd)(k & one);
  c.pos += (vd)((a == inf) & one);
  c.neg += (vd)((a == -inf) & one);
}
#endif

// +inf and -inf among 16-bit floats, counted on the raw words: with AVX-512 one compare and one
// masked add per kind for 2 * FW elements (per vector otherwise: see count_lanes), into 16-bit
// lanes (at most kBlock / 32 per lane in a block). The finite count stays per vector (count_fin).
#if defined(FH_ISA_AVX512)
struct CountW {
  __m512i pos, neg;
};
inline CountW count_w_zero() { return {_mm512_setzero_si512(), _mm512_setzero_si512()}; }
template <int kPos, int kNeg>
inline void count_inf16(const uint16_t* p, CountW& c) {
  const __m512i w = _mm512_loadu_si512((const void*)p), one = _mm512_set1_epi16(1);
  c.pos = _mm512_mask_add_epi16(c.pos, _mm512_cmpeq_epi16_mask(w, _mm512_set1_epi16(kPos)),
                                c.pos, one);
  c.neg = _mm512_mask_add_epi16(c.neg, _mm512_cmpeq_epi16_mask(w, _mm512_set1_epi16(kNeg)),
                                c.neg, one);
}
inline void count_fin(mf k, CountF& c) {
  c.fin = (vf)_mm512_mask_add_ps((__m512)c.fin, k, (__m512)c.fin, _mm512_set1_ps(1.0f));
}
inline void add_counts(const CountW& c, Counts& out) {
  alignas(64) uint16_t pos[32], neg[32];
  _mm512_store_si512((void*)pos, c.pos);
  _mm512_store_si512((void*)neg, c.neg);
  for (int k = 0; k < 32; ++k) {
    out.pos += pos[k];
    out.neg += neg[k];
  }
}
#else
struct CountW {};
inline CountW count_w_zero() { return {}; }
inline void count_fin(mf k, CountF& c) { c.fin += (vf)(k & (vi)splatf(1.0f)); }
inline void add_counts(const CountW&, Counts&) {}
#endif

// Lane counters into a block's tally (called once per block).
inline void add_counts(const CountF& c, Counts& out) {
  for (int k = 0; k < FW; ++k) {
    out.finite += (int64_t)c.fin[k];
    out.pos += (int64_t)c.pos[k];
    out.neg += (int64_t)c.neg[k];
  }
}
inline void add_counts(const CountD& c, Counts& out) {
  for (int k = 0; k < DW; ++k) {
    out.finite += (int64_t)c.fin[k];
    out.pos += (int64_t)c.pos[k];
    out.neg += (int64_t)c.neg[k];
  }
}

// One element of a masked path's scalar tail: false (and counted) when it is not finite.
inline bool tally1(double v, Counts& c) {
  if (is_finite(v)) {
    ++c.finite;
    return true;
  }
  c.pos += v > 0;  // NaN compares false
  c.neg += v < 0;
  return false;
}

inline float bits_to_float(uint32_t b) {
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    const float mag = (float)man * 5.9604644775390625e-8f;  // man * 2^-24
    return sign ? -mag : mag;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline float f8e4m3fn_to_float(uint8_t b) {
  const bool neg = b & 0x80u;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t man = b & 0x7u;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = __builtin_nanf("");
  } else if (exp == 0) {
    mag = (float)man * 0.001953125f;  // man * 2^-9
  } else {
    mag = __builtin_ldexpf(1.0f + (float)man * 0.125f, (int)exp - 7);
  }
  return neg ? -mag : mag;
}

// ---- loaders: FW elements as float32 lanes straight from memory (no staging buffer) ----------

// Zeros among the 2 * FW 16-bit floats (bfloat16 or float16) at p: +-0 are exactly the words
// whose bits other than the sign are clear, so one test on the raw words counts them all (a
// compare per float32 vector and a mask move each otherwise).
inline int count_zero16(const uint16_t* p) {
#if defined(FH_ISA_AVX512)
  const __m512i w = _mm512_loadu_si512((const void*)p);
  return __builtin_popcount(_mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x7fff)));
#elif defined(FH_ISA_AVX2)
  const __m256i w = _mm256_loadu_si256((const __m256i*)p);
  const __m256i z = _mm256_cmpeq_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7fff)),
                                       _mm256_setzero_si256());
  return __builtin_popcount((unsigned)_mm256_movemask_epi8(z)) >> 1;  // 2 bits per word
#else
  int c = 0;
  for (int k = 0; k < 2 * FW; ++k) c += (p[k] & 0x7fffu) == 0;
  return c;
#endif
}

// load2 fills two vectors with the next 2 * FW elements, in any order (the statistics do not
// depend on it).
struct LoadF32 {
  using T = float;
  static vf load(const T* p) { return loadf(p); }
  static void load2(const T* p, vf& a, vf& b) {
    a = loadf(p);
    b = loadf(p + FW);
  }
  static int zeros2(const T*, vf a, vf b) { return count_zero(a) + count_zero(b); }
  static double load1(const T* p) { return *p; }
  static constexpr bool kWordInfs = false;
};

struct LoadBF16 {  // bfloat16 is the high half of a float32
  using T = uint16_t;
  static vf load(const T* p) {
#if defined(FH_ISA_AVX512)
    return (vf)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif defined(FH_ISA_AVX)
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    const __m128i z = _mm_setzero_si128();
    const __m128 lo = _mm_castsi128_ps(_mm_unpacklo_epi16(z, h));
    const __m128 hi = _mm_castsi128_ps(_mm_unpackhi_epi16(z, h));
    return (vf)_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
#elif defined(__SSE2__)
    const __m128i h = _mm_loadl_epi64((const __m128i*)p);
    return (vf)_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
#else
    vf v;
    for (int k = 0; k < FW; ++k) v[k] = bits_to_float((uint32_t)p[k] << 16);
    return v;
#endif
  }
  static void load2(const T* p, vf& a, vf& b) {
#if defined(FH_ISA_AVX512)
    // One 64-byte load of 32 bf16 = 16 words: masking each word's low half gives the odd
    // elements, shifting the low halves up the even ones.
    const __m512i w = _mm512_loadu_si512((const void*)p);
    a = (vf)_mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
    b = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#elif defined(FH_ISA_AVX2)
    const __m256i w = _mm256_loadu_si256((const __m256i*)p);
    a = (vf)_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
    b = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#elif defined(FH_ISA_AVX)
    // One 32-byte load of 16 bf16 = 8 words: masking each word's low half gives the 8 odd
    // elements with no shuffle; shifting the low halves up gives the 8 even ones.
    const __m256 w = _mm256_loadu_ps((const float*)p);
    a = (vf)_mm256_and_ps(w, _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
    const __m128i lo = _mm_slli_epi32(_mm_castps_si128(_mm256_castps256_ps128(w)), 16);
    const __m128i hi = _mm_slli_epi32(_mm_castps_si128(_mm256_extractf128_ps(w, 1)), 16);
    b = (vf)_mm256_insertf128_ps(_mm256_castps128_ps256(_mm_castsi128_ps(lo)),
                                 _mm_castsi128_ps(hi), 1);
#else
    a = load(p);
    b = load(p + FW);
#endif
  }
  static int zeros2(const T* p, vf a, vf b) {
#if defined(FH_ISA_AVX512) || defined(FH_ISA_AVX2)
    return count_zero16(p);
#else
    return count_zero(a) + count_zero(b);
#endif
  }
  static double load1(const T* p) { return bits_to_float((uint32_t)*p << 16); }
#if defined(FH_ISA_AVX512)
  static constexpr bool kWordInfs = true;
  static void infs2(const T* p, CountW& c) { count_inf16<0x7f80, (int16_t)0xff80>(p, c); }
#else
  static constexpr bool kWordInfs = false;
#endif
};

struct LoadF16 {
  using T = uint16_t;
  static vf load(const T* p) {
#if defined(FH_ISA_AVX512)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(FH_ISA_AVX)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    vf v;
    for (int k = 0; k < FW; ++k) v[k] = half_to_float(p[k]);
    return v;
#endif
  }
  static void load2(const T* p, vf& a, vf& b) {
    a = load(p);
    b = load(p + FW);
  }
  static int zeros2(const T* p, vf a, vf b) {
#if defined(FH_ISA_AVX512) || defined(FH_ISA_AVX2)
    return count_zero16(p);
#else
    return count_zero(a) + count_zero(b);
#endif
  }
  static double load1(const T* p) { return half_to_float(*p); }
#if defined(FH_ISA_AVX512)
  static constexpr bool kWordInfs = true;
  static void infs2(const T* p, CountW& c) { count_inf16<0x7c00, (int16_t)0xfc00>(p, c); }
#else
  static constexpr bool kWordInfs = false;
#endif
};

struct LoadF64 {
  using T = double;
  static double load1(const T* p) { return *p; }
};

// 2^-480 .. 2^480: squares of such values, summed kBlock times, neither overflow nor lose
// precision to underflow in float64.
constexpr double kSafeLo = 3.2207592638585077e-145;  // 2^-480
constexpr double kSafeHi = 3.1048466066857303e+144;  // 2^480

// Exact scalar path for a block with non-finite values or extreme magnitudes.
template <typename L>
Partial block_slow(const typename L::T* x, int64_t n) {
  Partial p = partial_empty();
  p.n = n;
  for (int64_t i = 0; i < n; ++i) {
    const double v = L::load1(x + i);
    if (v != v) continue;
    if (v == __builtin_huge_val()) {
      ++p.posinf;
    } else if (v == -__builtin_huge_val()) {
      ++p.neginf;
    } else {
      ++p.finite;
      p.zero += v == 0.0;
      if (v < p.fmin) p.fmin = v;
      if (v > p.fmax) p.fmax = v;
    }
  }
  if (p.finite == 0) return p;
  const double amax = -p.fmin > p.fmax ? -p.fmin : p.fmax;
  double scale = 1.0;
  if (amax != 0.0 && (amax < kSafeLo || amax > kSafeHi)) {
    int e;
    __builtin_frexp(amax, &e);
    // Clamped so that both scale and 1/scale are representable (subnormal and near-max inputs).
    e = e < -1020 ? -1020 : (e > 1023 ? 1023 : e);
    scale = __builtin_ldexp(1.0, e);
  }
  const double inv = 1.0 / scale;  // a power of two: scaling is exact
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = L::load1(x + i);
    if (is_finite(v)) sum += v * inv;
  }
  const double mean = sum / (double)p.finite;
  double m2 = 0.0, ssq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = L::load1(x + i);
    if (is_finite(v)) {
      const double y = v * inv;
      const double d = y - mean;
      m2 += d * d;
      ssq += y * y;
    }
  }
  p.mean = mean * scale;
  p.m2 = m2 * scale * scale;
  p.scale = scale;
  p.ssq = ssq;
  return p;
}

// A block's record from its sums over the finite elements (c: their tally; finite == n on the
// unmasked paths).
inline Partial block_from_sums(int64_t n, int64_t zero, double mn, double mx, double s, double q,
                               Counts c) {
  Partial p = partial_empty();
  p.n = n;
  p.finite = c.finite;
  p.posinf = c.pos;
  p.neginf = c.neg;
  p.zero = zero;
  if (c.finite == 0) return p;  // only NaN/Inf: the empty record's moments and extremes
  p.fmin = mn;
  p.fmax = mx;
  p.mean = s / (double)c.finite;
  const double m2 = q - s * p.mean;
  p.m2 = m2 > 0.0 ? m2 : 0.0;
  p.ssq = q;
  return p;
}

// The end of a float-lane block: the running min/max and the sums' lanes reduced to scalars,
// then the elements [i, n) the vector loop left, one at a time (masked: NaN/Inf counted in c and
// skipped).
template <typename L, bool M>
inline void reduce_lanes_and_tail(vf mn0, vf mn1, vf mx0, vf mx1, vd s_lanes, vd q_lanes,
                                  const typename L::T* x, int64_t i, int64_t n, double& mn,
                                  double& mx, double& s, double& q, int64_t& zero, Counts& c) {
  mn0 = mn1 < mn0 ? mn1 : mn0;
  mx0 = mx1 > mx0 ? mx1 : mx0;
  mn = __builtin_huge_val();
  mx = -mn;
  s = 0;
  q = 0;
  for (int k = 0; k < FW; ++k) {
    mn = mn0[k] < mn ? mn0[k] : mn;
    mx = mx0[k] > mx ? mx0[k] : mx;
  }
  for (int k = 0; k < DW; ++k) {
    s += s_lanes[k];
    q += q_lanes[k];
  }
  for (; i < n; ++i) {
    const double v = L::load1(x + i);
    if (M && !tally1(v, c)) continue;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    zero += v == 0.0;
    s += v;
    q += v * v;
  }
}

// Wide path for inputs of 32 bits or fewer: float64 lanes for the sums (exact enough whatever
// the shift or the magnitudes). Finite float32 values cannot make a float64 sum non-finite, so
// non-finite sums mean NaN/Inf elements: the block is redone masked, which is then exact too.
template <typename L, bool M>
Partial block_f32_wide(const typename L::T* x, int64_t n) {
  if (n == 0) return partial_empty();
  const vf pinf = splatf(__builtin_huge_valf()), ninf = -pinf;
  vf mn0 = pinf, mn1 = pinf, mx0 = ninf, mx1 = ninf;
  vd s0 = splatd(0), s1 = s0, s2 = s0, s3 = s0, q0 = s0, q1 = s0, q2 = s0, q3 = s0;
  CountF ca = count_f_zero(), cb = ca;
  Counts c = {M ? 0 : n, 0, 0};
  int64_t zero = 0;
  int64_t i = 0;
  for (; i + 2 * FW <= n; i += 2 * FW) {
    vf a = L::load(x + i), b = L::load(x + i + FW);
    zero += count_zero(a) + count_zero(b);
    if constexpr (M) {
      const mf ka = fin_mask(a), kb = fin_mask(b);
      count_lanes(a, ka, ca);
      count_lanes(b, kb, cb);
      mn0 = mmin(a, mn0, ka);
      mn1 = mmin(b, mn1, kb);
      mx0 = mmax(a, mx0, ka);
      mx1 = mmax(b, mx1, kb);
      a = keep(a, ka);
      b = keep(b, kb);
    } else {
      mn0 = a < mn0 ? a : mn0;
      mn1 = b < mn1 ? b : mn1;
      mx0 = a > mx0 ? a : mx0;
      mx1 = b > mx1 ? b : mx1;
    }
    const vd a0 = lo_d(a), a1 = hi_d(a), b0 = lo_d(b), b1 = hi_d(b);
    s0 += a0;
    s1 += a1;
    s2 += b0;
    s3 += b1;
    q0 += a0 * a0;
    q1 += a1 * a1;
    q2 += b0 * b0;
    q3 += b1 * b1;
  }
  s0 += s1 + s2 + s3;
  q0 += q1 + q2 + q3;
  if constexpr (M) {
    add_counts(ca, c);
    add_counts(cb, c);
  }
  double mn, mx, s, q;
  reduce_lanes_and_tail<L, M>(mn0, mn1, mx0, mx1, s0, q0, x, i, n, mn, mx, s, q, zero, c);
  if (!M && !(is_finite(s) && is_finite(q))) return block_f32_wide<L, true>(x, n);
  return block_from_sums(n, zero, mn, mx, s, q, c);
}

// Magnitudes the float32 lanes serve: kFastMinAmax (stats.h) .. 2^60, whose squares, 16 to a
// lane, neither overflow nor lose precision to subnormals; sums fold into float64 every 16 terms,
// so the cancellation the fast path accepts is kCancelBudget / 16 (stats.h explains both).
constexpr double kF32Hi = 1.152921504606847e+18;  // 2^60
constexpr double kMaxCancel = kCancelBudget / 16;

// Second try for a block whose mean dominates its spread (block_f32 below refused it): float32
// lanes, sums of x^2, (x - K) and (x - K)^2 folded into float64 every 16 elements per lane, K
// the block's first (masked: first finite) element. Blocks it cannot serve exactly either (K far
// from the mean too) go to block_f32_wide.
template <typename L, bool M>
Partial block_f32_shifted(const typename L::T* x, int64_t n) {
  float k = (float)L::load1(x);
  if constexpr (M) {  // block_f32 sends a block here only when it holds a finite element
    for (int64_t j = 0; !is_finite(k) && j < n; ++j) k = (float)L::load1(x + j);
  }
  const vf kv = splatf(k);
  const vf pinf = splatf(__builtin_huge_valf()), ninf = -pinf;
  const vf zf = splatf(0.0f);
  vf mn0 = pinf, mn1 = pinf, mx0 = ninf, mx1 = ninf;
  vd sd = splatd(0), sq = sd, sp = sd;
  CountF ca = count_f_zero(), cb = ca;
  Counts c = {M ? 0 : n, 0, 0};
  int64_t zero = 0;
  int64_t i = 0;
  constexpr int64_t kSub = 16 * 2 * FW;  // elements per float32 sub-block
  // Streaming from DRAM, the hardware prefetcher alone leaves this loop waiting on memory.
  constexpr int64_t kStep = 2 * FW * sizeof(typename L::T);  // bytes an iteration reads
  while (i + 2 * FW <= n) {
    const int64_t stop = i + kSub <= n ? i + kSub : n - (n - i) % (2 * FW);
    vf d0 = zf, d1 = zf, q0 = zf, q1 = zf, p0 = zf, p1 = zf;
    for (; i < stop; i += 2 * FW) {
      prefetch_ahead<kStep>(x + i);
      vf a, b;
      L::load2(x + i, a, b);
      zero += L::zeros2(x + i, a, b);
      vf da, db;
      if constexpr (M) {
        const mf ka = fin_mask(a), kb = fin_mask(b);
        count_lanes(a, ka, ca);
        count_lanes(b, kb, cb);
        mn0 = mmin(a, mn0, ka);
        mn1 = mmin(b, mn1, kb);
        mx0 = mmax(a, mx0, ka);
        mx1 = mmax(b, mx1, kb);
        da = keep(a - kv, ka);
        db = keep(b - kv, kb);
        a = keep(a, ka);
        b = keep(b, kb);
      } else {
        mn0 = vmin(a, mn0);
        mn1 = vmin(b, mn1);
        mx0 = vmax(a, mx0);
        mx1 = vmax(b, mx1);
        da = a - kv;
        db = b - kv;
      }
      d0 += da;
      d1 += db;
      q0 += da * da;
      q1 += db * db;
      p0 += a * a;
      p1 += b * b;
    }
    d0 += d1;
    q0 += q1;
    p0 += p1;
    sd += lo_d(d0) + hi_d(d0);
    sq += lo_d(q0) + hi_d(q0);
    sp += lo_d(p0) + hi_d(p0);
  }
  if constexpr (M) {
    add_counts(ca, c);
    add_counts(cb, c);
  }
  mn0 = mn1 < mn0 ? mn1 : mn0;
  mx0 = mx1 > mx0 ? mx1 : mx0;
  double mn = __builtin_huge_val(), mx = -mn, s = 0, q = 0, pp = 0;
  for (int k2 = 0; k2 < FW; ++k2) {
    mn = mn0[k2] < mn ? mn0[k2] : mn;
    mx = mx0[k2] > mx ? mx0[k2] : mx;
  }
  for (int k2 = 0; k2 < DW; ++k2) {
    s += sd[k2];
    q += sq[k2];
    pp += sp[k2];
  }
  for (; i < n; ++i) {
    const double v = L::load1(x + i);
    if (M && !tally1(v, c)) continue;
    const double d = v - (double)k;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    zero += v == 0.0;
    s += d;
    q += d * d;
    pp += v * v;
  }
  const double amax = -mn > mx ? -mn : mx;
  if (!(is_finite(s) && is_finite(q) && is_finite(pp)) ||
      (amax != 0.0 && (amax < kFastMinAmax || amax > kF32Hi))) {
    return block_f32_wide<L, M>(x, n);
  }
  const double m2 = q - s * s / (double)c.finite;
  if (q > kMaxCancel * m2) return block_f32_wide<L, M>(x, n);
  Partial p = block_from_sums(n, zero, mn, mx, 0.0, 0.0, c);
  p.mean = (double)k + s / (double)c.finite;
  p.m2 = m2 > 0.0 ? m2 : 0.0;
  p.ssq = pp;
  return p;
}

// Fast path for inputs of 32 bits or fewer: float32 lanes throughout (running min/max, a zero
// count, sums of x and x^2 folded into float64 every 16 elements per lane, so float32 rounding
// stays ~1e-6 relative), M2 = sum x^2 - (sum x)^2 / n. That M2 is kept when the mean does not
// dominate the spread (sum x^2 <= kMaxCancel * M2: gradients nearly always); otherwise the block
// goes to block_f32_shifted, and a block with extreme magnitudes to block_f32_wide. About 12
// vector operations per 2 * FW elements, mask moves included: the shifted sums live in
// block_f32_shifted and 16-bit zeros are counted on the raw words (count_zero16), so that
// bfloat16, half the bytes per element, stays memory-bound rather than compute-bound on a few
// cores. Non-finite sums whose cause is not a finite extreme (the largest |x| is <= 2^60 or
// infinite) mean NaN/Inf elements: the block is redone masked (M = true), from L1.
template <typename L, bool M>
Partial block_f32(const typename L::T* x, int64_t n) {
  if (n < 4 * FW) return block_f32_wide<L, M>(x, n);
  const vf pinf = splatf(__builtin_huge_valf()), ninf = -pinf;
  const vf zf = splatf(0.0f);
  vf mn0 = pinf, mn1 = pinf, mx0 = ninf, mx1 = ninf;
  vd ss = splatd(0), sp = ss;
  CountF ca = count_f_zero(), cb = ca;
  CountW cw = count_w_zero();
  Counts c = {M ? 0 : n, 0, 0};
  int64_t zero = 0;
  int64_t i = 0;
  constexpr int64_t kSub = 16 * 2 * FW;  // elements per float32 sub-block
  // Streaming from DRAM, the hardware prefetcher alone leaves this loop waiting on memory.
  constexpr int64_t kStep = 2 * FW * sizeof(typename L::T);  // bytes an iteration reads
  while (i + 2 * FW <= n) {
    const int64_t stop = i + kSub <= n ? i + kSub : n - (n - i) % (2 * FW);
    vf s0 = zf, s1 = zf, p0 = zf, p1 = zf;
    for (; i < stop; i += 2 * FW) {
      prefetch_ahead<kStep>(x + i);
      vf a, b;
      L::load2(x + i, a, b);
      zero += L::zeros2(x + i, a, b);
      if constexpr (M) {
        const mf ka = fin_mask(a), kb = fin_mask(b);
        if constexpr (L::kWordInfs) {
          count_fin(ka, ca);
          count_fin(kb, cb);
          L::infs2(x + i, cw);
        } else {
          count_lanes(a, ka, ca);
          count_lanes(b, kb, cb);
        }
        if (none2(ka, kb)) continue;  // all NaN/Inf (a NaN-filled tensor): nothing to sum
        mn0 = mmin(a, mn0, ka);
        mn1 = mmin(b, mn1, kb);
        mx0 = mmax(a, mx0, ka);
        mx1 = mmax(b, mx1, kb);
        s0 = madd(s0, a, ka);
        s1 = madd(s1, b, kb);
        p0 = mfma(p0, a, ka);
        p1 = mfma(p1, b, kb);
        continue;
      }
      mn0 = vmin(a, mn0);
      mn1 = vmin(b, mn1);
      mx0 = vmax(a, mx0);
      mx1 = vmax(b, mx1);
      s0 += a;
      s1 += b;
      p0 += a * a;
      p1 += b * b;
    }
    s0 += s1;
    p0 += p1;
    ss += lo_d(s0) + hi_d(s0);
    sp += lo_d(p0) + hi_d(p0);
  }
  if constexpr (M) {
    add_counts(ca, c);
    add_counts(cb, c);
    add_counts(cw, c);
  }
  double mn, mx, s, q;
  reduce_lanes_and_tail<L, M>(mn0, mn1, mx0, mx1, ss, sp, x, i, n, mn, mx, s, q, zero, c);
  const double amax = -mn > mx ? -mn : mx;
  if (!(is_finite(s) && is_finite(q))) {
    // unmasked, min/max skip NaN but not +-inf: a finite amax above 2^60 is an extreme square
    if (M || (amax > kF32Hi && amax < __builtin_huge_val())) return block_f32_wide<L, M>(x, n);
    return block_f32<L, true>(x, n);
  }
  if (c.finite == 0) return block_from_sums(n, zero, mn, mx, s, q, c);
  if (amax != 0.0 && (amax < kFastMinAmax || amax > kF32Hi)) return block_f32_wide<L, M>(x, n);
  const double m2 = q - s * s / (double)c.finite;
  if (q > kMaxCancel * m2) return block_f32_shifted<L, M>(x, n);
  return block_from_sums(n, zero, mn, mx, s, q, c);
}

// float64 blocks (and the widened integers): float64 lanes; NaN/Inf (non-finite sums) redo the
// block masked; magnitudes outside [2^-480, 2^480] go to the exact scalar block_slow.
template <bool M>
Partial block_f64(const double* x, int64_t n) {
  if (n == 0) return partial_empty();
  const vd pinf = splatd(__builtin_huge_val()), ninf = -pinf, zero_d = splatd(0);
  vd mn0 = pinf, mn1 = pinf, mx0 = ninf, mx1 = ninf;
  vd s0 = zero_d, s1 = zero_d, q0 = zero_d, q1 = zero_d;
  CountD ca = count_d_zero(), cb = ca;
  Counts c = {M ? 0 : n, 0, 0};
  int64_t zero = 0;
  int64_t i = 0;
  for (; i + 2 * DW <= n; i += 2 * DW) {
    vd a = loadd(x + i), b = loadd(x + i + DW);
    zero += count_zero(a) + count_zero(b);
    if constexpr (M) {
      const md ka = fin_mask(a), kb = fin_mask(b);
      count_lanes(a, ka, ca);
      count_lanes(b, kb, cb);
      mn0 = mmin(a, mn0, ka);
      mn1 = mmin(b, mn1, kb);
      mx0 = mmax(a, mx0, ka);
      mx1 = mmax(b, mx1, kb);
      a = keep(a, ka);
      b = keep(b, kb);
    } else {
      mn0 = a < mn0 ? a : mn0;
      mn1 = b < mn1 ? b : mn1;
      mx0 = a > mx0 ? a : mx0;
      mx1 = b > mx1 ? b : mx1;
    }
    s0 += a;
    s1 += b;
    q0 += a * a;
    q1 += b * b;
  }
  if constexpr (M) {
    add_counts(ca, c);
    add_counts(cb, c);
  }
  mn0 = mn1 < mn0 ? mn1 : mn0;
  mx0 = mx1 > mx0 ? mx1 : mx0;
  s0 += s1;
  q0 += q1;
  double mn = __builtin_huge_val(), mx = -mn, s = 0, q = 0;
  for (int k = 0; k < DW; ++k) {
    mn = mn0[k] < mn ? mn0[k] : mn;
    mx = mx0[k] > mx ? mx0[k] : mx;
    s += s0[k];
    q += q0[k];
  }
  for (; i < n; ++i) {
    const double v = x[i];
    if (M && !tally1(v, c)) continue;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    zero += v == 0.0;
    s += v;
    q += v * v;
  }
  const double amax = -mn > mx ? -mn : mx;
  const bool sums = is_finite(s) && is_finite(q);
  // unmasked: +-inf shows in amax, NaN only in the sums; finite extremes show in amax
  if (!M && !sums && !(amax > kSafeHi && amax < __builtin_huge_val())) {
    return block_f64<true>(x, n);
  }
  if (c.finite == 0) return block_from_sums(n, zero, mn, mx, s, q, c);
  if (!sums || (amax != 0.0 && (amax < kSafeLo || amax > kSafeHi))) {
    return block_slow<LoadF64>(x, n);
  }
  return block_from_sums(n, zero, mn, mx, s, q, c);
}

// Rare element types (float8, integers, bool) are widened into an L1-resident buffer first.
template <typename T>
void widen(const void* data, int64_t begin, int64_t n, double* out) {
  const T* p = (const T*)data + begin;
  for (int64_t i = 0; i < n; ++i) out[i] = (double)p[i];
}

// ---- mixed-precision range counts (only when asked: a second look at the L1-resident block,
// not a second read from memory) -----------------------------------------------------------

// over: finite |x| > hi; under: 0 < |x| < lo. NaN compares false everywhere and +-inf is
// excluded from over, so only finite values count.
template <typename L>
void count_range(const typename L::T* x, int64_t n, double hi, double lo, int64_t* over,
                 int64_t* under) {
  const vf vhi = splatf((float)hi), vlo = splatf((float)lo);
  const vf vinf = splatf(__builtin_huge_valf()), vzero = splatf(0.0f);
  vi o = vi{}, u = vi{};
  int64_t i = 0;
  for (; i + FW <= n; i += FW) {
    const vf a = L::load(x + i);
    const vf ax = a < vzero ? -a : a;
    o -= (vi)((ax > vhi) & (ax < vinf));
    u -= (vi)((ax < vlo) & (ax > vzero));
  }
  int64_t oc = 0, uc = 0;
  for (int k = 0; k < FW; ++k) {
    oc += o[k];
    uc += u[k];
  }
  for (; i < n; ++i) {
    const double v = L::load1(x + i);
    const double av = v < 0 ? -v : v;
    oc += av > (float)hi && av < __builtin_huge_val();
    uc += av < (float)lo && av > 0;
  }
  *over = oc;
  *under = uc;
}

void count_range_f64(const double* x, int64_t n, double hi, double lo, int64_t* over,
                     int64_t* under) {
  int64_t oc = 0, uc = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double av = x[i] < 0 ? -x[i] : x[i];
    oc += av > hi && av < __builtin_huge_val();
    uc += av < lo && av > 0;
  }
  *over = oc;
  *under = uc;
}

// A float-lane block: its statistics (masked first when asked), then its range counts.
template <typename L>
Partial block_lanes(const typename L::T* x, int64_t n, double hi, double lo, bool ranged,
                    bool masked) {
  Partial p = masked ? block_f32<L, true>(x, n) : block_f32<L, false>(x, n);
  if (ranged) count_range<L>(x, n, hi, lo, &p.over, &p.under);
  return p;
}

Partial block_stats(const void* data, int dtype, int64_t begin, int64_t n, float* fbuf,
                    double* dbuf, double hi, double lo, bool masked) {
  const bool ranged = hi < __builtin_huge_val() || lo > 0.0;
  Partial p;
  switch (dtype) {
    case kF32:
      return block_lanes<LoadF32>((const float*)data + begin, n, hi, lo, ranged, masked);
    case kBF16:
      return block_lanes<LoadBF16>((const uint16_t*)data + begin, n, hi, lo, ranged, masked);
    case kF16:
      return block_lanes<LoadF16>((const uint16_t*)data + begin, n, hi, lo, ranged, masked);
    case kF64: {
      const double* x = (const double*)data + begin;
      p = masked ? block_f64<true>(x, n) : block_f64<false>(x, n);
      if (ranged) count_range_f64(x, n, hi, lo, &p.over, &p.under);
      return p;
    }
    case kF8E5M2:
    case kF8E4M3: {
      const uint8_t* x = (const uint8_t*)data + begin;
      if (dtype == kF8E5M2) {  // the high byte of a float16
        for (int64_t i = 0; i < n; ++i) fbuf[i] = half_to_float((uint16_t)(x[i] << 8));
      } else {
        for (int64_t i = 0; i < n; ++i) fbuf[i] = f8e4m3fn_to_float(x[i]);
      }
      return block_lanes<LoadF32>(fbuf, n, hi, lo, ranged, masked);
    }
    case kI8:
      widen<int8_t>(data, begin, n, dbuf);
      break;
    case kU8:
    case kBool:
      widen<uint8_t>(data, begin, n, dbuf);
      break;
    case kI16:
      widen<int16_t>(data, begin, n, dbuf);
      break;
    case kI32:
      widen<int32_t>(data, begin, n, dbuf);
      break;
    case kI64:
      widen<int64_t>(data, begin, n, dbuf);
      break;
    default:
      __builtin_trap();  // the caller validated the dtype
  }
  p = block_f64<false>(dbuf, n);  // integers: always finite
  if (ranged) {
    // integers of 32 bits or fewer compare against the thresholds rounded to float32, as the
    // float lanes and the reference do (docs/spec.md section 2); int64 against the doubles
    const bool narrow = dtype != kI64;
    count_range_f64(dbuf, n, narrow ? (double)(float)hi : hi, narrow ? (double)(float)lo : lo,
                    &p.over, &p.under);
  }
  return p;
}

}  // namespace

Partial chunk_stats(const void* data, int dtype, int64_t begin, int64_t end, double range_hi,
                    double range_lo) {
  alignas(64) float fbuf[kBlock];
  alignas(64) double dbuf[kBlock];
  Partial acc = partial_empty();
  // After a block with NaN/Inf, the chunk's later blocks go to the masked path first: the
  // unmasked one would only find them again and hand the block over (the same result either
  // way, a second pass saved).
  bool masked = false;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = end - b < kBlock ? end - b : kBlock;
    const Partial p = block_stats(data, dtype, b, n, fbuf, dbuf, range_hi, range_lo, masked);
    masked = masked || p.finite != p.n;
    acc = partial_merge(acc, p);
  }
  return acc;
}

#ifdef FASTHEALTH_READ_PROBE
// The benchmark's read floor (bench/read_probe.py builds it; production builds have no such
// kernel): every byte of elements [begin, end) read by a loop of the fast path's shape (two
// vectors an iteration, the same prefetch ahead) that computes nothing but an OR, so the
// launcher, its chunks and its prefetches are timed without the statistics. The Partial
// carries no statistics: only a bit of the OR in `zero`, so that the loads are not dropped.
Partial chunk_touch(const void* data, int dtype, int64_t begin, int64_t end, double, double) {
  const int elem = dtype == kF64 || dtype == kI64 ? 8
                   : dtype == kF32 || dtype == kI32 ? 4
                   : dtype == kF16 || dtype == kBF16 || dtype == kI16 ? 2 : 1;
  const char* p = static_cast<const char*>(data) + begin * elem;
  const int64_t n = (end - begin) * elem;
  constexpr int64_t kStep = 2 * sizeof(vi);
  vi acc0 = vi{}, acc1 = vi{};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    prefetch_ahead<kStep>(p + i);
    vi a, b;
    __builtin_memcpy(&a, p + i, sizeof(vi));
    __builtin_memcpy(&b, p + i + sizeof(vi), sizeof(vi));
    acc0 |= a;
    acc1 |= b;
  }
  unsigned r = 0;
  for (; i < n; ++i) r |= (unsigned char)p[i];
  acc0 |= acc1;
  for (int k = 0; k < FW; ++k) r |= (unsigned)acc0[k];
  r |= r >> 16;  // every byte of the 32-bit lanes onto the lowest
  r |= r >> 8;
  Partial out = partial_empty();
  out.zero = r & 1;
  return out;
}
#endif  // FASTHEALTH_READ_PROBE

}  // namespace FH_ISA_NS
}  // namespace fasthealth
