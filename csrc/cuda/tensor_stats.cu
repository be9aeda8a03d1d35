// CUDA implementation of fasthealth::multi_tensor_stats: three launches whatever the number of
// tensors, no host sync, on the current stream.
//   reference: fasthealth/ops/reference.py   kernels: stats_kernels.cuh   work list: multi_tensor.cuh
//
// 1. chunk_stats_cuda: a persistent grid reduces each (tensor, chunk) item to one record
//    (float32 fast path with float64 accumulation, exact fallbacks: see stats_kernels.cuh).
// 2. merge_chunks_cuda: one warp per tensor merges its chunks' records in a fixed order.
// 3. finalize_cuda: one thread per tensor row, then one block merges all tensors into the
//    total. Deterministic: no atomics, fixed reduction trees.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "../inputs.h"
#include "../stats.h"
#include "multi_tensor.cuh"
#include "stats_kernels.cuh"

namespace fasthealth {
namespace {

// The persistent grid: as many blocks as fit on the device at once (asked once per kernel and
// device; a host-side query, no sync).
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int64_t> known;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                               kernels::kThreads, 0));
  const int sms = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  const int64_t blocks = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sms;
  known.emplace(key, blocks);
  return blocks;
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
    const at::Tensor& t = tensors[i];
    if (code == kF8E4M3 || code == kF8E5M2) {  // widened on the device, into a stable buffer
      dense[i] = staged_copy(t, at::kFloat);
      code = kF32;
    } else if (t.is_contiguous() || t.is_non_overlapping_and_dense()) {
      dense[i] = t;  // read as it lies (a transpose covers its memory exactly)
    } else {
      dense[i] = staged_copy(t, t.scalar_type());
    }
    metas[i] = {dense[i].data_ptr(), dense[i].numel(), code, 0};
  }
  const WorkList wl = work_list(metas, device);
  const auto opts = at::TensorOptions().device(device);
  at::Tensor parts = at::empty({wl.n_chunks * static_cast<int64_t>(sizeof(Partial))},
                               opts.dtype(at::kByte));
  at::Tensor per_tensor = at::empty({n * static_cast<int64_t>(sizeof(Partial))},
                                    opts.dtype(at::kByte));
  at::Tensor table = at::empty({n + 1, kTableWidth}, opts.dtype(at::kDouble));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto* p = reinterpret_cast<Partial*>(parts.data_ptr<uint8_t>());
  auto* t = reinterpret_cast<Partial*>(per_tensor.data_ptr<uint8_t>());
  const bool ranged = range_hi < fh_inf() || range_lo > 0.0;
  using kernels::kThreads;
  auto* chunk_kernel = ranged ? &kernels::chunk_stats_cuda<true>
                              : &kernels::chunk_stats_cuda<false>;
  const int64_t resident = resident_blocks(chunk_kernel, device.index());
  const int64_t grid = wl.n_chunks < resident ? wl.n_chunks : resident;
  chunk_kernel<<<grid, kThreads, 0, stream>>>(wl.metas(), wl.chunks(), wl.n_chunks, p, range_hi,
                                              range_lo);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  kernels::merge_chunks_cuda<<<n, kernels::kMergeThreads, 0, stream>>>(p, wl.first(), t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  kernels::finalize_cuda<<<kernels::finalize_blocks(n), kThreads, 0, stream>>>(
      t, n, table.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return table;
}

TORCH_LIBRARY_IMPL(fasthealth, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cuda);
}

}  // namespace fasthealth
