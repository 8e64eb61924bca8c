"""Whom the plan cache trusts: the checks on its directory and entries, and the secret that
signs them.

A plan-cache entry holds a pickle, and loading a pickle runs whatever code it names. So an
entry is loaded only when this user (or, in a team cache, the team) wrote it, and that is
checked twice (NOTE [Who the plan cache trusts]): by where it lies (owners and permissions, as
ssh and git check theirs) and by what it says (an HMAC-SHA256 over the entry made with a secret
no one else can read).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from zerofx.config.options import CacheTrust, plan_cache_key_file

# NOTE [Who the plan cache trusts]
# The cache's directory comes from the config, ``ZEROFX_PLAN_CACHE`` or ``XDG_CACHE_HOME``, and
# on clusters those often name shared places. Anyone who can write an entry there could run code
# in every rank of the next job that loads it. Two guards, both required before an entry is
# unpickled:
#
# 1. Where it lies. With ``plan_cache_trust: "private"`` (the default) the directory and each
#    entry are owned by the current user and writable by no one else, and no directory above
#    it is writable by its group or others without the sticky bit, which would let them swap
#    the directory itself: the rules of ssh's StrictModes and git's safe.directory. A directory that fails this is not read or written; one
#    ``PlanCacheWarning`` says why, and the program is built. An entry that fails it (another
#    owner, group- or world-writable, a symbolic link, not a regular file) is rebuilt and
#    written over. ``"group"`` is the explicit opt-in to a team cache: the directory and its
#    entries may belong to any member and be group-writable, never world-writable.
# 2. What it says. Every entry carries an HMAC-SHA256 of its header and payload, keyed with a
#    secret of 32 random bytes in ``plan_cache_key_file`` (``~/.config/zerofx/plan-cache.key``),
#    made on first use with permissions 0600 and refused when anyone else can read or write it
#    (in a team cache, the group may read it). An entry whose signature does not verify was
#    written by someone without the secret (or with another one): it is rebuilt, never loaded.
#
# HMAC rather than a pickle-free format: an entry also holds the call's non-tensor values, the
# plan's data classes and torch's tree specs, each of which would need a schema of its own to
# be stored as inert data; the signature gives the same guarantee (only a holder of the secret
# wrote this) for every field at once. The SHA-256 in the header stays: it tells a damaged
# entry (a killed write, a flipped byte) from a forged one.

SECRET_BYTES = 32


class UntrustedCacheError(Exception):
    """The cache's directory or secret may not be trusted; the message says why."""


def _writable_by_others(mode: int, *, group_too: bool) -> bool:
    mask = stat.S_IWOTH | (stat.S_IWGRP if group_too else 0)
    return bool(mode & mask) and not mode & stat.S_ISVTX


def check_directory(directory: Path, trust: CacheTrust) -> Path:
    """``directory``, made when missing (0700, or 0770 for a team cache), resolved; raises
    ``UntrustedCacheError`` when it or a directory above it may be written by others
    (NOTE [Who the plan cache trusts])."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700 if trust is CacheTrust.PRIVATE else 0o770)
    resolved = directory.resolve()
    me = os.geteuid()
    st = os.stat(resolved)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedCacheError(f"{resolved} is not a directory")
    if st.st_mode & stat.S_IWOTH:
        raise UntrustedCacheError(f"{resolved} is writable by every user (mode {stat.filemode(st.st_mode)})")
    if trust is CacheTrust.PRIVATE:
        if st.st_uid != me:
            raise UntrustedCacheError(f"{resolved} is owned by uid {st.st_uid}, not by this user (uid {me})")
        if st.st_mode & stat.S_IWGRP:
            raise UntrustedCacheError(f"{resolved} is writable by its group (mode {stat.filemode(st.st_mode)})")
    for parent in resolved.parents:
        pst = os.stat(parent)
        if _writable_by_others(pst.st_mode, group_too=trust is CacheTrust.PRIVATE):
            raise UntrustedCacheError(f"{parent}, above {resolved}, may be written by others without the sticky bit (mode "
                                      f"{stat.filemode(pst.st_mode)}), who could replace the cache directory")
    return resolved


def entry_problem(st: os.stat_result, trust: CacheTrust) -> str | None:
    """Why an entry with status ``st`` (``os.fstat`` of the opened file) may not be loaded; None when it may."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_mode & stat.S_IWOTH:
        return f"writable by every user (mode {stat.filemode(st.st_mode)})"
    if trust is CacheTrust.PRIVATE:
        if st.st_uid != os.geteuid():
            return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        if st.st_mode & stat.S_IWGRP:
            return f"writable by its group (mode {stat.filemode(st.st_mode)})"
    return None


def read_entry_file(path: Path, trust: CacheTrust) -> bytes:
    """The bytes of the entry at ``path``, opened without following a symbolic link and checked
    on the opened file (so it cannot be swapped between check and read). Raises
    ``FileNotFoundError`` when there is none, ``UntrustedCacheError`` when it may not be loaded."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if path.is_symlink():
            raise UntrustedCacheError("a symbolic link") from exc
        raise
    with os.fdopen(fd, "rb") as f:
        problem = entry_problem(os.fstat(f.fileno()), trust)
        if problem is not None:
            raise UntrustedCacheError(problem)
        return f.read()


def _key_file_problem(st: os.stat_result, trust: CacheTrust) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if trust is CacheTrust.PRIVATE and st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user"
    shared = stat.S_IRWXO | (stat.S_IRWXG if trust is CacheTrust.PRIVATE else stat.S_IWGRP)
    if st.st_mode & shared:
        return f"may be read or written by others (mode {stat.filemode(st.st_mode)}; chmod 600 it)"
    return None


def load_secret(key_file: Path | None, trust: CacheTrust) -> bytes:
    """The secret entries are signed with, from ``key_file`` (default: ``plan_cache_key_file``'s),
    made there on first use (0600, 0640 in a team cache). Raises ``UntrustedCacheError`` when the
    file may be read or written by others, or holds too few bytes."""
    path = Path(key_file) if key_file is not None else plan_cache_key_file(None)
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-cache-key.")
        try:
            os.fchmod(fd, 0o600 if trust is CacheTrust.PRIVATE else 0o640)
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)  # fails when another process made it first: theirs is the secret
            except FileExistsError:
                pass
        finally:
            Path(tmp).unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise UntrustedCacheError(f"the key file {path} cannot be read ({exc})") from exc
    with os.fdopen(fd, "rb") as f:
        problem = _key_file_problem(os.fstat(f.fileno()), trust)
        if problem is not None:
            raise UntrustedCacheError(f"the key file {path} {problem}")
        secret = f.read()
    if len(secret) < SECRET_BYTES // 2:
        raise UntrustedCacheError(f"the key file {path} holds {len(secret)} bytes, fewer than {SECRET_BYTES // 2}")
    return secret


def signature(secret: bytes, header: bytes, payload: bytes) -> str:
    """The HMAC-SHA256 of an entry's header line and payload, in hex."""
    mac = hmac.new(secret, header, hashlib.sha256)
    mac.update(b"\n")
    mac.update(payload)
    return mac.hexdigest()


def verify(secret: bytes, header: bytes, payload: bytes, stated: bytes) -> bool:
    """Whether ``stated`` is the entry's signature (compared in constant time)."""
    return hmac.compare_digest(signature(secret, header, payload).encode(), stated)
