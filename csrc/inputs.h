// Input validation and element-type codes, shared by the CPU and CUDA launchers.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "stats.h"

namespace fasthealth {

// Maps a tensor's dtype to the kernels' DType code, or fails naming the input by its index.
inline int dtype_code(const at::Tensor& t, size_t index) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kDouble: return kF64;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kChar: return kI8;
    case at::kByte: return kU8;
    case at::kShort: return kI16;
    case at::kInt: return kI32;
    case at::kLong: return kI64;
    case at::kBool: return kBool;
    case at::kFloat8_e4m3fn: return kF8E4M3;
    case at::kFloat8_e5m2: return kF8E5M2;
    default:
      TORCH_CHECK_TYPE(false, "fasthealth: input ", index, " has unsupported dtype ",
                       t.scalar_type(), " (floating, integer, bool and float8 are supported)");
  }
  return -1;
}

inline void check_input(const at::Tensor& t, size_t index, c10::DeviceType device_type) {
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, "fasthealth: input ", index,
                   " is a ", t.layout(), " tensor; only strided (dense) tensors are supported");
  TORCH_CHECK(t.device().type() == device_type, "fasthealth: input ", index, " is on ",
              t.device(), " but this kernel runs on ", device_type, " tensors");
  dtype_code(t, index);
}

// One input as the CPU kernel reads it: `numel` elements of type `code` lying densely from
// `data` (`elem_bytes` each), kept alive by its owner for the call.
struct CpuInput {
  const void* data;
  int64_t numel;
  int code;
  int elem_bytes;
};

// The CPU table of inputs already checked (cpu/tensor_stats.cpp): what
// multi_tensor_stats_cpu runs after validating its tensors, and what check_grads' front door
// (fasthealth.cpp) runs on the gradients it gathered. In the read-probe build its table is not
// statistics (tensor_stats.cpp: FASTHEALTH_READ_PROBE).
at::Tensor cpu_stats_table(const std::vector<CpuInput>& inputs, double range_hi,
                           double range_lo);

#ifdef FASTHEALTH_WITH_CUDA
// The CUDA table of `n` CUDA tensors, `tensor(i)` the i-th (cuda/tensor_stats.cu): what the
// op's CUDA kernel runs, and what eager calls run straight from their Python list
// (fasthealth.cpp: cuda_table).
at::Tensor cuda_stats_table(int64_t n, const std::function<const at::Tensor&(int64_t)>& tensor,
                            double range_hi, double range_lo);
#endif

inline void check_range(double range_hi, double range_lo) {
  TORCH_CHECK(range_hi > 0 && range_lo >= 0 && range_lo <= range_hi,
              "fasthealth: range thresholds must satisfy 0 <= range_lo <= range_hi and "
              "range_hi > 0, got range_hi=", range_hi, ", range_lo=", range_lo);
}

}  // namespace fasthealth
