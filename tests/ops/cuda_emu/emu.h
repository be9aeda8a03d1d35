// Just enough of CUDA to run csrc/cuda/stats_kernels.cuh on the host, for tests on machines
// without a GPU: each CUDA thread of a block is a fiber (a ucontext with its own stack) and the
// block's fibers take turns on one OS thread, blocks run one after another, __syncthreads is a
// barrier of the block's threads, __shfl_xor_sync a barrier of the warp's (a fiber waiting at a
// barrier yields to the next one until the last one arrives), and __shared__ variables are
// function statics (one block at a time uses them). Fibers switch in user space, so a barrier
// costs the block's context switches, not a wake-up of 256 OS threads on a busy machine.
// It checks the kernels' logic (indexing, alignment heads and tails, the fast path's fallbacks,
// the reductions, the merges), not their speed, memory model or compilation by nvcc.
#pragma once

#include <ucontext.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
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
inline Dim3 threadIdx, blockIdx;  // the running fiber's (set at each switch)
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

struct Fiber {
  ucontext_t ctx;
  bool done = false;
};

inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline std::vector<char> stacks;
inline constexpr size_t kStack = 256 * 1024;  // per fiber: the kernels' locals and calls
inline const std::function<void()>* body = nullptr;
inline unsigned current = 0;
inline uint64_t arrivals = 0;  // grows whenever a fiber reaches a barrier: progress

inline void yield() { swapcontext(&fibers[current].ctx, &scheduler); }

// A barrier of `expected` fibers: the last to arrive opens it (a new generation) and goes on;
// the others yield until they see the new generation.
struct Barrier {
  unsigned expected, arrived = 0;
  uint64_t generation = 0;
  explicit Barrier(unsigned n) : expected(n) {}
  void arrive_and_wait() {
    const uint64_t g = generation;
    ++arrivals;
    if (++arrived == expected) {
      arrived = 0;
      ++generation;
      return;
    }
    while (generation == g) yield();
  }
};

struct Warp {
  uint64_t slot[32];
  Barrier bar{32};
};

inline Barrier* block_barrier = nullptr;
inline Warp* warps = nullptr;

inline void fiber_main() {
  (*body)();
  fibers[current].done = true;  // returns to the scheduler through uc_link
}

// Runs kernel() as a grid of `grid` blocks of `block` threads (block a multiple of 32).
inline void launch(unsigned grid, unsigned block, const std::function<void()>& kernel) {
  fibers.assign(block, Fiber{});
  if (stacks.size() < block * kStack) stacks.resize(block * kStack);
  body = &kernel;
  blockDim.x = block;
  gridDim.x = grid;
  for (unsigned b = 0; b < grid; ++b) {
    Barrier bar(block);
    std::vector<Warp> ws(block / 32);
    block_barrier = &bar;
    warps = ws.data();
    blockIdx.x = b;
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = fibers[t];
      f.done = false;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stacks.data() + t * kStack;
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &scheduler;
      makecontext(&f.ctx, fiber_main, 0);
    }
    for (unsigned left = block; left > 0;) {  // round robin until every fiber has returned
      const uint64_t before = arrivals;
      const unsigned was_left = left;
      for (unsigned t = 0; t < block; ++t) {
        if (fibers[t].done) continue;
        current = t;
        threadIdx.x = t;
        swapcontext(&scheduler, &fibers[t].ctx);
        left -= fibers[t].done;
      }
      if (arrivals == before && left == was_left) {  // everyone waits, no one arrives
        std::fprintf(stderr, "emu: deadlock in block %u: a barrier not every thread reaches\n", b);
        std::abort();
      }
    }
  }
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
