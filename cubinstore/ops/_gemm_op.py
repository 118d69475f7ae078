"""``cubinstore.ops.gemm``: the eager launch, or the torch custom ops ``torch.compile`` and CUDA graphs see.

    torch.ops.cubinstore.gemm(a, b, kernel_id=None, splits=None) -> Tensor     # D = a @ b.T
    torch.ops.cubinstore.gemm_out(a, b, out, kernel_id=None, splits=None)      # writes out

``gemm`` (and ``gemm_with``, which forces the instantiation) calls the eager path,
``_gemm.run``, on plain tensors; under ``torch.compile`` or on a tensor subclass (fake,
functional) it calls the op. The ops are registered on first need (``register()``,
idempotent): importing cubinstore never imports torch. The op's real implementation is
``_gemm.run`` too; its fake implementation checks what a fake tensor has (dtype, shape,
strides, device) with the same ``check_operands`` and gives D's shape, so bad operands are
the same typed ``BadArgumentError`` under tracing (dynamo wraps it in its own error, naming ours).
A call traced by dynamo also installs inductor's lowering of ``gemm`` (``_gemm_inductor``), so
the compiled code calls the launch without the dispatcher's round trip into Python.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from cubinstore.ops import _gemm_inductor
from cubinstore.ops._gemm import run
from cubinstore.ops._gemm_config import Operand, check_operands

__all__ = ["call", "gemm", "gemm_with", "register"]

_lock = threading.Lock()
_registered = False
_lowered = False  # whether inductor's lowering of the op is installed (_gemm_inductor), or found unavailable
_PLAIN: tuple[type, ...] = ()  # torch.Tensor and nn.Parameter, once torch is seen


def gemm(a: Any, b: Any, *, out: Any = None) -> Any:
    """D = a @ b.T: `a` (M x K) and `b` (N x K) bf16 CUDA tensors; returns D (M x N, bf16, contiguous).

    Any layout `torch.mm(a, b.T)` takes is taken: any M, N, K, strides and offsets. `out`,
    when given, is a bf16 M x N tensor on the same device, of any strides; it is written and
    returned. Runs on the current torch stream of that device, with the instantiation and
    K-split chosen for (M, N, K) (once per shape). Raises `BadArgumentError` for bad dtypes,
    ranks, shapes or devices, before any launch. The kernels read `a` and `b` in place when
    their rows are contiguous, a multiple of 8 elements (16 bytes) apart and start 16-byte
    aligned; otherwise the launch copies them first (K off 8, a transposed or sliced view, an
    odd offset; docs/gemm.md, "Layouts that copy", says what that costs), except a B with rows
    off 16 bytes for few rows of A, which the skinny_any kernels read in place; and a D that is not
    row-major is computed apart and copied into `out`. Rows that start on 128-byte lines (a row
    stride a multiple of 64 elements, e.g. a weight stored padded: ``torch.empty(n, k_pad)[:, :k]``)
    load up to 1.5x faster than rows off them, and a padded weight is never copied.
    Under `torch.compile` (and on fake or other tensor subclasses) the
    call is the custom op `torch.ops.cubinstore.gemm` (`gemm_out` with `out`), which
    dynamo puts in the graph; eager calls on plain tensors skip torch's dispatcher.
    """
    return gemm_with(a, b, out=out, kernel_id=None, splits=None)


def gemm_with(a: Any, b: Any, *, out: Any = None, kernel_id: str | None, splits: int | None) -> Any:
    """`gemm` with the instantiation and K-split forced (None: the selection's).

    For the tuning script and tests, which must run every instantiation.
    """
    torch = sys.modules.get("torch")  # never imported here: a caller with torch tensors has imported it
    if torch is not None and _through_op(torch, a, b, out):
        return call(torch, a, b, out, kernel_id, splits)
    return run(a, b, out, kernel_id, splits)


def _through_op(torch: Any, a: Any, b: Any, out: Any) -> bool:
    """Whether a call must go through the torch op: under torch.compile, or on a tensor subclass (fake, functional)."""
    global _PLAIN
    if torch.compiler.is_compiling():
        return True
    if not _PLAIN:
        _PLAIN = (torch.Tensor, torch.nn.Parameter)
    plain = _PLAIN
    return any(type(t) not in plain and isinstance(t, torch.Tensor) for t in (a, b, out))


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


def register_for_compile() -> bool:
    """`register`, and inductor's direct call of the launch (`_gemm_inductor`), once; returns True.

    Apart from `register` because it imports inductor (about a second), which only a compile needs."""
    global _lowered
    register()
    if not _lowered:
        with _lock:
            if not _lowered:
                _gemm_inductor.install(sys.modules["torch"])
                _lowered = True
    return True


# torch.compile runs a function so marked at trace time and takes its result as a constant,
# so the first call of `gemm` may be one dynamo traces. This is the attribute that
# torch.compiler.assume_constant_result sets; it cannot be called here without importing
# torch (tests/ops/test_gemm_op.py checks a compile-first process).
register._dynamo_marked_constant = True  # type: ignore[attr-defined]
register_for_compile._dynamo_marked_constant = True  # type: ignore[attr-defined]


_library: Any = None  # the torch.library.Library defining the ops: kept, or torch drops them


def _define() -> None:
    # torch.library.Library, not torch.library.custom_op: custom_op puts its own Python autograd
    # layer in front of every call the compiled graph makes (measured: it cost 10 to 20 us of host
    # time a call under inductor, benchmarks/bench_gemm.py "under torch.compile"). The ops have no
    # backward: the one implementation serves every device, and ours words a wrong one.
    import torch

    global _library
    library = torch.library.Library("cubinstore", "DEF")
    library.define("gemm(Tensor a, Tensor b, str? kernel_id=None, int? splits=None) -> Tensor")
    library.define("gemm_out(Tensor a, Tensor b, Tensor(a!) out, str? kernel_id=None, int? splits=None) -> ()")

    def gemm(a: Any, b: Any, kernel_id: str | None = None, splits: int | None = None) -> Any:
        return run(a, b, None, kernel_id, splits)

    def gemm_out(a: Any, b: Any, out: Any, kernel_id: str | None = None, splits: int | None = None) -> None:
        run(a, b, out, kernel_id, splits)

    def gemm_fake(a: Any, b: Any, kernel_id: str | None = None, splits: int | None = None) -> Any:
        m, n, _ = _check_fake(a, b, None)
        return a.new_empty((m, n), dtype=torch.bfloat16)

    def gemm_out_fake(a: Any, b: Any, out: Any, kernel_id: str | None = None, splits: int | None = None) -> None:
        _check_fake(a, b, out)

    library.impl("gemm", gemm, "CompositeExplicitAutograd")
    library.impl("gemm_out", gemm_out, "CompositeExplicitAutograd")
    torch.library.register_fake("cubinstore::gemm", gemm_fake, lib=library)
    torch.library.register_fake("cubinstore::gemm_out", gemm_out_fake, lib=library)
    _gemm_inductor.attach(torch)  # what inductor's generated code calls (register_for_compile)
    _library = library


def _check_fake(a: Any, b: Any, out: Any) -> tuple[Any, Any, Any]:
    """`check_operands` on what a fake tensor knows. Layouts and addresses decide only what the launch
    copies (`_gemm_staging`), never D's shape, dtype or strides, so the fake result is the real one's."""

    def describe(name: str, t: Any) -> Any:
        # Sizes stay as torch gives them (SymInts under dynamic shapes): the checks then guard on them.
        return Operand(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()),
                       str(t.device), 0)

    return check_operands(describe("a", a), describe("b", b), None if out is None else describe("out", out))


def call(torch: Any, a: Any, b: Any, out: Any, kernel_id: str | None, splits: int | None) -> Any:
    """`gemm_with` through the op: what dynamo traces into a graph."""
    if torch.compiler.is_compiling():
        register_for_compile()
    else:
        register()
    if out is None:
        return torch.ops.cubinstore.gemm(a, b, kernel_id, splits)
    torch.ops.cubinstore.gemm_out(a, b, out, kernel_id, splits)
    return out
