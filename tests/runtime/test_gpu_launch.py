"""Loading and launching CUBINs from a built manifest (cubinstore.launch).

GPU tests need a CUDA device and the manifest of `bazel build //kernels:all`
(`CUBINSTORE_TEST_MANIFEST`, default `bazel-bin/kernels/manifest.json`); they
skip with the reason otherwise. Blobs are fetched through a real `Store`: the
local store (`CUBINSTORE_HOME`, else a temporary one) backed by the build tree
the manifest sits in. The tests at the top run anywhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from helpers import native as native_paths

from cubinstore import launch
from cubinstore.errors import CudaError, ParamLayoutError
from cubinstore.internals import CubinImage, cuda as _cuda, device, loader as _loader
from cubinstore.errors import (
    BadArgumentError,
    IncompatibleArchError,
    KernelNotFoundError,
    ManifestError,
)
from cubinstore.manifest import KernelSpec, Manifest
from cubinstore.store import DirectorySource, LocalLayer, Store

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def _manifest_path() -> Path:
    path = Path(os.environ.get("CUBINSTORE_TEST_MANIFEST", "bazel-bin/kernels/manifest.json"))
    return path if path.is_absolute() else ROOT / path


# -- anywhere --------------------------------------------------------------------------------------


def _axpy_manifest(digest: str, size: int, arch: str = "sm_90a", types: list[str] | None = None) -> Manifest:
    return Manifest.build([{
        "id": f"axpy/f32/vec4/{arch}", "family": "axpy", "params": {"dtype": "f32", "vec": 4}, "arch": arch,
        "digest": digest, "size": size, "entries": {"axpy_f32": types or ["i32", "f32", "ptr", "ptr"]},
        "target": f"//kernels/axpy:axpy_f32_vec4_{arch}",
    }])


def test_a_missing_point_of_a_family_is_recorded_and_names_the_nearest_points(tmp_path: Path) -> None:
    # What Library.kernel does when select() misses a point of a known family, with JIT off.
    from cubinstore.internals import warmset as _warmset

    local = LocalLayer(tmp_path)
    lib = launch.open(_axpy_manifest("sha256:" + "ab" * 32, 4096), Store([local]))
    with pytest.raises(KernelNotFoundError, match=r"^no kernel axpy dtype='f32' vec=8 sm_90 in manifest sha256:[0-9a-f]{64}; nearest: axpy/f32/vec4/sm_90a"):
        lib._missing_point("axpy", {"dtype": "f32", "vec": 8}, (9, 0), jit=False)
    (record,) = [r for r in _warmset.records(local) if r.family == "axpy"]
    assert record.params == {"dtype": "f32", "vec": 8}


def test_the_jit_arch_is_the_templates_best_for_the_device() -> None:
    from types import SimpleNamespace

    template = SimpleNamespace(archs=("sm_80", "sm_90a", "sm_90"))
    assert launch._jit_arch("g", template, (9, 0)) == "sm_90a"
    assert launch._jit_arch("g", template, (8, 6)) == "sm_80"
    assert launch._jit_arch("g", None, (8, 9)) == "sm_89"
    with pytest.raises(IncompatibleArchError, match=r"^family 'g': its JIT template compiles for sm_80, sm_90a, sm_90, none of which runs on compute capability 10\.0"):
        launch._jit_arch("g", template, (10, 0))


def test_kernel_without_a_gpu_is_a_typed_error_and_open_needs_none(tmp_path: Path) -> None:
    if _cuda.available()[0]:
        pytest.skip("a CUDA device is present; this checks the no-driver path")
    lib = launch.open(_axpy_manifest("sha256:" + "ab" * 32, 4096), Store([LocalLayer(tmp_path)]))
    assert lib.manifest.kernels[0].id == "axpy/f32/vec4/sm_90a"
    with pytest.raises(CudaError, match=r"^cuInit failed: "):
        lib.kernel("axpy", dtype="f32", vec=4)


def test_open_rejects_what_is_not_a_manifest_reference() -> None:
    with pytest.raises(BadArgumentError, match=r"^manifest: expected a path, a Manifest or 'sha256:<hex>', got 42$"):
        launch.open(42)  # type: ignore[arg-type]


def test_open_reads_a_manifest_file(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(_axpy_manifest("sha256:" + "cd" * 32, 100).raw)
    assert launch.open(path, Store([])).manifest.kernels[0].digest.hex == "cd" * 32


def test_launch_dimensions_are_padded_and_checked() -> None:
    assert launch._dims("k", "grid", 7) == (7, 1, 1)
    assert launch._dims("k", "block", (32, 8)) == (32, 8, 1)
    for bad in [0, (1, 2, 3, 4), (), (1.0,), (True,), "8", None]:
        with pytest.raises(BadArgumentError, match=r"^kernel k grid: expected 1 to 3 positive ints"):
            launch._dims("k", "grid", bad)
    with pytest.raises(BadArgumentError, match=r"^kernel k block: expected 1 to 3 positive ints \(at most 1024\), got \(2048,\)$"):
        launch._dims("k", "block", (2048,), limit=1024)


class _Packed:
    torch_tensor = None
    cupy_array = None


class _CoreLikeStream:
    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 0xABC)


class _TorchLikeStream:
    cuda_stream = 0xDEF


def test_stream_handles_of_each_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # an earlier test may have imported it
    packed = _Packed()
    assert launch._stream_handle(None, packed, 0, "k") == 0  # no torch or CuPy argument: legacy default stream
    assert launch._stream_handle(0x1234, packed, 0, "k") == 0x1234
    assert launch._stream_handle(_CoreLikeStream(), packed, 0, "k") == 0xABC
    assert launch._stream_handle(_TorchLikeStream(), packed, 0, "k") == 0xDEF
    for bad, message in [(True, "got bool"), (-1, r"expected a handle in \[0, 2\*\*64\), got -1"), ("s", "expected a handle int")]:
        with pytest.raises(BadArgumentError, match=r"^kernel k stream: .*" + message):
            launch._stream_handle(bad, packed, 0, "k")


def test_with_torch_in_the_process_no_stream_is_torchs_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for torch in sys.modules: the real one would initialise CUDA, and there may be no GPU.
    asked: list[int] = []

    def current_stream(device: int) -> _TorchLikeStream:
        asked.append(device)
        return _TorchLikeStream()

    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(current_stream=current_stream)))
    assert launch._stream_handle(None, _Packed(), 3, "k") == 0xDEF  # no tensor argument: still torch's stream
    assert launch._stream_handle(0x1234, _Packed(), 3, "k") == 0x1234  # an explicit stream wins
    assert asked == [3]


@pytest.fixture(scope="module")
def cubins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    if NVCC is None:
        pytest.skip("nvcc not found: cannot build a CUBIN to read its header")
    out = tmp_path_factory.mktemp("cubins")
    built: dict[str, bytes] = {}
    for arch in ("sm_80", "sm_90a"):
        target = out / f"axpy_{arch}.cubin"
        subprocess.run(
            [NVCC, "-cubin", f"-arch={arch}", "-std=c++17", "-O3", "-DDTYPE_f32", "-DVEC=4", f"-I{ROOT}",
             str(ROOT / "kernels/axpy/axpy.cu"), "-o", str(target)],
            check=True, timeout=300,
        )
        built[arch] = target.read_bytes()
    return built


def test_cubin_header_names_the_sm_it_was_built_for(cubins: dict[str, bytes]) -> None:
    assert CubinImage(cubins["sm_80"], "sm_80").sm == 80
    assert CubinImage(cubins["sm_90a"], "sm_90a").sm == 90


def test_cubin_labelled_with_the_wrong_arch_is_refused_before_loading(cubins: dict[str, bytes]) -> None:
    data = cubins["sm_80"]
    from cubinstore import Digest

    spec = _axpy_manifest(str(Digest.of(data)), len(data)).kernels[0]
    with pytest.raises(ManifestError, match=r"^kernel 'axpy/f32/vec4/sm_90a' \(sha256:[0-9a-f]{64}\): manifest says sm_90a, the CUBIN's ELF header says sm_80$"):
        _loader._check_cubin_header(spec, data)


@pytest.mark.parametrize(("data", "why"), [(b"\0" * 4096, "bad magic"), (b"\x7fELF\x01" + b"\0" * 100, "expected a 64-bit little-endian ELF")])
def test_bytes_that_are_not_a_cubin_are_refused_before_loading(data: bytes, why: str) -> None:
    from cubinstore import Digest

    spec = _axpy_manifest(str(Digest.of(data)), len(data)).kernels[0]
    with pytest.raises(ManifestError, match=r"^kernel 'axpy/f32/vec4/sm_90a' \(sha256:[0-9a-f]{64}\): .*" + why):
        _loader._check_cubin_header(spec, data)


# -- on a GPU ------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    ok, why = _cuda.available()
    if not ok:
        pytest.skip(f"no CUDA device: {why}")
    path = _manifest_path()
    if not path.is_file():
        pytest.skip(f"no manifest at {path}: run `bazel build //kernels:all` or set CUBINSTORE_TEST_MANIFEST")
    return Manifest.from_path(path)


@pytest.fixture(scope="module")
def store(manifest: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Store:
    home = os.environ.get("CUBINSTORE_HOME") or tmp_path_factory.mktemp("cubinstore-home")
    # The local store is filled from the build tree on first use, as after a local build.
    return Store([LocalLayer(home), DirectorySource(Path(manifest.source).parent)])


@pytest.fixture(scope="module")
def lib(manifest: Manifest, store: Store) -> launch.Library:
    return launch.open(manifest, store)


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the GPU tests make their inputs with torch")


@pytest.fixture(scope="module")
def hopper(manifest: Manifest) -> None:
    if device.compute_capability(0) != (9, 0):
        pytest.skip(f"sm_90a kernels need compute capability 9.0, device 0 is {device.compute_capability(0)}")


def _specs(family: str | None = None, arch: str = "sm_90a") -> list[str]:
    path = _manifest_path()
    if not path.is_file():
        return []
    return [k.id for k in Manifest.from_path(path) if k.arch == arch and (family is None or k.family == family)]


def _axpy_run(torch: Any, kernel: launch.Kernel, n: int, device: int = 0, **launch_kw: Any) -> None:
    dtype = {"f32": torch.float32, "f64": torch.float64}[kernel.spec.params["dtype"]]
    vec = int(kernel.spec.params["vec"])
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(n)
    x = torch.randn(n, dtype=dtype, device=f"cuda:{device}", generator=gen)
    y = torch.randn(n, dtype=dtype, device=f"cuda:{device}", generator=gen)
    a = float(np.random.default_rng(n).uniform(-3, 3))
    expected = a * x.double().cpu().numpy() + y.double().cpu().numpy()
    blocks = -(-n // (256 * vec))
    launch_kw.setdefault("grid", (blocks,))
    kernel.launch(f"axpy_{kernel.spec.params['dtype']}", block=(256,), args=(n, a, x, y), **launch_kw)
    torch.cuda.synchronize(device)
    got = y.double().cpu().numpy()
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < (1e-6 if dtype == torch.float32 else 1e-14), f"{kernel.spec.id}: relative error {rel}"


@gpu
@pytest.mark.parametrize("kernel_id", _specs() or ["<no manifest>"])
def test_every_sm90a_kernel_loads_once_with_a_checked_layout(lib: launch.Library, hopper: None, kernel_id: str) -> None:
    kernel = lib.kernel(kernel_id, device=0)
    assert kernel.spec.id == kernel_id and kernel.device == 0
    assert launch.is_loaded(kernel.spec.digest, 0)
    again = lib.kernel(kernel_id, device=0)
    assert again._functions == kernel._functions  # the cached module, not a second load


@gpu
def test_a_benchmark_can_unload_what_it_loaded_and_load_afresh(manifest: Manifest, store: Store, torch: Any,
                                                               hopper: None) -> None:
    # What bench_runtime's fresh first loads rest on: the loader's table lists each loaded library
    # once, and after unloading them a new Devices loads the kernel again and it still runs.
    kernel_id = next(i for i in _specs("axpy"))
    before = device.use(device.Devices())
    try:
        for _ in range(2):
            kernel = launch.Library(manifest, store).kernel(kernel_id, device=0)
            handles = _loader.loaded_libraries()
            assert len(handles) == 1 and handles[0] != 0
            _axpy_run(torch, kernel, 4099)
            _unload(handles[0])
            device.use(device.Devices())
            assert _loader.loaded_libraries() == []
    finally:
        device.use(before)


@gpu
@pytest.mark.parametrize("kernel_id", _specs("axpy") or ["<no manifest>"])
@pytest.mark.parametrize("n", [1, 1_000_003])
def test_axpy_matches_numpy(lib: launch.Library, torch: Any, hopper: None, kernel_id: str, n: int) -> None:
    _axpy_run(torch, lib.kernel(kernel_id), n)


@gpu
@pytest.mark.parametrize("kernel_id", _specs("transpose") or ["<no manifest>"])
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (1000, 777), (64, 4096)])
def test_transpose_matches_torch(lib: launch.Library, torch: Any, hopper: None, kernel_id: str, rows: int, cols: int) -> None:
    kernel = lib.kernel(kernel_id)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[kernel.spec.params["dtype"]]
    tile = int(kernel.spec.params["tile"])
    src = torch.randn(rows, cols, device="cuda:0").to(dtype)
    out = torch.full((cols, rows), float("nan"), dtype=dtype, device="cuda:0")  # poison: every element must be written
    grid = (-(-cols // tile), -(-rows // tile), 1)
    kernel.launch(f"transpose_{kernel.spec.params['dtype']}", grid=grid, block=(32, 8, 1), args=(src, out, rows, cols))
    torch.cuda.synchronize()
    assert torch.equal(out, src.t().contiguous())


@gpu
@pytest.mark.parametrize("kernel_id", _specs("axpy") or ["<no manifest>"])
def test_axpy_launches_with_only_the_manifest_geometry(lib: launch.Library, torch: Any, hopper: None, kernel_id: str) -> None:
    kernel = lib.kernel(kernel_id)
    dtype = {"f32": torch.float32, "f64": torch.float64}[kernel.spec.params["dtype"]]
    n = 1_000_003
    x, y = torch.randn(n, dtype=dtype, device="cuda:0"), torch.randn(n, dtype=dtype, device="cuda:0")
    expected = 1.5 * x.double() + y.double()
    kernel.launch(f"axpy_{kernel.spec.params['dtype']}", args=(n, 1.5, x, y))  # no grid, block or shared_mem
    torch.cuda.synchronize()
    assert torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6)


@gpu
@pytest.mark.parametrize("kernel_id", _specs("transpose") or ["<no manifest>"])
def test_transpose_launches_with_only_the_manifest_geometry(lib: launch.Library, torch: Any, hopper: None, kernel_id: str) -> None:
    kernel = lib.kernel(kernel_id)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[kernel.spec.params["dtype"]]
    rows, cols = 1000, 777  # tails in both grid dimensions
    src = torch.randn(rows, cols, device="cuda:0").to(dtype)
    out = torch.full((cols, rows), float("nan"), dtype=dtype, device="cuda:0")
    kernel.launch(f"transpose_{kernel.spec.params['dtype']}", args=(src, out, rows, cols))
    torch.cuda.synchronize()
    assert torch.equal(out, src.t().contiguous())


@gpu
def test_a_launch_with_no_tensor_argument_goes_to_torchs_current_stream(lib: launch.Library, torch: Any, hopper: None) -> None:
    # Raw pointers only: the launch must still land on torch's stream, or graph capture breaks.
    kernel = lib.kernel("axpy", dtype="f32", vec=4)
    n = 4096
    x, y = torch.randn(n, device="cuda:0"), torch.zeros(n, device="cuda:0")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.launch("axpy_f32", args=(n, 2.0, x.data_ptr(), y.data_ptr()))
    torch.cuda.synchronize()
    assert torch.count_nonzero(y) == 0, "captured work must not run during capture"
    y.copy_(torch.ones(n, device="cuda:0"))
    x.copy_(torch.arange(n, dtype=torch.float32, device="cuda:0"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, 2.0 * torch.arange(n, dtype=torch.float32, device="cuda:0") + 1.0)


@gpu
def test_the_clusters_a_device_holds_at_once_are_asked_of_the_driver(lib: launch.Library, hopper: None) -> None:
    kernel = lib.kernel("axpy", dtype="f32", vec=1)  # no cluster compiled in: the launch gives one
    sms = device.sm_count(0)
    pairs = kernel.max_active_clusters("axpy_f32", grid=2, block=256, cluster=2)
    fours = kernel.max_active_clusters("axpy_f32", grid=4, block=256, cluster=4)
    # A small block fits several a SM; clusters must fit in one GPC, so never more CTAs than that allows.
    assert 1 <= fours * 4 <= pairs * 2
    assert pairs >= sms // 2
    with pytest.raises(BadArgumentError, match=r"cluster: expected 1 to 3 positive ints"):
        kernel.max_active_clusters("axpy_f32", grid=2, block=256, cluster=0)


@gpu
def test_programmatic_dependent_launch_gives_the_same_result(lib: launch.Library, torch: Any, hopper: None) -> None:
    _axpy_run(torch, lib.kernel("axpy", dtype="f32", vec=1), 1_000_003, pdl=True)


@gpu
def test_sm80_cubin_is_refused_before_the_driver_sees_it(lib: launch.Library, manifest: Manifest, hopper: None) -> None:
    sm80 = [k for k in manifest if k.arch == "sm_80"]
    if not sm80:
        pytest.skip("the manifest has no sm_80 CUBIN")
    spec = sm80[0]
    with pytest.raises(IncompatibleArchError, match=rf"^no CUBIN of '{spec.id}' for compute capability 9\.0 \(sm_90\)"):
        lib.kernel(spec.id, device=0)
    # The loader's own guard, reached directly: a store with no layers proves nothing was fetched either.
    with pytest.raises(IncompatibleArchError, match=rf"^kernel '{spec.id}' \({spec.digest}\) is built for sm_80, device 0 has compute capability 9\.0; it was not loaded$"):
        _loader.load(spec, 0, (9, 0), Store([]))
    assert not launch.is_loaded(spec.digest, 0)


def _with_entries(spec: KernelSpec, types: list[str]) -> Manifest:
    doc = spec.to_json()
    doc["entries"] = {name: types for name in doc["entries"]}
    return Manifest.build([doc])


@gpu
def test_parameter_type_mismatch_is_caught_before_any_launch(manifest: Manifest, store: Store, torch: Any, hopper: None) -> None:
    spec = manifest.by_id("axpy/f64/vec4/sm_90a")
    y = torch.ones(1024, dtype=torch.float64, device="cuda:0")
    # Loading asks nothing per parameter; the entry's first launch or prepare checks its layout.
    wrong = launch.open(_with_entries(spec, ["i32", "f32", "ptr", "ptr"]), store).kernel(spec.id)
    for _ in range(2):  # a failed check is not remembered as passed
        with pytest.raises(ParamLayoutError, match=(
            r"^kernel 'axpy/f64/vec4/sm_90a' entry 'axpy_f64' parameter 1: manifest declares f32 "
            r"\(4 bytes at offset 4\), the CUBIN's function has 8 bytes at offset 8$"
        )):
            wrong.launch("axpy_f64", grid=4, block=256, args=(1024, 2.0, y, y))
    short = launch.open(_with_entries(spec, ["i32", "f64", "ptr"]), store).kernel(spec.id)
    with pytest.raises(ParamLayoutError, match=r"^kernel 'axpy/f64/vec4/sm_90a' entry 'axpy_f64': manifest declares 3 parameters \(i32, f64, ptr\), the CUBIN's function takes 4$"):
        short.prepare("axpy_f64", args=(1024, 2.0, None), grid=4, block=256)
    assert torch.equal(y, torch.ones_like(y))


@gpu
def test_bad_arguments_are_refused_before_launch(lib: launch.Library, torch: Any, hopper: None) -> None:
    kernel = lib.kernel("axpy/f32/vec4/sm_90a")
    x = torch.ones(256, device="cuda:0")
    y = torch.ones(256, device="cuda:0")
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 2: expected ptr, got float$"):
        kernel.launch("axpy_f32", grid=1, block=256, args=(256, 2.0, 1.5, y))
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 2: expected ptr to CUDA memory on device 0, got torch.Tensor on cpu$"):
        kernel.launch("axpy_f32", grid=1, block=256, args=(256, 2.0, x.cpu(), y))
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 0: expected i32 in "):
        kernel.launch("axpy_f32", grid=1, block=256, args=(2**31, 2.0, x, y))
    with pytest.raises(KernelNotFoundError, match=r"^kernel 'axpy/f32/vec4/sm_90a' has no entry 'axpy_f64'; entries: axpy_f32$"):
        kernel.launch("axpy_f64", grid=1, block=256, args=(256, 2.0, x, y))
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' block: expected 1 to 3 positive ints"):
        kernel.launch("axpy_f32", grid=1, block=(0,), args=(256, 2.0, x, y))
    torch.cuda.synchronize()
    assert torch.equal(y, torch.ones_like(y))


@gpu
def test_every_pointer_flavour_launches(lib: launch.Library, torch: Any, hopper: None) -> None:
    cupy = pytest.importorskip("cupy")
    kernel = lib.kernel("axpy/f32/vec1/sm_90a")
    n = 4099
    x = cupy.random.standard_normal(n, dtype=cupy.float32)
    y = cupy.random.standard_normal(n, dtype=cupy.float32)
    y0 = cupy.asnumpy(y).astype(np.float64)
    x_np = cupy.asnumpy(x).astype(np.float64)

    class OnlyDLPack:
        def __init__(self, t: Any) -> None:
            self.t = t

        def __dlpack__(self, **kw: Any) -> Any:
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self) -> Any:
            return self.t.__dlpack_device__()

    grid = (-(-n // 256),)
    kernel.launch("axpy_f32", grid=grid, block=256, args=(n, 2.0, x, y))  # CuPy: __cuda_array_interface__
    kernel.launch("axpy_f32", grid=grid, block=256, args=(n, 1.0, OnlyDLPack(torch.as_tensor(x, device="cuda:0")), y.data.ptr))  # DLPack, raw int
    cupy.cuda.Device(0).synchronize()
    expected = 3.0 * x_np + y0
    got = cupy.asnumpy(y).astype(np.float64)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-6


@gpu
def test_launch_follows_torch_current_stream_into_graph_capture(lib: launch.Library, torch: Any, hopper: None) -> None:
    # Launched anywhere but the capturing stream, the launch would not be in the graph
    # (or would break the capture), and replaying it would leave y unchanged.
    kernel = lib.kernel("axpy/f32/vec4/sm_90a")
    n = 100_000
    x = torch.randn(n, device="cuda:0")
    y = torch.zeros(n, device="cuda:0")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        kernel.launch("axpy_f32", grid=(-(-n // 1024),), block=256, args=(n, 1.0, x, y))
    torch.cuda.synchronize()
    assert torch.count_nonzero(y) == 0  # captured, not run
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(y, 2 * x)


@gpu
def test_explicit_streams_of_each_kind(lib: launch.Library, torch: Any, hopper: None) -> None:
    kernel = lib.kernel("axpy/f64/vec1/sm_90a")
    n = 5000
    x = torch.randn(n, dtype=torch.float64, device="cuda:0")
    y = torch.zeros(n, dtype=torch.float64, device="cuda:0")
    s = torch.cuda.Stream()
    for stream in (s, s.cuda_stream):
        kernel.launch("axpy_f64", grid=(-(-n // 256),), block=256, args=(n, 1.0, x, y), stream=stream)
    core = pytest.importorskip("cuda.core")
    dev = core.Device(0)
    dev.set_current()
    cs = dev.create_stream()
    s.synchronize()
    kernel.launch("axpy_f64", grid=(-(-n // 256),), block=256, args=(n, 1.0, x, y), stream=cs)  # __cuda_stream__
    cs.sync()
    assert torch.equal(y, 3 * x)
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f64/vec1/sm_90a' entry 'axpy_f64' stream: expected a handle int"):
        kernel.launch("axpy_f64", grid=1, block=256, args=(n, 1.0, x, y), stream="default")


@gpu
def test_large_dynamic_shared_memory_and_clusters(lib: launch.Library, torch: Any, hopper: None) -> None:
    kernel = lib.kernel("axpy/f32/vec1/sm_90a")
    n = 256 * 64
    _axpy_run(torch, kernel, n, shared_mem=200 * 1024)  # above 48 KiB: needs the function attribute
    _axpy_run(torch, kernel, n, cluster=(2, 1, 1))
    _axpy_run(torch, kernel, n, cluster=(16, 1, 1))  # non-portable cluster size
    x = torch.ones(n, device="cuda:0")
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec1/sm_90a' entry 'axpy_f32': grid \(63, 1, 1\) is not a multiple of cluster \(2, 1, 1\)"):
        kernel.launch("axpy_f32", grid=63, block=256, args=(n, 1.0, x, x), cluster=2)
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec1/sm_90a' entry 'axpy_f32': shared_mem 1048576 bytes plus 0 static exceeds device 0's limit of \d+ bytes per block$"):
        kernel.launch("axpy_f32", grid=64, block=256, args=(n, 1.0, x, x), shared_mem=1 << 20)


@gpu
def test_a_launch_from_no_current_context_switches_to_the_device_and_back(lib: launch.Library, torch: Any,
                                                                          hopper: None) -> None:
    drv = _cuda.driver()
    kernel = lib.kernel("axpy/f32/vec4/sm_90a", device=0)
    primary = _cuda.primary_context(0)
    _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(0)), "cuCtxSetCurrent(NULL)")
    try:
        _axpy_run(torch, kernel, 100_003)  # torch makes its own context current for its copies
        _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(0)), "cuCtxSetCurrent(NULL)")
        x = torch.ones(1024, device="cuda:0")
        y = torch.zeros(1024, device="cuda:0")
        _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(0)), "cuCtxSetCurrent(NULL)")
        kernel.launch("axpy_f32", grid=(1,), block=(256,), args=(1024, 3.0, x, y))
        current = _cuda.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        assert current is None or int(current) == 0  # the caller's (none) again, not the primary
    finally:
        _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(primary)), "cuCtxSetCurrent(primary)")
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 3.0))


@gpu
def test_threads_share_one_loaded_module(lib: launch.Library, torch: Any, hopper: None) -> None:
    errors: list[BaseException] = []
    kernels: list[launch.Kernel] = []

    def work() -> None:
        try:
            k = lib.kernel("transpose", dtype="f32", tile=32)
            kernels.append(k)
            _ = k.spec
        except Exception as exc:  # noqa: BLE001 -- collected, asserted empty in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({id(next(iter(k._functions.values()))) for k in kernels}) == 1


@gpu
def test_one_kernel_on_each_of_two_devices(lib: launch.Library, torch: Any, hopper: None) -> None:
    if device.count() < 2:
        pytest.skip("needs two GPUs")
    if device.compute_capability(1) != (9, 0):
        pytest.skip("device 1 is not compute capability 9.0")
    torch.cuda.set_device(0)
    k0 = lib.kernel("axpy/f32/vec4/sm_90a", device=0)
    k1 = lib.kernel("axpy/f32/vec4/sm_90a", device=1)
    assert (k0.device, k1.device) == (0, 1)
    assert launch.is_loaded(k0.spec.digest, 0) and launch.is_loaded(k0.spec.digest, 1)
    _axpy_run(torch, k0, 1_000_003, device=0)
    _axpy_run(torch, k1, 1_000_003, device=1)
    assert torch.cuda.current_device() == 0  # launching on device 1 left the caller's device alone
    x0 = torch.ones(256, device="cuda:0")
    y1 = torch.ones(256, device="cuda:1")
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 2: expected ptr to CUDA memory on device 1, got torch.Tensor on cuda:0$"):
        k1.launch("axpy_f32", grid=1, block=256, args=(256, 1.0, x0, y1))
    # A bare __cuda_array_interface__ names no device: the driver is asked who owns the pointer.
    bare = type("Bare", (), {"__cuda_array_interface__": x0.__cuda_array_interface__})()
    with pytest.raises(BadArgumentError, match=r"^kernel 'axpy/f32/vec4/sm_90a' entry 'axpy_f32' parameter 2: expected ptr to CUDA memory on device 1, got .*Bare on device 0$"):
        k1.launch("axpy_f32", grid=1, block=256, args=(256, 1.0, bare, y1))


# -- the compiled first-load helper (cubinstore._core.native) against Python's calls ---------------


def _first_load(manifest: Manifest, store: Store, kernel_id: str) -> tuple[launch.Kernel, int]:
    """A first load of ``kernel_id`` on device 0 through a fresh ``Devices``: the kernel, its library."""
    device.use(device.Devices())
    kernel = launch.Library(manifest, store).kernel(kernel_id, device=0)
    (library,) = _loader.loaded_libraries()
    return kernel, library


def _unload(library: int) -> None:
    drv = _cuda.driver()
    with _cuda.on_device(0):
        _cuda.check(drv.cuLibraryUnload(drv.CUlibrary(library)), "cuLibraryUnload")


@gpu
@pytest.mark.parametrize("path", native_paths.PATHS)
def test_a_first_load_by_either_path_launches_and_leaves_no_context_current(
        manifest: Manifest, store: Store, torch: Any, hopper: None, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    calls: list[int] = []
    load: Any = None
    if path == "native":
        native_paths.use(monkeypatch, "native")
        real = _cuda.native_load()
        assert real is not None  # set with the driver where the helper was built

        def load(*args: Any) -> Any:
            calls.append(1)
            return real(*args)
    drv = _cuda.driver()
    kernel_id = next(i for i in _specs("axpy"))
    before = device.current()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_cuda.using_native_load(load))
        stack.callback(device.use, before)
        kernel, library = _first_load(manifest, store, kernel_id)
        _axpy_run(torch, kernel, 1_000_003)
        _unload(library)
        # From no current context: the load switches to the device's primary context and back.
        _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(0)), "cuCtxSetCurrent(NULL)")
        try:
            kernel, library = _first_load(manifest, store, kernel_id)
            current = _cuda.check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
            assert current is None or int(current) == 0
        finally:
            _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(_cuda.primary_context(0))), "cuCtxSetCurrent(primary)")
        _axpy_run(torch, kernel, 4099)
        _unload(library)
    assert len(calls) == (2 if path == "native" else 0)


@gpu
def test_the_helper_and_python_find_the_same_functions_and_word_failures_alike(
        manifest: Manifest, store: Store, hopper: None, monkeypatch: pytest.MonkeyPatch) -> None:
    native_paths.use(monkeypatch, "native")
    spec = manifest.by_id(next(i for i in _specs("axpy")))
    data = store.get(spec.digest, spec.size)
    entries = (*spec.entries, "no_such_entry", "never_asked")
    results = []
    for load in (_cuda.native_load(), None):
        with _cuda.using_native_load(load):
            library, functions = _cuda.load_functions(data, entries, 0, "axpy")
        results.append([f is None for f in functions])
        assert functions[0] is not None
        _unload(library)
    # Each entry's function, then a None at the first one the library lacks, and no further.
    assert results[0] == results[1] == [False] * len(spec.entries) + [True]
    helper = native_paths.built_helper()
    garbage = b"\x7fELF" + b"\0" * 200
    assert helper.load_functions(garbage, tuple(spec.entries), _cuda.primary_context(0), 500) not in (0, -1)
    for load in (_cuda.native_load(), None):  # the helper's CUresult sends the call down Python's path
        with _cuda.using_native_load(load), pytest.raises(CudaError, match=r"^cuLibrary(LoadData|GetKernel\('axpy_f32'\)) for axpy: CUDA_ERROR_INVALID_IMAGE"):
            _cuda.load_functions(garbage, tuple(spec.entries), 0, "axpy")
