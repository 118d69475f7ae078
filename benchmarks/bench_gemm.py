"""Benchmark of the Hopper bf16 GEMM family against torch.matmul (prints tables; not a test).

Two steps, because the GPU machine and the build machine may differ:

  # anywhere with nvcc 13 and the CUTLASS headers: compile every instantiation,
  # recording nvcc's CPU seconds, into a directory with a manifest
  python benchmarks/bench_gemm.py compile --out .device/gemm

  # on an H200/H100 with torch: TFLOP/s of cubinstore.ops.gemm and torch.matmul,
  # side by side on the same tensors, plus the load time of each CUBIN
  PYTHONPATH=. python benchmarks/bench_gemm.py run --manifest .device/gemm/manifest.json

`run` also takes the manifest of `bazel build //kernels:all`. Timing: CUDA
events around each call, median of `--reps` calls after `--warmup` calls; the
GPU is kept busy (torch.cuda._sleep) while Python enqueues, so launch overhead
on the host is not counted; inputs rotate over enough sets to be at least
three times the L2 size, so no call finds its operands in L2.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing cubinstore
SOURCE = "kernels/gemm/sm90_bf16_gemm.cu"

log = logging.getLogger("bench_gemm")

# The instantiation grid; mirrors the Starlark in kernels/gemm/README.md, for
# building without Bazel. Each row: (bm, bn, bk, stages, cluster).
GRID: tuple[tuple[int, int, int, int, int], ...] = tuple(
    [(128, 256, 64, s, c) for s in (3, 4) for c in (1, 2)]
    + [(128, bn, 64, 5, c) for bn in (128, 192) for c in (1, 2)]
    + [(128, 64, 64, 8, c) for c in (1, 2)]
    + [(256, bn, 64, 4, c) for bn in (64, 128) for c in (1, 2)]
    + [(128, 128, 128, 3, c) for c in (1, 2)]
)

# (M, N, K) of the LLM projections the issue names; 4096^3 first.
SQUARE = (4096, 4096, 4096)
LLM_NK = ((4096, 4096), (14336, 4096), (4096, 14336))
LLM_M = (1, 64, 128, 4096)


def gemm_module() -> Any:
    # `cubinstore.ops.gemm` is also the function's name; fetch the module itself.
    return importlib.import_module("cubinstore.ops.gemm")


def target_name(cfg: Any) -> str:
    return "gemm_" + "_".join(f"{k}{v}" for k, v in cfg.params.items()) + "_sm_90a"


# -- compile ---------------------------------------------------------------------------------------


def cutlass_include() -> Path:
    import cutlass_library  # nvidia-cutlass ships the headers inside its Python package

    return Path(cutlass_library.__file__).resolve().parent / "source" / "include"


def compile_grid(out: Path, nvcc: str, include: Path) -> None:
    from cubinstore.manifest import Manifest

    g = gemm_module()
    out.mkdir(parents=True, exist_ok=True)
    kernels = []
    seconds: dict[str, float] = {}
    for row in GRID:
        cfg = g.GemmConfig(*row)
        final = out / f"{target_name(cfg)}.cubin"
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=".cubin")
        os.close(fd)
        cmd = [nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", f"-I{ROOT}", f"-I{include}",
               *cfg.defines, str(ROOT / SOURCE), "-o", tmp]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            subprocess.run(cmd, check=True, timeout=600, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            os.unlink(tmp)
            sys.exit(f"nvcc failed for {cfg.kernel_id} (exit {exc.returncode}):\n{exc.stderr}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        data = Path(tmp).read_bytes()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        seconds[cfg.kernel_id] = round(cpu, 3)
        kernels.append({
            "id": cfg.kernel_id, "family": g.FAMILY, "params": cfg.params, "arch": g.ARCH,
            "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data),
            "entries": {g.ENTRY: list(g.ENTRY_TYPES)}, "target": f"//kernels/gemm:{target_name(cfg)}",
        })
        print(f"{cfg.kernel_id:50s} {cpu:6.2f} s CPU  {len(data):7d} bytes", flush=True)
    _write_atomic(out / "manifest.json", Manifest.build(kernels, source=str(out / "manifest.json")).raw)
    _write_atomic(out / "compile_seconds.json", (json.dumps(seconds, indent=1, sort_keys=True) + "\n").encode())


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- GPU helpers (shared with tune_gemm.py) --------------------------------------------------------


def open_library(manifest_path: Path, home: Path) -> Any:
    """A Library over `manifest_path` whose blobs come from the local store `home`,
    filled from the directory the manifest sits in (as after a local build)."""
    from cubinstore import launch
    from cubinstore.manifest import Manifest
    from cubinstore.store import DirectorySource, LocalStore, Store

    manifest = Manifest.from_path(manifest_path)
    store = Store([LocalStore(home), DirectorySource(manifest_path.parent)])
    return launch.open(manifest, store)


def gemm_specs(library: Any) -> list[Any]:
    return [k for k in library.manifest.kernels if k.family == "gemm"]


class Operands:
    """`sets` independent (A, B, D) triples for one shape, together over `min_bytes`."""

    def __init__(self, torch: Any, m: int, n: int, k: int, min_bytes: int, seed: int = 0) -> None:
        per_set = 2 * (m * k + n * k + m * n)
        self.sets = max(2, math.ceil(min_bytes / per_set))
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.a = [torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(self.sets)]
        self.b = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(self.sets)]
        self.d = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(self.sets)]


def time_ms(torch: Any, fn: Callable[[int], None], sets: int, reps: int, warmup: int) -> float:
    """Median device time of `fn(i % sets)` over `reps` calls, in milliseconds."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    # Keep the GPU busy while Python enqueues (about 0.2 ms of host time a call).
    torch.cuda._sleep(int(2e6 + reps * 4e5))
    for i in range(reps):
        starts[i].record()
        fn(i % sets)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def torch_mm(torch: Any, data: Operands) -> Callable[[int], None]:
    """torch.matmul of set i (cuBLAS, D = A @ B.T) into the same output buffers."""
    def run(i: int) -> None:
        torch.mm(data.a[i], data.b[i].T, out=data.d[i])

    return run


def ours_mm(data: Operands, kernel_id: str | None = None, splits: int | None = None) -> Callable[[int], None]:
    """cubinstore.ops.gemm of set i; with `kernel_id`, that instantiation and split instead of the table's."""
    import cubinstore.ops as ops

    g = gemm_module()

    def run(i: int) -> None:
        if kernel_id is None:
            ops.gemm(data.a[i], data.b[i], out=data.d[i])
        else:
            g.gemm_with(data.a[i], data.b[i], out=data.d[i], kernel_id=kernel_id, splits=splits)

    return run


def rel_error(torch: Any, d: Any, a: Any, b: Any) -> float:
    ref = a.float() @ b.float().T
    return float((d.float() - ref).norm() / ref.norm())


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def max_active_clusters(library: Any, kernel_id: str) -> str:
    """How many clusters of the kernel fit on the GPU at once (cuOccupancyMaxActiveClusters).

    The persistent grid assumes SMs / cluster of them; fewer would leave a tail wave.
    """
    from cubinstore import _cuda

    g = gemm_module()
    cfg = g.GemmConfig.from_id(kernel_id)
    if cfg.cluster == 1:
        return "-"
    kernel = library.kernel(kernel_id, device=0)
    drv = _cuda.driver()
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = 132, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 384, 1, 1
    config.sharedMemBytes = cfg.smem_bytes
    config.numAttrs = 0
    with _cuda.on_device(0):
        err, count = drv.cuOccupancyMaxActiveClusters(drv.CUfunction(kernel._functions[g.ENTRY].handle), config)
    return str(count) if err == drv.CUresult.CUDA_SUCCESS else f"err{int(err)}"


# -- run -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    import torch

    import cubinstore.ops as ops
    from cubinstore import launch
    from cubinstore.store import LocalStore, Store

    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    min_bytes = 3 * l2
    home = Path(args.home or tempfile.mkdtemp(prefix="cubinstore-bench-"))
    library = open_library(args.manifest, home)
    specs = gemm_specs(library)
    compile_json = args.manifest.parent / "compile_seconds.json"
    compile_s = json.loads(compile_json.read_text()) if compile_json.is_file() else {}

    # Load times from the local store: fill it first (copy from the build dir, verified),
    # then load each CUBIN through a store that has only the local layer.
    for spec in specs:
        library.store.get(spec.digest, spec.size, name=spec.id)
    local_only = launch.open(library.manifest, Store([LocalStore(home)]))
    load_ms: dict[str, float] = {}
    for spec in specs:
        t0 = time.perf_counter()
        local_only.kernel(spec.id, device=0)
        load_ms[spec.id] = (time.perf_counter() - t0) * 1e3
    ops.set_library(local_only)

    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB; torch {torch.__version__}")
    print(f"table measured: {importlib.import_module('cubinstore.ops._gemm_tuning').MEASURED}")

    # Every instantiation at 4096^3 next to torch on the same tensors.
    m, n, k = SQUARE
    data = Operands(torch, m, n, k, min_bytes)
    torch_ms = time_ms(torch, torch_mm(torch, data), data.sets, args.reps, args.warmup)
    print(f"\n== every instantiation at {m}x{n}x{k} (torch.matmul {tflops(m, n, k, torch_ms):.0f} TFLOP/s)")
    print(f"{'kernel id':50s} {'nvcc CPU s':>10s} {'load ms':>8s} {'clusters':>8s} {'TFLOP/s':>8s} "
          f"{'vs torch':>8s} {'rel err':>8s}")
    best = (0.0, "")
    for spec in specs:
        ms = time_ms(torch, ours_mm(data, spec.id, 1), data.sets, args.reps, args.warmup)
        err = rel_error(torch, data.d[0], data.a[0], data.b[0]) if args.check else float("nan")
        rate = tflops(m, n, k, ms)
        best = max(best, (rate, spec.id))
        cs = compile_s.get(spec.id)
        print(f"{spec.id:50s} {cs if cs is not None else float('nan'):10.2f} {load_ms[spec.id]:8.2f} "
              f"{max_active_clusters(local_only, spec.id):>8s} {rate:8.1f} {ms and torch_ms / ms:8.1%} {err:8.1e}",
              flush=True)
    print(f"best at 4096^3: {best[1]} {best[0]:.1f} TFLOP/s = {best[0] / tflops(m, n, k, torch_ms):.1%} of torch")

    # The tuned op against torch on the shapes.
    # 4096^3 is also the first LLM shape (M = 4096, N x K = 4096 x 4096).
    shapes = [(mm, nn, kk) for nn, kk in LLM_NK for mm in LLM_M]
    print("\n== cubinstore.ops.gemm (tuning table) vs torch.matmul")
    print(f"{'M x N x K':>20s} {'kernel (splits)':>58s} {'ours TF/s':>9s} {'torch TF/s':>10s} {'ratio':>7s}")
    ratios_llm = []
    for m, n, k in shapes:
        data = Operands(torch, m, n, k, min_bytes, seed=m + n + k)
        ours_ms = time_ms(torch, ours_mm(data), data.sets, args.reps, args.warmup)
        torch_ms = time_ms(torch, torch_mm(torch, data), data.sets, args.reps, args.warmup)
        kid, splits = importlib.import_module("cubinstore.ops._gemm_tuning").lookup(m, n, k)
        ratio = torch_ms / ours_ms
        if m >= 128:
            ratios_llm.append(ratio)
        print(f"{f'{m}x{n}x{k}':>20s} {f'{kid} ({splits})':>58s} {tflops(m, n, k, ours_ms):9.1f} "
              f"{tflops(m, n, k, torch_ms):10.1f} {ratio:7.1%}", flush=True)
    geo = math.exp(sum(map(math.log, ratios_llm)) / len(ratios_llm))
    print(f"geometric mean ratio over LLM shapes with M >= 128 ({len(ratios_llm)} shapes): {geo:.1%}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile every instantiation and write a manifest")
    c.add_argument("--out", type=Path, default=ROOT / ".device" / "gemm")
    c.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    c.add_argument("--include", type=Path, default=None, help="CUTLASS include dir (default: nvidia-cutlass's)")
    r = sub.add_parser("run", help="time on the GPU")
    r.add_argument("--manifest", type=Path, default=ROOT / ".device" / "gemm" / "manifest.json")
    r.add_argument("--home", type=Path, default=None, help="local store root (default: a fresh temp dir)")
    r.add_argument("--reps", type=int, default=30)
    r.add_argument("--warmup", type=int, default=5)
    r.add_argument("--check", action="store_true", help="also print each instantiation's relative error")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "compile":
        compile_grid(args.out, args.nvcc, args.include or cutlass_include())
    else:
        run(args)


if __name__ == "__main__":
    main()
