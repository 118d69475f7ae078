"""The local store's commands: ``prefetch``, ``ls``, ``verify``, ``gc``, ``pin``, ``unpin``, ``stats``.

The logic is in ``_release`` (prefetch pool, maintenance) and ``store``; this module parses and prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from cubinstore._core import knobs, native
from cubinstore._core.digest import Digest
from cubinstore._release.refs import load_manifest, with_build_trees
from cubinstore.cli import EXIT_FAILED, EXIT_OK, M_HELP, err
from cubinstore.cli._common import (
    Progress,
    archs,
    human,
    local_store,
    parse_bytes,
    usable,
)
from cubinstore.errors import BadArgumentError, CubinstoreError
from cubinstore.store import Store

__all__ = ["add_arguments"]

# Imported by the commands that need them: _release.maint by verify, gc, pin and unpin,
# _release.prefetch (a thread pool) by prefetch.


def _cmd_prefetch(args: argparse.Namespace) -> int:
    from cubinstore._release.prefetch import (
        blob_names,
        closure,
        fetch_blobs,
        without_memory,
    )

    store = with_build_trees(Store.from_env(extra_remotes=args.remote or (), strict=True), args.manifest)
    local = store.local
    if local is None:  # from_env always adds one; kept for type checkers
        raise CubinstoreError("no local store configured")
    usable(local, check=True)  # before the manifest: a sha256: reference reads the store too
    manifest = load_manifest(args.manifest, store, policy=args.policy)
    wanted = archs(args.arch)
    if wanted is not None and not wanted.intersection(manifest.archs):
        raise BadArgumentError(f"--arch {','.join(sorted(wanted))}: manifest {manifest.digest} has archs {', '.join(manifest.archs)}")
    blobs = closure(manifest, wanted)
    usable(local, create=True)  # every blob writes below v1/cas
    store = without_memory(store)
    before = store.stats
    progress = Progress("prefetch")
    try:
        failures = fetch_blobs(store, blobs, names=lambda d: blob_names(manifest, d), jobs=knobs.fetch_jobs(),
                               progress=progress)
    finally:
        progress.close()
    # Report the per-blob failures first: whatever fails after must not hide which kernels failed.
    for failure in failures:
        err(failure)
    if failures:
        err(f"prefetch {manifest.digest}: {len(failures)} of {len(blobs)} blobs failed")
    # Keep the manifest itself too, so `sha256:` references resolve offline.
    try:
        if local.status(manifest.digest, len(manifest.raw)) != "ok":
            local.write(manifest.digest, manifest.raw)
    except CubinstoreError as exc:
        err(f"cannot store manifest {manifest.digest} in {local.root}: {exc}")
        return EXIT_FAILED
    if failures:
        return EXIT_FAILED
    after = store.stats
    print(
        f"prefetched {manifest.digest}: {len(blobs)} blobs, {after.misses - before.misses} downloaded "
        f"({human(after.bytes_fetched - before.bytes_fetched)}), {after.hits - before.hits} already local, in {local.root}"
    )
    return EXIT_OK


def _cmd_ls(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    local = usable(local_store())
    status: dict[Digest, str] = {}  # kernels sharing a CUBIN read it once
    rows = [(k.id, k.arch, str(k.size), status.get(k.digest) or status.setdefault(k.digest, local.status(k.digest, k.size)))
            for k in sorted(manifest.kernels, key=lambda k: k.id)]
    header = ("ID", "ARCH", "SIZE", "LOCAL")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) if i < 3 else cell for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from cubinstore._release.maint import verify_store

    local = usable(local_store())
    blobs = None
    if args.manifest:
        manifest = load_manifest(args.manifest, Store([local]))
        blobs = list(manifest.blobs)
    report = verify_store(local, blobs)
    for digest, reason, moved in report.corrupt:
        print(f"corrupt {digest}: {reason}; quarantined to {moved}")
    for digest in report.missing:
        print(f"missing {digest}")
    for stray in report.strays:
        print(f"stray {stray} (ignored)")
    r = report.records
    print(f"records (xxh3-128, checked at first load instead of sha256): {r['ok']} ok, {r['recorded']} written, "
          f"{r['re-recorded']} stale and rewritten, {r['none']} not kept"
          + ("" if local.trusts_records() else " (this store's first loads use sha256: CUBINSTORE_VERIFY=full, "
             "a shared store, or one that fails the ownership rule)"))
    print(f"verified {report.checked} entries in {local.root}: {report.ok} ok, {len(report.corrupt)} corrupt, {len(report.missing)} missing")
    if report.failed:
        err(f"verify: {len(report.corrupt)} corrupt and {len(report.missing)} missing entries in {local.root}")
        return EXIT_FAILED
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from cubinstore._release.maint import gc

    limit = parse_bytes(args.max_bytes)
    local = usable(local_store())
    result = gc(local, limit)
    print(
        f"gc {local.root}: {human(result.total_before)} -> {human(result.total_after)}, evicted "
        f"{len(result.evicted)} entries, {human(result.pinned_bytes)} pinned"
    )
    if result.total_after > limit:
        print(f"note: pinned entries alone exceed --max-bytes {limit}", file=sys.stderr)
    return EXIT_OK


def _cmd_pin(args: argparse.Namespace) -> int:
    from cubinstore._release.maint import pin, pinned

    local = local_store()
    if not args.manifest:
        for manifest in pinned(local):
            print(f"{manifest.digest}  {len(manifest.kernels)} kernels")
        return EXIT_OK
    manifest = load_manifest(args.manifest)
    pin(local, manifest)
    print(f"pinned {manifest.digest}")
    return EXIT_OK


def _cmd_unpin(args: argparse.Namespace) -> int:
    from cubinstore._release.maint import unpin

    ref = args.manifest
    digest = Digest.parse(ref) if ref.startswith("sha256:") else load_manifest(ref).digest
    if not unpin(local_store(), digest):
        err(f"{digest} is not pinned in {local_store().root}")
        return EXIT_FAILED
    print(f"unpinned {digest}")
    return EXIT_OK


def _cmd_stats(args: argparse.Namespace) -> int:
    local = usable(local_store())
    counts = local.read_stats()
    entries, _ = local.scan()
    for key, value in counts.items():
        print(f"{key} {value}")
    print(f"entries {len(entries)}")
    print(f"bytes {sum(e.size for e in entries)}")
    print(f"root {local.root}")
    # How this process's first loads would check and read an entry (README: "Checks at load").
    print(f"first_load_check {'records' if local.trusts_records() else 'sha256'}")
    helper = "native" if native.helper() is not None else "python"
    print(f"first_load_read {helper}")
    print(f"launch {helper}")  # a prepared launch's argument writes and driver calls: one call of the helper
    return EXIT_OK


def _args_prefetch(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", help=M_HELP)
    p.add_argument("--remote", action="append", metavar="URL", help="HTTP CAS or oci://HOST/REPO registry to fetch from (before CUBINSTORE_REMOTE)")
    p.add_argument("--arch", action="append", metavar="ARCH", help="only kernels of this arch (repeatable, or comma-separated)")
    p.add_argument("--policy", metavar="FILE", help="trust policy for channel:NAME (default CUBINSTORE_TRUST_POLICY)")
    return _cmd_prefetch


def _args_ls(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", help=M_HELP)
    return _cmd_ls


def _args_verify(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", nargs="?", help=M_HELP)
    return _cmd_verify


def _args_gc(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("--max-bytes", required=True, metavar="N", help="target size, e.g. 1000000 or 10G")
    return _cmd_gc


def _args_pin(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", nargs="?", help=M_HELP)
    return _cmd_pin


def _args_unpin(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", help=M_HELP)
    return _cmd_unpin


def _args_stats(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    return _cmd_stats


_COMMANDS = {"prefetch": _args_prefetch, "ls": _args_ls, "verify": _args_verify, "gc": _args_gc, "pin": _args_pin,
             "unpin": _args_unpin, "stats": _args_stats}


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the arguments of ``command`` and the function that runs it."""
    parser.set_defaults(func=_COMMANDS[command](parser))
