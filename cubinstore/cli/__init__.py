"""The ``cubinstore`` command line.

Exit status: 0 success; 1 the operation failed or found a problem (missing or corrupt
blobs, unreachable remote); 2 bad usage (unknown flag, malformed digest, URL or size).
Failures print one line ``cubinstore: error: <reason>`` on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

from cubinstore._core import knobs as _env
from cubinstore._core.digest import Digest
from cubinstore._core.digest import verify
from cubinstore.store.local.files import open_regular
from cubinstore.store.layer import Layer
from cubinstore._core.log import get_logger
from cubinstore.errors import BadArgumentError, CubinstoreError, ManifestError
from cubinstore.manifest import MAX_MANIFEST_BYTES, Manifest, parse_arch
from cubinstore.store import DirectorySource, DiskCacheStore, LocalStore, MemoryStore, Store

if TYPE_CHECKING:
    from cubinstore.store.http import HttpStore

# Imported by the commands that need them, so that a process running another one never pays
# for them: _bundle (tarfile) by pack and unpack, _maint by verify, gc, pin and unpin, _http
# (http.client, email) by publish and remotes, _jitcli and _trustcli (the release-signing code)
# by their own commands and --help.

__all__ = ["main"]

_log = get_logger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block, so scripts can show the reason as is.
        raise _UsageError(f"{self.prog}: {message} (see --help)")


class _Progress:
    """A one-line progress bar on stderr (blobs, bytes, rate), only when stderr is a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.shown = False
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        if not self.enabled or total <= 0:
            return
        now = time.monotonic()
        if done < total and now - self.drawn < 0.1:  # at most 10 redraws a second
            return
        self.drawn = now
        width = 30
        filled = width * done // total
        rate = nbytes / max(now - self.started, 1e-6)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                          f"{_human(nbytes)} {_human(int(rate))}/s")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _parse_bytes(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = raw[-1:] if raw[-1:] in units and raw[-1:] else ""
    number = raw[: len(raw) - len(suffix)]
    if not number.isdigit():
        raise BadArgumentError(f"--max-bytes: expected a non-negative integer with optional K/M/G/T suffix, got {text!r}")
    return int(number) * units[suffix]


def _local() -> LocalStore:
    return LocalStore(_env.home())


def _usable(local: LocalStore, *, check: bool = False, create: bool = False) -> LocalStore:
    """``local``, once its root opens; ``check``: once the directories down to ``v1/cas`` that
    exist pass the ownership checks every write makes; ``create``: once they all exist (made
    here) and pass them. A store that cannot be used at all (its root a file, a directory
    others can write, a root that cannot be made) fails the command here, in one line naming
    the store and the cause, rather than once for every blob of a closure.
    """
    from cubinstore.store.local.root import StoreRoot

    with StoreRoot(local.root, allow_shared=_env.allow_shared_store()).dir("v1", "cas", create=create, check=check):
        pass
    return local


def _names(manifest: Manifest, digest: Digest) -> str:
    ids = manifest.ids_of(digest)  # one index per manifest: linear over the closure
    if ids:
        return ", ".join(ids)
    # Not a CUBIN: the source bundle of a family's JIT template (a manifest has a few).
    return ", ".join(f"{family} JIT sources" for family, t in manifest.jit_templates.items() if t.bundle == digest)


def _closure(manifest: Manifest, archs: set[str] | None) -> list[tuple[Digest, int]]:
    """The blobs of ``manifest`` a host of ``archs`` (None: every arch) needs, sorted by digest: the
    kernels' CUBINs, and the source bundle of each family JIT template that compiles for one of them."""
    blobs = {(k.digest, k.size) for k in manifest.kernels if archs is None or k.arch in archs}
    blobs.update((t.bundle, t.bundle_size) for t in manifest.jit_templates.values()
                 if archs is None or not t.archs or archs.intersection(t.archs))
    return sorted(blobs, key=lambda b: b[0].hex)


def _build_trees(ref: str) -> list[Path]:
    """The build trees a manifest path lies in: a ``bazel-bin`` above it, or ``bazel-out/<config>/bin``
    (the same tree reached by its real path). A digest or a channel names none."""
    if ref.startswith(("sha256:", "channel:")):
        return []
    path = Path(os.path.abspath(ref))
    return [parent for parent in path.parents
            if parent.name == "bazel-bin" or (parent.name == "bin" and parent.parent.parent.name == "bazel-out")]


def _with_build_trees(store: Store, ref: str) -> Store:
    """``store`` with the build tree of the manifest path ``ref`` searched after its local layers
    (memory, local store, disk cache) and before any remote. Whatever a build tree holds is
    verified like any layer's bytes (size, then sha256)."""
    trees = [DirectorySource(tree) for tree in _build_trees(ref) if tree.is_dir()]
    if not trees:
        return store
    layers = list(store.layers)
    at = next((i for i, layer in enumerate(layers) if not isinstance(layer, (MemoryStore, LocalStore, DiskCacheStore))),
              len(layers))
    return Store([*layers[:at], *trees, *layers[at:]], strict=store.strict, backfill=store.backfill)


def _archs(values: Sequence[str] | None) -> set[str] | None:
    if not values:
        return None
    archs = {a.strip() for value in values for a in value.split(",") if a.strip()}
    for arch in archs:
        parse_arch(arch)
    return archs


def _err(message: str) -> None:
    print(f"cubinstore: error: {message}", file=sys.stderr)


def _load_manifest(ref: str, store: Store | None = None, policy: str | None = None) -> Manifest:
    """A manifest from a ``sha256:`` digest (through ``store``), a ``channel:NAME`` (a signed
    release, verified against ``policy`` or ``CUBINSTORE_TRUST_POLICY``) or a path.

    A path is opened non-blocking and must be a regular file: a FIFO must not hang the CLI.
    """
    if ref.startswith("channel:"):
        from cubinstore.trust.channel import resolve_channel

        store = store if store is not None else Store.from_env()
        return Manifest.from_digest(resolve_channel(ref, store, policy), store)
    if ref.startswith("sha256:"):
        return Manifest.from_digest(ref, store if store is not None else Store.from_env())
    with open_regular(Path(ref), "manifest", ManifestError) as f:
        try:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise ManifestError(f"cannot read manifest {ref}: {exc.strerror or exc}") from exc
    return Manifest.from_bytes(raw, source=ref)


# -- commands -------------------------------------------------------------------------------------

def _cmd_prefetch(args: argparse.Namespace) -> int:
    from cubinstore._release.prefetch import fetch_blobs, without_memory

    store = _with_build_trees(Store.from_env(extra_remotes=args.remote or (), strict=True), args.manifest)
    local = store.local
    if local is None:  # from_env always adds one; kept for type checkers
        raise CubinstoreError("no local store configured")
    _usable(local, check=True)  # before the manifest: a sha256: reference reads the store too
    manifest = _load_manifest(args.manifest, store, args.policy)
    archs = _archs(args.arch)
    if archs is not None and not archs.intersection(manifest.archs):
        raise BadArgumentError(f"--arch {','.join(sorted(archs))}: manifest {manifest.digest} has archs {', '.join(manifest.archs)}")
    blobs = _closure(manifest, archs)
    _usable(local, create=True)  # every blob writes below v1/cas
    store = without_memory(store)
    before = store.stats
    progress = _Progress("prefetch")
    try:
        failures = fetch_blobs(store, blobs, names=lambda d: _names(manifest, d), jobs=_env.fetch_jobs(),
                               progress=progress)
    finally:
        progress.close()
    # Report the per-blob failures first: whatever fails after must not hide which kernels failed.
    for failure in failures:
        _err(failure)
    if failures:
        _err(f"prefetch {manifest.digest}: {len(failures)} of {len(blobs)} blobs failed")
    # Keep the manifest itself too, so `sha256:` references resolve offline.
    try:
        if local.status(manifest.digest, len(manifest.raw)) != "ok":
            local.write(manifest.digest, manifest.raw)
    except CubinstoreError as exc:
        _err(f"cannot store manifest {manifest.digest} in {local.root}: {exc}")
        return EXIT_FAILED
    if failures:
        return EXIT_FAILED
    after = store.stats
    print(
        f"prefetched {manifest.digest}: {len(blobs)} blobs, {after.misses - before.misses} downloaded "
        f"({_human(after.bytes_fetched - before.bytes_fetched)}), {after.hits - before.hits} already local, in {local.root}"
    )
    return EXIT_OK


def _cmd_ls(args: argparse.Namespace) -> int:
    manifest = _load_manifest(args.manifest)
    local = _usable(_local())
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

    local = _usable(_local())
    blobs = None
    if args.manifest:
        manifest = _load_manifest(args.manifest, Store([local]))
        blobs = list(manifest.blobs)
    report = verify_store(local, blobs)
    for digest, reason, moved in report.corrupt:
        print(f"corrupt {digest}: {reason}; quarantined to {moved}")
    for digest in report.missing:
        print(f"missing {digest}")
    for stray in report.strays:
        print(f"stray {stray} (ignored)")
    print(f"verified {report.checked} entries in {local.root}: {report.ok} ok, {len(report.corrupt)} corrupt, {len(report.missing)} missing")
    if report.failed:
        _err(f"verify: {len(report.corrupt)} corrupt and {len(report.missing)} missing entries in {local.root}")
        return EXIT_FAILED
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from cubinstore._release.maint import gc

    limit = _parse_bytes(args.max_bytes)
    local = _usable(_local())
    result = gc(local, limit)
    print(
        f"gc {local.root}: {_human(result.total_before)} -> {_human(result.total_after)}, evicted "
        f"{len(result.evicted)} entries, {_human(result.pinned_bytes)} pinned"
    )
    if result.total_after > limit:
        print(f"note: pinned entries alone exceed --max-bytes {limit}", file=sys.stderr)
    return EXIT_OK


def _cmd_pin(args: argparse.Namespace) -> int:
    from cubinstore._release.maint import pin, pinned

    local = _local()
    if not args.manifest:
        for manifest in pinned(local):
            print(f"{manifest.digest}  {len(manifest.kernels)} kernels")
        return EXIT_OK
    manifest = _load_manifest(args.manifest)
    pin(local, manifest)
    print(f"pinned {manifest.digest}")
    return EXIT_OK


def _cmd_unpin(args: argparse.Namespace) -> int:
    from cubinstore._release.maint import unpin

    ref = args.manifest
    digest = Digest.parse(ref) if ref.startswith("sha256:") else _load_manifest(ref).digest
    if not unpin(_local(), digest):
        _err(f"{digest} is not pinned in {_local().root}")
        return EXIT_FAILED
    print(f"unpinned {digest}")
    return EXIT_OK


def _cmd_pack(args: argparse.Namespace) -> int:
    from cubinstore._release.bundle import pack

    store = _with_build_trees(Store.from_env(extra_remotes=args.remote or ()), args.manifest)
    if store.local is not None:
        _usable(store.local)  # pack only reads it (and keeps what it fetches, if it can)
    manifest = _load_manifest(args.manifest, store)
    progress = _Progress("pack")
    try:
        size = pack(manifest, store, Path(args.out), progress=progress)
    finally:
        progress.close()
    print(f"packed {manifest.digest} ({len(manifest.blobs)} blobs, {_human(size)}) into {args.out}")
    return EXIT_OK


def _cmd_unpack(args: argparse.Namespace) -> int:
    from cubinstore._release.bundle import unpack

    expect = Digest.parse(args.expect) if args.expect else None
    local = _usable(_local(), check=True)  # created once the bundle has verified
    progress = _Progress("unpack")
    try:
        manifest = unpack(args.bundle, local, expect=expect, progress=progress, pin=args.pin)
    finally:
        progress.close()
    print(f"unpacked {manifest.digest} ({len(manifest.blobs)} blobs) into {local.root}")
    return EXIT_OK


def _publish_sources(args: argparse.Namespace) -> list[Layer]:
    sources: list[Layer] = [_local()]
    disk_cache = _env.disk_cache()
    if disk_cache is not None:
        sources.append(DiskCacheStore(disk_cache))
    dirs = [Path(d) for d in args.source or ()]
    # A manifest under bazel-bin/ names its build tree; found by content, not by label.
    dirs.extend(_build_trees(args.manifest))
    if Path("bazel-bin").is_dir():
        dirs.append(Path("bazel-bin"))
    unique: dict[str, Path] = {}  # one layer per directory however it was named (bazel-bin, its absolute path)
    for d in dirs:
        unique.setdefault(os.path.abspath(d), d)
    for directory in unique.values():
        if not directory.is_dir():
            raise BadArgumentError(f"--from {directory}: not a directory")
        sources.append(DiskCacheStore(directory) if (directory / "cas").is_dir() else DirectorySource(directory))
    return sources


def _cmd_publish(args: argparse.Namespace) -> int:
    from cubinstore.store.http import HttpStore

    remote = HttpStore(args.to)
    sources = Store(_publish_sources(args), backfill=False)
    channel = None
    if args.manifest.startswith("channel:"):
        *channel, manifest_digest = _channel_release(args.manifest, sources)
        manifest = Manifest.from_digest(manifest_digest, sources)
    else:
        manifest = _load_manifest(args.manifest, sources)
    from cubinstore._release.prefetch import run_each

    blobs = list(manifest.blobs)

    def upload(blob: tuple[Digest, int]) -> int:
        digest, size = blob
        remote.put(digest, sources.get(digest, size, name=_names(manifest, digest)))
        return size

    progress = _Progress("publish")
    try:  # CUBINSTORE_FETCH_JOBS uploads at once, each over a kept-alive connection
        results = run_each(blobs, upload, jobs=_env.fetch_jobs(), progress=progress)
    finally:
        progress.close()
    failures = [str(r) for r in results if isinstance(r, CubinstoreError)]
    uploaded = [blob for blob, r in zip(blobs, results) if not isinstance(r, CubinstoreError)]

    # The server may have accepted bytes it did not keep or mangled: read every blob back.
    def check(blob: tuple[Digest, int]) -> int:
        failure = _check_remote(remote, blob[0], blob[1], _names(manifest, blob[0]))
        if failure:
            raise CubinstoreError(failure)
        return blob[1]

    failures += [str(r) for r in run_each(uploaded, check, jobs=_env.fetch_jobs()) if isinstance(r, CubinstoreError)]
    for failure in failures:
        _err(failure)
    if failures:
        _err(f"publish {manifest.digest} to {remote.url}: {len(failures)} problems; manifest not uploaded")
        return EXIT_FAILED
    # The manifest goes last so a published manifest never references a missing blob.
    remote.put(manifest.digest, manifest.raw)
    failure = _check_remote(remote, manifest.digest, len(manifest.raw), "manifest")
    if failure:
        _err(failure)
        return EXIT_FAILED
    if channel is not None:
        return _publish_channel(remote, sources, manifest, *channel)
    print(f"published {manifest.digest} ({len(manifest.blobs)} blobs) to {remote.url}")
    return EXIT_OK


def _channel_release(ref: str, sources: Store) -> tuple[str, Digest, Digest, Digest]:
    """(channel, signature digest, record digest, manifest digest) of the release signed here last."""
    from cubinstore.trust.channel import ReleaseRecord, SignatureBlob, channel_name, local_pointer

    name = channel_name(ref[len("channel:"):])
    pointer = local_pointer(_local(), name)
    if pointer is None:
        raise BadArgumentError(f"channel:{name}: nothing signed here; run `cubinstore sign MANIFEST --channel {name} ...` first")
    signature = SignatureBlob.from_bytes(sources.get(pointer, name=f"signature of channel {name}"), source=str(pointer))
    record = ReleaseRecord.from_bytes(sources.get(signature.record, name=f"record of channel {name}"), source=str(signature.record))
    return name, pointer, record.digest, record.manifest


def _publish_channel(remote: HttpStore, sources: Store, manifest: Manifest, name: str, pointer: Digest,
                     record: Digest) -> int:
    # Record and signature before the pointer, so a published pointer never names a missing blob.
    for digest, what in ((record, "release record"), (pointer, "signature")):
        data = sources.get(digest, name=f"{what} of channel {name}")
        remote.put(digest, data)
        failure = _check_remote(remote, digest, len(data), f"{what} of channel {name}")
        if failure:
            _err(failure)
            return EXIT_FAILED
    remote.put_named(f"channels/{name}", f"{pointer}\n".encode())
    back = remote.get_named(f"channels/{name}", 4096)
    if back is None or back.strip() != str(pointer).encode():
        _err(f"channel pointer {remote.url}/channels/{name} reads back as {back!r}, expected {pointer}")
        return EXIT_FAILED
    print(f"published channel {name} ({pointer}) with manifest {manifest.digest} ({len(manifest.blobs)} blobs) to {remote.url}")
    return EXIT_OK


def _check_remote(remote: HttpStore, digest: Digest, size: int, name: str) -> str | None:
    try:
        data = remote.read(digest, size)
        if data is None:
            return f"{digest} ({name}) is missing from {remote.url} after upload"
        verify(data, digest, size, where=remote.blob_url(digest), name=name)
    except CubinstoreError as exc:
        return f"{digest} ({name}) failed re-verification after upload: {exc}"
    return None


def _cmd_stats(args: argparse.Namespace) -> int:
    local = _usable(_local())
    counts = local.read_stats()
    entries, _ = local.scan()
    for key, value in counts.items():
        print(f"{key} {value}")
    print(f"entries {len(entries)}")
    print(f"bytes {sum(e.size for e in entries)}")
    print(f"root {local.root}")
    return EXIT_OK


_CORE_COMMANDS = frozenset({"prefetch", "ls", "verify", "gc", "pin", "unpin", "pack", "unpack", "publish", "stats"})


def _parser(*, extras: bool = True) -> _Parser:
    """The argument parser; ``extras=False`` leaves out the JIT's and the signer's commands (and their imports)."""
    parser = _Parser(prog="cubinstore", description="Content-addressed store of compiled CUDA kernels.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    m_help = "manifest path, sha256:<hex> digest, or channel:NAME (a signed release)"

    p = sub.add_parser("prefetch", help="fill the local store with a manifest's closure")
    p.add_argument("manifest", help=m_help)
    p.add_argument("--remote", action="append", metavar="URL", help="HTTP CAS to fetch from (before CUBINSTORE_REMOTE)")
    p.add_argument("--arch", action="append", metavar="ARCH", help="only kernels of this arch (repeatable, or comma-separated)")
    p.add_argument("--policy", metavar="FILE", help="trust policy for channel:NAME (default CUBINSTORE_TRUST_POLICY)")
    p.set_defaults(func=_cmd_prefetch)

    p = sub.add_parser("ls", help="list a manifest's kernels and their local state")
    p.add_argument("manifest", help=m_help)
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("verify", help="re-hash the local store (or a manifest's closure), quarantine corrupt entries")
    p.add_argument("manifest", nargs="?", help=m_help)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("gc", help="evict least recently used unpinned entries")
    p.add_argument("--max-bytes", required=True, metavar="N", help="target size, e.g. 1000000 or 10G")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser("pin", help="protect a manifest's closure from gc (no argument: list pins)")
    p.add_argument("manifest", nargs="?", help=m_help)
    p.set_defaults(func=_cmd_pin)

    p = sub.add_parser("unpin", help="remove a pin")
    p.add_argument("manifest", help=m_help)
    p.set_defaults(func=_cmd_unpin)

    p = sub.add_parser("pack", help="bundle a manifest and its CUBINs into a tar for offline hosts")
    p.add_argument("manifest", help=m_help)
    p.add_argument("out", metavar="OUT.tar")
    p.add_argument("--remote", action="append", metavar="URL", help="HTTP CAS to fetch missing blobs from")
    p.set_defaults(func=_cmd_pack)

    p = sub.add_parser("unpack", help="verify a bundle and add it to the local store")
    p.add_argument("bundle", metavar="BUNDLE.tar")
    p.add_argument("--expect", metavar="DIGEST", help="reject the bundle unless its manifest has this digest")
    p.add_argument("--pin", action="store_true", help="pin the unpacked manifest")
    p.set_defaults(func=_cmd_unpack)

    p = sub.add_parser("publish", help="upload a manifest and its closure to an HTTP CAS, then re-verify")
    p.add_argument("manifest", help=m_help)
    p.add_argument("--to", required=True, metavar="URL", help="HTTP CAS base URL (PUT <URL>/cas/<hex>)")
    p.add_argument("--from", dest="source", action="append", metavar="DIR",
                   help="where to find blobs: a build tree (bazel-bin) or a Bazel disk cache (repeatable)")
    p.set_defaults(func=_cmd_publish)

    p = sub.add_parser("stats", help="hits, misses, bytes fetched and verification failures of the local store")
    p.set_defaults(func=_cmd_stats)

    if not extras:
        return parser
    # warmset export|prefetch|list and explain: the JIT's commands, defined beside their logic.
    from cubinstore.cli import jit as _jitcli

    _jitcli.add_parsers(sub, m_help)

    # keygen and sign: the signer's side of release channels (_trust), defined beside their logic.
    from cubinstore.cli import trust as _trustcli

    _trustcli.add_parsers(sub, m_help, _load_manifest, _local)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = _parser(extras=command not in _CORE_COMMANDS)
    try:
        args = parser.parse_args(args_list)
    except _UsageError as exc:
        _err(str(exc))
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="cubinstore: %(levelname)s: %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except BadArgumentError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except CubinstoreError as exc:
        _err(str(exc))
        return EXIT_FAILED
    except OSError as exc:  # e.g. OUT.tar's directory missing; still one line, not a traceback
        _err(f"{exc.filename or ''}{': ' if exc.filename else ''}{exc.strerror or exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        # `cubinstore ls | head`: the reader left; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
