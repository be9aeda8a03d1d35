// CPU implementation of fasthealth::multi_tensor_stats: one parallel pass over a work list of
// (tensor, chunk) items covering every input, then a deterministic pairwise merge.
//   reference: fasthealth/ops/reference.py   kernel: stats_kernel.h   record: ../stats.h
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../inputs.h"

namespace fasthealth {

// The read-probe build (FASTHEALTH_READ_PROBE, bench/read_probe.py only) swaps every variant's
// statistics kernel for chunk_touch, a loop that only reads: the same launcher, chunks and
// prefetches, so the benchmark can time them without the statistics.
#ifdef FASTHEALTH_READ_PROBE
#define FH_TOUCH_DECL \
  Partial chunk_touch(const void* data, int dtype, int64_t begin, int64_t end, double, double);
#define FH_KERNEL(ns) &ns::chunk_touch
#else
#define FH_TOUCH_DECL
#define FH_KERNEL(ns) &ns::chunk_stats
#endif

#if defined(__x86_64__) || defined(_M_X64)
namespace avx512 {
Partial chunk_stats(const void* data, int dtype, int64_t begin, int64_t end, double range_hi,
                    double range_lo);
FH_TOUCH_DECL
}
namespace avx2 {
Partial chunk_stats(const void* data, int dtype, int64_t begin, int64_t end, double range_hi,
                    double range_lo);
FH_TOUCH_DECL
}
namespace avx {
Partial chunk_stats(const void* data, int dtype, int64_t begin, int64_t end, double range_hi,
                    double range_lo);
FH_TOUCH_DECL
}
#endif
namespace base {
Partial chunk_stats(const void* data, int dtype, int64_t begin, int64_t end, double range_hi,
                    double range_lo);
FH_TOUCH_DECL
}

namespace {

using ChunkFn = Partial (*)(const void*, int, int64_t, int64_t, double, double);

struct Isa {
  ChunkFn fn;
  const char* name;
};

// The variants this processor runs, fastest first (as PyTorch's CPU_CAPABILITY builds do):
// AVX-512 (F, BW, VL, DQ), AVX2 + FMA + F16C, AVX + FMA + F16C, and the portable baseline.
std::vector<Isa> runnable() {
  std::vector<Isa> out;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx = __builtin_cpu_supports("avx") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
  const bool avx2 = avx && __builtin_cpu_supports("avx2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512) out.push_back({FH_KERNEL(avx512), "avx512"});
  if (avx2) out.push_back({FH_KERNEL(avx2), "avx2"});
  if (avx) out.push_back({FH_KERNEL(avx), "avx"});
#endif
  out.push_back({FH_KERNEL(base), "base"});
  return out;
}

// The fastest runnable variant, or the one FASTHEALTH_CPU_ISA names (the tests run each).
Isa select_isa() {
  const std::vector<Isa> ok = runnable();
  const char* env = std::getenv("FASTHEALTH_CPU_ISA");
  if (env == nullptr || *env == '\0') return ok.front();
  for (const Isa& v : ok) {
    if (std::strcmp(env, v.name) == 0) return v;
  }
  const bool known = std::strcmp(env, "avx512") == 0 || std::strcmp(env, "avx2") == 0 ||
                     std::strcmp(env, "avx") == 0;
  TORCH_CHECK(known, "fasthealth: FASTHEALTH_CPU_ISA must be one of avx512, avx2, avx, base; "
              "got '", env, "'");
  TORCH_CHECK(false, "fasthealth: FASTHEALTH_CPU_ISA=", env, " but this processor lacks it");
  return ok.back();
}

const Isa& isa() {
  static const Isa selected = select_isa();
  return selected;
}

// 64K elements: large enough that per-chunk overhead vanishes, small enough to balance many
// tensors over the threads.
constexpr int64_t kChunk = 64 * 1024;

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

}  // namespace

const char* cpu_isa_name() { return isa().name; }

std::vector<std::string> cpu_isas() {
  std::vector<std::string> out;
  for (const Isa& v : runnable()) out.emplace_back(v.name);
  return out;
}

// The first bytes of the chunks the thread reads next: tensors of a few KB each start cold, at
// scattered addresses, and the hardware prefetcher only follows a stream once it has begun. Up
// to 8 KB of each chunk (the kernel loop's own distance, stats_kernel.h: kPrefetchAhead, so
// together they cover every line once), for as many chunks as make kAheadBytes: with tiny
// tensors one chunk ahead is too little to hide the misses, a couple of head sizes ahead is
// enough, and much further ahead does worse on thousands of mid-sized tensors.
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kAheadBytes = 16384;

inline int64_t head_bytes(const CpuInput& in, const Chunk& ch) {
  return std::min<int64_t>((ch.end - ch.begin) * in.elem_bytes, kPrefetchBytes);
}

inline void prefetch_head(const CpuInput& in, const Chunk& ch) {
  const char* p = static_cast<const char*>(in.data) + ch.begin * in.elem_bytes;
  const int64_t bytes = head_bytes(in, ch);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

at::Tensor cpu_stats_table(const std::vector<CpuInput>& inputs, double range_hi,
                           double range_lo) {
  const int64_t n = static_cast<int64_t>(inputs.size());
  std::vector<int64_t> first_chunk(n + 1, 0);
  std::vector<Chunk> chunks;
  chunks.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = inputs[i].numel;
    first_chunk[i] = static_cast<int64_t>(chunks.size());
    for (int64_t b = 0; b < numel; b += kChunk) {
      chunks.push_back({i, b, b + kChunk < numel ? b + kChunk : numel});
    }
  }
  first_chunk[n] = static_cast<int64_t>(chunks.size());

  const ChunkFn fn = isa().fn;
  std::vector<Partial> parts(chunks.size());
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    int64_t next = lo;  // the heads of chunks [c, next) are prefetched,
    int64_t ahead = 0;  // those after c's making `ahead` bytes
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& ch = chunks[c];
      const CpuInput& in = inputs[ch.tensor];
      if (next == c) {
        prefetch_head(in, ch);
        ++next;
      } else {
        ahead -= head_bytes(in, ch);
      }
      for (; next < hi && ahead < kAheadBytes; ++next) {
        const CpuInput& later = inputs[chunks[next].tensor];
        prefetch_head(later, chunks[next]);
        ahead += head_bytes(later, chunks[next]);
      }
      parts[c] = fn(in.data, in.code, ch.begin, ch.end, range_hi, range_lo);
    }
  });

  // Each tensor's chunks merge and its row is written on the threads (a division and two
  // square roots a row, which add up over thousands of small tensors when done serially); the
  // total's merge over the tensors stays one fixed tree, whatever the thread count.
  at::Tensor out = at::empty({n + 1, kTableWidth}, at::TensorOptions().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  std::vector<Partial> per_tensor(n);
  at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      per_tensor[i] = partial_merge_range(parts.data() + first_chunk[i],
                                          first_chunk[i + 1] - first_chunk[i]);
      partial_finalize(per_tensor[i], o + i * kTableWidth);
    }
  });
  partial_finalize(partial_merge_range(per_tensor.data(), n), o + n * kTableWidth);
  return out;
}

at::Tensor multi_tensor_stats_cpu(at::TensorList tensors, double range_hi, double range_lo) {
  check_range(range_hi, range_lo);
  const int64_t n = static_cast<int64_t>(tensors.size());
  // Inputs are read as they lie when their elements fill their memory densely, in any order
  // (statistics do not depend on order: contiguous or merely permuted); expanded and sliced
  // views are copied first.
  std::vector<at::Tensor> copies;
  copies.reserve(n);
  std::vector<CpuInput> inputs(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    check_input(t, i, c10::DeviceType::CPU);
    const at::Tensor* dense = &t;
    if (!t.is_contiguous() && !t.is_non_overlapping_and_dense()) {
      copies.push_back(t.contiguous());
      dense = &copies.back();
    }
    inputs[i] = {dense->data_ptr(), dense->numel(), dtype_code(t, i),
                 static_cast<int>(t.element_size())};
  }
  return cpu_stats_table(inputs, range_hi, range_lo);
}

#ifndef FASTHEALTH_READ_PROBE  // the probe is a plain module beside _C: it registers no op
TORCH_LIBRARY_IMPL(fasthealth, CPU, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cpu);
}
#endif

}  // namespace fasthealth
