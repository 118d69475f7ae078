"""cuda_ptx: one kernel instantiation compiled by nvcc to PTX text, which the driver compiles at load.

A family ships PTX (`cubin_instantiations(ptx = [...])`) so that a GPU no CUBIN of the release runs
on can still load its kernels; the runtime picks PTX only then. The compile is cuda_cubin's with
`-ptx` for `-cubin` and a `compute_` arch (mnemonic PtxCompile); the manifest records it as a
kernel whose arch is that `compute_` arch.
"""

load("//tools/private/rules:cuda_cubin.bzl", "CUDA_CUBIN_ATTRS", "compile_instance")

def _cuda_ptx_impl(ctx):
    return compile_instance(ctx, ptx = True)

cuda_ptx = rule(
    implementation = _cuda_ptx_impl,
    doc = "Compiles one .cu translation unit to PTX text for one `compute_` arch (mnemonic PtxCompile).",
    attrs = CUDA_CUBIN_ATTRS,
)
