"""Misses of ``cubinstore-nvcc``, kept with what Bazel needs to build them ahead (``warmset export``).

    v1/nvcc/warm/<2 hex>/<call>.json   {"schema", "call", "source": sha256 of the TU text (a blob
                                       of the CAS), "arch", "kind", "flags" (``-isystem`` by label),
                                       "roots": [{"label", "path"}], "record", "count",
                                       "first_seen", "last_seen"}

``roots[i].path`` is where the include root was on this host (a local fact: the export turns
it into a Bazel repository, e.g. the include folder of an installed Python package found by
name); ``record`` is the call record of the compile (what a published entry carries).
Written under a per-call lock, read-modify-write, so concurrent misses keep every count.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from cubinstore._core.digest import Digest
from cubinstore._core.log import get_logger
from cubinstore._nvcc import calls
from cubinstore._nvcc.argv import Call
from cubinstore._nvcc.hit import labelled_flags
from cubinstore.errors import CubinstoreError

__all__ = ["SCHEMA", "note", "notes"]

_log = get_logger("cubinstore.nvcc")

SCHEMA = "cubinstore/nvcc-warm/v1"
_MAX_NOTE = 16 << 20


def note(store: Any, key: str, call: Call, text: bytes, record: dict) -> None:
    """Keep the miss of call key ``key`` (its TU text goes to the CAS by sha256)."""
    local = store.local
    try:
        source = Digest.of(text)
        local.write(source, text)
        roots = [{"label": f"inc/{i}", "path": os.path.realpath(d)} for i, d in enumerate(call.include_dirs)]
        isystem = [call.flags[i + 1] for i, f in enumerate(call.flags) if f == "-isystem"]
        roots += [{"label": f"flagpath/{i}", "path": os.path.realpath(d)} for i, d in enumerate(isystem)]
        now = int(time.time())
        with local.file_lock(("nvcc", "locks", key[:2]), key + ".warm.lock", what=f"nvcc warm note {key}"):
            old = read_note(str(local.root), key)
            doc = {"schema": SCHEMA, "call": key, "source": str(source), "size": len(text), "arch": call.arch,
                   "kind": call.kind, "flags": labelled_flags(call), "roots": roots, "record": record,
                   "count": (old["count"] if old else 0) + 1, "first_seen": old["first_seen"] if old else now,
                   "last_seen": now}
            local.write_file(("nvcc", "warm", key[:2]), key + ".json", calls.canonical(doc), durable=False)
    except CubinstoreError as exc:  # advice for CI: the call itself is answered
        _log.warning("cubinstore-nvcc: cannot keep the miss of call %s for warmset export: %s", key, exc)


def read_note(root: str, key: str) -> dict | None:
    """The note of call key ``key``, checked (None: absent or malformed)."""
    raw = calls.read_store_file(root, ("v1", "nvcc", "warm", key[:2], key + ".json"), _MAX_NOTE)
    try:
        doc = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("call") != key:
        return None
    ok = (isinstance(doc.get("source"), str) and doc["source"].startswith("sha256:")
          and isinstance(doc.get("arch"), str) and isinstance(doc.get("kind"), str)
          and isinstance(doc.get("flags"), list) and all(isinstance(f, str) for f in doc["flags"])
          and isinstance(doc.get("roots"), list)
          and all(isinstance(r, dict) and isinstance(r.get("label"), str) and isinstance(r.get("path"), str)
                  for r in doc["roots"])
          and isinstance(doc.get("record"), dict) and calls.record_problem(doc["record"]) is None
          and all(isinstance(doc.get(k), int) and not isinstance(doc.get(k), bool)
                  for k in ("count", "first_seen", "last_seen", "size")))
    return doc if ok else None


def notes(local: Any) -> list[dict]:
    """Every well-formed note of the store, by call key."""
    out = []
    root = str(local.root)
    for shard, _ in local.list_dir(("nvcc", "warm")):
        if len(shard) != 2:
            continue
        for name, _ in local.list_dir(("nvcc", "warm", shard)):
            key = name.removesuffix(".json")
            if name.endswith(".json") and len(key) == 32 and key[:2] == shard:
                doc = read_note(root, key)
                if doc is not None:
                    out.append(doc)
                else:
                    _log.warning("ignoring the malformed nvcc warm note %s", name)
    return sorted(out, key=lambda d: d["call"])
