"""The JIT's direct path: a warm hit checks only the files the TU included and the shape of each
root (real nvcc, no GPU). What must miss still misses; what the TU never read does not matter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.jit import ENTRIES, TU, child_env, make_library, run_child, toolkit_copy  # noqa: E402

from cubinstore import jit  # noqa: E402
from cubinstore.errors import BadArgumentError  # noqa: E402
from cubinstore.internals import JitIndex, compiler, cutlass_include, direct as _jitdirect, key as _jitkey  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

ARCH = "sm_90a"

# A child that must find its kernel without listing or hashing any tree: listing a directory ends it.
# An audit hook sees every os.scandir (each walk lists through it), with nothing of the package replaced.
_NO_WALK = """
import sys
def refuse(event, args):
    if event == "os.scandir" and not str(args[0]).endswith("nvvm/libdevice"):
        raise SystemExit(f"walked {args[0]}")  # the toolkit's programs (a few files, not a tree) may be listed
sys.addaudithook(refuse)
"""


@pytest.fixture
def no_racy_window() -> Iterator[None]:
    # Files these tests write are seconds old; stats are trusted only outside the racy window.
    with _jitkey.racy_window(0):  # the one window, for the key's and the direct key's caches
        yield


@pytest.fixture
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    for name in list(os.environ):
        if name.startswith("CUBINSTORE_"):
            monkeypatch.delenv(name)
    jit.clear_caches()
    home = tmp_path / "home"
    include = make_library(tmp_path / "lib")
    store = Store([LocalLayer(home)])
    yield SimpleNamespace(tmp=tmp_path, home=home, include=include, store=store)
    jit.clear_caches()


def _compile(lib: SimpleNamespace, *dirs: Path, source: str = TU, flags: tuple[str, ...] = ()) -> jit.JitKernel:
    return jit.compile(source, include_dirs=list(dirs or [lib.include]), flags=list(flags), arch=ARCH, entries=ENTRIES,
                       store=lib.store)


def _again(lib: SimpleNamespace, *dirs: Path, **kw) -> jit.JitKernel:
    jit.clear_caches()  # as a fresh process would see it (the stat caches on disk stay)
    return _compile(lib, *dirs, **kw)


def _child_compile(lib: SimpleNamespace, include: Path, prelude: str = "") -> list[str]:
    code = prelude + (
        "from cubinstore import jit\n"
        f"k = jit.compile({TU!r}, include_dirs=[{str(include)!r}], arch={ARCH!r}, entries={ENTRIES!r})\n"
        "print(k.compiled, k.found_by, k.key)\n"
    )
    out = run_child(code, child_env(lib.home))
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


# -- hits -----------------------------------------------------------------------------------------

def test_a_fresh_process_hits_through_the_direct_path_without_walking_a_tree(lib: SimpleNamespace,
                                                                             no_racy_window: None) -> None:
    first = _compile(lib)
    assert (first.compiled, first.found_by) == (True, "compile")
    assert _child_compile(lib, lib.include, _NO_WALK) == ["False", "direct", str(first.key)]


def test_the_same_process_hits_through_the_direct_path(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    k = _again(lib)
    assert (k.compiled, k.found_by, k.key, k.digest) == (False, "direct", first.key, first.digest)
    assert k.key.parts == first.key.parts


def test_a_relocated_copy_and_a_symlinked_tree_hit_through_the_direct_path(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    copied = lib.tmp / "opt" / "venvs" / "prod" / "site-packages" / "mylib" / "include"
    shutil.copytree(lib.include, copied)
    linked = lib.tmp / "links" / "include"
    linked.mkdir(parents=True)
    (linked / "mylib").symlink_to(lib.include / "mylib", target_is_directory=True)
    for tree in (copied, linked):
        assert _child_compile(lib, tree) == ["False", "direct", str(first.key)]


def test_a_changed_header_the_tu_does_not_include_hits(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    with open(lib.include / "mylib" / "unused.cuh", "a") as f:
        f.write("// edited; no TU includes it\n")
    k = _again(lib)
    assert (k.compiled, k.found_by, k.key) == (False, "direct", first.key)
    # The full key (explain's) does see it: the direct path is what makes this a hit.
    assert jit.key(TU, include_dirs=[lib.include], arch=ARCH, store=lib.store) != first.key


def test_a_flag_include_directory_is_checked_like_an_include_root(lib: SimpleNamespace) -> None:
    flags = (f"-I{lib.include}",)
    first = jit.compile(TU, include_dirs=[], flags=list(flags), arch=ARCH, entries=ENTRIES, store=lib.store)
    jit.clear_caches()
    k = jit.compile(TU, include_dirs=[], flags=list(flags), arch=ARCH, entries=ENTRIES, store=lib.store)
    assert (k.found_by, k.key) == ("direct", first.key)
    with open(lib.include / "mylib" / "twice.cuh", "a") as f:
        f.write("// changed\n")
    jit.clear_caches()
    k = jit.compile(TU, include_dirs=[], flags=list(flags), arch=ARCH, entries=ENTRIES, store=lib.store)
    assert k.compiled is True and k.key != first.key


# -- misses -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["same_process", "fresh_process"])
def test_a_changed_included_header_misses_through_the_direct_path(lib: SimpleNamespace, where: str,
                                                                   no_racy_window: None) -> None:
    first = _compile(lib)
    with open(lib.include / "mylib" / "twice.cuh", "a") as f:
        f.write("// a patched release\n")
    if where == "same_process":
        k = _again(lib)
        assert k.compiled is True and k.key != first.key
    else:
        compiled, found_by, key = _child_compile(lib, lib.include)
        assert (compiled, found_by) == ("True", "compile") and key != str(first.key)


def test_an_in_place_edit_that_keeps_size_and_mtime_still_misses(lib: SimpleNamespace, no_racy_window: None) -> None:
    first = _compile(lib)
    header = lib.include / "mylib" / "twice.cuh"
    st = header.stat()
    header.write_text(header.read_text().replace("x + x", "x * 2"))  # same length
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))
    k = _again(lib)  # the inode's ctime moved: the stat check fails and the content decides
    assert k.compiled is True and k.key != first.key


def test_a_new_file_that_shadows_an_include_earlier_in_the_path_misses(lib: SimpleNamespace) -> None:
    front = lib.tmp / "front" / "include"
    (front / "other").mkdir(parents=True)
    (front / "other" / "x.cuh").write_text("// unrelated\n")
    first = _compile(lib, front, lib.include)
    assert _again(lib, front, lib.include).found_by == "direct"
    (front / "mylib").mkdir()
    (front / "mylib" / "twice.cuh").write_text(
        "template <typename T> __device__ T twice(T x) { return x * 3; }\n")  # found before the library's
    k = _again(lib, front, lib.include)
    assert k.compiled is True and k.key != first.key and k.digest != first.digest


def test_a_new_file_a_has_include_looks_for_misses(lib: SimpleNamespace) -> None:
    source = '#if __has_include("mylib/extra.cuh")\n#define FACTOR 3\n#endif\n' + TU
    first = _compile(lib, source=source)
    (lib.include / "mylib" / "extra.cuh").write_text("// now present\n")
    k = _again(lib, source=source)
    assert k.compiled is True and k.digest != first.digest


def test_a_changed_flag_or_arch_misses(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    assert _again(lib, flags=("-DFACTOR=2",)).compiled is True
    jit.clear_caches()
    k = jit.compile(TU, include_dirs=[lib.include], arch="sm_80", entries=ENTRIES, store=lib.store)
    assert k.compiled is True and k.key != first.key


def test_headers_of_the_device_pass_and_of_the_host_pass_are_both_checked(lib: SimpleNamespace) -> None:
    # -cubin preprocesses twice (__CUDA_ARCH__ defined, then not); -MD must list both passes' files.
    (lib.include / "mylib" / "dev.cuh").write_text("#define DEV_FACTOR 1\n")
    (lib.include / "mylib" / "host.cuh").write_text("// host side only\n")
    source = ('#ifdef __CUDA_ARCH__\n#include "mylib/dev.cuh"\n#else\n#include "mylib/host.cuh"\n#endif\n'
              + TU.replace("* FACTOR;", "* FACTOR * DEV_FACTOR;"))
    first = _compile(lib, source=source)
    (dep,) = _direct_files(lib.home, "deps")
    recorded = {rel for _, rel, _ in json.loads(dep.read_text())["files"]}
    assert {"mylib/dev.cuh", "mylib/host.cuh", "mylib/twice.cuh"} <= recorded
    (lib.include / "mylib" / "dev.cuh").write_text("#define DEV_FACTOR 2\n")
    k = _again(lib, source=source)
    assert k.compiled is True and k.digest != first.digest


@pytest.fixture(scope="module")
def toolkit_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return toolkit_copy(tmp_path_factory.mktemp("toolkit") / "cuda")


_edits: list[tuple[Path, bytes | None]] = []


def _edit(path: Path, text: str) -> None:
    """Append ``text`` to a file of the toolkit copy (or create it); undone after the test."""
    _edits.append((path, path.read_bytes() if path.exists() else None))
    with open(path, "a") as f:
        f.write(text)


@pytest.fixture
def own_toolkit(lib: SimpleNamespace, toolkit_tree: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A toolkit copy whose nvcc reads the copy's headers, as CUDA_PATH."""
    monkeypatch.setenv("CUDA_PATH", str(toolkit_tree))
    jit.clear_caches()
    yield toolkit_tree
    while _edits:
        path, original = _edits.pop()
        if original is None:
            path.unlink()
        else:
            path.write_bytes(original)


def test_a_toolkit_copy_hits_through_the_direct_path(lib: SimpleNamespace, own_toolkit: Path) -> None:
    _compile(lib)
    (dep,) = _direct_files(lib.home, "deps")
    assert any(label == "cuda" for label, _, _ in json.loads(dep.read_text())["files"])
    assert _again(lib).found_by == "direct"


def test_a_changed_toolkit_header_the_tu_includes_misses(lib: SimpleNamespace, own_toolkit: Path,
                                                          no_racy_window: None) -> None:
    first = _compile(lib)
    _edit(own_toolkit / "include" / "crt" / "host_defines.h", "\n// patched toolkit\n")
    k = _again(lib)
    assert k.compiled is True and k.key != first.key


def test_a_changed_toolkit_header_the_tu_does_not_include_hits(lib: SimpleNamespace, own_toolkit: Path) -> None:
    first = _compile(lib)
    (dep,) = _direct_files(lib.home, "deps")
    assert not any(rel.endswith("/cuda_fp16.h") for _, rel, _ in json.loads(dep.read_text())["files"])
    _edit(own_toolkit / "include" / "cuda_fp16.h", "\n// patched, never included by this TU\n")
    k = _again(lib)
    assert (k.compiled, k.found_by, k.key) == (False, "direct", first.key)
    assert jit.key(TU, include_dirs=[lib.include], arch=ARCH, store=lib.store) != first.key  # the full key sees it


def test_a_new_file_in_the_toolkit_include_tree_misses(lib: SimpleNamespace, own_toolkit: Path) -> None:
    _compile(lib)
    _edit(own_toolkit / "include" / "stdio.h", "// would shadow the C library's\n")
    assert _again(lib).compiled is True


def test_changed_toolkit_programs_miss(lib: SimpleNamespace, own_toolkit: Path, no_racy_window: None) -> None:
    first = _compile(lib)
    assert _child_compile(lib, lib.include, "import os\nos.environ['CUDA_PATH'] = " + repr(str(own_toolkit)) + "\n"
                          + _NO_WALK)[:2] == ["False", "direct"]  # by stat alone, identities not taken
    _edit(own_toolkit / "bin" / "nvcc.profile", "\n")
    k = _again(lib)
    assert k.compiled is True and k.key != first.key


# -- damage and kills fall back to the full key ----------------------------------------------------

def _direct_files(home: Path, kind: str) -> list[Path]:
    return sorted((home / "v1" / "jit" / kind).glob("*/*.json"))


@pytest.mark.parametrize("damage", ["direct_entry_truncated", "direct_entry_removed", "deps_truncated",
                                    "deps_hash_wrong", "deps_shape_wrong", "stat_cache_garbage"])
def test_damaged_direct_entries_fall_back_to_the_full_key(lib: SimpleNamespace, damage: str) -> None:
    first = _compile(lib)
    if damage.startswith("direct_entry"):
        (path,) = _direct_files(lib.home, "direct")
        path.unlink() if damage.endswith("removed") else path.write_text(path.read_text()[:20])
    elif damage == "deps_truncated":
        (path,) = _direct_files(lib.home, "deps")
        path.write_text(path.read_text()[:30])
    elif damage.startswith("deps_"):
        (path,) = _direct_files(lib.home, "deps")
        doc = json.loads(path.read_text())
        if damage == "deps_hash_wrong":
            doc["files"][-1][2] = "xxh3:" + "0" * 32
        else:
            doc["shapes"]["inc/0"] = "xxh3:" + "0" * 32
        path.write_text(json.dumps(doc))
    for path in (lib.home / "v1" / "jit" / "stat").iterdir():
        path.write_text("{not json" if damage == "stat_cache_garbage" else "{}")
    k = _again(lib)
    # A stat cache is only a shortcut: garbage there means the content is checked.
    expected = "direct" if damage == "stat_cache_garbage" else "key"
    assert (k.compiled, k.found_by, k.key, k.digest) == (False, expected, first.key, first.digest)
    healed = _again(lib)  # the full-key hit lists the key under the direct key again, if its deps are whole
    if damage.startswith("deps_"):
        assert healed.found_by == "key"
    else:
        assert healed.found_by == "direct"


def test_parts_that_do_not_make_the_key_are_not_trusted(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    parts = lib.home / "v1" / "jit" / "parts" / first.key.hex[:2] / f"{first.key.hex}.json"
    doc = json.loads(parts.read_text())
    doc["parts"]["arch"] = "sm_80"
    parts.write_text(json.dumps(doc))
    k = _again(lib)
    assert (k.found_by, k.key) == ("key", first.key)


_KILL_AFTER_INDEX = """
import sys
from cubinstore.internals import JitIndex, compiler
class Index(JitIndex):
    def add_direct(self, *a, **k):  # the first step after the index entry: the direct entry
        print("index_written", flush=True)
        sys.stdin.readline()
        raise SystemExit("not killed")
"""


def test_a_compile_killed_before_its_direct_entry_is_found_by_the_full_key_then_listed(lib: SimpleNamespace) -> None:
    code = _KILL_AFTER_INDEX + (
        f"compiler.compile({TU!r}, include_dirs=[{str(lib.include)!r}], arch={ARCH!r}, entries={ENTRIES!r}, "
        "make_index=Index)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=child_env(lib.home), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line == "index_written", proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.communicate()
    assert _direct_files(lib.home, "direct") == []
    k = _compile(lib)
    assert (k.compiled, k.found_by) == (False, "key")
    assert _again(lib).found_by == "direct"


def test_an_evicted_cubin_under_a_direct_hit_compiles_again(lib: SimpleNamespace) -> None:
    first = _compile(lib)
    LocalLayer(lib.home).path_for(first.digest).unlink()
    k = _again(lib)
    assert k.compiled is True and k.digest == first.digest
    assert JitIndex(LocalLayer(lib.home)).get(first.key.hex).digest == first.digest


# -- the pieces ------------------------------------------------------------------------------------

def test_the_direct_key_holds_no_path(lib: SimpleNamespace) -> None:
    deep = make_library(lib.tmp / "a" / "much" / "deeper" / "prefix")
    keys = {_jitdirect.DirectRequest(TU, compiler.SOURCE_NAME, [str(d)], [f"-I{d}"], jit.Arch.parse(ARCH),
                                     LocalLayer(lib.home)).key for d in (lib.include, deep)}
    assert len(keys) == 1


@pytest.mark.parametrize("which", ["cutlass", "toolkit_include", "symlinked"])
def test_a_shape_lists_the_files_the_full_key_lists(lib: SimpleNamespace, which: str) -> None:
    if which == "cutlass":
        try:
            root = str(cutlass_include())
        except BadArgumentError as exc:
            pytest.skip(str(exc))
    elif which == "toolkit_include":
        root = os.path.realpath(_jitkey.locate_toolkit()[0] / "include")
    else:
        linked = lib.tmp / "linked"
        linked.mkdir()
        (linked / "a").symlink_to(lib.include, target_is_directory=True)
        (linked / "b").symlink_to(lib.include, target_is_directory=True)  # the same directory twice
        (linked / "dangling").symlink_to(lib.tmp / "nowhere")
        root = str(linked)
    full = _jitkey.tree(root, cached=False)
    assert _jitkey.shape(root).key == _jitkey.shape_key(full.files)


def test_a_dependency_list_outside_the_roots_writes_no_direct_entry(lib: SimpleNamespace) -> None:
    roots = _jitdirect.make_roots([str(lib.include)], _jitkey.normalize_flags([], local=None), _jitkey.locate_toolkit()[0])
    work = lib.tmp / "work"
    (work / "inc").mkdir(parents=True)
    (work / "inc" / "0").symlink_to(lib.include)
    ok = "x.cubin : cubinstore_jit.cu ./cubinstore_jit.anchor.h inc/0/mylib/twice.cuh /usr/include/stdio.h\n"
    assert _jitdirect.parse_deps(ok, roots, ["cubinstore_jit.cu", "cubinstore_jit.anchor.h"], work) == \
        [("inc/0", "mylib/twice.cuh")]
    for bad in ("x.cubin : tmp/generated.h\n", "x.cubin : inc/0/../../escape.h\n", "x.cubin : inc/7/mylib/twice.cuh\n",
                "x.cubin : inc/0/mylib/twice.cuh\nother: b.h\n"):
        assert _jitdirect.parse_deps(bad, roots, [], work) is None, bad
