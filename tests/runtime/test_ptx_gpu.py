"""PTX fallback and the driver-version check on a real GPU (issue 31).

The release under test (``CUBINSTORE_TEST_MANIFEST``, default ``bazel-bin/kernels/manifest.json``)
ships axpy as sm_90a and sm_80 CUBINs and as ``compute_90`` PTX. A copy of its manifest with the
axpy sm_90a CUBINs withheld leaves nothing an H100/H200 can run but the PTX: the runtime must pick
it, say so, have the driver JIT-compile it once per process, and compute axpy right. The driver's
real version is checked against every kernel's ``min_driver``, and a kernel that asks for a newer
driver is refused naming both, with nothing loaded.

Stage: ``tools/stage_device.sh`` copies the ``.ptx`` files beside the CUBINs into ``.device``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers.gpu import hopper_manifest, manifest_path

from cubinstore import launch
from cubinstore.errors import DriverVersionError
from cubinstore.internals import device
from cubinstore.manifest import Manifest
from cubinstore.store import DirectorySource, LocalLayer, Store

POINTS = [("f32", 1), ("f32", 4), ("f64", 1), ("f64", 4)]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def release() -> Manifest:
    manifest, path = hopper_manifest("withheld CUBINs")
    if not any(k.family == "axpy" and k.arch == "compute_90" for k in manifest):
        pytest.fail(f"manifest {path} has no axpy PTX (compute_90): kernels/axpy/BUILD.bazel ships it (ptx = [...])")
    return manifest


@pytest.fixture(scope="module")
def store(release: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Store:
    # The build tree beside the manifest holds the CUBINs and the PTX files (stage_device.sh copies both).
    return Store([LocalLayer(tmp_path_factory.mktemp("ptx-home")),
                  DirectorySource(manifest_path().parent, suffix=(".cubin", ".ptx"))])


@pytest.fixture
def fresh() -> Iterator[device.Devices]:
    """The real driver through a fresh ``Devices``: nothing loaded yet, as in a new process."""
    devices = device.Devices()
    before = device.use(devices)
    try:
        yield devices
    finally:
        device.use(before)


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the PTX test compares with torch")


def _withheld(release: Manifest) -> Manifest:
    """A copy of the release without axpy's sm_90a CUBINs: its PTX is all that runs on 9.0."""
    return Manifest.build([k for k in release if not (k.family == "axpy" and k.arch == "sm_90a")],
                          source="the release without axpy sm_90a", jit_templates=release.jit_templates)


def _axpy(torch: Any, kernel: launch.Kernel, n: int) -> None:
    dtype = {"f32": torch.float32, "f64": torch.float64}[kernel.spec.params["dtype"]]
    gen = torch.Generator(device="cuda:0").manual_seed(n)
    x = torch.randn(n, dtype=dtype, device="cuda:0", generator=gen)
    y = torch.randn(n, dtype=dtype, device="cuda:0", generator=gen)
    a = float(np.random.default_rng(n).uniform(-3, 3))
    expected = a * x.double().cpu().numpy() + y.double().cpu().numpy()
    kernel.launch(f"axpy_{kernel.spec.params['dtype']}", args=(n, a, x, y))  # the manifest's geometry
    torch.cuda.synchronize()
    got = y.double().cpu().numpy()
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < (1e-6 if dtype == torch.float32 else 1e-14), f"{kernel.spec.id}: relative error {rel}"


def test_without_the_sm90a_cubins_the_ptx_launches_and_is_right(release: Manifest, store: Store, torch: Any,
                                                                 fresh: device.Devices, caplog: pytest.LogCaptureFixture) -> None:
    lib = launch.open(_withheld(release), store)
    with caplog.at_level(logging.WARNING, logger="cubinstore"):
        kernels = [lib.kernel("axpy", dtype=dtype, vec=vec, device=0) for dtype, vec in POINTS]
    assert [k.spec.arch for k in kernels] == ["compute_90"] * len(POINTS)
    for kernel in kernels:
        for n in (1, 1_000_003):
            _axpy(torch, kernel, n)
    stats = launch.load_stats()
    assert stats.ptx == tuple(f"axpy/{d}/vec{v}/compute_90" for d, v in POINTS) and stats.modules == len(POINTS)
    warned = [r.getMessage() for r in caplog.records if "JIT-compiles its PTX compute_90" in r.getMessage()]
    assert len(warned) == len(POINTS), [r.getMessage() for r in caplog.records]
    # Once per process: the same PTX through another Library is the module already loaded.
    again = launch.open(_withheld(release), store).kernel("axpy", dtype="f32", vec=4, device=0)
    assert again._functions == kernels[1]._functions and launch.load_stats() == stats


def test_with_the_cubins_present_the_ptx_is_never_loaded(release: Manifest, store: Store, torch: Any,
                                                          fresh: device.Devices) -> None:
    kernel = launch.open(release, store).kernel("axpy", dtype="f32", vec=4, device=0)
    assert kernel.spec.arch == "sm_90a"
    _axpy(torch, kernel, 4097)
    assert launch.load_stats().ptx == ()


def test_the_real_driver_is_new_enough_for_every_kernel_of_the_release(release: Manifest, fresh: device.Devices) -> None:
    from cuda.bindings import driver as drv  # the version asked directly, beside cubinstore's answer

    err, version = drv.cuDriverGetVersion()
    assert err == drv.CUresult.CUDA_SUCCESS and fresh.driver_version() == version
    needs = {k.min_driver for k in release}
    assert None not in needs, "every kernel of a release built now records min_driver"
    assert max(needs) <= version, f"this host's driver ({version}) is older than the release needs ({max(needs)})"


def test_a_kernel_that_needs_a_newer_driver_is_refused_naming_both(release: Manifest, store: Store,
                                                                    fresh: device.Devices) -> None:
    host = fresh.driver_version()
    assert host is not None
    future = host + 1000  # the next major's driver
    spec = release.by_id("axpy/f32/vec4/sm_90a")
    doc = dict(spec.to_json(), min_driver=future, toolkit=f"{future // 1000}.0.1")
    lib = launch.open(Manifest.build([doc], source="a kernel from a future toolkit"), store)
    with pytest.raises(DriverVersionError) as info:
        lib.kernel("axpy/f32/vec4/sm_90a", device=0)
    assert str(info.value).startswith(
        f"kernel 'axpy/f32/vec4/sm_90a' ({spec.digest}) was built by CUDA toolkit {future // 1000}.0.1 and it needs a "
        f"driver of CUDA {future // 1000}.0")
    assert f"this host's driver supports CUDA {host // 1000}.{host % 1000 // 10} (cuDriverGetVersion {host})" in str(info.value)
    assert launch.load_stats().modules == 0 and not launch.is_loaded(spec.digest, 0)
