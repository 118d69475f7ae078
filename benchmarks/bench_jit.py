"""cubinstore.jit against AOT loads: JIT cold, JIT warm hit in a fresh process (through the direct
key, and through the full key for comparison), AOT load from a manifest, and the key over the
CUTLASS/CuTe tree with xxh3 vs sha256.

    python benchmarks/bench_jit.py                        # every row this host can run
    python benchmarks/bench_jit.py --prepare DIR          # on a host with nvcc: compile into DIR's store
    python benchmarks/bench_jit.py --prebuilt DIR         # on the GPU host: load rows from DIR (nvcc optional)

CPU rows need nvcc and the CUTLASS headers ($CUBINSTORE_CUTLASS_INCLUDE or the nvidia-cutlass
wheel); GPU rows need a GPU and cuda-bindings. With no nvcc on the GPU host, `--prebuilt`
loads what `--prepare` compiled through the index by its recorded key (the key itself is then
not recomputed there: that part is the CPU rows'). Each fresh-process row is the median of
`--repeats` child processes; the CUDA context is created before the timed part, so AOT and
JIT rows time the same thing: finding the CUBIN, verifying it and loading it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cubinstore.internals import gemm_launch as _gemm  # noqa: E402

GEMM_FILES = ("kernels/gemm/sm90_bf16_gemm.cu", "kernels/gemm/sm90_bf16_gemm.cuh", "kernels/gemm/sm90_ptx.cuh")
GEMM_ENTRY = {_gemm.ENTRY: list(_gemm.ENTRY_TYPES)}
GEMM_POINT = {"bm": 128, "bn": 128, "bk": 64, "stages": 2, "cluster": 1, "swap": 0}
GEMM_DEFINES = ("BM={bm}", "BN={bn}", "BK={bk}", "STAGES={stages}", "CLUSTER_M={cluster}", "SWAP={swap}")
TINY_TU = ('extern "C" __global__ void scale(int n, float a, float* x) {\n'
           '  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }\n')
TINY_ENTRY = {"scale": ["i32", "f32", "ptr"]}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- what a child process runs ----------------------------------------------------------------------

def _template(store: Any) -> Any:
    from cubinstore.internals import template_for_sources

    return template_for_sources("gemm", list(GEMM_POINT), GEMM_FILES[0], {p: (ROOT / p).read_text() for p in GEMM_FILES},
                                store, defines=list(GEMM_DEFINES), entries=GEMM_ENTRY, archs=["sm_90a"],
                                includes=["cutlass"], package="kernels/gemm")


def _child(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns seconds."""
    from cubinstore.store import LocalLayer, MemoryLayer, Store

    store = Store([MemoryLayer(1 << 28), LocalLayer(args["home"])])
    out: dict[str, Any] = {}
    gpu = kind.startswith("gpu_")
    if not gpu:  # the CPU rows compare lookups, not imports: both sides get these before the timer
        import cubinstore.launch  # noqa: F401
        import cubinstore.manifest  # noqa: F401
    if gpu:
        from cubinstore.internals import cuda as _cuda

        _cuda.driver()
        _cuda.primary_context(0)
    if kind == "key_cutlass_statcached":
        from cubinstore.internals import key as _jitkey

        t = time.perf_counter()
        _jitkey.tree(args["cutlass"], local=LocalLayer(args["home"]))
        out["seconds"] = time.perf_counter() - t
    elif kind in ("identity_statcached", "core_statcached"):
        from cubinstore.internals import key as _jitkey

        local = LocalLayer(args["home"])
        t = time.perf_counter()
        if kind == "identity_statcached":
            _jitkey.find_toolkit(local=local)  # the whole include tree, for the full key
        else:
            _jitkey.toolkit_core(local=local)  # the programs and libdevice, for the direct key
        _jitkey.host_compiler(local=local)
        out["seconds"] = time.perf_counter() - t
    elif kind in ("jit_cold", "jit_warm", "jit_warm_fullkey", "gpu_jit_warm", "gpu_jit_warm_fullkey"):
        from cubinstore.internals import family

        # compile_family_point, also returning the compiler's result: what found the kernel and how
        # long the direct check (its request and lookup) took. The "fullkey" rows turn the direct path off.
        direct = not kind.endswith("_fullkey")
        template = _template(store)  # the bundle's blob write is not timed
        t = time.perf_counter()
        spec, found = family.compile_point(template, GEMM_POINT, "sm_90a", store=store,
                                           include_roots={"cutlass": args["cutlass"]}, direct=direct)
        out["key_index_fetch"] = time.perf_counter() - t
        out["found_by"] = found.found_by  # the first call's: direct, key or compile
        out["direct_check"] = found.direct_seconds  # the first call's only
        if gpu:
            import cubinstore
            from cubinstore.manifest import Manifest

            cubinstore.open(Manifest.build([spec]), store).kernel(spec.id, device=0)
        out["seconds"] = time.perf_counter() - t
        # The same point again in this process: trees, toolkit and host are known by now.
        t = time.perf_counter()
        family.compile_point(template, GEMM_POINT, "sm_90a", store=store, include_roots={"cutlass": args["cutlass"]},
                             direct=direct)
        out["again"] = time.perf_counter() - t
    elif kind == "aot_cpu":
        import cubinstore

        t = time.perf_counter()
        spec = cubinstore.open(args["manifest"], store).manifest.select(args["id"], (9, 0))
        store.get(spec.digest, spec.size, name=spec.id)
        out["seconds"] = time.perf_counter() - t
    elif kind == "gpu_jit_by_key":
        import cubinstore
        from cubinstore.internals import JitIndex, knobs as _env
        from cubinstore.manifest import KernelSpec, Manifest

        t = time.perf_counter()
        entry = JitIndex(LocalLayer(args["home"]), _env.lock_timeout()).get(args["key"])
        spec = KernelSpec(id=args["spec"]["id"], family="gemm", params=args["spec"]["params"], arch="sm_90a",
                          digest=entry.digest, size=entry.size, entries=GEMM_ENTRY, target=args["spec"]["target"])
        cubinstore.open(Manifest.build([spec]), store).kernel(spec.id, device=0)
        out["seconds"] = time.perf_counter() - t
    elif kind == "gpu_aot":
        import cubinstore

        t = time.perf_counter()
        cubinstore.open(args["manifest"], store).kernel(args["id"], device=0)
        out["seconds"] = time.perf_counter() - t
    else:
        raise SystemExit(f"unknown child {kind}")
    return out


def _spawn(kind: str, args: dict[str, Any], env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"child {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _repeat(kind: str, args: dict[str, Any], env: dict[str, str], n: int, field: str = "seconds") -> float:
    return _median([_spawn(kind, args, env)[field] for _ in range(n)])


# -- the rows ---------------------------------------------------------------------------------------

def _have_nvcc() -> bool:
    from cubinstore.errors import BadArgumentError
    from cubinstore.internals import locate_toolkit

    try:
        locate_toolkit()
    except BadArgumentError:
        return False
    return True


def _have_gpu() -> bool:
    from cubinstore.internals import cuda as _cuda

    ok, _ = _cuda.available()
    return ok


def _env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    env["CUBINSTORE_HOME"] = str(home)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


_RACY_S = 2.1  # stats younger than this are not cached (cubinstore._jit.key.RACY_NS)


def _past_racy_window(since: float) -> None:
    # Files written by --prepare or a copy are trusted by stat only once this old; until then a
    # warm hit checks content (correct, slower), which is not what a long-lived install sees.
    time.sleep(max(0.0, since + _RACY_S - time.time()))


def _warm_rows(kind: str, args: dict[str, Any], env: dict[str, str], repeats: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Fresh-process warm hits through the direct key and through the full key, interleaved."""
    _spawn(kind, args, env)  # fills this location's stat caches
    _spawn(kind + "_fullkey", args, env)
    direct, full = [], []
    for _ in range(repeats):
        direct.append(_spawn(kind, args, env))
        full.append(_spawn(kind + "_fullkey", args, env))
    return direct, full


def _found(results: list[dict[str, Any]]) -> str:
    return "/".join(sorted({str(r.get("found_by")) for r in results}))


def cpu_rows(work: Path, cutlass: Path, repeats: int) -> list[tuple[str, str, str]]:
    from cubinstore.internals import key as _jitkey

    pre = work / "cpu"
    recorded = prepare(pre, cutlass)  # the GEMM point compiled, and a one-kernel manifest of it
    prepared_at = time.time()
    rows = []
    files = sum(1 for _ in _jitkey._walk(cutlass, "cutlass"))
    for algo in ("xxh3", "sha256"):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            _jitkey.tree(cutlass, algo=algo, cached=False)
            times.append(time.perf_counter() - t)
        rows.append((f"key over the CUTLASS tree, {algo}, every file read", _ms(_median(times)),
                     f"{files} files, in-process, page cache warm"))
    _past_racy_window(prepared_at)
    home = pre / "home"
    env = _env_for(home)
    args = {"home": str(home), "cutlass": str(cutlass), "manifest": str(pre / "manifest.json"), "id": recorded["spec"]["id"]}
    _spawn("key_cutlass_statcached", args, env)  # fills the stat cache
    rows.append(("full key: CUTLASS tree, fresh process, stat cache", _ms(_repeat("key_cutlass_statcached", args, env, repeats)),
                 "walk + stat every file; contents hashed only if one changed"))
    _spawn("identity_statcached", args, env)
    rows.append(("full key: toolkit + host identity, fresh process", _ms(_repeat("identity_statcached", args, env, repeats)),
                 "stat cache over ~1,900 toolkit files; first process on a machine hashes ~200 MB once"))
    _spawn("core_statcached", args, env)
    rows.append(("direct key: toolkit programs + host identity, fresh process",
                 _ms(_repeat("core_statcached", args, env, repeats)),
                 "stat cache over nvcc, cicc, ptxas... and libdevice; only a slow check or a compile takes it"))
    direct, full = _warm_rows("jit_warm", args, env, repeats)
    checks = [w["direct_check"] for w in direct if "direct_check" in w]
    rows.append(("direct check, fresh process", _ms(_median(checks)),
                 "stat of the included files, each root's directories, the identities' files"))
    warm = _median([w["seconds"] for w in direct])
    rows.append(("JIT warm hit, fresh process: direct check + index + verified fetch", _ms(warm),
                 f"CPU part (no GPU load); found by {_found(direct)}"))
    rows.append(("JIT warm hit, fresh process, full key (direct path off)", _ms(_median([w["seconds"] for w in full])),
                 f"CPU part; found by {_found(full)}: key over CUTLASS + toolkit + host"))
    _spawn("aot_cpu", args, env)
    aot = _repeat("aot_cpu", args, env, repeats)
    rows.append(("AOT, fresh process: open manifest + verified fetch", _ms(aot), f"CPU part; JIT warm is {_ms(warm - aot)} above"))
    rows.append(("JIT hit again in the same process", _ms(_median([w["again"] for w in direct])),
                 "check remembered per process, like the trees: source hash + index read + fetch"))
    cold = []
    for i in range(max(1, repeats // 2)):
        cold_home = work / f"cold-home-{i}"
        cold.append(_spawn("jit_cold", {"home": str(cold_home), "cutlass": str(cutlass)}, _env_for(cold_home))["seconds"])
    rows.append(("JIT cold: key + nvcc + store (GEMM point, CuTe)", f"{_median(cold):.2f} s", "empty store each run"))
    return rows


def gpu_rows(home: Path, manifest: Path, kid: str, cutlass: Path | None, recorded: dict[str, Any] | None,
             repeats: int) -> list[tuple[str, str, str]]:
    env = _env_for(home)
    rows = []
    aot = _repeat("gpu_aot", {"home": str(home), "manifest": str(manifest), "id": kid}, env, repeats)
    rows.append(("AOT load from a manifest", _ms(aot), "open + fetch + sha256 + cuLibraryLoadData + layout check"))
    if cutlass is not None and _have_nvcc():
        args = {"home": str(home), "cutlass": str(cutlass)}
        direct, full = _warm_rows("gpu_jit_warm", args, env, repeats)
        total = _median([r["seconds"] for r in direct])
        rows.append(("JIT warm hit + load, fresh process (direct key)", _ms(total),
                     f"{_ms(total - aot)} above AOT; found by {_found(direct)}"))
        total = _median([r["seconds"] for r in full])
        rows.append(("JIT warm hit + load, fresh process (full key)", _ms(total),
                     f"{_ms(total - aot)} above AOT; found by {_found(full)}"))
    if recorded is not None:
        by_key = _repeat("gpu_jit_by_key", {"home": str(home), **recorded}, env, repeats)
        rows.append(("JIT index hit by recorded key + load", _ms(by_key), f"{_ms(by_key - aot)} above AOT, key not recomputed"))
    return rows


def prepare(out: Path, cutlass: Path) -> dict[str, Any]:
    """Compile the GEMM point into ``out/home`` and write a one-kernel AOT manifest of the same CUBIN."""
    from cubinstore import jit
    from cubinstore.manifest import SCHEMA, dumps_canonical
    from cubinstore.store import LocalLayer, Store

    store = Store([LocalLayer(out / "home")])
    spec = jit.compile_family_point(_template(store), GEMM_POINT, "sm_90a", store=store,
                                    include_roots={"cutlass": str(cutlass)})
    (out / "manifest.json").write_bytes(dumps_canonical({"schema": SCHEMA, "kernels": [spec.to_json()]}))
    from cubinstore.internals import warmset as _warmset

    rec = next(r for r in _warmset.records(LocalLayer(out / "home")) if r.digest == spec.digest)
    desc = {"key": rec.key, "spec": {"id": spec.id, "params": dict(spec.params), "target": spec.target},
            "digest": str(spec.digest)}
    (out / "bench.json").write_text(json.dumps(desc, indent=2) + "\n")
    return desc


def _print(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    print(f"{'measurement'.ljust(width)}  {'median'.rjust(vwidth)}  notes")
    print(f"{'-' * width}  {'-' * vwidth}  -----")
    for name, value, note in rows:
        print(f"{name.ljust(width)}  {value.rjust(vwidth)}  {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prepare", metavar="DIR", help="compile into DIR (a host with nvcc) and stop")
    parser.add_argument("--prebuilt", metavar="DIR", help="GPU rows from what --prepare wrote to DIR")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "ARGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], json.loads(args.child[1]))))
        return 0
    from cubinstore.errors import BadArgumentError
    from cubinstore.internals import cutlass_include

    try:
        cutlass: Path | None = cutlass_include()
    except BadArgumentError as exc:
        cutlass = None
        print(f"note: {exc}", file=sys.stderr)
    if args.prepare:
        if cutlass is None or not _have_nvcc():
            raise SystemExit("--prepare needs nvcc and the CUTLASS headers")
        out = Path(args.prepare).resolve()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        desc = prepare(out, cutlass)
        print(f"prepared {out}: {desc['spec']['id']} {desc['digest']} under JIT key xxh3:{desc['key']}")
        return 0
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench_jit.") as tmp:
        work = Path(tmp)
        if cutlass is not None and _have_nvcc():
            rows += cpu_rows(work, cutlass, args.repeats)
        else:
            print("note: no nvcc or CUTLASS headers here: CPU rows skipped", file=sys.stderr)
        if _have_gpu():
            if args.prebuilt:
                pre = Path(args.prebuilt).resolve()
                home = work / "gpu-home"
                shutil.copytree(pre / "home", home)  # a private copy: the runs write stats and stat caches
                _past_racy_window(time.time())
                recorded = json.loads((pre / "bench.json").read_text())
                rows += gpu_rows(home, pre / "manifest.json", recorded["spec"]["id"], cutlass, recorded, args.repeats)
            elif cutlass is not None and _have_nvcc():
                pre = work / "prepared"
                recorded = prepare(pre, cutlass)
                _past_racy_window(time.time())
                rows += gpu_rows(pre / "home", pre / "manifest.json", recorded["spec"]["id"], cutlass, recorded,
                                 args.repeats)
            else:
                print("note: GPU present but nothing to load: pass --prebuilt DIR", file=sys.stderr)
        else:
            print("note: no GPU here: GPU rows (AOT load, JIT warm hit + load) skipped", file=sys.stderr)
    if rows:
        _print(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
