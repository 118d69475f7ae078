"""``cubinstore keygen`` and ``cubinstore sign``: the signer's side of release channels (``trust.sign``)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path

from cubinstore._release.refs import load_manifest
from cubinstore.cli import M_HELP
from cubinstore.cli._common import local_store
from cubinstore.errors import BadArgumentError, StoreError
from cubinstore.trust.records import channel_name, format_time
from cubinstore.trust.sign import generate_key, public_line, sign_release

__all__ = ["add_arguments", "parse_duration"]

_DURATION_RE = re.compile(r"(\d+)([smhd])", re.ASCII)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """``90s``, ``15m``, ``12h``, ``7d`` -> seconds (positive)."""
    match = _DURATION_RE.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise BadArgumentError(f"--expires-in: expected a positive duration like 12h or 7d, got {text!r}")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _cmd_keygen(args: argparse.Namespace) -> int:
    out = Path(args.out)
    pem, public = generate_key()
    try:
        # O_EXCL: never overwrite a key; 0600: a private key is readable by its owner only.
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        raise BadArgumentError(f"{out} exists; refusing to overwrite a key") from None
    except OSError as exc:
        raise StoreError(f"cannot create {out}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    _, kid = public_line(out)
    print(f"wrote private key {out}")
    print(f"public key {public}")
    print(f"key id {kid}")
    return 0


def _cmd_sign(args: argparse.Namespace) -> int:
    channel = channel_name(args.channel)
    public_line(Path(args.key))  # the key first (mode 0600, Ed25519): nothing is written for a key refused
    manifest = load_manifest(args.manifest)
    store = local_store()
    store.write(manifest.digest, manifest.raw)  # so `publish channel:NAME` finds it by digest
    record, signature = sign_release(store, manifest.digest, Path(args.key), channel, args.version,
                                     parse_duration(args.expires_in))
    print(f"signed channel {channel} version {record.version}: manifest {record.manifest}, record {record.digest}, "
          f"signature {signature.digest}, key {record.key}, expires {format_time(record.expires)}")
    return 0


def _args_keygen(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("out", metavar="KEY.pem")
    return _cmd_keygen


def _args_sign(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    p.add_argument("manifest", help=M_HELP)
    p.add_argument("--key", required=True, metavar="KEY.pem", help="Ed25519 private key (from `cubinstore keygen`)")
    p.add_argument("--channel", required=True, metavar="NAME", help="release channel, e.g. prod")
    p.add_argument("--version", required=True, type=int, metavar="N", help="release version: above every earlier one")
    p.add_argument("--expires-in", default="7d", metavar="DURATION",
                   help="how long the record is valid (default 7d); clients refuse it afterwards")
    return _cmd_sign


_COMMANDS = {"keygen": _args_keygen, "sign": _args_sign}


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the arguments of ``command`` and the function that runs it."""
    parser.set_defaults(func=_COMMANDS[command](parser))
