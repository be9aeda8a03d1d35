// Device code of the CUDA backend (launcher: tensor_stats.cu). It includes no torch header, so
// that tests/ops/cuda_emu/ can compile these very kernels for the host, one OS thread per CUDA
// thread, and check them against the reference on a machine without a GPU.
//   reference: fasthealth/ops/reference.py   record and merge: ../stats.h   work plan: ../plan.h
//
// chunk_stats_cuda: a persistent grid walks the plan's (tensor, chunk) items, largest first;
// each block reduces one item at a time to one Partial record, and loads the next item while
// it reduces this one. Float32, float16 and bfloat16 chunks take the fast
// path, the same method as the CPU kernel (csrc/cpu/stats_kernel.h):
//   pass 1: 16-byte vector loads (4 in flight per thread); each vector's sum and sum of squares
//     in float32 (a chain of at most 8 terms), added into float64 per thread; min/max and
//     counts in float32 (exact: a chunk has at most 2^24 elements); a deterministic butterfly
//     (warp shuffles, then the 8 warp sums) gives every thread the chunk's sums. The chunk is
//     final here unless
//       - a sum is not finite (a NaN or an inf in the chunk, or a square above float32's range),
//       - its largest |x| is below 2^-40 (squares would lose bits to float32 underflow), or
//       - the variance cancels (sum x^2 > 64 * M2: the mean dominates the spread);
//   pass 2 (cancellation only): the same sums around c = the chunk's mean rounded to float32,
//     so M2 = sum (x-c)^2 - (sum (x-c))^2 / n no longer cancels;
//   masked pass (a sum is not finite while the largest |x| is not a finite extreme: NaN/Inf
//     elements): the same loads and sums over the finite elements only (each element's
//     finiteness test predicates its sums, min/max and count), with finite, +inf and -inf
//     counted per thread; it is final unless its finite values need the shifted pass (its
//     masked form) or the slow path. A block whose last chunk held NaN/Inf reads its next
//     chunk masked first (a NaN-filled tensor is read once); on finite data the masked sums
//     are bitwise those of pass 1;
//   slow path (tiny, extreme, float64, integers): one float64 value per element, sums around
//     each thread's first value, Blue's three-bin sum of squares (no overflow or underflow for
//     any float64), Chan's formula over a fixed tree of the block's threads, NaN/inf counted.
// Accuracy of the fast path: each float32 term carries at most ~10 roundings of 2^-24, so
// sums are within ~6e-7 of sum |term|: norm within 1e-6, mean within 6e-7 * mean|x|, M2 within
// 64 * 1.2e-6 (std within 4e-5), inside the tolerances of docs/spec.md section 2.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "../stats.h"
#include "../plan.h"

// Test hook: tests/ops/cuda_emu/ counts the chunks each path finishes (0 fast, 1 shifted, 2 slow,
// 3 masked).
#ifndef FH_COUNT_PATH
#define FH_COUNT_PATH(path)
#endif

namespace fasthealth {
namespace kernels {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
// float32 chains of at most 8 terms per thread before float64 (stats.h: the fast path's limits)
constexpr double kMaxCancel = kCancelBudget / 8;

__device__ __forceinline__ bool finite64(double x) { return fabs(x) < fh_inf(); }

// ---- element types of the fast path: elements per 16 bytes, unpacking, single loads --------

struct F32 {
  static constexpr int kPer = 4, kSize = 4;
  __device__ __forceinline__ static void unpack(const uint4& r, float* x) {
    x[0] = __uint_as_float(r.x);
    x[1] = __uint_as_float(r.y);
    x[2] = __uint_as_float(r.z);
    x[3] = __uint_as_float(r.w);
  }
  __device__ __forceinline__ static float load1(const void* p, int64_t i) {
    return static_cast<const float*>(p)[i];
  }
};

struct BF16 {  // bfloat16 is the top half of a float32
  static constexpr int kPer = 8, kSize = 2;
  __device__ __forceinline__ static void unpack(const uint4& r, float* x) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = __uint_as_float(w[k] << 16);
      x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static float load1(const void* p, int64_t i) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  }
};

struct F16 {
  static constexpr int kPer = 8, kSize = 2;
  __device__ __forceinline__ static void unpack(const uint4& r, float* x) {
    const __half* h = reinterpret_cast<const __half*>(&r);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = __half2float(h[k]);
  }
  __device__ __forceinline__ static float load1(const void* p, int64_t i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
};

// ---- the fast path's sums --------------------------------------------------------------------

// Counts are float: exact up to 2^24 (a chunk has at most kCudaChunk elements), and
// `n += (x == 0)` in float compiles to FSET + FADD, where an int count takes three
// instructions (FSETP, add, predicated move back): a third fewer instructions per element.
struct Sums {
  double s;  // sum of (x - c)
  double q;  // sum of (x - c)^2; with c = 0 (pass 1) the sum of squares
  float mn, mx;
  float zero, over, under;  // counts, at most kCudaChunk each (under: |x| < lo, zeros too)
  float fin, pinf, ninf;    // masked passes only: finite, +inf and -inf elements
};
static_assert(kCudaChunk <= (int64_t{1} << 24), "float counts in Sums must stay exact");

__device__ __forceinline__ Sums sums_empty() {
  Sums a;
  a.s = a.q = 0.0;
  a.mn = __builtin_huge_valf();
  a.mx = -__builtin_huge_valf();
  a.zero = a.over = a.under = 0.0f;
  a.fin = a.pinf = a.ninf = 0.0f;
  return a;
}

// Adds K elements: float32 within them, float64 across.
template <int K, bool kShift, bool kRange>
__device__ __forceinline__ void add_elems(Sums& a, const float* x, float c, float hi,
                                          float lo) {
  const float d0 = kShift ? x[0] - c : x[0];
  float s = d0, q = d0 * d0;  // (not 0 + d0: one add fewer per vector)
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (k > 0) {
      const float d = kShift ? x[k] - c : x[k];
      s += d;
      q = fmaf(d, d, q);
    }
    a.mn = fminf(a.mn, x[k]);
    a.mx = fmaxf(a.mx, x[k]);
    a.zero += x[k] == 0.0f ? 1.0f : 0.0f;
    if (kRange) {
      const float ax = fabsf(x[k]);
      a.over += ax > hi ? 1.0f : 0.0f;
      a.under += ax < lo ? 1.0f : 0.0f;  // zeros included here, taken out in fast_chunk
    }
  }
  a.s += static_cast<double>(s);
  a.q += static_cast<double>(q);
}

// The masked form of add_elems: non-finite elements are left out of the sums (the same sum
// order, so finite data gives the same bits), min/max and the range counts; finite, +inf and
// -inf elements are counted. Every finite-only update is an instruction predicated on the one
// finiteness test: a select of the value or 0 before each update cost an instruction more.
// The range counts compare |x| itself: NaN is neither over nor under and inf is not under, so
// only the infinities need taking out of over, which the caller does with the +inf/-inf counts.
template <int K, bool kShift, bool kRange>
__device__ __forceinline__ void add_elems_masked(Sums& a, const float* x, float c, float hi,
                                                 float lo) {
  float s = 0.0f, q = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float v = x[k];
    const bool f = fabsf(v) < __builtin_huge_valf();  // false for NaN
    if (f) {
      const float d = kShift ? v - c : v;
      s += d;
      q = fmaf(d, d, q);
      a.mn = fminf(a.mn, v);
      a.mx = fmaxf(a.mx, v);
      a.fin += 1.0f;
    }
    a.zero += v == 0.0f ? 1.0f : 0.0f;
    a.pinf += v == __builtin_huge_valf() ? 1.0f : 0.0f;
    a.ninf += v == -__builtin_huge_valf() ? 1.0f : 0.0f;
    if (kRange) {
      const float ax = fabsf(v);
      a.over += ax > hi ? 1.0f : 0.0f;   // +inf and -inf too (hi < inf): the caller takes them out
      a.under += ax < lo ? 1.0f : 0.0f;  // zeros too: the caller takes them out
    }
  }
  a.s += static_cast<double>(s);
  a.q += static_cast<double>(q);
}

template <int K, bool kShift, bool kRange, bool kMask>
__device__ __forceinline__ void add_any(Sums& a, const float* x, float c, float hi, float lo) {
  if constexpr (kMask) {
    add_elems_masked<K, kShift, kRange>(a, x, c, hi, lo);
  } else {
    add_elems<K, kShift, kRange>(a, x, c, hi, lo);
  }
}

// One thread's share of elements [begin, end) of a tensor: the elements before the first
// 16-byte boundary and after the last whole vector one at a time, the vectors between four
// loads at a time.
template <typename V, bool kShift, bool kRange, bool kMask = false>
__device__ Sums thread_sums(const void* ptr, int64_t begin, int64_t end, float c, float hi,
                            float lo) {
  Sums a = sums_empty();
  const char* base = static_cast<const char*>(ptr);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(base + begin * V::kSize);
  int64_t head = static_cast<int64_t>(((16 - (addr & 15)) & 15) / V::kSize);
  if (head > end - begin) head = end - begin;
  const int64_t vbegin = begin + head;
  const int64_t nvec = (end - vbegin) / V::kPer;
  const uint4* vp = reinterpret_cast<const uint4*>(base + vbegin * V::kSize);
  int64_t v = threadIdx.x;
  // Zero, though the compiler cannot know it (end >= 0). Or-ing the fourth vector's first word,
  // masked by it, into the first vector's makes the first use of the first load wait for the
  // fourth, so ptxas issues all four before any is used: without it, it sank the fourth load
  // past the first one's use (and into its registers) in about half of the loops, two memory
  // latencies an iteration. One LOP3 an iteration (tests/ops/test_cuda_build.py reads the SASS).
  const uint32_t opaque_zero = static_cast<uint32_t>(-static_cast<int32_t>(end < 0));
  for (; v + 3 * kThreads < nvec; v += 4 * kThreads) {
    uint4 r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = __ldg(vp + v + u * kThreads);
    r[0].x |= r[3].x & opaque_zero;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      float x[V::kPer];
      V::unpack(r[u], x);
      add_any<V::kPer, kShift, kRange, kMask>(a, x, c, hi, lo);
    }
  }
  for (; v < nvec; v += kThreads) {
    float x[V::kPer];
    V::unpack(__ldg(vp + v), x);
    add_any<V::kPer, kShift, kRange, kMask>(a, x, c, hi, lo);
  }
  const int64_t tail = vbegin + nvec * V::kPer;
  const int64_t rest = head + (end - tail);
  for (int64_t j = threadIdx.x; j < rest; j += kThreads) {
    const float x = V::load1(ptr, j < head ? begin + j : tail + (j - head));
    add_any<1, kShift, kRange, kMask>(a, &x, c, hi, lo);
  }
  return a;
}

// Butterfly over the warp: every lane ends with the same (bitwise) totals, since each step
// adds the same two values in either order.
template <bool kMask>
__device__ __forceinline__ Sums warp_sums(Sums a) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    a.s += __shfl_xor_sync(kFullMask, a.s, m);
    a.q += __shfl_xor_sync(kFullMask, a.q, m);
    a.mn = fminf(a.mn, __shfl_xor_sync(kFullMask, a.mn, m));
    a.mx = fmaxf(a.mx, __shfl_xor_sync(kFullMask, a.mx, m));
    a.zero += __shfl_xor_sync(kFullMask, a.zero, m);
    a.over += __shfl_xor_sync(kFullMask, a.over, m);
    a.under += __shfl_xor_sync(kFullMask, a.under, m);
    if (kMask) {
      a.fin += __shfl_xor_sync(kFullMask, a.fin, m);
      a.pinf += __shfl_xor_sync(kFullMask, a.pinf, m);
      a.ninf += __shfl_xor_sync(kFullMask, a.ninf, m);
    }
  }
  return a;
}

// The block's totals in every thread (each warp reduces the kWarps warp totals itself).
template <bool kMask = false>
__device__ __forceinline__ Sums block_sums(Sums a, Sums* smem) {
  a = warp_sums<kMask>(a);
  const int lane = threadIdx.x & 31;
  if (lane == 0) smem[threadIdx.x >> 5] = a;
  __syncthreads();
  Sums t = lane < kWarps ? smem[lane] : sums_empty();
  t = warp_sums<kMask>(t);
  __syncthreads();  // smem is reused by the next call
  return t;
}

// ---- the slow path: one float64 per element, Chan's merge over a fixed tree ----------------

// Blue's three bins for the sum of squares in float64: no overflow or underflow for any
// float64 value (|x| above 2^500 is scaled by 2^-600, below 2^-500 by 2^600).
constexpr double kBlueBig = 3.273390607896142e+150;        // 2^500
constexpr double kBlueBigScale = 2.409919865102884e-181;   // 2^-600
constexpr double kBlueSmall = 3.054936363499605e-151;      // 2^-500
constexpr double kBlueSmallScale = 4.149515568880993e+180; // 2^600

struct ThreadAcc {
  int64_t finite = 0, posinf = 0, neginf = 0, zero = 0, over = 0, under = 0;
  double fmin = fh_inf(), fmax = -fh_inf();
  double c = 0.0, s = 0.0, q = 0.0;  // shift (the first finite value), sums of (v - c), (v - c)^2
  double big = 0.0, mid = 0.0, small = 0.0;  // sums of squares by magnitude (Blue)

  __device__ __forceinline__ void add(double v, double hi, double lo) {
    if (v != v) return;
    if (v == fh_inf()) {
      ++posinf;
    } else if (v == -fh_inf()) {
      ++neginf;
    } else {
      if (finite == 0) c = v;
      ++finite;
      zero += v == 0.0;
      fmin = fmin < v ? fmin : v;
      fmax = fmax > v ? fmax : v;
      const double d = v - c;
      s += d;
      q += d * d;
      const double a = fabs(v);
      if (a > kBlueBig) {
        const double y = a * kBlueBigScale;
        big += y * y;
      } else if (a < kBlueSmall) {
        const double y = a * kBlueSmallScale;
        small += y * y;
      } else {
        mid += a * a;
      }
      over += a > hi;
      under += a < lo && a > 0.0;
    }
  }

  // ~kCudaChunk / kThreads elements per thread, summed around the thread's first value.
  __device__ __forceinline__ Partial to_partial() const {
    Partial p = partial_empty();
    p.n = finite + posinf + neginf;  // the chunk's NaNs are added back by its element count
    p.finite = finite;
    p.posinf = posinf;
    p.neginf = neginf;
    p.zero = zero;
    p.over = over;
    p.under = under;
    p.fmin = fmin;
    p.fmax = fmax;
    if (finite > 0) {
      const double ds = s / static_cast<double>(finite);
      p.mean = c + ds;
      const double m2 = q - s * ds;
      p.m2 = m2 > 0.0 ? m2 : 0.0;
    }
    if (big > 0.0) {  // the mid bin in the big bin's scale (the small bin is far below)
      p.scale = 1.0 / kBlueBigScale;
      p.ssq = big + (mid * kBlueBigScale) * kBlueBigScale;
    } else if (mid > 0.0) {
      p.ssq = mid + (small / kBlueSmallScale) / kBlueSmallScale;
    } else {
      p.scale = 1.0 / kBlueSmallScale;
      p.ssq = small;
    }
    return p;
  }
};

__device__ __forceinline__ double load_one(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case kF32: return static_cast<const float*>(base)[i];
    case kF64: return static_cast<const double*>(base)[i];
    case kF16: return F16::load1(base, i);
    case kBF16: return BF16::load1(base, i);
    case kI8: return static_cast<const int8_t*>(base)[i];
    case kU8:
    case kBool: return static_cast<const uint8_t*>(base)[i];
    case kI16: return static_cast<const int16_t*>(base)[i];
    case kI32: return static_cast<const int32_t*>(base)[i];
    case kI64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    default: return fh_nan();
  }
}

// Deterministic block-wide merge of one Partial per thread (kN threads): a fixed tree over
// thread indices; every thread gets the result.
template <int kN>
__device__ Partial block_merge(Partial p, Partial* shared) {
  const int tid = threadIdx.x;
  shared[tid] = p;
  __syncthreads();
  for (int stride = kN / 2; stride > 0; stride /= 2) {
    if (tid < stride) shared[tid] = partial_merge(shared[tid], shared[tid + stride]);
    __syncthreads();
  }
  const Partial r = shared[0];
  __syncthreads();
  return r;
}

// A range threshold as the reference applies it (docs/spec.md section 2): rounded to float32
// for inputs of 32 bits or fewer, as the fast path's float32 lanes compare, so that every chunk
// of a tensor, whichever path finishes it, and every backend count against the same value;
// float64 and int64 inputs compare against the double itself.
__device__ __forceinline__ double threshold_of(int dtype, double x) {
  return dtype == kF64 || dtype == kI64 ? x : static_cast<double>(static_cast<float>(x));
}

__device__ Partial slow_chunk(const void* ptr, int dtype, int64_t begin, int64_t end, double hi,
                              double lo, Partial* shared) {
  hi = threshold_of(dtype, hi);
  lo = threshold_of(dtype, lo);
  ThreadAcc acc;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreads) {
    acc.add(load_one(ptr, dtype, j), hi, lo);
  }
  Partial p = block_merge<kThreads>(acc.to_partial(), shared);
  p.n = end - begin;  // NaNs counted here
  if (threadIdx.x == 0) FH_COUNT_PATH(2);
  return p;
}

// ---- one chunk -------------------------------------------------------------------------------

// Largest |x| whose float32 chains of 8 squares cannot overflow (2^62): non-finite sums under it
// (or with an infinite min/max: pass 1's min/max see +-inf, not NaN) mean NaN/Inf elements.
constexpr double kSquaresFit = 4.611686018427388e+18;

// A chunk holding NaN/Inf: the masked passes (finite elements only, NaN/+inf/-inf counted);
// finite values that the fast path cannot serve exactly (tiny, extreme) go to slow_chunk.
// The finite elements' range and moments of a chunk's record, from its block sums (the fast
// and the masked passes end alike).
__device__ __forceinline__ Partial with_moments(Partial p, const Sums& a, double mean,
                                                double m2) {
  p.fmin = a.mn;
  p.fmax = a.mx;
  p.mean = mean;
  p.m2 = m2 > 0.0 ? m2 : 0.0;
  p.ssq = a.q;
  return p;
}

template <typename V, bool kRange>
__device__ Partial masked_chunk(const void* ptr, int dtype, int64_t begin, int64_t end, double hi,
                                double lo, Partial* shared, Sums* smem) {
  const float hf = static_cast<float>(hi), lf = static_cast<float>(lo);
  const Sums a = block_sums<true>(
      thread_sums<V, false, kRange, true>(ptr, begin, end, 0.0f, hf, lf), smem);
  Partial p = partial_empty();
  p.n = end - begin;
  p.finite = static_cast<int64_t>(a.fin);
  p.posinf = static_cast<int64_t>(a.pinf);
  p.neginf = static_cast<int64_t>(a.ninf);
  p.zero = static_cast<int64_t>(a.zero);
  // finite |x| > hi: a.over counted the infinities too, unless hi is inf (range_lo alone)
  p.over = kRange ? static_cast<int64_t>(hf < __builtin_huge_valf() ? a.over - a.pinf - a.ninf
                                                                    : a.over)
                  : 0;
  // 0 < |x| < lo: a.under holds the zeros too. Tested on lf, the threshold that was counted
  // against: a lo that rounds to 0 in float32 counted nothing, and taking the zeros out of
  // nothing would leave a negative count.
  p.under = kRange && lf > 0.0f ? static_cast<int64_t>(a.under - a.zero) : 0;
  if (p.finite == 0) {
    if (threadIdx.x == 0) FH_COUNT_PATH(3);
    return p;
  }
  const double n = static_cast<double>(a.fin);
  const double amax = fmax(-static_cast<double>(a.mn), static_cast<double>(a.mx));
  if (!finite64(a.s) || !finite64(a.q) || (amax > 0.0 && amax < kFastMinAmax)) {
    return slow_chunk(ptr, dtype, begin, end, hi, lo, shared);
  }
  double mean = a.s / n;
  double m2 = a.q - a.s * mean;
  if (!(a.q <= kMaxCancel * m2)) {
    const float c = static_cast<float>(mean);
    const Sums b = block_sums<true>(
        thread_sums<V, true, false, true>(ptr, begin, end, c, hf, lf), smem);
    if (!finite64(b.s) || !finite64(b.q)) return slow_chunk(ptr, dtype, begin, end, hi, lo, shared);
    mean = static_cast<double>(c) + b.s / n;
    m2 = b.q - b.s * (b.s / n);
  }
  if (threadIdx.x == 0) FH_COUNT_PATH(3);
  return with_moments(p, a, mean, m2);
}

// masked_first: this block's previous chunk held NaN/Inf, so this one is read masked first (the
// same result on finite data, one pass instead of two on a NaN-laden tensor).
template <typename V, bool kRange>
__device__ Partial fast_chunk(const void* ptr, int dtype, int64_t begin, int64_t end, double hi,
                              double lo, Partial* shared, Sums* smem, bool masked_first) {
  if (masked_first) return masked_chunk<V, kRange>(ptr, dtype, begin, end, hi, lo, shared, smem);
  const float hf = static_cast<float>(hi), lf = static_cast<float>(lo);
  const Sums a = block_sums(thread_sums<V, false, kRange>(ptr, begin, end, 0.0f, hf, lf), smem);
  const double n = static_cast<double>(end - begin);
  const double amax = fmax(-static_cast<double>(a.mn), static_cast<double>(a.mx));
  // (every thread holds the same totals, so every thread takes the same branch)
  if (!finite64(a.s) || !finite64(a.q)) {
    if (amax > kSquaresFit && amax < fh_inf()) {  // finite extremes (NaN possibly too)
      return slow_chunk(ptr, dtype, begin, end, hi, lo, shared);
    }
    return masked_chunk<V, kRange>(ptr, dtype, begin, end, hi, lo, shared, smem);
  }
  if (amax > 0.0 && amax < kFastMinAmax) return slow_chunk(ptr, dtype, begin, end, hi, lo, shared);
  double mean = a.s / n;
  double m2 = a.q - a.s * mean;
  const bool shifted = !(a.q <= kMaxCancel * m2);
  if (shifted) {
    const float c = static_cast<float>(mean);
    const Sums b = block_sums(thread_sums<V, true, false>(ptr, begin, end, c, hf, lf), smem);
    if (!finite64(b.s) || !finite64(b.q)) {  // (x - c)^2 beyond float32: far apart extremes
      return slow_chunk(ptr, dtype, begin, end, hi, lo, shared);
    }
    mean = static_cast<double>(c) + b.s / n;
    m2 = b.q - b.s * (b.s / n);
  }
  if (threadIdx.x == 0) FH_COUNT_PATH(shifted ? 1 : 0);
  Partial p = partial_empty();
  p.n = p.finite = end - begin;
  p.zero = static_cast<int64_t>(a.zero);
  p.over = kRange ? static_cast<int64_t>(a.over) : 0;
  p.under = kRange && lf > 0.0f ? static_cast<int64_t>(a.under - a.zero) : 0;  // as masked_chunk
  return with_moments(p, a, mean, m2);
}

// ---- the three kernels -----------------------------------------------------------------------

// One record per item, at its slot. kRange: range counts were asked for (range_hi < inf or
// range_lo > 0). The next item's record is loaded before this one is reduced: it arrives while
// the block works, instead of stalling the block between items.
// At least 2 blocks an SM, not 3: under the 85-register budget of 3 blocks ptxas reused the
// first load's registers for the fourth in the 16-bit loops, so an iteration waited on memory
// twice; the budget of 2 blocks (128 registers) leaves room for four loads in flight, and
// thread_sums' opaque dependency makes ptxas issue them all before the first use in every loop
// (tests/ops/test_cuda_build.py checks it, and that nothing spills).
template <bool kRange>
__global__ void __launch_bounds__(kThreads, 2)
chunk_stats_cuda(const ChunkItem* items, int64_t n_items, Partial* parts, double hi, double lo,
                 unsigned int* done) {
  __shared__ Partial shared[kThreads];
  __shared__ Sums smem[kWarps];
  if (blockIdx.x == 0 && threadIdx.x == 0) *done = 0u;  // merge_finalize_cuda's counter
  int64_t c = blockIdx.x;
  if (c >= n_items) return;
  ChunkItem next = items[c];
  bool masked_first = false;  // the same in every thread: records are block-wide
  for (; c < n_items; c += gridDim.x) {
    const ChunkItem item = next;
    if (c + gridDim.x < n_items) next = items[c + gridDim.x];
    const int64_t end = item.begin + item.count;
    Partial p;
    if (item.count <= 0) {
      p = partial_empty();
    } else if (item.dtype == kF32) {
      p = fast_chunk<F32, kRange>(item.ptr, item.dtype, item.begin, end, hi, lo, shared, smem,
                                   masked_first);
    } else if (item.dtype == kBF16) {
      p = fast_chunk<BF16, kRange>(item.ptr, item.dtype, item.begin, end, hi, lo, shared, smem,
                                   masked_first);
    } else if (item.dtype == kF16) {
      p = fast_chunk<F16, kRange>(item.ptr, item.dtype, item.begin, end, hi, lo, shared, smem,
                                   masked_first);
    } else {
      p = slow_chunk(item.ptr, item.dtype, item.begin, end, hi, lo, shared);
    }
    masked_first = p.finite != p.n;
    if (threadIdx.x == 0) parts[item.slot] = p;
  }
}

// One block per segment merges records [first[i], first[i+1]) in a fixed order (strided
// over the threads, then block_merge's fixed tree): the first level of the two-level merge
// (plan.h), one block a run of chunks.
constexpr int kMergeThreads = 128;

// Records [begin, end) merged in a fixed order by a block of kMergeThreads: strided over the
// threads, then block_merge's tree; every thread gets the result.
__device__ __forceinline__ Partial segment_merge(const Partial* parts, int64_t begin,
                                                 int64_t end, Partial* shared) {
  Partial acc = partial_empty();
  for (int64_t c = begin + threadIdx.x; c < end; c += kMergeThreads) {
    acc = partial_merge(acc, parts[c]);
  }
  return block_merge<kMergeThreads>(acc, shared);
}

__global__ void __launch_bounds__(kMergeThreads)
merge_chunks_cuda(const Partial* parts, const int64_t* first, Partial* merged) {
  __shared__ Partial shared[kMergeThreads];
  const int64_t i = blockIdx.x;
  const Partial r = segment_merge(parts, first[i], first[i + 1], shared);
  if (threadIdx.x == 0) merged[i] = r;
}

// The last launch: block i merges tensor i's records [first[i], first[i+1]) in a fixed order
// and writes its row of the table; the last block to finish (counted in `done`, which the
// chunk kernel zeroed and this block resets) merges the n tensors' records, in index order,
// into the total row. Deterministic and free of atomics in the results: the counter only
// picks which block does the total, and any block computes the same bits from the same
// records. The fences order each block's record before its count, and the count before the
// last block's reads (the pattern of CUDA's threadFenceReduction sample).
__global__ void __launch_bounds__(kMergeThreads)
merge_finalize_cuda(const Partial* parts, const int64_t* first, int64_t n, Partial* per_tensor,
                    double* table, unsigned int* done) {
  __shared__ Partial shared[kMergeThreads];
  __shared__ bool last;
  const int64_t i = blockIdx.x;
  const Partial r = segment_merge(parts, first[i], first[i + 1], shared);
  if (threadIdx.x == 0) {
    per_tensor[i] = r;
    __threadfence();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  Partial total = r;
  if (last) {  // the same in every thread of the block
    __threadfence();
    total = segment_merge(per_tensor, 0, n, shared);
    if (threadIdx.x == 0) *done = 0u;  // ready for the next call and the next graph replay
  }
  if (threadIdx.x == 0) partial_finalize(r, table + i * kTableWidth);
  if (last && threadIdx.x == 1) partial_finalize(total, table + n * kTableWidth);
}

}  // namespace kernels
}  // namespace fasthealth
