"""Operators built on cubinstore's kernel families.

    import cubinstore.launch, cubinstore.ops
    cubinstore.ops.set_library(cubinstore.launch.open("bazel-bin/kernels/manifest.json"))
    d = cubinstore.ops.gemm(a, b)          # a: M x K, b: N x K, bf16 CUDA tensors -> a @ b.T

Operators take their kernels from one process-wide `Library`, set once with
`set_library` (a `Library`, or a manifest path opened with the default store), or
opened on first use from `CUBINSTORE_MANIFEST` (a path or `sha256:<hex>`).
Nothing touches CUDA until an operator runs, and nothing here imports torch: with torch, an
operator is also a torch custom op (`torch.ops.cubinstore.gemm`, registered on first use;
see `_gemm_op.py`), which is what `torch.compile` puts in its graphs; inductor's generated code
then calls the launch itself, not the op through torch's dispatcher (`_gemm_inductor.py`).

`gemm_with(a, b, out=None, kernel_id=..., splits=...)` forces the instantiation and K-split
(for the tuning script and tests, which run every instantiation).

Modules, bottom up: `_library` (the library), `_gemm_config` (instantiations, plans, operand
checks), `_gemm_staging` (which operands a launch copies: any layout torch.mm takes is taken),
`_gemm_calibration` and `_gemm_model` (the selection), `_gemm` (the eager launch and
its caches), `_gemm_inductor` (inductor's direct call of the launch), `_gemm_op` (`gemm`: the
eager call or the torch op), `_gemm_tuning` (the measured
table, kept for comparison), `_timing`.
"""

from __future__ import annotations

from cubinstore.ops._gemm_op import gemm, gemm_with
from cubinstore.ops._library import get_library, set_library

__all__ = ["gemm", "gemm_with", "get_library", "set_library"]
