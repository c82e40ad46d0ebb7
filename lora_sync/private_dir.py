"""This process's private directory in a shared place (/dev/shm), where staged bodies and
completion notices live.

Another local user can create, replace or link anything in a shared directory, so nothing
there is trusted by name: the directory is made by `mkdtemp` (a name nobody can guess, made
atomically with mode 0700) and its owner and mode are checked before use. Once it is ours,
no other user can enter it, so paths inside it are safe for every process of the server
(API, workers, schedulers) that runs as the same user. Where privacy cannot be had (a shared
root that others may rename entries in), the server stops at start-up with a message."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile

PREFIX = "lora-sync-staging-"
# Opening a file never follows a link, even inside our own directory.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC

_made: dict[str, str] = {}  # root -> this process's directory under it


class NotPrivate(RuntimeError):
    """A shared place where lora-sync cannot keep its files private."""


def check_root(root: str, what: str = "") -> None:
    """The root must be a real directory where other users cannot rename or delete our entries:
    owned by us or root, and, if others may write in it, sticky (as /dev/shm and /tmp are).
    `what` names it in the message (default: the staging root)."""
    what = what or f"lora-sync's staging root {root!r} (LORA_SYNC_SHM_DIR)"
    try:
        st = os.lstat(root)
    except OSError as e:
        raise NotPrivate(f"{what} cannot be used: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{what} is not a directory (a symbolic link is not accepted)")
    if st.st_uid not in (0, os.geteuid()):
        raise NotPrivate(f"{what} belongs to uid {st.st_uid}, who could swap our files: use a "
                         "directory owned by this user or by root")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise NotPrivate(f"{what} is writable by other users without the sticky bit: they "
                         "could rename our entries away; set the sticky bit (chmod +t) or use "
                         "another directory")


def _verify(path: str) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise NotPrivate(f"lora-sync's private directory {path!r} is not a directory of this "
                         f"user with mode 0700 (mode {oct(st.st_mode)}, uid {st.st_uid})")


def pid_namespace() -> str:
    """This process's PID namespace, as `ns<inode>`: a pid names a process only within its
    namespace, and servers in other namespaces (containers) may share the root."""
    try:
        return f"ns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return "ns-unknown"


def private_dir(root: str) -> str:
    """This process's private directory under `root`, made on first use and checked each
    time it is handed out. The process id and PID namespace in its name let a later server
    of the same namespace sweep it after a kill -9 (`remove_orphans`); the random rest
    makes it unguessable."""
    path = _made.get(root)
    if path is None or not os.path.isdir(path):
        check_root(root)
        path = _made[root] = tempfile.mkdtemp(
            prefix=f"{PREFIX}{os.getpid()}-{pid_namespace()}-", dir=root)
    _verify(path)
    return path


def current_root(default: str) -> str:
    """The root of the directory this process made last (`default` before it made any)."""
    return next(reversed(_made), default)


def forget(root: str) -> None:
    """Removes this process's directory under `root` (at exit)."""
    path = _made.pop(root, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def subdir(parent: str, name: str) -> str:
    """A private subdirectory of our private directory (mode 0700, ours, never a link)."""
    path = os.path.join(parent, name)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    _verify(path)
    return path


def remove_orphans(root: str) -> None:
    """Private directories of processes that died without cleaning up (kill -9). Only
    directories of this user and of this PID namespace are touched (elsewhere the pid says
    nothing of whether their process lives); rmtree never follows a link out of them."""
    if not os.path.isdir(root):
        return
    namespace = pid_namespace()
    for entry in os.scandir(root):
        pid, ns, _ = (entry.name[len(PREFIX):].split("-", 2) + ["", ""])[:3]
        if not entry.name.startswith(PREFIX) or not pid.isdigit() or ns != namespace \
                or namespace == "ns-unknown" or pid_alive(int(pid)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(entry.path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
