"""cubinstore.jit: one compile per content key, wherever the library is installed (real nvcc, no GPU)."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.jit import ENTRIES, TU, child_env, make_library, run_child, toolkit_copy_with_changed_header  # noqa: E402

from cubinstore import Digest, jit  # noqa: E402
from cubinstore.errors import BadArgumentError, JitCompileError, KernelNotFoundError  # noqa: E402
from cubinstore.internals import JitIndex, compiler, cutlass_include  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

ARCH = "sm_90a"


def _store(home: Path) -> Store:
    return Store([LocalLayer(home)])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One store, the library at two prefixes of different depth, and the base compile (done once)."""
    base = tmp_path_factory.mktemp("jit")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("CUBINSTORE_"):
                mp.delenv(name)
        home = base / "home"
        mp.setenv("CUBINSTORE_HOME", str(home))
        jit.clear_caches()
        shallow = make_library(base / "a")
        deep = make_library(base / "opt" / "venvs" / "prod-2" / "lib" / "python3.11" / "site-packages" / "mylib")
        store = _store(home)
        first = jit.compile(TU, include_dirs=[shallow], arch=ARCH, entries=ENTRIES, store=store)
        yield SimpleNamespace(base=base, home=home, shallow=shallow, deep=deep, store=store, first=first, mp=mp)
    jit.clear_caches()


def _compile(env: SimpleNamespace, source: str = TU, include: Path | None = None, **kw):
    return jit.compile(source, include_dirs=[include or env.shallow], arch=kw.pop("arch", ARCH),
                       entries=kw.pop("entries", ENTRIES), store=env.store, **kw)


# -- relocation: the seed's failure -----------------------------------------------------------------

def test_first_compile_runs_nvcc_and_stores_the_cubin_under_its_sha256(env: SimpleNamespace) -> None:
    k = env.first
    assert k.compiled is True and k.kernels == ("scale",) and k.arch == ARCH
    blob = LocalLayer(env.home).path_for(k.digest).read_bytes()
    assert Digest.of(blob) == k.digest and len(blob) == k.size
    assert JitIndex(LocalLayer(env.home)).get(k.key.hex).digest == k.digest


def test_same_library_at_a_deeper_prefix_hits_without_compiling(env: SimpleNamespace) -> None:
    k = _compile(env, include=env.deep)
    assert k.compiled is False
    assert (k.key, k.digest) == (env.first.key, env.first.digest)


def test_relocated_install_in_a_fresh_process_hits(env: SimpleNamespace) -> None:
    moved = env.base / "relocated" / "x" / "include"
    shutil.copytree(env.shallow, moved)
    code = (
        "from cubinstore import jit\n"
        f"k = jit.compile({TU!r}, include_dirs=[{str(moved)!r}], arch={ARCH!r}, entries={ENTRIES!r})\n"
        "print(k.compiled, k.key, k.digest)\n"
    )
    out = run_child(code, child_env(env.home))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", str(env.first.key), str(env.first.digest)]


def test_unrelated_readme_beside_the_tree_still_hits(env: SimpleNamespace) -> None:
    (env.shallow.parent / "README.md").write_text("# mylib\nnot a header\n")
    jit.clear_caches()
    assert _compile(env).compiled is False


def test_same_cubin_bytes_from_a_different_store_root(env: SimpleNamespace) -> None:
    # Nothing of the store's path (the compile directory, TMPDIR) reaches the CUBIN.
    other = _store(env.base / "elsewhere" / "deeper" / "home")
    k = jit.compile(TU, include_dirs=[env.deep], arch=ARCH, entries=ENTRIES, store=other)
    assert k.compiled is True and k.digest == env.first.digest


# -- the key: what must and must not matter ---------------------------------------------------------

def test_key_parts_hold_no_path_user_or_host(env: SimpleNamespace) -> None:
    text = json.dumps(env.first.key.parts.to_json())
    for needle in (str(env.base), str(env.home), "/usr/local/cuda", getpass.getuser() + "/", socket.gethostname()):
        assert needle not in text
    assert all(p.startswith("xxh3:") for p in env.first.key.parts.includes)


def _cute_copy(include: Path, dest: Path) -> Path:
    shutil.copytree(include, dest, symlinks=False)
    return dest


@pytest.fixture(scope="module")
def cute(env: SimpleNamespace) -> SimpleNamespace:
    try:
        include = cutlass_include()
    except BadArgumentError as exc:
        pytest.skip(str(exc))
    copied = _cute_copy(include, env.base / "cute-copy" / "include")
    linked = env.base / "cute-links" / "include"
    linked.mkdir(parents=True)
    for item in include.iterdir():
        (linked / item.name).symlink_to(item)
    whole = env.base / "cute-whole-link"
    whole.symlink_to(include)
    return SimpleNamespace(include=include, copied=copied, linked=linked, whole=whole)


def _key(env: SimpleNamespace, include: Path, **kw) -> jit.JitKey:
    return jit.key(TU, include_dirs=[env.shallow, include], arch=kw.pop("arch", ARCH), store=env.store, **kw)


def test_symlinked_and_copied_cute_trees_give_one_key(env: SimpleNamespace, cute: SimpleNamespace) -> None:
    keys = {_key(env, p).hex for p in (cute.copied, cute.linked, cute.whole, cute.include)}
    assert len(keys) == 1


def test_one_changed_bundled_cute_header_changes_the_key(env: SimpleNamespace, cute: SimpleNamespace) -> None:
    changed = _cute_copy(cute.include, env.base / "cute-changed" / "include")
    with open(changed / "cute" / "layout.hpp", "a") as f:
        f.write("\n// patched\n")
    assert _key(env, changed).hex != _key(env, cute.copied).hex


def test_a_new_file_inside_an_include_root_changes_the_key(env: SimpleNamespace) -> None:
    grown = env.base / "grown" / "include"
    shutil.copytree(env.shallow, grown)
    before = jit.key(TU, include_dirs=[grown], arch=ARCH, store=env.store).hex
    (grown / "mylib" / "new.cuh").write_text("// reachable by #include\n")
    jit.clear_caches()
    assert jit.key(TU, include_dirs=[grown], arch=ARCH, store=env.store).hex != before


@pytest.mark.parametrize(
    "change",
    ["flag", "define", "arch", "host_compiler", "toolkit_copy_with_changed_header", "changed_library_header"],
)
def test_each_input_that_matters_is_a_miss(env: SimpleNamespace, change: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    kw: dict = {}
    include = env.shallow
    if change == "flag":
        kw["flags"] = ["-O2"]
    elif change == "define":
        kw["flags"] = ["-DFACTOR=3"]
    elif change == "arch":
        kw["arch"] = "sm_80"
    elif change == "host_compiler":
        monkeypatch.setenv("CUBINSTORE_HOST_CC", "g++")
    elif change == "toolkit_copy_with_changed_header":
        monkeypatch.setenv("CUDA_PATH", str(toolkit_copy_with_changed_header(tmp_path / "cuda")))
    elif change == "changed_library_header":
        include = tmp_path / "include"
        shutil.copytree(env.shallow, include)
        with open(include / "mylib" / "twice.cuh", "a") as f:
            f.write("// changed\n")
    k = _compile(env, include=include, **kw)
    assert k.compiled is True, f"{change} must miss"
    assert k.key != env.first.key
    assert _compile(env, include=include, **kw).compiled is False  # and then it hits


def test_absolute_include_flag_is_keyed_by_content_not_path(env: SimpleNamespace) -> None:
    keys = {jit.key(TU, include_dirs=[], flags=[f"-I{p}"], arch=ARCH, store=env.store).hex
            for p in (env.shallow, env.deep)}
    keys.add(jit.key(TU, include_dirs=[], flags=["-isystem", str(env.deep)], arch=ARCH, store=env.store).hex)
    assert len(keys) == 2  # -I vs -isystem differ; the two prefixes do not
    k = jit.compile(TU, include_dirs=[], flags=[f"-I{env.deep}"], arch=ARCH, entries=ENTRIES, store=env.store)
    assert k.kernels == ("scale",)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-arch=sm_80"], "flag '-arch=sm_80': the JIT sets -arch itself"),
        (["-o", "x.cubin"], "flag '-o': the JIT sets -o itself"),
        (["-Iinclude"], "flag '-Iinclude': 'include' is relative"),
        (["-Xcompiler", "-fmacro-prefix-map=/home/x=y"], "flag '-fmacro-prefix-map=/home/x=y' holds an absolute path"),
        ("-O2", "flags: expected a sequence of strings"),
    ],
)
def test_bad_flags_are_typed_errors_naming_the_flag(env: SimpleNamespace, flags, message: str) -> None:
    with pytest.raises(BadArgumentError) as info:
        jit.key(TU, include_dirs=[env.shallow], flags=flags, arch=ARCH, store=env.store)
    assert str(info.value).startswith(message)


def test_relative_include_dir_is_refused(env: SimpleNamespace) -> None:
    with pytest.raises(BadArgumentError, match="^include_dirs: 'include' is relative"):
        jit.key(TU, include_dirs=["include"], arch=ARCH, store=env.store)


# -- failures cache nothing -------------------------------------------------------------------------

def test_broken_tu_raises_with_nvccs_message_and_caches_nothing(env: SimpleNamespace) -> None:
    broken = TU.replace("x[i] = twice", "x[i] = no_such_function")
    with pytest.raises(JitCompileError) as info:
        _compile(env, source=broken)
    message = str(info.value)
    assert message.startswith("nvcc failed (exit ")
    assert 'identifier "no_such_function" is undefined' in message
    assert "command: cuda/bin/nvcc -cubin -arch=sm_90a -ccbin gcc" in message
    assert "cubinstore_jit.cu" in message
    assert str(env.base) not in message and "/usr/local/cuda" not in message
    k = jit.key(broken, include_dirs=[env.shallow], arch=ARCH, store=env.store)
    assert JitIndex(LocalLayer(env.home)).get(k.hex) is None
    assert not list((env.home / "v1" / "jit" / "tmp").glob(f"{k.hex}.*"))


def test_declared_entry_missing_from_the_cubin_is_refused(env: SimpleNamespace) -> None:
    with pytest.raises(BadArgumentError, match="entry 'nope' is not a kernel of its CUBIN; its kernels: scale \\(scale\\)"):
        _compile(env, entries={"nope": ["i32"]})


def test_declared_types_that_disagree_with_the_cubin_are_refused(env: SimpleNamespace) -> None:
    source = TU.replace("FACTOR;\n}", "FACTOR;\n}\n// other types\n")
    with pytest.raises(BadArgumentError, match=r"entry 'scale': declared \['i32', 'f64', 'ptr'\]"):
        _compile(env, source=source, entries={"scale": ["i32", "f64", "ptr"]})
    k = jit.key(source, include_dirs=[env.shallow], arch=ARCH, store=env.store)
    assert JitIndex(LocalLayer(env.home)).get(k.hex) is None


def test_jit_off_serves_hits_and_refuses_misses(env: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBINSTORE_JIT", "0")
    assert _compile(env).compiled is False
    with pytest.raises(KernelNotFoundError, match=r"^JIT key xxh3:[0-9a-f]{32} \(arch sm_90a, family axpy dtype='f32'\)"):
        _compile(env, flags=["-DFACTOR=7"], family="axpy", params={"dtype": "f32"})
    from cubinstore.internals import warmset as _warmset

    (rec,) = [r for r in _warmset.records(LocalLayer(env.home)) if r.family == "axpy" and r.params == {"dtype": "f32"}]
    assert (rec.kind, rec.digest, rec.count) == ("miss", None, 1)  # recorded, so CI can build it ahead
    monkeypatch.setenv("CUBINSTORE_JIT", "1")
    with pytest.raises(KernelNotFoundError):
        _compile(env, flags=["-DFACTOR=7"], jit=False)


def test_damaged_index_entry_recompiles_and_is_rewritten(env: SimpleNamespace) -> None:
    k = _compile(env, flags=["-DFACTOR=5"])
    path = env.home / "v1" / "jit" / "index" / k.key.hex[:2] / f"{k.key.hex}.json"
    path.write_text('{"schema": "cubinstore/jit-index/v1", "key": "broken"')
    again = _compile(env, flags=["-DFACTOR=5"])
    assert again.compiled is True and again.digest == k.digest
    assert json.loads(path.read_text())["digest"] == str(k.digest)


def test_cubin_gone_from_the_cas_recompiles(env: SimpleNamespace) -> None:
    k = _compile(env, flags=["-DFACTOR=6"])
    LocalLayer(env.home).path_for(k.digest).unlink()
    again = _compile(env, flags=["-DFACTOR=6"])
    assert again.compiled is True and LocalLayer(env.home).path_for(k.digest).is_file()


def test_a_kernel_without_entries_cannot_be_launched(env: SimpleNamespace) -> None:
    k = jit.compile(TU, include_dirs=[env.shallow], arch=ARCH, store=env.store)
    assert k.compiled is False and k.kernels == ("scale",)
    with pytest.raises(BadArgumentError, match=r"^JIT kernel xxh3:[0-9a-f]{32} \(scale\): pass entries="):
        k.library()


def test_jit_kernel_is_a_one_kernel_library_with_the_declared_entries(env: SimpleNamespace) -> None:
    spec = env.first.spec
    assert spec.id == f"jit/{env.first.key.hex}/{ARCH}" and spec.digest == env.first.digest
    assert dict(spec.entries) == {"scale": ("i32", "f32", "ptr")}


def test_import_cubinstore_and_its_cli_do_not_import_xxhash() -> None:
    code = ("import sys, cubinstore, cubinstore.cli, cubinstore._release.maint\n"
            "print(sorted(m for m in ('xxhash', 'cubinstore.jit', 'cubinstore._jit.key') if m in sys.modules))\n")
    out = run_child(code, child_env(Path("/nonexistent")))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_symlinked_jit_directory_in_the_store_is_never_written_through(env: SimpleNamespace, tmp_path: Path) -> None:
    from cubinstore.errors import UnsafeStoreError

    home = tmp_path / "home"
    (home / "v1").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (home / "v1" / "jit").symlink_to(elsewhere)
    with pytest.raises(UnsafeStoreError, match=r"is a symlink or not a directory; cubinstore never follows links"):
        jit.compile(TU, include_dirs=[env.shallow], flags=["-DFACTOR=9"], arch=ARCH, entries=ENTRIES, store=_store(home))
    assert list(elsewhere.iterdir()) == []


def test_a_header_edited_during_the_compile_caches_nothing(env: SimpleNamespace, tmp_path: Path) -> None:
    include = tmp_path / "include"
    shutil.copytree(env.shallow, include)

    def edit_then_run(argv, work):  # another process upgrades the library mid-compile
        with open(include / "mylib" / "twice.cuh", "a") as f:
            f.write("// upgraded\n")
        return compiler.run_nvcc(argv, work)

    flags = ["-DFACTOR=11"]  # a key not compiled yet
    k = jit.key(TU, include_dirs=[include], flags=flags, arch=ARCH, store=env.store)
    with pytest.raises(JitCompileError, match=r"^include_dirs\[0\] \(.*\) changed after JIT key xxh3:[0-9a-f]{32} was computed"):
        compiler.compile(TU, include_dirs=[include], flags=flags, arch=ARCH, entries=ENTRIES, store=env.store,
                         nvcc=edit_then_run)
    assert JitIndex(LocalLayer(env.home)).get(k.hex) is None
    again = jit.compile(TU, include_dirs=[include], flags=flags, arch=ARCH, entries=ENTRIES, store=env.store)
    assert again.compiled is True and again.key != k  # the new content, under its own key


def test_a_corrupted_cubin_in_the_cas_is_quarantined_and_recompiled_not_loaded(env: SimpleNamespace) -> None:
    k = _compile(env, flags=["-DFACTOR=12"])
    path = LocalLayer(env.home).path_for(k.digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    again = _compile(env, flags=["-DFACTOR=12"])
    assert again.compiled is True and again.digest == k.digest
    assert Digest.of(path.read_bytes()) == k.digest
