// The per-tensor statistics record, its merge and its finalisation, shared by the CPU and CUDA
// kernels (mirrored by triton_kernels/tensor_stats.py; the columns by fasthealth/ops/layout.py).
//
// This header is deliberately free of torch and of the C++ standard library: the SIMD kernel
// translation units include it under `#pragma GCC target(...)`, and every function here is
// `static inline`, so no out-of-line copy compiled for one ISA can be picked by the linker for
// another.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define FH_HD __host__ __device__
#define FH_FORCE_INLINE __forceinline__  // a kernel calling it twice keeps no stack frame
#else
#define FH_HD
#define FH_FORCE_INLINE inline
#endif

namespace fasthealth {

// Columns of the output table, in the order of fasthealth.ops.layout.FIELDS.
enum Field : int {
  kNumel = 0,
  kNanCount,
  kPosinfCount,
  kNeginfCount,
  kInfCount,
  kZeroCount,
  kMin,
  kMax,
  kMean,
  kStd,
  kNorm,
  kFiniteMin,
  kFiniteMax,
  kFiniteMean,
  kFiniteStd,
  kFiniteNorm,
  kAmax,
  kAllFinite,
  kNumFields,  // the fields of docs/spec.md section 2
  // Mixed-precision range, against the thresholds of the call (0 when none were given):
  kOverflowCount = kNumFields,  // finite |x| > range_hi
  kUnderflowCount,              // 0 < |x| < range_lo
  kTableWidth
};

// Input element types the kernels read. Kept separate from c10::ScalarType so that the SIMD
// translation units need no torch header.
enum DType : int {
  kF32 = 0,
  kF64,
  kF16,
  kBF16,
  kI8,
  kU8,
  kI16,
  kI32,
  kI64,
  kBool,
  kF8E4M3,
  kF8E5M2,
};

// A mergeable summary of some elements. NaN is never stored: nan = n - finite - posinf - neginf.
// Moments are over the finite elements only (Chan et al.'s pairwise form), and the sum of
// squares is kept as scale^2 * ssq with `scale` a power of two, so that neither float32 nor
// float64 inputs overflow or underflow it (scale stays 1 except for float64 extremes).
struct Partial {
  int64_t n;
  int64_t finite;
  int64_t posinf;
  int64_t neginf;
  int64_t zero;
  int64_t over;   // finite |x| > range_hi
  int64_t under;  // 0 < |x| < range_lo
  double fmin;  // +inf when no finite element
  double fmax;  // -inf when no finite element
  double mean;
  double m2;
  double scale;
  double ssq;
};

// ---- The numerics every kernel shares (the Python twin: fasthealth/ops/layout.py) ----------
//
// Fast path (inputs of 32 bits or fewer): float32 lanes summing x and x^2, folded into float64
// after T terms per lane. Its limits:
// - kFastMinAmax: a chunk whose largest |x| is below 2^-40 leaves it, since float32 squares of
//   such values (< 2^-80, summed with others near 2^-126) lose precision as subnormals.
// - kCancelBudget: the variance from these sums, M2 = sum x^2 - (sum x)^2 / n, has a relative
//   error of about c * T * 2^-24 with c = sum x^2 / M2 (how much the mean dominates). A chunk
//   with c above kCancelBudget / T takes a second, shifted pass around its mean. 512 * 2^-24 =
//   3e-5 relative on the variance, inside the 1e-4 for std of docs/spec.md section 2, for
//   every kernel: the CPU kernel folds every T = 16 terms (c <= 32), the CUDA kernel every 8
//   (c <= 64), the Triton kernel every CHUNK / BLOCK = 32 (c <= 16).
// Exact path (float64 and integer inputs, and chunks the fast path refuses): the same record by
// different means, each the cheapest exact one for its hardware: the CPU and Triton kernels
// scale each block's squares by a power of two near its largest |x| (a block's values sit in
// registers, so the extra pass costs nothing), the CUDA kernel streams its elements once and
// sums squares in Blue's three bins (small, mid, large), which needs no pass ahead.
constexpr double kFastMinAmax = 9.094947017729282e-13;  // 2^-40
constexpr double kCancelBudget = 512.0;

static inline FH_HD double fh_inf() { return __builtin_huge_val(); }
static inline FH_HD double fh_nan() { return __builtin_nan(""); }

static inline FH_HD Partial partial_empty() {
  Partial p;
  p.n = p.finite = p.posinf = p.neginf = p.zero = p.over = p.under = 0;
  p.fmin = fh_inf();
  p.fmax = -fh_inf();
  p.mean = p.m2 = 0.0;
  p.scale = 1.0;
  p.ssq = 0.0;
  return p;
}

static inline FH_HD Partial partial_merge(const Partial& a, const Partial& b) {
  Partial r;
  r.n = a.n + b.n;
  r.finite = a.finite + b.finite;
  r.posinf = a.posinf + b.posinf;
  r.neginf = a.neginf + b.neginf;
  r.zero = a.zero + b.zero;
  r.over = a.over + b.over;
  r.under = a.under + b.under;
  r.fmin = b.fmin < a.fmin ? b.fmin : a.fmin;
  r.fmax = b.fmax > a.fmax ? b.fmax : a.fmax;
  if (a.finite == 0) {
    r.mean = b.mean;
    r.m2 = b.m2;
  } else if (b.finite == 0) {
    r.mean = a.mean;
    r.m2 = a.m2;
  } else {
    const double delta = b.mean - a.mean;
    const double wb = (double)b.finite / (double)r.finite;
    r.mean = a.mean + delta * wb;
    r.m2 = a.m2 + b.m2 + delta * delta * (double)a.finite * wb;
  }
  if (b.ssq == 0.0) {
    r.scale = a.scale;
    r.ssq = a.ssq;
  } else if (a.ssq == 0.0) {
    r.scale = b.scale;
    r.ssq = b.ssq;
  } else if (a.scale >= b.scale) {
    const double f = b.scale / a.scale;
    r.scale = a.scale;
    r.ssq = a.ssq + b.ssq * f * f;
  } else {
    const double f = a.scale / b.scale;
    r.scale = b.scale;
    r.ssq = b.ssq + a.ssq * f * f;
  }
  return r;
}

// Writes the kTableWidth columns: the fields of docs/spec.md section 2 (counts as exact
// doubles, all_finite as 0/1), then the range counts.
static FH_FORCE_INLINE FH_HD void partial_finalize(const Partial& p, double* out) {
  const double nan = fh_nan();
  const double inf = fh_inf();
  const int64_t nan_count = p.n - p.finite - p.posinf - p.neginf;
  const int64_t inf_count = p.posinf + p.neginf;
  const bool any_finite = p.finite > 0;
  const double fmin = any_finite ? p.fmin : nan;
  const double fmax = any_finite ? p.fmax : nan;
  const double fmean = any_finite ? p.mean : nan;
  const double fstd =
      p.finite > 1 ? __builtin_sqrt((p.m2 > 0.0 ? p.m2 : 0.0) / (double)(p.finite - 1)) : nan;
  const double fnorm = p.scale * __builtin_sqrt(p.ssq);

  out[kNumel] = (double)p.n;
  out[kNanCount] = (double)nan_count;
  out[kPosinfCount] = (double)p.posinf;
  out[kNeginfCount] = (double)p.neginf;
  out[kInfCount] = (double)inf_count;
  out[kZeroCount] = (double)p.zero;

  double mn, mx, mean;
  if (p.n == 0 || nan_count > 0) {
    mn = mx = mean = nan;
  } else {
    mn = p.neginf > 0 ? -inf : (any_finite ? p.fmin : inf);
    mx = p.posinf > 0 ? inf : (any_finite ? p.fmax : -inf);
    if (p.posinf > 0 && p.neginf > 0) {
      mean = nan;
    } else if (p.posinf > 0) {
      mean = inf;
    } else if (p.neginf > 0) {
      mean = -inf;
    } else {
      mean = fmean;
    }
  }
  out[kMin] = mn;
  out[kMax] = mx;
  out[kMean] = mean;
  out[kStd] = (nan_count > 0 || inf_count > 0) ? nan : fstd;
  out[kNorm] = nan_count > 0 ? nan : (inf_count > 0 ? inf : fnorm);
  out[kFiniteMin] = fmin;
  out[kFiniteMax] = fmax;
  out[kFiniteMean] = fmean;
  out[kFiniteStd] = fstd;
  out[kFiniteNorm] = fnorm;
  out[kAmax] = any_finite ? (-p.fmin > p.fmax ? -p.fmin : p.fmax) : nan;
  out[kAllFinite] = (nan_count == 0 && inf_count == 0) ? 1.0 : 0.0;
  out[kOverflowCount] = (double)p.over;
  out[kUnderflowCount] = (double)p.under;
}

// Deterministic pairwise merge of parts[0, count): the same tree whatever the thread count,
// and an error that grows with log(count) rather than count.
static inline Partial partial_merge_range(const Partial* parts, int64_t count) {
  if (count <= 0) return partial_empty();
  if (count == 1) return parts[0];
  const int64_t half = count / 2;
  return partial_merge(partial_merge_range(parts, half),
                       partial_merge_range(parts + half, count - half));
}

}  // namespace fasthealth
