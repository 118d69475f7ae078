"""The warm set: records that count across processes, an export Bazel loads (accumulating),
prefetch of only the warm closure, and gc that evicts warm CUBINs last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cubinstore import Digest, Manifest
from cubinstore.errors import BadArgumentError
from cubinstore.internals import gc, warmset as _warmset
from cubinstore.store import LocalLayer

pytestmark = pytest.mark.usefixtures("clean_env")

REPO = Path(__file__).resolve().parents[2]


def test_one_point_recorded_three_times_is_one_record_counted_three(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    for _ in range(3):
        _warmset.record(local, kind="miss", family="axpy", params={"dtype": "f32", "vec": 2}, arch="sm_90a")
    _warmset.record(local, kind="miss", family="axpy", params={"vec": 2, "dtype": "f32"}, arch="sm_80")
    recs = _warmset.records(local)
    assert [(r.arch, r.count) for r in recs] == [("sm_80", 1), ("sm_90a", 3)]
    assert all(0 < r.first_seen <= r.last_seen <= time.time() for r in recs)


def test_concurrent_processes_never_lose_a_count(tmp_path: Path, clean_env: Path) -> None:
    code = ("from cubinstore.internals import knobs as _env, warmset as _warmset\nfrom cubinstore.store import LocalLayer\n"
            "_warmset.record(LocalLayer(_env.home()), kind='miss', family='gemm', params={'bn': 176}, arch='sm_90a')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(8)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 8
    (rec,) = _warmset.records(LocalLayer(clean_env))
    assert rec.count == 8 and rec.params == {"bn": 176}


def test_a_jit_record_keeps_its_key_and_digest_when_a_miss_follows(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    digest = Digest("ab" * 32)
    _warmset.record(local, kind="jit", family="gemm", params={"bn": 176}, arch="sm_90a", key="0" * 32, digest=digest)
    rec = _warmset.record(local, kind="miss", family="gemm", params={"bn": 176}, arch="sm_90a")
    assert (rec.kind, rec.key, rec.digest, rec.count) == ("jit", "0" * 32, digest, 2)
    assert _warmset.warm_digests(local) == {digest}


@pytest.mark.parametrize(("params", "message"), [
    ({"bn": 1.5}, "warm set: parameter bn must be an int or a word"),
    ({"b n": 1}, "warm set: parameter names must be identifiers"),
    ({"bn": "../x"}, "warm set: parameter bn must be an int or a word"),
])
def test_malformed_points_are_refused_before_anything_is_written(tmp_path: Path, params, message) -> None:
    local = LocalLayer(tmp_path / "home")
    with pytest.raises(BadArgumentError, match="^" + message):
        _warmset.record(local, kind="miss", family="axpy", params=params, arch="sm_90a")
    assert not (tmp_path / "home" / "v1" / "warmset").exists()


def _points(path: Path) -> list[dict]:
    line = next(x for x in path.read_text().splitlines() if x.startswith(_warmset.EXPORT_MARK))
    return json.loads(line[len(_warmset.EXPORT_MARK):])


def test_export_writes_the_familys_points_and_accumulates(tmp_path: Path, cli, cli_env) -> None:
    local = LocalLayer(Path(cli_env["CUBINSTORE_HOME"]))
    _warmset.record(local, kind="miss", family="axpy", params={"dtype": "f32", "vec": 2}, arch="sm_90a")
    _warmset.record(local, kind="jit", family="gemm", params={"bn": 176}, arch="sm_90a", key="1" * 32)
    _warmset.record(local, kind="jit", family=None, params=None, arch="sm_90a", key="2" * 32)
    out_path = tmp_path / "ws" / "warmset.bzl"
    out_path.parent.mkdir()
    out = cli(["warmset", "export", "--family", "axpy", "--out", str(out_path)], cli_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"exported 1 warm points of axpy (1 new) to {out_path}\n"
    assert "1 JIT records name no family" in out.stderr
    assert _points(out_path) == [{"dtype": "f32", "vec": 2}]
    listed = cli(["warmset", "list"], cli_env)
    assert listed.returncode == 0
    assert "miss  axpy dtype=f32 vec=2  sm_90a  count 1  key -  -" in listed.stdout.splitlines()
    text = out_path.read_text()
    assert "WARM_POINTS = [" in text and '"dtype": "f32"' in text

    # A later export from a store that has forgotten the first point keeps it: the next
    # release must not lose a point the previous one built.
    local2 = LocalLayer(tmp_path / "home2")
    _warmset.record(local2, kind="miss", family="axpy", params={"dtype": "f64", "vec": 2}, arch="sm_80")
    result = _warmset.export(local2, "axpy", out_path)
    assert result.added == 1
    assert _points(out_path) == [{"dtype": "f32", "vec": 2}, {"dtype": "f64", "vec": 2}]


def test_the_export_is_data_and_warm_grid_is_defined_once(tmp_path: Path) -> None:
    # cubin_instantiations(warm_points = WARM_POINTS) applies the one warm_grid; the export holds no code.
    local = LocalLayer(tmp_path / "home")
    _warmset.record(local, kind="miss", family="gemm", params={"bn": 176, "bm": 128}, arch="sm_90a")
    out = tmp_path / "warmset.bzl"
    _warmset.export(local, "gemm", out)
    body = out.read_text().rsplit('"""', 1)[1]  # after the docstring
    code = [line for line in body.splitlines() if line and not line.startswith((" ", "#", "]"))]
    assert code == ["WARM_POINTS = ["], code
    defining = sorted(str(p.relative_to(REPO)) for d in ("tools", "kernels") for p in (REPO / d).rglob("*.bzl")
                      if "def warm_grid(" in p.read_text())
    assert defining == ["tools/private/macros/warm_grid.bzl"]
    macro = (REPO / "tools" / "private" / "macros" / "cubin_instantiations.bzl").read_text()
    assert 'load(":warm_grid.bzl", "warm_grid")' in macro and "grid = warm_grid(grid, warm_points)" in macro


def test_export_refuses_to_overwrite_a_file_it_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "warmset.bzl"
    out.write_text("WARM_POINTS = []  # hand-written\n")
    with pytest.raises(BadArgumentError, match=f"^{out} exists but was not written by `cubinstore warmset export`"):
        _warmset.export(LocalLayer(tmp_path / "home"), "axpy", out)
    assert out.read_text() == "WARM_POINTS = []  # hand-written\n"


def test_prefetch_fetches_only_the_warm_closure(faulty, make_release, cli, cli_env) -> None:
    release = make_release(n=8, archs=("sm_90a",))
    for hex_, data in release.blobs.items():
        faulty.stored[f"/cas/{hex_}"] = data
    local = LocalLayer(Path(cli_env["CUBINSTORE_HOME"]))
    _warmset.record(local, kind="miss", family="axpy", params={"dtype": "f64", "vec": 2}, arch="sm_90a")
    _warmset.record(local, kind="miss", family="axpy", params={"dtype": "f32", "vec": 4}, arch="sm_90a")
    _warmset.record(local, kind="miss", family="axpy", params={"dtype": "f32", "vec": 4}, arch="sm_80")  # no such kernel
    out = cli(["warmset", "prefetch", str(release.path), "--remote", faulty.url], cli_env)
    assert out.returncode == 0, out.stderr
    manifest = Manifest.from_path(release.path)
    wanted = {k.digest.hex for k in manifest.kernels if (k.params["dtype"], k.params["vec"]) in {("f64", 2), ("f32", 4)}}
    assert out.stdout == f"prefetched the warm set of {manifest.digest}: 2 of 8 blobs\n"
    assert {e.digest.hex for e in local.scan()[0]} == wanted
    assert sum(faulty.count("GET", f"/cas/{h}") for h in release.blobs) == 2


def test_gc_evicts_warm_cubins_after_all_others(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    blobs = {name: (b"\x7fELF" + name.encode() * 1000) for name in ("warm", "old", "new")}
    digests = {name: Digest.of(data) for name, data in blobs.items()}
    for age, name in enumerate(("warm", "old", "new")):  # warm is the least recently used
        local.write(digests[name], blobs[name])
        t = time.time() - 3600 + age * 60
        os.utime(local.path_for(digests[name]), (t, t))
    _warmset.record(local, kind="jit", family="gemm", params={"bn": 176}, arch="sm_90a", key="3" * 32,
                    digest=digests["warm"])
    result = gc(local, max_bytes=len(blobs["warm"]))
    assert {e.digest for e in result.evicted} == {digests["old"], digests["new"]}
    assert {e.digest for e in local.scan()[0]} == {digests["warm"]}


BUILDIFIER = REPO / "node_modules" / ".bin" / "buildifier"


@pytest.mark.skipif(not BUILDIFIER.exists(), reason="buildifier is not installed: run tools/bootstrap.sh")
def test_the_export_is_buildifier_clean_so_it_can_be_committed(tmp_path: Path) -> None:
    local = LocalLayer(tmp_path / "home")
    _warmset.record(local, kind="miss", family="gemm", params={"bn": 176, "bm": 128}, arch="sm_90a")
    full, empty = tmp_path / "full.bzl", tmp_path / "empty.bzl"
    _warmset.export(local, "gemm", full)
    _warmset.export(local, "axpy", empty)
    out = subprocess.run([str(BUILDIFIER), "-mode=check", "-lint=warn", str(full), str(empty)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARM_POINTS = []" in empty.read_text()


def test_export_outside_a_workspace_is_a_usage_error(tmp_path: Path, cli, cli_env) -> None:
    cli_env["CUBINSTORE_TEST_CWD"] = str(tmp_path)  # no kernels/axpy here
    out = cli(["warmset", "export", "--family", "axpy"], cli_env)
    assert out.returncode == 2
    assert out.stderr.startswith("cubinstore: error: warmset export: kernels/axpy is not a directory; run from the workspace root")
    assert not (tmp_path / "kernels").exists()


# -- damaged records, bad flags, a FIFO: one line each, never a traceback, never a hang ---------------

def _one_line(stderr: str, starts: str) -> str:
    assert "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and stderr.startswith(starts), stderr
    return stderr


def _damage(local: LocalLayer, damage) -> Path:
    """A record of axpy dtype=bf16 (beside a good one of dtype=f32), rewritten by ``damage`` (doc -> doc or bytes)."""
    _warmset.record(local, kind="miss", family="axpy", params={"dtype": "f32"}, arch="sm_90a")
    before = set((local.v1 / "warmset").glob("*/*.json"))
    _warmset.record(local, kind="miss", family="axpy", params={"dtype": "bf16"}, arch="sm_90a")
    (path,) = set((local.v1 / "warmset").glob("*/*.json")) - before
    changed = damage(json.loads(path.read_text()))
    path.write_bytes(changed if isinstance(changed, bytes) else json.dumps(changed).encode())
    return path


def _with_params(params):
    return lambda doc: dict(doc, params=params)


DAMAGES = {
    "null value": _with_params({"dtype": None}),
    "bool value": _with_params({"dtype": True}),
    "list value": _with_params({"dtype": ["f32"]}),
    "object value": _with_params({"dtype": {"a": 1}}),
    "quote in a key": _with_params({'dt"ype': "f32"}),
    "quote in a value": _with_params({"dtype": 'f32"+x'}),
    "newline in a value": _with_params({"dtype": "f32\nload"}),
    "huge int": _with_params({"dtype": 2**70}),
    "family 123": lambda doc: dict(doc, family=123),
    "family with a quote": lambda doc: dict(doc, family='axpy"'),
    "arch that breaks the docstring": lambda doc: dict(doc, arch='sm_90a"""\nfail("x")\n"""'),
    "params a list": lambda doc: dict(doc, params=[["dtype", "f32"]]),
    "count a string": lambda doc: dict(doc, count="7"),
    "count negative": lambda doc: dict(doc, count=-1),
    "key not hex": lambda doc: dict(doc, key="../x"),
    "digest malformed": lambda doc: dict(doc, digest="sha256:zz"),
    "unknown field": lambda doc: dict(doc, extra=1),
    "not an object": lambda doc: [doc],
    "duplicate key": lambda doc: json.dumps(doc).replace('"kind":', '"family": "axpy", "kind":', 1).encode(),
    "deep nesting": lambda doc: ("[" * 100_000 + "]" * 100_000).encode(),
}


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_a_damaged_record_is_skipped_with_one_warning_naming_its_file(tmp_path: Path, cli, cli_env, damage: str) -> None:
    local = LocalLayer(Path(cli_env["CUBINSTORE_HOME"]))
    path = _damage(local, DAMAGES[damage])
    listed = cli(["warmset", "list"], cli_env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    _one_line(listed.stderr, f"cubinstore: WARNING: cubinstore._release.warmset: ignoring damaged warm set record {path}: ")
    assert listed.stdout == "miss  axpy dtype=f32  sm_90a  count 1  key -  -\n"

    out_path = tmp_path / "warmset.bzl"
    exported = cli(["warmset", "export", "--family", "axpy", "--out", str(out_path)], cli_env, timeout=60)
    assert exported.returncode == 0, exported.stderr
    _one_line(exported.stderr, f"cubinstore: WARNING: cubinstore._release.warmset: ignoring damaged warm set record {path}: ")
    assert _points(out_path) == [{"dtype": "f32"}]
    assert "seen at run time: sm_90a)" in out_path.read_text()


def test_starlark_is_written_only_from_checked_points(tmp_path: Path) -> None:
    # export's records are checked when read; the writer checks each point again where it becomes code.
    with pytest.raises(BadArgumentError, match="^warm set: parameter dtype must be an int or a word"):
        _warmset._starlark_points([{"dtype": 'f32"]\nfail("x")'}])
    with pytest.raises(BadArgumentError, match="^warm set: parameter names must be identifiers"):
        _warmset._starlark_points([{'a"': 1}])


@pytest.mark.parametrize("days", ["nan", "inf", "-inf", "1e308", "-1", "abc", "36501"])
def test_since_days_must_be_a_finite_number_of_days(tmp_path: Path, cli, cli_env, days: str) -> None:
    _warmset.record(LocalLayer(Path(cli_env["CUBINSTORE_HOME"])), kind="miss", family="axpy",
                    params={"dtype": "f32"}, arch="sm_90a")
    out_path = tmp_path / "warmset.bzl"
    out = cli(["warmset", "export", "--family", "axpy", "--out", str(out_path), f"--since-days={days}"], cli_env,
              timeout=60)
    assert out.returncode == 2
    _one_line(out.stderr, "cubinstore: error: ")
    assert "argument --since-days: expected a number of days in [0, 36500]" in out.stderr
    assert not out_path.exists()


def test_since_days_keeps_recent_points(tmp_path: Path, cli, cli_env) -> None:
    _warmset.record(LocalLayer(Path(cli_env["CUBINSTORE_HOME"])), kind="miss", family="axpy",
                    params={"dtype": "f32"}, arch="sm_90a")
    out_path = tmp_path / "warmset.bzl"
    out = cli(["warmset", "export", "--family", "axpy", "--out", str(out_path), "--since-days", "0.5"], cli_env)
    assert out.returncode == 0, out.stderr
    assert _points(out_path) == [{"dtype": "f32"}]


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_out_must_be_a_regular_file_or_new_and_never_blocks(tmp_path: Path, cli, cli_env, kind: str) -> None:
    _warmset.record(LocalLayer(Path(cli_env["CUBINSTORE_HOME"])), kind="miss", family="axpy",
                    params={"dtype": "f32"}, arch="sm_90a")
    out_path = tmp_path / "warmset.bzl"
    if kind == "fifo":
        os.mkfifo(out_path)
    elif kind == "symlink":
        target = tmp_path / "elsewhere.bzl"
        _warmset.export(LocalLayer(tmp_path / "other-home"), "axpy", target)  # an export, reached by a link
        out_path.symlink_to(target)
    else:
        out_path.mkdir()
    # A hang fails here (the child is killed at the timeout) instead of blocking the suite.
    out = cli(["warmset", "export", "--family", "axpy", "--out", str(out_path)], cli_env, timeout=30)
    assert out.returncode == 2
    what = {"fifo": "is a FIFO", "symlink": "is a symbolic link", "directory": "is a directory"}[kind]
    _one_line(out.stderr, f"cubinstore: error: warmset export: --out {out_path} {what}; expected a regular file "
                          f"or a new path")
