// Op schemas and the Python module fasthealth._C. Kernels register themselves per device:
// cpu/tensor_stats.cpp (CPU) and cuda/tensor_stats.cu (CUDA); triton_kernels/ adds its own op.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <string>
#include <vector>

#include "inputs.h"
#include "plan.h"
#include "work_list.h"

namespace fasthealth {
const char* cpu_isa_name();
std::vector<std::string> cpu_isas();

namespace {

// A CPU gradient the kernel reads directly: dense storage and exactly the dispatch keys of a
// plain CPU tensor. Anything else goes through the dispatcher, which resolves it first: a lazy
// negation or conjugation (a `_neg_view` read raw would flip every sign), an efficient zero
// tensor, a Python subclass (DTensor), functorch and fake tensors.
bool plain_cpu(const at::Tensor& g) {
  if (!g.defined() || g.layout() != at::kStrided || !g.device().is_cpu()) return false;
  if (!g.is_contiguous() && !g.is_non_overlapping_and_dense()) return false;
  static const c10::DispatchKeySet plain({c10::DispatchKey::CPU,
                                          c10::DispatchKey::ADInplaceOrView,
                                          c10::DispatchKey::AutogradCPU,
                                          c10::DispatchKey::AutocastCPU});
  return plain.isSupersetOf(g.key_set());
}

void prefetch(const void* p, int lines) {
  for (int k = 0; k < lines; ++k) __builtin_prefetch(static_cast<const char*>(p) + 64 * k);
}

// Parameters gathered a block at a time, one level of pointers per sweep (the Python object,
// its TensorImpl, its autograd meta, the gradient's TensorImpl, its storage), each sweep
// prefetching the next level for the whole block: the loads of a block overlap instead of
// waiting on each other, which is what a gradient list costs when the caches are cold.
constexpr Py_ssize_t kBlock = 128;

// Gradients up to this many bytes are read with the GIL held: at CPU memory rates that is on
// the order of a millisecond, well inside Python's own 5 ms thread switch interval, and holding
// it spares taking a reference to each gradient. Larger ones release it, so that other Python
// threads (a data loader's) run during the pass.
constexpr int64_t kHoldGilBytes = int64_t{32} << 20;

// check_grads' front door for CPU models (fasthealth/params.py): (the table, the gradients'
// dtype codes as bytes, the indices of the parameters without one) for `params`, each held by its
// module (`dicts[i][keys[i]] is params[i]`), read without a Python attribute access or a
// dispatcher call per tensor. A parameter without a gradient (frozen, as in LoRA fine-tuning,
// or unused this step) is skipped and listed, as the general path does. None when the front
// door does not apply (a slot replaced, no gradient at all, a gradient sparse, strided, on
// another device, a tensor subclass, an unsupported dtype): the caller then takes the general
// path, which handles each case and names any bad input.
py::object param_grads_table(py::list params, py::list dicts, py::list keys, double range_hi,
                             double range_lo) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  if (n == 0 || PyList_GET_SIZE(dicts.ptr()) != n || PyList_GET_SIZE(keys.ptr()) != n ||
      !(range_hi > 0 && range_lo >= 0 && range_lo <= range_hi)) {
    return py::none();
  }
  std::vector<const at::Tensor*> grads;  // held by their parameters' autograd meta
  std::vector<CpuInput> inputs;
  grads.reserve(n);
  inputs.reserve(n);
  int64_t bytes = 0;
  std::vector<Py_ssize_t> missing;
  c10::TensorImpl* impl[kBlock];
  c10::AutogradMetaInterface* meta[kBlock];
  bool has[kBlock];
  for (Py_ssize_t b = 0; b < n; b += kBlock) {
    const Py_ssize_t m = std::min(kBlock, n - b);
    PyObject** ps = &PyList_GET_ITEM(params.ptr(), b);
    for (Py_ssize_t i = 0; i < m; ++i) {
      prefetch(ps[i], 1);
      prefetch(PyList_GET_ITEM(dicts.ptr(), b + i), 1);
    }
    for (Py_ssize_t i = 0; i < m; ++i) {
      PyObject* d = PyList_GET_ITEM(dicts.ptr(), b + i);
      if (!PyDict_Check(d) || !THPVariable_Check(ps[i])) return py::none();
      PyObject* held = PyDict_GetItemWithError(d, PyList_GET_ITEM(keys.ptr(), b + i));
      if (held != ps[i]) {  // replaced behind the registration hooks: the general path
        PyErr_Clear();
        return py::none();
      }
      impl[i] = THPVariable_Unpack(ps[i]).unsafeGetTensorImpl();
      // Only its autograd meta pointer is read, and it lies in the first cache line (after the
      // vtable, the counts and the storage): prefetching more of the TensorImpl only adds
      // memory traffic that many small tensors pay for.
      prefetch(impl[i], 1);
    }
    for (Py_ssize_t i = 0; i < m; ++i) {
      meta[i] = impl[i]->autograd_meta();  // none: a tensor that never required a gradient
      has[i] = meta[i] != nullptr;
      if (has[i]) prefetch(meta[i], 2);
    }
    for (Py_ssize_t i = 0; i < m; ++i) {
      has[i] = has[i] && meta[i]->grad().defined();
      if (!has[i]) continue;
      impl[i] = meta[i]->grad().unsafeGetTensorImpl();
      prefetch(impl[i], 4);
    }
    for (Py_ssize_t i = 0; i < m; ++i) {
      if (!has[i]) continue;
      const at::Tensor& g = meta[i]->grad();
      if (!plain_cpu(g)) return py::none();
      if (g.has_storage()) prefetch(g.storage().unsafeGetStorageImpl(), 1);
    }
    for (Py_ssize_t i = 0; i < m; ++i) {
      if (!has[i]) {
        missing.push_back(b + i);
        continue;
      }
      const at::Tensor& g = meta[i]->grad();
      try {
        const int code = dtype_code(g, static_cast<size_t>(b + i));
        inputs.push_back({g.data_ptr(), g.numel(), code, static_cast<int>(g.element_size())});
        bytes += g.numel() * static_cast<int64_t>(g.element_size());
      } catch (const c10::Error&) {  // the general path names the input
        return py::none();
      }
      grads.push_back(&g);
    }
  }
  if (inputs.empty()) return py::none();  // the general path warns that backward() is missing
  at::Tensor out;
  if (bytes <= kHoldGilBytes) {
    // Under the GIL no Python code can drop a gradient while the kernel reads it, so no
    // reference is taken: that saves two atomic count updates per tensor, a visible share of
    // the cost of checking a small one.
    out = cpu_stats_table(inputs, range_hi, range_lo);
  } else {
    std::vector<at::Tensor> alive;  // kept alive while the kernel runs without the GIL
    alive.reserve(grads.size());
    for (const at::Tensor* g : grads) alive.push_back(*g);
    py::gil_scoped_release no_gil;
    out = cpu_stats_table(inputs, range_hi, range_lo);
  }
  // The dtypes, for the stats' float fields, as one code a byte: a list of the gradients would
  // touch each one's Python object again, a cache miss per tensor when the caches are cold.
  std::string codes(inputs.size(), '\0');
  for (size_t i = 0; i < inputs.size(); ++i) codes[i] = static_cast<char>(inputs[i].code);
  return py::make_tuple(out, py::bytes(codes), py::cast(missing));
}

PlanLimits limits_of(const std::vector<int64_t>& v) {
  TORCH_CHECK_VALUE(v.size() == 5 && v[0] > 0 && v[1] > 0 && v[1] <= v[0] && v[4] > 0,
                    "fasthealth: plan limits are (max_chunk, min_chunk, resident, item_cost, "
                    "merge_run)");
  return {v[0], v[1], v[2], v[3], v[4]};
}

// The GPU work list of `tensors` (work_list.h), for the Triton launcher and the host benchmark:
// (buffer, n_items, n_runs, chunk, groups as (dtype code, 16-byte aligned, first item, end));
// `params` (float64) follow the plan in the buffer.
// `grouped`: one launch group per dtype and alignment (Triton), else one (CUDA). The tensors are
// read straight from the list: no Python attribute access, no reference taken per tensor.
py::tuple work_list_py(py::list tensors, bool grouped, bool capturing,
                       const std::vector<int64_t>& limits, const std::vector<double>& params) {
  const int64_t n = static_cast<int64_t>(PyList_GET_SIZE(tensors.ptr()));
  TORCH_CHECK_VALUE(n > 0, "fasthealth: multi_tensor_stats needs at least one tensor");
  auto get = [&](int64_t i) -> const at::Tensor& {
    PyObject* o = PyList_GET_ITEM(tensors.ptr(), i);
    TORCH_CHECK_TYPE(THPVariable_Check(o), "fasthealth: input ", i, " is a ",
                     Py_TYPE(o)->tp_name, ", not a torch.Tensor");
    return THPVariable_Unpack(o);
  };
  const PlanLimits lim = limits_of(limits);
  std::vector<at::Tensor> staged;  // (the cache holds them too; Python launches under the GIL)
  const std::vector<TensorMeta> metas =
      kernel_inputs(n, get, get(0).device().type(),
                    grouped ? Grouping::kDtypeAlignment : Grouping::kOne, capturing, &staged);
  const DeviceWorkList wl = work_list(metas, get(0).device(), lim, params, capturing);
  const int64_t groups = static_cast<int64_t>(wl.group_begin.size()) - 1;
  py::tuple out_groups(groups);
  std::vector<bool> seen(groups, false);
  for (const TensorMeta& m : metas) {
    if (seen[m.group]) continue;
    seen[m.group] = true;
    out_groups[m.group] = py::make_tuple(m.dtype, reinterpret_cast<uintptr_t>(m.ptr) % 16 == 0,
                                         wl.group_begin[m.group], wl.group_begin[m.group + 1]);
  }
  return py::make_tuple(wl.buffer, wl.n_items, wl.n_runs, wl.chunk, out_groups);
}

#ifdef FASTHEALTH_WITH_CUDA
// A tensor the eager CUDA path reads straight from the list: a plain CUDA tensor, exactly the
// dispatch keys of one (as plain_cpu above for CPU). Anything else (a lazy negation or
// conjugation, a subclass, a fake or functorch tensor) needs the dispatcher to resolve it.
bool plain_cuda(const at::Tensor& t) {
  static const c10::DispatchKeySet plain({c10::DispatchKey::CUDA,
                                          c10::DispatchKey::ADInplaceOrView,
                                          c10::DispatchKey::AutogradCUDA,
                                          c10::DispatchKey::AutocastCUDA});
  return t.defined() && plain.isSupersetOf(t.key_set());
}

struct NotPlain {};

// The CUDA op's table for eager calls, straight from the Python list: the dispatcher's
// conversion of a list of N tensors costs about as much again as the whole launch's host work
// (bench/bench_host.py: dispatch), and nothing needs it for plain CUDA tensors. None when an
// input is not a plain CUDA tensor: the caller then calls the op.
py::object cuda_table_py(py::list tensors, double range_hi, double range_lo) {
  const int64_t n = static_cast<int64_t>(PyList_GET_SIZE(tensors.ptr()));
  auto get = [&](int64_t i) -> const at::Tensor& {
    PyObject* o = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(o)) throw NotPlain{};
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!plain_cuda(t)) throw NotPlain{};
    return t;
  };
  try {
    return py::cast(cuda_stats_table(n, get, range_hi, range_lo));
  } catch (const NotPlain&) {
    return py::none();
  }
}
#endif

// The plan itself (plan.h) of tensors of these sizes and launch groups, for tests:
// (chunk, items as (tensor, slot, begin, count), group_begin, first, runs, run_first).
py::tuple plan_py(const std::vector<int64_t>& numels, const std::vector<int32_t>& groups,
                  const std::vector<int64_t>& limits) {
  TORCH_CHECK_VALUE(numels.size() == groups.size(), "fasthealth: one group per tensor");
  std::vector<TensorMeta> metas(numels.size());
  for (size_t i = 0; i < numels.size(); ++i) metas[i] = {nullptr, numels[i], kF32, groups[i]};
  const WorkPlan p = plan_work(metas, limits_of(limits));
  py::list items;
  for (const ChunkItem& it : p.items) {
    items.append(py::make_tuple(it.tensor, it.slot, it.begin, it.count));
  }
  return py::make_tuple(p.chunk, items, p.group_begin, p.first, p.runs, p.run_first);
}

}  // namespace
}  // namespace fasthealth

// The read-probe build (bench/read_probe.py) is a second module loaded beside _C: defining the
// op again there would fail its registration.
#ifndef FASTHEALTH_READ_PROBE
TORCH_LIBRARY(fasthealth, m) {
  // Row i < N: statistics of tensors[i]; row N: of all elements together. Columns: the fields of
  // csrc/stats.h (fasthealth.ops.layout.TABLE_COLUMNS), float64, counts as exact integers. The range
  // counts compare |x| with range_hi (overflow) and range_lo (underflow of non-zeros).
  m.def("multi_tensor_stats(Tensor[] tensors, float range_hi, float range_lo) -> Tensor");
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fasthealth compiled kernels (ops live under torch.ops.fasthealth)";
  m.def("cpu_isa", []() { return std::string(fasthealth::cpu_isa_name()); },
        "Instruction set of the CPU kernel chosen at first use: 'avx512', 'avx2', 'avx' or "
        "'base' (FASTHEALTH_CPU_ISA forces one).");
  m.def("cpu_isas", &fasthealth::cpu_isas,
        "The CPU kernel variants this processor runs, fastest first.");
  m.def("param_grads_table", &fasthealth::param_grads_table, py::arg("params"),
        py::arg("dicts"), py::arg("keys"), py::arg("range_hi"), py::arg("range_lo"),
        "check_grads' CPU front door: (stats table, dtype codes, indices without a gradient) "
        "of the parameters, or None when the general path must run (see "
        "csrc/fasthealth.cpp).");
  m.def("work_list", &fasthealth::work_list_py, py::arg("tensors"), py::arg("grouped"),
        py::arg("capturing"), py::arg("limits"), py::arg("params"),
        "The GPU work list of the tensors, cached (csrc/work_list.h): (buffer, items, runs, "
        "chunk, launch groups).");
#ifdef FASTHEALTH_WITH_CUDA
  m.def("cuda_table", &fasthealth::cuda_table_py, py::arg("tensors"), py::arg("range_hi"),
        py::arg("range_lo"),
        "The CUDA op's table for an eager call on plain CUDA tensors, without the dispatcher; "
        "None when the op must run instead (see csrc/fasthealth.cpp).");
#endif
  m.def("plan", &fasthealth::plan_py, py::arg("numels"), py::arg("groups"), py::arg("limits"),
        "The work plan of tensors of these sizes (csrc/plan.h), for tests.");
  m.def("cuda_plan_limits", [](int64_t resident) {
          const fasthealth::PlanLimits l = fasthealth::cuda_plan_limits(resident);
          return std::vector<int64_t>{l.max_chunk, l.min_chunk, l.resident, l.item_cost,
                                      l.merge_run};
        }, py::arg("resident"), "The CUDA kernel's plan limits for `resident` blocks.");
  m.def("cache_counts", &fasthealth::cache_counts,
        "(work lists, of them pinned, staging buffers, of them pinned) in the cache.");
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
