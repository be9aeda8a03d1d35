// The work list of the CUDA kernel: (tensor, chunk) items over many tensors. Free of torch and
// of CUDA headers, so that the host emulation test (tests/cuda_emu/) builds the same list.
#pragma once

#include <stdint.h>

#include <vector>

namespace fasthealth {

#ifndef FH_CUDA_CHUNK
#define FH_CUDA_CHUNK (64 * 1024)
#endif
constexpr int64_t kCudaChunk = FH_CUDA_CHUNK;  // elements per work item

struct TensorMeta {
  const void* ptr;
  int64_t numel;
  int32_t dtype;  // DType code (stats.h)
  int32_t pad;
};

struct ChunkItem {
  int32_t tensor;
  int32_t pad;
  int64_t begin;
};

// Chunks of every tensor in input order (an empty tensor gets one empty chunk, so that every
// tensor has a record); first[i] is tensor i's first chunk, first[n] the number of chunks.
inline void plan_chunks(const std::vector<TensorMeta>& metas, std::vector<ChunkItem>* chunks,
                        std::vector<int64_t>* first) {
  chunks->clear();
  first->assign(metas.size() + 1, 0);
  for (size_t i = 0; i < metas.size(); ++i) {
    (*first)[i] = static_cast<int64_t>(chunks->size());
    const int64_t n = metas[i].numel;
    const int64_t count = n == 0 ? 1 : (n + kCudaChunk - 1) / kCudaChunk;
    for (int64_t c = 0; c < count; ++c) {
      chunks->push_back({static_cast<int32_t>(i), 0, c * kCudaChunk});
    }
  }
  (*first)[metas.size()] = static_cast<int64_t>(chunks->size());
}

}  // namespace fasthealth
