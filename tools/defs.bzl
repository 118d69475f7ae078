"""Public entry point of cubinstore's Starlark rules.

- `cuda_cubin`: one kernel instantiation compiled to one `.cubin` (mnemonic `CubinCompile`).
- `cuda_ptx`: the same compile to PTX text for a `compute_` arch (mnemonic `PtxCompile`); the
  macro's `ptx = [...]` makes them.
- `cubin_instantiations`: expands an instantiation matrix into one `cuda_cubin` per point.
- `cubin_family`: groups the instantiations of one family (made by the macro).
- `cubin_manifest`: writes `manifest.json` (schema `cubinstore/manifest/v1`, mnemonic `CubinManifest`).
- `cuda_headers`: headers plus include directories for `deps`.
- `nvcc_cubin`: one call of a library's JIT rebuilt as `cubinstore-nvcc` compiled it (mnemonic
  `CubinCompile`); `cubinstore warmset export --nvcc` writes them.
- `cubin_jit_template`: a family's JIT template and source bundle (mnemonic `CubinJitTemplate`),
  so `cubinstore.jit.compile_family_point` can compile points no manifest has.
"""

load("//tools/private:providers.bzl", _CubinInfo = "CubinInfo", _CubinSetInfo = "CubinSetInfo", _CudaHeadersInfo = "CudaHeadersInfo")
load("//tools/private/macros:cubin_instantiations.bzl", _cubin_instantiations = "cubin_instantiations")
load("//tools/private/rules:cubin_family.bzl", _cubin_family = "cubin_family")
load("//tools/private/rules:cubin_jit_template.bzl", _cubin_jit_template = "cubin_jit_template")
load("//tools/private/rules:cubin_manifest.bzl", _cubin_manifest = "cubin_manifest")
load("//tools/private/rules:cuda_cubin.bzl", _cuda_cubin = "cuda_cubin")
load("//tools/private/rules:cuda_headers.bzl", _cuda_headers = "cuda_headers")
load("//tools/private/rules:cuda_ptx.bzl", _cuda_ptx = "cuda_ptx")
load("//tools/private/rules:nvcc_cubin.bzl", _nvcc_cubin = "nvcc_cubin")

CubinInfo = _CubinInfo
CubinSetInfo = _CubinSetInfo
CudaHeadersInfo = _CudaHeadersInfo
cuda_cubin = _cuda_cubin
cuda_ptx = _cuda_ptx
cuda_headers = _cuda_headers
cubin_family = _cubin_family
cubin_jit_template = _cubin_jit_template
cubin_manifest = _cubin_manifest
cubin_instantiations = _cubin_instantiations
nvcc_cubin = _nvcc_cubin
