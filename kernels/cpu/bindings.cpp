// The base CPU extension as one Python module (nanopaged/layers/build.py builds it from
// this folder's .cpp files): attention, the cache ops, the layer ops and the matmuls.
// Every kernel is counted on its way in (path_counts.h).

#include "bindings.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  def_reports(m, /*special_paths=*/true);
  m.def("paged_attention", &Counted<&paged_attention>::call,
        "Causal paged attention, prefill and decode rows (CPU)");
  m.def("paged_attention_decode", &Counted<&paged_attention_decode>::call, "Paged attention for decode (CPU)");
  m.def("reshape_and_cache", &Counted<&reshape_and_cache>::call, "Write K/V rows to their slots (CPU)");
  m.def("copy_blocks", &Counted<&copy_blocks>::call, "Copy KV blocks within the pool (copy-on-write, CPU)");
  m.def("swap_blocks", &Counted<&swap_blocks>::call, "Copy KV blocks between two pools (swap, CPU)");
  m.def("linear", &Counted<&linear>::call, "x W^T, batch-invariant, fp32 or bf16 (CPU)");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def("linear_amx", &Counted<&linear_amx>::call, "x W^T on AMX tiles, W packed, bf16 (CPU)");
#endif
  m.def("rms_norm", &Counted<&rms_norm>::call, "RMSNorm (CPU)");
  m.def("fused_add_rms_norm", &Counted<&fused_add_rms_norm>::call,
        "residual += x; x = RMSNorm(residual), in place (CPU)");
  m.def("silu_and_mul", &Counted<&silu_and_mul>::call, "silu(gate) * up (CPU)");
  m.def("rotary_embedding", &Counted<&rotary_embedding>::call, "RoPE in place on query and key (CPU)");
}
