"""The key that signs checkpoint listings, kept outside every checkpoint folder.

Resuming runs code a checkpoint carries (torch's DCP reader unpickles `.metadata`), and the sha256 listing sits in
the same folder as the files it lists: whoever can rewrite a file can rewrite its digest. So the listing is signed
with HMAC-SHA256 (RFC 2104) under a secret only this installation holds; a checkpoint whose listing's signature
checks was written by a run holding the key, and its digests then vouch for every file.

The key file is 32 random bytes (the output size of SHA-256: RFC 2104 section 3 recommends a key no shorter),
made on the first save with mode 0600: $ZEROPIPE_CHECKPOINT_KEY if set (one key file shared by several machines),
else $XDG_CONFIG_HOME/zeropipe/checkpoint.key, else ~/.config/zeropipe/checkpoint.key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from cost_models.records.errors import ConfigError

KEY_ENV = "ZEROPIPE_CHECKPOINT_KEY"
KEY_BYTES = 32
KEY_FILE_MAX = 4096   # bytes: far past any key (HMAC takes keys of any length, RFC 2104 section 2)


def key_path() -> Path:
    """Where this installation's key lives (it may not exist yet)."""
    named = os.environ.get(KEY_ENV)
    if named:
        return Path(named).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "zeropipe" / "checkpoint.key"


def load_key(path: Path) -> bytes | None:
    """The key at `path`, or None when there is none. Refused, as ssh refuses a private key others can read
    (ssh(1), FILES: "not accessible by others"), when it is not a regular file or its mode lets other users read or
    write it: whoever can read the key can sign a checkpoint that --resume then runs code from."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the checkpoint key {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"the checkpoint key {path} is not a regular file; point {KEY_ENV} at a key file, or unset "
                          f"it to use this installation's own")
    if st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        raise ConfigError(f"the checkpoint key {path} is accessible to other users (mode {mode:04o}): anyone who can "
                          f"read it can sign checkpoints; chmod 600 {path}")
    if st.st_size > KEY_FILE_MAX:   # the whole file is the key: refuse a file far past any key rather than cut it
        raise ConfigError(f"the checkpoint key {path} is {st.st_size:,} bytes, more than a key file holds "
                          f"({KEY_FILE_MAX:,} at most); point {KEY_ENV} at the key file")
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the checkpoint key {path}: {exc.strerror}") from None
    if len(key) < KEY_BYTES:
        raise ConfigError(f"the checkpoint key {path} holds {len(key)} bytes, a key needs {KEY_BYTES}; remove it to "
                          f"have a new one made (checkpoints signed with the old one then need --trust-checkpoint)")
    return key


def load_or_create_key(path: Path) -> bytes:
    """The key at `path`, made first if there is none: written to a private temporary file, then linked into place
    (link never replaces an existing file, so two processes making it at once end up with the same key)."""
    key = load_key(path)
    if key is not None:
        return key
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass             # another process made it first: use theirs
    except OSError as exc:
        raise ConfigError(f"cannot create the checkpoint signing key {path}: {exc.strerror}; set {KEY_ENV} to a "
                          f"file in a writable place") from None
    finally:
        tmp.unlink(missing_ok=True)
    key = load_key(path)
    assert key is not None
    return key


def sign(data: bytes, key: bytes) -> str:
    """Hex HMAC-SHA256 of `data`."""
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def key_id(key: bytes) -> str:
    """A key's public name: 16 hex digits of its sha256 (a one-way hash of 32 random bytes gives nothing of the key
    away). A signature file records it beside the HMAC, so a listing that no longer matches its signature is told
    apart from one another installation signed."""
    return hashlib.sha256(key).hexdigest()[:16]


def signature_line(data: bytes, key: bytes) -> str:
    """What a signature file holds: the HMAC of `data`, then "key:" and key_id."""
    return f"{sign(data, key)} key:{key_id(key)}"


def verify(data: bytes, signature: str, key: bytes) -> bool:
    """`signature` (a signature_line, or a bare HMAC as older files hold) is `data`'s under `key` (compared in
    constant time)."""
    mac = signature.split()[0] if signature.split() else ""
    return hmac.compare_digest(sign(data, key).encode(), mac.encode())


def signed_by(signature: str, key: bytes) -> bool:
    """Whether a signature line names `key` (older, bare signatures name none)."""
    return f"key:{key_id(key)}" in signature.split()[1:]
