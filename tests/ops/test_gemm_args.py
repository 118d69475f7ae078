"""cubinstore.ops.gemm without a GPU: argument checks, the launch plan, tensor-map checks, the tuning table.

`check_operands` is the exact validation `gemm` runs on the tensors it is
given (read into `Operand` values first), so it is tested here on such values
without torch or a GPU.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import cubinstore.ops as ops
from cubinstore import launch as ops_launch
from cubinstore.errors import BadArgumentError, CubinstoreError, KernelNotFoundError
from cubinstore.internals import ArgBuffer, PackedArgs, args as _args, device, gemm_launch as G, gemm_tuning as TUNING, pack_args
from cubinstore.manifest import Manifest
from cubinstore.tensormap import TensorMap, check_2d_bf16

ROOT = Path(__file__).resolve().parents[2]


def op(name: str, shape: tuple[int, ...], strides: tuple[int, ...] | None = None, *, dtype: str = "bfloat16",
       device: str = "cuda:0", address: int = 0x7F0000000000) -> G.Operand:
    if strides is None:
        strides = (shape[1], 1) if len(shape) == 2 else (1,) * len(shape)
    return G.Operand(name, dtype, shape, strides, device, address)


# -- operand checks --------------------------------------------------------------------------------


def test_valid_operands_give_m_n_k() -> None:
    assert G.check_operands(op("a", (1000, 1008)), op("b", (333, 1008)), None) == (1000, 333, 1008)
    assert G.check_operands(op("a", (1, 8)), op("b", (1, 8)), op("out", (1, 1))) == (1, 1, 8)


def test_an_out_view_at_any_element_is_accepted_when_n_is_odd() -> None:
    # With N odd the kernel stores D one element at a time: 2-byte alignment is enough.
    assert G.check_operands(op("a", (4, 8)), op("b", (3, 8)), op("out", (4, 3), address=0x7F0000000002)) == (4, 3, 8)


def test_padded_row_stride_is_accepted() -> None:
    assert G.check_operands(op("a", (64, 1000), (1064, 1)), op("b", (64, 1000)), None) == (64, 64, 1000)


@pytest.mark.parametrize(("a", "b", "out"), [
    (op("a", (64, 60)), op("b", (64, 60)), None),  # K off 8
    (op("a", (777, 1111)), op("b", (3333, 1111)), None),  # the shape
    (op("a", (64, 64), (1, 64)), op("b", (64, 64)), None),  # a transposed view
    (op("a", (64, 64)), op("b", (64, 64), (68, 1)), None),  # rows off 16 bytes
    (op("a", (64, 64), (0, 1)), op("b", (64, 64)), None),  # an expanded row
    (op("a", (64, 64), address=0x7F0000000008), op("b", (64, 64)), None),  # a view 8 bytes in
    (op("a", (64, 64)), op("b", (32, 64)), op("out", (64, 32), (1, 64))),  # a transposed out
    (op("a", (64, 64)), op("b", (32, 64)), op("out", (64, 32), address=0x7F0000000002)),  # out mid-word
    (op("a", (1, 1)), op("b", (1, 1)), op("out", (1, 1), (7, 3))),
])
def test_every_layout_torch_mm_takes_passes_the_checks(a: G.Operand, b: G.Operand, out: G.Operand | None) -> None:
    # Layouts decide what a launch copies (_gemm_staging, tests/ops/test_gemm_staging.py), never an error.
    assert G.check_operands(a, b, out) == (a.shape[0], b.shape[0], a.shape[1])


@pytest.mark.parametrize(("a", "b", "out", "message"), [
    (op("a", (64, 64), dtype="float32"), op("b", (64, 64)), None,
     r"^gemm a: expected dtype bfloat16, got float32$"),
    (op("a", (64, 64)), op("b", (64, 64), dtype="float16"), None,
     r"^gemm b: expected dtype bfloat16, got float16$"),
    (op("a", (64,)), op("b", (64, 64)), None,
     r"^gemm a: expected a 2-D tensor, got 1-D shape \(64,\)$"),
    (op("a", (64, 64)), op("b", (32, 72)), None,
     r"^gemm: a is 64x64 and b is 32x72: expected the same K"),
    (op("a", (64, 64)), op("b", (32, 64)), op("out", (32, 64)),
     r"^gemm out: expected shape \(64, 32\), got \(32, 64\)$"),
    (op("a", (64, 64)), op("b", (32, 64)), op("out", (64, 32), dtype="float32"),
     r"^gemm out: expected dtype bfloat16, got float32$"),
    (op("a", (64, 64), device="cpu"), op("b", (64, 64)), None,
     r"^gemm a: expected a CUDA tensor, got one on cpu$"),
    (op("a", (64, 64)), op("b", (64, 64), device="cuda:1"), None,
     r"^gemm: expected a, b and out on one device, got cuda:0, cuda:1$"),
])
def test_bad_operands_are_typed_errors_naming_the_operand(
    a: G.Operand, b: G.Operand, out: G.Operand | None, message: str
) -> None:
    with pytest.raises(BadArgumentError, match=message):
        G.check_operands(a, b, out)


@pytest.mark.parametrize("value", [[[1.0]], None, 3.0, b"\0" * 16])
def test_gemm_refuses_what_is_not_a_torch_tensor(value: object) -> None:
    with pytest.raises(BadArgumentError, match=r"^gemm a: expected a torch.Tensor, got builtins\."):
        ops.gemm(value, value)


def test_gemm_refuses_cpu_torch_tensors_before_any_cuda_call() -> None:
    torch = pytest.importorskip("torch", reason="needs torch to make a real CPU tensor")
    a = torch.zeros(16, 16, dtype=torch.bfloat16)
    with pytest.raises(BadArgumentError, match=r"^gemm a: expected a CUDA tensor, got one on cpu$"):
        ops.gemm(a, a)


def test_importing_cubinstore_ops_never_tries_to_import_torch() -> None:
    # A finder that records every attempt, so the check holds whether torch is installed or not.
    code = """
import sys
tried = []
class Recorder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] == "torch":
            tried.append(name)
        return None
sys.meta_path.insert(0, Recorder)
import cubinstore, cubinstore.ops, cubinstore.ops._gemm, cubinstore.ops._gemm_op
print(tried)
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines()[-1] == "[]"


def write_gemm_manifest(path: Path, cfg: G.GemmConfig, digest: str) -> Path:
    """A one-kernel manifest for `cfg`, written to `path` (the blob itself need not exist)."""
    target = "//kernels/gemm:" + cfg.kernel_id.removesuffix("/sm_90a").replace("/", "_") + "_sm_90a"
    path.write_bytes(Manifest.build([{
        "id": cfg.kernel_id, "family": "gemm", "params": cfg.params, "arch": "sm_90a",
        "digest": digest, "size": 4096, "entries": {G.ENTRY: list(G.ENTRY_TYPES)}, "target": target,
    }]).raw)
    return path


def test_without_a_library_the_error_says_how_to_set_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBINSTORE_MANIFEST", raising=False)
    ops.set_library(None)
    with pytest.raises(KernelNotFoundError, match=r"^no kernel library for cubinstore.ops: set CUBINSTORE_MANIFEST"):
        ops.get_library()


def test_the_default_library_comes_from_cubinstore_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = G.GemmConfig(128, 256, 64, 4, 1)
    path = write_gemm_manifest(tmp_path / "manifest.json", cfg, "sha256:" + "cd" * 32)
    monkeypatch.setenv("CUBINSTORE_MANIFEST", str(path))
    ops.set_library(None)
    try:
        assert ops.get_library().manifest.by_id(cfg.kernel_id).digest.hex == "cd" * 32
    finally:
        ops.set_library(None)


def test_a_missing_default_manifest_is_a_typed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBINSTORE_MANIFEST", str(tmp_path / "nope.json"))
    ops.set_library(None)
    with pytest.raises(CubinstoreError, match="nope.json"):
        ops.get_library()


def test_set_library_accepts_a_manifest_path_without_touching_cuda(tmp_path: Path) -> None:
    cfg = G.GemmConfig(128, 256, 64, 4, 2)
    path = write_gemm_manifest(tmp_path / "manifest.json", cfg, "sha256:" + "ab" * 32)
    try:
        ops.set_library(path)
        assert ops.get_library().manifest.by_id(cfg.kernel_id).params["cluster"] == 2
    finally:
        ops.set_library(None)


# -- instantiations and plans ----------------------------------------------------------------------


def test_kernel_id_round_trips_and_renders_params_in_grid_order() -> None:
    cfg = G.GemmConfig.from_id("gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a")
    assert cfg == G.GemmConfig(128, 256, 64, 4, 1)
    assert cfg.kernel_id == "gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a"
    assert list(cfg.params) == ["bm", "bn", "bk", "stages", "cluster", "swap"]
    assert cfg.defines == ("-DBM=128", "-DBN=256", "-DBK=64", "-DSTAGES=4", "-DCLUSTER_M=1", "-DSWAP=0")
    swapped = G.GemmConfig.from_id("gemm/bm128/bn104/bk64/stages6/cluster1/swap1/sm_90a")
    assert swapped == G.GemmConfig(128, 104, 64, 6, 1, 1) and swapped.defines[-1] == "-DSWAP=1"


@pytest.mark.parametrize("bad", ["gemm/bm128/bn256/bk64/stages4/sm_90a", "gemm/bm128/bn256/bk64/stages4/cluster1/sm_90",
                                 "gemm/bm128/bn256/bk64/stages4/cluster1/sm_90a",
                                 "axpy/f32/vec4/sm_90a", 42])
def test_malformed_kernel_id_is_a_typed_error(bad: object) -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid gemm kernel id "):
        G.GemmConfig.from_id(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("row", "why"), [
    ((256, 256, 64, 2, 1), "accumulators of a 256x256 tile exceed 128 registers"),
    ((128, 256, 64, 5, 1), "shared memory 263248 > 232448 bytes"),
    ((128, 96, 64, 4, 1), "bn 96 not in"),
    ((128, 128, 64, 4, 8), "cluster 8 not in"),
    ((128, 128, 64, 4, 3), "cluster 3 not in"),
    # Swapped, BN is wgmma's N along the caller's M: a multiple of 8 (so a cluster of 4 shares it in equal slices).
    ((128, 100, 64, 4, 1, 1), "bn 100 with swap 1: expected a multiple of 8"),
    ((128, 264, 64, 2, 1, 1), "bn 264 with swap 1: expected a multiple of 8 up to 256"),
    ((64, 104, 64, 4, 8, 1), "cluster 8 not in"),
    ((128, 104, 64, 4, 1, 2), "swap 2 not in"),
])
def test_instantiations_the_kernel_cannot_build_are_refused(row: tuple[int, ...], why: str) -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid gemm instantiation .*" + why):
        G.GemmConfig(*row)


def test_shared_memory_formula_matches_the_kernel() -> None:
    # kernels/gemm/sm90_bf16_gemm.cuh: 1024 + STAGES * (BM + BN) * BK * 2 + 2 * STAGES * 8
    # + kDBoxes * consumers * 64 * 128, two D boxes a consumer where they fit and a tile has an even number
    assert G.GemmConfig(128, 256, 64, 4, 1).smem_bytes == 1024 + 4 * 384 * 128 + 64 + 2 * 2 * 8192
    assert G.GemmConfig(128, 128, 128, 3, 2).smem_bytes == 1024 + 3 * 256 * 256 + 48 + 2 * 2 * 8192
    assert G.GemmConfig(64, 256, 64, 5, 1).smem_bytes == 1024 + 5 * 320 * 128 + 80 + 2 * 8192
    # Two do not fit beside this ring; a 128 x 64 tile is one box a consumer (odd).
    assert G.GemmConfig(128, 192, 64, 5, 1).smem_bytes == 1024 + 5 * 320 * 128 + 80 + 2 * 8192
    assert G.GemmConfig(128, 64, 64, 8, 1).d_boxes == 1 and G.GemmConfig(256, 64, 64, 4, 1).d_boxes == 2
    # Swapped (kDBoxBytes = BN * 128): one box a consumer of the tile's BN rows of D by 64 columns.
    assert G.GemmConfig(128, 104, 64, 6, 1, 1).smem_bytes == 1024 + 6 * 232 * 128 + 96 + 2 * 104 * 128
    assert G.GemmConfig(64, 104, 64, 10, 1, 1).smem_bytes == 1024 + 10 * 168 * 128 + 160 + 104 * 128
    assert G.GemmConfig(128, 104, 64, 6, 1, 1).d_box == (104, 64) and G.GemmConfig(128, 128, 64, 5, 1).d_box == (64, 64)


def test_block_has_one_consumer_warpgroup_for_64_row_tiles_else_two() -> None:
    # kernels/gemm/sm90_bf16_gemm.cuh: kThreads = 128 * (kConsumers + 1), kConsumers = BM == 64 ? 1 : 2
    assert G.GemmConfig(64, 128, 64, 5, 1).threads == 256
    assert G.GemmConfig(128, 128, 64, 5, 1).threads == 384
    assert G.GemmConfig(256, 64, 64, 4, 2).threads == 384


def test_cluster_halves_the_b_box() -> None:
    assert G.GemmConfig(128, 192, 64, 5, 1).box_b == (192, 64)
    assert G.GemmConfig(128, 192, 64, 5, 2).box_b == (96, 64)
    assert G.GemmConfig(256, 64, 64, 4, 2).box_a == (256, 64)


def test_plan_is_persistent_and_a_multiple_of_the_cluster() -> None:
    p = G.plan(4096, 4096, 4096, 132, "gemm/bm128/bn256/bk64/stages4/cluster2/swap0/sm_90a", 1)
    assert (p.tiles_m, p.tiles_n, p.units, p.grid, p.splits) == (32, 16, 256, 132, 1)
    assert p.workspace_floats == 0 and p.counters == 0
    small = G.plan(100, 100, 64, 132, "gemm/bm128/bn256/bk64/stages4/cluster2/swap0/sm_90a", 1)
    assert (small.units, small.grid) == (1, 2)  # one cluster; its second CTA has no rows


def test_plan_caps_the_grid_at_the_clusters_the_device_holds_at_once() -> None:
    pair = "gemm/bm128/bn256/bk64/stages4/cluster2/swap0/sm_90a"
    # A GPU whose GPCs hold only 55 pairs at once (an odd SM count per GPC strands one each).
    capped = G.plan(4096, 4096, 4096, 132, pair, 1, max_clusters=55)
    assert (capped.units, capped.grid) == (256, 110)
    assert G.plan(4096, 4096, 4096, 132, pair, 1, max_clusters=66).grid == 132  # the SMs bound it first
    assert G.plan(100, 100, 64, 132, pair, 1, max_clusters=55).grid == 2  # the work bounds it first
    stream_k = G.plan(4096, 4096, 4096, 132, pair, G.STREAM_K, max_clusters=55)
    assert stream_k.grid == 110 and stream_k.workspace_floats == 110 * 128 * 256  # one partial a CTA


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "55"])
def test_plan_refuses_a_bad_cluster_cap(bad: object) -> None:
    with pytest.raises(BadArgumentError, match=r"^gemm: kernel gemm/\S+ max_clusters: expected a positive int "
                                               r"\(the clusters the device holds at once\), got "):
        G.plan(4096, 4096, 4096, 132, "gemm/bm128/bn256/bk64/stages4/cluster2/swap0/sm_90a", 1,
               max_clusters=bad)  # type: ignore[arg-type]


class _HoldsClusters:
    """A loaded kernel as _co_resident sees it: what the driver would answer, and how often it was asked."""

    def __init__(self, held: int) -> None:
        self.held, self.asked = held, []
        self.spec = SimpleNamespace(entries={G.ENTRY: list(G.ENTRY_TYPES)}, digest="sha256:" + "ab" * 32)

    def max_active_clusters(self, entry: str, **geometry: Any) -> int:
        self.asked.append((entry, geometry))
        return self.held


def test_the_co_resident_count_is_asked_once_per_point_and_device() -> None:
    pair = "gemm/bm128/bn256/bk64/stages4/cluster2/swap0/sm_90a"
    library, kernel = object(), _HoldsClusters(55)
    try:
        assert G._co_resident(library, kernel, pair, 0) == 55
        assert G._co_resident(library, kernel, pair, 0) == 55
        cfg = G.GemmConfig.from_id(pair)
        assert kernel.asked == [(G.ENTRY, {"grid": (2, 1, 1), "block": (cfg.threads, 1, 1),
                                           "shared_mem": cfg.smem_bytes})]
        # Not launched in clusters: nothing to ask.
        assert G._co_resident(library, kernel, "gemm/bm128/bn256/bk64/stages4/cluster1/swap0/sm_90a", 0) is None
        assert G._co_resident(library, kernel, "skinny/bm16/bn16/warps8/unroll4/sm_90a", 0) is None
        assert len(kernel.asked) == 1
        with pytest.raises(BadArgumentError, match=r"^gemm: device 1 cannot hold one cluster of kernel "
                                                   r"gemm/bm128/bn256/bk64/stages4/cluster2/swap0/sm_90a \(2 CTAs of "):
            G._co_resident(library, _HoldsClusters(0), pair, 1)
    finally:
        for key in [k for k in G._co_resident_counts if k[0] is library]:
            del G._co_resident_counts[key]


class _Library:
    """A Library as the gemm caches see it: its manifest's points (`find`) and their loaded kernels."""

    def __init__(self, kernels: dict[str, _HoldsClusters], others: list[str]) -> None:
        self.kernels = kernels
        points = [SimpleNamespace(id=kid, arch=G.ARCH) for kid in [*kernels, *others]]
        self.manifest = SimpleNamespace(find=lambda family: [p for p in points if p.id.startswith(family + "/")])

    def kernel(self, kernel_id: str, *, device: int) -> _HoldsClusters:
        return self.kernels[kernel_id]


def test_cluster_slots_asks_the_first_point_of_each_cluster_size_once() -> None:
    ids = [G.GemmConfig(*row).kernel_id for row in ((128, 256, 64, 4, 1), (128, 256, 64, 4, 2), (128, 128, 64, 5, 2),
                                                     (64, 104, 64, 10, 4, 1), (128, 200, 64, 4, 4, 1))]
    kernels = {kid: _HoldsClusters(66 if "/cluster2/" in kid else 30) for kid in ids}
    library = _Library(kernels, ["skinny/bm16/bn16/warps8/unroll4/sm_90a"])
    try:
        assert G.cluster_slots(library, 0) == {2: 66, 4: 30}
        assert G.cluster_slots(library, 0) == {2: 66, 4: 30}
        asked = sorted(kid for kid, kernel in kernels.items() for _ in kernel.asked)
        assert asked == sorted([min(i for i in ids if "/cluster2/" in i), min(i for i in ids if "/cluster4/" in i)])
    finally:
        G._cluster_slots.pop((library, 0), None)
        for key in [k for k in G._co_resident_counts if k[0] is library]:
            del G._co_resident_counts[key]


def test_d_goes_through_tma_only_with_16_byte_rows_and_start() -> None:
    # kernels/gemm/sm90_bf16_gemm.cuh: tma_store = (n & 7) == 0 && (d & 15) == 0
    assert G.stores_by_tma(4096, 0x7F00_0000_0000) and G.stores_by_tma(8, 16)
    assert not G.stores_by_tma(4100, 0x7F00_0000_0000)  # rows of 8200 bytes
    assert not G.stores_by_tma(4096, 0x7F00_0000_0008)  # an out view 8 bytes into its storage


def test_a_map_promotes_l2_reads_to_256_bytes_only_for_rows_on_the_128_byte_lines() -> None:
    # Rows off the lines: each 128-byte box row spans two lines (kernels/gemm/README.md, the maps).
    assert [G.l2_promotion(s) for s in (64, 2048, 4096, 28672)] == ["256B"] * 4
    assert [G.l2_promotion(s) for s in (8, 520, 1000, 2008, 4104, 28680)] == ["128B"] * 6


def test_a_swapped_plan_tiles_n_by_m() -> None:
    # 200 rows of A in two tiles of 104 (not 128) along the kernel's n; N's 7168 in 56 of 128 along its m.
    p = G.plan(200, 7168, 2048, 132, "gemm/bm128/bn104/bk64/stages6/cluster1/swap1/sm_90a", 1)
    assert (p.tiles_m, p.tiles_n, p.units, p.grid) == (56, 2, 112, 112)
    assert G.GemmConfig(128, 104, 64, 6, 1, 1).kernel_dims(200, 7168) == (7168, 200)
    assert G.GemmConfig(128, 128, 64, 5, 1).kernel_dims(200, 7168) == (200, 7168)


def test_plan_clamps_splits_to_the_k_blocks() -> None:
    p = G.plan(128, 4096, 200, 132, "gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 8)
    assert p.splits == 4  # ceil(200 / 64) K blocks
    assert p.workspace_floats == 1 * 32 * 3 * 128 * 128 and p.counters == 32  # no partial of the last split
    assert G.plan(8, 8, 8, 132, "gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", -3).splits == 1
    assert G.plan(8, 8, 8, 132, "gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", G.STREAM_K).stream_k


@pytest.mark.parametrize(("m", "n", "k"), [(0, 8, 8), (8, 8, 2**31)])
def test_plan_refuses_sizes_outside_i32(m: int, n: int, k: int) -> None:
    with pytest.raises(BadArgumentError, match=r"^gemm [mnk]: expected 1 <= "):
        G.plan(m, n, k, 132, "gemm/bm128/bn128/bk64/stages5/cluster1/swap0/sm_90a", 1)


# -- tensor maps -----------------------------------------------------------------------------------


def test_tensormap_holds_exactly_128_bytes() -> None:
    assert TensorMap(b"\1" * 128).raw == b"\1" * 128
    with pytest.raises(BadArgumentError, match=r"^TensorMap.raw: expected 128 bytes, got bytes of 127 bytes$"):
        TensorMap(b"\0" * 127)
    with pytest.raises(BadArgumentError, match=r"^TensorMap.raw: expected 128 bytes, got bytearray"):
        TensorMap(bytearray(128))  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"address": 0x1008}, r"^tensor map address 0x1008: expected 16-byte alignment$"),
    ({"address": 0}, r"^tensor map address: expected a device pointer, got 0$"),
    ({"row_stride": 1004}, r"^tensor map row_stride 1004 elements \(2008 bytes\): expected a multiple of 16 bytes"),
    ({"row_stride": 500}, r"^tensor map row_stride: expected an int >= cols \(1000\) elements, got 500$"),
    ({"box_rows": 257}, r"^tensor map box_rows: expected an int in \[1, 256\], got 257$"),
    ({"box_cols": 128}, r"^tensor map box_cols 128 \(256 bytes\): a 128-byte swizzle needs"),
    ({"swizzle": 16}, r"^tensor map swizzle: expected one of \(0, 32, 64, 128\) bytes, got 16$"),
    ({"rows": 0}, r"^tensor map rows: expected an int in \[1, 4294967296\], got 0$"),
])
def test_tensor_map_arguments_are_checked_before_the_driver(kwargs: dict[str, int], message: str) -> None:
    args = {"address": 0x10000, "rows": 64, "cols": 1000, "row_stride": 1000, "box_rows": 64, "box_cols": 64,
            "swizzle": 128} | kwargs
    with pytest.raises(BadArgumentError, match=message):
        check_2d_bf16(**args)


# -- tuning table ----------------------------------------------------------------------------------


def test_tuning_table_ids_are_valid_instantiations() -> None:
    assert TUNING.TABLE, "empty tuning table"
    for shape, (kernel_id, splits) in TUNING.TABLE.items():
        G.GemmConfig.from_id(kernel_id)  # raises if the id or the instantiation is invalid
        assert 1 <= splits <= 16, (shape, splits)
        assert all(isinstance(x, int) and x >= 1 for x in shape), shape


def test_tuning_table_names_only_ids_in_the_manifest() -> None:
    path = Path(os.environ.get("CUBINSTORE_TEST_MANIFEST", "bazel-bin/kernels/manifest.json"))
    path = path if path.is_absolute() else ROOT / path
    if not path.is_file():
        pytest.skip(f"no manifest at {path}: run `bazel build //kernels:all` or set CUBINSTORE_TEST_MANIFEST")
    manifest = Manifest.from_path(path)
    if not manifest.find("gemm"):
        pytest.skip(f"manifest {path} has no gemm kernels yet")
    missing = sorted({kid for kid, _ in TUNING.TABLE.values()} - {k.id for k in manifest.find("gemm")})
    assert not missing, f"tuning table names kernels not in {path}: {missing}"
    for kernel_id, _ in TUNING.TABLE.values():
        assert tuple(manifest.by_id(kernel_id).entries[G.ENTRY]) == G.ENTRY_TYPES


def test_lookup_returns_the_exact_entry_and_the_nearest_otherwise() -> None:
    # Entries differ by at least 2x in some dimension (log2 distance >= 1); a shape
    # 10% off in every dimension (distance 3 * log2(1.1) = 0.41) is nearest to its own.
    for shape, value in TUNING.TABLE.items():
        assert TUNING.lookup(*shape) == value
        near = tuple(max(1, round(x * 1.1)) for x in shape)
        assert TUNING.lookup(*near) == value, (shape, near)


# -- what repeat calls reuse -----------------------------------------------------------------------


def _packed_bytes(packed: PackedArgs, types: tuple[str, ...]) -> bytes:
    """The bytes `pack_args` laid out, from parameter 0's slot on."""
    _, _, total = _args._plan("gemm/x", G.ENTRY, types)
    start = packed.pointers[0] - ctypes.addressof(packed.buffer)  # type: ignore[index]
    return bytes(packed.buffer)[start : start + total]


def test_reused_argument_buffer_packs_the_bytes_pack_args_gives() -> None:
    maps = [TensorMap(bytes([i]) * 128) for i in (1, 2, 3, 4, 5, 6)]
    buffer = ArgBuffer("gemm/x", G.ENTRY, G.ENTRY_TYPES, (None, None, None, None, 1000, 333, 1008, None, None, 4),
                       device=0)
    # Raw bytes and ints take the short path, TensorMap objects the full one: same bytes either way.
    for changing in [(maps[0].raw, maps[1].raw, maps[2].raw, 0x7F00_0000_0000, 0x7F00_1000_0000, 0x7F00_2000_0000),
                     (maps[3], maps[4], maps[5], 0x10, 0, 0)]:
        buffer.write(changing)
        tma_a, tma_b, tma_d, d, ws, counters = changing
        once = pack_args("gemm/x", G.ENTRY, G.ENTRY_TYPES, (tma_a, tma_b, tma_d, d, 1000, 333, 1008, ws, counters, 4),
                         device=0)
        assert buffer.raw() == _packed_bytes(once, G.ENTRY_TYPES)


@pytest.mark.parametrize(("changing", "message"), [
    ((b"\0" * 127, b"\0" * 128, b"\0" * 128, 0, 0, 0),
     r"^kernel 'gemm/x' entry 'gemm_bf16_tn' parameter 0: expected tensormap of 128 bytes"),
    ((b"\0" * 128, b"\0" * 128, b"\0" * 64, 0, 0, 0),
     r"^kernel 'gemm/x' entry 'gemm_bf16_tn' parameter 2: expected tensormap of 128 bytes"),
    ((b"\0" * 128, b"\0" * 128, b"\0" * 128, -1, 0, 0),
     r"^kernel 'gemm/x' entry 'gemm_bf16_tn' parameter 3: expected ptr in \[0, 2\*\*64\)"),
    ((b"\0" * 128, b"\0" * 128, b"\0" * 128, 0, 0.5, 0),
     r"^kernel 'gemm/x' entry 'gemm_bf16_tn' parameter 7: expected ptr, got float"),
    ((b"\0" * 128, b"\0" * 128, b"\0" * 128, 0, 0), r"^kernel 'gemm/x' entry 'gemm_bf16_tn': expected 6 changing arguments"),
])
def test_reused_argument_buffer_checks_each_changing_argument(changing: tuple[object, ...], message: str) -> None:
    buffer = ArgBuffer("gemm/x", G.ENTRY, G.ENTRY_TYPES, (None, None, None, None, 8, 8, 8, None, None, 1), device=0)
    with pytest.raises(BadArgumentError, match=message):
        buffer.write(changing)


def test_reused_argument_buffer_checks_fixed_arguments_once() -> None:
    with pytest.raises(BadArgumentError, match=r"^kernel 'gemm/x' entry 'gemm_bf16_tn' parameter 4: expected i32 in"):
        ArgBuffer("gemm/x", G.ENTRY, G.ENTRY_TYPES, (None, None, None, None, 2**31, 8, 8, None, None, 1), device=0)


class _H200Driver:
    """The driver as the device cache asks it, answering as an H200 would; no GPU needed."""

    def device_count(self) -> int:
        return 1

    def device_attribute(self, ordinal: int, name: str) -> int:
        assert ordinal == 0
        return {"CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": 132}[name]


@pytest.fixture
def h200() -> Any:
    """Device facts from `_H200Driver` for the test, then the real ones again."""
    before = device.use(device.Devices(_H200Driver()))
    yield
    device.use(before)


def test_selection_is_made_once_per_shape_and_library(tmp_path: Path, h200: None) -> None:
    library = ops_launch.open(write_gemm_manifest(tmp_path / "m.json", G.GemmConfig(128, 256, 64, 4, 1),
                                                  "sha256:" + "ab" * 32))
    before = G.cache_misses()["selection"]
    first = G.select(library, 0, 777, 4096, 4096)
    assert [G.select(library, 0, 777, 4096, 4096) for _ in range(3)] == [first] * 3
    assert G.cache_misses()["selection"] == before + 1
    G.select(library, 0, 778, 4096, 4096)  # another shape is another choice
    G.select(ops_launch.open(library.manifest), 0, 777, 4096, 4096)  # and so is another library
    assert G.cache_misses()["selection"] == before + 3
    # and so are the copies another layout makes (K off 8, contiguous: a tile copies A and B), once each
    a, b = (G.Operand(name, "bfloat16", (rows, 4095), (4095, 1), "cuda:0", 0)
            for name, rows in (("a", 777), ("b", 4096)))
    copies = (G.copies_of(G.staging(a, b, None), 777, 4096, 4095), G.NO_COPIES)
    for _ in range(2):
        G.select(library, 0, 777, 4096, 4095)
        G.select(library, 0, 777, 4096, 4095, copies)
    assert G.cache_misses()["selection"] == before + 5


def test_candidates_are_the_librarys_sm90a_gemm_ids(tmp_path: Path) -> None:
    cfg = G.GemmConfig(128, 128, 64, 5, 2)
    library = ops_launch.open(write_gemm_manifest(tmp_path / "m.json", cfg, "sha256:" + "cd" * 32))
    assert G.candidates(library) == frozenset({cfg.kernel_id})
    assert G.candidates(library) is G.candidates(library)  # computed once
