"""The JIT's commands: ``warmset export|prefetch|list|publish`` and ``explain`` (the logic is in
``_release.warmset``, ``_nvcc.export`` (the ``--nvcc`` forms) and ``_jit.explain``). Modules that need ``xxhash`` are imported when a
command runs, so ``cubinstore --help`` and the other commands never import it."""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from cubinstore._core import knobs
from cubinstore._core.abi import IDENT_RE, WORD_RE
from cubinstore.cli import M_HELP
from cubinstore.cli._common import local_store
from cubinstore.errors import BadArgumentError

__all__ = ["add_arguments"]

_KEY_RE = re.compile(r"(xxh3:)?[0-9a-f]{32}", re.ASCII)
# A family point as the manifest spells one: identifier names (IDENT_RE), values ints of at most
# 64 bits or words (WORD_RE).
_INT_RE = re.compile(r"-?[0-9]{1,20}", re.ASCII)  # 20 digits hold 2**64; longer is never an int here
_INT_BOUND = 2**63
MAX_SINCE_DAYS = 36_500.0  # a century: any warm set is younger


def _since_days(text: str) -> float:
    """``--since-days``: a finite number of days in [0, MAX_SINCE_DAYS] (argparse reports the error)."""
    try:
        days = float(text)
    except ValueError:
        days = math.nan
    if not math.isfinite(days) or not 0 <= days <= MAX_SINCE_DAYS:
        raise argparse.ArgumentTypeError(f"expected a number of days in [0, {MAX_SINCE_DAYS:g}], got {text[:40]!r}")
    return days


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    """Give ``p`` the arguments of ``command`` (``warmset`` or ``explain``) and the function that runs it."""
    if command == "warmset":
        ws = p.add_subparsers(dest="warmset_command", metavar="ACTION", parser_class=type(p))
        ws.required = True
        e = ws.add_parser("export", help="write (or extend) a .bzl the family's BUILD.bazel loads to build the warm points; "
                                         "--nvcc: a Bazel package of the calls cubinstore-nvcc compiled")
        e.add_argument("--family", help="the family, e.g. axpy")
        e.add_argument("--nvcc", action="store_true",
                       help="export the calls cubinstore-nvcc compiled instead: --out DIR gets BUILD.bazel, "
                            "repositories.bzl, calls.json and srcs/")
        e.add_argument("--out", metavar="PATH", help="default kernels/<family>/warmset.bzl, or nvcc_warmset/ with "
                                                     "--nvcc (run from the workspace root)")
        e.add_argument("--since-days", type=_since_days, metavar="N", help="only points seen in the last N days")
        e.add_argument("--rules-repo", default="@cubinstore", metavar="REPO",
                       help="with --nvcc: the repository cubinstore's rules are loaded from (default @cubinstore)")
        e.set_defaults(func=_cmd_export)
        pub = ws.add_parser("publish", help="CI: upload the CUBINs Bazel built for `warmset export --nvcc`, under "
                                            "the calls' keys, to a remote cache")
        pub.add_argument("--nvcc", required=True, metavar="DIR", help="the folder `warmset export --nvcc` wrote")
        pub.add_argument("--bazel-bin", required=True, metavar="PATH", help="Bazel's bin folder (the workspace's bazel-bin)")
        pub.add_argument("--to", required=True, metavar="URL", help="the remote cache (HTTP CAS and action cache) to fill")
        pub.set_defaults(func=_cmd_publish)
        f = ws.add_parser("prefetch", help="fetch only the kernels of MANIFEST the warm set names")
        f.add_argument("manifest", help=M_HELP)
        f.add_argument("--remote", action="append", metavar="URL", help="HTTP CAS or oci://HOST/REPO registry to fetch from (before CUBINSTORE_REMOTE)")
        f.set_defaults(func=_cmd_prefetch)
        ls = ws.add_parser("list", help="every warm-set record")
        ls.set_defaults(func=_cmd_list)
        return
    if command != "explain":
        raise KeyError(command)
    p.add_argument("what", nargs="?", help="a JIT key (xxh3:<hex>) or a family name")
    p.add_argument("params", nargs="*", metavar="NAME=VALUE", help="the family point's parameters")
    p.add_argument("--manifest", help=f"for a family point: {M_HELP} (default CUBINSTORE_MANIFEST)")
    p.add_argument("--arch", help="for a family point: the arch asked for, e.g. sm_90a")
    p.add_argument("--nvcc", nargs=argparse.REMAINDER, metavar="ARG",
                   help="a cubinstore-nvcc call: every word after --nvcc is nvcc's arguments, as the library passed them "
                        "(run from the directory it ran in)")
    p.set_defaults(func=_cmd_explain)


def _cmd_export(args: argparse.Namespace) -> int:
    if args.nvcc:
        if args.family is not None or args.since_days is not None:
            raise BadArgumentError("warmset export --nvcc takes no --family or --since-days")
        return _cmd_export_nvcc(args)
    if args.family is None:
        raise BadArgumentError("warmset export: pass --family FAMILY (or --nvcc)")
    from cubinstore._release import warmset

    out = Path(args.out) if args.out else Path("kernels") / args.family / "warmset.bzl"
    since = int(time.time() - args.since_days * 86400) if args.since_days is not None else 0
    result = warmset.export(local_store(), args.family, out, since=since)
    print(f"exported {len(result.points)} warm points of {args.family} ({result.added} new) to {out}")
    if result.skipped_without_family:
        print(f"note: {result.skipped_without_family} JIT records name no family and cannot become Bazel targets", file=sys.stderr)
    return 0


def _cmd_export_nvcc(args: argparse.Namespace) -> int:
    from cubinstore._nvcc import export

    out = Path(args.out) if args.out else Path("nvcc_warmset")
    result = export.export(local_store(), out, rules_repo=args.rules_repo)
    for refused in result.refused:
        print(f"cubinstore: error: warmset export --nvcc: {refused}", file=sys.stderr)
    repos = len(result.repositories)
    print(f"exported {len(result.calls)} cubinstore-nvcc calls to {out} (include roots: {repos} "
          f"{'repository' if repos == 1 else 'repositories'}); build them with the target {export.TARGET_GROUP} "
          "of its package")
    print("\nWORKSPACE:\n" + "\n".join(result.workspace_lines()))
    print("\nor MODULE.bazel:\n" + "\n".join(result.module_lines()))
    return 1 if result.refused else 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from cubinstore._nvcc import export
    from cubinstore.store import Store
    from cubinstore.store.http import HttpLayer

    to = HttpLayer(args.to)
    store = Store([local_store(), to])
    report = export.publish(store, Path(args.nvcc), Path(args.bazel_bin))
    for skipped in report.skipped:
        print(f"cubinstore: warning: warmset publish: skipped {skipped}", file=sys.stderr)
    for failed in report.failed:
        print(f"cubinstore: error: warmset publish: {failed}", file=sys.stderr)
    print(f"published {len(report.published)} calls to {to.name}; {len(report.skipped)} skipped, "
          f"{len(report.failed)} uploads failed")
    return 1 if report.failed else 0


def _cmd_prefetch(args: argparse.Namespace) -> int:
    from cubinstore._release import warmset
    from cubinstore._release.refs import load_manifest
    from cubinstore.store import Store

    store = Store.from_env(extra_remotes=args.remote or (), strict=True)
    manifest = load_manifest(args.manifest, store)
    count, failures = warmset.prefetch(manifest, store, store.local)
    for failure in failures:
        print(f"cubinstore: error: {failure}", file=sys.stderr)
    if failures:
        print(f"cubinstore: error: warmset prefetch {manifest.digest}: {len(failures)} of {count} blobs failed", file=sys.stderr)
        return 1
    print(f"prefetched the warm set of {manifest.digest}: {count} of {len(manifest.blobs)} blobs")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from cubinstore._release import warmset

    for r in warmset.records(local_store()):
        name = (r.family or "jit") + "".join(f" {k}={v}" for k, v in sorted(r.params.items()))
        print(f"{r.kind:4}  {name}  {r.arch}  count {r.count}  key {('xxh3:' + r.key) if r.key else '-'}  "
              f"{r.digest or '-'}")
    return 0


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:37]!r}... ({len(text)} characters)"


def _value(name: str, text: str) -> str | int:
    """A NAME=VALUE's value as the manifest holds it: an int of at most 64 bits, or a word like 'f32'."""
    if _INT_RE.fullmatch(text):
        value = int(text)
        if -_INT_BOUND <= value < _INT_BOUND:
            return value
    elif WORD_RE.fullmatch(text) and len(text) <= 256 and not text.isdigit():
        return text
    raise BadArgumentError(f"explain: parameter {name}: expected an integer in [-2**63, 2**63) or a word like "
                           f"'f32' ([A-Za-z0-9_.+-]), got {_short(text)}")


def _cmd_explain(args: argparse.Namespace) -> int:
    if args.nvcc is not None:
        if args.what is not None or args.params or args.manifest or args.arch:
            raise BadArgumentError("explain --nvcc takes nvcc's arguments only, after --nvcc")
        if not args.nvcc:
            raise BadArgumentError("explain --nvcc: pass the nvcc call's arguments after --nvcc")
        from cubinstore._nvcc.explain import explain_call

        sys.stdout.write(explain_call(args.nvcc))
        return 0
    if args.what is None:
        raise BadArgumentError("explain: pass a JIT key, a family name, or --nvcc ARGS")
    if _KEY_RE.fullmatch(args.what):
        from cubinstore._jit.explain import explain_key
        from cubinstore._jit.index import JitIndex

        if args.params or args.manifest or args.arch:
            raise BadArgumentError("explain KEY takes no NAME=VALUE, --manifest or --arch")
        sys.stdout.write(explain_key(JitIndex(local_store(), knobs.lock_timeout()), args.what))
        return 0
    from cubinstore._jit.explain import explain_point
    from cubinstore._release.refs import load_manifest

    if not WORD_RE.fullmatch(args.what) or len(args.what) > 256:
        raise BadArgumentError(f"explain: expected a JIT key (xxh3:<32 hex>) or a family name like 'axpy', "
                               f"got {_short(args.what)}")
    if args.arch is not None:
        from cubinstore.manifest import parse_arch

        parse_arch(args.arch)  # BadArgumentError naming the spelling
    params: dict[str, str | int] = {}
    for item in args.params:
        name, sep, value = item.partition("=")
        if not sep or not IDENT_RE.fullmatch(name) or len(name) > 256:
            raise BadArgumentError(f"explain: expected NAME=VALUE with NAME an identifier, got {_short(item)}")
        if name in params:
            raise BadArgumentError(f"explain: parameter {name} is given twice")
        params[name] = _value(name, value)
    ref = args.manifest or knobs.manifest()
    if not ref:
        raise BadArgumentError("explain FAMILY: pass --manifest (or set CUBINSTORE_MANIFEST)")
    sys.stdout.write(explain_point(load_manifest(ref), args.what, params, args.arch))
    return 0
