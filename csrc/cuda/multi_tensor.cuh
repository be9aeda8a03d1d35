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
  c10::StreamId stream = 0;  // where it was copied to the device
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

constexpr size_t kMaxWorkLists = 32;

// Drops the least recently used entries (at the back) that no CUDA graph reads, down to
// kMaxWorkLists of them; pinned entries stay.
template <typename List>
void evict_unpinned(List* cache) {
  size_t unpinned = 0;
  for (const auto& e : *cache) unpinned += e.pinned ? 0 : 1;
  for (auto it = cache->end(); unpinned > kMaxWorkLists && it != cache->begin();) {
    --it;
    if (!it->pinned) {
      it = cache->erase(it);
      --unpinned;
    }
  }
}

// Builds (or finds in a small LRU cache) the device work list for these tensors. A new list is
// refused inside CUDA-graph capture: its copy from pinned host memory would be captured into
// the graph and replayed from a host buffer that is gone by then (docs/spec.md section 5 asks
// for one warm-up call with the same tensors before capture, which builds the list). A list
// found during capture is pinned: the graph reads it at every replay, so it is never evicted. A
// list used on a stream other than its own is recorded there, so that it is freed after both.
inline WorkList work_list(const std::vector<TensorMeta>& metas, c10::Device device) {
  using Key = std::pair<int, std::vector<std::pair<const void*, int64_t>>>;
  struct Entry {
    Key key;
    WorkList list;
    bool pinned;
  };
  static std::mutex mu;
  static std::list<Entry> cache;
  Key key{device.index(), {}};
  key.second.reserve(metas.size());
  for (const auto& m : metas) {
    key.second.emplace_back(m.ptr, (m.numel << 8) | m.dtype);
  }
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
                         c10::cuda::CaptureStatus::None;
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->key == key) {
      cache.splice(cache.begin(), cache, it);
      Entry& e = cache.front();
      e.pinned = e.pinned || capturing;
      if (e.list.stream != stream.id()) e.list.buffer.record_stream(stream.unwrap());
      return e.list;
    }
  }
  TORCH_CHECK(!capturing,
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
  wl.stream = stream.id();
  cache.push_front(Entry{std::move(key), wl, false});
  evict_unpinned(&cache);
  return wl;
}

// A copy of an input the kernels cannot read as it lies (float8, widened to float32; a
// non-dense view), into the same buffer for the same input every call: a CUDA graph then
// captures a stable pointer, and the work list of a warm-up call is found inside the capture
// (a fresh copy would be new memory, a miss, and refused there). Buffers used during capture
// are pinned, like the work lists.
inline at::Tensor staged_copy(const at::Tensor& t, at::ScalarType dtype) {
  struct Entry {
    const void* ptr;
    std::vector<int64_t> sizes, strides;
    at::ScalarType from, to;
    int device;
    at::Tensor buffer;
    bool pinned;
  };
  static std::mutex mu;
  static std::list<Entry> cache;
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
                         c10::cuda::CaptureStatus::None;
  const std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  const std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->ptr == t.data_ptr() && it->sizes == sizes && it->strides == strides &&
        it->from == t.scalar_type() && it->to == dtype && it->device == t.device().index()) {
      cache.splice(cache.begin(), cache, it);
      Entry& e = cache.front();
      e.pinned = e.pinned || capturing;
      return e.buffer.copy_(t);
    }
  }
  at::Tensor buffer = at::empty(t.sizes(), t.options().dtype(dtype));
  cache.push_front(Entry{t.data_ptr(), sizes, strides, t.scalar_type(), dtype,
                         t.device().index(), buffer, capturing});
  evict_unpinned(&cache);
  return buffer.copy_(t);
}

}  // namespace fasthealth
