"""The runtime at the speed of a raw load: import time, per-kernel verified loads, concurrent starts.

    python benchmarks/bench_runtime.py --manifest bazel-bin/kernels/manifest.json

Prints, side by side in one run:
  1. `import cubinstore`: median of fresh interpreters, and `python -X importtime`'s heaviest lines;
  2. per CUBIN, from a filled local store (p50 / p99 of --samples reads; no GPU needed):
     raw file read | read + sha256 | Store.get (verified, a fresh Store: no memory layer);
  2b. the host side of Library.kernel(), everything but the driver (no GPU needed; with no
     manifest, synthetic ELF-headed blobs of the sm_90a CUBINs' sizes): read + sha256 (the peer
     without its load) | Store.get | Library.kernel() with the driver's three calls stubbed
     (select, fetch, verify, ELF check, module and Kernel objects) | the same of bytes verified
     before in the process (memory layer), p50 / p99, side by side;
  3. per kernel, fresh loads on GPU 0 (p50 / p99): raw (read + bare cuda.bindings cuLibraryLoadData +
     get function: no cubinstore code) | the plain verified peer (raw + sha256) | Library.kernel() from
     an owned local store (size + xxh3-128 record, issue 31), the kernel's spec built before | the
     same at the kernel's first selection in a manifest (its spec built in the call, as a process's
     first call of each kernel builds it) | the same with CUBINSTORE_VERIFY=full (sha256) |
     Library.kernel() of bytes this process verified before (memory layer) | the layout check alone;
     each module unloaded again so every sample is a fresh load, the paths' order rotated from
     sample to sample (--paths rotated: a load's time depends on what ran just before it) or
     shuffled (--paths shuffled: each path also follows each other one), each sample through every
     CUBIN before the next (--order cycle, a start-up) or each CUBIN's samples in a row (--order
     repeat); ours also through Python alone (CUBINSTORE_NATIVE=0);
  3b. where a fresh load's time goes, the peer's and Library.kernel()'s side by side (median us
     per load over every CUBIN, interleaved): reading and checking, the driver's load
     (cuLibraryLoadData), its get function (cuLibraryGetKernel + cuKernelGetFunction), each timed
     where cuda.bindings is called, and the rest: everything cubinstore adds;
  3c. the rest, layer by layer (median us, interleaved; needs the compiled helper): Library.kernel()
     (its spec built in the call, as at a process's first selection of a kernel, and built before,
     as in 3 and 3b), the loader alone, and the fewest Python steps a first load needs around the
     same read and driver calls, reading through Store.get and through LocalLayer.read_verified:
     what each layer adds, and the floor under any Python loader;
  4. the load phase (every runnable kernel) of 1 process and of --procs processes started
     together on one local store: Library.kernel() of each, with the store's modules imported
     in the first call (as a serving process does) and with the store opened before the timed
     part (as the peer imports hashlib before it) | the plain peer (read + sha256 + load of
     each) | raw (read + load, nothing verified), with the time per kernel against raw's;
  5. the goals of issue 31 against this run.
Sections 3 and 4 need a CUDA device and are skipped with the reason when there is none;
--host-only runs section 2b alone.
The package is byte-compiled first, as pip leaves an installed package: a checkout carried to a
host that writes no `__pycache__` otherwise compiles the store's modules from source inside the
first load of every child (17 ms of 23-31 ms on the H200, 2026-12-02).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def env_for(home: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    env["PYTHONPATH"] = str(ROOT)
    if home is not None:
        env.update(CUBINSTORE_HOME=str(home), CUBINSTORE_OFFLINE="1")
    return env


# -- 1. import time -------------------------------------------------------------------------------

def import_time(runs: int) -> dict[str, Any]:
    code = "import time; t = time.perf_counter(); import cubinstore; print(time.perf_counter() - t)"
    times = [float(subprocess.run([sys.executable, "-c", code], env=env_for(), capture_output=True, text=True,
                                  check=True).stdout) for _ in range(runs)]
    trace = subprocess.run([sys.executable, "-X", "importtime", "-c", "import cubinstore"], env=env_for(),
                           capture_output=True, text=True, check=True).stderr
    lines = []
    for line in trace.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            lines.append((int(m.group(1)), int(m.group(2)), len(m.group(3)) // 2, m.group(4)))
    total = next((cum for _, cum, _, name in lines if name == "cubinstore"), None)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "importtime_cumulative_us": total,
            "heaviest": sorted(lines, reverse=True)[:15], "trace": trace}


# -- 2. reads from the local store ----------------------------------------------------------------

def fill_store(manifest_path: Path, home: Path, cc: tuple[int, int] | None) -> tuple[Any, list[Any]]:
    from cubinstore.manifest import Manifest, arch_compatible
    from cubinstore.store import DirectorySource, LocalLayer, Store

    manifest = Manifest.from_path(manifest_path)
    specs = [k for k in manifest if cc is None or arch_compatible(k.arch, cc)]
    filler = Store([LocalLayer(home), DirectorySource(manifest_path.parent)])
    for spec in specs:
        filler.get(spec.digest, spec.size, name=spec.id)
    return manifest, specs


def reads(home: Path, specs: list[Any], samples: int) -> list[dict[str, Any]]:
    from cubinstore.store import LocalLayer, Store

    local = LocalLayer(home)
    store_ = Store([local])
    rows = []
    for spec in specs:
        path = local.path_for(spec.digest)
        raw, hashed, store = [], [], []
        for _ in range(samples):
            t = time.perf_counter()
            with open(path, "rb") as f:
                data = f.read()
            raw.append(time.perf_counter() - t)
            t = time.perf_counter()
            with open(path, "rb") as f:
                data = f.read()
            hashlib.sha256(data).hexdigest()
            hashed.append(time.perf_counter() - t)
            s = store_  # one store, as in a process; no memory layer: every byte read and verified
            t = time.perf_counter()
            s.get(spec.digest, spec.size, name=spec.id)
            store.append(time.perf_counter() - t)
        rows.append({"id": spec.id, "size": spec.size, **{f"{name}_{q}": pct(v, p) * 1e3 for name, v in
                     (("raw", raw), ("sha", hashed), ("store", store)) for q, p in (("p50", 0.5), ("p99", 0.99))}})
    return rows


# -- the driver as the runtime is handed it --------------------------------------------------------
# The runtime takes a substitute driver through one hook, `cubinstore._driver.device.use`; a new
# `Devices` there has loaded nothing, so each sample below is a fresh load without reaching inside.

def driver_with(**replaced: Any) -> Any:
    """`cubinstore._driver.cuda`'s calls with `replaced` ones swapped (plain attributes: each call
    costs what the module's does)."""
    from types import SimpleNamespace

    from cubinstore.internals import cuda as _cuda

    calls = {name: getattr(_cuda, name) for name in dir(_cuda) if not name.startswith("_")}
    return SimpleNamespace(**{**calls, **replaced})


def fresh_loads(driver: Any = None) -> None:
    """From here on a load is fresh, as in a new process: a new `Devices` over `driver` has loaded
    nothing. Its device facts and its (empty) module cache are made before the clock starts, as a
    running process has them."""
    from cubinstore import launch
    from cubinstore.internals import device

    devices = device.Devices(driver)
    devices.check_ordinal(0)
    devices.compute_capability(0)
    devices.driver_version()  # asked once per process, by its first load of a kernel with min_driver
    device.use(devices)
    launch.loaded_module_count()


def unload_loaded() -> None:
    """Unload what Library.kernel() loaded since the last `fresh_loads()`, so that the next sample is a
    fresh load again. Found in the loader's own table (`loader.loaded_libraries`), so the timed loads
    run the production path: no stand-in of the benchmark's between the loader and the driver."""
    from cubinstore.internals import loader

    for handle in loader.loaded_libraries():
        _unload(handle)


# -- 2b. the host side of a fresh load ------------------------------------------------------------

# Sizes of the sm_90a CUBINs (axpy, transpose, gemm, tgemm) when no manifest is at hand.
SYNTHETIC_SIZES = (4608, 10872, 46984, 52960)


def synthetic_release(work: Path, copies: int = 4) -> Path:
    """A manifest over ELF-headed random blobs of real CUBIN sizes (the header says sm_90), files beside it."""
    import random
    import struct

    from cubinstore.manifest import dumps_canonical

    kernels = []
    for i, size in enumerate(SYNTHETIC_SIZES * copies):
        head = bytearray(64)
        head[:9] = b"\x7fELF\x02\x01\x01\x00\x08"  # 64-bit, little-endian, CUDA ELF ABI v8
        struct.pack_into("<H", head, 0x12, 190)  # EM_CUDA
        struct.pack_into("<I", head, 0x30, 90 << 8)  # sm_90
        data = bytes(head) + random.Random(i).randbytes(size - 64)
        hex_ = hashlib.sha256(data).hexdigest()
        (work / f"syn_{i}.cubin").write_bytes(data)  # found by content, as in bazel-bin
        kernels.append({"id": f"syn/i{i}/sm_90a", "family": "syn", "params": {"i": i}, "arch": "sm_90a",
                        "digest": f"sha256:{hex_}", "size": size, "target": f"//syn:syn_{i}",
                        "entries": {"k": {"name": "k", "params": ["ptr"], "offsets": [0]}}})
    path = work / "manifest.json"
    path.write_bytes(dumps_canonical({"schema": "cubinstore/manifest/v2", "kernels": kernels}))
    return path


def host_loads(manifest: Any, home: Path, specs: list[Any], samples: int, cc: tuple[int, int], gpu: bool) -> list[dict[str, Any]]:
    """Per CUBIN: read + sha256 | Store.get | Library.kernel() without the driver, fresh loads (ms)."""
    from cubinstore import launch
    from cubinstore.internals import device
    from cubinstore.manifest import arch_compatible
    from cubinstore.store import LocalLayer, MemoryLayer, Store

    specs = [s for s in specs if arch_compatible(s.arch, cc)]
    local = LocalLayer(home)
    store = Store([local])  # no memory layer: every sample reads and verifies, as a first load does
    warm = Store([MemoryLayer(), local])  # Store.from_env's layers: a blob verified before is a memory hit
    # The driver's three load calls stubbed; with no GPU, the device facts as a GPU of `cc` answers them.
    stubs: dict[str, Any] = dict(on_device=lambda ordinal: contextlib.nullcontext(),
                                 load_library=lambda data, what: 1, library_function=lambda library, entry, what: 1)
    if not gpu:
        attributes = {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": cc[0],
                      "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": cc[1]}
        stubs.update(device_count=lambda: 1, device_attribute=lambda ordinal, name: attributes[name],
                     driver_version=lambda: 13000)  # CUDA 13.0's: every kernel of this release loads
    stubbed = driver_with(**stubs)
    before = device.current()
    rows = []
    try:
        for spec in specs:
            path = local.path_for(spec.digest)
            peer, get, ours, again = [], [], [], []
            warm.get(spec.digest, spec.size, name=spec.id)  # verified once in this process
            for i in range(samples + 5):  # 5 warm-up rounds
                t = time.perf_counter()
                with open(path, "rb") as f:
                    data = f.read()
                ok = hashlib.sha256(data).hexdigest() == spec.digest.hex
                a = time.perf_counter() - t
                if not ok:
                    raise SystemExit(f"{spec.id}: the local store's bytes do not verify")
                t = time.perf_counter()
                store.get(spec.digest, spec.size, name=spec.id)
                b = time.perf_counter() - t
                fresh_loads(stubbed)  # a fresh load, as in a new process
                library = launch.Library(manifest, store)  # and its first selection, as section 3 does
                t = time.perf_counter()
                library.kernel(spec.id, device=0)
                c = time.perf_counter() - t
                fresh_loads(stubbed)
                library = launch.Library(manifest, warm)
                t = time.perf_counter()
                library.kernel(spec.id, device=0)
                e = time.perf_counter() - t
                if i >= 5:
                    peer.append(a)
                    get.append(b)
                    ours.append(c)
                    again.append(e)
            rows.append({"id": spec.id, "size": spec.size, **{f"{name}_{q}": pct(v, p) * 1e3 for name, v in
                         (("peer", peer), ("get", get), ("ours", ours), ("again", again))
                         for q, p in (("p50", 0.5), ("p99", 0.99))}})
    finally:
        device.use(before)  # the real driver again, and its modules (none loaded here)
    return rows


def print_host_loads(rows: list[dict[str, Any]], samples: int) -> None:
    print(f"\n## the host side of a fresh load (driver stubbed), {len(rows)} CUBINs, {samples} samples each (ms)\n")
    print("| kernel | bytes | read+sha256 p50 | p99 | Store.get p50 | p99 | Library.kernel() p50 | p99 "
          "| get/peer p50 | kernel()/peer p50 | kernel()/peer p99 | verified before p50 | p99 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def row(label: str, size: object, r: dict[str, Any]) -> str:
        return (f"| {label} | {size} | {r['peer_p50']:.4f} | {r['peer_p99']:.4f} | {r['get_p50']:.4f} | {r['get_p99']:.4f} "
                f"| {r['ours_p50']:.4f} | {r['ours_p99']:.4f} | {r['get_p50'] / r['peer_p50']:.2f} "
                f"| {r['ours_p50'] / r['peer_p50']:.2f} | {r['ours_p99'] / r['peer_p99']:.2f} "
                f"| {r['again_p50']:.4f} | {r['again_p99']:.4f} |")

    print_rows(rows, row)


def print_rows(rows: list[dict[str, Any]], row: Callable[[str, object, dict[str, Any]], str]) -> None:
    """Each kernel's table row, then the row of each p50 and p99 column's median over the kernels."""
    for r in rows:
        print(row(r["id"], r["size"], r))
    agg = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith(("p50", "p99"))}
    print(row("all (median of rows)", "", agg))


# -- 3. fresh loads on the GPU --------------------------------------------------------------------

def _make_primary_current() -> None:
    """GPU 0's primary context current, as in a torch process (and in the load-phase children): a
    load then switches no context, ours and the peers' alike."""
    from cubinstore.internals import cuda as _cuda

    drv = _cuda.driver()
    _cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(_cuda.primary_context(0))), "cuCtxSetCurrent")


def _unload(library: int) -> None:
    """cuLibraryUnload of a library loaded on GPU 0."""
    from cubinstore.internals import cuda as _cuda

    drv = _cuda.driver()
    with _cuda.on_device(0):
        _cuda.check(drv.cuLibraryUnload(drv.CUlibrary(library)), "cuLibraryUnload")


def direct_load(spec: Any, data: bytes) -> Any:
    """The raw floor: cuLibraryLoadData and each entry's function, bare cuda.bindings calls (GPU 0's
    primary context already current, as in a torch process): no cubinstore code at all."""
    from cuda.bindings import driver as drv

    err, library = drv.cuLibraryLoadData(data, None, None, 0, None, None, 0)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"{spec.id}: cuLibraryLoadData: {err}")
    for entry in spec.entries:
        err, kernel = drv.cuLibraryGetKernel(library, entry.encode())
        err, fn = drv.cuKernelGetFunction(kernel)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise SystemExit(f"{spec.id}: {entry}: {err}")
    return library


def direct_unload(library: Any) -> None:
    from cuda.bindings import driver as drv

    (err,) = drv.cuLibraryUnload(library)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"cuLibraryUnload: {err}")


def store_with(home: Path, **env: str) -> Any:
    """A Store over ``home`` whose local layer was made with ``env`` set (what it decides once, at its
    first load or when made: ``CUBINSTORE_VERIFY=full``, ``CUBINSTORE_NATIVE=0``)."""
    from cubinstore.store import LocalLayer, Store

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        local = LocalLayer(home)
        local.trusts_records()  # decided now, under env
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return Store([local])


def manifests_per_round(manifest_path: Path, rounds: int) -> list[Any]:
    """The manifest parsed once for each round, before any timed load: a process parses its manifest
    once, then selects each kernel a first time, which builds its spec; so a round's first selections
    build their specs, and no parse runs just before a sample (its caches full of the parse)."""
    from cubinstore.manifest import Manifest

    data = manifest_path.read_bytes()
    return [Manifest.from_bytes(data) for _ in range(rounds)]


def gpu_loads(manifest_path: Path, manifest: Any, home: Path, specs: list[Any], samples: int,
              order: str = "cycle", paths_order: str = "rotated") -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per kernel, fresh loads on GPU 0 (p50 / p99 ms), every path once a sample in an order rotated
    from sample to sample (``paths_order`` "rotated": each path follows the same path every time) or
    shuffled ("shuffled": each follows each): raw | read + sha256 + load | Library.kernel() from the
    owned store (records) | the same at the kernel's first selection (its spec built in the call, over a
    manifest parsed for the round, as a process's first call of each kernel builds it) | the same
    through Python alone (CUBINSTORE_NATIVE=0) | the same with CUBINSTORE_VERIFY=full |
    Library.kernel() of bytes verified before in the process | the layout check alone. ``order``
    "cycle": each sample goes through every CUBIN before the next (a serving process's start-up,
    each load a different CUBIN); "repeat": all of one CUBIN's samples, then the next's. Also what
    the owned store's first loads checked (``LocalLayer.checks``)."""
    from cubinstore import launch
    from cubinstore.internals import cuda as _cuda, device, loader as _loader
    from cubinstore.store import LocalLayer, MemoryLayer, Store

    _make_primary_current()
    before = device.current()
    local = LocalLayer(home)
    store = Store([local])  # no memory layer: every first load reads and checks
    python = store_with(home, CUBINSTORE_NATIVE="0")
    full = store_with(home, CUBINSTORE_VERIFY="full")
    # Store.from_env's layers: a blob this process verified before is a memory hit (no read, no hash).
    warm = Store([MemoryLayer(), local])
    names = ("raw", "peer", "ours", "first", "python", "full", "again", "layout")
    rounds = samples + 5  # 5 warm-up rounds: first-touch costs of each path
    parsed = manifests_per_round(manifest_path, rounds)
    round_now = [0]
    times = {spec.id: {name: [] for name in names} for spec in specs}

    def paths_of(spec: Any) -> list[Callable[[], None]]:
        path = local.path_for(spec.digest)
        got = times[spec.id]
        warm.get(spec.digest, spec.size, name=spec.id)  # verified once in this process

        def plain_load(verify: bool) -> float:
            """The plain peers: read (raw), or read + sha256 (peer), then bare cuda.bindings calls."""
            t = time.perf_counter()
            with open(path, "rb") as f:
                data = f.read()
            if verify and hashlib.sha256(data).hexdigest() != spec.digest.hex:
                raise SystemExit(f"{spec.id}: the local store's bytes do not verify")
            library = direct_load(spec, data)
            elapsed = time.perf_counter() - t
            direct_unload(library)
            return elapsed

        def our_load(through: Any, check_layout: bool = False, first: bool = False) -> float:
            fresh_loads()  # a fresh load, as in a new process
            library = launch.Library(parsed[round_now[0]] if first else manifest, through)
            t = time.perf_counter()
            kernel = library.kernel(spec.id, device=0)
            elapsed = time.perf_counter() - t
            if check_layout:
                # The per-entry layout check (cuFuncGetParamInfo per parameter) alone, done again on fresh
                # caches: where it runs (load or first launch), this is what it costs.
                t = time.perf_counter()
                for symbol, fn in kernel._functions.items():
                    fn.layouts.clear()
                    _loader.check_function_layout(spec, symbol, fn, 0)
                got["layout"].append(time.perf_counter() - t)
            unload_loaded()
            return elapsed

        def python_load() -> float:
            with _cuda.using_native_load(None):  # the driver's calls made from Python (cuda.bindings)
                return our_load(python)

        loads = (("raw", lambda: plain_load(False)), ("peer", lambda: plain_load(True)), ("ours", lambda: our_load(store, check_layout=True)),
                 ("first", lambda: our_load(store, first=True)), ("python", python_load), ("full", lambda: our_load(full)), ("again", lambda: our_load(warm)))
        return [lambda name=name, fn=fn: got[name].append(fn()) for name, fn in loads]

    per_spec = [(spec, paths_of(spec)) for spec in specs]
    shuffle = random.Random(31).shuffle
    if order == "cycle":
        plan = [(i, paths) for i in range(rounds) for _, paths in per_spec]
    else:
        plan = [(i, paths) for _, paths in per_spec for i in range(rounds)]
    try:
        for i, paths in plan:
            # Every path once, the order rotated from sample to sample: a load's time depends on what ran
            # just before it (the CPU's caches, the driver's deferred work of the last unload), and each
            # path takes each place equally often; shuffled, each path also follows each other one.
            round_now[0] = i
            if paths_order == "shuffled":
                runs = list(paths)
                shuffle(runs)
            else:
                turn = i % len(paths)
                runs = paths[turn:] + paths[:turn]
            for run in runs:
                run()
    finally:
        device.use(before)  # the real driver again
    rows = []
    for spec in specs:
        got = {name: values[5:] for name, values in times[spec.id].items()}  # less the warm-up rounds
        rows.append({"id": spec.id, "size": spec.size, **{f"{name}_{q}": pct(values, p) * 1e3
                                                          for name, values in got.items()
                                                          for q, p in (("p50", 0.5), ("p99", 0.99))}})
    return rows, dict(local.checks)


# -- 3b. where a fresh load's time goes -----------------------------------------------------------

def part_timer(inside: dict[str, float]) -> Callable[[str, Callable[..., Any]], Callable[..., Any]]:
    """``timed(part, fn)``: ``fn`` wrapped to add the seconds of each call to ``inside[part]`` (the parts
    of a load timed inside it; the wrapper's own calls fall in the rest)."""
    def timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                inside[part] += time.perf_counter() - t
        return wrapper
    return timed


def load_breakdown(manifest: Any, home: Path, specs: list[Any], samples: int) -> dict[str, dict[str, float]]:
    """Median us per fresh load of each part (and of the rest: each sample's total less its parts),
    for the peer (read + sha256, then bare cuLibraryLoadData, cuLibraryGetKernel + cuKernelGetFunction)
    and for Library.kernel() from the owned store, whose parts are timed inside it: the read and check
    (``LocalLayer.read_verified``) and the driver's calls, timed where ``cuda.bindings`` is called or,
    where it was built, around the compiled helper's one call of them (its context check included),
    so every other line of cubinstore's own code is in "rest". Medians: a load now and then takes the
    driver's deferred work of earlier unloads."""
    from cuda.bindings import driver as drv

    from cubinstore import launch
    from cubinstore.internals import cuda as _cuda, device
    from cubinstore.store import LocalLayer, Store

    _make_primary_current()
    local = LocalLayer(home)
    store = Store([local])
    inside: dict[str, float] = {"read + check": 0.0, "driver": 0.0}
    timed = part_timer(inside)

    parts = ("read + check", "driver", "rest", "total")
    peer: dict[str, list[float]] = {p: [] for p in parts}
    ours: dict[str, list[float]] = {p: [] for p in parts}
    real = {name: getattr(drv, name) for name in ("cuLibraryLoadData", "cuLibraryGetKernel", "cuKernelGetFunction")}
    timed_calls = {name: timed("driver", fn) for name, fn in real.items()}
    real_read = local.read_verified
    real_native = _cuda.native_load()
    timed_native = None if real_native is None else timed("driver", real_native)
    before = device.current()
    try:
        for i in range(samples + 5):  # 5 warm-up rounds
            for spec in specs:
                path = local.path_for(spec.digest)
                t0 = time.perf_counter()
                with open(path, "rb") as f:
                    data = f.read()
                if hashlib.sha256(data).hexdigest() != spec.digest.hex:
                    raise SystemExit(f"{spec.id}: the local store's bytes do not verify")
                t1 = time.perf_counter()
                err, library = drv.cuLibraryLoadData(data, None, None, 0, None, None, 0)
                for entry in spec.entries:
                    err, kernel = drv.cuLibraryGetKernel(library, entry.encode())
                    err, fn = drv.cuKernelGetFunction(kernel)
                t3 = time.perf_counter()
                direct_unload(library)
                fresh_loads()  # a fresh load, as in a new process
                fresh = launch.Library(manifest, store)
                for part in inside:
                    inside[part] = 0.0
                for name, fn in timed_calls.items():
                    setattr(drv, name, fn)
                local.read_verified = timed("read + check", real_read)  # type: ignore[method-assign]
                try:
                    with _cuda.using_native_load(timed_native):
                        t = time.perf_counter()
                        fresh.kernel(spec.id, device=0)
                        elapsed = time.perf_counter() - t
                finally:
                    for name, fn in real.items():
                        setattr(drv, name, fn)
                    del local.read_verified
                unload_loaded()
                if i < 5:
                    continue
                for out, sample in ((peer, {"read + check": t1 - t0, "driver": t3 - t1, "total": t3 - t0}),
                                    (ours, {**inside, "total": elapsed})):
                    sample["rest"] = sample["total"] - sample["read + check"] - sample["driver"]
                    for part, seconds in sample.items():
                        out[part].append(seconds)
    finally:
        device.use(before)  # the real driver again
    return {name: {part: statistics.median(values) * 1e6 for part, values in got.items()}
            for name, got in (("peer", peer), ("ours", ours))}


def print_load_breakdown(parts: dict[str, dict[str, float]], kernels: int, samples: int) -> None:
    print(f"\n## where a fresh load's time goes ({kernels} CUBINs x {samples} samples, interleaved; median us "
          "per load of each part)\n")
    print("| path | read + check | driver calls (cuLibraryLoadData, cuLibraryGetKernel, cuKernelGetFunction) "
          "| rest | total |")
    print("|---|---|---|---|---|")
    for label, key in (("peer: read + sha256, bare driver calls", "peer"), ("Library.kernel(), owned store", "ours")):
        r = parts[key]
        print(f"| {label} | {r['read + check']:.1f} | {r['driver']:.1f} | {r['rest']:.1f} | {r['total']:.1f} |")
    print("\nLibrary.kernel()'s parts are timed inside it: the read and check (LocalLayer.read_verified: size "
          "and the xxh3-128 record) and the driver's calls, where cuda.bindings is called or around the compiled "
          "helper's one call of them, so its rest is every other line of cubinstore's own (selection, Store.get's "
          "layering, ELF check, module and Kernel objects). Medians of each part do not add up to the median "
          "total exactly.")


# -- 3c. the rest, layer by layer ----------------------------------------------------------------

REST_PATHS = ("first_select", "ours", "loader", "store", "fewest", "ours_bare", "fewest_bare")


def fewest_steps(plans: dict[str, Any], modules: dict[Any, Any], kernel_id: str, read: Callable[..., Any],
                 load: Callable[..., Any], context: int, not_found: int, header_is: Callable[[bytes, int], bool]) -> Any:
    """A first load in the fewest Python steps around the two calls every first load makes (the read
    and check, the compiled helper's driver calls): the spec by id (with its entries and the SM its
    ELF header names), the module table, the header test, a table of the entries' functions. No
    device check, selection, lock, counter or object of the runtime's: not a loader, the floor a
    loader written in Python stands on."""
    spec, entries, sm = plans[kernel_id]
    key = (spec.digest.hex, 0)
    module = modules.get(key)
    if module is not None:
        return module
    data = read(spec.digest, spec.size)
    if data is None or not header_is(data, sm):
        raise SystemExit(f"{kernel_id}: the owned store's bytes do not read back as its CUBIN")
    library, functions = load(data, entries, context, not_found)
    module = modules[key] = (library, data, dict(zip(entries, functions)))
    return module


def rest_by_layer(manifest_path: Path, manifest: Any, home: Path, specs: list[Any], samples: int,
                  cc: tuple[int, int]) -> dict[str, dict[str, float]]:
    """Median us of each path's rest and total per fresh load, the paths interleaved in shuffled order,
    the read and check and the driver's calls timed as in 3b (the rest is all else, the timers' own
    calls included): ours (Library.kernel(), as in 3b: the kernel's spec built before, as sections 3
    and 3b have it); first_select (the same over a manifest parsed again each round, in which the
    call builds the kernel's spec, as a process's first call of each kernel does); the loader alone
    (``loader.load``: no device check, selection or Kernel object); the fewest steps reading through
    ``Store.get`` (store) and through ``LocalLayer.read_verified`` (fewest); ours_bare and fewest_bare
    time nothing inside (their totals less ours' and fewest's: the timers' share). Needs the
    compiled helper."""
    from cuda.bindings import driver as drv

    from cubinstore import launch
    from cubinstore.internals import Arch, cuda as _cuda, device, header_is, loader
    from cubinstore.store import LocalLayer, Store

    _make_primary_current()
    local = LocalLayer(home)
    store = Store([local])
    native_load = _cuda.native_load()
    context = _cuda.primary_context(0)
    not_found = int(drv.CUresult.CUDA_ERROR_NOT_FOUND)
    inside = {"read": 0.0, "driver": 0.0}
    shuffle = random.Random(31).shuffle
    timed = part_timer(inside)
    parsed = manifests_per_round(manifest_path, samples + 5)
    real_read = local.read_verified
    timed_read, timed_load = timed("read", real_read), timed("driver", native_load)
    plans = {spec.id: (spec, tuple(spec.entries), Arch.parse(spec.arch).sm) for spec in specs}
    rest: dict[str, list[float]] = {path: [] for path in REST_PATHS}
    total: dict[str, list[float]] = {path: [] for path in REST_PATHS}
    before = device.current()
    try:
        for i in range(samples + 5):  # 5 warm-up rounds
            for spec in specs:
                # A shuffled order, not a rotated one: in a rotation each path follows the same path, whose
                # unload's deferred work the driver may do in the next load; shuffled, each follows each.
                order = list(REST_PATHS)
                shuffle(order)
                for path in order:
                    inside["read"] = inside["driver"] = 0.0
                    if path in ("first_select", "ours", "loader", "ours_bare"):
                        fresh_loads()
                        library = launch.Library(parsed[i] if path == "first_select" else manifest, store)
                        devices = device.current()
                        bare = path == "ours_bare"
                        local.read_verified = real_read if bare else timed_read  # type: ignore[method-assign]
                        try:
                            with _cuda.using_native_load(native_load if bare else timed_load):
                                t = time.perf_counter()
                                if path == "loader":
                                    loader.load(spec, 0, cc, store, devices)
                                else:
                                    library.kernel(spec.id, device=0)
                                elapsed = time.perf_counter() - t
                        finally:
                            del local.read_verified
                        unload_loaded()
                    else:
                        # store: read through Store.get, read_verified timed inside it as in ours
                        read = {"store": store.get, "fewest": timed_read, "fewest_bare": real_read}[path]
                        if path == "store":
                            local.read_verified = timed_read  # type: ignore[method-assign]
                        try:
                            t = time.perf_counter()
                            module = fewest_steps(plans, {}, spec.id, read,
                                                  native_load if path == "fewest_bare" else timed_load,
                                                  context, not_found, header_is)
                            elapsed = time.perf_counter() - t
                        finally:
                            if path == "store":
                                del local.read_verified
                        _unload(module[0])
                    if i >= 5:
                        total[path].append(elapsed)
                        rest[path].append(elapsed - inside["read"] - inside["driver"])
    finally:
        device.use(before)
    return {path: {"rest": statistics.median(rest[path]) * 1e6, "total": statistics.median(total[path]) * 1e6}
            for path in REST_PATHS}


def print_rest_by_layer(layers: dict[str, dict[str, float]], kernels: int, samples: int) -> None:
    print(f"\n## the rest, layer by layer ({kernels} CUBINs x {samples} samples, interleaved; median us per load)\n")
    print("| path | rest | total | what it adds to the rest below it |")
    print("|---|---|---|---|")
    rows = (("Library.kernel(), the process's first selection of the kernel", "first_select", "ours",
             "the manifest's spec of the kernel, built at its first selection"),
            ("Library.kernel(), its spec built before (sections 3 and 3b)", "ours", "loader", "the device check, selection and the Kernel object"),
            ("loader.load()", "loader", "store", "the lock, arch and driver checks, the runtime's module and "
             "function objects, the load's timing"),
            ("fewest steps, through Store.get", "store", "fewest", "Store.get's layers and hit counts"),
            ("fewest steps, through LocalLayer.read_verified", "fewest", None, ""))
    for label, key, below, what in rows:
        adds = f"{layers[key]['rest'] - layers[below]['rest']:+.1f}: {what}" if below else "the floor"
        print(f"| {label} | {layers[key]['rest']:.1f} | {layers[key]['total']:.1f} | {adds} |")
    print(f"\nThe timers' share (a path's total less the same path's timing nothing inside): Library.kernel() "
          f"{layers['ours']['total'] - layers['ours_bare']['total']:.1f} us, the fewest steps "
          f"{layers['fewest']['total'] - layers['fewest_bare']['total']:.1f} us. The fewest steps are what any "
          "loader written in Python pays around the same two calls: the rest goal (<= 5 us) against that floor.")


# -- 4. concurrent processes ----------------------------------------------------------------------

CHILD = """
import sys, time, json
import cubinstore
from cubinstore.internals import cuda as _cuda, device
from cubinstore.manifest import arch_compatible
lib = cubinstore.open(sys.argv[1])
drv = _cuda.driver()
# The primary context current, as in a torch process (and as the peer sets it): no switch per load.
_cuda.check(drv.cuCtxSetCurrent(drv.CUcontext(_cuda.primary_context(0))), "cuCtxSetCurrent")
cc = device.compute_capability(0)
ids = [k.id for k in lib.manifest if arch_compatible(k.arch, cc)]
if sys.argv[2] == "store-first":
    lib.store  # the store and its modules (hashlib among them) before the timed part, as the peer imports hashlib
print("ready", flush=True)
sys.stdin.readline()  # all children start loading together
t = time.perf_counter()
for kid in ids:
    lib.kernel(kid, device=0)
print(json.dumps({"load_s": time.perf_counter() - t, "kernels": len(ids)}), flush=True)
"""


# The plain peer of CHILD: read, sha256 and load the same CUBINs from the same store with bare
# cuda.bindings calls, so contention that is the driver's (not ours) shows in its own ratio.
CHILD_RAW = """
import sys, time, json, hashlib
from cuda.bindings import driver as drv
paths = json.loads(sys.argv[1])
drv.cuInit(0)
err, dev = drv.cuDeviceGet(0)
err, ctx = drv.cuDevicePrimaryCtxRetain(dev)
drv.cuCtxSetCurrent(ctx)
print("ready", flush=True)
sys.stdin.readline()
t = time.perf_counter()
verify = sys.argv[2] == "verify"
for path, hex_, entries in paths:
    with open(path, "rb") as f:
        data = f.read()
    if verify and hashlib.sha256(data).hexdigest() != hex_:
        raise SystemExit(path + ": bytes do not verify")
    err, lib = drv.cuLibraryLoadData(data, None, None, 0, None, None, 0)
    for entry in entries:
        err, kern = drv.cuLibraryGetKernel(lib, entry.encode())
        err, fn = drv.cuKernelGetFunction(kern)
print(json.dumps({"load_s": time.perf_counter() - t, "kernels": len(paths)}), flush=True)
"""


# The load phase's paths: (label, child code, its mode argument); the peers get the CUBINs' paths.
LOAD_PHASES = (
    ("Library.kernel() of each (the store's modules imported in the first)", "ours", "first"),
    ("Library.kernel() of each, the store opened before", "ours", "store-first"),
    ("plain peer: read + sha256 + cuLibraryLoadData", "peer", "verify"),
    ("raw: read + cuLibraryLoadData (nothing verified)", "peer", "raw"),
)


def concurrent(manifest_path: Path, home: Path, procs: int, specs: list[Any]) -> dict[str, Any]:
    """Per path of LOAD_PHASES: one fresh process (median of 3), then `procs` started together."""
    from cubinstore.store import LocalLayer

    local = LocalLayer(home)
    raw_arg = json.dumps([[str(local.path_for(s.digest)), s.digest.hex, list(s.entries)] for s in specs])

    def run(n: int, code: str, arg: str, mode: str) -> list[float]:
        children = [subprocess.Popen([sys.executable, "-c", code, arg, mode], env=env_for(home),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for _ in range(n)]
        for c in children:
            if c.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise SystemExit(f"child failed: {c.stderr.read()}")  # type: ignore[union-attr]
        for c in children:
            c.stdin.write("go\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        out = [json.loads(c.stdout.readline())["load_s"] for c in children]  # type: ignore[union-attr]
        for c in children:
            c.wait(timeout=120)
        return out

    rows = {}
    for label, who, mode in LOAD_PHASES:
        code, arg = (CHILD, str(manifest_path)) if who == "ours" else (CHILD_RAW, raw_arg)
        one = [run(1, code, arg, mode)[0] for _ in range(3)]
        many = run(procs, code, arg, mode)
        rows[label] = {"one_s": statistics.median(one), "many_median_s": statistics.median(many),
                       "many_max_s": max(many)}
    return {"procs": procs, "kernels": len(specs), "rows": rows}


def print_concurrent(conc: dict[str, Any]) -> None:
    raw = conc["rows"][LOAD_PHASES[-1][0]]["one_s"]
    print(f"\n## load phase ({conc['kernels']} runnable kernels, fresh processes started together, one local "
          "store)\n")
    print(f"| path | 1 process ms | per kernel ms | / raw | {conc['procs']} at once: median ms | max ms | median / 1 "
          "| max / 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in conc["rows"].items():
        one_s, med, top = r["one_s"], r["many_median_s"], r["many_max_s"]
        print(f"| {label} | {one_s * 1e3:.1f} | {one_s * 1e3 / conc['kernels']:.3f} | {one_s / raw:.2f} "
              f"| {med * 1e3:.1f} | {top * 1e3:.1f} | {med / one_s:.2f} | {top / one_s:.2f} |")


def print_goals(loads: list[dict[str, Any]], parts: dict[str, dict[str, float]], conc: dict[str, Any]) -> None:
    """The issue's goals against this run (ratios of medians over kernels)."""
    def med(key: str) -> float:
        return statistics.median(r[key] for r in loads)

    rows = conc["rows"]
    raw_many = rows[LOAD_PHASES[-1][0]]["many_median_s"]
    ours_many = rows[LOAD_PHASES[1][0]]["many_median_s"]
    checks = [
        ("first load p50 / raw p50", med("ours_p50") / med("raw_p50"), 1.15),
        ("first load p99 / raw p99", med("ours_p99") / med("raw_p99"), 1.3),
        ("first load at the kernel's first selection (its spec built) p50 / raw p50", med("first_p50") / med("raw_p50"),
         1.15),
        ("the same, p99 / raw p99", med("first_p99") / med("raw_p99"), 1.3),
        ("reload (verified before) p50 / raw p50", med("again_p50") / med("raw_p50"), 1.05),
        ("full mode p50 / (read + sha256 + load) p50", med("full_p50") / med("peer_p50"), 1.1),
        ("first load through Python alone (CUBINSTORE_NATIVE=0) p50 / raw p50", med("python_p50") / med("raw_p50"),
         None),
        ("what cubinstore adds (rest, us)", parts["ours"]["rest"], 5.0),
        (f"{conc['procs']} processes at once / raw's", ours_many / raw_many, 1.1),
    ]
    print("\n## goals (issue 31)\n")
    print("| measure | this run | goal | met |\n|---|---|---|---|")
    for label, value, goal in checks:
        if goal is None:  # for comparison, not a goal
            print(f"| {label} | {value:.2f} | | |")
        else:
            print(f"| {label} | {value:.2f} | <= {goal:g} | {'yes' if value <= goal else 'no'} |")


def print_import_time(runs: int, results: dict[str, Any]) -> None:
    imp = import_time(runs)
    results["import"] = {k: v for k, v in imp.items() if k != "trace"}
    print(f"\n## import cubinstore\nmedian {imp['median_ms']:.1f} ms, min {imp['min_ms']:.1f} ms over {runs} fresh "
          f"interpreters; -X importtime cumulative for cubinstore: {imp['importtime_cumulative_us']} us\n")
    print("| self us | cumulative us | module |\n|---|---|---|")
    for self_us, cum, depth, name in imp["heaviest"]:
        print(f"| {self_us} | {cum} | {'  ' * depth}{name} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=Path(os.environ.get("CUBINSTORE_TEST_MANIFEST", ROOT / "bazel-bin/kernels/manifest.json")))
    parser.add_argument("--samples", type=int, default=150)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--import-runs", type=int, default=15)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--host-only", action="store_true", help="section 2b alone (the host side of a load)")
    parser.add_argument("--order", choices=("cycle", "repeat"), default="cycle",
                        help="section 3: each sample through every CUBIN (cycle, a start-up) or each CUBIN's samples in a row")
    parser.add_argument("--paths", choices=("rotated", "shuffled"), default="rotated",
                        help="section 3: the paths of a sample in an order rotated from sample to sample (each follows "
                             "the same one every time) or shuffled (each follows each)")
    opts = parser.parse_args()
    results: dict[str, Any] = {}
    # The children and the import timings must find .pyc files, as in an installed package.
    if not compileall.compile_dir(ROOT / "cubinstore", quiet=1):
        print("warning: could not byte-compile cubinstore/ (read-only checkout?): imports compile from source")

    if not opts.host_only:
        print_import_time(opts.import_runs, results)

    gpu_reason = None
    cc = None
    try:
        from cubinstore.internals import cuda as _cuda, device

        ok, why = _cuda.available()
        if ok:
            cc = device.compute_capability(0)
        else:
            gpu_reason = why
    except Exception as exc:  # noqa: BLE001 - no driver, no bindings: report why and go on without a GPU
        gpu_reason = f"{type(exc).__name__}: {exc}"

    work = Path(tempfile.mkdtemp(prefix="cubinstore-runtime-"))
    try:
        real = opts.manifest.is_file()
        if real:
            manifest_path = opts.manifest.resolve()
        else:
            print(f"\nno manifest at {opts.manifest} (build //kernels:all or pass --manifest): sections 2, 3 and 4 "
                  "skipped; section 2b over synthetic blobs")
            (work / "syn").mkdir()
            manifest_path = synthetic_release(work / "syn")
        manifest, specs = fill_store(manifest_path, work / "home", cc)
        if real and not opts.host_only:
            rows = reads(work / "home", specs, opts.samples)
            results["reads"] = rows
            print(f"\n## reads from the local store, {len(rows)} CUBINs, {opts.samples} samples each (ms)\n")
            print("| kernel | bytes | raw p50 | raw p99 | read+sha256 p50 | p99 | Store.get p50 | p99 | get/raw p50 |")
            print("|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['id']} | {r['size']} | {r['raw_p50']:.3f} | {r['raw_p99']:.3f} | {r['sha_p50']:.3f} | {r['sha_p99']:.3f} "
                      f"| {r['store_p50']:.3f} | {r['store_p99']:.3f} | {r['store_p50'] / r['raw_p50']:.2f} |")
        host = host_loads(manifest, work / "home", specs, opts.samples, cc or (9, 0), gpu=gpu_reason is None)
        results["host_loads"] = host
        print_host_loads(host, opts.samples)
        if not real or opts.host_only:
            return
        if gpu_reason is not None:
            print(f"\n## GPU sections skipped: {gpu_reason}")
            return
        from cubinstore.internals import native

        loads, checks = gpu_loads(manifest_path, manifest, work / "home", specs, opts.samples, opts.order, opts.paths)
        results["loads"] = loads
        results["checks"] = checks
        results["native"] = native.helper() is not None
        order = ("each sample goes through every CUBIN before the next (a start-up: each load a different CUBIN)"
                 if opts.order == "cycle" else "all of one CUBIN's samples, then the next's")
        print(f"\n## fresh loads on GPU 0 (compute capability {cc[0]}.{cc[1]}), {opts.samples} samples each, every "
              f"path once a sample in an order {opts.paths} from sample to sample; {order} (ms)\n")
        print("raw = read + bare cuLibraryLoadData + get function (cuda.bindings, no cubinstore code); "
              "peer = raw + sha256; ours = Library.kernel() from an owned local store (size + xxh3-128 record), "
              f"{'through the compiled helper' if results['native'] else 'the helper NOT built: Python alone'}, "
              "the kernel's spec built before; first = ours at the kernel's first selection (its spec built in the "
              "call, as in a process's first call of each kernel); "
              "python = the same through Python alone (CUBINSTORE_NATIVE=0); "
              "full = ours with CUBINSTORE_VERIFY=full (sha256); before = bytes verified earlier in the "
              f"process (memory layer). The owned store's first loads checked: {checks}\n")
        print("| kernel | bytes | raw p50 | raw p99 | peer p50 | p99 | ours p50 | p99 | ours/raw p50 "
              "| ours/raw p99 | first p50 | first/raw p50 | first/raw p99 | python p50 | python/raw p50 | full p50 "
              "| full/peer p50 | before p50 | p99 | before/raw p50 | layout check p50 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        def load_row(label: str, size: object, r: dict[str, Any]) -> str:
            return (f"| {label} | {size} | {r['raw_p50']:.3f} | {r['raw_p99']:.3f} | {r['peer_p50']:.3f} | {r['peer_p99']:.3f} "
                    f"| {r['ours_p50']:.3f} | {r['ours_p99']:.3f} | {r['ours_p50'] / r['raw_p50']:.2f} "
                    f"| {r['ours_p99'] / r['raw_p99']:.2f} | {r['first_p50']:.3f} | {r['first_p50'] / r['raw_p50']:.2f} "
                    f"| {r['first_p99'] / r['raw_p99']:.2f} | {r['python_p50']:.3f} | {r['python_p50'] / r['raw_p50']:.2f} "
                    f"| {r['full_p50']:.3f} | {r['full_p50'] / r['peer_p50']:.2f} "
                    f"| {r['again_p50']:.3f} | {r['again_p99']:.3f} "
                    f"| {r['again_p50'] / r['raw_p50']:.2f} | {r['layout_p50']:.3f} |")

        print_rows(loads, load_row)
        parts = load_breakdown(manifest, work / "home", specs, opts.samples)
        results["load_breakdown"] = parts
        print_load_breakdown(parts, len(specs), opts.samples)
        if results["native"]:
            layers = rest_by_layer(manifest_path, manifest, work / "home", specs, opts.samples, cc)
            results["rest_by_layer"] = layers
            print_rest_by_layer(layers, len(specs), opts.samples)
        else:
            print("\n## the rest, layer by layer: skipped (the compiled helper was not built)")
        conc = concurrent(opts.manifest.resolve(), work / "home", opts.procs, specs)
        results["concurrent"] = conc
        print_concurrent(conc)
        print_goals(loads, parts, conc)
    finally:
        if opts.json:
            opts.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
