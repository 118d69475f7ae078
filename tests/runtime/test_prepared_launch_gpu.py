"""`Kernel.prepare` on a GPU: a prepared launch computes what `Kernel.launch` does, on the given stream.

Every test runs on both launch paths: the compiled helper's one call (``cubinstore._core._native``
``launch``, where it was built) and the bindings' ``cuLaunchKernelEx`` from Python. Uses the `axpy`
family (y = a*x + y) of the manifest under test (tests/helpers/gpu.py); skips with the reason where
there is no Hopper GPU, torch or manifest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers import native as native_paths

from cubinstore import launch
from cubinstore.errors import BadArgumentError, CudaError
from cubinstore.internals import cuda as _cuda
from helpers.gpu import family_library

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the prepared-launch tests make their arrays with torch")


@pytest.fixture(scope="module")
def axpy(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Kernel]:
    library = family_library("axpy", tmp_path_factory)
    yield library.kernel("axpy", dtype="f32", vec=4, device=0)


@pytest.fixture(params=["helper", "bindings"])
def path(request: pytest.FixtureRequest, axpy: launch.Kernel) -> Iterator[str]:
    """Launches prepared (and made) in the test go through the helper, or through the bindings."""
    if request.param == "helper":
        native_paths.built_helper()
        assert _cuda.native_launch() is not None, "the helper is built but the driver did not take its launch"
        yield request.param
    else:
        with _cuda.using_native_launch(None):
            yield request.param


@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_prepared_axpy_matches_launch_and_reuses_one_buffer(axpy: launch.Kernel, torch: Any, path: str, n: int) -> None:
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
        with torch.cuda.stream(stream):
            prepared(int(stream.cuda_stream), x.data_ptr(), y.data_ptr())  # raw pointers only
        stream.synchronize()
        assert torch.equal(y, 2.0 * x + want)
    assert prepared.calls == 6


def test_changing_scalars_are_packed_and_checked_before_the_launch(axpy: launch.Kernel, torch: Any, path: str) -> None:
    # An i32 and an f32 change per call: the helper leaves them to ArgBuffer.write, then launches.
    prepared = axpy.prepare("axpy_f32", grid=1, block=256, args=(None, None, None, None))
    x = torch.arange(1024, dtype=torch.float32, device="cuda:0")
    y = torch.zeros(1024, device="cuda:0")
    prepared(0, 512, 3.0, x.data_ptr(), y.data_ptr())
    torch.cuda.synchronize()
    assert torch.equal(y[:512], 3.0 * x[:512]) and not y[512:].any()
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 0: expected i32"):
        prepared(0, 2**40, 3.0, x.data_ptr(), y.data_ptr())
    assert prepared.calls == 1


def test_prepared_launch_refuses_a_tensor_on_another_device_and_a_bad_stream(axpy: launch.Kernel, torch: Any,
                                                                              path: str) -> None:
    prepared = axpy.prepare("axpy_f32", grid=1, block=256, args=(8, 1.0, None, None))
    x = torch.zeros(8, device="cuda:0")
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 2: expected ptr to CUDA memory on device 0, got torch.Tensor on cpu$"):
        prepared(0, torch.zeros(8), x)
    with pytest.raises(BadArgumentError, match=r"^cuLaunchKernelEx of kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' .* stream: expected a raw handle"):
        prepared(-1, x, x)
    with pytest.raises(BadArgumentError, match=r"parameter 2: expected ptr in \[0, 2\*\*64\), got -1$"):
        prepared(0, -1, x.data_ptr())
    with pytest.raises(BadArgumentError, match=r"expected 2 changing arguments"):
        prepared(0, x.data_ptr())
    assert prepared.calls == 0


def test_a_launch_the_driver_refuses_is_a_cuda_error_naming_it(axpy: launch.Kernel, torch: Any, path: str) -> None:
    x = torch.zeros(8, device="cuda:0")
    prepared = axpy.prepare("axpy_f32", grid=1, block=(1024, 2, 1), args=(8, 1.0, None, None))  # 2048 threads
    with pytest.raises(CudaError, match=r"^cuLaunchKernelEx of kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' .*: CUDA_ERROR_INVALID_VALUE"):
        prepared(0, x, x)
    with pytest.raises(CudaError, match=r"^cuLaunchKernelEx of kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' .*: CUDA_ERROR_INVALID_VALUE"):
        axpy.launch("axpy_f32", grid=1, block=(1024, 2, 1), args=(8, 1.0, x, x))
    assert prepared.calls == 0


def test_clusters_and_pdl_reach_the_driver(axpy: launch.Kernel, torch: Any, path: str) -> None:
    n = 1 << 16
    x = torch.randn(n, device="cuda:0")
    for cluster, pdl in (((2, 1, 1), False), ((4, 1, 1), True), (None, True)):
        y = torch.randn(n, device="cuda:0")
        want = 0.5 * x + y
        prepared = axpy.prepare("axpy_f32", grid=64, block=256, cluster=cluster, pdl=pdl, args=(n, 0.5, None, None))
        prepared(0, x.data_ptr(), y.data_ptr())
        torch.cuda.synchronize()
        assert torch.allclose(y, want), (cluster, pdl)
    with pytest.raises(CudaError, match=r"^cuLaunchKernelEx of kernel .* cluster \(64, 1, 1\).*: CUDA_ERROR_(INVALID_CLUSTER_SIZE|INVALID_VALUE)"):
        # 64 blocks in clusters of 64: above any cluster the device holds, refused by the driver
        axpy.prepare("axpy_f32", grid=64, block=256, cluster=(64, 1, 1), args=(n, 0.5, None, None))(0, x, x)


def test_a_prepared_launch_from_no_current_context_restores_none(axpy: launch.Kernel, torch: Any, path: str) -> None:
    drv = _cuda.driver()
    x = torch.ones(256, device="cuda:0")
    y = torch.zeros(256, device="cuda:0")
    prepared = axpy.prepare("axpy_f32", grid=1, block=256, args=(256, 2.0, None, None))
    primary = _cuda.primary_context(0)
    _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(0)), "cuCtxSetCurrent(NULL)")
    try:
        prepared(0, x.data_ptr(), y.data_ptr())
        current = _cuda.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        assert current is None or int(current) == 0
    finally:
        _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(primary)), "cuCtxSetCurrent(primary)")
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 2.0))
