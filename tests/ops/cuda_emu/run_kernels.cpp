// Runs the CUDA backend's kernels (csrc/cuda/stats_kernels.cuh) on the host through emu.h, the
// way csrc/cuda/tensor_stats.cu launches them: tests/ops/test_cuda_emu.py builds and drives it.
//
//   run_kernels IN OUT
// IN:  int64 n; float64 range_hi, range_lo; int64 resident blocks and merge run (the plan's
//      limits, csrc/plan.h; resident 0: the largest chunk); then per tensor: int32 dtype code
//      (stats.h), int64 numel, int64 misalignment in bytes, numel elements' raw bytes.
// OUT: float64 table [(n + 1) x kTableWidth], then int64 chunks finished by each path
//      (fast, shifted, slow, masked), then int64 chunk size, items, merge runs (0: one level), then
//      per item in launch order int64 tensor, slot, begin, count.
#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "emu.h"

inline std::atomic<int64_t> path_count[4];
#define FH_COUNT_PATH(path) (path_count[(path)]++)

#include "cuda/stats_kernels.cuh"

using namespace fasthealth;

static size_t elem_size(int dtype) {
  switch (dtype) {
    case kF64: case kI64: return 8;
    case kF32: case kI32: return 4;
    case kF16: case kBF16: case kI16: return 2;
    default: return 1;
  }
}

template <class T>
static T get(FILE* f) {
  T v;
  if (std::fread(&v, sizeof(T), 1, f) != 1) {
    std::fprintf(stderr, "run_kernels: truncated input\n");
    std::exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: run_kernels IN OUT\n");
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  const int64_t n = get<int64_t>(in);
  const double hi = get<double>(in), lo = get<double>(in);
  const int64_t resident = get<int64_t>(in), merge_run = get<int64_t>(in);
  std::vector<std::vector<unsigned char>> storage(n);
  std::vector<TensorMeta> metas(n);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t dtype = get<int32_t>(in);
    const int64_t numel = get<int64_t>(in), skew = get<int64_t>(in);
    const size_t bytes = numel * elem_size(dtype);
    storage[i].resize(bytes + skew + 32);
    // an address that is `skew` bytes past a 16-byte boundary
    unsigned char* p = storage[i].data();
    p += (16 - reinterpret_cast<uintptr_t>(p) % 16) % 16 + skew;
    if (bytes && std::fread(p, 1, bytes, in) != bytes) return 2;
    metas[i] = {p, numel, dtype, 0};
  }
  std::fclose(in);

  PlanLimits limits = cuda_plan_limits(resident);
  limits.merge_run = merge_run;
  const WorkPlan plan = plan_work(metas, limits);
  const int64_t n_chunks = static_cast<int64_t>(plan.items.size());
  const int64_t n_runs = plan.runs.empty() ? 0 : static_cast<int64_t>(plan.runs.size()) - 1;
  std::vector<Partial> parts(n_chunks), run_parts(n_runs), per_tensor(n);
  std::vector<double> table((n + 1) * kTableWidth);
  const bool ranged = hi < fh_inf() || lo > 0.0;
  // a small persistent grid, so that blocks take several chunks each
  const unsigned grid = n_chunks < 3 ? static_cast<unsigned>(n_chunks) : 3u;
  unsigned int done = 12345u;  // garbage: the chunk kernel zeroes it
  emu::launch(grid, kernels::kThreads, [&] {
    if (ranged) {
      kernels::chunk_stats_cuda<true>(plan.items.data(), n_chunks, parts.data(), hi, lo, &done);
    } else {
      kernels::chunk_stats_cuda<false>(plan.items.data(), n_chunks, parts.data(), hi, lo, &done);
    }
  });
  const Partial* records = parts.data();
  const int64_t* first = plan.first.data();
  if (n_runs > 0) {  // the two-level merge, as tensor_stats.cu launches it
    emu::launch(static_cast<unsigned>(n_runs), kernels::kMergeThreads, [&] {
      kernels::merge_chunks_cuda(parts.data(), plan.runs.data(), run_parts.data());
    });
    records = run_parts.data();
    first = plan.run_first.data();
  }
  emu::launch(static_cast<unsigned>(n), kernels::kMergeThreads, [&] {
    kernels::merge_finalize_cuda(records, first, n, per_tensor.data(), table.data(), &done);
  });
  if (done != 0u) return 3;  // the last block resets the counter for the next call

  FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 2;
  std::fwrite(table.data(), sizeof(double), table.size(), out);
  for (auto& c : path_count) {
    const int64_t v = c.load();
    std::fwrite(&v, sizeof(v), 1, out);
  }
  const int64_t info[3] = {plan.chunk, n_chunks, n_runs};
  std::fwrite(info, sizeof(int64_t), 3, out);
  for (const ChunkItem& it : plan.items) {
    const int64_t row[4] = {it.tensor, it.slot, it.begin, it.count};
    std::fwrite(row, sizeof(int64_t), 4, out);
  }
  std::fclose(out);
  return 0;
}
