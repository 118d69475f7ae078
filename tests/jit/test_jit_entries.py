"""cubinstore.jit.compile(entries=) takes an entry as the Bazel macro does: a mangled symbol, an
extern "C" name, or a C++ name, qualified or (when unique) not (real nvcc, no GPU)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xxhash", reason="the JIT needs the jit extra (xxhash)")

from helpers.jit import child_env, run_child  # noqa: E402

from cubinstore import jit  # noqa: E402
from cubinstore.errors import BadArgumentError  # noqa: E402
from cubinstore.internals import demangle  # noqa: E402
from cubinstore.store import LocalLayer, Store  # noqa: E402

ARCH = "sm_90a"
# Two namespaces with a template kernel of one name: `scale<128, float>` alone is ambiguous.
TU = """
template <typename T> __device__ T twice(T x) { return x + x; }
namespace mylib {
template <int N, typename T> __global__ void scale(int n, T a, T* x) {
  int i = blockIdx.x * N + threadIdx.x;
  if (i < n) x[i] = twice(x[i]) * a;
}
template __global__ void scale<128, float>(int, float, float*);
}  // namespace mylib
namespace other {
template <int N, typename T> __global__ void scale(int n, T a, T* x) {
  int i = blockIdx.x * N + threadIdx.x;
  if (i < n) x[i] = x[i] * a;
}
template __global__ void scale<128, float>(int, float, float*);
template __global__ void scale<64, double>(int, double, double*);
}  // namespace other
"""
NAME = "mylib::scale<128, float>"
TYPES = ["i32", "f32", "ptr"]
MYLIB_PREFIX = "_ZN5mylib5scaleILi128EfEE"  # the Itanium mangling of mylib::scale<128, float>
OTHER_PREFIX = "_ZN5other5scaleILi128EfEE"
DOUBLE_PREFIX = "_ZN5other5scaleILi64EdEE"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One store and the TU compiled once, its entry named by its qualified C++ name."""
    base = tmp_path_factory.mktemp("entries")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("CUBINSTORE_"):
                mp.delenv(name)
        home = base / "home"
        mp.setenv("CUBINSTORE_HOME", str(home))
        jit.clear_caches()
        store = Store([LocalLayer(home)])
        first = jit.compile(TU, include_dirs=[], arch=ARCH, entries={NAME: TYPES}, store=store)
        (symbol,) = [s for s in first.kernels if s.startswith(MYLIB_PREFIX)]
        yield SimpleNamespace(home=home, store=store, first=first, symbol=symbol)
    jit.clear_caches()


def _compile(env: SimpleNamespace, entries: dict[str, list[str]]) -> jit.JitKernel:
    return jit.compile(TU, include_dirs=[], arch=ARCH, entries=entries, store=env.store)


def test_a_qualified_cxx_name_resolves_to_the_cubins_symbol(env: SimpleNamespace) -> None:
    k = env.first
    assert k.compiled is True and len(k.kernels) == 3
    assert k.entries == {env.symbol: tuple(TYPES)} and k.names == {env.symbol: NAME}
    spec = k.spec  # the manifest entry: keyed by symbol, the declared C++ name its readable name
    assert dict(spec.entries) == {env.symbol: tuple(TYPES)}
    assert spec.entry(NAME).symbol == env.symbol and spec.entry(env.symbol).name == NAME


def test_the_mangled_symbol_names_the_same_entry_and_hits(env: SimpleNamespace) -> None:
    k = _compile(env, {env.symbol: TYPES})
    assert k.compiled is False and k.key == env.first.key
    assert k.entries == {env.symbol: tuple(TYPES)} and k.names == {env.symbol: env.symbol}


@pytest.mark.parametrize("spelling", ["::mylib::scale< 128 , float >", "mylib::scale<128u, float>"])
def test_a_cxx_name_in_another_spelling_hits(env: SimpleNamespace, spelling: str) -> None:
    k = _compile(env, {spelling: TYPES})
    assert k.compiled is False and k.entries == {env.symbol: tuple(TYPES)} and k.names == {env.symbol: spelling}


def test_an_unqualified_name_resolves_when_one_kernel_has_it(env: SimpleNamespace) -> None:
    k = _compile(env, {"scale<64, double>": ["i32", "f64", "ptr"]})
    (symbol,) = k.entries
    assert k.compiled is False and symbol.startswith(DOUBLE_PREFIX)
    assert k.spec.entry("scale<64, double>").symbol == symbol


def test_an_unqualified_name_two_kernels_share_is_ambiguous(env: SimpleNamespace) -> None:
    kernels = env.first.kernels
    mylib, other = sorted(s for s in kernels if s.startswith((MYLIB_PREFIX, OTHER_PREFIX)))
    with pytest.raises(BadArgumentError, match=(
            rf"^JIT kernel x: entry 'scale<128, float>' matches 2 kernels of its CUBIN: {mylib}, {other}; "
            "name it by its symbol or fully qualified$")):
        demangle.resolve_entries(["scale<128, float>"], kernels, where="JIT kernel x")


def test_an_unknown_name_is_refused_naming_the_kernels(env: SimpleNamespace) -> None:
    with pytest.raises(BadArgumentError) as caught:
        _compile(env, {"mylib::scale<256, float>": TYPES})
    message = str(caught.value)
    assert message.startswith(f"JIT kernel {env.first.key}: entry 'mylib::scale<256, float>' is not a kernel of its "
                              "CUBIN; its kernels: ")
    assert f"mylib::scale<128, float> ({env.symbol})" in message and "other::scale<64, double> (" in message


def test_the_declared_layout_is_checked_against_the_resolved_kernel(env: SimpleNamespace) -> None:
    with pytest.raises(BadArgumentError, match=(
            rf"^JIT kernel xxh3:[0-9a-f]{{32}} entry '{NAME}': declared \['i32', 'f64', 'ptr'\] .*"
            rf"the CUBIN's {env.symbol} has offsets \[0, 4, 8\]")):
        _compile(env, {NAME: ["i32", "f64", "ptr"]})


def test_two_names_of_one_kernel_are_refused(env: SimpleNamespace) -> None:
    with pytest.raises(BadArgumentError, match=rf"^x: entries '{NAME}' and '{env.symbol}' are one kernel, {env.symbol}$"):
        demangle.resolve_entries([NAME, env.symbol], env.first.kernels, where="x")


def test_an_entry_name_a_manifest_cannot_hold_is_refused_before_compiling(env: SimpleNamespace) -> None:
    with pytest.raises(BadArgumentError, match=r"^entries: expected symbols or C\+\+ names, got 'a\\nb': expected printable"):
        jit.compile("this TU is never compiled", include_dirs=[], arch=ARCH, entries={"a\nb": []}, store=env.store)


def test_a_fresh_process_hits_by_cxx_name(env: SimpleNamespace) -> None:
    code = (
        "from cubinstore import jit\n"
        f"k = jit.compile({TU!r}, include_dirs=[], arch={ARCH!r}, entries={{{NAME!r}: {TYPES!r}}})\n"
        f"print(k.compiled, k.found_by, k.key, *k.entries, k.spec.entry({NAME!r}).symbol)\n"
    )
    out = run_child(code, child_env(env.home))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "direct", str(env.first.key), env.symbol, env.symbol]


# -- which demangler, and only when a name needs one ----------------------------------------------

def _fake_toolkit(root: Path, cufilt: str | None) -> Path:
    """A directory the toolkit search takes (bin/nvcc, nvvm/bin/cicc), with ``cufilt`` as its bin/cu++filt."""
    (root / "bin").mkdir(parents=True)
    (root / "nvvm" / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("")
    (root / "nvvm" / "bin" / "cicc").write_text("")
    if cufilt is not None:
        (root / "bin" / "cu++filt").write_text("#!/bin/sh\n" + cufilt + "\n")
        (root / "bin" / "cu++filt").chmod(0o755)
    return root


@pytest.fixture
def no_host_demangler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$PATH with no c++filt on it; CUDA_HOME unset, so CUDA_PATH decides the toolkit."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    return empty


def test_the_toolkits_cu_filt_is_the_demangler_it_has_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           no_host_demangler: Path) -> None:
    # Symbols no other test demangles: the process keeps each symbol's demangling.
    root = _fake_toolkit(tmp_path / "cuda", "while read l; do echo 'void tk::f<3>(int)'; done")
    monkeypatch.setenv("CUDA_PATH", str(root))
    assert demangle.resolve_entries(["tk::f<3>"], ["_ZN2tk1fILi3EEEvi"], where="t") == {
        "tk::f<3>": ("_ZN2tk1fILi3EEEvi", "tk::f<3>")}


def test_no_demangler_fails_only_a_name_that_needs_one_naming_what_was_tried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_host_demangler: Path) -> None:
    root = _fake_toolkit(tmp_path / "cuda", None)
    monkeypatch.setenv("CUDA_PATH", str(root))
    kernels = ["_ZN2nd1gEv", "_ZN2nd1hEv"]
    # A symbol, or a name among extern "C" kernels, needs no demangler.
    assert demangle.resolve_entries(["_ZN2nd1gEv"], kernels, where="t") == {"_ZN2nd1gEv": ("_ZN2nd1gEv", "_ZN2nd1gEv")}
    with pytest.raises(BadArgumentError, match=r"^t: entry 'nope' is not a kernel of its CUBIN; its kernels: scale \(scale\)$"):
        demangle.resolve_entries(["nope"], ["scale"], where="t")
    with pytest.raises(demangle.DemanglerError, match=(
            rf"^t: entry 'nd::g' is a C\+\+ name, and matching it to a kernel needs a demangler; tried "
            rf"{root}/bin/cu\+\+filt \(absent\); c\+\+filt on \$PATH \(not found; binutils has it\)\. "
            "Install binutils, or declare the entry by its symbol: _ZN2nd1gEv, _ZN2nd1hEv$")):
        demangle.resolve_entries(["nd::g"], kernels, where="t")


def test_a_demangler_that_prints_garbage_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              no_host_demangler: Path) -> None:
    root = _fake_toolkit(tmp_path / "cuda", "while read l; do printf '\\001\\n'; done")
    monkeypatch.setenv("CUDA_PATH", str(root))
    with pytest.raises(demangle.DemanglerError, match=(
            rf"^t: demangler '{root}/bin/cu\+\+filt' gave '\\x01' for _ZN2gb1fEv: expected a printable C\+\+ name$")):
        demangle.resolve_entries(["gb::f"], ["_ZN2gb1fEv"], where="t")
