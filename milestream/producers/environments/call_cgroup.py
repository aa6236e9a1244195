"""A cgroup per tool call: one cap on the memory and on the tasks of the whole call.

Per-process limits do not add up to a cap on a call: ``RLIMIT_AS`` bounds each process (32 processes
hold 32 times it) and does not count pages in ``memfd`` files or on tmpfs at all; ``RLIMIT_NPROC``
counts a uid's processes. A cgroup is charged every page its tasks use (anonymous, page cache, shmem
such as memfd and tmpfs, kernel memory) and counts every task, threads included. Past its memory cap
the kernel reclaims, then kills inside the cgroup, never outside it (cgroup v2: every process of the
call at once, ``memory.oom.group``); swap is closed to it, so the cap is on memory, not on RAM.

Where the leaves go. Cgroup v2 lets a cgroup enable controllers for its children
(``cgroup.subtree_control``) only while it holds no process itself, the root excepted: a leaf goes
under the worker's own cgroup where that is the root, else beside it, under its parent (as root may do
under a systemd slice). Cgroup v1 (memory and pids mounted as hierarchies of their own) has no such
rule: a leaf under the worker's own cgroup in each. Either needs root or a delegated subtree; a
container's cgroup file system is read-only unless the container is given a writable one.

A call's processes are born inside its leaf: its command starts with a shell that writes its own pid
into the leaf's ``cgroup.procs`` and then execs the sandbox (``Sandbox`` in ``sandbox.py``).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids")
LEAF_PREFIX = "milestream-call-"
# a leaf whose tasks were all killed is removable once they have exited: milliseconds
REMOVE_GUARD_S = 5.0
_numbers = itertools.count()


@dataclass(frozen=True)
class CallCgroup:
    """One call's leaf: one folder (cgroup v2), or one in the memory and one in the pids hierarchy (v1)."""
    leaves: tuple[Path, ...]

    def procs_files(self) -> list[str]:
        return [str(leaf / "cgroup.procs") for leaf in self.leaves]

    def remove(self) -> None:
        """Kills whatever is left in the leaves (nothing, once the sandbox's init is gone) and removes them."""
        for leaf in self.leaves:
            deadline = time.monotonic() + REMOVE_GUARD_S
            while leaf.exists():
                _kill_tasks(leaf)
                try:
                    leaf.rmdir()
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("cgroup %s of a tool call was not removed: %s", leaf, exc)
                        break
                    time.sleep(0.01)  # tasks killed but not yet exited


@dataclass(frozen=True)
class CgroupParents:
    """Where this process makes its calls' leaves: the folder of each controller (the same one in v2)."""
    version: int
    memory: Path
    pids: Path

    @contextlib.contextmanager
    def call(self, memory_bytes: int, tasks: int) -> Iterator[CallCgroup]:
        """A fresh leaf capped at ``memory_bytes`` of memory and ``tasks`` tasks, removed afterwards."""
        name = f"{LEAF_PREFIX}{os.getpid()}-{next(_numbers)}"
        memory, pids = self.memory / name, self.pids / name
        cgroup = CallCgroup(tuple(dict.fromkeys((memory, pids))))
        try:
            for leaf in cgroup.leaves:
                leaf.mkdir()
            for file, value in self._limits(memory, pids, memory_bytes, tasks):
                file.write_text(value)
            yield cgroup
        finally:
            cgroup.remove()

    def _limits(self, memory: Path, pids: Path, memory_bytes: int, tasks: int) -> list[tuple[Path, str]]:
        """(file, value) in the order they must be written; the optional ones where the kernel has them."""
        if self.version == 2:
            required = [(memory / "memory.max", str(memory_bytes))]
            optional = [(memory / "memory.swap.max", "0"), (memory / "memory.oom.group", "1")]
        else:  # memsw (memory and swap together) may not be below the memory limit: written after it
            required = [(memory / "memory.limit_in_bytes", str(memory_bytes))]
            optional = [(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))]
        return [*required, *[(file, value) for file, value in optional if file.exists()],
                (pids / "pids.max", str(tasks))]


@functools.cache
def cgroup_parents() -> CgroupParents | str:
    """Where this process can make capped leaves, or why nowhere. Probed once per process by making one."""
    mounts, own = _cgroup_mounts(), _own_cgroups()
    reasons = []
    for candidate in [*_v2_candidates(mounts, own), *_v1_candidates(mounts, own)]:
        try:
            with candidate.call(memory_bytes=64 * 1024 * 1024, tasks=8):
                pass
            return candidate
        except OSError as exc:
            reasons.append(f"cgroup v{candidate.version} at {candidate.memory}: {exc}")
    if not reasons:
        return "no cgroup file system with the memory and pids controllers is mounted here"
    return "no cgroup can cap a tool call here (" + "; ".join(reasons) + ")"


def _v2_candidates(mounts: list[tuple[str, Path, str, set[str]]], own: dict[str, str]) -> list[CgroupParents]:
    found = []
    for fstype, point, root, _ in mounts:
        folder = _folder(point, root, own.get("")) if fstype == "cgroup2" else None
        if folder is None:
            continue
        for parent in dict.fromkeys((folder, folder.parent if folder != point else folder)):
            if _enable_controllers(parent):
                found.append(CgroupParents(2, parent, parent))
    return found


def _v1_candidates(mounts: list[tuple[str, Path, str, set[str]]], own: dict[str, str]) -> list[CgroupParents]:
    folders = {}
    for fstype, point, root, options in mounts:
        for controller in CONTROLLERS:
            if fstype == "cgroup" and controller in options:
                folders[controller] = _folder(point, root, own.get(controller))
    if folders.get("memory") is None or folders.get("pids") is None:
        return []
    return [CgroupParents(1, folders["memory"], folders["pids"])]


def _enable_controllers(folder: Path) -> bool:
    """Whether the memory and pids controllers are, or could be made, on for ``folder``'s children."""
    try:
        if not set(CONTROLLERS) <= set((folder / "cgroup.controllers").read_text().split()):
            return False
        missing = set(CONTROLLERS) - set((folder / "cgroup.subtree_control").read_text().split())
        if missing:  # refused (EBUSY) where the folder holds processes and is not the root
            (folder / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(missing)))
        return True
    except OSError:
        return False


def _folder(point: Path, root: str, own: str | None) -> Path | None:
    """This process's cgroup as a folder under a mount of the hierarchy whose ``root`` is mounted at ``point``."""
    if own is None or not (root == "/" or own == root or own.startswith(root + "/")):
        return None
    return point / os.path.relpath(own, root)


def _cgroup_mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(file system type, mount point, root within the hierarchy, super options) of each cgroup mount."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        after = fields.index("-")
        if fields[after + 1] in ("cgroup", "cgroup2"):
            mounts.append((fields[after + 1], Path(fields[4]), fields[3], set(fields[after + 3].split(","))))
    return mounts


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per controller ("" for the v2 hierarchy)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _kill_tasks(leaf: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        for pid in (leaf / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
