"""Time to first kernel with cubinstore, against compiling the kernel with nvcc.

    python benchmarks/startup.py --manifest bazel-bin/kernels/manifest.json

Prints two tables:
  1. process start -> first launched kernel finished, for a fresh Python process
     fetching from (a) a filled local store and (b) an HTTP store on loopback
     (`python -m http.server` serving `cas/<hex>`, an empty local store each run),
     beside the time `nvcc` takes to compile the same CUBIN;
  2. per kernel, in one warm process: `Library.kernel()` (select + fetch + sha256
     verify + ELF check + module load + layout check) against a plain file read of
     the same bytes plus the same module load.
Medians of `--repeats` runs. Needs a CUDA device; nvcc only for the compile column.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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

DEFAULT_KERNELS = ("axpy/f32/vec4/sm_90a", "transpose/bf16/tile64/sm_90a")


# -- child: one cold process, start to first kernel ----------------------------------------------------


def child(manifest_path: str, kernel_id: str, started: float) -> None:
    """Runs in a fresh interpreter; prints one JSON line of wall-clock marks (time.time())."""
    marks = {"spawned": started, "interpreter": time.time()}
    from cubinstore import launch
    from cubinstore.internals import cuda as _cuda

    marks["imported"] = time.time()
    lib = launch.open(manifest_path)  # Store.from_env(): CUBINSTORE_HOME / CUBINSTORE_REMOTE
    drv = _cuda.driver()
    _cuda.primary_context(0)
    marks["cuda_ready"] = time.time()
    kernel = lib.kernel(kernel_id, device=0)
    marks["kernel_loaded"] = time.time()
    with _cuda.on_device(0):
        family = kernel.spec.family
        entry = next(iter(kernel.spec.entries))
        if family == "axpy":
            n = 1 << 20
            nbytes = n * (8 if kernel.spec.params["dtype"] == "f64" else 4)
            x = _cuda.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            y = _cuda.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            _cuda.check(drv.cuMemsetD8(x, 0, nbytes), "cuMemsetD8")
            _cuda.check(drv.cuMemsetD8(y, 0, nbytes), "cuMemsetD8")
            vec = int(kernel.spec.params["vec"])
            kernel.launch(entry, grid=(-(-n // (256 * vec)),), block=(256,), args=(n, 2.0, int(x), int(y)))
        elif family == "transpose":
            rows = cols = 1024
            nbytes = rows * cols * 4
            x = _cuda.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            y = _cuda.check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            _cuda.check(drv.cuMemsetD8(x, 0, nbytes), "cuMemsetD8")
            tile = int(kernel.spec.params["tile"])
            kernel.launch(entry, grid=(-(-cols // tile), -(-rows // tile), 1), block=(32, 8, 1),
                          args=(int(x), int(y), rows, cols))
        else:
            raise SystemExit(f"benchmark knows how to launch axpy and transpose, not {family!r}")
        _cuda.check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
    marks["first_kernel_done"] = time.time()
    print(json.dumps(marks))


# -- parent --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, deadline: float) -> None:
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"http.server on port {port} did not start")


class ChildFailed(Exception):
    """A cold-start child exited non-zero; the message is its last stderr line."""


def _run_child(manifest: str, kernel_id: str, env: dict[str, str]) -> dict[str, float]:
    started = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", manifest, kernel_id, repr(started)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"child for {kernel_id} failed ({done.returncode}):\n{done.stderr}", file=sys.stderr)
        raise ChildFailed(last)
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "total": marks["first_kernel_done"] - marks["spawned"],
        "interpreter": marks["interpreter"] - marks["spawned"],
        "import": marks["imported"] - marks["interpreter"],
        "cuda_init": marks["cuda_ready"] - marks["imported"],
        "fetch_load": marks["kernel_loaded"] - marks["cuda_ready"],
        "launch": marks["first_kernel_done"] - marks["kernel_loaded"],
    }


def _nvcc_seconds(nvcc: str, spec: Any, cutlass: str | None, repeats: int, work: Path) -> float | None:
    src = ROOT / "kernels" / spec.family / f"{spec.family}.cu"
    if not src.is_file():
        return None
    defines = [f"-D{k.upper()}_{v}" if isinstance(v, str) else f"-D{k.upper()}={v}" for k, v in spec.params.items()]
    cmd = [nvcc, "-cubin", f"-arch={spec.arch}", "-std=c++17", "-O3", *defines, f"-I{ROOT}"]
    if cutlass:
        cmd.append(f"-I{cutlass}")
    cmd += [str(src), "-o", str(work / "bench.cubin")]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        times.append(time.perf_counter() - t)
        if done.returncode != 0:
            print(f"nvcc failed for {spec.id}: {done.stderr.strip()[:500]}", file=sys.stderr)
            return None
    return statistics.median(times)


def _in_process(manifest: Any, home: Path, ids: list[str], repeats: int) -> list[dict[str, Any]]:
    from cubinstore import launch
    from cubinstore.internals import cuda as _cuda, device
    from cubinstore.store import LocalLayer, Store

    local = LocalLayer(home)
    before = device.current()

    def plain(spec: Any) -> None:
        # The same driver calls launch.py makes, on bytes read with no verification.
        with open(local.path_for(spec.digest), "rb") as f:
            data = f.read()
        with _cuda.on_device(0):
            library = _cuda.load_library(data, spec.id)
            for entry in spec.entries:
                _cuda.library_function(library, entry, spec.id)

    def ours(spec: Any) -> float:
        # Force a real fetch + load: a new Devices (the real driver's) has loaded nothing, as in a new
        # process (cubinstore._driver.device.use); its device facts asked before the clock starts.
        devices = device.Devices()
        devices.check_ordinal(0)
        devices.compute_capability(0)
        device.use(devices)
        launch.loaded_module_count()
        lib = launch.Library(manifest, Store([LocalLayer(home)]))  # no memory layer: read the disk
        t = time.perf_counter()
        lib.kernel(spec.id, device=0)
        return time.perf_counter() - t

    def fetch_only(spec: Any) -> float:
        store = Store([LocalLayer(home)])
        t = time.perf_counter()
        store.get(spec.digest, spec.size, name=spec.id)
        return time.perf_counter() - t

    rows = []
    try:
        for kid in ids:
            spec = manifest.by_id(kid)
            ours(spec)  # warm: first-touch costs of the code paths
            plain(spec)
            a, b, c = [], [], []
            for _ in range(repeats):
                a.append(ours(spec))
                t = time.perf_counter()
                plain(spec)
                b.append(time.perf_counter() - t)
                c.append(fetch_only(spec))
            rows.append({"id": kid, "size": spec.size, "cubinstore_ms": statistics.median(a) * 1e3,
                         "plain_ms": statistics.median(b) * 1e3, "fetch_verify_ms": statistics.median(c) * 1e3})
    finally:
        device.use(before)
    return rows


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=os.environ.get("CUBINSTORE_TEST_MANIFEST", "bazel-bin/kernels/manifest.json"))
    parser.add_argument("--kernel", action="append", help="kernel id for the cold-start table (repeatable)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    parser.add_argument("--cutlass-include",
                        help="directory holding cute/ and cutlass/ for the transpose compile (default: the JIT's)")
    parser.add_argument("--json", help="also write all numbers here")
    opts = parser.parse_args()
    if opts.cutlass_include is None:
        from cubinstore.errors import BadArgumentError
        from cubinstore.internals import cutlass_include

        try:
            opts.cutlass_include = str(cutlass_include())
        except BadArgumentError as exc:  # only the nvcc column needs them
            print(f"note: {exc}", file=sys.stderr)

    from cubinstore.internals import cuda as _cuda, device
    from cubinstore.manifest import Manifest
    from cubinstore.store import DirectorySource, LocalLayer, Store

    manifest_path = str(Path(opts.manifest).resolve())
    manifest = Manifest.from_path(manifest_path)
    cc = device.compute_capability(0)
    from cubinstore.manifest import arch_compatible

    runnable = [k.id for k in manifest if arch_compatible(k.arch, cc)]
    cold_ids = opts.kernel or [k for k in DEFAULT_KERNELS if k in runnable] or runnable[:1]

    work = Path(tempfile.mkdtemp(prefix="cubinstore-bench-"))
    home = work / "home"
    cas = work / "http" / "cas"
    cas.mkdir(parents=True)
    filler = Store([LocalLayer(home), DirectorySource(Path(manifest_path).parent)])
    for kid in runnable:
        spec = manifest.by_id(kid)
        data = filler.get(spec.digest, spec.size, name=kid)
        (cas / spec.digest.hex).write_bytes(data)

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(work / "http")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    results: dict[str, Any] = {"versions": _cuda.versions(), "compute_capability": cc, "cold": [], "per_kernel": []}
    try:
        _wait_port(port, time.time() + 10)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
        base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        for kid in cold_ids:
            spec = manifest.by_id(kid)
            runs: dict[str, list[dict[str, float]]] = {"local": [], "http": []}
            failed: dict[str, str] = {}
            for i in range(opts.repeats):
                fresh = work / f"home-http-{kid.replace('/', '_')}-{i}"
                envs = {
                    "local": {**base_env, "CUBINSTORE_HOME": str(home), "CUBINSTORE_OFFLINE": "1"},
                    "http": {**base_env, "CUBINSTORE_HOME": str(fresh), "CUBINSTORE_REMOTE": f"http://127.0.0.1:{port}"},
                }
                for source, env in envs.items():
                    if source in failed:
                        continue
                    try:
                        runs[source].append(_run_child(manifest_path, kid, env))
                    except ChildFailed as exc:
                        failed[source] = str(exc)  # reported in the table; the other source still runs
            nvcc_s = _nvcc_seconds(opts.nvcc, spec, opts.cutlass_include, max(1, min(3, opts.repeats)), work) \
                if opts.nvcc and Path(opts.nvcc).exists() else None
            results["cold"].append({
                "id": kid,
                **{source: _medians(r) if r else {"failed": failed[source]} for source, r in runs.items()},
                "nvcc_s": nvcc_s,
            })
    finally:
        server.terminate()
        server.wait(timeout=10)

    results["per_kernel"] = _in_process(manifest, home, runnable, opts.repeats)
    shutil.rmtree(work, ignore_errors=True)

    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1) + "\n")
    _print(results)


def _print(results: dict[str, Any]) -> None:
    v = results["versions"]
    print(f"\ncuda.core {v.get('cuda.core')}, cuda.bindings {v.get('cuda.bindings')}, driver {v.get('driver')}, "
          f"compute capability {results['compute_capability']}")
    print("\nProcess start -> first kernel finished (median, ms); phases: interpreter / import / CUDA init+ctx / fetch+verify+load / launch+sync")
    print(f"{'kernel':48} {'source':6} {'total':>8} {'interp':>7} {'import':>7} {'cuda':>7} {'fetch+load':>10} {'launch':>7} {'nvcc':>8}")
    for row in results["cold"]:
        nvcc = "n/a" if row["nvcc_s"] is None else f"{row['nvcc_s'] * 1e3:.0f}"
        for source in ("local", "http"):
            r = row[source]
            if "failed" in r:
                print(f"{row['id']:48} {source:6} failed: {r['failed']}")
                continue
            print(f"{row['id']:48} {source:6} {r['total'] * 1e3:8.1f} {r['interpreter'] * 1e3:7.1f} {r['import'] * 1e3:7.1f} "
                  f"{r['cuda_init'] * 1e3:7.1f} {r['fetch_load'] * 1e3:10.2f} {r['launch'] * 1e3:7.2f} {nvcc:>8}")
    print("\nPer kernel in a warm process (median, ms): Library.kernel() vs plain file read + the same module load")
    print(f"{'kernel':48} {'bytes':>7} {'cubinstore':>10} {'fetch+verify':>12} {'plain':>8} {'ratio':>6}")
    for row in results["per_kernel"]:
        print(f"{row['id']:48} {row['size']:7d} {row['cubinstore_ms']:10.3f} {row['fetch_verify_ms']:12.3f} "
              f"{row['plain_ms']:8.3f} {row['cubinstore_ms'] / row['plain_ms']:6.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        main()
