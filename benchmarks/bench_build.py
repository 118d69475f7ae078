#!/usr/bin/env python3
"""The build side of issue 9: what a CubinCompile declares, and what the sandbox costs.

For each side (a git revision, or the working tree), in one run and interleaved over
`--rounds`, on a fresh copy of the workspace with a fresh output base and no disk cache:

  inputs       files each CubinCompile declares, per family, and summed over a build (aquery)
  cold         wall of `bazel build //kernels:all`: server start, fetch, analysis and every
               compile (what "the first build" costs)
  per inst.    cold wall / instantiations
  setup        per compile, the profile's sandbox.createFileSystem (mean)
  overhead     per compile, the action's time less its subprocess's (set-up, tear-down, the
               action cache): what Bazel adds to nvcc (mean)
  nvcc         per compile, the subprocess's time inside Bazel (mean)
  left         entries under <output_base>/sandbox after the cold build: Bazel 4.2.3 leaves each
               action's sandbox (a link per input) until the next server start deletes them
  restart      wall of the same build again after `bazel shutdown`: nothing runs, but the stale
               sandboxes are deleted and every key is recomputed from the inputs (the "first
               build after a server start")
  plain nvcc   the same compile commands (from aquery) run by a plain loop in the execution root,
               as many at once as Bazel's --jobs (the cores), wall / instantiations: the floor

Usage:
  .venv/bin/python benchmarks/bench_build.py --side before=687b714 --side after=. [--rounds 2]
      [--side 'after+shm=.:--sandbox_base=/dev/shm'] [--json FILE] [--keep]
A side is NAME=REV[:FLAG,FLAG...]: REV `.` is the working tree; the flags go to every build
of that side. The host's load average is printed with the table: compare rows of one run.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.bazel._workspace import (  # noqa: E402  (the path above makes the checkout importable)
    ACTION_PATH,
    ALL_TARGETS,
    COMPILE,
    TREE_ENV,
    Workspace,
    find_bazel,
    find_venv,
)

QUERY = f'mnemonic("{COMPILE}", //kernels/...)'


@dataclass(frozen=True)
class Side:
    name: str
    rev: str  # "." for the working tree
    flags: tuple[str, ...]


@dataclass
class Row:
    side: str
    round: int
    inputs: dict[str, int]  # family -> files declared by each of its compiles
    inputs_total: int  # summed over every compile: the links the sandboxes of one build make
    instantiations: int
    cold_s: float
    setup_s: float
    overhead_s: float
    nvcc_in_bazel_s: float
    sandbox_left: int  # entries under <output_base>/sandbox after the cold build
    restart_s: float
    plain_nvcc_s: float  # the whole loop
    load: str


def parse_side(text: str) -> Side:
    name, _, rest = text.partition("=")
    rev, _, flags = rest.partition(":")
    if not name or not rev:
        raise SystemExit(f"--side wants NAME=REV[:FLAG,...], got '{text}'")
    return Side(name, rev, tuple(f for f in flags.split(",") if f))


def make_workspace(side: Side, base: Path, bazel: Path, venv: Path) -> Workspace:
    saved = os.environ.pop(TREE_ENV, None)
    try:
        if side.rev != ".":
            os.environ[TREE_ENV] = side.rev
        return Workspace.create(base / "cubinstore", base / "output_base", bazel, venv)
    finally:
        os.environ.pop(TREE_ENV, None)
        if saved is not None:
            os.environ[TREE_ENV] = saved


def compile_actions(ws: Workspace) -> list[tuple[str, int, list[str]]]:
    """(target label, number of inputs, argv) of every CubinCompile under //kernels."""
    graph = ws.aquery(QUERY)
    sets = {s["id"]: s for s in graph.get("depSetOfFiles", [])}
    memo: dict[int, frozenset] = {}

    def walk(i: int) -> frozenset:
        if i not in memo:
            s = sets[i]
            acc = set(s.get("directArtifactIds", []))
            for t in s.get("transitiveDepSetIds", []):
                acc |= walk(t)
            memo[i] = frozenset(acc)
        return memo[i]

    targets = {t["id"]: t["label"] for t in graph.get("targets", [])}
    out = []
    for action in graph["actions"]:
        inputs = frozenset().union(*(walk(i) for i in action.get("inputDepSetIds", [])))
        out.append((targets[action["targetId"]], len(inputs), action["arguments"]))
    return out


def profile_means(path: Path) -> tuple[float, float, float]:
    """Per CubinCompile: mean sandbox set-up, mean overhead (action - subprocess), mean subprocess."""
    trace = json.load(gzip.open(path))
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace) if e.get("ph") == "X"]
    inner = collections.defaultdict(list)  # tid -> (ts, dur, name)
    for e in events:
        if e.get("name") in ("subprocess.run", "sandbox.createFileSystem"):
            inner[e["tid"]].append((e["ts"], e["dur"], e["name"]))
    setup, overhead, sub = [], [], []
    for e in events:
        if e.get("cat") != "action processing" or "Compiling CUBIN" not in e.get("name", ""):
            continue
        within = [(n, d) for ts, d, n in inner[e["tid"]] if e["ts"] <= ts <= e["ts"] + e["dur"]]
        run = sum(d for n, d in within if n == "subprocess.run")
        setup.append(sum(d for n, d in within if n == "sandbox.createFileSystem") / 1e6)
        overhead.append((e["dur"] - run) / 1e6)
        sub.append(run / 1e6)
    if not sub:
        raise SystemExit(f"no CubinCompile action in the profile {path}")
    return statistics.mean(setup), statistics.mean(overhead), statistics.mean(sub)


def plain_nvcc(ws: Workspace, actions: list[tuple[str, int, list[str]]], out: Path, jobs: int) -> float:
    """Runs every compile command in the execution root (the built tree's inputs), `jobs` at once."""
    execroot = ws.output_base / "execroot" / "cubinstore"
    out.mkdir(parents=True, exist_ok=True)
    env = {"PATH": ACTION_PATH, "LC_ALL": "C"}

    def run(i: int) -> None:
        argv = list(actions[i][2])
        argv[argv.index("-o") + 1] = str(out / f"{i}.cubin")
        subprocess.run(argv, cwd=execroot, env=env, check=True, capture_output=True, timeout=900)

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(run, range(len(actions))))
    return time.monotonic() - start


def timed_build(ws: Workspace, flags: list[str]) -> tuple[float, str]:
    """Wall of one `bazel build //kernels:all` without a disk cache (and without an execution
    log, whose size grows with the inputs) and its output."""
    start = time.monotonic()
    proc = ws.run("build", ["--color=no", "--curses=no", "--noshow_progress", "--disk_cache=", *flags, "--",
                            *ALL_TARGETS])
    return time.monotonic() - start, proc.stderr


def count_entries(path: Path) -> int:
    """Files, links and directories under `path` (Bazel 4.2.3 leaves every action's sandbox
    there until the next server start, which deletes them before it builds)."""
    return sum(len(dirs) + len(files) for _root, dirs, files in os.walk(path))


def remove(path: Path) -> None:
    """Removes a copy and its output base (Bazel leaves read-only directories)."""
    subprocess.run(["chmod", "-R", "u+w", str(path)], capture_output=True, check=False)
    shutil.rmtree(path, ignore_errors=True)


def load_average() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def measure(side: Side, rnd: int, base: Path, bazel: Path, venv: Path, jobs: int) -> Row:
    ws = make_workspace(side, base, bazel, venv)
    load = load_average()
    try:
        profile = base / "cold.profile.gz"
        cold, _ = timed_build(ws, [f"--profile={profile}", *side.flags])
        setup, overhead, nvcc = profile_means(profile)
        left = count_entries(ws.output_base / "sandbox")
        ws.shutdown()
        restart, output = timed_build(ws, list(side.flags))
        ran = [line for line in output.splitlines() if line.startswith("INFO: ") and " process" in line]
        if not ran or any(k in ran[-1] for k in ("sandbox", "remote", "local")):
            raise SystemExit(f"{side.name}: the build after a restart ran compiles:\n{output}")
        actions = compile_actions(ws)
        inputs = {}
        for label, count, _argv in actions:
            inputs.setdefault(label.split(":")[0].rsplit("/", 1)[-1], count)
        plain = plain_nvcc(ws, actions, base / "plain", jobs)
        load = f"{load} / {load_average()}"
    finally:
        ws.shutdown()
    total = sum(count for _label, count, _argv in actions)
    return Row(side.name, rnd, inputs, total, len(actions), cold, setup, overhead, nvcc, left, restart, plain, load)


def print_table(rows: list[Row]) -> None:
    families = sorted({f for r in rows for f in r.inputs})
    head = ["side", "round", *[f"inputs {f}" for f in families], "inputs a build", "cold s", "per inst. s", "setup s",
            "overhead s", "nvcc in Bazel s", "sandbox entries left", "restart s", "plain nvcc per inst. s", "Bazel / plain", "load (1/5/15 min)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        per = r.cold_s / r.instantiations
        plain = r.plain_nvcc_s / r.instantiations
        cells = [r.side, str(r.round), *[str(r.inputs.get(f, "")) for f in families], f"{r.inputs_total:,}",
                 f"{r.cold_s:.1f}",
                 f"{per:.2f}", f"{r.setup_s:.3f}", f"{r.overhead_s:.3f}", f"{r.nvcc_in_bazel_s:.2f}",
                 f"{r.sandbox_left:,}", f"{r.restart_s:.1f}", f"{plain:.2f}", f"{per / plain:.2f}x", r.load]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", action="append", type=parse_side, required=True, help="NAME=REV[:FLAG,...]")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="plain loop's parallelism")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the copies (printed)")
    opts = parser.parse_args()
    bazel, venv = find_bazel(), find_venv()
    if bazel is None or venv is None:
        raise SystemExit("needs Bazel (bazelisk) and the .venv with nvidia-cutlass (tools/bootstrap.sh)")
    work = Path(tempfile.mkdtemp(prefix="bench_build."))
    rows: list[Row] = []
    try:
        for rnd in range(1, opts.rounds + 1):
            for i, side in enumerate(opts.side):
                base = work / f"r{rnd}s{i}"
                rows.append(measure(side, rnd, base, bazel, venv, opts.jobs))
                print(f"# {side.name} round {rnd}: cold {rows[-1].cold_s:.1f} s", file=sys.stderr, flush=True)
                if not opts.keep:
                    remove(base)
    finally:
        if opts.keep:
            print(f"# copies kept under {work}", file=sys.stderr)
        else:
            remove(work)
    print(f"{os.cpu_count()} cores; plain loop {opts.jobs} at once")
    print_table(rows)
    if opts.json:
        opts.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
