"""A validated manifest's lookups: the index of its kernels (by id, by id without arch, by family
and params), arch compatibility, and the selection of the CUBIN to load on a GPU.

``Index`` serves both validators' results: the full checker's specs, or the fast path's parsed
kernel objects, whose KernelSpecs it builds on first use.
"""

from __future__ import annotations

import gc
import itertools
import logging
import operator
from collections.abc import Mapping
from typing import Any

from cubinstore._core.abi import Arch, render_param
from cubinstore._core.digest import Digest
from cubinstore._core.geometry import LaunchGeometry
from cubinstore._core.log import get_logger
from cubinstore._core.text import show
from cubinstore.errors import BadArgumentError, IncompatibleArchError, KernelNotFoundError
from cubinstore.manifest.fast import spec_from_obj
from cubinstore.manifest.ptx import PtxArch, is_ptx
from cubinstore.manifest.spec import ComputeCapability, KernelSpec, ParamValue, checked_digests

__all__ = ["AGE_AFTER_BYTES", "Index", "age_young_objects", "arch_compatible", "check_cc", "parse_arch"]

_log = get_logger("cubinstore.manifest")  # the package's logger, as before the split: one name to filter


def parse_arch(arch: object) -> tuple[int, int, bool]:
    """``"sm_90a"`` -> ``(9, 0, True)``: the arch grammar of ``cubinstore._core.abi.Arch``."""
    parsed = Arch.parse(arch)
    return parsed.major, parsed.minor, parsed.suffix == "a"


def check_cc(cc: object) -> ComputeCapability:
    """``cc`` when it is a compute capability ``(major, minor)``; else a BadArgumentError naming it."""
    if type(cc) is tuple and len(cc) == 2 and type(cc[0]) is int is type(cc[1]) and cc[0] >= 0 <= cc[1]:
        return cc  # type: ignore[return-value]  # the common case, as a device reports it; the check below words the rest
    if (
        not isinstance(cc, tuple)
        or len(cc) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cc)
    ):
        raise BadArgumentError(f"invalid compute capability {show(cc)}: expected a tuple (major, minor) of non-negative ints")
    return cc


def arch_compatible(arch: str | Arch, cc: ComputeCapability) -> bool:
    """Whether a CUBIN built for ``arch`` loads on a GPU of compute capability ``cc``.

    ``sm_XYa`` runs only on X.Y exactly; ``sm_XYf`` and ``sm_XY`` on major X with minor >= Y.
    CUBINs never cross a major version. A PTX arch (``compute_90``) is no CUBIN: False (whether
    the driver can compile it there is ``PtxArch.runs_on``; ``select`` falls back to it).
    """
    if isinstance(arch, str) and is_ptx(arch):
        PtxArch.parse(arch)  # a malformed one still raises
        check_cc(cc)
        return False
    parsed = arch if isinstance(arch, Arch) else Arch.parse(arch)
    return parsed.runs_on(check_cc(cc))


# (arch, compute capability) -> arch_compatible(arch, cc): every first load selects by its full id, and
# parsing the arch each time costs more than the rest of the selection. Bounded by the archs seen.
_cubin_runs: dict[tuple[str, ComputeCapability], bool] = {}


def _cubin_runs_on(arch: str, cc: ComputeCapability) -> bool:
    runs = _cubin_runs.get((arch, cc))
    if runs is None:
        runs = _cubin_runs[(arch, cc)] = arch_compatible(arch, cc)
    return runs


# Only a big manifest is worth it: aging also moves the application's young objects (and any
# young cyclic garbage) to the oldest generation, where they wait for the next full collection.
AGE_AFTER_BYTES = 1 << 20


def age_young_objects() -> None:
    """Move what the parse allocated straight to the oldest GC generation.

    Parsed with the collector paused, the whole document sits in the youngest generation, and
    the next collections would traverse all of it twice on its way up: a one-time cost that
    otherwise lands on the first lookups. ``freeze`` then ``unfreeze`` moves every tracked
    object to the oldest generation without traversing any; skipped when the application
    froze objects itself (``unfreeze`` would release them).
    """
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


class Index:
    """A manifest's lookups. KernelSpecs of a fast-path manifest are built on first use.

    ``by_id`` maps an id, ``by_stem`` an id without its arch, to kernel positions; ``orders``
    is each family's param order in its ids (fast path), so a family and all of its params
    render one stem: one dict lookup. Lazily filled parts use setdefault, so threads that
    race on one position all get the same KernelSpec. ``source`` and ``digest`` name the
    manifest in the errors of a failed lookup.
    """

    def __init__(self, objs: list[dict[str, Any]] | None, specs: tuple[KernelSpec, ...] | None,
                 by_id: dict[str, int], by_stem: dict[str, tuple[int, ...]], orders: dict[str, tuple[str, ...]],
                 *, source: str, digest: Digest) -> None:
        self.source = source
        self.digest = digest
        self._objs = objs
        self._specs: dict[int, KernelSpec] = dict(enumerate(specs)) if specs is not None else {}
        self._count = len(objs) if objs is not None else len(specs or ())
        self._launches: dict[str, LaunchGeometry] = {}
        self.by_id = by_id
        self.by_stem = by_stem
        self.orders = orders
        self._by_point: dict[tuple[str, frozenset[Any]], tuple[int, ...]] | None = None
        if objs is None:  # the slow path has its specs already: index them by point
            by_point: dict[tuple[str, frozenset[Any]], list[int]] = {}
            for i, spec in self._specs.items():
                by_point.setdefault((spec.family, frozenset(spec.params.items())), []).append(i)
            self._by_point = {p: tuple(v) for p, v in by_point.items()}
        self._cache: dict[str, Any] = {}

    def __len__(self) -> int:
        return self._count

    def spec(self, i: int, whole: bool = False) -> KernelSpec:
        # ``whole``: for a walk of every kernel, which reads all of each spec (see spec_from_obj).
        spec = self._specs.get(i)
        if spec is None:
            assert self._objs is not None  # every position of a slow-path index is filled
            spec = self._specs.setdefault(i, spec_from_obj(self._objs[i], self._launches, whole))
        return spec

    def _field(self, i: int, name: str) -> Any:
        return self._objs[i][name] if self._objs is not None else getattr(self._specs[i], name)

    def all(self) -> tuple[KernelSpec, ...]:
        specs = self._cache.get("all")
        if specs is None:
            collecting = gc.isenabled()
            gc.disable()  # tens of thousands of new acyclic objects: see Manifest.from_bytes
            try:
                specs = self._cache.setdefault(
                    "all", tuple(map(self.spec, range(self._count), itertools.repeat(True, self._count))))
            finally:
                if collecting:
                    if self._count >= 5000:  # see AGE_AFTER_BYTES
                        age_young_objects()
                    gc.enable()
        return specs

    def _lazy(self, name: str, build: Any) -> Any:
        value = self._cache.get(name)
        if value is None:
            value = self._cache.setdefault(name, build())
        return value

    def families(self) -> dict[str, tuple[int, ...]]:
        def build() -> dict[str, tuple[int, ...]]:
            out: dict[str, list[int]] = {}
            for i in range(self._count):
                out.setdefault(self._field(i, "family"), []).append(i)
            return {f: tuple(v) for f, v in out.items()}
        return self._lazy("families", build)

    def archs(self) -> tuple[str, ...]:
        return self._lazy("archs", lambda: tuple(sorted({self._field(i, "arch") for i in range(self._count)})))

    def blobs(self) -> tuple[tuple[Digest, int], ...]:
        def build() -> tuple[tuple[Digest, int], ...]:
            objs = self._objs
            if objs is not None:  # fast path: two C-level column reads; the digests were checked at open
                # One size per digest (checked at open): sorting the digest strings sorts the pairs.
                sizes = dict(zip(map(operator.itemgetter("digest"), objs), map(operator.itemgetter("size"), objs)))
                texts = sorted(sizes)
                return tuple(zip(checked_digests(texts), map(sizes.__getitem__, texts)))
            pairs = {(str(self._field(i, "digest")), self._field(i, "size")) for i in range(self._count)}
            return tuple((Digest.parse(d), s) for d, s in sorted(pairs))
        return self._lazy("blobs", build)

    def ids_of(self) -> dict[str, tuple[str, ...]]:
        def build() -> dict[str, tuple[str, ...]]:
            out: dict[str, list[str]] = {}
            for i in range(self._count):
                out.setdefault(str(self._field(i, "digest")), []).append(self._field(i, "id"))
            return {d: tuple(v) for d, v in out.items()}
        return self._lazy("ids_of", build)

    def point(self, family: str, params: Mapping[str, ParamValue]) -> list[KernelSpec]:
        """The kernels of ``family`` whose params are exactly ``params``, every arch."""
        if self._by_point is not None:
            try:
                return [self._specs[i] for i in self._by_point.get((family, frozenset(params.items())), ())]
            except TypeError:  # an unhashable value names no point
                return []
        order = self.orders.get(family)
        if order is None or len(order) != len(params):
            return []
        try:
            stem = "/".join([family, *[render_param(k, params[k]) for k in order]])
        except KeyError:
            return []
        assert self._objs is not None
        # Rendering can collide (an int 4 and a string 'vec4'): keep only exact params.
        return [self.spec(i) for i in self.by_stem.get(stem, ()) if self._objs[i]["params"] == params]

    def _families(self) -> str:
        return ", ".join(sorted(self.families()))

    def lookup(self, kernel_id: str) -> KernelSpec:
        """The kernel whose id is ``kernel_id`` (``Manifest.by_id``)."""
        i = self.by_id.get(kernel_id) if isinstance(kernel_id, str) else None
        if i is None:
            raise KernelNotFoundError(
                f"no kernel {show(kernel_id)} in manifest {self.source} ({self.digest}); "
                f"it has {len(self)} kernels of families {self._families()}"
            ) from None
        return self.spec(i)

    def find(self, family: str, params: Mapping[str, ParamValue]) -> list[KernelSpec]:
        """Kernels of ``family`` whose params include every given ``key=value``, all archs, sorted by id."""
        spec = self.spec
        return sorted(
            (k for k in map(spec, self.families().get(family, ()))
             if all(key in k.params and k.params[key] == v for key, v in params.items())),
            key=lambda k: k.id,
        )

    def select(self, family_or_id: str, compute_capability: ComputeCapability,
               params: Mapping[str, ParamValue]) -> KernelSpec:
        """The kernel to load on a GPU of ``compute_capability`` (``Manifest.select`` says how it is chosen)."""
        cc = check_cc(compute_capability)
        if not params:  # a full id whose CUBIN runs here: the one candidate, nothing to rank (first loads)
            i = self.by_id.get(family_or_id)
            if i is not None:
                spec = self.spec(i)
                if _cubin_runs_on(spec.arch, cc):
                    if _log.isEnabledFor(logging.DEBUG):
                        _log.debug("selected %s (%s) for compute capability %d.%d", spec.id, spec.digest, cc[0], cc[1])
                    return spec
        candidates = self.point(family_or_id, params) if params else None
        one_point = bool(candidates)  # a family and all of its params: one dict lookup
        if one_point:
            pass
        elif family_or_id in self.by_id:
            candidates = [self.spec(self.by_id[family_or_id])]
            if params:
                raise BadArgumentError(f"select({family_or_id!r}): a full kernel id takes no params, got {sorted(params)}")
        else:
            candidates = [self.spec(i) for i in self.by_stem.get(family_or_id, ())]
            if candidates and params:
                candidates = [k for k in candidates if all(k.params.get(p) == v for p, v in params.items())]
            elif not candidates:
                candidates = self.find(family_or_id, params)
        assert candidates is not None
        if not candidates:
            asked = family_or_id + "".join(f" {k}={v!r}" for k, v in sorted(params.items()))
            raise KernelNotFoundError(
                f"no kernel matches {asked} in manifest {self.source} ({self.digest}); "
                f"families: {self._families()}"
            )
        parse = Arch.parse  # cached per arch string
        compatible = [k for k in candidates if not is_ptx(k.arch) and parse(k.arch).runs_on(cc)]
        if not compatible:
            # PTX only where no CUBIN runs: the driver compiles it at load (see _ptx_fallback).
            compatible = [k for k in candidates if is_ptx(k.arch) and PtxArch.parse(k.arch).runs_on(cc)]
            if compatible:
                return self._ptx_fallback(family_or_id, compatible, cc, one_point)
        if not compatible:
            sm = f"sm_{cc[0]}{cc[1]}"
            raise IncompatibleArchError(
                f"no CUBIN of {family_or_id!r} for compute capability {cc[0]}.{cc[1]} ({sm}): "
                f"candidates have {', '.join(sorted({k.arch for k in candidates}))}; "
                f"manifest {self.source} has archs {', '.join(self.archs())}; build the kernels for {sm} or {sm}a"
            )
        if not one_point and len(compatible) > 1:  # one point's kernels share their params
            variants = {tuple(sorted(k.params.items())) for k in compatible}
            if len(variants) > 1:
                differing = sorted({key for v in variants for key, _ in v if len({dict(w).get(key) for w in variants}) > 1})
                raise BadArgumentError(
                    f"select({family_or_id!r}) is ambiguous: {len(variants)} parameter sets match; "
                    f"pass {', '.join(differing)}"
                )
        # The highest minor not above the GPU's, then the most specific (a, then f, then plain).
        best = compatible[0] if len(compatible) == 1 else max(
            compatible, key=lambda k: (parse(k.arch).minor, parse(k.arch).preference))
        if _log.isEnabledFor(logging.DEBUG):  # the call costs more than the check
            _log.debug("selected %s (%s) for compute capability %d.%d", best.id, best.digest, cc[0], cc[1])
        return best

    def _ptx_fallback(self, asked: str, compatible: list[KernelSpec], cc: ComputeCapability,
                      one_point: bool) -> KernelSpec:
        """The PTX to load where no CUBIN of the candidates runs on ``cc``: one point's, the most specific
        (``a``, then ``f``, then plain), then the newest target not above the GPU."""
        if not one_point and len({tuple(sorted(k.params.items())) for k in compatible}) > 1:
            raise BadArgumentError(f"select({asked!r}) is ambiguous: several parameter sets have PTX for "
                                   f"compute capability {cc[0]}.{cc[1]}; pass all of the family's params")
        best = max(compatible, key=lambda k: (PtxArch.parse(k.arch).sm.compute_capability,
                                              PtxArch.parse(k.arch).sm.preference))
        _log.debug("no CUBIN of %s runs on compute capability %d.%d: selected PTX %s (%s)",
                   asked, cc[0], cc[1], best.id, best.digest)
        return best
