"""Relocation: a checkout at another path, with another output base, builds nothing that a
checkout elsewhere already built into the shared disk cache."""

from __future__ import annotations

import hashlib

import pytest

from ._workspace import ALL_TARGETS, MANIFEST, PTX_COMPILE, BuildResult, compiled_targets, output_path
from .conftest import Checkouts

pytestmark = pytest.mark.bazel


@pytest.fixture(scope="module")
def relocated(checkouts: Checkouts) -> BuildResult:
    """The deep checkout's build, after the shallow one seeded the shared disk cache."""
    checkouts.seed()
    return checkouts.deep.build(ALL_TARGETS, disk_cache=checkouts.disk_cache)


def test_relocated_checkout_takes_every_cubin_compile_from_the_disk_cache(
        checkouts: Checkouts, relocated: BuildResult) -> None:
    seed = checkouts.seed()
    assert len(checkouts.deep.root.parts) != len(checkouts.shallow.root.parts)
    assert checkouts.deep.output_base != checkouts.shallow.output_base
    instantiations = compiled_targets(seed.manifest_json())
    assert instantiations, "the manifest lists no kernel"
    # Read from the execution log: one CubinCompile spawn per instantiation, every one a hit;
    # the same of each PtxCompile.
    assert set(relocated.by_label()) == instantiations
    assert relocated.misses() == set(), f"recompiled after relocation (log: {relocated.log})"
    assert set(relocated.by_label(PTX_COMPILE)) == compiled_targets(seed.manifest_json(), PTX_COMPILE)
    assert relocated.misses(PTX_COMPILE) == set()
    assert relocated.by_label(MANIFEST) == {"//kernels:manifest": True}
    assert relocated.manifest == seed.manifest


def test_relocated_checkout_gets_the_bytes_the_manifest_names(
        checkouts: Checkouts, relocated: BuildResult) -> None:
    for kernel in relocated.manifest_json()["kernels"]:
        data = output_path(checkouts.deep.root, kernel).read_bytes()
        got = ("sha256:" + hashlib.sha256(data).hexdigest(), len(data))
        assert got == (kernel["digest"], kernel["size"]), kernel["id"]
