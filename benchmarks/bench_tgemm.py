"""Benchmark (and check) of the templated `tgemm` family against torch's own GEMMs (prints tables; not a test).

Every instantiation, on 4096^3 and LLM projection shapes, in TFLOP/s beside the plain peers:
`torch.mm` for bf16 and `torch._scaled_mm` (row-wise fp32 scales, bf16 out) for e4m3, with and
without its fast accumulation. Two ways to get the kernels:

  # CUBINs of a Bazel build, through cubinstore (launch geometry from the manifest)
  PYTHONPATH=. python benchmarks/bench_tgemm.py --manifest bazel-bin/kernels/manifest.json

  # without Bazel: render kernels/tgemm/tgemm.cu.tmpl per point and compile with nvcc (any host
  # with nvcc 13 and the nvidia-cutlass wheel), then, on the GPU host, load the CUBINs with
  # cuda.bindings directly and launch with the geometry formulas of kernels/tgemm/README.md
  python benchmarks/bench_tgemm.py --compile DIR
  python benchmarks/bench_tgemm.py --cubins DIR [--only REGEX] [--check]

`--check` first runs every instantiation on tail shapes (fresh random inputs, output poisoned
with NaN, float64 reference) and prints ||D - ref|| / ||ref||, and whether a second launch on
the same inputs gave the same bits. Timing: CUDA events around each call, median of `--reps`
calls after `--warmup`; the GPU is kept busy (torch.cuda._sleep) while Python enqueues; inputs
rotate over sets together at least three times the L2, so no call finds its operands in L2.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing cubinstore

FAMILY = "tgemm"
# The instantiation grid of kernels/tgemm/BUILD.bazel: (dtype, bm, bn, bk, stages).
GRID: tuple[tuple[str, int, int, int, int], ...] = (
    ("bf16", 128, 256, 64, 4),
    ("bf16", 128, 128, 64, 6),
    ("bf16", 256, 128, 64, 4),
    ("e4m3", 128, 128, 128, 6),
    ("e4m3", 128, 192, 128, 5),
)
ENTRY = "cubinstore::tgemm::tgemm_impl<cubinstore::tgemm::{dtype}, {bm}, {bn}, {bk}, {stages}>"
MANGLED = ("_ZN10cubinstore5tgemm10tgemm_implINS0_{dtl}{dtype}ELi{bm}ELi{bn}ELi{bk}ELi{stages}EEEvjjjPKfS4_"
           "14CUtensorMap_stS5_P13__nv_bfloat16")
BLOCK = 384

TIMED = ((4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336), (128, 14336, 4096), (8192, 8192, 8192))
# Tails in M, N and K (K a multiple of 16 so both dtypes take it), odd N (the scalar store path), one tile.
CHECKED = ((1, 1, 16), (128, 256, 128), (77, 301, 144), (300, 520, 1040), (1000, 1000, 1008),
           (257, 4095, 2048), (4096, 4096, 4096), (333, 14336, 4096))


@dataclass(frozen=True)
class Point:
    dtype: str
    bm: int
    bn: int
    bk: int
    stages: int
    tag: str = ""  # a development variant of the same point (CUBIN name suffix `_<tag>`)

    @property
    def name(self) -> str:
        return f"tgemm_{self.dtype}_bm{self.bm}_bn{self.bn}_bk{self.bk}_stages{self.stages}" + (
            f"_{self.tag}" if self.tag else "")

    @property
    def params(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "bm": self.bm, "bn": self.bn, "bk": self.bk, "stages": self.stages}

    @property
    def elem_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 1

    @property
    def entry(self) -> str:
        return ENTRY.format(**self.params)

    @property
    def mangled(self) -> str:
        return MANGLED.format(dtl=len(self.dtype), **self.params)

    def smem_bytes(self) -> int:
        # kernels/tgemm/README.md: align to 1024, then per stage the A and B rows (128 bytes of K) and 2 mbarriers.
        return 1024 + self.stages * ((self.bm + self.bn) * 128 + 16)

    def grid(self, m: int, n: int, sm_count: int) -> int:
        return min(sm_count, math.ceil(m / self.bm) * math.ceil(n / self.bn))


def point_from_name(name: str) -> Point:
    found = re.fullmatch(r"tgemm_(bf16|e4m3)_bm(\d+)_bn(\d+)_bk(\d+)_stages(\d+)(?:_sm_90a)?(?:_([a-z0-9]+))?", name)
    if found is None:
        raise SystemExit(f"bench_tgemm: cannot read a grid point from CUBIN name {name!r}")
    dtype, bm, bn, bk, stages, tag = found.groups()
    return Point(dtype, int(bm), int(bn), int(bk), int(stages), tag or "")


# -- compile (no Bazel) ----------------------------------------------------------------------------


def render(point: Point) -> str:
    """The translation unit of one point: the template with each `{param}` replaced literally."""
    text = (ROOT / "kernels" / "tgemm" / "tgemm.cu.tmpl").read_text()
    for key, value in point.params.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def compile_grid(out: Path, nvcc: str) -> None:
    from cubinstore.errors import BadArgumentError
    from cubinstore.internals import cutlass_include

    try:
        include = cutlass_include()
    except BadArgumentError as exc:
        raise SystemExit(f"--compile: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    for row in GRID:
        point = Point(*row)
        src = out / f"{point.name}.cu"
        src.write_text(render(point))
        cmd = [nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", "--expt-relaxed-constexpr", f"-I{ROOT}",
               f"-I{include}", str(src), "-o", str(out / f"{point.name}.cubin")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"nvcc failed for {point.name} (exit {done.returncode}):\n{done.stderr}")
        print(f"{point.name:44s} {(out / f'{point.name}.cubin').stat().st_size:7d} bytes", flush=True)


# -- tensor maps -----------------------------------------------------------------------------------


def encode_kmajor(t: Any, box_rows: int) -> bytes:
    """The 128 bytes of the README's tensor map of a K-major (rows x K) bf16 or fp8 matrix: boxes of
    box_rows x 128 bytes, 128-byte swizzle, zero fill out of bounds (cubinstore's encoder)."""
    from cubinstore.tensormap import from_tensor

    return from_tensor(t, box=[box_rows, 128 // t.element_size()], swizzle="128B").raw


# -- launchers -------------------------------------------------------------------------------------


class RawKernel:
    """One CUBIN loaded with cuda.bindings and launched with the README's geometry."""

    def __init__(self, point: Point, path: Path, sm_count: int) -> None:
        from cuda.bindings import driver as drv

        self.drv, self.point, self.sm_count = drv, point, sm_count
        self._data = path.read_bytes()  # the driver may read it lazily: keep it alive
        err, self.library = drv.cuLibraryLoadData(self._data, None, None, 0, None, None, 0)
        self._ok(err, f"cuLibraryLoadData({path})")
        # A CUTLASS_GLOBAL kernel is a local symbol: the driver finds it by name all the same.
        err, kernel = drv.cuLibraryGetKernel(self.library, point.mangled.encode())
        self._ok(err, f"cuLibraryGetKernel({point.mangled})")
        err, self.func = drv.cuKernelGetFunction(kernel)
        self._ok(err, "cuKernelGetFunction")
        (err,) = drv.cuFuncSetAttribute(
            self.func, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, point.smem_bytes())
        self._ok(err, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")

    def _ok(self, err: Any, what: str) -> None:
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{self.point.name}: {what}: {err}")

    def prepare(self, m: int, n: int, k: int, sa: int, sb: int, tma: bytes, tmb: bytes, d: int,
                stream: int) -> Callable[[], None]:
        drv = self.drv
        def words(raw: bytes) -> Any:
            return (ctypes.c_uint64 * 16)(*[int.from_bytes(raw[i:i + 8], "little") for i in range(0, 128, 8)])

        values = [ctypes.c_uint32(m), ctypes.c_uint32(n), ctypes.c_uint32(k), ctypes.c_uint64(sa),
                  ctypes.c_uint64(sb), words(tma), words(tmb), ctypes.c_uint64(d)]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        config = drv.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.point.grid(m, n, self.sm_count), 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = BLOCK, 1, 1
        config.sharedMemBytes = self.point.smem_bytes()
        config.hStream = drv.CUstream(stream)
        config.numAttrs = 0

        def launch() -> None:
            (err,) = drv.cuLaunchKernelEx(config, self.func, ctypes.addressof(params), 0)
            self._ok(err, "cuLaunchKernelEx")
            _ = values  # parameters referenced for as long as the closure lives

        return launch


class StoreKernel:
    """The same instantiation through cubinstore: manifest, verified store, launch geometry from the manifest."""

    def __init__(self, library: Any, point: Point) -> None:
        self.point = point
        self.kernel = library.kernel(FAMILY, **point.params)

    def prepare(self, m: int, n: int, k: int, sa: int, sb: int, tma: bytes, tmb: bytes, d: int,
                stream: int) -> Callable[[], None]:
        from cubinstore.tensormap import TensorMap

        args = (m, n, k, sa, sb, TensorMap(tma), TensorMap(tmb), d)
        return lambda: self.kernel.launch(self.point.entry, args=args, stream=stream)


# -- operands, reference, timing -------------------------------------------------------------------


class Operands:
    """A, B (K-major), fp32 row/column scales and a NaN-poisoned D for one shape and dtype."""

    def __init__(self, torch: Any, dtype: str, m: int, n: int, k: int, gen: Any, scales: bool = True) -> None:
        self.m, self.n, self.k = m, n, k
        a = torch.randn(m, k, device="cuda", generator=gen)
        b = torch.randn(n, k, device="cuda", generator=gen)
        if dtype == "bf16":
            self.a, self.b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        else:
            self.a, self.b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        self.sa = (torch.rand(m, device="cuda", generator=gen) + 0.5) if scales else None
        self.sb = (torch.rand(n, device="cuda", generator=gen) + 0.5) if scales else None
        self.d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)

    def reference(self) -> Any:
        ref = self.a.double() @ self.b.double().T
        if self.sa is not None:
            ref = ref * self.sa.double()[:, None] * self.sb.double()[None, :]
        return ref

    def launcher(self, kern: Any, stream: int) -> Callable[[], None]:
        p = kern.point
        return kern.prepare(self.m, self.n, self.k, 0 if self.sa is None else self.sa.data_ptr(),
                            0 if self.sb is None else self.sb.data_ptr(), encode_kmajor(self.a, p.bm),
                            encode_kmajor(self.b, p.bn), self.d.data_ptr(), stream)


def rel_error(torch: Any, d: Any, ref: Any) -> float:
    """||D - ref|| / ||ref||; NaN if any element of D is NaN (e.g. never written)."""
    return float((d.double() - ref).norm() / ref.norm())


def time_ms(torch: Any, fns: Sequence[Callable[[], None]], reps: int, warmup: int) -> float:
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(int(2e6 + reps * 4e5))  # keep the GPU busy while Python enqueues
    for i in range(reps):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def operand_sets(torch: Any, dtype: str, m: int, n: int, k: int, gen: Any, l2: int) -> list[Operands]:
    esize = 2 if dtype == "bf16" else 1
    per_set = esize * (m * k + n * k) + 2 * m * n
    return [Operands(torch, dtype, m, n, k, gen) for _ in range(max(2, math.ceil(3 * l2 / per_set)))]


def peers(torch: Any, dtype: str, sets: list[Operands]) -> dict[str, list[Callable[[], None]]]:
    if dtype == "bf16":
        return {"torch.mm": [lambda o=o: torch.mm(o.a, o.b.T, out=o.d) for o in sets]}
    out = {}
    if hasattr(torch, "_scaled_mm"):
        for fast in (False, True):
            out[f"_scaled_mm{' fast' if fast else ''}"] = [
                lambda o=o, fast=fast: torch._scaled_mm(o.a, o.b.T, scale_a=o.sa[:, None], scale_b=o.sb[None, :],
                                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
                for o in sets]
    return out


# -- main ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", type=Path, help="a manifest (bazel-bin/kernels/manifest.json)")
    src.add_argument("--cubins", type=Path, help="a directory of tgemm_<point>.cubin files")
    src.add_argument("--compile", type=Path, metavar="DIR", help="compile GRID into DIR with nvcc, then stop")
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    parser.add_argument("--only", default=None, help="regex over instantiation names; 'none' times only the peers")
    parser.add_argument("--check", action="store_true", help="first check correctness on tail shapes")
    parser.add_argument("--no-time", action="store_true", help="skip timing")
    parser.add_argument("--no-peers", action="store_true", help="skip the torch peers")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.compile is not None:
        compile_grid(args.compile, args.nvcc)
        return

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    sm_count, l2 = props.multi_processor_count, props.L2_cache_size
    torch.zeros(1, device="cuda")  # primary context current before cuda.bindings calls
    stream = torch.cuda.current_stream().cuda_stream
    print(f"# {props.name}, {sm_count} SMs, L2 {l2 >> 20} MiB, torch {torch.__version__}", flush=True)

    kernels: list[Any] = []
    if args.cubins is not None:
        for path in sorted(args.cubins.glob("tgemm_*.cubin")):
            point = point_from_name(path.stem)
            if args.only is None or re.search(args.only, point.name):
                kernels.append(RawKernel(point, path, sm_count))
    else:
        import tempfile

        from cubinstore import launch
        from cubinstore.manifest import Manifest
        from cubinstore.store import DirectorySource, LocalLayer, Store

        # A fresh local store filled from the build tree the manifest sits in (bazel-bin/kernels).
        manifest = Manifest.from_path(args.manifest)
        store = Store([LocalLayer(tempfile.mkdtemp(prefix="bench-tgemm-")), DirectorySource(args.manifest.parent)])
        library = launch.open(manifest, store)
        for spec in manifest.find(FAMILY):
            point = Point(**{key: spec.params[key] for key in ("dtype", "bm", "bn", "bk", "stages")})
            if args.only is None or re.search(args.only, point.name):
                kernels.append(StoreKernel(library, point))
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device="cuda").manual_seed(20261201)

    if args.check:
        print(f"{'instantiation':44s} {'M':>5s} {'N':>6s} {'K':>5s} {'scales':>6s} {'rel err':>9s} {'same bits':>9s}")
        for kern in kernels:
            for i, (m, n, k) in enumerate(CHECKED):
                # bf16 with and without scales; e4m3 with scales except on one shape.
                scales = (i % 2 == 1) if kern.point.dtype == "bf16" else (i != 2)
                ops = Operands(torch, kern.point.dtype, m, n, k, gen, scales=scales)
                launch = ops.launcher(kern, stream)
                launch()
                torch.cuda.synchronize()
                err = rel_error(torch, ops.d, ops.reference())
                first = ops.d.clone()
                ops.d.fill_(float("nan"))
                launch()
                torch.cuda.synchronize()
                same = bool(torch.equal(first.view(torch.int16), ops.d.view(torch.int16)))
                ok = err < 1e-2 and same
                rows.append({"kind": "check", "kernel": kern.point.name, "shape": [m, n, k], "scales": scales,
                             "rel_err": err, "deterministic": same, "ok": ok})
                print(f"{kern.point.name:44s} {m:5d} {n:6d} {k:5d} {str(scales):>6s} {err:9.2e} {str(same):>9s}"
                      f"{'' if ok else '  FAIL'}", flush=True)

    if not args.no_time:
        print(f"{'instantiation / peer':44s} {'M':>5s} {'N':>6s} {'K':>6s} {'ms':>8s} {'TFLOP/s':>8s}")
        for dtype in ("bf16", "e4m3"):
            mine = [kr for kr in kernels if kr.point.dtype == dtype]
            if not mine and args.no_peers:
                continue
            for m, n, k in TIMED:
                sets = operand_sets(torch, dtype, m, n, k, gen, l2)
                timed = {} if args.no_peers else peers(torch, dtype, sets)
                for kern in mine:
                    timed[kern.point.name] = [o.launcher(kern, stream) for o in sets]
                for label, fns in timed.items():
                    try:
                        ms = time_ms(torch, fns, args.reps, args.warmup)
                    except Exception as exc:  # a peer torch lacks (e.g. row-wise _scaled_mm) is reported, not fatal
                        print(f"{label:44s} {m:5d} {n:6d} {k:6d}  failed: {type(exc).__name__}: {exc}"[:200])
                        continue
                    rows.append({"kind": "time", "dtype": dtype, "label": label, "shape": [m, n, k], "ms": ms,
                                 "tflops": tflops(m, n, k, ms)})
                    print(f"{label:44s} {m:5d} {n:6d} {k:6d} {ms:8.4f} {tflops(m, n, k, ms):8.1f}", flush=True)
                del sets, timed
                torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if any(r["kind"] == "check" and not r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
