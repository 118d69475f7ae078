"""cubinstore.ops.gemm as a torch custom op, without a GPU: fake tensors, tracing, typed errors, lazy registration.

Fake tensors on device "cuda" need no GPU (`FakeTensorMode`), so the op's fake
implementation, dynamo's graph (`torch.compile(fullgraph=True)` with a backend
that records it) and `make_fx` run here; the real kernels run in test_gemm_op_gpu.py.
torch is pinned in requirements-dev.txt (tools/bootstrap.sh installs it); a venv without it skips these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import cubinstore.ops as ops
from cubinstore.errors import BadArgumentError
from cubinstore.internals import gemm_op as _gemm_op

REPO = Path(__file__).resolve().parents[2]

torch = pytest.importorskip("torch", reason="the torch op tests need torch (pinned in requirements-dev.txt: run tools/bootstrap.sh)")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402


def fake_cuda(*shape: int, dtype: Any = None, strides: tuple[int, ...] | None = None) -> Any:
    """A fake CUDA tensor (call inside FakeTensorMode)."""
    dtype = torch.bfloat16 if dtype is None else dtype
    if strides is None:
        return torch.empty(*shape, dtype=dtype, device="cuda")
    return torch.empty_strided(shape, strides, dtype=dtype, device="cuda")


class GraphRecorder:
    """A torch.compile backend that keeps each graph dynamo hands it and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[Any] = []

    def __call__(self, gm: Any, inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> list[str]:
        return [str(node.target) for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"]


def test_fake_gemm_gives_d_shape_dtype_and_device() -> None:
    with FakeTensorMode():
        d = ops.gemm(fake_cuda(5, 64), fake_cuda(24, 64))
        direct = torch.ops.cubinstore.gemm(fake_cuda(3, 16), fake_cuda(7, 16))
    assert (tuple(d.shape), d.dtype, d.device.type) == ((5, 24), torch.bfloat16, "cuda")
    assert (tuple(direct.shape), direct.dtype) == ((3, 7), torch.bfloat16)


ODD = (1, 7, 9, 15, 127, 1111)


def odd_layouts(m: int, n: int, k: int) -> list[tuple[str, Any, Any]]:
    """(what, A, B) of M x K and N x K in layouts the kernels cannot all read in place (call inside FakeTensorMode)."""
    return [
        ("contiguous", fake_cuda(m, k), fake_cuda(n, k)),
        ("transposed", fake_cuda(k, m).T, fake_cuda(k, n).T),
        ("offset views of padded rows", fake_cuda(m, k + 9)[:, 1 : k + 1], fake_cuda(n + 1, k + 8)[1:, :k]),
        ("expanded rows", fake_cuda(1, k).expand(m, k), fake_cuda(n, k)),
    ]


@pytest.mark.parametrize("m", ODD)
@pytest.mark.parametrize("n", ODD)
@pytest.mark.parametrize("k", ODD)
def test_fake_gemm_agrees_with_torch_mm_on_every_odd_shape_and_layout(m: int, n: int, k: int) -> None:
    # The real op returns a fresh contiguous D whatever the operands' layout (copies happen inside
    # the launch); the fake must say so, as torch.mm's own fake does.
    with FakeTensorMode():
        for what, a, b in odd_layouts(m, n, k):
            d, ref = ops.gemm(a, b), torch.mm(a, b.T)
            assert (d.shape, d.dtype, d.stride(), d.device) == (ref.shape, ref.dtype, ref.stride(), ref.device), what
            direct = torch.ops.cubinstore.gemm(a, b)
            assert (direct.shape, direct.stride()) == (ref.shape, ref.stride()), what
            out = fake_cuda(n, m).T  # a transposed D: written through a copy
            assert ops.gemm(a, b, out=out) is out, what


def test_compile_fullgraph_takes_odd_k_and_views_into_one_op() -> None:
    # The copies a layout needs are inside the op: the graph holds the op and nothing else of ours.
    recorder = GraphRecorder()

    def f(a: Any, b: Any) -> Any:
        return ops.gemm(a, b) * 2

    with FakeTensorMode():
        a, b = fake_cuda(1111, 777).T, fake_cuda(3333, 1120)[:, 3:1114]
        d = torch.compile(f, fullgraph=True, backend=recorder)(a, b)
    assert tuple(d.shape) == (777, 3333) and d.stride() == (3333, 1)
    ours = [t for t in recorder.targets() if t.startswith("cubinstore")]
    assert ours in (["cubinstore.gemm.default"], ["cubinstore.gemm"]), recorder.targets()


def test_one_dynamic_shape_graph_serves_k_on_and_off_8() -> None:
    # K off 8 is not a guard: nothing in the checks asks K % 8 any more.
    recorder = GraphRecorder()
    f = torch.compile(lambda a, b: ops.gemm(a, b) + 1, fullgraph=True, backend=recorder, dynamic=True)
    with FakeTensorMode():
        shapes = [tuple(f(fake_cuda(12, k), fake_cuda(24, k)).shape) for k in (64, 1111, 1112, 9)]
    assert shapes == [(12, 24)] * 4
    assert len(recorder.graphs) == 1


def test_compile_fullgraph_puts_the_op_in_the_graph() -> None:
    recorder = GraphRecorder()

    def f(a: Any, b: Any) -> Any:
        return ops.gemm(a, b) * 2

    with FakeTensorMode():
        d = torch.compile(f, fullgraph=True, backend=recorder)(fake_cuda(4, 64), fake_cuda(8, 64))
    assert tuple(d.shape) == (4, 8)
    assert "cubinstore.gemm.default" in recorder.targets() or "cubinstore.gemm" in recorder.targets()


def test_one_dynamic_shape_graph_serves_every_m() -> None:
    # The fake implementation's checks guard on symbolic sizes rather than specialising them.
    recorder = GraphRecorder()
    f = torch.compile(lambda a, b: ops.gemm(a, b) + 1, fullgraph=True, backend=recorder, dynamic=True)
    with FakeTensorMode():
        shapes = [tuple(f(fake_cuda(m, 64), fake_cuda(24, 64)).shape) for m in (4, 12, 100)]
    assert shapes == [(4, 24), (12, 24), (100, 24)]
    assert len(recorder.graphs) == 1


def test_compile_fullgraph_with_out_puts_the_mutating_op_in_the_graph() -> None:
    recorder = GraphRecorder()

    def f(a: Any, b: Any, d: Any) -> Any:
        ops.gemm(a, b, out=d)
        return d + 1

    with FakeTensorMode():
        r = torch.compile(f, fullgraph=True, backend=recorder)(fake_cuda(4, 64), fake_cuda(8, 64), fake_cuda(4, 8))
    assert tuple(r.shape) == (4, 8)
    assert any(t.startswith("cubinstore.gemm_out") for t in recorder.targets()), recorder.targets()


def test_make_fx_traces_the_forced_instantiation_into_the_graph() -> None:
    def f(a: Any, b: Any) -> Any:
        return ops.gemm_with(a, b, kernel_id="gemm/bm128/bn64/bk64/stages8/cluster1/swap0/sm_90a", splits=2)

    with FakeTensorMode():
        gm = make_fx(f, tracing_mode="fake")(fake_cuda(2, 128), fake_cuda(64, 128))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in calls] == ["cubinstore.gemm.default"]
    assert calls[0].args[2:] == ("gemm/bm128/bn64/bk64/stages8/cluster1/swap0/sm_90a", 2)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: (fake_cuda(4, 64, dtype=torch.float32), fake_cuda(8, 64)), r"^gemm a: expected dtype bfloat16, got float32$"),
    (lambda: (fake_cuda(4, 64), fake_cuda(8, 32)), r"^gemm: a is 4x64 and b is 8x32: expected the same K"),
    (lambda: (fake_cuda(4, 64, 2), fake_cuda(8, 64)), r"^gemm a: expected a 2-D tensor, got 3-D"),
    (lambda: (fake_cuda(4, 64), fake_cuda(8, 64).T), r"^gemm: a is 4x64 and b is 64x8: expected the same K"),
])
def test_bad_operands_through_the_op_are_typed_errors(make: Callable[[], tuple[Any, Any]], message: str) -> None:
    with FakeTensorMode():
        a, b = make()
        with pytest.raises(BadArgumentError, match=message):
            torch.ops.cubinstore.gemm(a, b)
        with pytest.raises(BadArgumentError, match=message):
            ops.gemm(a, b)  # a fake tensor goes through the op too


def test_bad_out_through_the_op_is_a_typed_error() -> None:
    with FakeTensorMode():
        a, b, d = fake_cuda(4, 64), fake_cuda(8, 64), fake_cuda(8, 4)
        with pytest.raises(BadArgumentError, match=r"^gemm out: expected shape \(4, 8\), got \(8, 4\)$"):
            torch.ops.cubinstore.gemm_out(a, b, d)


def test_cpu_tensors_through_the_op_are_a_typed_device_error() -> None:
    a = torch.zeros(4, 64, dtype=torch.bfloat16)
    _gemm_op.register()
    with pytest.raises(BadArgumentError, match=r"^gemm a: expected a CUDA tensor, got one on cpu$"):
        torch.ops.cubinstore.gemm(a, a)


def test_a_process_whose_first_gemm_is_traced_registers_the_op() -> None:
    # torch imported after cubinstore.ops, and no eager call before torch.compile.
    code = """
import cubinstore.ops as ops
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
names = []
def backend(gm, inputs):
    names.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return gm.forward
with FakeTensorMode():
    a = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
    torch.compile(lambda x: ops.gemm(x, x), fullgraph=True, backend=backend)(a)
import json; print(json.dumps(names))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == ["cubinstore.gemm"]


def test_a_copy_holds_the_operand_in_rows_of_k_rounded_up() -> None:
    # The copy a launch makes is plain torch, so it runs here on the CPU as it does on the GPU.
    from cubinstore.internals import Feed, gemm_launch

    # Fresh memory as NaN (torch.empty promises nothing): what the copy leaves unwritten stays NaN.
    poisoned = SimpleNamespace(bfloat16=torch.bfloat16, empty=lambda shape, dtype, device: torch.full(
        shape, float("nan"), dtype=dtype, device=device))
    x = torch.randn(1111, 7).to(torch.bfloat16).T  # 7 x 1111, K not the contiguous dimension
    copy = gemm_launch._copy_in(poisoned, x, Feed(True, 1112), "cpu")
    assert copy.shape == (7, 1112) and copy.is_contiguous() and torch.equal(copy[:, :1111], x)
    assert copy[:, 1111:].isnan().all()  # no kernel reads past K: the pad is left as it was
    aligned = torch.randn(9, 64).to(torch.bfloat16)
    same_rows = gemm_launch._copy_in(poisoned, aligned.T.contiguous().T, Feed(True, 64), "cpu")
    assert same_rows.stride() == (64, 1) and torch.equal(same_rows, aligned)


def test_a_compile_installs_inductors_direct_call_of_the_launch() -> None:
    # The lowering is installed by the first traced call (it imports inductor, which eager use never
    # needs); what its code calls hangs on the op from its definition. The GPU tests check the code
    # inductor generates with it.
    from torch._inductor.lowering import lowerings

    from cubinstore.internals import INDUCTOR_CALL

    recorder = GraphRecorder()
    with FakeTensorMode():
        torch.compile(lambda a, b: ops.gemm(a, b), fullgraph=True, backend=recorder)(fake_cuda(4, 64), fake_cuda(8, 64))
    assert torch.ops.cubinstore.gemm.default in lowerings
    namespace, _, name = INDUCTOR_CALL.rpartition(".")
    assert namespace == "torch.ops.cubinstore.gemm"
    assert callable(getattr(torch.ops.cubinstore.gemm, name))


def test_defining_the_op_alone_gives_generated_code_its_call_without_importing_inductor() -> None:
    # Inductor's FX graph cache hands a process code compiled in another; any process that has the
    # op defined can run it, though it never installed the lowering (nor imported inductor).
    code = """
import sys, json
import torch
import cubinstore.ops as ops
from cubinstore.internals import INDUCTOR_CALL, gemm_op
gemm_op.register()
namespace, _, name = INDUCTOR_CALL.rpartition(".")
print(json.dumps([callable(getattr(torch.ops.cubinstore.gemm, name)), "torch._inductor.lowering" in sys.modules]))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [True, False]
