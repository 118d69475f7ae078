"""Issue 31: a kernel records the toolkit that built it and the oldest driver that loads it, and a
family may ship PTX (arch ``compute_...``), which selection picks only where no CUBIN runs.

Both validators are held to one answer on every document here (``Manifest.from_bytes`` with and
without the fast path); the toolkit facts are read from real nvcc output.
"""

from __future__ import annotations

import copy
import hashlib
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cubinstore.errors import BadArgumentError, CubinFormatError, IncompatibleArchError, ManifestError
from cubinstore.manifest import SCHEMA, SCHEMA_V1, Manifest, arch_compatible, dumps_canonical, fast
from cubinstore.manifest import ptx as _ptx
from cubinstore.manifest.toolkit import describe_driver, min_driver, toolkit_of

pytestmark = pytest.mark.usefixtures("clean_env")

ROOT = Path(__file__).resolve().parents[2]
NVCC = "/usr/local/cuda/bin/nvcc"
ENTRY = {"axpy_f32": {"name": "axpy_f32", "params": ["i32", "f32", "ptr", "ptr"], "offsets": [0, 4, 8, 16]}}


def _kernel(arch: str, vec: int = 4, **facts: Any) -> dict[str, Any]:
    return {"id": f"axpy/f32/vec{vec}/{arch}", "family": "axpy", "params": {"dtype": "f32", "vec": vec}, "arch": arch,
            "digest": "sha256:" + hashlib.sha256(f"{arch}{vec}".encode()).hexdigest(), "size": 100 + vec,
            "entries": copy.deepcopy(ENTRY), "target": f"//kernels/axpy:axpy_f32_vec{vec}_{arch}", **facts}


FACTS = {"toolkit": "13.0.88", "min_driver": 13000}


def _both(doc: dict[str, Any]) -> Manifest:
    """The manifest both validators open from ``doc``'s canonical text, checked to be the same one."""
    raw = dumps_canonical(doc)
    by_fast, by_checker = Manifest.from_bytes(raw), Manifest.from_bytes(raw, fast=False)
    assert by_fast.kernels == by_checker.kernels
    return by_fast


def _refused(doc: dict[str, Any]) -> str:
    """The one error both validators give ``doc``."""
    raw = dumps_canonical(doc)
    with pytest.raises(fast.Slow):
        fast.check(raw.decode())
    with pytest.raises(ManifestError) as by_fast:
        Manifest.from_bytes(raw, source="m.json")
    with pytest.raises(ManifestError) as by_checker:
        Manifest.from_bytes(raw, source="m.json", fast=False)
    assert str(by_fast.value) == str(by_checker.value)
    return str(by_fast.value)


# -- the schema -----------------------------------------------------------------------------------

def test_a_manifest_from_before_the_facts_opens_with_none_for_them() -> None:
    m = _both({"schema": SCHEMA, "kernels": [_kernel("sm_90a"), _kernel("sm_80")]})
    assert [(k.toolkit, k.min_driver) for k in m] == [(None, None), (None, None)]
    assert "toolkit" not in m.kernels[0].to_json()


def test_the_facts_round_trip_through_both_validators() -> None:
    m = _both({"schema": SCHEMA, "kernels": [_kernel("sm_90a", **FACTS), _kernel("compute_90", **FACTS)]})
    spec = m.by_id("axpy/f32/vec4/compute_90")
    assert (spec.toolkit, spec.min_driver, spec.is_ptx, spec.compute_capability) == ("13.0.88", 13000, True, (9, 0))
    assert not m.by_id("axpy/f32/vec4/sm_90a").is_ptx
    assert Manifest.build(m.kernels).raw == m.raw  # KernelSpec.to_json writes them back


def test_kernels_with_and_without_facts_may_mix() -> None:
    m = _both({"schema": SCHEMA, "kernels": [_kernel("sm_90a", **FACTS), _kernel("sm_80")]})
    assert [k.min_driver for k in m] == [None, 13000]  # sorted by id: sm_80 first


BAD = [
    ({"toolkit": "13.0.88"}, "kernels[0] (id 'axpy/f32/vec4/sm_90a'): missing key 'min_driver': 'toolkit' and 'min_driver' come together"),
    ({"min_driver": 13000}, "kernels[0] (id 'axpy/f32/vec4/sm_90a'): missing key 'toolkit'"),
    ({"toolkit": "13", "min_driver": 13000}, "kernels[0] (id 'axpy/f32/vec4/sm_90a').toolkit: expected a CUDA toolkit version like '13.0.88', got '13'"),
    ({"toolkit": "V13.0.88", "min_driver": 13000}, "kernels[0] (id 'axpy/f32/vec4/sm_90a').toolkit: expected"),
    ({"toolkit": 13.0, "min_driver": 13000}, "kernels[0] (id 'axpy/f32/vec4/sm_90a').toolkit: expected"),
    ({"toolkit": "13.0", "min_driver": "13000"}, "kernels[0] (id 'axpy/f32/vec4/sm_90a').min_driver: expected a driver version as cuDriverGetVersion reports it"),
    ({"toolkit": "13.0", "min_driver": True}, "kernels[0] (id 'axpy/f32/vec4/sm_90a').min_driver: expected"),
    ({"toolkit": "13.0", "min_driver": 580}, "kernels[0] (id 'axpy/f32/vec4/sm_90a').min_driver: expected"),
    ({"toolkit": "13.0", "min_driver": 10**6}, "kernels[0] (id 'axpy/f32/vec4/sm_90a').min_driver: expected"),
    ({"cuda": "13.0"}, "kernels[0] (id 'axpy/f32/vec4/sm_90a'): unknown key 'cuda'"),
]


@pytest.mark.parametrize("facts, message", BAD, ids=[m.split(": ", 1)[1][:50] for _, m in BAD])
def test_malformed_facts_are_refused_by_both_validators_naming_the_field(facts: dict[str, Any], message: str) -> None:
    assert _refused({"schema": SCHEMA, "kernels": [_kernel("sm_90a", **facts)]}).startswith(
        "invalid manifest m.json: " + message)


def test_ptx_must_name_its_toolkit() -> None:
    message = _refused({"schema": SCHEMA, "kernels": [_kernel("sm_90a"), _kernel("compute_90")]})
    assert message.startswith("invalid manifest m.json: kernels[0] (id 'axpy/f32/vec4/compute_90'): missing key "
                              "'toolkit': PTX (compute_90) must name the toolkit that wrote it")


@pytest.mark.parametrize("arch", ["compute_9", "compute_90b", "compute90", "ptx_90"])
def test_a_malformed_ptx_arch_is_refused(arch: str) -> None:
    message = _refused({"schema": SCHEMA, "kernels": [_kernel(arch, **FACTS)]})
    assert re.match(rf"invalid manifest m\.json: kernels\[0\] \(id '[^']+'\)\.arch: expected 'sm_<digits>' .* "
                    rf"or 'compute_<digits>' likewise for PTX \(v2\), got '{arch}'", message), message


def test_v1_knows_neither_facts_nor_ptx() -> None:
    def v1(kernel: dict[str, Any]) -> bytes:
        kernel["entries"] = {"axpy_f32": ENTRY["axpy_f32"]["params"]}
        return dumps_canonical({"schema": SCHEMA_V1, "kernels": [kernel]})

    assert Manifest.from_bytes(v1(_kernel("sm_90a"))).kernels[0].toolkit is None
    with pytest.raises(ManifestError, match=r"^invalid manifest <bytes>: kernels\[0\] \(id '[^']+'\): unknown key 'min_driver'"):
        Manifest.from_bytes(v1(_kernel("sm_90a", **FACTS)))
    with pytest.raises(ManifestError, match=r"^invalid manifest <bytes>: kernels\[0\] \(id '[^']+'\)\.arch: expected"):
        Manifest.from_bytes(v1(_kernel("compute_90")))


# -- selection ------------------------------------------------------------------------------------

@pytest.fixture
def release() -> Manifest:
    kernels = [_kernel(a, vec, **FACTS) for vec in (1, 4) for a in ("sm_90a", "sm_80", "compute_90")]
    return _both({"schema": SCHEMA, "kernels": [*kernels, _kernel("compute_100f", 4, **FACTS),
                                                _kernel("compute_120a", 4, toolkit="13.0", min_driver=13000)]})


@pytest.mark.parametrize("cc, expected", [
    ((9, 0), "sm_90a"),          # a CUBIN runs: never the PTX
    ((8, 6), "sm_80"),
    ((10, 0), "compute_100f"),   # no CUBIN runs: the most specific PTX that does
    ((10, 3), "compute_100f"),
    ((12, 0), "compute_120a"),
    ((12, 1), "compute_90"),     # plain compute_90 runs on every newer GPU
    ((11, 0), "compute_90"),
])
def test_ptx_is_selected_only_where_no_cubin_runs(release: Manifest, cc: tuple[int, int], expected: str) -> None:
    assert release.select("axpy", cc, dtype="f32", vec=4).arch == expected
    assert release.select("axpy/f32/vec4", cc).arch == expected


def test_a_gpu_older_than_every_target_gets_no_kernel(release: Manifest) -> None:
    with pytest.raises(IncompatibleArchError, match=r"^no CUBIN of 'axpy' for compute capability 7\.5 \(sm_75\)"):
        release.select("axpy", (7, 5), dtype="f32", vec=4)


def test_a_ptx_id_selects_the_ptx_itself(release: Manifest) -> None:
    assert release.select("axpy/f32/vec4/compute_90", (9, 0)).arch == "compute_90"


def test_ptx_of_several_points_is_ambiguous_without_the_params(release: Manifest) -> None:
    with pytest.raises(BadArgumentError, match=r"^select\('axpy'\) is ambiguous: several parameter sets have PTX"):
        release.select("axpy", (12, 1), dtype="f32")


def test_arch_compatible_speaks_of_cubins_only() -> None:
    assert arch_compatible("sm_90a", (9, 0)) and not arch_compatible("compute_90", (9, 0))
    with pytest.raises(BadArgumentError, match=r"^invalid PTX arch 'compute_9b'"):
        arch_compatible("compute_9b", (9, 0))


@pytest.mark.parametrize("arch, runs, not_on", [
    ("compute_90", [(9, 0), (10, 0), (12, 1)], [(8, 9)]),
    ("compute_90a", [(9, 0)], [(9, 1), (10, 0)]),
    ("compute_100f", [(10, 0), (10, 3)], [(11, 0), (9, 0)]),
])
def test_where_ptx_runs(arch: str, runs: list[tuple[int, int]], not_on: list[tuple[int, int]]) -> None:
    parsed = _ptx.PtxArch.parse(arch)
    assert str(parsed) == arch and parsed.target == "sm_" + arch[len("compute_"):]
    assert all(parsed.runs_on(cc) for cc in runs) and not any(parsed.runs_on(cc) for cc in not_on)


# -- the toolkit table ----------------------------------------------------------------------------

@pytest.mark.parametrize("toolkit, ptx, expected", [
    ("13.0.88", False, 13000), ("13.0.88", True, 13000), ("13.5.1", False, 13000), ("13.5.1", True, 13050),
    ("12.8", False, 12000), ("12.8", True, 12080),
])
def test_min_driver_follows_minor_version_compatibility_for_cubins_only(toolkit: str, ptx: bool, expected: int) -> None:
    assert min_driver(toolkit, ptx=ptx) == expected


def test_describe_driver_names_the_linux_driver_where_known() -> None:
    assert describe_driver(13000) == "CUDA 13.0 (Linux driver 580.65.06 or newer)"
    assert describe_driver(13050) == "CUDA 13.5"


def test_min_driver_refuses_what_is_no_version() -> None:
    with pytest.raises(BadArgumentError, match=r"^invalid toolkit version 'thirteen'"):
        min_driver("thirteen", ptx=False)


# -- real nvcc output -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nvcc_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    if not Path(NVCC).is_file():
        pytest.skip(f"no nvcc at {NVCC}")
    out = tmp_path_factory.mktemp("nvcc")
    made = {}
    for kind, arch in (("cubin", "sm_90a"), ("ptx", "compute_90")):
        target = out / f"axpy.{kind}"
        subprocess.run([NVCC, f"-{kind}", f"-arch={arch}", "-DDTYPE_f32", "-DVEC=4", f"-I{ROOT}", "-o", str(target),
                        str(ROOT / "kernels/axpy/axpy.cu")], check=True, capture_output=True, timeout=300)
        made[kind] = target.read_bytes()
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    made["version"] = re.search(r"V(\d+\.\d+\.\d+)", version).group(1).encode()  # type: ignore[union-attr]
    return made


def test_the_toolkit_is_read_from_the_cubin_and_the_ptx_nvcc_wrote(nvcc_outputs: dict[str, bytes]) -> None:
    version = nvcc_outputs["version"].decode()
    assert toolkit_of(nvcc_outputs["cubin"], "k") == version
    assert toolkit_of(nvcc_outputs["ptx"], "k") == version


def test_bytes_that_do_not_name_their_toolkit_are_refused(nvcc_outputs: dict[str, bytes]) -> None:
    stripped = re.sub(rb"Cuda compilation tools[^\n]*", b"", nvcc_outputs["ptx"])
    with pytest.raises(BadArgumentError, match=r"^k: its header comment does not name the CUDA toolkit"):
        toolkit_of(stripped, "k")


def test_nvcc_ptx_passes_the_text_check_and_its_entries_read(nvcc_outputs: dict[str, bytes]) -> None:
    _ptx.check_text(nvcc_outputs["ptx"], "compute_90", "k")
    assert _ptx.entries(nvcc_outputs["ptx"].decode()) == {"axpy_f32": (False, (4, 4, 8, 8))}


@pytest.mark.parametrize("change, message", [
    (lambda d: d.replace(b".target sm_90", b".target sm_80"), r"^k: manifest says compute_90, the PTX has '\.target sm_80' \(expected '\.target sm_90'\)"),
    (lambda d: d.replace(b".version", b".versio"), r"^k: not PTX text for compute_90: no '\.version X\.Y' directive"),
    (lambda d: d + b"\0junk", r"^k: not PTX text \(empty, or a byte that is not printable ASCII\)"),
    (lambda d: b"", r"^k: not PTX text"),
])
def test_bytes_that_are_not_ptx_for_the_arch_are_refused(nvcc_outputs: dict[str, bytes], change: Any, message: str) -> None:
    with pytest.raises(CubinFormatError, match=message):
        _ptx.check_text(change(nvcc_outputs["ptx"]), "compute_90", "k")


def test_a_cubin_is_not_ptx_text(nvcc_outputs: dict[str, bytes]) -> None:
    with pytest.raises(CubinFormatError, match=r"^k: not PTX text"):
        _ptx.check_text(nvcc_outputs["cubin"], "compute_90", "k")


def test_ptx_entries_read_struct_and_array_parameter_sizes() -> None:
    text = (".visible .entry _Z1kv(\n\t.param .align 64 .b8 _Z1kv_param_0[128],\n\t.param .u64 .ptr .global .align 1 p,"
            "\n\t.param .align 4 .b32 s[3]\n)\n.entry local_k(\n)\n.weak .entry w(.param .f64 x)\n")
    assert _ptx.entries(text) == {"_Z1kv": (False, (128, 8, 12)), "local_k": (True, ()), "w": (False, (8,))}
