"""The signer's side of release channels: Ed25519 keys (made, loaded, checked for their mode) and
`sign_release`, which stores a record and its signature in the local CAS and moves the local
channel pointer (the state file, under its lock) to them."""

from __future__ import annotations

import base64
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cubinstore._core.digest import Digest
from cubinstore.errors import RollbackError, TrustError
from cubinstore._core.userfile import open_regular
from cubinstore.trust.channel import read_state, write_state
from cubinstore.trust.records import (
    MAX_SMALL_BLOB,
    PUBLIC_PREFIX,
    ChannelState,
    ReleaseRecord,
    SignatureBlob,
    channel_name,
    check_version,
    crypto,
    key_id,
)

if TYPE_CHECKING:
    from cubinstore.store.local.cas import LocalLayer

__all__ = ["generate_key", "public_line", "sign_release"]


def generate_key() -> tuple[bytes, str]:
    """A new Ed25519 private key as PEM (PKCS#8, unencrypted) and its public key line for a policy."""
    ed25519, serialization, _ = crypto()
    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return pem, PUBLIC_PREFIX + base64.b64encode(public).decode("ascii")


def _check_key_mode(path: Path, mode: int) -> None:
    """A private key others can read is a key others may have copied: refuse to sign with it."""
    if os.name != "nt" and mode & 0o077:
        raise TrustError(f"signing key {path}: mode {stat.S_IMODE(mode):04o} lets group or others access it, "
                         f"expected 0600 (owner only); run `chmod 600 {path}` (and replace the key if others read it)")


def _load_private(path: Path) -> Any:
    ed25519, serialization, _ = crypto()
    with open_regular(path, "signing key", TrustError) as f:
        _check_key_mode(path, os.fstat(f.fileno()).st_mode)
        pem = f.read(MAX_SMALL_BLOB + 1)
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TrustError(f"signing key {path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise TrustError(f"signing key {path}: expected an Ed25519 key, got {type(key).__name__}")
    return key


def public_line(path: Path) -> tuple[str, str]:
    """(``ed25519:<base64>``, key id) of the private key file at ``path``."""
    _, serialization, _ = crypto()
    public = _load_private(path).public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PUBLIC_PREFIX + base64.b64encode(public).decode("ascii"), key_id(public)


def sign_release(local: LocalLayer, manifest: Digest, key_path: Path, channel: str, version: int,
                 expires_in: float) -> tuple[ReleaseRecord, SignatureBlob]:
    """Sign ``manifest`` as ``channel`` version ``version``; store record and signature in ``local``'s
    CAS and point the local channel at them. Refuses a version not above the one signed here last."""
    _, serialization, _ = crypto()
    channel = channel_name(channel)
    version = check_version(version, f"--version of channel {channel}")
    private = _load_private(key_path)
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    kid = key_id(public)
    record = ReleaseRecord.build(channel, version, manifest, int(time.time() + expires_in), kid)
    signature = SignatureBlob.build(record, kid, private.sign(record.raw))
    with local.file_lock(("channels",), f"{channel}.lock", what=f"channel {channel}"):
        state = read_state(local, channel)
        top = state.floor(None) if state is not None else None
        if top is not None and top[1].version >= version:
            raise RollbackError(f"channel {channel}: version {version} is not above version {top[1].version}, "
                                f"the last one signed or accepted in {local.root}; sign a higher version")
        local.write(record.digest, record.raw)
        local.write(signature.digest, signature.raw)
        write_state(local, (state or ChannelState(channel, {})).with_release(kid, version, signature.digest))
    return record, signature
