// The LoRA extension as one Python module, beside the base one (nanopaged/lora/kernels.py
// builds it from this folder's .cpp files): Punica's two BGMV halves. Every kernel is
// counted on its way in (../path_counts.h); this module has no vdpbf16ps or AMX path.

#include "../bindings.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_reports(m, /*special_paths=*/false);
  m.def("lora_shrink", &Counted<&lora_shrink>::call,
        "out[i] = x[i] a[slots[i]]^T in fp32, each row its own adapter slot (-1: zeros), batch-invariant (CPU)");
  m.def("lora_expand", &Counted<&lora_expand>::call,
        "y[i] += (t[i] b[slots[i]]^T) * scales[slots[i]] in place (-1: untouched), batch-invariant (CPU)");
}
