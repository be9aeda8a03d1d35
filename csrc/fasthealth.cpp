// Op schemas and the Python module fasthealth._C. Kernels register themselves per device:
// cpu/tensor_stats.cpp (CPU) and cuda/tensor_stats.cu (CUDA); triton_kernels/ adds its own op.
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <string>

#include <vector>

namespace fasthealth {
const char* cpu_isa_name();
std::vector<std::string> cpu_isas();
}

TORCH_LIBRARY(fasthealth, m) {
  // Row i < N: statistics of tensors[i]; row N: of all elements together. Columns: the fields of
  // csrc/stats.h (fasthealth.ops.layout.TABLE_COLUMNS), float64, counts as exact integers. The range
  // counts compare |x| with range_hi (overflow) and range_lo (underflow of non-zeros).
  m.def("multi_tensor_stats(Tensor[] tensors, float range_hi, float range_lo) -> Tensor");
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "fasthealth compiled kernels (ops live under torch.ops.fasthealth)";
  m.def("cpu_isa", []() { return std::string(fasthealth::cpu_isa_name()); },
        "Instruction set of the CPU kernel chosen at first use: 'avx512', 'avx2', 'avx' or "
        "'base' (FASTHEALTH_CPU_ISA forces one).");
  m.def("cpu_isas", &fasthealth::cpu_isas,
        "The CPU kernel variants this processor runs, fastest first.");
  // the torch this module was compiled against: fasthealth/ops/compiled.py refuses another
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                            std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
#ifdef FASTHEALTH_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
