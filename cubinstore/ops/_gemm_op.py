"""``cubinstore.ops.gemm`` as torch custom ops, so ``torch.compile`` and CUDA graphs see it.

    torch.ops.cubinstore.gemm(a, b, kernel_id=None, splits=None) -> Tensor     # D = a @ b.T
    torch.ops.cubinstore.gemm_out(a, b, out, kernel_id=None, splits=None)      # writes out

Registered on first need (``register()``, idempotent): importing cubinstore never imports
torch. The real implementation is ``cubinstore.ops.gemm.run``, the eager path itself; the
fake implementation checks what a fake tensor has (dtype, shape, strides, device) with the
same ``check_operands`` and gives D's shape, so bad operands are the same typed
``BadArgumentError`` under tracing (dynamo wraps it in its own error, naming ours).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

__all__ = ["call", "register"]

_lock = threading.Lock()
_registered = False


def register() -> bool:
    """Register the ``cubinstore::gemm`` and ``cubinstore::gemm_out`` ops with torch, once; returns True."""
    global _registered
    if _registered:
        return True
    with _lock:
        if not _registered:
            _define()
            _registered = True
    return True


# torch.compile runs a function so marked at trace time and takes its result as a constant,
# so the first call of `gemm` may be one dynamo traces. This is the attribute that
# torch.compiler.assume_constant_result sets; it cannot be called here without importing
# torch (tests/test_gemm_op.py checks a compile-first process).
register._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _define() -> None:
    import torch

    impl = importlib.import_module("cubinstore.ops.gemm")  # the module: `cubinstore.ops.gemm` is the function

    # Schemas spelled out: this module's annotations are strings (no torch at import).
    @torch.library.custom_op("cubinstore::gemm", mutates_args=(),
                             schema="(Tensor a, Tensor b, str? kernel_id=None, int? splits=None) -> Tensor")
    def gemm(a: Any, b: Any, kernel_id: str | None = None, splits: int | None = None) -> Any:
        return impl.run(a, b, None, kernel_id, splits)

    @gemm.register_fake
    def _(a: Any, b: Any, kernel_id: str | None = None, splits: int | None = None) -> Any:
        m, n, _ = _check_fake(impl, a, b, None)
        return a.new_empty((m, n), dtype=torch.bfloat16)

    @torch.library.custom_op(
        "cubinstore::gemm_out", mutates_args=("out",),
        schema="(Tensor a, Tensor b, Tensor(a!) out, str? kernel_id=None, int? splits=None) -> ()")
    def gemm_out(a: Any, b: Any, out: Any, kernel_id: str | None = None, splits: int | None = None) -> None:
        impl.run(a, b, out, kernel_id, splits)

    @gemm_out.register_fake
    def _(a: Any, b: Any, out: Any, kernel_id: str | None = None, splits: int | None = None) -> None:
        _check_fake(impl, a, b, out)


def _check_fake(impl: Any, a: Any, b: Any, out: Any) -> tuple[Any, Any, Any]:
    """`check_operands` on what a fake tensor knows; its address is unknown, so alignment waits for the launch."""

    def describe(name: str, t: Any) -> Any:
        # Sizes stay as torch gives them (SymInts under dynamic shapes): the checks then guard on them.
        return impl.Operand(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()),
                            str(t.device), 0)

    return impl.check_operands(describe("a", a), describe("b", b), None if out is None else describe("out", out))


def call(torch: Any, a: Any, b: Any, out: Any, kernel_id: str | None, splits: int | None) -> Any:
    """`gemm_with` through the op: what dynamo traces into a graph."""
    register()
    if out is None:
        return torch.ops.cubinstore.gemm(a, b, kernel_id, splits)
    torch.ops.cubinstore.gemm_out(a, b, out, kernel_id, splits)
    return out
