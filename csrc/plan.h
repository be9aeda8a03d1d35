// The work plan of the GPU kernels, one policy for CUDA (csrc/cuda/) and Triton (which gets it
// through fasthealth._C.work_list): the (tensor, chunk) items the chunk kernel reduces, their
// order, their size, and the order in which their records merge. Free of torch and of CUDA
// headers, so that the host emulation test (tests/ops/cuda_emu/) and the planner's own tests
// (tests/ops/test_plan.py, through _C.plan) run the very same code.
//
// - Chunk size from the total work: the largest power of two in [min_chunk, max_chunk] that
//   minimises the estimated time of the slowest program, ceil(items / resident) x (chunk +
//   item_cost). Items are dealt round robin (item c to program c mod grid), so a plan of 5.04
//   waves costs 6 full waves; smaller chunks cut that tail, and the per-item cost (loading the
//   item, the block's barriers) keeps them from getting too small. With resident = 0 (not
//   known, as on CPU tensors) the chunk is max_chunk.
// - Largest first: within each launch group, whole chunks come first, then the tails (the
//   last chunk of each tensor) by decreasing size, so the short items fill the last wave.
// - Each item carries its tensor's base pointer and its element count: a program reads one
//   16-byte-aligned 32-byte record per item, with no dependent load of a tensor table.
// - Records are written at `slot`, in input order (tensor i's chunks at [first[i],
//   first[i+1])), whatever order the items run in, and merged in that fixed order: results are
//   bit for bit the same run to run for the same inputs and the same device.
// - Two-level merge: a tensor of more than merge_run chunks (a flat 7B-parameter buffer has
//   over 100,000) would keep one merging block busy for all of them; its records are merged in
//   runs of merge_run first (one block a run, in parallel), then the runs per tensor.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <vector>

namespace fasthealth {

// One input as the planner sees it; `group` is its launch group (0..G-1; the CUDA kernel has
// one, Triton one per dtype and alignment).
struct TensorMeta {
  const void* ptr;
  int64_t numel;
  int32_t dtype;  // DType code (stats.h)
  int32_t group;
};

// One work item: elements [begin, begin + count) of the tensor at `ptr`; its record goes to
// parts[slot]. 32 bytes, the layout the Triton kernel reads through int32/int64 views.
struct alignas(16) ChunkItem {
  const void* ptr;
  int64_t begin;
  int32_t count;
  int32_t slot;
  int32_t dtype;
  int32_t tensor;
};
static_assert(sizeof(ChunkItem) == 32, "Triton reads ChunkItem as 4 int64 / 8 int32");

struct PlanLimits {
  int64_t max_chunk;  // elements; a power of two
  int64_t min_chunk;  // a power of two <= max_chunk
  int64_t resident;   // programs the device runs at once (0: unknown)
  int64_t item_cost;  // the per-item overhead, in elements' worth of time
  int64_t merge_run;  // records merged per run at the first level of a two-level merge
};

struct WorkPlan {
  int64_t chunk = 0;
  std::vector<ChunkItem> items;     // by launch group, then largest first
  std::vector<int64_t> group_begin; // group g's items: [group_begin[g], group_begin[g+1])
  std::vector<int64_t> first;       // tensor i's records: slots [first[i], first[i+1])
  // Two-level merge (both empty when no tensor has more than merge_run records): run j merges
  // slots [runs[j], runs[j+1]); tensor i then merges runs [run_first[i], run_first[i+1]).
  std::vector<int64_t> runs;
  std::vector<int64_t> run_first;
};

inline int64_t plan_items(const std::vector<TensorMeta>& metas, int64_t chunk) {
  int64_t c = 0;
  for (const auto& m : metas) c += m.numel == 0 ? 1 : (m.numel + chunk - 1) / chunk;
  return c;
}

inline int64_t plan_chunk_size(const std::vector<TensorMeta>& metas, const PlanLimits& lim) {
  if (lim.resident <= 0) return lim.max_chunk;
  int64_t best = lim.max_chunk, best_cost = -1;
  for (int64_t chunk = lim.max_chunk; chunk >= lim.min_chunk; chunk /= 2) {
    const int64_t waves = (plan_items(metas, chunk) + lim.resident - 1) / lim.resident;
    const int64_t cost = waves * (chunk + lim.item_cost);
    if (best_cost < 0 || cost < best_cost) {  // ties keep the larger chunk: fewer items
      best = chunk;
      best_cost = cost;
    }
  }
  return best;
}

inline WorkPlan plan_work(const std::vector<TensorMeta>& metas, const PlanLimits& lim) {
  WorkPlan p;
  p.chunk = plan_chunk_size(metas, lim);
  const int64_t n = static_cast<int64_t>(metas.size());
  p.first.assign(n + 1, 0);
  int32_t groups = 0;
  bool two_level = false;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = metas[i].numel;
    const int64_t count = numel == 0 ? 1 : (numel + p.chunk - 1) / p.chunk;
    p.first[i + 1] = p.first[i] + count;
    groups = std::max(groups, metas[i].group + 1);
    two_level = two_level || count > lim.merge_run;
  }
  p.items.reserve(p.first[n]);
  for (int64_t i = 0; i < n; ++i) {
    const TensorMeta& m = metas[i];
    for (int64_t s = p.first[i]; s < p.first[i + 1]; ++s) {
      const int64_t begin = (s - p.first[i]) * p.chunk;
      const int64_t count = std::min(p.chunk, m.numel - begin);
      p.items.push_back({m.ptr, begin, static_cast<int32_t>(count), static_cast<int32_t>(s),
                         m.dtype, static_cast<int32_t>(i)});
    }
  }
  // (a stable sort: equal items keep input order, so the plan is a function of the inputs)
  std::stable_sort(p.items.begin(), p.items.end(), [&](const ChunkItem& a, const ChunkItem& b) {
    const int32_t ga = metas[a.tensor].group, gb = metas[b.tensor].group;
    return ga != gb ? ga < gb : a.count > b.count;
  });
  p.group_begin.assign(groups + 1, 0);
  for (const auto& it : p.items) ++p.group_begin[metas[it.tensor].group + 1];
  for (int32_t g = 0; g < groups; ++g) p.group_begin[g + 1] += p.group_begin[g];
  if (two_level) {
    p.run_first.assign(n + 1, 0);
    for (int64_t i = 0; i < n; ++i) {
      p.run_first[i] = static_cast<int64_t>(p.runs.size());
      for (int64_t s = p.first[i]; s < p.first[i + 1]; s += lim.merge_run) p.runs.push_back(s);
    }
    p.run_first[n] = static_cast<int64_t>(p.runs.size());
    p.runs.push_back(p.first[n]);
  }
  return p;
}

// The CUDA kernel's limits (csrc/cuda/tensor_stats.cu; FH_CUDA_CHUNK: tests/ops/cuda_emu/ builds
// smaller chunks). Chunks of at least an eighth of the largest keep four 16-byte loads in flight
// per thread for 16-bit types; an item costs about 1/32 of a largest chunk (its record load and
// the block's four barriers).
#ifndef FH_CUDA_CHUNK
#define FH_CUDA_CHUNK (64 * 1024)
#endif
constexpr int64_t kCudaChunk = FH_CUDA_CHUNK;  // the largest chunk, in elements
// One merging block of 128 threads takes up to 32 records a thread before its tree: a tensor of
// up to 4096 chunks (a 7B model's embedding: 4000) is merged in one level.
constexpr int64_t kMergeRun = 4096;

inline PlanLimits cuda_plan_limits(int64_t resident) {
  return {kCudaChunk, kCudaChunk / 8, resident, kCudaChunk / 32, kMergeRun};
}

}  // namespace fasthealth
