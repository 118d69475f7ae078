"""GPU: a GEMM point no manifest has, JIT-compiled from the family's sources, launches and is
correct; a JIT kernel launches like `lib.kernel()`'s. Needs nvcc, the CUTLASS headers
($CUBINSTORE_CUTLASS_INCLUDE or the nvidia-cutlass wheel) and a Hopper GPU.

On the H200 host: `CUBINSTORE_CUTLASS_INCLUDE=<carried include> python3 -m pytest -m gpu tests/jit/test_jit_gpu.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")
torch = pytest.importorskip("torch", reason="the GPU tests use torch tensors")

import cubinstore  # noqa: E402
from cubinstore import jit  # noqa: E402
from cubinstore.errors import BadArgumentError  # noqa: E402
from cubinstore.internals import (  # noqa: E402
    cutlass_include, gemm_launch, locate_toolkit, ops_library, template_for_sources,
)
from cubinstore.manifest import Manifest  # noqa: E402
from cubinstore.store import DirectorySource, LocalLayer, MemoryLayer, Store  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GEMM_FILES = ["kernels/gemm/sm90_bf16_gemm.cu", "kernels/gemm/sm90_bf16_gemm.cuh", "kernels/gemm/sm90_ptx.cuh"]
GEMM_ENTRY = {gemm_launch.ENTRY: list(gemm_launch.ENTRY_TYPES)}
# Two stages: a point the family's grid (kernels/gemm/BUILD.bazel) does not have.
POINT = {"bm": 128, "bn": 128, "bk": 64, "stages": 2, "cluster": 1, "swap": 0}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    try:
        locate_toolkit()
    except BadArgumentError as exc:
        pytest.skip(f"no nvcc for the JIT: {exc}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"needs a Hopper GPU (9.0), got {torch.cuda.get_device_capability()}")
    return Store([MemoryLayer(1 << 28), LocalLayer(tmp_path_factory.mktemp("jitgpu") / "home")])


@pytest.fixture(scope="module")
def gemm_spec(store: Store):
    try:
        cutlass = cutlass_include()
    except BadArgumentError as exc:
        pytest.skip(str(exc))
    template = template_for_sources(
        "gemm", list(POINT), "kernels/gemm/sm90_bf16_gemm.cu", {p: (REPO / p).read_text() for p in GEMM_FILES}, store,
        defines=["BM={bm}", "BN={bn}", "BK={bk}", "STAGES={stages}", "CLUSTER_M={cluster}", "SWAP={swap}"],
        entries=GEMM_ENTRY, archs=["sm_90a"], includes=["cutlass"], package="kernels/gemm",
    )
    return jit.compile_family_point(template, POINT, "sm_90a", store=store, include_roots={"cutlass": cutlass})


@pytest.mark.parametrize("splits", [1, 2])
def test_jit_compiled_gemm_point_matches_torch(store: Store, gemm_spec, splits: int) -> None:
    from cubinstore import ops

    assert gemm_spec.id == "gemm/bm128/bn128/bk64/stages2/cluster1/swap0/sm_90a"
    previous = ops_library._library  # restored after: other GPU tests use the default library
    ops.set_library(cubinstore.open(Manifest.build([gemm_spec]), store))
    try:
        torch.manual_seed(0)
        m, n, k = 1000, 776, 520  # tails in every dimension
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poison: every element is written
        ops.gemm_with(a, b, out=d, kernel_id=gemm_spec.id, splits=splits)
        torch.cuda.synchronize()
        ref = a.double() @ b.double().T
        err = (torch.linalg.norm(d.double() - ref) / torch.linalg.norm(ref)).item()
        assert err < 1e-2, f"relative error {err}"
    finally:
        ops.set_library(previous)


def test_jit_kernel_launches_like_a_manifest_kernel(store: Store) -> None:
    tu = ('extern "C" __global__ void scale(int n, float a, float* x) {\n'
          '  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }\n')
    k = jit.compile(tu, include_dirs=[], arch="sm_90a", entries={"scale": ["i32", "f32", "ptr"]}, store=store)
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    k.launch("scale", grid=4, block=256, args=(1000, 3.0, x))
    torch.cuda.synchronize()
    assert torch.equal(x, torch.arange(1000, device="cuda", dtype=torch.float32) * 3.0)
    again = jit.compile(tu, include_dirs=[], arch=None, entries={"scale": ["i32", "f32", "ptr"]}, store=store)
    assert again.compiled is False and again.key == k.key  # arch=None is the device's: sm_90a on an H200


def test_jit_kernel_declared_by_its_cxx_name_launches_by_either_name(store: Store) -> None:
    tu = ('namespace mylib {\n'
          'template <int N, typename T> __global__ void scale(int n, T a, T* x) {\n'
          '  int i = blockIdx.x * N + threadIdx.x; if (i < n) x[i] *= a; }\n'
          'template __global__ void scale<256, float>(int, float, float*);\n'
          '}\n')
    k = jit.compile(tu, include_dirs=[], arch="sm_90a", entries={"mylib::scale<256, float>": ["i32", "f32", "ptr"]},
                    store=store)
    (symbol,) = k.entries
    assert symbol.startswith("_ZN5mylib5scaleILi256EfEE") and k.names == {symbol: "mylib::scale<256, float>"}
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    k.launch("mylib::scale<256, float>", grid=4, block=256, args=(1000, 3.0, x))
    k.launch(symbol, grid=4, block=256, args=(1000, 0.5, x))
    torch.cuda.synchronize()
    assert torch.equal(x, torch.arange(1000, device="cuda", dtype=torch.float32) * 1.5)


def test_a_point_the_release_lacks_compiles_from_the_manifests_own_template(
        store: Store, tmp_path_factory: pytest.TempPathFactory) -> None:
    # The release's manifest embeds the gemm family's JIT template; its source bundle is a blob
    # of the build (found here beside the CUBINs, in production in the cache CI filled).
    import os

    from cubinstore import ops

    path = Path(os.environ.get("CUBINSTORE_TEST_MANIFEST", "bazel-bin/kernels/manifest.json"))
    if not path.is_file():
        pytest.skip(f"no manifest at {path}: run `bazel build //kernels:all` or set CUBINSTORE_TEST_MANIFEST")
    manifest = Manifest.from_path(path)
    if "gemm" not in manifest.jit_templates:
        pytest.skip("the manifest's gemm family has no JIT template")
    assert not manifest.find("gemm", **POINT), "the point must be one the release lacks"
    build = Store([MemoryLayer(1 << 28), LocalLayer(tmp_path_factory.mktemp("release") / "home"),
                   DirectorySource(path.parent), DirectorySource(path.parent, suffix=".sources.json")])
    lib = cubinstore.open(manifest, build)
    kernel = lib.kernel("gemm", jit=True, **POINT)
    assert dict(kernel.spec.params) == POINT and kernel.spec.arch == "sm_90a"
    with pytest.raises(cubinstore.KernelNotFoundError, match=r"^no kernel gemm bm=128 .* run-time compilation is off"):
        cubinstore.open(manifest, Store([MemoryLayer(1 << 20)])).kernel("gemm", jit=False, bm=128, bn=128, bk=64, stages=3, cluster=1)
    previous = ops_library._library
    ops.set_library(cubinstore.open(Manifest.build([kernel.spec]), build))
    try:
        m, n, k = 1000, 776, 520
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ops.gemm_with(a, b, out=d, kernel_id=kernel.spec.id, splits=1)
        torch.cuda.synchronize()
        ref = a.double() @ b.double().T
        assert (torch.linalg.norm(d.double() - ref) / torch.linalg.norm(ref)).item() < 1e-2
    finally:
        ops.set_library(previous)
