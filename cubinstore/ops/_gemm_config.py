"""The instantiations ``ops.gemm`` launches, their launch plans, and its operand checks.

``GemmConfig`` is one instantiation of ``kernels/gemm/sm90_bf16_gemm.cu`` (a tile, pipeline depth,
cluster size, operand swap, and for family ``gemm_kc`` the CTAs a tile's K is shared by), ``SkinnyConfig`` one of ``kernels/skinny/sm90_bf16_skinny.cu``;
each computes its launch contract (block, shared memory, TMA boxes; see the families'
README.md). ``plan`` turns an instantiation, a problem and a K-split into a grid;
``check_operands`` validates A, B and D as ``Operand`` descriptions. Pure Python: no CUDA and
no torch, so CPU-only CI tests all of it, and the selection model (``_gemm_model``) plans with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from cubinstore._core import abi
from cubinstore.errors import BadArgumentError

__all__ = [
    "ARCH",
    "ENTRY",
    "ENTRY_TYPES",
    "FAMILIES",
    "FAMILY",
    "GemmConfig",
    "KC_FAMILY",
    "KC_KEYS",
    "KEYS",
    "MAX_SPLITS",
    "Operand",
    "Plan",
    "SKINNY_ANY_FAMILY",
    "SKINNY_ENTRY",
    "SKINNY_ENTRY_TYPES",
    "SKINNY_FAMILY",
    "SKINNY_KEYS",
    "STREAM_K",
    "SkinnyConfig",
    "check_operands",
    "config_of",
    "entry_of",
    "l2_promotion",
    "plan",
    "stores_by_tma",
]

FAMILY: Final = "gemm"
ENTRY: Final = "gemm_bf16_tn"
#: tma_a, tma_b, tma_d, d, m, n, k, workspace, counters, splits
ENTRY_TYPES: Final = ("tensormap", "tensormap", "tensormap", "ptr", "i32", "i32", "i32", "ptr", "ptr", "i32")
ARCH: Final = "sm_90a"

_WARPGROUP: Final = 128  # threads
_SWIZZLE_BYTES: Final = 128
_SWIZZLE_ELEMS: Final = 64  # bf16 elements in one 128-byte swizzle row
_L2_LINE_BYTES: Final = 128
_D_BOX: Final = (64, _SWIZZLE_ELEMS)  # (rows, cols) of the box each consumer stages D through
_D_BOX_BYTES: Final = _D_BOX[0] * _D_BOX[1] * 2  # bf16
_NO_MAP: Final = bytes(128)  # tma_d when D is not stored by TMA (the kernel never reads it)
_MAX_SMEM: Final = 232448  # sm_90 opt-in limit per block (227 KiB)
_I32_MAX: Final = 2**31 - 1
#: The most K splits `plan` takes (it clamps to this).
MAX_SPLITS: Final = 16
#: `splits` value that asks for stream-K: the last one to two waves of tiles dealt out as equal
#: ranges of K blocks (see kernels/gemm/README.md).
STREAM_K: Final = 0
#: The gemm grid's keys, in the order its ids render them.
KEYS: Final = ("bm", "bn", "bk", "stages", "cluster", "swap")
#: The same kernel with its CLUSTER_K define (kernels/gemm/README.md, "A K split inside a cluster"):
#: the `kcluster` CTAs of a cluster share one tile's K blocks and add their partials through
#: distributed shared memory. A family of its own, so no `gemm` id changes; no B multicast, no swap.
KC_FAMILY: Final = "gemm_kc"
KC_KEYS: Final = ("bm", "bn", "bk", "stages", "kcluster")

SKINNY_FAMILY: Final = "skinny"
#: The skinny kernel reading rows at any element address (kernels/skinny/README.md, "Rows at any
#: address"): run in place of the selected skinny point where its operands' rows are off 16 bytes.
SKINNY_ANY_FAMILY: Final = "skinny_any"
SKINNY_ENTRY: Final = "skinny_bf16_tn"
#: a, b, d, m, n, k, lda, ldb
SKINNY_ENTRY_TYPES: Final = ("ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32")
#: The kernel families ops.gemm's selection model chooses among (skinny_any stands in for a
#: chosen skinny point; it is never weighed itself).
FAMILIES: Final = (FAMILY, KC_FAMILY, SKINNY_FAMILY)
#: The skinny grid's keys, in the order its ids render them.
SKINNY_KEYS: Final = ("bm", "bn", "warps", "unroll")
_SKINNY_CHUNK: Final = 32  # K elements a warp multiplies per chunk (two m16n8k16 mmas)
_SKINNY_THREADS_PER_SM: Final = 512  # resident on an SM at least (kernels/skinny/README.md)
_SKINNY_ANY_THREADS_PER_SM: Final = 256  # skinny_any: one CTA of 8 warps at least (up to 153 registers)


@dataclass(frozen=True)
class GemmConfig:
    """One instantiation of ``kernels/gemm/sm90_bf16_gemm.cu`` and its launch contract.

    ``swap = 1``: the kernel is given B as its A and A as its B (its m is the caller's N, its
    n the caller's M) and stores D transposed, so ``bn`` (any multiple of 8 up to 256) runs
    along the caller's M: few or odd rows of A pad to less.

    ``kcluster`` 2 or 4 (family ``gemm_kc``): clusters of that many CTAs, each taking an equal
    share of one tile's K blocks; the first adds the others' fp32 partials, which they store into
    its shared memory, and stores D. It takes no split (the cluster is the split) and needs
    ``cluster`` 1 and ``swap`` 0.
    """

    bm: int
    bn: int
    bk: int
    stages: int
    cluster: int
    swap: int = 0
    kcluster: int = 1

    def __post_init__(self) -> None:
        problems = []
        if self.bm not in (64, 128, 256):
            problems.append(f"bm {self.bm} not in (64, 128, 256)")
        if self.swap not in (0, 1):
            problems.append(f"swap {self.swap} not in (0, 1)")
        elif self.swap and not (self.bn % 8 == 0 and 8 <= self.bn <= 256):
            problems.append(f"bn {self.bn} with swap 1: expected a multiple of 8 up to 256")
        elif not self.swap and self.bn not in (64, 128, 192, 256):
            problems.append(f"bn {self.bn} not in (64, 128, 192, 256)")
        if self.bk not in (64, 128):
            problems.append(f"bk {self.bk} not in (64, 128)")
        if self.cluster not in (1, 2, 4):
            problems.append(f"cluster {self.cluster} not in (1, 2, 4)")  # every bn above splits into 4 equal slices
        if self.kcluster not in (1, 2, 4):
            problems.append(f"kcluster {self.kcluster} not in (1, 2, 4)")
        elif self.kcluster > 1 and (self.cluster != 1 or self.swap):
            problems.append(f"kcluster {self.kcluster}: expected cluster 1 and swap 0, "
                            f"got cluster {self.cluster} and swap {self.swap}")
        if self.stages < 2:
            problems.append(f"stages {self.stages} < 2")
        if self.bm // 128 * self.bn // 2 > 128:
            problems.append(f"accumulators of a {self.bm}x{self.bn} tile exceed 128 registers per thread")
        if not problems and self.smem_bytes > _MAX_SMEM:
            problems.append(f"shared memory {self.smem_bytes} > {_MAX_SMEM} bytes")
        if problems:
            raise BadArgumentError(f"invalid {self.family} instantiation {self.params}: {'; '.join(problems)}")

    @classmethod
    def from_id(cls, kernel_id: str) -> GemmConfig:
        if isinstance(kernel_id, str) and kernel_id.startswith(KC_FAMILY + "/"):
            params = _int_params(kernel_id, KC_FAMILY, KC_KEYS)
            if params is None:
                raise BadArgumentError(f"invalid gemm_kc kernel id {kernel_id!r}: expected "
                                       "'gemm_kc/bm<M>/bn<N>/bk<K>/stages<S>/kcluster<2|4>/sm_90a'")
            if params["kcluster"] == 1:  # that instantiation is the gemm family's, under its own id
                raise BadArgumentError(f"invalid gemm_kc kernel id {kernel_id!r}: expected kcluster 2 or 4")
            return cls(cluster=1, swap=0, **params)
        params = _int_params(kernel_id, FAMILY, KEYS)
        if params is None:
            raise BadArgumentError(
                f"invalid gemm kernel id {kernel_id!r}: expected "
                "'gemm/bm<M>/bn<N>/bk<K>/stages<S>/cluster<C>/swap<0|1>/sm_90a'"
            )
        return cls(**params)

    @property
    def family(self) -> str:
        return KC_FAMILY if self.kcluster > 1 else FAMILY

    @property
    def params(self) -> dict[str, int]:
        """Manifest params, in grid order (its family's keys)."""
        return {key: getattr(self, key) for key in (KC_KEYS if self.kcluster > 1 else KEYS)}

    @property
    def kernel_id(self) -> str:
        return abi.kernel_id(self.family, self.params, ARCH)

    @property
    def defines(self) -> tuple[str, ...]:
        """nvcc ``-D`` flags of this instantiation (CLUSTER_K only where it is above 1, as the BUILD's are)."""
        flags = (f"-DBM={self.bm}", f"-DBN={self.bn}", f"-DBK={self.bk}",
                 f"-DSTAGES={self.stages}", f"-DCLUSTER_M={self.cluster}", f"-DSWAP={self.swap}")
        return (*flags, f"-DCLUSTER_K={self.kcluster}") if self.kcluster > 1 else flags

    @property
    def cluster_ctas(self) -> int:
        """CTAs a cluster: ``cluster`` along M (sharing B) times ``kcluster`` along K (the kernel's kClusterSize)."""
        return self.cluster * self.kcluster

    def k_share(self, kblocks: int) -> int:
        """K blocks of a tile the busiest CTA of its cluster takes (all of them where kcluster is 1)."""
        return -(-kblocks // self.kcluster)

    def kernel_dims(self, m: int, n: int) -> tuple[int, int]:
        """The kernel's (m, n) for the caller's M x N: swapped when ``swap`` is 1."""
        return (n, m) if self.swap else (m, n)

    @property
    def d_box(self) -> tuple[int, int]:
        """(rows, cols) of D that one TMA store writes: a 64 x 64 box, or, swapped, the tile's BN rows of D by 64."""
        return (self.bn, _SWIZZLE_ELEMS) if self.swap else _D_BOX

    @property
    def d_boxes(self) -> int:
        """D staging boxes a consumer (the kernel's kDBoxes): two where they fit and a consumer's
        rows of a tile make an even number of boxes, else one (always one when swapped)."""
        if self.swap:
            return 1
        boxes_a_tile = (self.bm // self.consumers // _D_BOX[0]) * (self.bn // _D_BOX[1])
        fits = self._fixed_smem_bytes + 2 * self.consumers * _D_BOX_BYTES <= _MAX_SMEM
        return 2 if fits and boxes_a_tile % 2 == 0 else 1

    @property
    def _fixed_smem_bytes(self) -> int:
        return 1024 + self.stages * (self.bm + self.bn) * self.bk * 2 + 2 * self.stages * 8 + self.partials_bytes

    @property
    def partials_bytes(self) -> int:
        """kcluster above 1: the peers' fp32 partials (one BM x BN buffer each) and two mbarriers (kRedBytes)."""
        return (self.kcluster - 1) * self.bm * self.bn * 4 + 16 if self.kcluster > 1 else 0

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: alignment slack, the stage ring, two mbarriers a stage, the peers'
        partials (kcluster above 1), the D boxes."""
        box_bytes = self.d_box[0] * self.d_box[1] * 2  # bf16
        return self._fixed_smem_bytes + self.d_boxes * self.consumers * box_bytes

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: one for BM = 64, else two."""
        return 1 if self.bm == 64 else 2

    @property
    def threads(self) -> int:
        """Block size: one producer warpgroup and the consumers."""
        return _WARPGROUP * (self.consumers + 1)

    @property
    def box_a(self) -> tuple[int, int]:
        """(rows, cols) of one TMA box of the kernel's A (the caller's B when swapped)."""
        return self.bm, _SWIZZLE_ELEMS

    @property
    def box_b(self) -> tuple[int, int]:
        """(rows, cols) of one TMA box of the kernel's B (the caller's A when swapped): each CTA of
        a cluster loads (and multicasts) a slice."""
        return self.bn // self.cluster, _SWIZZLE_ELEMS


@dataclass(frozen=True)
class SkinnyConfig:
    """One instantiation of ``kernels/skinny/sm90_bf16_skinny.cu`` and its launch contract.

    A CTA computes BM rows by BN columns of D over the whole of K: its warps take K's chunks
    of 32 in turn, each loading `unroll` chunks at once, and add up in shared memory. With
    `any_rows` (family ``skinny_any``), rows may start at any element address.
    """

    bm: int
    bn: int
    warps: int
    unroll: int
    any_rows: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.bm not in (16, 32):
            problems.append(f"bm {self.bm} not in (16, 32)")
        if self.bn not in (8, 16, 32):
            problems.append(f"bn {self.bn} not in (8, 16, 32)")
        if self.warps not in (8, 16):
            problems.append(f"warps {self.warps} not in (8, 16)")
        if self.unroll not in (1, 2, 4, 8):
            problems.append(f"unroll {self.unroll} not in (1, 2, 4, 8)")
        if self.any_rows and self.warps != 8:
            problems.append(f"warps {self.warps}: skinny_any points have 8")
        if problems:
            raise BadArgumentError(f"invalid {self.family} instantiation {self.params}: {'; '.join(problems)}")

    @classmethod
    def from_id(cls, kernel_id: str) -> SkinnyConfig:
        any_rows = isinstance(kernel_id, str) and kernel_id.startswith(SKINNY_ANY_FAMILY + "/")
        family = SKINNY_ANY_FAMILY if any_rows else SKINNY_FAMILY
        params = _int_params(kernel_id, family, SKINNY_KEYS)
        if params is None:
            raise BadArgumentError(
                f"invalid skinny kernel id {kernel_id!r}: expected '{family}/bm<M>/bn<N>/warps<W>/unroll<U>/sm_90a'"
            )
        return cls(**params, any_rows=any_rows)

    @property
    def family(self) -> str:
        return SKINNY_ANY_FAMILY if self.any_rows else SKINNY_FAMILY

    @property
    def params(self) -> dict[str, int]:
        """Manifest params, in grid order."""
        return {"bm": self.bm, "bn": self.bn, "warps": self.warps, "unroll": self.unroll}

    @property
    def kernel_id(self) -> str:
        return abi.kernel_id(self.family, self.params, ARCH)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def ctas_per_sm(self) -> int:
        """CTAs an SM holds at least: 512 threads (the kernel uses at most 128 registers a thread; a GPU test
        checks), or for skinny_any 256 (one CTA)."""
        return (_SKINNY_ANY_THREADS_PER_SM if self.any_rows else _SKINNY_THREADS_PER_SM) // self.threads

    @property
    def k_step(self) -> int:
        """K elements the CTA's warps load in one batch (`unroll` chunks each)."""
        return _SKINNY_CHUNK * self.warps * self.unroll

    @property
    def max_k(self) -> int:
        """The largest K it takes: its K offsets run up to two batches past K, in int32."""
        return _I32_MAX - 2 * self.k_step

    @property
    def batch_bytes(self) -> int:
        """Bytes of B one batch of the CTA loads: `bn` rows of `k_step` bf16."""
        return self.bn * self.k_step * 2


def _int_params(kernel_id: object, family: str, keys: tuple[str, ...]) -> dict[str, int] | None:
    """The params of an sm_90a id of `family` (`abi.parse_kernel_id`), each a non-negative int; else None."""
    try:
        params, arch = abi.parse_kernel_id(kernel_id, family, keys)
    except BadArgumentError:
        return None
    if str(arch) != ARCH or not all(type(v) is int and v >= 0 for v in params.values()):
        return None
    return params  # type: ignore[return-value]


def _is_skinny(kernel_id: str) -> bool:
    return isinstance(kernel_id, str) and kernel_id.startswith((SKINNY_FAMILY + "/", SKINNY_ANY_FAMILY + "/"))


def config_of(kernel_id: str) -> GemmConfig | SkinnyConfig:
    """The instantiation an ops.gemm kernel id names, of either family."""
    return SkinnyConfig.from_id(kernel_id) if _is_skinny(kernel_id) else GemmConfig.from_id(kernel_id)


def entry_of(kernel_id: str) -> tuple[str, tuple[str, ...]]:
    """The entry an ops.gemm kernel id launches, and its parameter types."""
    if _is_skinny(kernel_id):
        return SKINNY_ENTRY, SKINNY_ENTRY_TYPES
    return ENTRY, ENTRY_TYPES


@dataclass(frozen=True)
class Plan:
    """How one problem is launched: the instantiation, the K-split (or stream-K) and the grid."""

    config: GemmConfig | SkinnyConfig
    splits: int  # K splits, or STREAM_K (a skinny point: 1)
    tiles_m: int  # tiles along the kernel's m (the caller's N when the config is swapped)
    tiles_n: int
    units: int  # work units: cluster tiles x splits (stream-K: cluster tiles)
    grid: int

    @property
    def stream_k(self) -> bool:
        return self.splits == STREAM_K

    @property
    def workspace_floats(self) -> int:
        """fp32 partials: split-K one BM x BN block per (tile, split but the last), stream-K one per CTA; else 0."""
        block = self.config.bm * self.config.bn
        if self.stream_k:
            return self.grid * block
        return self.tiles_m * self.tiles_n * (self.splits - 1) * block

    @property
    def counters(self) -> int:
        """int32 counters of split-K and stream-K, one a tile: its published partials (zero between launches); else 0."""
        return 0 if self.splits == 1 else self.tiles_m * self.tiles_n


def l2_promotion(row_stride: int) -> str:
    """The L2 promotion of a ``gemm`` tensor map over bf16 rows ``row_stride`` elements apart.

    256 bytes where the rows are 128-byte multiples apart; 128 where they are not. Off the lines
    each 128-byte box row spans two of them, and promoting its reads to 256 bytes took up to 9%
    longer (H100, 2026-12-07: 1000x3000x2008 28.7 against 26.6 us); on the lines the two were as
    fast (kernels/gemm/README.md). The stride decides, not the address: one map encoder serves
    every address of a signature (and torch's allocations start on 512 bytes).
    """
    return "256B" if row_stride * 2 % _L2_LINE_BYTES == 0 else "128B"  # bf16


def stores_by_tma(n: int, address: int) -> bool:
    """Whether the kernel stores D (N columns, at `address`) through TMA, and so reads `tma_d`.

    The kernel's rule (kernels/gemm/README.md): rows of a multiple of 16 bytes and a 16-byte
    aligned start, which a tensor map needs; otherwise it stores D itself, an element at a time.
    """
    return n % 8 == 0 and address % 16 == 0


def plan(m: int, n: int, k: int, sm_count: int, kernel_id: str, splits: int, *,
         max_clusters: int | None = None) -> Plan:
    """The launch of `kernel_id` for an M x N x K problem on a GPU of `sm_count` SMs.

    `splits` is STREAM_K, or clamped to [1, number of K blocks] (and to 16); a gemm_kc point takes
    none (`splits` must be 1: its cluster shares each tile's K). The grid is
    persistent: at most one CTA per SM, a multiple of the cluster size, and at most
    `max_clusters` clusters (the device's co-resident count, `Kernel.max_active_clusters`: a
    cluster must fit in one GPC, so it may be below SMs / cluster; None: no such cap); with
    stream-K at most one cluster per K block of the problem. A swapped gemm point tiles N x M
    (its m is N). A skinny point takes no split (`splits` must be 1) and launches one CTA per
    BM x BN block of D, N's blocks fastest.
    """
    config = config_of(kernel_id)
    for name, value in (("m", m), ("n", n), ("k", k)):
        if not 1 <= value <= _I32_MAX:
            raise BadArgumentError(f"gemm {name}: expected 1 <= {name} <= {_I32_MAX}, got {value}")
    if isinstance(config, SkinnyConfig):
        return _skinny_plan(m, n, k, config, kernel_id, splits)
    size = config.cluster_ctas
    if sm_count < size:
        raise BadArgumentError(f"gemm: {sm_count} SMs cannot hold a cluster of {size}")
    if config.kcluster > 1 and int(splits) != 1:
        raise BadArgumentError(f"gemm: kernel {kernel_id} takes no K split (its cluster shares each tile's K): "
                               f"expected splits 1, got {splits}")
    if max_clusters is not None and (isinstance(max_clusters, bool) or not isinstance(max_clusters, int)
                                     or max_clusters < 1):
        raise BadArgumentError(f"gemm: kernel {kernel_id} max_clusters: expected a positive int (the clusters "
                               f"the device holds at once), got {max_clusters!r}")
    m, n = config.kernel_dims(m, n)
    kblocks = -(-k // config.bk)
    splits = int(splits)
    if splits != STREAM_K:
        splits = max(1, min(splits, kblocks, MAX_SPLITS))
    tiles_m = -(-m // config.bm)
    tiles_n = -(-n // config.bn)
    cluster_tiles = -(-tiles_m // config.cluster) * tiles_n
    units = cluster_tiles * max(splits, 1)
    if units > _I32_MAX or tiles_m * tiles_n * max(splits, 1) * config.bm * config.bn > 2**40:
        raise BadArgumentError(f"gemm {m}x{n}x{k}: too many tiles for kernel {kernel_id} ({units} work units)")
    # Stream-K deals out K blocks: more clusters than the problem has would idle.
    work = cluster_tiles * kblocks if splits == STREAM_K else units
    clusters = min(work, sm_count // size, max_clusters or work)
    return Plan(config, splits, tiles_m, tiles_n, units, clusters * size)


def _skinny_plan(m: int, n: int, k: int, config: SkinnyConfig, kernel_id: str, splits: int) -> Plan:
    if int(splits) != 1:
        raise BadArgumentError(f"gemm: kernel {kernel_id} takes no K split: expected splits 1, got {splits}")
    if k > config.max_k:
        raise BadArgumentError(f"gemm K = {k}: kernel {kernel_id} expects K <= {config.max_k}")
    tiles_m, tiles_n = -(-m // config.bm), -(-n // config.bn)
    if tiles_m * tiles_n > _I32_MAX:
        raise BadArgumentError(f"gemm {m}x{n}: too many CTAs for kernel {kernel_id} ({tiles_m * tiles_n})")
    return Plan(config, 1, tiles_m, tiles_n, tiles_m * tiles_n, tiles_m * tiles_n)


# -- operand checks (pure Python, so CPU-only CI can test them) -------------------------------------


@dataclass(frozen=True)
class Operand:
    """What `gemm` needs to know about one tensor, read off it once."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    device: str  # "cuda:0", "cpu", ...
    address: int


def _check_matrix(op: Operand) -> None:
    if op.dtype != "bfloat16":
        raise BadArgumentError(f"gemm {op.name}: expected dtype bfloat16, got {op.dtype}")
    if len(op.shape) != 2:
        raise BadArgumentError(f"gemm {op.name}: expected a 2-D tensor, got {len(op.shape)}-D shape {op.shape}")


def check_operands(a: Operand, b: Operand, out: Operand | None) -> tuple[int, int, int]:
    """Validate A (M x K), B (N x K) and an optional D (M x N); return (M, N, K).

    Raises `BadArgumentError` naming the operand and what was expected: dtypes, ranks, shapes,
    sizes and devices. Strides, offsets and K take no part: any layout torch.mm takes is valid,
    and `_gemm_staging` decides which operands a launch copies.
    """
    _check_matrix(a)
    _check_matrix(b)
    m, k = a.shape
    n, kb = b.shape
    if kb != k:
        raise BadArgumentError(
            f"gemm: a is {m}x{k} and b is {n}x{kb}: expected the same K (b is N x K, D = a @ b.T)"
        )
    for name, value in (("M", m), ("N", n), ("K", k)):
        if value > _I32_MAX:
            raise BadArgumentError(f"gemm: {name} = {value}: expected at most {_I32_MAX}")
    if out is not None:
        _check_matrix(out)
        if out.shape != (m, n):
            raise BadArgumentError(f"gemm out: expected shape ({m}, {n}), got {out.shape}")
    for op in (a, b, out):
        if op is None:
            continue
        if not op.device.startswith("cuda"):
            raise BadArgumentError(f"gemm {op.name}: expected a CUDA tensor, got one on {op.device}")
    devices = {op.device for op in (a, b, out) if op is not None}
    if len(devices) > 1:
        raise BadArgumentError(f"gemm: expected a, b and out on one device, got {', '.join(sorted(devices))}")
    return m, n, k
