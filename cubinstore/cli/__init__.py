"""The ``cubinstore`` command line: a table of commands, each defined in the module of its group.

Exit status: 0 success; 1 the operation failed or found a problem (missing or corrupt
blobs, unreachable remote); 2 bad usage (unknown flag, malformed digest, URL or size).
Failures print one line ``cubinstore: error: <reason>`` on stderr.

Only the module of the command that runs is imported (``--help`` imports none): a process
running ``ls`` never pays for tarfile (pack, unpack), http.client (publish, remotes), the
JIT's xxhash or the signer's cryptography.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NoReturn

from cubinstore.errors import BadArgumentError, CubinstoreError

__all__ = ["COMMANDS", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "M_HELP", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

M_HELP = ("manifest path, sha256:<hex> digest, channel:NAME (a signed release), or a release in a registry "
          "(oci://HOST[:PORT]/REPO@sha256:<hex> or :TAG; oci+http://, oci+https://, oci-layout:)")


def _store_commands() -> ModuleType:
    from cubinstore.cli import store

    return store


def _release_commands() -> ModuleType:
    from cubinstore.cli import release

    return release


def _jit_commands() -> ModuleType:
    from cubinstore.cli import jit

    return jit


def _trust_commands() -> ModuleType:
    from cubinstore.cli import trust

    return trust


# name -> (the module of its group, one-line summary), in the order --help lists them. A group
# module's add_arguments(name, parser) fills in the command's arguments and sets its function.
COMMANDS: dict[str, tuple[Callable[[], ModuleType], str]] = {
    "prefetch": (_store_commands, "fill the local store with a manifest's closure"),
    "ls": (_store_commands, "list a manifest's kernels and their local state"),
    "verify": (_store_commands, "re-hash the local store (or a manifest's closure), quarantine corrupt entries"),
    "gc": (_store_commands, "evict least recently used unpinned entries"),
    "pin": (_store_commands, "protect a manifest's closure from gc (no argument: list pins)"),
    "unpin": (_store_commands, "remove a pin"),
    "pack": (_release_commands, "bundle a manifest and its CUBINs into a tar for offline hosts"),
    "unpack": (_release_commands, "verify a bundle and add it to the local store"),
    "publish": (_release_commands, "upload a manifest and its closure to an HTTP CAS, then re-verify"),
    "stats": (_store_commands, "hits, misses, bytes fetched and verification failures of the local store"),
    "warmset": (_jit_commands, "points met at run time that no release had: list, export for Bazel, publish, prefetch"),
    "explain": (_jit_commands,
                "why a JIT key or a family point missed: its parts and what differs from the nearest entry"),
    "keygen": (_trust_commands, "make an Ed25519 signing key (PEM, mode 0600) and print its public key"),
    "sign": (_trust_commands,
             "sign a manifest as a channel's release (record and signature go to the local CAS)"),
}


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block, so scripts can show the reason as is.
        raise UsageError(f"{self.prog}: {message} (see --help)")


def err(message: str) -> None:
    """Print the one-line failure reason on stderr."""
    print(f"cubinstore: error: {message}", file=sys.stderr)


def _parser(command: str | None) -> Parser:
    """The argument parser; only ``command``'s arguments are filled in (and its module imported)."""
    parser = Parser(prog="cubinstore", description="Content-addressed store of compiled CUDA kernels.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name, (group, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary)
        if name == command:
            group().add_arguments(name, p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = _parser(command)
    try:
        args = parser.parse_args(args_list)
    except UsageError as exc:
        err(str(exc))
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="cubinstore: %(levelname)s: %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except BadArgumentError as exc:
        err(str(exc))
        return EXIT_USAGE
    except CubinstoreError as exc:
        err(str(exc))
        return EXIT_FAILED
    except OSError as exc:  # e.g. OUT.tar's directory missing; still one line, not a traceback
        err(f"{exc.filename or ''}{': ' if exc.filename else ''}{exc.strerror or exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except BrokenPipeError:
        # `cubinstore ls | head`: the reader left; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
