// The GPU work list's cache and the staging buffers: the policy is in work_list.h.
#include "work_list.h"

#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "inputs.h"

namespace fasthealth {
namespace {

bool on_host(c10::Device d) { return d.type() == c10::DeviceType::CPU; }

c10::Stream current_stream(c10::Device d) {
  return c10::impl::VirtualGuardImpl(d.type()).getStream(d);
}

// Drops the least recently used entries (at the back) that no CUDA graph reads, down to
// kMaxCached of them; pinned entries stay.
template <typename List>
void evict_unpinned(List* cache) {
  size_t unpinned = 0;
  for (const auto& e : *cache) unpinned += e.pinned ? 0 : 1;
  for (auto it = cache->end(); unpinned > kMaxCached && it != cache->begin();) {
    --it;
    if (!it->pinned) {
      it = cache->erase(it);
      --unpinned;
    }
  }
}

struct StagedEntry {
  const void* ptr;
  std::vector<int64_t> sizes, strides;
  at::ScalarType from, to;
  c10::Device device;
  at::Tensor buffer;
  c10::StreamId stream;  // allocated on, and the only stream that writes or reads it
  bool pinned;
};

// Both caches are never destroyed: at exit their CUDA buffers and events would be freed after
// the CUDA runtime has shut down.
std::mutex staged_mu;
std::list<StagedEntry>& staged_cache = *new std::list<StagedEntry>;

// The staging buffer of `t` as `to` for the current stream, refilled from `t` on it. One buffer
// per stream: a buffer shared with another stream would be refilled here while that stream's
// kernels may still read it (a call on another stream is ordered after nothing of this one), so
// two concurrent calls could each read the other's copy. Within one stream, stream order keeps
// each refill after the kernels of the call before.
at::Tensor staged(const at::Tensor& t, at::ScalarType to, bool capturing) {
  const c10::NoGradGuard no_grad;  // an internal copy: nothing to record for autograd
  const c10::Device device = t.device();
  const c10::StreamId stream = on_host(device) ? 0 : current_stream(device).id();
  const std::lock_guard<std::mutex> lock(staged_mu);
  for (auto it = staged_cache.begin(); it != staged_cache.end(); ++it) {
    if (it->ptr == t.const_data_ptr() && it->from == t.scalar_type() && it->to == to &&
        it->device == device && it->stream == stream && t.sizes().equals(it->sizes) &&
        t.strides().equals(it->strides)) {
      staged_cache.splice(staged_cache.begin(), staged_cache, it);
      StagedEntry& e = staged_cache.front();
      e.pinned = e.pinned || capturing;
      return e.buffer.copy_(t);
    }
  }
  at::Tensor buffer = at::empty(t.sizes(), t.options().dtype(to));
  staged_cache.push_front(StagedEntry{t.const_data_ptr(), t.sizes().vec(), t.strides().vec(),
                                      t.scalar_type(), to, device, buffer, stream, capturing});
  evict_unpinned(&staged_cache);
  return buffer.copy_(t);
}

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

struct ListEntry {
  uint64_t hash;
  c10::Device device;
  PlanLimits limits;
  std::vector<double> params;
  std::vector<TensorMeta> metas;
  DeviceWorkList list;
  std::shared_ptr<c10::Event> ready;  // recorded after the copy (none on the host, none in capture)
  std::optional<c10::Stream> stream;  // the copy's
  bool pinned;
  // Built inside capture: the copy is a node of the graph that reads `host` at every replay,
  // so `host` lives as long as the entry (pinned: forever); the device buffer holds the list
  // only once a graph has replayed, so eager calls never use this entry.
  bool in_capture = false;
  at::Tensor host;
};

bool same_limits(const PlanLimits& a, const PlanLimits& b) {
  return a.max_chunk == b.max_chunk && a.min_chunk == b.min_chunk &&
         a.resident == b.resident && a.item_cost == b.item_cost && a.merge_run == b.merge_run;
}

std::mutex list_mu;
std::list<ListEntry>& list_cache = *new std::list<ListEntry>;

// Inputs are read a block at a time, after prefetching the block's TensorImpls and then their
// storages: with thousands of small tensors (whose objects lie scattered and out of cache)
// each input otherwise costs two or three dependent memory latencies, several times the cost
// of the checks themselves (as in check_grads' CPU front door, csrc/fasthealth.cpp).
constexpr int64_t kBlock = 64;

void prefetch_block(const std::function<const at::Tensor&(int64_t)>& tensor, int64_t begin,
                    int64_t end) {
  c10::TensorImpl* impl[kBlock];
  for (int64_t i = begin; i < end; ++i) {
    impl[i - begin] = tensor(i).unsafeGetTensorImpl();
    for (int k = 0; k < 4; ++k) {  // sizes, strides, dtype, device and storage: its first lines
      __builtin_prefetch(reinterpret_cast<const char*>(impl[i - begin]) + 64 * k);
    }
  }
  for (int64_t i = begin; i < end; ++i) {
    if (impl[i - begin]->has_storage()) {
      __builtin_prefetch(impl[i - begin]->storage().unsafeGetStorageImpl());
    }
  }
}

}  // namespace

std::vector<TensorMeta> kernel_inputs(int64_t n,
                                      const std::function<const at::Tensor&(int64_t)>& tensor,
                                      c10::DeviceType device_type, Grouping grouping,
                                      bool capturing, std::vector<at::Tensor>* staged_out) {
  TORCH_CHECK_VALUE(n > 0, "fasthealth: multi_tensor_stats needs at least one tensor");
  std::vector<TensorMeta> metas(n);
  std::vector<std::pair<int32_t, bool>> kinds;  // launch groups, first seen first
  const c10::Device device = tensor(0).device();
  for (int64_t i = 0; i < n; ++i) {
    if (i % kBlock == 0) prefetch_block(tensor, i, std::min(n, i + kBlock));
    const at::Tensor& t = tensor(i);
    check_input(t, static_cast<size_t>(i), device_type);
    TORCH_CHECK(t.device() == device, "fasthealth: input ", i, " is on ", t.device(),
                ", input 0 on ", device);
    int code = dtype_code(t, static_cast<size_t>(i));
    const void* ptr;
    if (code == kF8E4M3 || code == kF8E5M2) {  // widened on the device: float8 loads need sm_89
      staged_out->push_back(staged(t, at::kFloat, capturing));
      ptr = staged_out->back().data_ptr();
      code = kF32;
    } else if (t.is_contiguous() || t.is_non_overlapping_and_dense()) {
      ptr = t.const_data_ptr();  // read as it lies (a transpose covers its memory exactly)
    } else {
      staged_out->push_back(staged(t, t.scalar_type(), capturing));
      ptr = staged_out->back().data_ptr();
    }
    int32_t group = 0;
    if (grouping == Grouping::kDtypeAlignment) {
      const std::pair<int32_t, bool> kind{code, reinterpret_cast<uintptr_t>(ptr) % 16 == 0};
      while (group < static_cast<int32_t>(kinds.size()) && kinds[group] != kind) ++group;
      if (group == static_cast<int32_t>(kinds.size())) kinds.push_back(kind);
    }
    metas[i] = {ptr, t.numel(), code, group};
  }
  return metas;
}

DeviceWorkList work_list(const std::vector<TensorMeta>& metas, c10::Device device,
                         const PlanLimits& limits, const std::vector<double>& params,
                         bool capturing) {
  uint64_t hash = mix(static_cast<uint64_t>(metas.size()), device.index());
  for (const TensorMeta& m : metas) {
    hash = mix(hash, reinterpret_cast<uintptr_t>(m.ptr));
    hash = mix(hash, static_cast<uint64_t>(m.numel) ^
                         (static_cast<uint64_t>(m.dtype) << 56 ^
                          static_cast<uint64_t>(m.group) << 48));
  }
  const std::optional<c10::Stream> stream =
      on_host(device) ? std::nullopt : std::optional<c10::Stream>(current_stream(device));
  const std::lock_guard<std::mutex> lock(list_mu);
  for (auto it = list_cache.begin(); it != list_cache.end(); ++it) {
    if ((it->in_capture && !capturing) || it->hash != hash || it->device != device ||
        it->metas.size() != metas.size() ||
        !same_limits(it->limits, limits) || it->params != params ||
        std::memcmp(it->metas.data(), metas.data(), metas.size() * sizeof(TensorMeta)) != 0) {
      continue;
    }
    list_cache.splice(list_cache.begin(), list_cache, it);
    ListEntry& e = list_cache.front();
    e.pinned = e.pinned || capturing;
    if (e.in_capture && !on_host(device)) {
      // another graph: its own copy node, so that it holds the list whichever graph replays
      // first
      e.list.buffer.copy_(e.host, /*non_blocking=*/true);
    }
    if (stream && *stream != *e.stream && !capturing) {
      e.ready->block(*stream);  // ordered after the copy, on the device
      if (!e.pinned) e.list.buffer.record_stream(*stream);  // and freed after this stream
    }
    return e.list;
  }
  const WorkPlan plan = plan_work(metas, limits);
  DeviceWorkList wl;
  wl.n_tensors = static_cast<int64_t>(metas.size());
  wl.n_items = static_cast<int64_t>(plan.items.size());
  wl.n_runs = plan.runs.empty() ? 0 : static_cast<int64_t>(plan.runs.size()) - 1;
  wl.chunk = plan.chunk;
  wl.group_begin = plan.group_begin;
  const size_t item_bytes = plan.items.size() * sizeof(ChunkItem);
  const size_t first_bytes = plan.first.size() * sizeof(int64_t);
  const size_t run_bytes = (plan.runs.size() + plan.run_first.size()) * sizeof(int64_t);
  const size_t param_bytes = params.size() * sizeof(double);
  const int64_t bytes =
      static_cast<int64_t>(item_bytes + first_bytes + run_bytes + param_bytes);
  // pinned: the copy below is then asynchronous, with no host sync
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(
                                           !on_host(device)));
  uint8_t* h = host.data_ptr<uint8_t>();
  std::memcpy(h, plan.items.data(), item_bytes);
  std::memcpy(h + item_bytes, plan.first.data(), first_bytes);
  std::memcpy(h + item_bytes + first_bytes, plan.runs.data(), plan.runs.size() * 8);
  std::memcpy(h + item_bytes + first_bytes + plan.runs.size() * 8, plan.run_first.data(),
              plan.run_first.size() * 8);
  std::memcpy(h + item_bytes + first_bytes + run_bytes, params.data(), param_bytes);
  ListEntry e{hash, device, limits, params, metas, wl, nullptr, stream, capturing};
  if (on_host(device)) {
    e.list.buffer = host;
  } else {
    // in capture: the copy becomes a node of the graph (from pinned memory, kept in `host`),
    // and the buffer comes from the graph's pool; no event (the graph orders its own nodes)
    e.list.buffer = host.to(device, /*non_blocking=*/true);
    if (!capturing) {
      e.ready = std::make_shared<c10::Event>(device.type());
      e.ready->record(*stream);
    }
  }
  e.in_capture = capturing;
  if (capturing) e.host = host;
  list_cache.push_front(std::move(e));
  evict_unpinned(&list_cache);
  return list_cache.front().list;
}

std::vector<int64_t> cache_counts() {
  std::vector<int64_t> out(4, 0);
  {
    const std::lock_guard<std::mutex> lock(list_mu);
    for (const auto& e : list_cache) {
      ++out[0];
      out[1] += e.pinned;
    }
  }
  const std::lock_guard<std::mutex> lock(staged_mu);
  for (const auto& e : staged_cache) {
    ++out[2];
    out[3] += e.pinned;
  }
  return out;
}

}  // namespace fasthealth
