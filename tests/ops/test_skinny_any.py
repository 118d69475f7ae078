"""skinny_any (kernels/skinny, ANY_ROWS=1) on the CPU: its ids and contract, and which operands
a launch through it copies (only those not contiguous along K)."""

from __future__ import annotations

import pytest

from cubinstore.errors import BadArgumentError
from cubinstore.internals import Operand, gemm_launch as G, staging
from helpers.gpu import family_ids


def _op(name: str, rows: int, k: int, strides: tuple[int, int], address: int) -> Operand:
    return Operand(name, "bfloat16", (rows, k), strides, "cuda:0", address)


def test_ids_name_the_family_and_parse_back() -> None:
    cfg = G.SkinnyConfig(16, 32, 8, 1, any_rows=True)
    assert cfg.kernel_id == "skinny_any/bm16/bn32/warps8/unroll1/sm_90a" and cfg.family == G.SKINNY_ANY_FAMILY
    assert G.config_of(cfg.kernel_id) == cfg and G.SkinnyConfig.from_id(cfg.kernel_id) == cfg
    assert G.entry_of(cfg.kernel_id) == (G.SKINNY_ENTRY, G.SKINNY_ENTRY_TYPES)
    assert G.config_of(G.SkinnyConfig(16, 32, 8, 1).kernel_id) != cfg  # the aligned point is another kernel
    # One CTA of 8 warps an SM at least (up to 153 registers a thread); the GPU test asks the driver.
    assert cfg.threads * cfg.ctas_per_sm == 256


def test_every_built_point_parses_to_its_manifest_params() -> None:
    ids = [i for i in family_ids(G.SKINNY_ANY_FAMILY) if not i.startswith("<")]
    if not ids:
        pytest.skip("no manifest with skinny_any kernels: run `bazel build //kernels:all`")
    for kernel_id in ids:
        cfg = G.SkinnyConfig.from_id(kernel_id)
        assert cfg.any_rows and cfg.kernel_id == kernel_id and cfg.warps == 8


@pytest.mark.parametrize(("kernel_id", "message"), [
    ("skinny_any/bm16/bn16/warps16/unroll1/sm_90a", "warps 16: skinny_any points have 8"),
    ("skinny_any/bm16/bn16/warps8/sm_90a", "invalid skinny kernel id"),
])
def test_bad_ids_name_what_is_wrong(kernel_id: str, message: str) -> None:
    with pytest.raises(BadArgumentError, match=message):
        G.config_of(kernel_id)


@pytest.mark.parametrize(("k", "a_strides", "a_address", "b_strides", "b_address"), [
    (4095, (4095, 1), 0, (4095, 1), 0),  # contiguous, K off 8: rows 8,190 bytes apart
    (4096, (4096, 1), 2, (4096, 1), 6),  # starts off 16 bytes
    (1000, (1003, 1), 14, (1001, 1), 0),  # odd row strides
])
def test_rows_off_16_bytes_are_read_in_place(k: int, a_strides: tuple[int, int], a_address: int,
                                              b_strides: tuple[int, int], b_address: int) -> None:
    a, b = _op("a", 16, k, a_strides, a_address), _op("b", 4096, k, b_strides, b_address)
    aligned = staging(a, b, None)
    assert aligned.a.copy and aligned.b.copy  # what a skinny point would copy
    anywhere = staging(a, b, None, any_rows=True)
    assert not anywhere.copies
    assert (anywhere.a.row_stride, anywhere.b.row_stride) == (a_strides[0], b_strides[0])


@pytest.mark.parametrize(("strides", "why"), [
    ((1, 16), "K-major only: columns of one element apart"),
    ((4096, 2), "elements two apart along K"),
    ((100, 1), "rows overlap (stride below K)"),
    ((2**31, 1), "a row stride past int32"),
])
def test_what_is_not_contiguous_along_k_is_still_copied(strides: tuple[int, int], why: str) -> None:
    a, b = _op("a", 4, 1000, (1000, 1), 0), _op("b", 64, 1000, strides, 0)
    stage = staging(a, b, None, any_rows=True)
    assert stage.b.copy and not stage.a.copy, why


def _library() -> object:
    from cubinstore import launch
    from helpers.gpu import manifest_path

    path = manifest_path()
    if not path.is_file():
        pytest.skip(f"no manifest at {path}: run `bazel build //kernels:all`")
    library = launch.open(path)
    if not G.any_rows_points(library):
        pytest.skip(f"{path} has no skinny_any kernels")
    return library


@pytest.mark.parametrize(("a_strides", "b_strides", "b_address", "runs_any", "copies"), [
    ((4095, 1), (4095, 1), 0, True, (False, False)),  # both contiguous, K off 8: B read in place
    ((4095, 1), (4096, 1), 0, False, (True, False)),  # B padded: only the few rows of A are copied
    ((4096, 1), (4096, 1), 2, True, (False, False)),  # B starts off 16 bytes
    ((4096, 1), (4096, 1), 0, False, (False, False)),  # aligned: the selected point as it is
    ((4095, 1), (1, 4095), 0, False, (True, True)),  # B not contiguous along K: copied whichever runs
])
def test_skinny_any_stands_in_where_b_would_be_copied(a_strides: tuple[int, int], b_strides: tuple[int, int],
                                                      b_address: int, runs_any: bool,
                                                      copies: tuple[bool, bool]) -> None:
    library = _library()
    k = 4095 if a_strides[0] == 4095 else 4096
    a, b = _op("a", 16, k, a_strides, 0), _op("b", 8192, k, b_strides, b_address)
    chosen = G.SkinnyConfig(16, 16, 8, 4).kernel_id
    ran, stage = G.reads(library, chosen, a, b, None, chosen=True)
    assert G.config_of(ran).any_rows is runs_any, ran
    assert (stage.a.copy, stage.b.copy) == copies
    # An id the caller names runs as named.
    assert G.reads(library, chosen, a, b, None, chosen=False)[0] == chosen
