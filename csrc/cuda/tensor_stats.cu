// CUDA implementation of fasthealth::multi_tensor_stats: two launches (three with the two-level
// merge) whatever the number of tensors, no host sync, on the current stream.
//   reference: fasthealth/ops/reference.py   kernels: stats_kernels.cuh
//   plan: ../plan.h   work list, staging and their cache: ../work_list.h (shared with Triton)
//
// 1. chunk_stats_cuda: a persistent grid reduces each (tensor, chunk) item of the plan to one
//    record (float32 fast path with float64 accumulation, exact fallbacks: stats_kernels.cuh).
// 2. (only when a tensor has more than kMergeRun chunks) merge_chunks_cuda: one block per run
//    of chunks merges their records.
// 3. merge_finalize_cuda: one block per tensor merges its records in a fixed order and writes
//    its row; the last block to finish merges the tensors into the total. Deterministic: fixed
//    reduction trees, no atomics in the results (one counter picks the block for the total).
// FASTHEALTH_CUDA_CHUNK and FASTHEALTH_MERGE_RUN (read once) set the plan's largest chunk (at
// most the compiled kCudaChunk: the fast path's float32 chains are sized for it) and the
// two-level merge's run, so that one benchmark run can compare settings.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "../inputs.h"
#include "../stats.h"
#include "../work_list.h"
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

// The plan's limits with FASTHEALTH_CUDA_CHUNK / FASTHEALTH_MERGE_RUN applied (read once; a
// value out of range is refused with a warning that names it).
PlanLimits env_limits(PlanLimits lim) {
  static const std::pair<int64_t, int64_t> knobs = [] {
    auto read = [](const char* name, int64_t lo, int64_t hi, bool pow2) -> int64_t {
      const char* v = std::getenv(name);
      if (v == nullptr || *v == 0) return 0;
      char* end = nullptr;
      const long long x = std::strtoll(v, &end, 10);
      if (*end != 0 || x < lo || x > hi || (pow2 && (x & (x - 1)) != 0)) {
        TORCH_WARN("fasthealth: ", name, "=", v, " ignored: an integer in [", lo, ", ", hi,
                   "]", pow2 ? ", a power of two," : "", " is expected");
        return 0;
      }
      return x;
    };
    return std::make_pair(read("FASTHEALTH_CUDA_CHUNK", 1024, kCudaChunk, true),
                          read("FASTHEALTH_MERGE_RUN", 2, int64_t{1} << 30, false));
  }();
  if (knobs.first) {
    lim.max_chunk = knobs.first;
    lim.min_chunk = std::min(lim.min_chunk, knobs.first);
    lim.item_cost = knobs.first / 32;
  }
  if (knobs.second) lim.merge_run = knobs.second;
  return lim;
}

}  // namespace

at::Tensor cuda_stats_table(int64_t n, const std::function<const at::Tensor&(int64_t)>& tensor,
                            double range_hi, double range_lo) {
  check_range(range_hi, range_lo);
  TORCH_CHECK(n > 0, "fasthealth: multi_tensor_stats needs at least one tensor");
  const c10::Device device = tensor(0).device();
  const c10::cuda::CUDAGuard guard(device);
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
                         c10::cuda::CaptureStatus::None;
  std::vector<at::Tensor> staged;  // held until the kernels are launched
  const std::vector<TensorMeta> metas = kernel_inputs(n, tensor, c10::DeviceType::CUDA,
                                                      Grouping::kOne, capturing, &staged);
  const bool ranged = range_hi < fh_inf() || range_lo > 0.0;
  using kernels::kThreads;
  auto* chunk_kernel = ranged ? &kernels::chunk_stats_cuda<true>
                              : &kernels::chunk_stats_cuda<false>;
  const int64_t resident = resident_blocks(chunk_kernel, device.index());
  const DeviceWorkList wl = work_list(metas, device, env_limits(cuda_plan_limits(resident)), {},
                                      capturing);
  const auto opts = at::TensorOptions().device(device).dtype(at::kByte);
  const int64_t record = static_cast<int64_t>(sizeof(Partial));
  at::Tensor parts = at::empty({(wl.n_items + wl.n_runs) * record}, opts);
  // the tensors' records, then merge_finalize_cuda's counter (zeroed by the chunk kernel)
  at::Tensor per_tensor = at::empty({n * record + 16}, opts);
  at::Tensor table = at::empty({n + 1, kTableWidth}, opts.dtype(at::kDouble));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto* p = reinterpret_cast<Partial*>(parts.data_ptr<uint8_t>());
  auto* t = reinterpret_cast<Partial*>(per_tensor.data_ptr<uint8_t>());
  auto* done = reinterpret_cast<unsigned int*>(per_tensor.data_ptr<uint8_t>() + n * record);
  const int64_t grid = wl.n_items < resident ? wl.n_items : resident;
  chunk_kernel<<<grid, kThreads, 0, stream>>>(wl.items(), wl.n_items, p, range_hi, range_lo,
                                               done);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const Partial* records = p;
  const int64_t* first = wl.first();
  if (wl.n_runs > 0) {  // the two-level merge: runs of chunks first, then the runs per tensor
    Partial* r = p + wl.n_items;
    kernels::merge_chunks_cuda<<<wl.n_runs, kernels::kMergeThreads, 0, stream>>>(p, wl.runs(),
                                                                                  r);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    records = r;
    first = wl.run_first();
  }
  kernels::merge_finalize_cuda<<<n, kernels::kMergeThreads, 0, stream>>>(
      records, first, n, t, table.data_ptr<double>(), done);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return table;
}

at::Tensor multi_tensor_stats_cuda(at::TensorList tensors, double range_hi, double range_lo) {
  return cuda_stats_table(
      static_cast<int64_t>(tensors.size()),
      [&](int64_t i) -> const at::Tensor& { return tensors[i]; }, range_hi, range_lo);
}

TORCH_LIBRARY_IMPL(fasthealth, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cuda);
}

}  // namespace fasthealth
