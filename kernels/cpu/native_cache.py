"""Which folders and files a compiled native library may be loaded from.

Opening a shared library runs its constructors, so a library at a predictable path (the kernel
cache's names are a hash anyone can compute) must be one only this user could have put there.
For ``<root>/<sub>/<name>.so`` (``root``: the cache folder, e.g. ``PAGED_SERVE_CACHE``)::

    /  ...  parent-of-root      owned by this user or root; not writable by group or others,
                                unless sticky (as /tmp is: others cannot rename our entries)
    root, root/sub              owned by this user, not writable by group or others, no symlink
                                (the root itself may be one: its target is what is checked)
    name.so                     a regular file (no symlink) owned by this user, not writable by
                                group or others

``private_folder`` creates the missing folders 0700. A folder that fails the check is never
written to or read from; callers build into ``tempfile.mkdtemp`` instead. Limits: a check, not
a lock, so it trusts this user and root (either could swap a file between check and load), and
it reads modes only (no ACLs).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_MODE = 0o700
SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _own_problem(path: Path, st: os.stat_result, kind: str) -> str | None:
    """Why ``path`` (of ``st``) is not ours alone, or None."""
    if st.st_uid != os.geteuid():
        return f"{kind} {path} is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & SHARED_WRITE:
        return f"{kind} {path} is writable by group or others (mode {st.st_mode & 0o7777:o})"
    return None


def _components(root: Path, folder: Path) -> list[Path]:
    """``root`` resolved, then each folder from it down to ``folder`` (unresolved below root)."""
    real_root = root.resolve()
    below = folder.relative_to(root).parts
    return [real_root, *(real_root.joinpath(*below[: i + 1]) for i in range(len(below)))]


def private_folder(folder: Path, root: Path) -> str | None:
    """Create ``folder`` (under ``root``) and what is missing above it, each 0700; then check
    the chain (module docstring). Returns why it cannot be trusted, or None."""
    try:
        chain = _components(root, folder)
        top_down = [*reversed(chain[0].parents), *chain]
        for path in [p for p in top_down if not os.path.lexists(p)]:
            try:
                os.mkdir(path, PRIVATE_MODE)
            except FileExistsError:  # another process made it first: the check below decides
                continue
            os.chmod(path, PRIVATE_MODE)  # exactly 0700, whatever the umask
        for ancestor in chain[0].parents:
            st = os.stat(ancestor)
            if st.st_uid not in (0, os.geteuid()):
                return f"folder {ancestor} is owned by uid {st.st_uid}"
            if st.st_mode & SHARED_WRITE and not st.st_mode & stat.S_ISVTX:
                mode = st.st_mode & 0o7777
                return f"folder {ancestor} is writable by group or others (mode {mode:o})"
        for path in chain:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                return f"{path} is not a folder"
            problem = _own_problem(path, st, "folder")
            if problem is not None:
                return problem
    except OSError as error:
        return f"cannot prepare {folder}: {error}"
    return None


def file_problem(path: Path) -> str | None:
    """Why the existing ``path`` may not be loaded (module docstring), or None."""
    try:
        st = os.lstat(path)
    except OSError as error:
        return f"cannot inspect {path}: {error}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    return _own_problem(path, st, "file")
