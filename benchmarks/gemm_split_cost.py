"""Where a K-split launch's time goes (prints tables; not a test).

Builds variants of the gemm kernel with parts of the split protocol taken out (or changed), and
times each against the kernel as built, option by option, on shapes where splits matter. The
variants that skip a part write a wrong D: they are for timing only, never for a library.

    # on the build host, after `bazel build //kernels:all` (the anchors and CUBINs it checks against)
    python benchmarks/gemm_split_cost.py build --out .device/split_cost
    # on the GPU host, with .device carried (tools/device_run.sh splitcost)
    PYTHONPATH=. python benchmarks/gemm_split_cost.py run --manifest .device/kernels/manifest.json \\
        --variants .device/split_cost

`build` compiles each variant of each point in POINTS as Bazel compiles the point (the flags
of cubinstore's ABI, the point's defines, its module anchor), from a copy of kernels/gemm with
the variant's edits applied, and refuses to go on unless the unedited copy gives the build's
bytes. `run` makes one library per variant (the manifest, those points' digests replaced) and
times every option of CASES under each, as tune_gemm.py times an option (median of 30 calls
behind a sleep kernel, inputs rotated over 4x the L2), rounds taking turns. docs/gemm.md (tenth
session) has the H200's table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemm as bench  # noqa: E402  (the sibling script: loading, operands, timing)

ROOT = Path(__file__).resolve().parent.parent
HEADER = "kernels/gemm/sm90_bf16_gemm.cuh"

# Edits of the kernel's split protocol (sm90_bf16_gemm.cuh), each (text, replacement); the text
# must occur exactly once.
_NO_WRITE = ("            if (!live(r)) continue;\n            __stcg(own",
             "            if (true) continue;  // variant: no partial written\n            __stcg(own")
_NO_PUBLISH = ("if (ct == 0) sm90::red_add_release_gpu(published, 1);",
               "if (false) sm90::red_add_release_gpu(published, 1);  // variant: not published")
_NO_WAIT = ("        if (ct == 0) {\n          while (sm90::ld_acquire_gpu(published)",
            "        if (false) {  // variant: no wait\n          while (sm90::ld_acquire_gpu(published)")
_NO_READ = ("for (int sl = from; sl < to; ++sl) {", "for (int sl = from; sl < from; ++sl) {  // variant: no read")
_NO_SLEEP = ("< piece.nslots - 1) __nanosleep(64);", "< piece.nslots - 1) {}  // variant: spin")
_LEAD = "  static constexpr int kReducerLead = (5 * 64 * 128 * 64 + kBM * kBN * kBK - 1) / (kBM * kBN * kBK);"


def _reducer_leads(factor: int) -> tuple[str, str]:
    """The reducer (the last split) leads by `factor` times the kernel's lead (kReducerLead: about
    1.5 us of K blocks, 5 of 64x128x64); 0 deals K out evenly, as the kernel did before the lead."""
    return _LEAD, _LEAD.replace("5 * 64", f"{5 * factor} * 64") + f"  // variant: lead x{factor}"


VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "as_built": (),
    "wait_no_read": (_NO_READ,),  # correct protocol up to the read: the read's cost
    "no_wait_no_read": (_NO_PUBLISH, _NO_WAIT, _NO_READ),  # partials still written
    "nothing": (_NO_WRITE, _NO_PUBLISH, _NO_WAIT, _NO_READ),  # the main loops and D's store alone
    "no_sleep": (_NO_SLEEP,),  # correct
    "even_split": (_reducer_leads(0),),  # correct: no lead (the kernel before it had one)
    "lead_2x": (_reducer_leads(2),),  # correct
    "cluster_k2": (),  # correct; built with CLUSTER_K = 2 (_cluster_k_defines)
    "cluster_k4": (),  # correct; CLUSTER_K = 4
}
CORRECT = frozenset({"as_built", "no_sleep", "even_split", "lead_2x", "cluster_k2", "cluster_k4"})
# The variants built with the kernel's CLUSTER_K define instead of edits, and their cluster size.
CLUSTER_K = {"cluster_k2": 2, "cluster_k4": 4}

# (BM, BN, BK, stages, cluster, swap): the points the cases time.
POINTS = ((64, 128, 64, 8, 1, 0), (64, 64, 128, 5, 1, 0), (128, 128, 64, 5, 1, 0), (128, 64, 64, 8, 1, 0),
          (64, 256, 64, 5, 1, 0), (128, 256, 64, 4, 1, 0), (128, 256, 64, 4, 2, 0), (128, 200, 64, 4, 4, 1),
          (128, 104, 64, 6, 1, 1))
_A, _B, _C = POINTS[0], POINTS[1], POINTS[2]
# (M, N, K) -> options (point, splits): the weak mid-size shapes and deep K with few rows.
CASES: dict[tuple[int, int, int], tuple[tuple[tuple[int, ...], int], ...]] = {
    (512, 1024, 4096): ((_A, 1), (_A, 2), (_C, 2), (_C, 3), (_C, 4), (_B, 1), (_B, 2), (POINTS[3], 2),
                        (POINTS[4], 3), (POINTS[4], 4), (POINTS[5], 4), (POINTS[5], 8)),
    (256, 1408, 2048): ((_B, 1), (_A, 2), (_A, 3), (_C, 3)),
    (128, 1024, 4096): ((_B, 1), (_B, 2), (_B, 4), (_A, 2), (_A, 4)),
    (48, 2048, 7168): ((_B, 2), (_B, 4), (_A, 2), (_A, 4)),
    (8, 8192, 28672): ((_A, 1), (_A, 2), (_A, 4)),
    (32, 4096, 28672): ((_A, 2), (_A, 4)),
    (1000, 3000, 2008): ((POINTS[7], 1), (POINTS[7], 2)),
    (200, 7168, 2048): ((POINTS[8], 1), (POINTS[8], 2)),
    (1280, 3584, 4096): ((POINTS[6], 0), (POINTS[6], 2)),
}


def _cluster_k_defines(cfg: Any, size: int = 2) -> tuple[str, ...] | None:
    """The `cluster_k<size>` build of a point (the kernel's CLUSTER_K: the cluster's CTAs take equal
    shares of a tile's K, the others' partials added through distributed shared memory), launched as
    the point is: its grid (a K-split of `size` gives `size` CTAs a tile) and its shared memory. The
    partials' buffers take the place of pipeline stages: the most stages whose layout and buffers fit
    the point's shared memory (None where fewer than 2 would, or the point multicasts or is swapped)."""
    from cubinstore.errors import BadArgumentError

    if cfg.cluster != 1 or cfg.swap:
        return None
    for stages in range(cfg.stages - 1, 1, -1):
        try:
            shared = type(cfg)(cfg.bm, cfg.bn, cfg.bk, stages, 1, 0, size)  # gemm_kc's layout, buffers included
        except BadArgumentError:  # above the opt-in limit
            continue
        if shared.smem_bytes <= cfg.smem_bytes:
            return shared.defines
    return None


def runs_as(variant: str, point: tuple[int, ...], shape: tuple[int, int, int], splits: int, sm_count: int) -> bool:
    """Whether an option runs `variant`'s build of its point: a cluster_k<size> variant launches clusters of
    `size` CTAs, so only where the point has such a build and its grid is a multiple of `size`."""
    size = CLUSTER_K.get(variant)
    if size is None:
        return True
    cfg = _config(point)
    grid = bench.gemm_module().plan(*shape, sm_count, cfg.kernel_id, splits).grid
    return grid % size == 0 and _cluster_k_defines(cfg, size) is not None


def _selected(variant: str, only: list[str] | None) -> bool:
    """Whether `--only` takes `variant` (all without it; as_built always: the others are timed against it,
    and its build checks the flags)."""
    return not only or variant in only or variant == "as_built"


def edited(source: str, edits: tuple[tuple[str, str], ...], variant: str) -> str:
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"variant {variant}: expected one occurrence in {HEADER} of {old!r}, "
                             f"found {source.count(old)} (the kernel changed: update its edits)")
        source = source.replace(old, new)
    return source


def _config(point: tuple[int, ...]) -> Any:
    return bench.gemm_module().GemmConfig(*point)


def build(out: Path, bazel_bin: Path, only: list[str] | None = None) -> None:
    from cubinstore.internals import DEFAULT_NVCC_FLAGS, cutlass_include, locate_toolkit, nvcc

    compiler = str(locate_toolkit()[0] / "bin" / "nvcc")
    include = cutlass_include()
    header = (ROOT / HEADER).read_text()
    bazel_bin, out = bazel_bin.resolve(), out.resolve()  # nvcc runs in the copied tree
    for variant, edits in VARIANTS.items():
        if not _selected(variant, only):
            continue
        with tempfile.TemporaryDirectory(prefix="cubinstore-split-cost-") as tree:
            gemm = Path(tree) / "kernels" / "gemm"
            shutil.copytree(ROOT / "kernels" / "gemm", gemm)
            (gemm / Path(HEADER).name).write_text(edited(header, edits, variant))
            (out / variant).mkdir(parents=True, exist_ok=True)
            for point in POINTS:
                cfg = _config(point)
                name = bench.target_name(cfg)
                built = bazel_bin / "kernels" / "gemm" / f"{name}.cubin"
                anchor = built.with_suffix(".anchor.h")
                if not anchor.is_file():
                    raise SystemExit(f"{anchor}: missing: run `bazel build //kernels:all` first")
                target = out / variant / f"{name}.cubin"
                defines = _cluster_k_defines(cfg, CLUSTER_K[variant]) if variant in CLUSTER_K else cfg.defines
                if defines is None:  # the point as built stands in (its options print "-" in this column)
                    shutil.copyfile(built, target)
                    continue
                # As Bazel runs it (the one argv shape, cubinstore/_core/nvcc.py), in the copied tree.
                source = "kernels/gemm/sm90_bf16_gemm.cu"
                cmd = nvcc.cubin_argv({
                    "nvcc": compiler, "arch": "sm_90a", "host_cc": "gcc", "flags": list(DEFAULT_NVCC_FLAGS),
                    "includes": [str(include)], "defines": [d.removeprefix("-D") for d in defines],
                    "anchor": str(anchor), "source_name": source, "extra": [], "output": str(target), "source": source,
                })
                done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"{variant} {cfg.kernel_id}: nvcc exit {done.returncode}:\n{done.stderr[-4000:]}")
                if variant == "as_built" and target.read_bytes() != built.read_bytes():
                    raise SystemExit(f"{cfg.kernel_id}: this build's bytes differ from {built}: its flags or "
                                     "sources are not the build's; fix that before timing variants")
            print(f"{variant}: {len(POINTS)} CUBINs in {out / variant}", flush=True)


def _libraries(manifest: Path, variants: Path, home: Path, only: list[str] | None = None) -> dict[str, Any]:
    from cubinstore import launch
    from cubinstore.manifest import Manifest
    from cubinstore.store import LocalLayer, Store
    from cubinstore.store.sources import DirectorySource

    base = json.loads(manifest.read_text())
    names = {bench.target_name(_config(p)) for p in POINTS}
    out = {}
    for variant in VARIANTS:
        where = variants / variant
        if not where.is_dir() or not _selected(variant, only):
            continue
        raw = json.loads(json.dumps(base))
        for spec in raw["kernels"]:
            name = spec["target"].rpartition(":")[2]
            if name in names:
                data = (where / f"{name}.cubin").read_bytes()
                spec["digest"], spec["size"] = "sha256:" + hashlib.sha256(data).hexdigest(), len(data)
        (home / variant).mkdir(parents=True)
        path = home / variant / "manifest.json"
        path.write_text(json.dumps(raw))
        store = Store([LocalLayer(home / variant / "store"), DirectorySource(where), DirectorySource(manifest.parent)])
        out[variant] = launch.open(Manifest.from_path(path), store)
    return out


def run(manifest: Path, variants: Path, rounds: int, only: list[str] | None = None) -> None:
    import torch

    import cubinstore.ops as ops

    libraries = _libraries(manifest, variants, Path(tempfile.mkdtemp(prefix="cubinstore-split-cost-")), only)
    if "as_built" not in libraries:
        raise SystemExit(f"{variants}: no as_built variant: run `gemm_split_cost.py build` on the build host")
    props = torch.cuda.get_device_properties(0)
    l2 = bench.l2_bytes(props)
    names = list(libraries)
    print(f"device: {props.name}; us, median of {rounds} rounds taking turns (each tune_gemm's median of 30 "
          "calls); * a wrong D (a variant that skips part of the reduction)")
    print(f"{'option':>44s} " + " ".join(f"{n:>15s}" for n in names))
    for (m, n, k), options in CASES.items():
        data = bench.Operands(torch, m, n, k, bench.ROTATE_L2 * l2)
        ref = data.reference(0)
        theirs = [1e3 * bench.time_ms(torch, bench.torch_mm(torch, data), data.sets, 30, 3) for _ in range(rounds)]
        print(f"{m}x{n}x{k}: torch.mm {statistics.median(theirs):.1f}", flush=True)
        for point, splits in options:
            kernel_id = _config(point).kernel_id
            times: dict[str, list[float]] = {v: [] for v in names}
            wrong = {}
            skipped = {v for v in names if not runs_as(v, point, (m, n, k), splits, props.multi_processor_count)}
            names_now = [v for v in names if v not in skipped]
            for variant in names_now:
                ops.set_library(libraries[variant])
                wrong[variant] = not bench.checked_error(torch, bench.ours_mm(data, kernel_id, splits), data,
                                                         ref) < bench.MAX_REL_ERROR
                if wrong[variant] and variant in CORRECT:
                    raise SystemExit(f"{variant} {kernel_id} splits {splits} at {m}x{n}x{k}: a wrong D")
            for _ in range(rounds):
                for variant in names_now:
                    ops.set_library(libraries[variant])
                    run_one = bench.ours_mm(data, kernel_id, splits)
                    times[variant].append(1e3 * bench.time_ms(torch, run_one, data.sets, 30, 3))
            label = kernel_id.removeprefix("gemm/").removesuffix("/sm_90a") + f" s{splits}"
            cells = " ".join(f"{'-':>15s}" if v in skipped else f"{statistics.median(times[v]):14.1f}{'*' if wrong[v] else ' '}"
                             for v in names)
            print(f"{label:>44s} {cells}", flush=True)
        del data, ref
    ops.set_library(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the variants (build host)")
    b.add_argument("--out", type=Path, default=ROOT / ".device" / "split_cost")
    b.add_argument("--bazel-bin", type=Path, default=ROOT / "bazel-bin")
    b.add_argument("--only", nargs="+", metavar="VARIANT", help="build these variants (and as_built) alone")
    r = sub.add_parser("run", help="time them (GPU host)")
    r.add_argument("--manifest", type=Path, default=ROOT / ".device" / "kernels" / "manifest.json")
    r.add_argument("--variants", type=Path, default=ROOT / ".device" / "split_cost")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--only", nargs="+", metavar="VARIANT", help="time these variants (and as_built) alone")
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--only: no variant {unknown} (variants: {', '.join(VARIANTS)})")
    if args.command == "build":
        build(args.out, args.bazel_bin, args.only)
    else:
        run(args.manifest, args.variants, args.rounds, args.only)


if __name__ == "__main__":
    main()
