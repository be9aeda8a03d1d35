// Just enough of CUDA to run csrc/cuda/stats_kernels.cuh on the host, for tests on machines
// without a GPU: each CUDA thread of a block is an OS thread, blocks run one after another,
// __syncthreads is a barrier of the block's threads, __shfl_xor_sync a barrier of the warp's,
// and __shared__ variables are function statics (one block at a time uses them).
// It checks the kernels' logic (indexing, alignment heads and tails, the fast path's fallbacks,
// the reductions, the merges), not their speed, memory model or compilation by nvcc.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 blockDim, gridDim;

struct __half {
  uint16_t bits;
};

inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float __half2float(__half h) {
  const uint32_t sign = (h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1f,
                 man = h.bits & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    const float mag = std::ldexp(static_cast<float>(man), -24);
    return sign ? -mag : mag;
  }
  return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

template <class T>
inline T __ldg(const T* p) {
  return *p;
}

namespace emu {

struct Warp {
  uint64_t slot[32];
  std::barrier<> bar{32};
};

inline std::barrier<>* block_barrier = nullptr;
inline Warp* warps = nullptr;

// Runs kernel() as a grid of `grid` blocks of `block` threads (block a multiple of 32).
inline void launch(unsigned grid, unsigned block, const std::function<void()>& kernel) {
  std::barrier<> bar(block);
  std::vector<Warp> ws(block / 32);
  block_barrier = &bar;
  warps = ws.data();
  blockDim.x = block;
  gridDim.x = grid;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < block; ++t) {
    threads.emplace_back([&, t] {
      threadIdx.x = t;
      for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        kernel();
        bar.arrive_and_wait();  // the next block may reuse __shared__ statics
      }
    });
  }
  for (auto& th : threads) th.join();
}

}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

// Device-wide fence and counter: blocks run one after another here, so a fence orders nothing
// more than program order does; the count is atomic all the same (threads of one block may
// call it).
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
  return std::atomic_ref<unsigned int>(*p).fetch_add(v);
}

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "emulated shuffles move at most 8 bytes");
  emu::Warp& w = emu::warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w.slot[lane] = bits;
  w.bar.arrive_and_wait();
  const uint64_t other = w.slot[lane ^ static_cast<unsigned>(lane_mask)];
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &other, sizeof(T));
  return r;
}
