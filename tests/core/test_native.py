"""The compiled first-load helper (``cubinstore._core._native``) on its own: what ``read_entry``
returns for each kind of entry, and that ``load_functions`` touches no driver this process has not
loaded. The paths through ``LocalLayer`` run in tests/store/test_store_records.py on both readers;
the driver half on a GPU in tests/runtime/test_gpu_launch.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash
from helpers import native as native_paths
from helpers.jit import real_toolkit

from cubinstore.internals import ArgBuffer
from cubinstore.internals import native
from cubinstore.store.local import record
from cubinstore.store.local.root import READ_FLAGS, TOUCH_AFTER, entry_rule

MISSING, OTHER = 0, 1
HEX = "ab" * 32


@pytest.fixture
def helper() -> Any:
    return native_paths.built_helper()


@pytest.fixture
def shard(tmp_path: Path) -> Any:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def entry(where: Path, data: bytes, *, recorded: bytes | None = None, mode: int = 0o444) -> Path:
    path = where / HEX
    path.write_bytes(data)
    try:
        os.setxattr(path, record.NAME, record.head(HEX) + xxhash.xxh3_128_digest(data) if recorded is None else recorded)
    except OSError as exc:
        pytest.skip(f"{where} has no user xattrs ({exc.strerror})")
    path.chmod(mode)
    return path


def vouch(rule: tuple[int, int, int] | None = None) -> tuple[Any, ...]:
    return (record.NAME, record.head(HEX), xxhash.xxh3_128_digest, *(rule or entry_rule()))


def read(helper: Any, fd: int, size: int, checked: bool = True, name: str = HEX) -> Any:
    return helper.read_entry(fd, name, size, READ_FLAGS, TOUCH_AFTER, vouch() if checked else None)


def test_a_recorded_entry_of_ours_reads_back(helper: Any, shard: Any) -> None:
    where, fd = shard
    data = os.urandom(5000)
    entry(where, data)
    assert read(helper, fd, len(data)) == data
    assert read(helper, fd, len(data), checked=False) == data


def test_a_missing_name_is_0_and_a_wrong_size_1(helper: Any, shard: Any) -> None:
    where, fd = shard
    assert read(helper, fd, 10) == MISSING
    entry(where, b"x" * 100)
    assert read(helper, fd, 99) == OTHER and read(helper, fd, 101) == OTHER
    assert read(helper, fd, 99, checked=False) == OTHER  # the size is checked either way


def test_nothing_is_allocated_for_a_size_the_file_does_not_have(helper: Any, shard: Any) -> None:
    # A terabyte asked for: the open and fstat come first, so a miss or a wrong size is a code, not a MemoryError.
    where, fd = shard
    assert read(helper, fd, 1 << 40) == MISSING
    entry(where, b"z" * 10)
    assert read(helper, fd, 1 << 40) == OTHER and read(helper, fd, 1 << 40, checked=False) == OTHER


@pytest.mark.parametrize("damage", ["flipped bit", "same-size replacement", "stale record", "no record",
                                    "another digest's record", "garbage record"])
def test_bytes_the_record_does_not_vouch_for_are_1(helper: Any, shard: Any, damage: str) -> None:
    where, fd = shard
    data = bytearray(os.urandom(4096))
    path = entry(where, bytes(data), mode=0o644)
    if damage == "flipped bit":
        data[1234] ^= 0x10
        path.write_bytes(data)
    elif damage == "same-size replacement":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "stale record":
        os.setxattr(path, record.NAME, record.head(HEX) + xxhash.xxh3_128_digest(b"other"))
    elif damage == "no record":
        os.removexattr(path, record.NAME)
    elif damage == "another digest's record":
        os.setxattr(path, record.NAME, record.head("cd" * 32) + xxhash.xxh3_128_digest(bytes(data)))
    else:
        os.setxattr(path, record.NAME, b"\x01" * 300)
    assert read(helper, fd, len(data)) == OTHER


def test_the_ownership_rule_comes_from_the_caller(helper: Any, shard: Any) -> None:
    where, fd = shard
    data = os.urandom(1000)
    path = entry(where, data, mode=0o664)  # group-writable: the rule's forbidden bits
    assert read(helper, fd, len(data)) == OTHER
    path.chmod(0o644)
    assert read(helper, fd, len(data)) == data
    me = os.geteuid()
    assert helper.read_entry(fd, HEX, len(data), READ_FLAGS, TOUCH_AFTER, vouch((me + 1, me + 2, 0o022))) == OTHER
    assert read(helper, fd, len(data), checked=False) == data  # unchecked: the caller hashes


def test_links_fifos_and_directories_are_1_and_never_followed(helper: Any, shard: Any, tmp_path: Path) -> None:
    where, fd = shard
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "target"
    target.write_bytes(b"y" * 64)
    (where / HEX).symlink_to(target)
    assert read(helper, fd, 64, checked=False) == OTHER
    (where / HEX).unlink()
    os.mkfifo(where / HEX)  # O_NONBLOCK from the caller's flags: the open does not wait for a writer
    assert read(helper, fd, 64, checked=False) == OTHER
    (where / HEX).unlink()
    (where / HEX).mkdir()
    assert read(helper, fd, 64, checked=False) == OTHER


def test_a_name_is_one_component_of_the_directory_given(helper: Any, shard: Any, tmp_path: Path) -> None:
    where, fd = shard
    data = os.urandom(100)
    entry(where, data)
    assert read(helper, fd, len(data), name=f"../{where.name}/{HEX}") == OTHER  # no path, even to itself
    (tmp_path / "elsewhere").mkdir()
    other = os.open(tmp_path / "elsewhere", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read(helper, other, len(data)) == MISSING
    finally:
        os.close(other)


def test_an_old_entry_gets_its_mtime_bumped_a_new_one_not(helper: Any, shard: Any) -> None:
    where, fd = shard
    data = os.urandom(100)
    path = entry(where, data, mode=0o644)
    old = time.time() - 2 * TOUCH_AFTER
    os.utime(path, (old, old))
    assert read(helper, fd, len(data)) == data
    bumped = path.stat().st_mtime
    assert bumped > old + TOUCH_AFTER
    assert read(helper, fd, len(data)) == data
    assert path.stat().st_mtime == bumped


def test_an_xxh3_that_raises_propagates(helper: Any, shard: Any) -> None:
    where, fd = shard
    data = os.urandom(100)
    entry(where, data)

    def broken(_: bytes) -> bytes:
        raise RuntimeError("xxh3 failed")

    with pytest.raises(RuntimeError, match="xxh3 failed"):
        helper.read_entry(fd, HEX, len(data), READ_FLAGS, TOUCH_AFTER,
                          (record.NAME, record.head(HEX), broken, *entry_rule()))


def test_load_functions_without_a_loaded_driver_is_minus_1(helper: Any) -> None:
    # RTLD_NOLOAD: the helper only uses the libcuda the bindings loaded, never loads a driver itself.
    if any("libcuda" in line for line in Path("/proc/self/maps").read_text().splitlines()):
        pytest.skip("libcuda is loaded in this process")
    assert helper.load_functions(b"\x7fELF", ("kernel",), 0, 500) == -1


def test_cubinstore_native_0_turns_the_helper_off(monkeypatch: pytest.MonkeyPatch) -> None:
    native_paths.use(monkeypatch, "native")
    assert native.helper() is native.built() is not None
    monkeypatch.setenv("CUBINSTORE_NATIVE", "0")
    assert native.helper() is None


# -- the launch (cubinstore.launch.PreparedLaunch, Kernel.launch; on a GPU in tests/runtime) ----------

LAYOUT_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
    printf("CUlaunchConfig %zu\n", sizeof(CUlaunchConfig));
    printf("CUlaunchConfig.sharedMemBytes %zu\n", offsetof(CUlaunchConfig, sharedMemBytes));
    printf("CUlaunchConfig.hStream %zu\n", offsetof(CUlaunchConfig, hStream));
    printf("CUlaunchConfig.attrs %zu\n", offsetof(CUlaunchConfig, attrs));
    printf("CUlaunchConfig.numAttrs %zu\n", offsetof(CUlaunchConfig, numAttrs));
    printf("CUlaunchAttribute %zu\n", sizeof(CUlaunchAttribute));
    printf("CUlaunchAttribute.value %zu\n", offsetof(CUlaunchAttribute, value));
    printf("CUlaunchAttributeValue.clusterDim.z %zu\n", offsetof(CUlaunchAttributeValue, clusterDim.z));
    printf("CUlaunchAttributeValue.programmaticStreamSerializationAllowed %zu\n",
           offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed));
    printf("CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION %d\n", (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);
    return 0;
}
"""


def test_the_launch_structs_are_laid_out_as_cuda_h_lays_them_out(helper: Any, tmp_path: Path) -> None:
    include = real_toolkit() / "include"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not (include / "cuda.h").is_file():
        pytest.skip(f"no C compiler or no {include}/cuda.h")
    (tmp_path / "probe.c").write_text(LAYOUT_PROBE)
    subprocess.run([compiler, "-I", str(include), "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")],
                   check=True, timeout=120)
    got = subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True, text=True, timeout=30).stdout
    want = {name: int(value) for name, value in (line.split() for line in got.splitlines())}
    assert want.pop("CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION") == 4  # the probe read this cuda.h
    assert helper.launch_layout() == want


def test_a_launch_config_holds_the_geometry_and_the_attributes_asked_for(helper: Any) -> None:
    layout = helper.launch_layout()
    config, attribute = layout["CUlaunchConfig"], layout["CUlaunchAttribute"]
    value_at = layout["CUlaunchAttribute.value"]

    def attributes(blob: bytes, count: int) -> list[tuple[int, bytes]]:
        found = []
        for i in range(count):
            at = config + i * attribute
            found.append((struct.unpack_from("<i", blob, at)[0], blob[at + value_at : at + attribute]))
        return found

    blob = helper.launch_config((7, 2, 3), (128, 2, 1), 200 * 1024, (2, 1, 1), 4, 6)
    assert struct.unpack_from("<7I", blob, 0) == (7, 2, 3, 128, 2, 1, 200 * 1024)
    assert struct.unpack_from("<I", blob, layout["CUlaunchConfig.numAttrs"])[0] == 2
    (cluster_id, cluster), (pdl_id, pdl) = attributes(blob, 2)
    assert (cluster_id, struct.unpack_from("<3I", cluster)) == (4, (2, 1, 1))
    assert (pdl_id, struct.unpack_from("<i", pdl)[0]) == (6, 1)
    plain = helper.launch_config((1, 1, 1), (32, 1, 1), 0, None, 4, -1)
    assert struct.unpack_from("<I", plain, layout["CUlaunchConfig.numAttrs"])[0] == 0
    with pytest.raises(OverflowError):
        helper.launch_config((-1, 1, 1), (32, 1, 1), 0, None, 4, -1)
    with pytest.raises(OverflowError):
        helper.launch_config((1, 1, 1), (32, 1, 1), 2**32, None, 4, -1)
    with pytest.raises(OverflowError):
        helper.launch_config((1, 1, 1), (32, 1, 1), 0, (2**32, 1, 1), 4, -1)


def _no_libcuda() -> None:
    if any("libcuda" in line for line in Path("/proc/self/maps").read_text().splitlines()):
        pytest.skip("libcuda is loaded in this process: the helper would launch")


def test_launch_writes_pointers_and_tensor_maps_where_the_plan_says(helper: Any) -> None:
    _no_libcuda()
    buffer = (ctypes.c_ubyte * 256)()
    base = ctypes.addressof(buffer)
    config = helper.launch_config((1, 1, 1), (32, 1, 1), 0, None, 4, -1)
    tensor_map = bytes(range(128))
    plan = (base, 1, base + 8, 2, base + 136, 1)
    assert helper.launch(0, config, 0, 0, 0, plan, (2**64 - 1, tensor_map, 0x1234)) == -2  # written; no driver
    assert bytes(buffer[:8]) == b"\xff" * 8
    assert bytes(buffer[8:136]) == tensor_map
    assert bytes(buffer[136:144]) == (0x1234).to_bytes(8, "little")
    assert helper.bind() is False


@pytest.mark.parametrize("value", [-1, 2**64, True, 1.0, b"\0" * 8, None], ids=repr)
def test_launch_launches_nothing_for_a_value_it_does_not_write(helper: Any, value: Any) -> None:
    # -1: the caller packs every value with its checks (ArgBuffer.write), which words the error.
    buffer = (ctypes.c_ubyte * 128)()
    at = ctypes.addressof(buffer)
    config = helper.launch_config((1, 1, 1), (32, 1, 1), 0, None, 4, -1)
    assert helper.launch(0, config, 0, 0, 0, (at, 1), (value,)) == -1
    assert helper.launch(0, config, 0, 0, 0, (at, 2), (b"\0" * 127,)) == -1
    assert helper.launch(0, config, 0, 0, 0, (at, 0), (0,)) == -1  # a kind it leaves to the caller
    assert helper.launch(0, config, 0, 0, 0, (at, 1), (1, 2)) == -1  # not one value per plan entry
    with pytest.raises(TypeError):
        helper.launch(0, config[:-1], 0, 0, 0, (), ())


def test_an_arg_buffers_plan_names_its_pointers_and_tensor_maps() -> None:
    buffer = ArgBuffer("k", "e", ("ptr", "tensormap", "i32", "ptr"), (None, None, None, 5), device=0)
    plan = buffer.plan()
    assert plan[1::2] == (1, 2, 0)
    base = ctypes.addressof(buffer._buffer)  # the buffer the plan points into
    assert [a - base for a in plan[::2]] == [at for _i, _name, at, _size in buffer.varying]
