"""Inductor calls ``cubinstore::gemm``'s launch straight from its wrapper, not through torch's dispatcher.

Inductor's default for a custom op is a call of ``torch.ops.cubinstore.gemm.default`` in the code
it generates: the dispatcher boxes the arguments and calls back into Python, which cost 13 to 17 us
of host time a call beside ``torch.mm`` (H100, benchmarks/bench_gemm.py "under torch.compile"),
whose lowering is a direct ``extern_kernels.mm(a, b, out=buf)``. This lowering does the same for
ours: inductor allocates D (M x N, bf16, row-major: what the fake implementation says) and the
generated code calls ``torch.ops.cubinstore.gemm.cubinstore_launch(a, b, kernel_id, splits, out=buf)``,
which is ``_gemm.run``. The checks, selection and layouts are the eager path's, so nothing is
decided twice.

Why the op's packet holds the function (``attach``, when the op is defined), not inductor's
``extern_kernels`` namespace: inductor's FX graph cache hands generated code to other processes,
and its key does not cover lowerings. Any process that can trace a graph with the op has defined
the op, so the function is there whenever such code runs; ``extern_kernels`` would hold it only
where this lowering was installed. For the same reason the call's signature,
``cubinstore_launch(a, b, kernel_id, splits, *, out)``, is a contract with code already cached:
a change needs a new attribute name, the old one kept for that code.

Only the Python wrapper gets it: a C++ wrapper (AOTInductor, ``cpp_wrapper``) cannot call Python
and keeps the dispatcher's op. ``gemm_out`` keeps it too (inductor re-inplaces it itself). The
lowering uses inductor's internal IR; where this torch lacks it, ``install`` returns False and
compiled code keeps calling the op: slower, never wrong (tests/ops/test_gemm_op_gpu.py checks the
generated code of the torch the package is tested with).
"""

from __future__ import annotations

from typing import Any

from cubinstore.ops._gemm import run

__all__ = ["CALL", "attach", "install"]

_ATTRIBUTE = "cubinstore_launch"
CALL = f"torch.ops.cubinstore.gemm.{_ATTRIBUTE}"  # what the generated code calls (the wrapper imports torch)


def gemm_into(a: Any, b: Any, kernel_id: str | None, splits: int | None, *, out: Any) -> None:
    """What the generated code calls: D = a @ b.T written into inductor's buffer `out` (laid out as the lowering says)."""
    run(a, b, out, kernel_id, splits, True)


def attach(torch: Any) -> None:
    """Put the launch where generated code calls it: on the op's packet (defined a moment ago)."""
    setattr(torch.ops.cubinstore.gemm, _ATTRIBUTE, gemm_into)


def install(torch: Any) -> bool:
    """Register the lowering of ``cubinstore::gemm`` with inductor; False where this torch's inductor lacks what it needs."""
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import fallback_handler, register_lowering
        from torch._inductor.virtualized import V

        op = torch.ops.cubinstore.gemm.default
        dispatched = fallback_handler(op, add_to_fallback_set=False)
    except (ImportError, AttributeError, TypeError):  # an inductor without these internals
        return False

    def lower(a: Any, b: Any, kernel_id: str | None = None, splits: int | None = None) -> Any:
        if V.graph.cpp_wrapper:
            return dispatched(a, b, kernel_id, splits)
        try:
            a_in = ir.ExternKernel.realize_input(a)
            b_in = ir.ExternKernel.realize_input(b)
            layout = ir.FixedLayout(a_in.get_device(), torch.bfloat16, [a_in.get_size()[0], b_in.get_size()[0]])
            node = ir.ExternKernelOut(layout=layout, inputs=[a_in, b_in], constant_args=(kernel_id, splits),
                                      python_kernel_name=CALL)
        except (AttributeError, TypeError):  # inductor's IR changed under us: the op, as without this lowering
            return dispatched(a, b, kernel_id, splits)
        return ir.TensorBox.create(node)

    try:
        register_lowering(op, type_promotion_kind=None)(lower)
    except (AttributeError, TypeError):
        return False
    return True
