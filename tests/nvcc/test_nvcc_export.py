"""``cubinstore warmset export --nvcc`` and ``publish --nvcc`` without Bazel or nvcc runs: the files
the export writes from the calls cubinstore-nvcc kept (``_nvcc.warm`` notes), and what publish
checks before it uploads (a synthetic output base stands in for Bazel's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xxhash", reason="cubinstore-nvcc needs the jit extra (xxhash)")

import xxhash  # noqa: E402

from cubinstore import Digest  # noqa: E402
from cubinstore.errors import BadArgumentError  # noqa: E402
from cubinstore.internals import Call, calls, export, remote, warm  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402
from cubinstore.store.http import HttpLayer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUILDIFIER = REPO / "node_modules" / ".bin" / "buildifier"
FLAGS = ("-std=c++20", "--diag-suppress=39,161", "--ptxas-options=--register-usage-level=10", "-O3",
         "--expt-relaxed-constexpr")
HEADER = "#pragma once\nnamespace mylib { template <int N> __global__ void k(int* y) { y[0] = N; } }\n"


def _tu(n: int) -> bytes:
    return f"#include <mylib/k.cuh>\nstatic void i() {{ auto p = &mylib::k<{n}>; (void)p; }}\n".encode()


def _xxh3(data: bytes) -> str:
    return "xxh3:" + xxhash.xxh3_128_hexdigest(data)


def _site(tmp: Path, package: str, kind: str = "site-packages") -> Path:
    """``<tmp>/<package>-env/lib/python3/<kind>/<package>/include`` holding ``mylib/k.cuh``."""
    root = tmp / f"{package}-env" / "lib" / "python3" / kind / package / "include"
    (root / "mylib").mkdir(parents=True, exist_ok=True)
    (root / "mylib" / "k.cuh").write_text(HEADER)
    return root


def _loose(tmp: Path) -> Path:
    """An include root in no Python package: ``<tmp>/opt/include``."""
    root = tmp / "opt" / "include"
    (root / "mylib").mkdir(parents=True, exist_ok=True)
    (root / "mylib" / "k.cuh").write_text(HEADER)
    return root


def _record(key: str, root: Path, data: bytes = b"\x7fELF-placeholder") -> dict:
    return {"key": key, "digest": str(Digest.of(data)), "size": len(data),
            "files": [["inc/0", "mylib/k.cuh", _xxh3((root / "mylib" / "k.cuh").read_bytes())]],
            "absent": [["inc/0", "mylib/shadow.cuh"]], "outside": [], "stdout": "", "stderr": "ptxas info\n"}


def _note(store: Store, key: str, text: bytes, includes: list[Path], flags: tuple[str, ...] = FLAGS,
          record: dict | None = None) -> dict:
    call = Call("/c/tmp/u/kernel.cu", "/c/tmp/u/kernel.cu", "/c/tmp/u/kernel.cubin", "/c/tmp/u/kernel.cubin", "sm_90a",
                tuple(str(d) for d in includes), tuple(f"-I{d}" for d in includes), flags, "cubin")
    record = record if record is not None else _record("0" * 32, includes[0])
    warm.note(store, key, call, text, record)
    return record


@pytest.fixture
def store(clean_env: Path) -> Store:
    return Store([LocalLayer(clean_env)])


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "WORKSPACE").write_text('workspace(name = "ci")\n')
    return ws


def _export(store: Store, out: Path) -> export.Exported:
    assert store.local is not None
    return export.export(store.local, out)


# -- export ------------------------------------------------------------------------------------------

def test_each_call_becomes_one_target_with_its_tu_flags_and_roots_in_order(store: Store, workspace: Path,
                                                                           tmp_path: Path) -> None:
    first, second, system = _site(tmp_path, "mylib"), _site(tmp_path, "other", "dist-packages"), _site(tmp_path, "sysinc")
    flags = (*FLAGS[:2], "-isystem", str(system), *FLAGS[2:])
    _note(store, "a" * 32, _tu(1), [first, second], flags)
    _note(store, "b" * 32, _tu(2), [first])
    out = workspace / "nvcc_warmset"
    result = _export(store, out)
    assert [c.key for c in result.calls] == ["a" * 32, "b" * 32] and result.refused == []
    assert (out / "srcs" / f"{Digest.of(_tu(1)).hex}.cu").read_bytes() == _tu(1)
    build = (out / "BUILD.bazel").read_text()
    block = build[build.index('name = "nvcc_' + "a" * 32):build.index('name = "nvcc_' + "b" * 32)]
    assert f'srcs = ["srcs/{Digest.of(_tu(1)).hex}.cu"]' in block and 'arch = "sm_90a"' in block
    copts = re.findall(r'^        "(.*)",$', block[block.index("copts"):block.index("source_name")], re.MULTILINE)
    assert copts == list(FLAGS)  # the caller's flags in order, the -isystem root taken out
    assert 'source_name = "cubinstore_jit.cu"' in block  # the name cubinstore-nvcc compiled the TU under
    deps = block[block.index("    deps = ["):]
    assert deps.index("@pip_mylib_include//:headers") < deps.index("@pip_other_include//:headers")
    assert '"@pip_sysinc_include//:headers"' in block[block.index("system_deps"):block.index("    deps = [")]
    assert re.search(r'name = "cubins",\n    srcs = \[\n        ":nvcc_a{32}",\n        ":nvcc_b{32}",', build)


def test_each_package_root_is_one_repository_found_by_package_name(store: Store, workspace: Path, tmp_path: Path) -> None:
    mylib = _site(tmp_path, "mylib")
    _note(store, "a" * 32, _tu(1), [mylib])
    _note(store, "b" * 32, _tu(2), [mylib, _site(tmp_path, "other", "dist-packages")])
    result = _export(store, workspace / "w")
    bzl = (workspace / "w" / "repositories.bzl").read_text()
    declared = re.findall(r"^    pip_package_headers\((.*)\)$", bzl, re.MULTILINE)
    assert declared == ['name = "pip_mylib_include", package = "mylib", subdir = "include"',
                        'name = "pip_other_include", package = "other", subdir = "include"']
    assert 'load("@cubinstore//third_party/pip:pip_package_headers.bzl", "pip_package_headers")' in bzl
    assert result.workspace_lines()[0] == 'load("//w:repositories.bzl", "nvcc_warmset_repositories")'
    assert result.module_lines()[0].startswith('pip_package_headers = use_repo_rule("@cubinstore//third_party/pip:')
    assert result.module_lines()[2:] == [f"pip_package_headers({d})" for d in declared]


def test_calls_json_holds_each_calls_target_roots_and_record(store: Store, workspace: Path, tmp_path: Path) -> None:
    root = _site(tmp_path, "mylib")
    record = _note(store, "a" * 32, _tu(1), [root])
    _export(store, workspace / "w")
    doc = json.loads((workspace / "w" / "calls.json").read_bytes())
    assert doc["schema"] == export.SCHEMA
    entry = doc["calls"]["a" * 32]
    assert entry["target"] == "nvcc_" + "a" * 32 and entry["arch"] == "sm_90a"
    assert entry["source"] == str(Digest.of(_tu(1))) and entry["flags"] == list(FLAGS)
    assert entry["roots"] == [{"label": "inc/0", "repository": "pip_mylib_include", "package": "mylib",
                               "subdir": "include"}]
    assert entry["record"] == record


def test_generated_bazel_files_hold_no_absolute_path_and_no_target_named_all(store: Store, workspace: Path,
                                                                            tmp_path: Path) -> None:
    root = _site(tmp_path, "mylib")
    _note(store, "a" * 32, _tu(1), [root], (*FLAGS, "-isystem", str(_site(tmp_path, "sysinc"))))
    _export(store, workspace / "w")
    for name in ("BUILD.bazel", "repositories.bzl"):
        text = (workspace / "w" / name).read_text()
        assert str(tmp_path) not in text, name
        assert not re.search(r'"/(?!/)', text), name  # "//visibility:public" is a label, not a path
        assert 'name = "all"' not in text, name


@pytest.mark.skipif(not BUILDIFIER.exists(), reason="buildifier is not installed: run tools/bootstrap.sh")
def test_generated_bazel_files_are_buildifier_clean(store: Store, workspace: Path, tmp_path: Path) -> None:
    root = _site(tmp_path, "mylib")
    _note(store, "a" * 32, _tu(1), [root], (*FLAGS, "-isystem", str(_site(tmp_path, "sysinc"))))
    _note(store, "b" * 32, _tu(2), [root])
    _export(store, workspace / "w")
    files = [str(workspace / "w" / "BUILD.bazel"), str(workspace / "w" / "repositories.bzl")]
    result = subprocess.run([str(BUILDIFIER), "-mode=check", "-lint=warn", *files], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_root_outside_every_package_refuses_its_call_naming_the_root(store: Store, workspace: Path,
                                                                      tmp_path: Path) -> None:
    loose = _loose(tmp_path)
    _note(store, "a" * 32, _tu(1), [loose])
    _note(store, "b" * 32, _tu(2), [_site(tmp_path, "mylib")])
    result = _export(store, workspace / "w")
    assert [c.key for c in result.calls] == ["b" * 32]
    assert len(result.refused) == 1
    assert result.refused[0].startswith(f"call {'a' * 32}: include root inc/0 ({loose}) lies in no installed Python "
                                        "package")
    assert "nvcc_" + "a" * 32 not in (workspace / "w" / "BUILD.bazel").read_text()


def test_a_note_with_a_flag_cubinstore_nvcc_does_not_model_is_refused(store: Store, workspace: Path, tmp_path: Path) -> None:
    _note(store, "a" * 32, _tu(1), [_site(tmp_path, "mylib")], (*FLAGS, "--keep"))
    result = _export(store, workspace / "w")
    assert result.calls == []
    assert result.refused == [f"call {'a' * 32}: flags: not a call cubinstore-nvcc caches (option '--keep' is not modelled)"]


def test_a_note_whose_tu_left_the_store_is_refused(store: Store, workspace: Path, tmp_path: Path) -> None:
    _note(store, "a" * 32, _tu(1), [_site(tmp_path, "mylib")])
    assert store.local is not None and store.local.remove(Digest.of(_tu(1)))
    result = _export(store, workspace / "w")
    assert result.refused == [f"call {'a' * 32}: its TU text {Digest.of(_tu(1))} is not in the local store"]


@pytest.mark.parametrize(("path", "expected"), [
    ("/v/lib/python3.11/site-packages/deep_gemm/include", export.PipRoot("deep_gemm", "include")),
    ("/usr/lib/python3/dist-packages/mylib", export.PipRoot("mylib", "")),
    ("/v/site-packages/a/site-packages/pkg/x/y", export.PipRoot("pkg", "x/y")),  # the innermost
    ("/v/lib/python3.11/site-packages", None),
    ("/v/lib/python3.11/site-packages/deep-gemm/include", None),  # no import name
    ("/v/lib/python3.11/site-packages/mylib/in clude", None),
    ("/opt/mylib/include", None),
])
def test_pip_root_names_the_package_a_root_lies_in(path: str, expected: export.PipRoot | None) -> None:
    assert export.pip_root(path) == expected


def test_cli_export_takes_family_or_nvcc(cli_env: dict[str, str], cli, tmp_path: Path) -> None:
    neither = cli(["warmset", "export"], cli_env)
    assert neither.returncode != 0 and "pass --family FAMILY (or --nvcc)" in neither.stderr
    both = cli(["warmset", "export", "--nvcc", "--family", "axpy", "--out", str(tmp_path / "w")], cli_env)
    assert both.returncode != 0 and "warmset export --nvcc takes no --family" in both.stderr


def test_cli_export_prints_the_lines_to_add_and_fails_on_a_refused_call(cli_env: dict[str, str], cli, store: Store,
                                                                        workspace: Path, tmp_path: Path) -> None:
    _note(store, "b" * 32, _tu(2), [_site(tmp_path, "mylib")])
    ok = cli(["warmset", "export", "--nvcc", "--out", str(workspace / "w")], cli_env)
    assert ok.returncode == 0, ok.stderr
    assert 'load("//w:repositories.bzl", "nvcc_warmset_repositories")' in ok.stdout
    assert 'pip_package_headers(name = "pip_mylib_include", package = "mylib", subdir = "include")' in ok.stdout
    _note(store, "a" * 32, _tu(1), [_loose(tmp_path)])
    refused = cli(["warmset", "export", "--nvcc", "--out", str(workspace / "w")], cli_env)
    assert refused.returncode == 1 and f"call {'a' * 32}: include root inc/0" in refused.stderr


# -- publish -----------------------------------------------------------------------------------------

def _elf_cubin(sm: int, body: bytes = b"") -> bytes:
    """The 64-byte header CubinImage reads (64-bit, little-endian, EM_CUDA, ABI v8, the SM in
    e_flags), then ``body``: enough for the checks publish makes."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    header[8] = 8
    struct.pack_into("<H", header, 0x12, 190)
    struct.pack_into("<I", header, 0x30, sm << 8)
    return bytes(header) + body


@pytest.fixture
def ci(store: Store, workspace: Path, tmp_path: Path) -> SimpleNamespace:
    """A call whose key names this host's toolchain, exported into ``workspace``, and an output
    base laid out as Bazel's (``bazel-bin`` with the call's CUBIN, the repository linking the
    package's include folder)."""
    if shutil.which("gcc") is None:
        pytest.skip("no host compiler (gcc): the toolchain identity cannot be taken")
    try:
        identity = export._toolchain(store)["identity"]
    except BadArgumentError as exc:
        pytest.skip(f"no CUDA toolkit: {exc}")
    root = _site(tmp_path, "mylib")
    key = calls.call_key(_tu(7), "sm_90a", "cubin", list(FLAGS), 1, identity)
    _note(store, key, _tu(7), [root], record=_record("1" * 32, root))
    _export(store, workspace / "w")
    output_base = tmp_path / "output_base"
    bazel_bin = output_base / "execroot" / "ci" / "bazel-out" / "k8-fastbuild" / "bin"
    (bazel_bin / "w").mkdir(parents=True)
    cubin = _elf_cubin(90, b"bazel built this")
    (bazel_bin / "w" / f"nvcc_{key}.cubin").write_bytes(cubin)
    repo = output_base / "external" / "pip_mylib_include"
    repo.mkdir(parents=True)
    (repo / "include").symlink_to(root)
    return SimpleNamespace(key=key, root=root, bazel_bin=bazel_bin, out=workspace / "w", cubin=cubin)


def _remote_store(url: str) -> Store:
    return Store([LocalLayer(Path(os.environ["CUBINSTORE_HOME"])), HttpLayer(url)])


def test_publish_uploads_bazels_cubin_under_the_call_key_with_the_record_naming_it(ci: SimpleNamespace, faulty) -> None:
    report = export.publish(_remote_store(faulty.url), ci.out, ci.bazel_bin)
    assert (report.published, report.skipped, report.failed) == ([ci.key], [], [])
    fresh = Store([LocalLayer(ci.out.parent / "fresh"), HttpLayer(faulty.url)])
    found = remote.fetch(fresh, ci.key, {"inc/0": str(ci.root), "cuda": "/nonexistent"})
    assert found is not None
    record, data = found
    assert data == ci.cubin and record["digest"] == str(Digest.of(ci.cubin)) and record["size"] == len(ci.cubin)
    assert record["stderr"] == "ptxas info\n"  # the first compile's messages, replayed on hits


def test_publish_skips_a_call_whose_header_differs_from_what_it_read_naming_the_file(ci: SimpleNamespace, faulty) -> None:
    (ci.root / "mylib" / "k.cuh").write_text(HEADER + "// changed\n")
    report = export.publish(_remote_store(faulty.url), ci.out, ci.bazel_bin)
    assert report.published == [] and report.failed == []
    assert report.skipped == [f"call {ci.key} (//w:nvcc_{ci.key}): not published: {ci.root}/mylib/k.cuh changed "
                              "since the call was recorded"]
    assert not any(method == "PUT" for method, _ in faulty.counts)


def test_publish_skips_a_call_a_new_header_would_shadow(ci: SimpleNamespace, faulty) -> None:
    (ci.root / "mylib" / "shadow.cuh").write_text("#pragma once\n")
    report = export.publish(_remote_store(faulty.url), ci.out, ci.bazel_bin)
    assert report.published == [] and report.skipped == [
        f"call {ci.key} (//w:nvcc_{ci.key}): not published: {ci.root}/mylib/shadow.cuh appeared since the call was recorded"]


def test_publish_skips_a_cubin_built_for_another_arch(ci: SimpleNamespace, faulty) -> None:
    path = ci.bazel_bin / "w" / f"nvcc_{ci.key}.cubin"
    path.write_bytes(_elf_cubin(80))
    report = export.publish(_remote_store(faulty.url), ci.out, ci.bazel_bin)
    assert report.published == [] and len(report.skipped) == 1
    assert f"{path} is a CUBIN for sm_80, expected sm_90a" in report.skipped[0]


def test_publish_skips_a_call_recorded_with_another_toolchain(ci: SimpleNamespace, store: Store, workspace: Path,
                                                              faulty) -> None:
    other = "c" * 32  # a key this host's toolchain does not give the call
    _note(store, other, _tu(8), [ci.root], record=_record("2" * 32, ci.root))
    _export(store, ci.out)
    (ci.bazel_bin / "w" / f"nvcc_{other}.cubin").write_bytes(_elf_cubin(90))
    report = export.publish(_remote_store(faulty.url), ci.out, ci.bazel_bin)
    assert report.published == [ci.key]
    assert report.skipped == [f"call {other} (//w:nvcc_{other}): this host's toolchain (CUDA toolkit "
                              f"{export._toolchain(store)['toolkit']}, host compiler, CUBINSTORE_NVCC) is not the one "
                              "that recorded the call, so Bazel's CUBIN is not what its key names"]


def test_publish_refuses_a_bin_folder_that_is_not_bazels(ci: SimpleNamespace, faulty, tmp_path: Path) -> None:
    with pytest.raises(BadArgumentError, match=r"^--bazel-bin .*: expected Bazel's bin folder"):
        export.publish(_remote_store(faulty.url), ci.out, tmp_path)


@pytest.mark.parametrize("change", [
    lambda doc: doc.update(schema="cubinstore/nvcc-warmset/v0"),
    lambda doc: next(iter(doc["calls"].values())).update(target="all"),
    lambda doc: next(iter(doc["calls"].values())).update(flags=["-I/etc"]),
    lambda doc: next(iter(doc["calls"].values()))["roots"][0].update(repository="../../x"),
    lambda doc: next(iter(doc["calls"].values()))["record"].update(size=-1),
])
def test_publish_refuses_a_malformed_calls_json(ci: SimpleNamespace, faulty, change) -> None:
    path = ci.out / "calls.json"
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(BadArgumentError, match=rf"^{re.escape(str(path))}: "):
        export.publish(_remote_store(faulty.url), ci.out, ci.bazel_bin)
    assert not faulty.counts
