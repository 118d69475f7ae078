#!/usr/bin/env python3
"""Measures the build figures of the README's closing note, side by side, in one run:

  cold       a fresh copy of the workspace, a fresh output base, an empty disk cache
  no-op      the same command again in the same copy (server warm, nothing changed)
  relocated  a second copy at a path of another depth, a fresh output base, the same disk cache

Seconds are the wall time of the `bazel build` command (server start, repository fetch and
analysis included for the fresh output bases). Instantiations, hits and misses are read from
Bazel's execution log (`CubinCompile` spawns), never inferred from timing.

Usage:
  .venv/bin/python benchmarks/build_figures.py [--targets //kernels:all] [--json FILE] [--keep]
      [--bazel7] [--cuda-path DIR]
--bazel7 measures Bazel 7 (tools/bazel7, MODULE.bazel) instead of Bazel 4.2.3; --cuda-path sets
CUDA_PATH for the builds (e.g. the sid root's CUDA 13.5, to compare both on one toolkit).
Set CUBINSTORE_BAZEL_TEST_REV=HEAD to measure the last commit instead of the working tree.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.bazel._workspace import (  # noqa: E402  (the path above makes the checkout importable)
    ALL_TARGETS,
    COMPILE,
    BuildResult,
    Workspace,
    find_bazel,
    find_bazel7,
    find_venv,
)

logger = logging.getLogger("build_figures")


@dataclass(frozen=True)
class Figure:
    build: str
    seconds: float
    compile_spawns: int
    hits: int
    misses: int
    instantiations: int


def figure(name: str, result: BuildResult, instantiations: int) -> Figure:
    compiles = result.by_label(COMPILE)
    hits = sum(compiles.values())
    return Figure(name, round(result.seconds, 1), len(compiles), hits, len(compiles) - hits, instantiations)


def table(figures: list[Figure]) -> str:
    header = ("build", "seconds", "instantiations", f"{COMPILE} spawns", "cache hits", "misses")
    rows = [header] + [(f.build, f"{f.seconds:.1f}", str(f.instantiations), str(f.compile_spawns),
                        str(f.hits), str(f.misses)) for f in figures]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def measure(work: Path, targets: tuple[str, ...], bazel7: bool = False,
            env: dict[str, str] | None = None) -> list[Figure]:
    bazel, venv = (find_bazel7() if bazel7 else find_bazel()), find_venv()
    if bazel is None:
        raise SystemExit("build_figures: Bazel not found (node_modules/.bin/bazelisk, bazelisk or bazel on PATH;"
                         " for --bazel7, tools/bootstrap_bazel7.sh)")
    disk_cache = work / "disk_cache"
    disk_cache.mkdir()
    first = Workspace.create(work / "a" / "cubinstore", work / "output_base_a", bazel, venv, bzlmod=bazel7)
    second = Workspace.create(work / "b" / "srv" / "releases" / "current" / "cubinstore",
                              work / "output_base_b", bazel, venv, bzlmod=bazel7)
    for ws in (first, second):
        ws.env_defaults.update(env or {})
    try:
        logger.info("cold build in %s", first.root)
        cold = first.build(targets, disk_cache=disk_cache, clean=False)
        instantiations = len(cold.manifest_json()["kernels"]) if cold.manifest else len(cold.by_label())
        logger.info("no-op build in %s", first.root)
        noop = first.build(targets, disk_cache=disk_cache, clean=False)
        logger.info("relocated build in %s", second.root)
        moved = second.build(targets, disk_cache=disk_cache, clean=False)
        if moved.manifest is not None and moved.manifest != cold.manifest:
            logger.error("the relocated build's manifest differs from the cold build's")
    finally:
        first.shutdown()
        second.shutdown()
    return [figure("cold (empty disk cache)", cold, instantiations),
            figure("no-op (same output base)", noop, instantiations),
            figure("relocated (shared disk cache)", moved, instantiations)]


def remove_tree(path: Path) -> None:
    """Deletes `path`, including the read-only directories Bazel leaves in an output base."""
    def make_writable(func, name, _exc_info) -> None:  # type: ignore[no-untyped-def]
        os.chmod(os.path.dirname(name), 0o700)
        if not os.path.islink(name) and os.path.isdir(name):
            os.chmod(name, 0o700)
        func(name)
    shutil.rmtree(path, onerror=make_writable)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(ALL_TARGETS), help="targets to build")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies and caches")
    parser.add_argument("--bazel7", action="store_true", help="measure Bazel 7 (tools/bazel7) instead of 4.2.3")
    parser.add_argument("--cuda-path", help="CUDA_PATH for the builds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    work = Path(tempfile.mkdtemp(prefix="cubinstore-build-figures-"))
    try:
        figures = measure(work, tuple(args.targets), bazel7=args.bazel7,
                          env={"CUDA_PATH": args.cuda_path} if args.cuda_path else None)
    finally:
        if args.keep:
            logger.info("kept %s", work)
        else:
            remove_tree(work)
    print(table(figures))
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
