"""Call records shared through a remote cache's action cache, as REAPI ``ActionResult`` entries.

A call key's entry lives at ``<remote>/ac/<action digest>`` (``store.action_result``: the
digest of an ``Action`` whose command line names the scheme and the call key). Its result
lists two output files in the CAS: ``kernel.cubin`` (the CUBIN; ``kernel.ptx`` or ``kernel.fatbin`` for such calls) and ``call.json`` (the call
record: the files the compile read, by label and content, the places that must stay empty,
nvcc's output), and carries nvcc's stdout and stderr as the action's own. A reader checks the
record against this host's files exactly as a local record is checked, and verifies both
blobs by sha256 (``Store.get``), so a remote can make a call miss, never load a wrong CUBIN
for files it does not match. Only trusted writers publish (``CUBINSTORE_NVCC_PUBLISH=1`` on
CI, or ``cubinstore warmset publish``), as only Bazel's ``--config=ci`` uploads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cubinstore._core.abi import loads_strict
from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore._nvcc import calls
from cubinstore.errors import CubinstoreError, IntegrityError
from cubinstore.store.action_result import ActionResult, OutputFile, action_digest_for, decode_action_result

if TYPE_CHECKING:
    from cubinstore.store import Store
    from cubinstore.store.http import HttpLayer

__all__ = ["SCHEME", "fetch", "publish", "remotes"]

_log = get_logger("cubinstore.nvcc")

SCHEME = "nvcc-call/v1"  # the Action's scheme word: bumped with the record's meaning
def output_path(kind: str) -> str:
    """The output file's name in the result: ``kernel.cubin`` (or ``kernel.ptx``, ``kernel.fatbin``)."""
    return f"kernel.{kind}"
RECORD_PATH = "call.json"
_INLINE = 1 << 20  # a record up to this size is inlined in the result too (well within its 4 MiB)


def remotes(store: Store) -> list[HttpLayer]:
    from cubinstore.store.http import HttpLayer

    return [layer for layer in store.layers if isinstance(layer, HttpLayer)]


def fetch(store: Store, key: str, where: dict[str, str], kind: str = "cubin") -> tuple[dict, bytes] | None:
    """(record, output) from the first remote whose entry for call key ``key`` checks here."""
    out_path = output_path(kind)
    action = action_digest_for(SCHEME, key)
    for remote in remotes(store):
        try:
            raw = remote.get_action_result(action)
            if raw is None:
                continue
            result = decode_action_result(raw)
            files = {f.path: f for f in result.output_files}
            if out_path not in files or RECORD_PATH not in files:
                raise IntegrityError(f"it lacks {out_path} or {RECORD_PATH}")
            meta = files[RECORD_PATH]
            # Inlined by our writers (the decoder checked it against its digest); else from the CAS,
            # at the size the remote declares: no larger than a record this host could keep.
            if not meta.contents and meta.size > calls.MAX_RECORD_BYTES:
                raise IntegrityError(f"its {RECORD_PATH} is {meta.size} bytes, over the "
                                     f"{calls.MAX_RECORD_BYTES}-byte limit of a call record")
            raw = meta.contents or store.get(meta.digest, meta.size, name=f"nvcc call {key} record")
            record = loads_strict(raw, f"its {RECORD_PATH}", IntegrityError)
            problem = calls.record_problem(record) if isinstance(record, dict) else "not an object"
            if problem is not None:
                raise IntegrityError(f"its call record is malformed ({problem})")
            if record["outside"]:
                # Files by absolute path: a remote's record never makes this host read one.
                raise IntegrityError("its call record names files outside the include roots, which a remote "
                                     "record may not (the call compiles here)")
            cubin = files[out_path]
            if str(cubin.digest) != record["digest"] or cubin.size != record["size"]:
                raise IntegrityError("its CUBIN is not the one its record names")
            why = calls.check(record, where)
            if why is not None:
                _log.debug("nvcc call %s: %s's entry does not hold here (%s)", key, remote.name, why)
                continue
            data = store.get(cubin.digest, cubin.size, name=f"nvcc call {key}")
            if not calls.looks_like(data, kind):
                raise IntegrityError(f"{cubin.digest} is not a {kind}")
            return record, data
        except (CubinstoreError, ValueError) as exc:
            _log.warning("nvcc call %s: ignoring the entry of %s (action %s): %s", key, remote.name, action, exc)
    return None


def publish(store: Store, key: str, record: dict, data: bytes, kind: str = "cubin") -> list[str]:
    """Upload the CUBIN, the record and the entry naming them (in that order: an entry never
    names a missing blob) to every remote of ``store``; each upload is read back. Returns the
    problems, one per remote that failed (empty: all took it)."""
    blob = calls.canonical(record)
    cubin_digest, record_digest = Digest.of(data), Digest.of(blob)
    if str(cubin_digest) != record["digest"]:
        raise IntegrityError(f"nvcc call {key}: the CUBIN to publish is {cubin_digest}, its record names {record['digest']}")
    result = ActionResult(
        # The record inlined too (a reader saves a request) and in the CAS (REAPI readers expect it there).
        output_files=(OutputFile(output_path(kind), cubin_digest, len(data)),
                      OutputFile(RECORD_PATH, record_digest, len(blob), contents=blob if len(blob) <= _INLINE else b"")),
        stdout_raw=record["stdout"].encode("utf-8", "surrogateescape"),
        stderr_raw=record["stderr"].encode("utf-8", "surrogateescape"),
    ).encode()
    action = action_digest_for(SCHEME, key)
    problems = []
    for remote in remotes(store):
        try:
            remote.put(cubin_digest, data)
            remote.put(record_digest, blob)
            remote.put_action_result(action, result)
            if remote.get_action_result(action) != result:  # a cache may drop what it accepted
                raise IntegrityError(f"ac/{action} does not read back as written")
        except CubinstoreError as exc:
            problems.append(f"{remote.name}: {exc}")
    return problems
