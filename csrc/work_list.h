// The device work list and the staging buffers of the GPU kernels, and their cache: one
// implementation for both GPU backends. csrc/cuda/tensor_stats.cu calls it for the CUDA
// kernels; the Triton launcher calls it through fasthealth._C.work_list. It uses only torch's
// device-generic API (streams, events, pinned memory through the registered accelerator), so it
// is compiled into every build, CPU-only ones too, and tests/ops/test_plan.py runs it on CPU
// tensors with the capture state passed in.
//
// The policy (docs/design.md, "The GPU work list"):
// - Key: each input's (data pointer, element count, dtype code, launch group), the device and
//   the plan's limits. Built in C++ from the tensors themselves, hashed, then compared in full
//   on a hash match. A repeated call with the same tensors copies nothing to the device, which
//   CUDA-graph capture needs.
// - Size: at most kMaxCached work lists and kMaxCached staging buffers that no CUDA graph reads,
//   least recently used dropped first.
// - Pinning under capture: a work list or staging buffer found or used while the current
//   stream is capturing is pinned, never evicted or freed: the graph reads it (and writes the
//   staging buffer) at every replay, for as long as the graph lives.
// - A new work list inside capture (gradients allocated in the captured step, as PyTorch's
//   whole-network capture does: zero_grad(set_to_none=True), forward, backward, check, step):
//   its host-to-device copy becomes a node of the graph, replayed at every replay from a pinned
//   host buffer that the entry keeps (pinned: never evicted). Its device buffer holds the list
//   only after a replay, so eager calls never use that entry (they build their own), and a
//   later capture that finds it adds its own copy node.
// - Stream order: a new work list is copied on the current stream, and an event is recorded
//   after the copy. A call on another stream first makes that stream wait for the event (a
//   device-side wait, no host sync), then records the buffer on it (so that it is freed only
//   after that stream's kernels too): order and lifetime. Inside capture no wait is added (a
//   captured stream cannot wait on work outside the graph); torch.cuda.graph synchronizes
//   before capturing, so the warm-up's copy has landed.
// - Staging (float8 widened to float32, non-dense views copied dense): the same buffer for the
//   same input and stream every call, refilled with copy_ on that stream, so that the work
//   list's key stays the same and a graph captures a stable pointer. Each stream has its own
//   buffer: a call on another stream would otherwise refill it while this stream's kernels
//   still read it. A capture (on its own stream) stages into a buffer of its own, which the
//   graph refills at every replay.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "plan.h"

namespace fasthealth {

constexpr size_t kMaxCached = 32;

// A cached plan on the device. Buffer layout (bytes): ChunkItem x items, then int64 first
// (n + 1), int64 runs (n_runs + 1, absent when one level), int64 run_first (n + 1, likewise),
// then the caller's float64 parameters (Triton's range thresholds; part of the key).
struct DeviceWorkList {
  at::Tensor buffer;  // uint8 on the inputs' device
  int64_t n_tensors = 0;
  int64_t n_items = 0;
  int64_t n_runs = 0;  // 0: a one-level merge
  int64_t chunk = 0;
  std::vector<int64_t> group_begin;  // host copy: launch group g's items
  const ChunkItem* items() const {
    return reinterpret_cast<const ChunkItem*>(buffer.data_ptr<uint8_t>());
  }
  const int64_t* first() const {
    return reinterpret_cast<const int64_t*>(buffer.data_ptr<uint8_t>() +
                                            n_items * sizeof(ChunkItem));
  }
  const int64_t* runs() const { return first() + n_tensors + 1; }
  const int64_t* run_first() const { return runs() + n_runs + 1; }
};

// How the inputs are split into launch groups: one group (the CUDA kernel reads every dtype in
// one launch), or one per (dtype, 16-byte alignment of the data) in first-seen order (Triton
// compiles a kernel per dtype and tells aligned ones so).
enum class Grouping { kOne, kDtypeAlignment };

// The inputs as the kernels read them: each checked (a bad one named by its index), float8
// widened into a float32 staging buffer, non-dense views copied into a dense one, the rest
// read as they lie. `tensor(i)` gives input i of `n`. `capturing`: the current stream is
// capturing a CUDA graph. The staging buffers used are appended to `staged_out`: held until the
// kernels are launched, whatever another thread's call evicts meanwhile.
std::vector<TensorMeta> kernel_inputs(int64_t n,
                                      const std::function<const at::Tensor&(int64_t)>& tensor,
                                      c10::DeviceType device_type, Grouping grouping,
                                      bool capturing, std::vector<at::Tensor>* staged_out);

// The plan of `metas` on `device` under `limits` (with `params` after it), from the cache or
// built and copied now.
DeviceWorkList work_list(const std::vector<TensorMeta>& metas, c10::Device device,
                         const PlanLimits& limits, const std::vector<double>& params,
                         bool capturing);

// (work lists, of them pinned, staging buffers, of them pinned): for tests.
std::vector<int64_t> cache_counts();

}  // namespace fasthealth
