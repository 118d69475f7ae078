"""The eager launch of ``ops.gemm``: D = A @ B.T in bf16 on Hopper through the ``gemm`` and ``skinny`` families.

A is M x K and B is N x K, bf16, on one CUDA device of compute capability 9.0,
in any layout torch.mm takes (strides, offsets, any K); D is M x N, bf16, computed
with fp32 accumulation. Operands the kernels cannot read where they lie (rows not
contiguous, row strides off 16 bytes, starts off 16 bytes) are copied inside the launch,
and a D they cannot store into is computed apart and copied in (``_gemm_staging.py``
decides; docs/gemm.md measures). The instantiation (a ``gemm`` tile, pipeline depth and
cluster size with its K-split, or a ``skinny`` point for few rows of A) comes from the
selection model in ``_gemm_model.py``, once per shape; a ``skinny`` point whose B has rows
off 16 bytes gives way to the ``skinny_any`` point of its BM and BN, which reads them in
place (``reads``).

The kernels come from the library set with ``cubinstore.ops.set_library``
(see ``cubinstore/ops/_library.py``). The launch contracts (grid, block,
cluster, shared memory, tensor maps, split-K workspace) are the ones documented
in ``kernels/gemm/README.md`` and ``kernels/skinny/README.md``; ``GemmConfig`` and
``SkinnyConfig`` (``_gemm_config.py``) compute them. ``run`` is the launch; ``_gemm_op`` decides
between it and the torch op.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from cubinstore._core.log import get_logger
from cubinstore._driver import device as _device
from cubinstore.errors import BadArgumentError, KernelNotFoundError
from cubinstore.ops._gemm_config import (
    ARCH,
    ENTRY,
    ENTRY_TYPES,
    FAMILIES,
    FAMILY,
    KC_FAMILY,
    KC_KEYS,
    KEYS,
    MAX_SPLITS,
    SKINNY_ANY_FAMILY,
    SKINNY_ENTRY,
    SKINNY_ENTRY_TYPES,
    SKINNY_FAMILY,
    SKINNY_KEYS,
    STREAM_K,
    GemmConfig,
    Operand,
    Plan,
    SkinnyConfig,
    check_operands,
    config_of,
    entry_of,
    l2_promotion,
    plan,
    stores_by_tma,
)
from cubinstore.ops._gemm_staging import NO_COPIES, Copies, Feed, Staging, copies_of, skinny_staging, staging
from cubinstore.ops._library import get_library

if TYPE_CHECKING:
    from cubinstore.launch import Kernel, Library, PreparedLaunch

__all__ = [
    "any_rows_points",
    "cache_misses",
    "candidates",
    "cluster_slots",
    "copies_for",
    "layout_copies",
    "reads",
    "run",
    "select",
    "sm_count",
    # Defined in _gemm_config; this module launches them, and tests and benchmarks reach them here.
    "ARCH",
    "ENTRY",
    "ENTRY_TYPES",
    "FAMILIES",
    "FAMILY",
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
    "GemmConfig",
    "SkinnyConfig",
    "check_operands",
    "config_of",
    "entry_of",
    "l2_promotion",
    "plan",
    "stores_by_tma",
]

logger = get_logger(__name__)

_NO_MAP: Final = bytes(128)  # tma_d when D is not stored by TMA (the kernel never reads it)
_SWIZZLE_BYTES: Final = 128


def _describe(name: str, tensor: Any) -> Operand:
    if type(tensor).__module__.split(".")[0] != "torch" or not hasattr(tensor, "data_ptr"):
        cls = type(tensor)
        raise BadArgumentError(f"gemm {name}: expected a torch.Tensor, got {cls.__module__}.{cls.__qualname__}")
    return Operand(
        name=name,
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=tuple(int(s) for s in tensor.shape),
        strides=tuple(int(s) for s in tensor.stride()),
        device=str(tensor.device),
        address=int(tensor.data_ptr()),
    )



# -- launch -----------------------------------------------------------------------------------------
# Everything that does not change between calls of one problem signature is computed once:
# the operand checks that depend only on dtype, shape, strides and device (the signature is
# the cache key, so a hit has passed them), which operands a launch copies (the key holds the
# alignment classes of the addresses too), the selection, the plan, the kernel, its prepared
# launch (config, function attributes, packed scalars) and the tensor-map encoders; maps are
# cached per address. A call then allocates D (and the split-K workspace), packs six
# arguments and launches.

_lock = threading.Lock()
_kernels: dict[tuple[Library, str, int], Kernel] = {}  # the library itself: an id() may be reused
_co_resident_counts: dict[tuple[Library, str, int], int] = {}  # clusters a device holds at once, per point
_cluster_slots: dict[tuple[Library, int], dict[int, int]] = {}  # ClusterSlots of a library's points, per device
# Per (device, stream): split-K and stream-K publication counters. The kernel leaves them at zero, and
# launches on one stream are ordered, so one buffer per stream is reused safely.
_counters: dict[tuple[int, int], Any] = {}
_SELECTION_CACHE: Final = 4096  # (library, device, M, N, K) entries
_CALL_CACHE: Final = 1024  # problem signatures
_MAP_CACHE: Final = 16  # addresses per operand and signature (the caching allocator recycles few)
_selections: dict[tuple[Any, ...], tuple[str, int]] = {}
_candidates: dict[Library, frozenset[str]] = {}
_any_rows_points: dict[Library, dict[tuple[int, int], str]] = {}
_calls: dict[tuple[Any, ...], _Call] = {}
# Misses of each cache since start (a hit counts nothing): tests check repeats add none.
_misses: dict[str, int] = {"selection": 0, "prepared": 0, "tensor_map": 0}
_raw_stream: Any = None  # device ordinal -> torch's current raw CUstream handle


def forget_calls() -> None:
    """Drop every prepared call: the next call of each problem signature prepares its launch again (for
    benchmarks that compare launch paths, ``cubinstore._driver.cuda.using_native_launch``)."""
    with _lock:
        _calls.clear()


def cache_misses() -> dict[str, int]:
    """How often each cache of `gemm` missed: selection, prepared (a new problem signature), tensor_map."""
    with _lock:
        return dict(_misses)


def _kernel(library: Library, kernel_id: str, device: int) -> Kernel:
    key = (library, kernel_id, device)
    with _lock:
        kernel = _kernels.get(key)
    if kernel is None:
        kernel = library.kernel(kernel_id, device=device)
        entry, expected = entry_of(kernel_id)
        types = tuple(kernel.spec.entries.get(entry, ()))
        if types != expected:
            raise KernelNotFoundError(
                f"kernel {kernel_id!r} ({kernel.spec.digest}): expected entry {entry} with parameters "
                f"{list(expected)}, the manifest declares {list(types) if types else 'no such entry'}"
            )
        with _lock:
            _kernels[key] = kernel
    return kernel


def _co_resident(library: Library, kernel: Kernel, kernel_id: str, device: int) -> int | None:
    """The clusters of a gemm point the device holds at once (cached); None for one not launched in clusters."""
    config = config_of(kernel_id)
    if isinstance(config, SkinnyConfig) or config.cluster_ctas == 1:
        return None
    key = (library, kernel_id, device)
    count = _co_resident_counts.get(key)
    if count is None:
        count = kernel.max_active_clusters(ENTRY, grid=(config.cluster_ctas, 1, 1), block=(config.threads, 1, 1),
                                           shared_mem=config.smem_bytes)
        if count < 1:
            raise BadArgumentError(f"gemm: device {device} cannot hold one cluster of kernel {kernel_id} "
                                   f"({config.cluster_ctas} CTAs of {config.smem_bytes} bytes of shared memory)")
        with _lock:
            _co_resident_counts[key] = count
    return count


def sm_count(device: int) -> int:
    """Multiprocessor count of `device` (the driver's, asked once: `cubinstore._driver.device`)."""
    return _device.sm_count(device)


def candidates(library: Library) -> frozenset[str]:
    """The ids of the library's gemm and skinny kernels for sm_90a: what the selection may choose from (cached)."""
    cached = _candidates.get(library)
    if cached is not None:
        return cached
    ids = frozenset(_ids(library, FAMILIES))
    with _lock:
        return _candidates.setdefault(library, ids)


def _ids(library: Library, families: tuple[str, ...]) -> list[str]:
    """The ids of the library's sm_90a kernels of `families`."""
    return [spec.id for family in families for spec in library.manifest.find(family) if spec.arch == ARCH]


def cluster_slots(library: Library, device: int) -> dict[int, int]:
    """The clusters of each size (above 1) among the library's gemm points that `device` holds at
    once (cached): the selection model's ClusterSlots. Asked of the driver with the first point of
    each size (every gemm point takes one CTA an SM, so the count is the GPCs', not the point's)."""
    key = (library, device)
    slots = _cluster_slots.get(key)
    if slots is None:
        firsts: dict[int, str] = {}
        for kernel_id in sorted(candidates(library)):
            config = config_of(kernel_id)
            if isinstance(config, GemmConfig) and config.cluster_ctas > 1:
                firsts.setdefault(config.cluster_ctas, kernel_id)
        slots = {}
        for size, kernel_id in sorted(firsts.items()):
            count = _co_resident(library, _kernel(library, kernel_id, device), kernel_id, device)
            if count is not None:  # always, for a point launched in clusters
                slots[size] = count
        with _lock:
            _cluster_slots[key] = slots
    return slots


def select(library: Library, device: int, m: int, n: int, k: int,
           copies: tuple[Copies, Copies] = (NO_COPIES, NO_COPIES)) -> tuple[str, int]:
    """(kernel id, K splits) for an M x N x K problem on `device`, chosen once per (library, device,
    M, N, K, copies); `copies`: what a `gemm` tile's launch and a `skinny` point's would copy
    (`copies_for`)."""
    key = (library, device, m, n, k, copies)
    chosen = _selections.get(key)
    if chosen is None:
        from cubinstore.ops import _gemm_model

        chosen = _gemm_model.choose(m, n, k, sm_count(device), candidates(library),
                                    cluster_slots=cluster_slots(library, device), copies=copies)
        with _lock:
            _misses["selection"] += 1
            if len(_selections) >= _SELECTION_CACHE:
                _selections.pop(next(iter(_selections)))
            _selections[key] = chosen
    return chosen


class _TensorMaps:
    """The tensor maps of one operand signature (shape, strides, box, device), by address.

    A map holds only the address and the encoder's fixed arguments, so a recycled address
    gets a map equal to a fresh encode: a cached map is never stale.
    """

    __slots__ = ("_encoder", "_maps")

    def __init__(self, encoder: Any) -> None:
        self._encoder = encoder
        self._maps: dict[int, bytes] = {}

    def get(self, address: int) -> bytes:
        raw = self._maps.get(address)
        if raw is None:
            raw = self._encoder.encode(address).raw
            with _lock:
                _misses["tensor_map"] += 1
                if len(self._maps) >= _MAP_CACHE:
                    self._maps.pop(next(iter(self._maps)))
                self._maps[address] = raw
        return raw


@dataclass(frozen=True)
class _Call:
    """What every call of one problem signature shares."""

    library: Library
    device: int
    torch_device: Any
    shape: tuple[int, int]  # of D
    plan: Plan
    # gemm: called as (stream, tma_a, tma_b, tma_d, d, workspace, counters); skinny: (stream, a, b, d)
    launch: PreparedLaunch
    maps_a: _TensorMaps | None  # None: a skinny kernel, which takes pointers; else of A as read (copied or not)
    maps_b: _TensorMaps | None
    maps_d: _TensorMaps | None  # None: N not a multiple of 8; the kernel stores D itself (pairs, or swapped elements)
    swap: bool = False  # the kernel takes B's map first (GemmConfig.swap)
    staging: Staging | None = None  # the copies a launch makes (_gemm_staging); None: every operand in place


def _counter_buffer(torch: Any, device: int, stream: int, count: int) -> Any:
    if torch.cuda.is_current_stream_capturing():
        # A graph replays what was captured, not what ran: a per-stream buffer made or used
        # during capture would be zero at replay only by luck. Give the graph its own
        # counters, zeroed by a fill captured ahead of the kernel (the kernel leaves them zero).
        return torch.zeros(count, dtype=torch.int32, device=f"cuda:{device}")
    key = (device, stream)
    with _lock:
        buf = _counters.get(key)
        if buf is None or buf.numel() < count:
            buf = torch.zeros(max(count, 1024), dtype=torch.int32, device=f"cuda:{device}")
            _counters[key] = buf
    return buf


def _stream_of(torch: Any) -> Any:
    """torch's current raw stream of a device: the private accessor torch's own compiler uses, else the public one."""
    global _raw_stream
    if _raw_stream is None:
        accessor = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = accessor if accessor is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream


_FRESH_OUT = "fresh"  # the key's `out` part for a D allocated as the fake implementation says (run's fresh_out)


def run(a: Any, b: Any, out: Any, kernel_id: str | None, splits: int | None, fresh_out: bool = False) -> Any:
    """The eager implementation of `ops.gemm_with` on real tensors (the torch op's too).

    `fresh_out`: `out` is a buffer inductor allocated for D from the op's fake implementation (M x N
    bf16, row-major, at the start of its own block on A's device), so its attributes need no reading
    on each call: its signature's first call checks it in full, as any `out`, and the launches after
    find that call by A's and B's attributes alone (`_gemm_inductor`)."""
    try:
        address_a, address_b = a.data_ptr(), b.data_ptr()
        key: tuple[Any, ...] | None = (
            a.dtype, a.device, a.shape, a.stride(), b.dtype, b.device, b.shape, b.stride(),
            None if out is None else _FRESH_OUT if fresh_out else (out.dtype, out.device, out.shape, out.stride()),
            kernel_id, splits,
            # Which operands a launch copies depends on these too (_gemm_staging): A and B start on
            # 16 bytes. (D's address does not decide its copy; whether TMA stores it is per launch.)
            address_a & 15 == 0, address_b & 15 == 0,
        )
        call = _calls.get(key)  # type: ignore[arg-type]
    except (AttributeError, TypeError):  # not tensors, or unhashable: the full checks word the error
        key, call, address_a, address_b = None, None, 0, 0
    if call is None or call.library is not get_library():
        call = _prepare(key, a, b, out, kernel_id, splits)  # checks every operand
        if call is None:  # an empty problem: done
            return out if out is not None else _empty_result(a, b)
        address_a, address_b = a.data_ptr(), b.data_ptr()
    torch = sys.modules["torch"]  # the operands are torch tensors
    if call.staging is not None:
        return _run_staged(torch, call, call.staging, a, b, out)
    if out is None:
        out = torch.empty(call.shape, dtype=torch.bfloat16, device=call.torch_device)
    _launch(torch, call, address_a, address_b, out)
    return out


def _launch(torch: Any, call: _Call, address_a: int, address_b: int, out: Any) -> None:
    """Launch `call`'s kernel on A and B at these addresses (as the kernel reads them), into `out`."""
    stream = _stream_of(torch)(call.device)
    if call.maps_a is None:  # a skinny kernel: plain pointers, no workspace
        call.launch(stream, address_a, address_b, out.data_ptr())
        return
    tma_a = call.maps_a.get(address_a)
    tma_b = call.maps_b.get(address_b)  # type: ignore[union-attr]
    if call.swap:
        tma_a, tma_b = tma_b, tma_a
    address_d, n_d = out.data_ptr(), call.shape[1]
    tma_d = call.maps_d.get(address_d) if call.maps_d is not None and stores_by_tma(n_d, address_d) else _NO_MAP
    launch = call.plan
    if launch.counters:
        workspace = torch.empty(launch.workspace_floats, dtype=torch.float32, device=call.torch_device)
        counters = _counter_buffer(torch, call.device, stream, launch.counters)
        call.launch(stream, tma_a, tma_b, tma_d, address_d, workspace.data_ptr(), counters.data_ptr())
    else:
        call.launch(stream, tma_a, tma_b, tma_d, address_d, 0, 0)


# -- layouts the kernels cannot read in place (_gemm_staging decides; docs/gemm.md measures) ----------
# Every copy is a torch op on the current stream into memory from torch's caching allocator: no host
# sync, so a CUDA graph captures it with the launch, and the allocator's stream order keeps a buffer
# from being reused before the kernel has read it.


def _copy_in(torch: Any, src: Any, feed: Feed, device: Any) -> Any:
    """`src` (rows x K) copied into fresh rows `feed.row_stride` apart (the kernels never read past K)."""
    rows, k = src.shape
    buf = torch.empty((rows, feed.row_stride), dtype=torch.bfloat16, device=device)
    buf[:, :k].copy_(src)
    return buf


def _run_staged(torch: Any, call: _Call, staging: Staging, a: Any, b: Any, out: Any) -> Any:
    """A launch with copies: A or B into rows the kernel reads, D through a fresh tensor into `out`."""
    if staging.a.copy:
        a = _copy_in(torch, a, staging.a, call.torch_device)
    if staging.b.copy:
        b = _copy_in(torch, b, staging.b, call.torch_device)
    d = out
    if out is None or staging.copy_out:
        d = torch.empty(call.shape, dtype=torch.bfloat16, device=call.torch_device)
    _launch(torch, call, a.data_ptr(), b.data_ptr(), d)
    if out is None:
        return d
    if staging.copy_out:
        out.copy_(d)
    return out


def _empty_result(a: Any, b: Any) -> Any:
    torch = sys.modules["torch"]
    m, k = a.shape
    out = torch.empty((m, b.shape[0]), dtype=torch.bfloat16, device=a.device)
    return out.zero_() if k == 0 else out


def _prepare(
    key: tuple[Any, ...] | None, a: Any, b: Any, out: Any, kernel_id: str | None, splits: int | None
) -> _Call | None:
    """Check the operands in full and build their signature's `_Call`; None for an empty problem."""
    from cubinstore.tensormap import encoder_2d_bf16

    a_op, b_op = _describe("a", a), _describe("b", b)
    out_op = None if out is None else _describe("out", out)
    m, n, k = check_operands(a_op, b_op, out_op)
    if m == 0 or n == 0 or k == 0:
        if out is not None and k == 0:
            out.zero_()
        return None
    library = get_library()
    torch = sys.modules["torch"]
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    chose = kernel_id is None
    if chose:
        kernel_id, chosen_splits = select(library, device, m, n, k, copies_for(library, a_op, b_op, out_op))
        splits = chosen_splits if splits is None else splits
    splits = 1 if splits is None else splits
    kernel_id, stage = reads(library, kernel_id, a_op, b_op, out_op, chosen=chose)
    launch = plan(m, n, k, sm_count(device), kernel_id, splits)  # checks all before anything is loaded
    kernel = _kernel(library, kernel_id, device)
    co_resident = _co_resident(library, kernel, kernel_id, device)
    if co_resident is not None and launch.grid > co_resident * launch.config.cluster_ctas:
        launch = plan(m, n, k, sm_count(device), kernel_id, splits, max_clusters=co_resident)
    cfg = launch.config
    logger.debug("gemm %dx%dx%d: %s splits=%d grid=%d%s", m, n, k, kernel_id, launch.splits, launch.grid,
                 f", copies {stage}" if stage.copies else "")
    copies = stage if stage.copies else None
    if isinstance(cfg, SkinnyConfig):
        prepared = kernel.prepare(
            SKINNY_ENTRY, grid=(launch.grid, 1, 1), block=(cfg.threads, 1, 1), shared_mem=0,
            args=(None, None, None, m, n, k, stage.a.row_stride, stage.b.row_stride),
        )
        call = _Call(library, device, torch.device("cuda", device), (m, n), launch, prepared, None, None, None,
                     staging=copies)
        return _remember(key, call)
    kernel_m, kernel_n = cfg.kernel_dims(m, n)
    prepared = kernel.prepare(
        ENTRY,
        grid=(launch.grid, 1, 1),
        block=(cfg.threads, 1, 1),
        # The cluster shape is compiled into the kernel (__cluster_dims__); none is passed here.
        shared_mem=cfg.smem_bytes,
        args=(None, None, None, None, kernel_m, kernel_n, k, None, None, launch.splits),
    )
    # Swapped, the kernel's A is the caller's B (and its B the caller's A): each gets the other's box.
    box_a, box_b = (cfg.box_b, cfg.box_a) if cfg.swap else (cfg.box_a, cfg.box_b)
    # Addresses come with each call (the operand's, or its copy's); 16, an aligned stand-in, lets
    # the encoders check the rest now.
    call = _Call(
        library, device, torch.device("cuda", device), (m, n), launch, prepared,
        _TensorMaps(encoder_2d_bf16(16, m, k, stage.a.row_stride, *box_a, swizzle=_SWIZZLE_BYTES,
                                    device=device, l2_promotion=l2_promotion(stage.a.row_stride))),
        _TensorMaps(encoder_2d_bf16(16, n, k, stage.b.row_stride, *box_b, swizzle=_SWIZZLE_BYTES,
                                    device=device, l2_promotion=l2_promotion(stage.b.row_stride))),
        _TensorMaps(encoder_2d_bf16(16, m, n, n, *cfg.d_box, swizzle=_SWIZZLE_BYTES, device=device,
                                    l2_promotion=l2_promotion(n)))
        if stores_by_tma(n, 16) else None,
        bool(cfg.swap),
        copies,
    )
    return _remember(key, call)


def reads(library: Library, kernel_id: str, a: Operand, b: Operand, out: Operand | None, *,
          chosen: bool) -> tuple[str, Staging]:
    """The kernel a launch of `kernel_id` runs and the copies it makes (`_gemm_staging`).

    A skinny point the selection `chosen` whose B has rows off 16 bytes gives way to the skinny_any
    point of its BM and BN, where the library has one, which reads B (and A) in place: copying B,
    the operand a skinny launch is bound by, costs more than skinny_any's slower loads. A's rows
    alone off 16 bytes (M <= 32 of them) are copied for the faster skinny point instead (H100,
    16x8192x28671 with B padded: 212 us copying A, 245 through skinny_any). An id the caller named
    runs as named. A bad id is a BadArgumentError before anything is loaded.
    """
    config = config_of(kernel_id)
    if not (chosen and isinstance(config, SkinnyConfig) and not config.any_rows):
        return kernel_id, staging(a, b, out, any_rows=isinstance(config, SkinnyConfig) and config.any_rows)
    twin = any_rows_points(library).get((config.bm, config.bn))
    runs_twin, stage = skinny_staging(a, b, out, has_twin=twin is not None)
    return (twin if runs_twin else kernel_id), stage  # type: ignore[return-value]


def copies_for(library: Library, a: Operand, b: Operand, out: Operand | None) -> tuple[Copies, Copies]:
    """What a `gemm` tile's launch and a `skinny` point's (its `skinny_any` twin where `reads` runs
    that) would copy for these operands: with K off 8, say, a tile copies contiguous A and B
    into rows of `padded(K)` where a skinny point's twin reads them in place."""
    (m, k), n = a.shape, b.shape[0]
    tile = copies_of(staging(a, b, out), m, n, k)
    # As for a point with a twin (kernels/skinny_any builds one for each BM and BN of kernels/skinny);
    # a library that lacks some twins has those points' copies counted short.
    _, skinny = skinny_staging(a, b, out, has_twin=bool(any_rows_points(library)))
    return tile, copies_of(skinny, m, n, k)


def layout_copies(library: Library, a: Any, b: Any, out: Any = None) -> tuple[Copies, Copies]:
    """`copies_for` of torch tensors: what their layouts make each family copy."""
    return copies_for(library, _describe("a", a), _describe("b", b), None if out is None else _describe("out", out))


def any_rows_points(library: Library) -> dict[tuple[int, int], str]:
    """The library's skinny_any kernels for sm_90a by (BM, BN), the first id of each in sorted order (cached)."""
    cached = _any_rows_points.get(library)
    if cached is not None:
        return cached
    points: dict[tuple[int, int], str] = {}
    for kernel_id in sorted(_ids(library, (SKINNY_ANY_FAMILY,))):
        config = SkinnyConfig.from_id(kernel_id)
        points.setdefault((config.bm, config.bn), kernel_id)
    with _lock:
        return _any_rows_points.setdefault(library, points)


def _remember(key: tuple[Any, ...] | None, call: _Call) -> _Call:
    if key is not None:
        with _lock:
            _misses["prepared"] += 1
            if len(_calls) >= _CALL_CACHE:
                _calls.pop(next(iter(_calls)))
            _calls[key] = call
    return call
