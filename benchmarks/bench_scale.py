"""cubinstore at tens of thousands of kernels: every command and lookup, side by side, in one run.

    python benchmarks/bench_scale.py                      # 1,000 / 10,000 / 23,000 kernels
    python benchmarks/bench_scale.py --sizes 1000,10000 --prefetch-max 10000 --plots docs/benchmarks

For each N it builds a synthetic release of N kernels over N distinct CUBINs (a real CUBIN
from bazel-bin/ or nvcc with 8 unique bytes appended, or, with neither, ELF-headed random
bytes), serves the CAS from nginx on loopback, and times:

  open        Manifest.from_path (best of 3, in process) and the first open in a fresh process
  lookup      Manifest.select(family, cc, **params), mean of 20,000 random points (warm)
  prefetch    `cubinstore prefetch` with CUBINSTORE_FETCH_JOBS=1, --jobs-small and --jobs, beside the
              floor: a plain urllib loop that GETs and writes the same blobs (no hash, no fsync)
  ls, verify  `cubinstore ls M`, `verify M` (the closure), `verify` (the whole store)
  pack        `cubinstore pack M out.tar` beside `tar -cf` of the same CAS files
  unpack      `cubinstore unpack out.tar --expect D` into an empty store
  gc          `cubinstore gc --max-bytes <half the store>`
  manifest    the CubinManifest action (tools/manifest_tool.py) over the N CUBINs (needs a real CUBIN)

Commands run as real CLI processes (their interpreter start, about 0.1 s, is included). The
package's bytecode is compiled first, as an install does: with PYTHONDONTWRITEBYTECODE set and a
stale ``__pycache__`` (an edited checkout), every CLI process would compile the modules it imports
(about 30 ms CPU of a 0.5 s pack of 10,000 blobs on the 2-core host).
Wall-clock seconds on whatever host runs it: compare rows of one run, not runs of two hosts;
the CPU columns (user + system of the process) and each row's load average say how much of a
wall time was the host's load.
``--plots DIR`` writes cost-vs-N PNGs (matplotlib); ``--json`` all numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the loopback nginx config the tests use

from helpers.net import free_port, nginx_conf, wait_for_port  # noqa: E402

from cubinstore.internals import Arch, param_layout, param_type  # noqa: E402
from cubinstore.manifest import Manifest, dumps_canonical  # noqa: E402

TEMPLATE_CANDIDATES = ("bazel-bin/kernels/axpy/axpy_f32_vec4_sm_90a.cubin",)
ENTRY = ("axpy_f32", ["i32", "f32", "ptr", "ptr"])


def template_cubin(work: Path) -> tuple[bytes, bool]:
    """A real CUBIN (from bazel-bin, else compiled by nvcc), or ELF-headed random bytes: (bytes, real)."""
    for candidate in TEMPLATE_CANDIDATES:
        path = ROOT / candidate
        if path.is_file():
            return path.read_bytes(), True
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = work / "template.cubin"
        done = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", "-DDTYPE_f32", "-DVEC=4",
                               "-I", str(ROOT), str(ROOT / "kernels/axpy/axpy.cu"), "-o", str(out)],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return out.read_bytes(), True
    return b"\x7fELF\x02\x01\x01" + random.Random(0).randbytes(3961), False


def make_release(work: Path, n: int, template: bytes, pad: int) -> tuple[Path, Manifest, Path, list[dict[str, Any]]]:
    """N kernels over N CUBINs written to work/www/cas/<hex>; the manifest; the build spec for the action."""
    cas = work / "www" / "cas"
    cas.mkdir(parents=True)
    symbol, types = ENTRY
    offsets = list(param_layout([param_type(t) for t in types], Arch.parse("sm_90a")))
    kernels, spec = [], []
    for i in range(n):
        data = template + i.to_bytes(8, "little") + bytes(pad)  # past the ELF's sections: still the same CUBIN
        hex_ = hashlib.sha256(data).hexdigest()
        (cas / hex_).write_bytes(data)
        params = {"bm": 64 * (i % 50 + 1), "bn": i // 50}
        kid = f"syn/bm{params['bm']}/bn{params['bn']}/sm_90a"
        launch = {"block": [256], "grid": ["cdiv(args[0], 1024)"]}
        kernels.append({"id": kid, "family": "syn", "params": params, "arch": "sm_90a", "digest": f"sha256:{hex_}",
                        "size": len(data), "target": f"//kernels/syn:syn_{i}_sm_90a",
                        "entries": {symbol: {"name": symbol, "params": types, "offsets": offsets,
                                             "launch": {"block": [256, 1, 1], "shared_mem": 0, "grid": launch["grid"]}}}})
        spec.append({"id": kid, "family": "syn", "params": params, "arch": "sm_90a", "entries": {symbol: types},
                     "launch": {symbol: launch}, "target": f"//kernels/syn:syn_{i}_sm_90a", "cubin": str(cas / hex_)})
    path = work / "manifest.json"
    path.write_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels}))
    return path, Manifest.from_path(path), cas, spec


class Nginx:
    def __init__(self, work: Path) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).exists():
            raise SystemExit("nginx is not installed (tools/bootstrap.sh installs it)")
        self.port = free_port()
        conf = work / "nginx.conf"
        conf.write_text(nginx_conf(work, self.port, work / "www", work / "access.log"))
        self.proc = subprocess.Popen([nginx, "-p", str(work), "-c", str(conf), "-e", str(work / "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_for_port(self.port, self.proc, time.monotonic() + 10):
            raise SystemExit(f"nginx did not start: {(work / 'error.log').read_text(errors='replace')[-500:]}")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: CPU seconds (user + system) of the last cli() or run() child: a loaded host stretches wall time
#: by 2-3x, CPU time much less.
LAST_CPU = [0.0]


def run(cmd: list[str], **kwargs: Any) -> float:
    """Wall seconds of one child process (its CPU seconds in LAST_CPU)."""
    c, t = _children_cpu(), time.perf_counter()
    subprocess.run(cmd, check=True, **kwargs)
    LAST_CPU[0] = _children_cpu() - c
    return time.perf_counter() - t


def cli(args: list[str], home: Path, **env: str) -> float:
    """Seconds one `cubinstore` command takes as a process (stdout discarded; CPU seconds in LAST_CPU)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    full.update(PYTHONPATH=str(ROOT), CUBINSTORE_HOME=str(home), **env)
    c, t = _children_cpu(), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cubinstore", *args], env=full, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    elapsed = time.perf_counter() - t
    LAST_CPU[0] = _children_cpu() - c
    if done.returncode not in (0, 1):
        raise SystemExit(f"cubinstore {' '.join(args)} failed ({done.returncode}): {done.stderr[-800:]}")
    return elapsed


def urllib_floor(url: str, blobs: list[tuple[str, int]], out: Path) -> float:
    """A plain loop: GET each blob (a new connection each, as urllib does) and write it to a file."""
    out.mkdir(parents=True)
    c, t = _self_cpu(), time.perf_counter()
    for hex_, _size in blobs:
        with urllib.request.urlopen(f"{url}/cas/{hex_}", timeout=30) as resp:
            data = resp.read()
        (out / hex_).write_bytes(data)
    LAST_CPU[0] = _self_cpu() - c
    return time.perf_counter() - t


def measure(n: int, opts: argparse.Namespace, base: Path, template: bytes, real: bool) -> dict[str, Any]:
    work = base / f"n{n}"
    work.mkdir()
    row: dict[str, Any] = {"n": n}
    t = time.perf_counter()
    path, manifest, cas, spec = make_release(work, n, template, opts.pad)
    row["setup_s"] = time.perf_counter() - t
    row["manifest_mb"] = len(manifest.raw) / 1e6

    opens, cpu = [], []
    for _ in range(3):
        t, c = time.perf_counter(), time.process_time()
        opened = Manifest.from_path(path)
        opens.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        del opened  # freeing the last one (30-40 ms at 23,000 on a 2-core host) is no part of an open
    row["open_s"] = min(opens)
    row["open_cpu_s"] = min(cpu)  # a loaded host stretches wall time; CPU time is what open costs
    code = f"import time; t = time.perf_counter(); import cubinstore; cubinstore.open({str(path)!r}); print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True)
    row["open_fresh_process_s"] = float(out.stdout.strip())

    rng = random.Random(1)
    points = [rng.choice(manifest.kernels).params for _ in range(20_000)]
    for p in points[:200]:
        manifest.select("syn", (9, 0), **p)
    t = time.perf_counter()
    for p in points:
        manifest.select("syn", (9, 0), **p)
    row["lookup_us"] = (time.perf_counter() - t) / len(points) * 1e6

    server = Nginx(work)
    try:
        blobs = [(d.hex, s) for d, s in manifest.blobs]
        home = work / "home"
        if n <= opts.prefetch_max:
            row["urllib_floor_s"] = urllib_floor(server.url, blobs, work / "floor")
            row["urllib_floor_cpu_s"] = LAST_CPU[0]
            row["prefetch_1_s"] = cli(["prefetch", str(path), "--remote", server.url], work / "home1",
                                      CUBINSTORE_FETCH_JOBS="1")
            row["prefetch_1_cpu_s"] = LAST_CPU[0]
            shutil.rmtree(work / "home1")
            if opts.jobs_small:
                row["prefetch_small_jobs"] = opts.jobs_small
                row["prefetch_small_s"] = cli(["prefetch", str(path), "--remote", server.url], work / "home4",
                                              CUBINSTORE_FETCH_JOBS=str(opts.jobs_small))
                shutil.rmtree(work / "home4")
            row["prefetch_jobs"] = opts.jobs
            row["prefetch_par_s"] = cli(["prefetch", str(path), "--remote", server.url], home,
                                        CUBINSTORE_FETCH_JOBS=str(opts.jobs))
        else:  # fill the store without the network: unpack is measured below anyway
            from cubinstore.store import LocalLayer

            local = LocalLayer(home)
            with local.batch():
                for hex_, _ in blobs:
                    local.write_verified(__import__("cubinstore").Digest(hex_), (cas / hex_).read_bytes())
    finally:
        server.stop()

    row["ls_s"] = cli(["ls", str(path)], home)
    row["verify_manifest_s"] = cli(["verify", str(path)], home)
    row["verify_store_s"] = cli(["verify"], home)
    bundle = work / "release.tar"
    row["pack_s"] = cli(["pack", str(path), str(bundle)], home, CUBINSTORE_OFFLINE="1")
    row["pack_cpu_s"] = LAST_CPU[0]
    row["tar_s"] = run(["tar", "-cf", str(work / "plain.tar"), "-C", str(home / "v1"), "cas"])
    row["tar_cpu_s"] = LAST_CPU[0]
    row["unpack_s"] = cli(["unpack", str(bundle), "--expect", str(manifest.digest)], work / "home2")
    total = sum(s for _, s in blobs)
    row["gc_s"] = cli(["gc", "--max-bytes", str(total // 2)], home)

    if real and n <= opts.action_max:
        spec_path = work / "spec.json"
        spec_path.write_text(json.dumps({"demangler": "c++filt", "kernels": spec}))
        t = time.perf_counter()
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "manifest_tool.py"), str(spec_path), str(work / "built.json")],
                              capture_output=True, text=True, check=False)
        row["manifest_action_s"] = time.perf_counter() - t if done.returncode == 0 else None
        if done.returncode != 0:
            print(f"manifest action failed at {n}: {done.stderr[-500:]}", file=sys.stderr)
    row["load_avg"] = os.getloadavg()[0]  # the host's load as this N finished
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    return row


COLUMNS = [
    ("n", "N", "{:,}"), ("open_s", "open s", "{:.3f}"), ("open_cpu_s", "open CPU s", "{:.3f}"), ("open_fresh_process_s", "open new proc s", "{:.3f}"),
    ("lookup_us", "lookup us", "{:.1f}"), ("urllib_floor_s", "urllib floor s", "{:.2f}"),
    ("urllib_floor_cpu_s", "floor CPU s", "{:.2f}"), ("prefetch_1_s", "prefetch j=1 s", "{:.2f}"),
    ("prefetch_1_cpu_s", "prefetch j=1 CPU s", "{:.2f}"), ("prefetch_small_s", "prefetch j=j s", "{:.2f}"),
    ("prefetch_par_s", "prefetch j=J s", "{:.2f}"),
    ("ls_s", "ls s", "{:.2f}"), ("verify_manifest_s", "verify M s", "{:.2f}"), ("verify_store_s", "verify s", "{:.2f}"),
    ("pack_s", "pack s", "{:.2f}"), ("pack_cpu_s", "pack CPU s", "{:.2f}"), ("tar_s", "tar s", "{:.2f}"),
    ("tar_cpu_s", "tar CPU s", "{:.2f}"), ("unpack_s", "unpack s", "{:.2f}"),
    ("gc_s", "gc s", "{:.2f}"), ("manifest_action_s", "manifest action s", "{:.2f}"),
]


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in COLUMNS]
        print("| " + " | ".join(cells) + " |")
    print()
    for row in rows:
        ratios = []
        if row.get("prefetch_1_s") and row.get("urllib_floor_s"):
            small = (f"j={row['prefetch_small_jobs']} / floor {row['prefetch_small_s'] / row['urllib_floor_s']:.2f}x, "
                     if row.get("prefetch_small_s") else "")
            ratios.append(f"prefetch j=1 / floor {row['prefetch_1_s'] / row['urllib_floor_s']:.2f}x "
                          f"(CPU {row['prefetch_1_cpu_s'] / row['urllib_floor_cpu_s']:.2f}x), {small}"
                          f"j={row['prefetch_jobs']} / floor {row['prefetch_par_s'] / row['urllib_floor_s']:.2f}x")
        ratios.append(f"pack / tar {row['pack_s'] / row['tar_s']:.2f}x (CPU {row['pack_cpu_s'] / max(row['tar_cpu_s'], 1e-3):.2f}x)")
        ratios.append(f"load average {row['load_avg']:.1f}")
        print(f"N={row['n']:,}: manifest {row['manifest_mb']:.1f} MB; " + "; ".join(ratios))


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    ns = [r["n"] for r in rows]
    groups = {
        "scale_open_lookup.png": ("Manifest open and lookup", [("open_s", "open (s)"), ("open_cpu_s", "open, CPU (s)"),
                                                               ("open_fresh_process_s", "open, fresh process (s)")],
                                  [("lookup_us", "lookup (us)")]),
        "scale_prefetch.png": ("Prefetch from loopback nginx", [("urllib_floor_s", "urllib loop floor"), ("prefetch_1_s", "prefetch, 1 job"),
                                                                ("prefetch_small_s", "prefetch, few jobs"),
                                                                ("prefetch_par_s", "prefetch, default jobs")], []),
        "scale_commands.png": ("CLI commands", [("ls_s", "ls"), ("verify_manifest_s", "verify MANIFEST"), ("verify_store_s", "verify"),
                                                ("pack_s", "pack"), ("tar_s", "tar (reference)"), ("unpack_s", "unpack"),
                                                ("gc_s", "gc"), ("manifest_action_s", "manifest action")], []),
    }
    written = []
    for name, (title, left, right) in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for key, label in left:
            pts = [(r["n"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xlabel("kernels (N)")
        ax.set_ylabel("seconds")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if right:
            ax2 = ax.twinx()
            for key, label in right:
                pts = [(r["n"], r[key]) for r in rows if r.get(key) is not None]
                ax2.plot(*zip(*pts), marker="s", linestyle="--", color="tab:red", label=label)
            ax2.set_ylabel("microseconds per lookup")
            ax2.set_ylim(bottom=0)
            ax2.legend(loc="lower right")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"{title} (cost vs N; {', '.join(f'{n:,}' for n in ns)})")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,23000", help="comma-separated kernel counts")
    parser.add_argument("--prefetch-max", type=int, default=23000, help="skip the prefetch rows above this N")
    parser.add_argument("--action-max", type=int, default=23000, help="skip the manifest action above this N")
    parser.add_argument("--jobs", type=int, default=16, help="CUBINSTORE_FETCH_JOBS of the parallel prefetch row")
    parser.add_argument("--jobs-small", type=int, default=4, help="a second parallel row with this many jobs (0: none)")
    parser.add_argument("--pad", type=int, default=0, help="bytes added to each synthetic CUBIN")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--keep", action="store_true", help="keep the work directories")
    opts = parser.parse_args()
    sizes = [int(s) for s in opts.sizes.split(",") if s.strip()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "cubinstore")], check=True,
                   stdout=subprocess.DEVNULL)  # see the docstring: time the commands, not the compiler
    base = Path(tempfile.mkdtemp(prefix="cubinstore-scale-"))
    template, real = template_cubin(base)
    print(f"synthetic CUBINs: {len(template) + 8 + opts.pad} bytes each ({'a real CUBIN' if real else 'random ELF bytes'}); "
          f"work in {base}; host {os.cpu_count()} CPUs", flush=True)
    rows = []
    for n in sizes:
        row = measure(n, opts, base, template, real)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1) + "\n")
    if opts.plots:
        for p in plot(rows, opts.plots):
            print(f"wrote {p}")
    if not opts.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
