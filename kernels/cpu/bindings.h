// What both CPU extensions' bindings share (bindings.cpp, quant/bindings.cpp): build_info
// and path_counts, the two functions nanopaged/layers/build.py's kernel_paths reads, and
// def_reports, which puts them in a module.
#pragma once

#include <torch/extension.h>

#include "path_counts.h"
#include "vec.h"

// What this build compiled in: the vector body of namespace mm, and the special paths
// (`special_paths`: false for an extension that has none, whatever its flags).
// VNNI (vpdpbusd) is in no body: gguf_linear_a8 multiplies int8 with AVX2's vpmaddubsw.
inline pybind11::dict build_info(bool special_paths) {
  pybind11::dict info;
#if defined(__AVX512F__)
  info["vector"] = "avx512";
#elif defined(__AVX2__)
  info["vector"] = "avx2";
#else
  info["vector"] = "portable";
#endif
  info["lanes"] = mm::kLanes;
#if defined(__AVX512BF16__)
  info["avx512_bf16"] = special_paths;
#else
  info["avx512_bf16"] = false;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  info["amx"] = special_paths;
#else
  info["amx"] = false;
#endif
  info["vnni"] = false;
  return info;
}

// calls per path since the module loaded: {"vector", "avx512_bf16", "amx"}
inline pybind11::dict path_counts() {
  pybind11::dict counts;
  counts["vector"] = paths::calls[paths::kVector].load();
  counts["avx512_bf16"] = paths::calls[paths::kAvx512Bf16].load();
  counts["amx"] = paths::calls[paths::kAmx].load();
  return counts;
}

// Both reports on module m: every CPU extension has them (kernel_paths reads them).
inline void def_reports(pybind11::module_& m, bool special_paths) {
  m.def("build_info", [special_paths] { return build_info(special_paths); },
        "What this build compiled in: its vector body and special paths");
  m.def("path_counts", &path_counts, "Calls per instruction-set path since the module loaded");
}
