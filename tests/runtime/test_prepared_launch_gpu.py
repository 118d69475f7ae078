"""`Kernel.prepare` on a GPU: a prepared launch computes what `Kernel.launch` does, on the given stream.

Uses the `axpy` family (y = a*x + y) of the manifest under test (tests/helpers/gpu.py); skips
with the reason where there is no Hopper GPU, torch or manifest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cubinstore import launch
from cubinstore.errors import BadArgumentError
from helpers.gpu import family_library

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the prepared-launch tests make their arrays with torch")


@pytest.fixture(scope="module")
def axpy(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Kernel]:
    library = family_library("axpy", tmp_path_factory)
    yield library.kernel("axpy", dtype="f32", vec=4, device=0)


@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_prepared_axpy_matches_launch_and_reuses_one_buffer(axpy: launch.Kernel, torch: Any, n: int) -> None:
    grid = (n + 1023) // 1024
    prepared = axpy.prepare("axpy_f32", grid=grid, block=256, args=(n, 2.0, None, None))
    stream = torch.cuda.Stream()
    for _ in range(3):  # new arrays at each turn: only the pointers change
        x = torch.randn(n, device="cuda:0")
        y = torch.randn(n, device="cuda:0")
        want = 2.0 * x + y
        with torch.cuda.stream(stream):
            prepared(int(stream.cuda_stream), x.data_ptr(), y)  # a raw pointer, and a tensor (checked)
        stream.synchronize()
        assert torch.equal(y, want)
    assert prepared.calls == 3


def test_prepared_launch_refuses_a_tensor_on_another_device_and_a_bad_stream(axpy: launch.Kernel, torch: Any) -> None:
    prepared = axpy.prepare("axpy_f32", grid=1, block=256, args=(8, 1.0, None, None))
    x = torch.zeros(8, device="cuda:0")
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 2: expected ptr to CUDA memory on device 0, got torch.Tensor on cpu$"):
        prepared(0, torch.zeros(8), x)
    with pytest.raises(BadArgumentError, match=r"^cuLaunchKernelEx of kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' .* stream: expected a raw handle"):
        prepared(-1, x, x)
