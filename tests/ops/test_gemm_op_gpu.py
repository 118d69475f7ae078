"""cubinstore.ops.gemm under torch on a Hopper GPU: compile, CUDA graphs, recycled addresses, host cost.

Needs a compute capability 9.0 GPU, torch, and a manifest with the `gemm` kernels
(`CUBINSTORE_TEST_MANIFEST`, see tests/helpers/gpu.py); skips with the reason otherwise.
Inputs are fresh random values on every run and outputs start as NaN, so an element
the kernel does not write, or a result computed from stale inputs, fails the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import cubinstore.ops as ops
from cubinstore import launch
from cubinstore.internals import gemm_launch as G, gemm_model as _gemm_model, host_us_per_call
from cubinstore.internals import INDUCTOR_CALL
from helpers.gpu import family_library, gemm_operands, gemm_rel_error


pytestmark = pytest.mark.gpu

MAX_REL_ERROR = 1e-2
# Decode (M = 1, split-K), prefill-sized, and a tail shape (no tile edge divides it).
SHAPES = [(1, 4096, 4096), (128, 4096, 4096), (300, 4099, 520)]


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="the gemm op tests need torch")


@pytest.fixture(scope="module")
def lib(torch: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[launch.Library]:
    library = family_library(G.FAMILY, tmp_path_factory)
    ops.set_library(library)
    yield library
    ops.set_library(None)


def _rel_error(torch: Any, d: Any, a: Any, b: Any) -> float:
    torch.cuda.synchronize()
    assert not torch.isnan(d).any(), "output elements left unwritten (still NaN)"
    return gemm_rel_error(torch, d, a, b)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=str)
def test_compiled_fullgraph_matches_eager(lib: launch.Library, torch: Any, backend: str, m: int, n: int, k: int) -> None:
    def f(a: Any, b: Any) -> Any:
        return ops.gemm(a, b).float() * 2.0  # exact in fp32, so compiled and eager agree bit for bit

    compiled = torch.compile(f, fullgraph=True, backend=backend, dynamic=False)
    a, b = gemm_operands(torch, m, n, k)
    eager = f(a, b)
    got = compiled(a, b)
    torch.cuda.synchronize()
    assert torch.equal(got, eager), f"{backend} at {m}x{n}x{k}: compiled differs from eager"
    a2, b2 = gemm_operands(torch, m, n, k)  # the compiled function again, on new values
    assert torch.equal(compiled(a2, b2), f(a2, b2))


# -- inductor calls the launch itself (_gemm_inductor), not the op through torch's dispatcher ------


def _compiled_code(torch: Any, fn: Any, *args: Any) -> tuple[Any, str]:
    """`fn(*args)` and the code inductor generated for it (empty when nothing was compiled)."""
    from torch._inductor.utils import run_and_get_code

    result, codes = run_and_get_code(fn, *args)
    return result, "\n".join(codes)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=str)
def test_inductor_calls_the_launch_not_the_dispatcher(lib: launch.Library, torch: Any, m: int, n: int, k: int) -> None:
    def f(a: Any, b: Any) -> Any:
        return torch.relu(ops.gemm(a, b))

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    a, b = gemm_operands(torch, m, n, k)
    got, code = _compiled_code(torch, compiled, a, b)
    assert f"{INDUCTOR_CALL}(" in code, code
    assert "torch.ops.cubinstore.gemm.default(" not in code, code
    assert torch.equal(got, f(a, b)), f"{m}x{n}x{k}: compiled differs from eager"


def test_inductor_direct_call_takes_views_and_dynamic_shapes(lib: launch.Library, torch: Any) -> None:
    # A transposed (the launch copies it) and B's rows 16 bytes into a wider buffer (read in place),
    # under symbolic sizes. Whatever graphs inductor makes of them (M = 1 is one of its own), each
    # calls the launch and agrees with eager.
    def f(a_t: Any, b_wide: Any) -> Any:
        return ops.gemm(a_t.T, b_wide[:, 8:]).float() * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    n, k = 520, 264
    codes = 0
    for m in (300, 64, 1):
        a_t = torch.randn(k, m, device="cuda:0").to(torch.bfloat16)
        b_wide = torch.randn(n, k + 8, device="cuda:0").to(torch.bfloat16)
        got, code = _compiled_code(torch, compiled, a_t, b_wide)
        if code:
            codes += 1
            assert f"{INDUCTOR_CALL}(" in code, code
            assert "torch.ops.cubinstore.gemm.default(" not in code, code
        assert torch.equal(got, f(a_t, b_wide)), f"{m}x{n}x{k}: compiled differs from eager"
    assert codes >= 1


def test_inductor_direct_call_of_an_empty_k_writes_zeros(lib: launch.Library, torch: Any) -> None:
    # Inductor's buffer for D starts as whatever the allocator held: K = 0 must still write its zeros.
    def f(a: Any, b: Any) -> Any:
        return ops.gemm(a, b).float() + 1.0

    torch._dynamo.reset()
    junk = torch.full((64, 96), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    del junk  # its block goes back to the allocator, NaN and all
    a = torch.empty(64, 0, dtype=torch.bfloat16, device="cuda:0")
    b = torch.empty(96, 0, dtype=torch.bfloat16, device="cuda:0")
    got, code = _compiled_code(torch, torch.compile(f, fullgraph=True, dynamic=False), a, b)
    assert f"{INDUCTOR_CALL}(" in code, code
    assert torch.equal(got, torch.ones(64, 96, device="cuda:0"))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (300, 4099, 520)], ids=str)
def test_inductor_with_cuda_graphs_replays_the_direct_call(lib: launch.Library, torch: Any, m: int, n: int,
                                                           k: int) -> None:
    # mode="reduce-overhead": inductor's CUDA graph trees capture the generated code, our launch in it.
    def f(a: Any, b: Any) -> Any:
        return torch.relu(ops.gemm(a, b)).float() * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead", dynamic=False)
    for turn in range(4):  # warm-up, record, then replays
        a, b = gemm_operands(torch, m, n, k)
        got = compiled(a, b).clone()
        assert torch.equal(got, f(a, b)), f"turn {turn} at {m}x{n}x{k}: the compiled graph differs from eager"
    torch._dynamo.reset()


def test_the_cpp_wrapper_keeps_the_dispatchers_op(lib: launch.Library, torch: Any) -> None:
    def f(a: Any, b: Any) -> Any:
        return ops.gemm(a, b).float() * 2.0

    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    a, b = gemm_operands(torch, 128, 4096, 4096)
    with inductor_config.patch(cpp_wrapper=True):
        got, code = _compiled_code(torch, torch.compile(f, fullgraph=True, dynamic=False), a, b)
    torch._dynamo.reset()
    assert INDUCTOR_CALL not in code, code
    assert torch.equal(got, f(a, b))


def _gemm_tile(lib: launch.Library, m: int, n: int, k: int) -> str:
    """The selection's gemm tile for the shape (never a skinny point, which takes no K split)."""
    tiles = frozenset(i for i in G.candidates(lib) if i.startswith(G.FAMILY + "/"))
    return _gemm_model.choose(m, n, k, G.sm_count(0), tiles, cluster_slots=G.cluster_slots(lib, 0))[0]


@pytest.mark.parametrize(("splits", "m"), [(2, 1), (3, 1), (8, 1), (16, 1), (G.STREAM_K, 1), (G.STREAM_K, 1280)])
def test_split_k_gives_the_same_bits_whichever_split_arrives_last(
    lib: launch.Library, torch: Any, splits: int, m: int
) -> None:
    # The last CTA of a tile to arrive sums the partials; the order the splits finish in varies
    # from launch to launch, so the sum must not follow it (compiled and eager must agree bit for bit).
    # Stream-K at 1280 rows: whole tiles, then tiles cut over two or three CTAs.
    n, k = 4096, 4096
    a, b = gemm_operands(torch, m, n, k)
    kernel_id = _gemm_tile(lib, m, n, k)
    first = ops.gemm_with(a, b, kernel_id=kernel_id, splits=splits)
    for i in range(50):
        again = ops.gemm_with(a, b, kernel_id=kernel_id, splits=splits)
        assert torch.equal(again, first), f"{kernel_id} splits={splits}: launch {i + 1} differs from the first"
    assert _rel_error(torch, first, a, b) < MAX_REL_ERROR


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=str)
def test_captured_graph_replays_with_newgemm_operands(lib: launch.Library, torch: Any, m: int, n: int, k: int) -> None:
    a, b = gemm_operands(torch, m, n, k)
    ops.gemm(a, b)  # warm: load, select, prepare outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d = ops.gemm(a, b)
    for _ in range(3):
        new_a, new_b = gemm_operands(torch, m, n, k)
        a.copy_(new_a)
        b.copy_(new_b)
        d.fill_(float("nan"))
        graph.replay()
        rel = _rel_error(torch, d, new_a, new_b)
        assert rel < MAX_REL_ERROR, f"graph replay at {m}x{n}x{k}: relative error {rel:.3g}"


def test_two_graphs_on_one_capture_stream_each_zero_their_split_k_counters(lib: launch.Library, torch: Any) -> None:
    # Both captures use torch's default capture stream; the second graph replayed first
    # must not depend on anything the first one's capture left behind.
    m, n, k = 1, 4096, 4096
    kernel_id = _gemm_tile(lib, m, n, k)
    inputs = [gemm_operands(torch, m, n, k) for _ in range(2)]
    graphs, outs = [], []
    for a, b in inputs:
        ops.gemm_with(a, b, kernel_id=kernel_id, splits=8)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(ops.gemm_with(a, b, kernel_id=kernel_id, splits=8))
        graphs.append(graph)
    for i in (1, 0, 1):
        outs[i].fill_(float("nan"))
        graphs[i].replay()
        rel = _rel_error(torch, outs[i], *inputs[i])
        assert rel < MAX_REL_ERROR, f"graph {i}: relative error {rel:.3g}"


def test_recycled_addresses_get_correct_results_and_reuse_the_caches(lib: launch.Library, torch: Any) -> None:
    m, n, k = 64, 1024, 512
    a, b = gemm_operands(torch, m, n, k)
    ops.gemm(a, b, out=torch.empty(m, n, dtype=torch.bfloat16, device="cuda:0"))
    seen_a, seen_b = {a.data_ptr()}, {b.data_ptr()}  # already mapped
    del a, b
    before = G.cache_misses()
    new_a: set[int] = set()
    new_b: set[int] = set()
    turns = 12
    for i in range(turns):
        # Freed and reallocated each turn: the caching allocator hands back the same addresses
        # with new contents, so a map cached for an address must still be right.
        a, b = gemm_operands(torch, m, n, k)
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        ops.gemm(a, b, out=d)
        new_a |= {a.data_ptr()} - seen_a
        new_b |= {b.data_ptr()} - seen_b
        rel = _rel_error(torch, d, a, b)
        assert rel < MAX_REL_ERROR, f"call {i}: relative error {rel:.3g}"
        del a, b, d
    after = G.cache_misses()
    assert after["prepared"] == before["prepared"] and after["selection"] == before["selection"]
    # One encode per address not mapped before, none for an address seen again.
    assert len(seen_a | new_a) <= G._MAP_CACHE and len(seen_b | new_b) <= G._MAP_CACHE
    assert after["tensor_map"] - before["tensor_map"] == len(new_a) + len(new_b)
    assert len(new_a) + len(new_b) < 2 * turns, "the allocator recycled no address; the test proves nothing"


def test_repeat_calls_use_one_prepared_launch(lib: launch.Library, torch: Any) -> None:
    a, b = gemm_operands(torch, 128, 4096, 4096)
    d = torch.empty(128, 4096, dtype=torch.bfloat16, device="cuda:0")
    ops.gemm(a, b, out=d)
    before = G.cache_misses()
    # This signature's entry: with `out`, and neither instantiation nor split forced (earlier tests
    # may have left entries of the same shapes that force them); the alignment flags follow.
    call = next(c for key, c in G._calls.items()
                if key[2] == a.shape and key[6] == b.shape and isinstance(key[8], tuple) and key[9:11] == (None, None))
    launches = call.launch.calls
    for _ in range(50):
        ops.gemm(a, b, out=d)
    assert call.launch.calls == launches + 50
    assert G.cache_misses() == before


def test_the_op_called_directly_matches_the_reference(lib: launch.Library, torch: Any) -> None:
    a, b = gemm_operands(torch, 129, 257, 72)
    d = torch.ops.cubinstore.gemm(a, b)
    assert _rel_error(torch, d, a, b) < MAX_REL_ERROR
    out = torch.full((129, 257), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    torch.ops.cubinstore.gemm_out(a, b, out)
    assert _rel_error(torch, out, a, b) < MAX_REL_ERROR


@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (128, 4096, 4096)], ids=str)
def test_host_cost_per_call_is_at_most_twice_torch_mm(lib: launch.Library, torch: Any, m: int, n: int, k: int) -> None:
    a, b = gemm_operands(torch, m, n, k)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda:0")
    ours = host_us_per_call(lambda: ops.gemm(a, b, out=d))
    theirs = host_us_per_call(lambda: torch.mm(a, b.T, out=d))
    assert ours <= 2 * theirs, f"{m}x{n}x{k}: ops.gemm {ours:.1f} us a call, torch.mm {theirs:.1f} us"


def test_threads_sharing_the_caches_get_their_own_results(lib: launch.Library, torch: Any) -> None:
    # Two threads per signature, so they share one prepared launch (its buffer) and one map cache.
    import threading

    shapes = [(64, 1024, 512), (64, 1024, 512), (1, 4096, 4096), (1, 4096, 4096)]
    for shape in shapes:
        ops.gemm(*gemm_operands(torch, *shape))
    torch.cuda.synchronize()
    errors: list[str] = []

    def work(index: int, m: int, n: int, k: int) -> None:
        try:  # an exception in a thread would only end the thread: record it
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for i in range(20):
                    a, b = gemm_operands(torch, m, n, k)
                    d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda:0")
                    ops.gemm(a, b, out=d)
                    stream.synchronize()
                    rel = _rel_error(torch, d, a, b)
                    assert rel < MAX_REL_ERROR, f"call {i}: relative error {rel:.3g}"
        except Exception as exc:
            errors.append(f"thread {index} at {m}x{n}x{k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i, *shape)) for i, shape in enumerate(shapes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_an_out_view_one_element_in_is_stored_in_place(lib: launch.Library, torch: Any) -> None:
    # Off TMA every store of D is one element, so a row-major view one element into a buffer is
    # stored into directly, as a view 4 bytes in is: no copy for either signature, nothing written
    # around D. (Before the eighth session of 2026-12-06, an N-even D had to start on 4 bytes, and
    # this one was copied.)
    m, n, k = 64, 256, 128
    a, b = gemm_operands(torch, m, n, k)
    buf = torch.full((m * n + 2,), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    odd, even = buf[1:1 + m * n].view(m, n), buf[2:].view(m, n)
    for d in (odd, even, odd):  # the second odd call is a cache hit
        buf.fill_(float("nan"))
        assert ops.gemm(a, b, out=d) is d
        assert _rel_error(torch, d, a, b) < MAX_REL_ERROR
        assert bool(torch.isnan(buf[:d.storage_offset()]).all() and torch.isnan(buf[d.storage_offset() + m * n:]).all())
    copying = {c.staging is not None and c.staging.copy_out for key, c in G._calls.items()
               if key[2] == a.shape and key[6] == b.shape and isinstance(key[8], tuple) and key[8][2] == (m, n)}
    assert copying == {False}


# -- layouts the kernels cannot read in place, under torch.compile and CUDA graphs ------------------


def _odd_operands(torch: Any) -> tuple[Any, Any]:
    """A transposed (so copied) and B contiguous with K = 1111 (rows off 16 bytes: copied): the issue's shape."""
    a = torch.randn(1111, 777, device="cuda:0").to(torch.bfloat16).T
    b = torch.randn(3333, 1111, device="cuda:0").to(torch.bfloat16)
    return a, b


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fullgraph_with_copies_matches_eager(lib: launch.Library, torch: Any, backend: str) -> None:
    def f(a: Any, b: Any, out: Any) -> Any:
        ops.gemm(a, b, out=out)
        return ops.gemm(a, b).float() * 2.0, out.float()

    compiled = torch.compile(f, fullgraph=True, backend=backend, dynamic=False)
    a, b = _odd_operands(torch)
    out_eager = torch.full((3333, 777), float("nan"), dtype=torch.bfloat16, device="cuda:0").T  # copied into
    out_compiled = out_eager.clone()
    eager = f(a, b, out_eager)
    got = compiled(a, b, out_compiled)
    torch.cuda.synchronize()
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), f"{backend}: compiled differs from eager"
    assert _rel_error(torch, out_compiled, a, b) < MAX_REL_ERROR


def test_captured_graph_replays_the_copies_with_new_operands(lib: launch.Library, torch: Any) -> None:
    a, b = _odd_operands(torch)
    out = torch.full((3333, 777), float("nan"), dtype=torch.bfloat16, device="cuda:0").T
    ops.gemm(a, b)  # warm: load, select, prepare outside capture
    ops.gemm(a, b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d = ops.gemm(a, b)
        ops.gemm(a, b, out=out)
    for _ in range(3):
        new_a, new_b = _odd_operands(torch)
        a.copy_(new_a)
        b.copy_(new_b)
        d.fill_(float("nan"))
        out.fill_(float("nan"))
        graph.replay()
        for what, got in (("returned", d), ("out", out)):
            rel = _rel_error(torch, got, new_a, new_b)
            assert rel < MAX_REL_ERROR, f"graph replay, {what}: relative error {rel:.3g}"
