"""Providers of cubinstore's rules."""

CubinInfo = provider(
    doc = "One compiled kernel instantiation.",
    fields = {
        "cubin": "(File) the .cubin; for a PTX arch (`compute_90`), the .ptx",
        "id": "(str) manifest id: <family>/<param values in grid order>/<arch>",
        "family": "(str) kernel family",
        "params_json": "(str) the instantiation's parameters as a JSON object",
        "arch": "(str) target architecture, e.g. 'sm_90a', or 'compute_90' for PTX",
        "entries_json": "(str) JSON object: entry (symbol or C++ name) -> list of parameter types",
        "launch_json": "(str) JSON object: entry -> launch geometry, values filled in for the point",
        "target": "(str) the label of the cuda_cubin target",
    },
)

CubinSetInfo = provider(
    doc = "The instantiations of one or more families.",
    fields = {
        "instances": "(list of CubinInfo) every instantiation",
        "jit_templates": "(list of File) the families' JIT templates (cubinstore/jit-family/v1 JSON)",
    },
)

CudaHeadersInfo = provider(
    doc = "Headers a CUDA compile may include.",
    fields = {
        "headers": "(depset of File) the header files",
        "includes": "(depset of str) include directories, relative to the execution root",
    },
)

PyToolInfo = provider(
    doc = "The Python sources a py_tool imports.",
    fields = {
        "srcs": "(depset of File) .py files, inputs of every action that runs the tool",
    },
)
