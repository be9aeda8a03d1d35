// CUDA implementation of fasthealth::multi_tensor_stats: three launches whatever the number of
// tensors, no host sync, on the current stream.
//   reference: fasthealth/reference.py   record and merge: ../stats.h   work list: multi_tensor.cuh
//
// 1. chunk_stats_cuda: a persistent grid walks the (tensor, chunk) work list. Each thread reads
//    its elements with 16-byte vector loads where the tensor is aligned, accumulating counts,
//    finite min/max, and float64 sums of x and x^2 (float64 keeps the unshifted variance well
//    conditioned: ~256 elements per thread, error ~256 * 1e-16 * (mean/std)^2); threads merge
//    into one Partial per chunk with Chan's formula in a fixed tree order.
// 2. merge_chunks_cuda: one block per tensor merges its chunks' records in a fixed order.
// 3. finalize_cuda: block i < N writes tensor i's row; block N merges all tensors into the total.
// Limitation: float64 inputs above ~1e150 overflow the sum of squares here (the CPU kernel
// scales them); float32/16/bf16 inputs cannot.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <vector>

#include "../inputs.h"
#include "../stats.h"
#include "multi_tensor.cuh"

namespace fasthealth {
namespace {

constexpr int kThreads = 256;

struct ThreadAcc {
  int64_t finite = 0, posinf = 0, neginf = 0, zero = 0, over = 0, under = 0;
  double fmin = __builtin_huge_val(), fmax = -__builtin_huge_val(), s = 0.0, q = 0.0;

  __device__ __forceinline__ void add(double v, double hi, double lo) {
    if (v != v) return;
    if (v == __builtin_huge_val()) {
      ++posinf;
    } else if (v == -__builtin_huge_val()) {
      ++neginf;
    } else {
      ++finite;
      zero += v == 0.0;
      fmin = fmin < v ? fmin : v;
      fmax = fmax > v ? fmax : v;
      s += v;
      q += v * v;
      const double a = fabs(v);
      over += a > hi;
      under += a < lo && a > 0.0;
    }
  }

  __device__ __forceinline__ Partial to_partial() const {
    Partial p = partial_empty();
    p.n = finite + posinf + neginf;  // NaNs are added back by the chunk's element count
    p.finite = finite;
    p.posinf = posinf;
    p.neginf = neginf;
    p.zero = zero;
    p.over = over;
    p.under = under;
    p.fmin = fmin;
    p.fmax = fmax;
    if (finite > 0) {
      p.mean = s / (double)finite;
      const double m2 = q - s * p.mean;
      p.m2 = m2 > 0.0 ? m2 : 0.0;
    }
    p.ssq = q;
    return p;
  }
};

__device__ __forceinline__ double load_one(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case kF32: return static_cast<const float*>(base)[i];
    case kF64: return static_cast<const double*>(base)[i];
    case kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case kI8: return static_cast<const int8_t*>(base)[i];
    case kU8:
    case kBool: return static_cast<const uint8_t*>(base)[i];
    case kI16: return static_cast<const int16_t*>(base)[i];
    case kI32: return static_cast<const int32_t*>(base)[i];
    case kI64: return (double)static_cast<const int64_t*>(base)[i];
    default: return __builtin_nan("");
  }
}

// Adds elements [begin, end) of one tensor to this thread's accumulator: 16-byte vector loads
// for float32/float16/bfloat16 when aligned, scalar loads otherwise.
__device__ void accumulate(ThreadAcc& acc, const TensorMeta& m, int64_t begin, int64_t end,
                           double hi, double lo) {
  const int tid = threadIdx.x;
  int64_t i = begin;
  if (m.aligned && (m.dtype == kF32 || m.dtype == kF16 || m.dtype == kBF16)) {
    const int per = m.dtype == kF32 ? 4 : 8;  // elements per 16 bytes
    const int64_t vec_end = begin + (end - begin) / per * per;
    for (int64_t v = begin / per + tid; v < vec_end / per; v += blockDim.x) {
      const uint4 raw = reinterpret_cast<const uint4*>(m.ptr)[v];
      if (m.dtype == kF32) {
        const float* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
        for (int k = 0; k < 4; ++k) acc.add(f[k], hi, lo);
      } else if (m.dtype == kF16) {
        const __half* h = reinterpret_cast<const __half*>(&raw);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc.add(__half2float(h[k]), hi, lo);
      } else {
        const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc.add(__bfloat162float(b[k]), hi, lo);
      }
    }
    i = vec_end;
  }
  for (int64_t j = i + tid; j < end; j += blockDim.x) acc.add(load_one(m.ptr, m.dtype, j), hi, lo);
}

// Deterministic block-wide merge: a fixed tree over thread indices.
__device__ Partial block_merge(Partial p, Partial* shared) {
  const int tid = threadIdx.x;
  shared[tid] = p;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (tid < stride) shared[tid] = partial_merge(shared[tid], shared[tid + stride]);
    __syncthreads();
  }
  Partial r = shared[0];
  __syncthreads();
  return r;
}

__global__ void __launch_bounds__(kThreads)
chunk_stats_cuda(const TensorMeta* metas, const ChunkItem* chunks, int64_t n_chunks,
                 Partial* parts, double hi, double lo) {
  __shared__ Partial shared[kThreads];
  for (int64_t c = blockIdx.x; c < n_chunks; c += gridDim.x) {
    const ChunkItem item = chunks[c];
    const TensorMeta m = metas[item.tensor];
    const int64_t end = item.begin + kCudaChunk < m.numel ? item.begin + kCudaChunk : m.numel;
    ThreadAcc acc;
    accumulate(acc, m, item.begin, end, hi, lo);
    Partial p = block_merge(acc.to_partial(), shared);
    if (threadIdx.x == 0) {
      p.n = end > item.begin ? end - item.begin : 0;  // NaNs counted here
      parts[c] = p;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
merge_chunks_cuda(const Partial* parts, const int64_t* first, Partial* per_tensor) {
  __shared__ Partial shared[kThreads];
  const int64_t i = blockIdx.x;
  Partial acc = partial_empty();
  for (int64_t c = first[i] + threadIdx.x; c < first[i + 1]; c += blockDim.x) {
    acc = partial_merge(acc, parts[c]);
  }
  const Partial r = block_merge(acc, shared);
  if (threadIdx.x == 0) per_tensor[i] = r;
}

__global__ void __launch_bounds__(kThreads)
finalize_cuda(const Partial* per_tensor, int64_t n, double* table) {
  __shared__ Partial shared[kThreads];
  const int64_t row = blockIdx.x;
  if (row < n) {
    if (threadIdx.x == 0) partial_finalize(per_tensor[row], table + row * kTableWidth);
    return;
  }
  Partial acc = partial_empty();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc = partial_merge(acc, per_tensor[i]);
  const Partial total = block_merge(acc, shared);
  if (threadIdx.x == 0) partial_finalize(total, table + n * kTableWidth);
}

}  // namespace

at::Tensor multi_tensor_stats_cuda(at::TensorList tensors, double range_hi, double range_lo) {
  check_range(range_hi, range_lo);
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(n > 0, "fasthealth: multi_tensor_stats needs at least one tensor");
  const c10::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  std::vector<at::Tensor> dense(n);
  std::vector<TensorMeta> metas(n);
  for (int64_t i = 0; i < n; ++i) {
    check_input(tensors[i], i, c10::DeviceType::CUDA);
    TORCH_CHECK(tensors[i].device() == device, "fasthealth: input ", i, " is on ",
                tensors[i].device(), ", input 0 on ", device);
    int code = dtype_code(tensors[i], i);
    dense[i] = dense_view(tensors[i]);
    if (code == kF8E4M3 || code == kF8E5M2) {  // widened on the device
      dense[i] = dense[i].to(at::kFloat);
      code = kF32;
    }
    const auto addr = reinterpret_cast<uintptr_t>(dense[i].data_ptr());
    metas[i] = {dense[i].data_ptr(), dense[i].numel(), code, (addr % 16 == 0) ? 1 : 0};
  }
  const WorkList wl = work_list(metas, device);
  const auto opts = at::TensorOptions().device(device);
  at::Tensor parts = at::empty({wl.n_chunks * static_cast<int64_t>(sizeof(Partial))},
                               opts.dtype(at::kByte));
  at::Tensor per_tensor = at::empty({n * static_cast<int64_t>(sizeof(Partial))},
                                    opts.dtype(at::kByte));
  at::Tensor table = at::empty({n + 1, kTableWidth}, opts.dtype(at::kDouble));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t grid = wl.n_chunks < 4LL * sms ? wl.n_chunks : 4LL * sms;
  auto* p = reinterpret_cast<Partial*>(parts.data_ptr<uint8_t>());
  auto* t = reinterpret_cast<Partial*>(per_tensor.data_ptr<uint8_t>());
  chunk_stats_cuda<<<grid, kThreads, 0, stream>>>(wl.metas(), wl.chunks(), wl.n_chunks, p,
                                                  range_hi, range_lo);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  merge_chunks_cuda<<<n, kThreads, 0, stream>>>(p, wl.first(), t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  finalize_cuda<<<n + 1, kThreads, 0, stream>>>(t, n, table.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // (widened float8 copies are freed here: the caching allocator is stream-ordered, so their
  // memory is reused only by work queued after these kernels on this stream)
  return table;
}

TORCH_LIBRARY_IMPL(fasthealth, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cuda);
}

}  // namespace fasthealth
