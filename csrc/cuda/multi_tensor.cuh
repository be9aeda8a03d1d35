// Work list of (tensor, chunk) items over many tensors, kept on the device.
//
// Unlike apex's multi_tensor_apply (metadata in kernel parameters, one launch per ~100
// tensors), the list lives in a device buffer so that one launch covers any number of
// tensors. The buffer is built once per set of input pointers and cached: a repeated call with
// the same tensors copies nothing to the device, which is what CUDA-graph capture needs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <list>
#include <mutex>
#include <utility>
#include <vector>

#include "work_items.h"

namespace fasthealth {

struct WorkList {
  at::Tensor buffer;  // uint8 on the device: [TensorMeta x n][ChunkItem x c][int64 first x n+1]
  int64_t n_tensors = 0;
  int64_t n_chunks = 0;
  const TensorMeta* metas() const {
    return reinterpret_cast<const TensorMeta*>(buffer.data_ptr<uint8_t>());
  }
  const ChunkItem* chunks() const {
    return reinterpret_cast<const ChunkItem*>(buffer.data_ptr<uint8_t>() +
                                              n_tensors * sizeof(TensorMeta));
  }
  const int64_t* first() const {
    return reinterpret_cast<const int64_t*>(buffer.data_ptr<uint8_t>() +
                                            n_tensors * sizeof(TensorMeta) +
                                            n_chunks * sizeof(ChunkItem));
  }
};

// Builds (or finds in a small LRU cache) the device work list for these tensors. A new list is
// refused inside CUDA-graph capture: its copy from pinned host memory would be captured into
// the graph and replayed from a host buffer that is gone by then (SPEC section 5 asks for one
// warm-up call with the same tensors before capture, which builds the list).
inline WorkList work_list(const std::vector<TensorMeta>& metas, c10::Device device) {
  using Key = std::pair<int, std::vector<std::pair<const void*, int64_t>>>;
  static std::mutex mu;
  static std::list<std::pair<Key, WorkList>> cache;
  Key key{device.index(), {}};
  key.second.reserve(metas.size());
  for (const auto& m : metas) {
    key.second.emplace_back(m.ptr, (m.numel << 8) | m.dtype);
  }
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->first == key) {
      cache.splice(cache.begin(), cache, it);
      return cache.front().second;
    }
  }
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() ==
                  c10::cuda::CaptureStatus::None,
              "fasthealth: first call with these tensors is inside CUDA-graph capture; call it "
              "once with the same tensors before capturing (the warm-up builds the device work "
              "list that the graph then reuses)");
  std::vector<ChunkItem> chunks;
  std::vector<int64_t> first;
  plan_chunks(metas, &chunks, &first);
  const size_t bytes = metas.size() * sizeof(TensorMeta) + chunks.size() * sizeof(ChunkItem) +
                       first.size() * sizeof(int64_t);
  at::Tensor host = at::empty({static_cast<int64_t>(bytes)},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  uint8_t* h = host.data_ptr<uint8_t>();
  std::memcpy(h, metas.data(), metas.size() * sizeof(TensorMeta));
  h += metas.size() * sizeof(TensorMeta);
  std::memcpy(h, chunks.data(), chunks.size() * sizeof(ChunkItem));
  h += chunks.size() * sizeof(ChunkItem);
  std::memcpy(h, first.data(), first.size() * sizeof(int64_t));
  WorkList wl;
  // Asynchronous copy from pinned memory on the current stream: no host sync.
  wl.buffer = host.to(device, /*non_blocking=*/true);
  wl.n_tensors = static_cast<int64_t>(metas.size());
  wl.n_chunks = static_cast<int64_t>(chunks.size());
  cache.emplace_front(std::move(key), wl);
  if (cache.size() > 32) cache.pop_back();
  return wl;
}

}  // namespace fasthealth
