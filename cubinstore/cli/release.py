"""The release commands: ``pack`` and ``unpack`` (a tar for offline hosts) and ``publish`` (to an HTTP CAS
or, as one OCI artifact, to a registry).

The logic is in ``_release.bundle`` and ``_release.publish``; this module parses and prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from cubinstore._core.digest import Digest
from cubinstore.cli import EXIT_FAILED, EXIT_OK, M_HELP, err
from cubinstore.cli._common import Progress, human, local_store, usable

__all__ = ["add_arguments"]

# _release.bundle (tarfile) is imported by pack and unpack, _release.publish (http.client, the
# upload pool) by publish.


def _cmd_pack(args: argparse.Namespace) -> int:
    from cubinstore._release.bundle import pack
    from cubinstore._release.refs import load_manifest, with_build_trees
    from cubinstore.store import Store

    store = with_build_trees(Store.from_env(extra_remotes=args.remote or ()), args.manifest)
    if store.local is not None:
        usable(store.local)  # pack only reads it (and keeps what it fetches, if it can)
    manifest = load_manifest(args.manifest, store)
    progress = Progress("pack")
    try:
        size = pack(manifest, store, Path(args.out), progress=progress)
    finally:
        progress.close()
    print(f"packed {manifest.digest} ({len(manifest.blobs)} blobs, {human(size)}) into {args.out}")
    return EXIT_OK


def _cmd_unpack(args: argparse.Namespace) -> int:
    from cubinstore._release.bundle import unpack

    expect = Digest.parse(args.expect) if args.expect else None
    local = usable(local_store(), check=True)  # created once the bundle has verified
    progress = Progress("unpack")
    try:
        manifest = unpack(args.bundle, local, expect=expect, progress=progress, pin=args.pin)
    finally:
        progress.close()
    print(f"unpacked {manifest.digest} ({len(manifest.blobs)} blobs) into {local.root}")
    return EXIT_OK


def _cmd_publish(args: argparse.Namespace) -> int:
    from cubinstore._release.publish import publish

    progress = Progress("publish")
    try:
        result = publish(args.manifest, args.to, args.source or (), local=local_store(), progress=progress)
    finally:
        progress.close()
    for problem in result.problems:
        err(problem)
    if not result.ok:
        return EXIT_FAILED
    manifest = result.manifest
    if result.artifact is not None:
        counts = f"{len(manifest.blobs)} blobs, {result.uploaded} uploaded, {result.present} already there"
        channel = f" and channel {result.channel} ({result.pointer})" if result.channel is not None else ""
        tag = f" tagged {result.tag}" if result.tag else ""
        print(f"published {manifest.digest} ({counts}){channel} to {result.url}{tag} as artifact {result.artifact}")
        # The pinned reference alone on the last line: what `cubinstore.open` and `prefetch` take.
        print(f"{result.url}@{result.artifact}")
        return EXIT_OK
    if result.channel is not None:
        print(f"published channel {result.channel} ({result.pointer}) with manifest {manifest.digest} "
              f"({len(manifest.blobs)} blobs) to {result.url}")
    else:
        print(f"published {manifest.digest} ({len(manifest.blobs)} blobs) to {result.url}")
    return EXIT_OK


def _args_pack(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", help=M_HELP)
    p.add_argument("out", metavar="OUT.tar")
    p.add_argument("--remote", action="append", metavar="URL",
                   help="HTTP CAS or registry (oci://HOST/REPO) to fetch missing blobs from")
    return _cmd_pack


def _args_unpack(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("bundle", metavar="BUNDLE.tar")
    p.add_argument("--expect", metavar="DIGEST", help="reject the bundle unless its manifest has this digest")
    p.add_argument("--pin", action="store_true", help="pin the unpacked manifest")
    return _cmd_unpack


def _args_publish(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", help=M_HELP)
    p.add_argument("--to", required=True, metavar="URL",
                   help="HTTP CAS base URL (PUT <URL>/cas/<hex>), or a registry repository oci://HOST[:PORT]/REPO[:TAG]")
    p.add_argument("--from", dest="source", action="append", metavar="DIR",
                   help="where to find blobs: a build tree (bazel-bin), a Bazel disk cache, or a remote URL "
                        "(http://, oci://) (repeatable)")
    return _cmd_publish


_COMMANDS = {"pack": _args_pack, "unpack": _args_unpack, "publish": _args_publish}


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the arguments of ``command`` and the function that runs it."""
    parser.set_defaults(func=_COMMANDS[command](parser))
