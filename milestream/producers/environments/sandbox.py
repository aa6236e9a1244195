"""A throw-away sandbox per episode for model-written tool code: bubblewrap, failing closed.

Every tool call runs ``python -I`` (this interpreter) in a sandbox of its own made by bubblewrap
(``bwrap``), which gives it
- its own user, PID, network, IPC, UTS and cgroup namespaces (what ``--unshare-all`` unshares; the
  flags are listed one by one because a worker running as root brings its own user namespace, below).
  The network namespace has nothing but its own loopback: the host's loopback (the run's broker,
  Redis) and everything beyond are out of reach of Python, subprocesses and native code alike;
- a read-only system: ``/usr`` with the ``/bin``, ``/lib*`` links, this interpreter's installation
  and its virtual environment; no ``/etc``, no home, no repository, no run folder;
- one writable place, the episode's folder, mounted as ``/sandbox`` (its working folder, HOME and
  TMPDIR) with ``/tmp`` a link to it; the root and ``/dev`` are remounted read-only;
- a ``/proc`` of its own PID namespace, so no other process's environment to read; its own
  environment is empty but PATH, HOME, TMPDIR and LANG;
- a whole-call cap: the call runs in a cgroup of its own (``call_cgroup.py``) whose memory cap
  (``memory_mb``) covers every process of the call and the pages of its ``memfd`` files and tmpfs,
  and whose task cap is ``max_processes`` (plus bubblewrap's two);
- limits set before its code runs: CPU seconds, address space (``RLIMIT_AS``, per process), file size,
  processes (``RLIMIT_NPROC``, threads included), open files (``max_open_files``) and no core dumps;
  ``oom_score_adj`` 1000, so that a machine out of memory kills tool code before the worker or the
  trainer (an unprivileged process cannot lower it again); a fresh, empty session keyring, so that tool
  code does not possess the keys of the worker's;
- an end: bubblewrap's init is PID 1 of the namespace, bubblewrap exits when the tool's process
  does (``--die-with-parent`` takes the init with it; a timeout kills bubblewrap) and the kernel kills
  whatever is left in the namespace with its init. A call returns only after that init is gone, so a
  detached child does not outlive it.

``RLIMIT_NPROC`` counts the processes of one host uid within one user namespace, so inside the
sandbox it counts only the call's own; but the kernel never enforces it for host uid 0. A worker
running as root therefore makes the user namespace itself (``unshare --user`` and its id maps): id 0
is host root, as whom bubblewrap mounts (the interpreter may live where only root can read, as
``/root/.pyenv``), and id 1000 is host ``nobody`` (65534), to which the tool's process switches
before its code runs; the episode folder belongs to nobody. So the process limit holds, and tool
code never runs as host root. (With a namespace given, bubblewrap cannot ``--disable-userns``: tool
code may make a nested user namespace, which gives it nothing more, its mounts staying locked.) A
worker running as another user lets bubblewrap make the namespace (``--unshare-user
--disable-userns``, the tool as id 1000 = that user).

Why bubblewrap rather than namespaces, seccomp and Landlock through Python bindings: one exec sets up
all the namespaces, the mounts and ``pivot_root``, drops capabilities, sets ``no_new_privs``, reaps as
init and dies with its parent. It is small, audited and what Flatpak runs on, and it is one Debian
package whose absence is easy to detect. By hand, each of these would be ``ctypes`` calls (Python
3.11 has no ``os.unshare``) made between fork and exec of a multithreaded worker, where little is
safe to run; Landlock confines files but gives no PID namespace or private ``/proc``, and seccomp
filters system calls but cannot tell a connect to the broker on 127.0.0.1 from a harmless one.

Fails closed: whether bubblewrap can isolate a call is probed once per process (a real sandboxed
run). Where it cannot (not installed, no user namespaces), entering a ``Sandbox`` raises
``SandboxUnavailable`` unless ``allow_weak`` (``sandbox.allow_weak``): then tools run in the weak
sandbox, with a warning in the log and ``sandbox_weak`` 1 in the rollout worker's metrics; never for a
worker running as root, where ``unshare -r`` would map tool code to host root (it could signal the worker
and write into the virtual environment): there entering raises ``SandboxUnavailable``. The weak
sandbox is what milestream had before: ``python -I`` in the episode folder with the same limits but
the process count, a network namespace through ``unshare -rn`` where that works, and an audit hook
refusing socket calls from Python. Where ``unshare`` fails, subprocesses and native code reach the
network; everywhere, tool code can write outside its folder, read other processes' ``/proc`` and
leave a detached child behind.

Where no cgroup can cap a call (no cgroup file system with the memory and pids controllers that this
process may write, as in a container without a writable one), entering a ``Sandbox`` raises
``SandboxUnavailable`` too, unless ``allow_uncapped`` (``sandbox.allow_uncapped``): then the limits
are per process only, with a warning in the log and ``sandbox_uncapped`` 1 in the worker's metrics. A
call can then hold ``max_processes`` x ``memory_mb`` of address space, plus up to ``max_open_files`` x
``max_file_mb`` per process in ``memfd`` files. The weak sandbox (``allow_weak``) caps the call where a
cgroup can, else runs uncapped without asking.

The output a tool leaves is kept in files limited by ``RLIMIT_FSIZE``, so a tool printing without
end cannot fill the worker's memory. Nothing is kept: the folder is deleted when the episode ends.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from milestream.producers.environments.call_cgroup import CallCgroup, CgroupParents, cgroup_parents

log = logging.getLogger(__name__)

TOOL_UID = 1000  # the tool's uid and gid inside the sandbox
NOBODY = 65534  # the host uid and gid they map to when the worker runs as root
INSIDE = "/sandbox"  # where the episode's folder appears in the sandbox (and /tmp, where free: see _tmp_alias)
# hang guards only: bubblewrap's own set-up and tear-down take milliseconds
SETUP_GUARD_S = 60.0
PROBE_TIMEOUT_S = 60.0
MEGABYTE = 1024 * 1024
SANDBOX_TASKS = 2  # bubblewrap and its init, besides the tool's own processes
# the host side of a call, before it execs the sandbox: first in line for the OOM killer, then into the
# call's cgroup (the leaves' cgroup.procs files are its arguments, up to "--"), so the call is born there
_HOST_SIDE = ('echo 1000 > /proc/self/oom_score_adj || exit 125; '
              'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"')

# runs first in the child: its uid (as root: host nobody), a session keyring of its own, folder and
# limits, no sockets from Python, then the tool's code from stdin. keyctl has no libc wrapper: its system
# call number per machine. EPERM (a seccomp filter, as Docker's) and ENOSYS (no keys in the kernel) leave
# tool code without keyctl too
_GUARD = """
import ctypes, errno, os, resource, sys
uid, cpu_s, memory, file_size, processes, open_files, folder = sys.argv[1:]
if uid:
    os.setresgid(int(uid), int(uid), int(uid))
    os.setresuid(int(uid), int(uid), int(uid))
keyctl = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
if keyctl is None:
    sys.exit("the sandbox cannot give tool code a session keyring of its own on " + os.uname().machine)
libc = ctypes.CDLL(None, use_errno=True)  # keyctl 1: KEYCTL_JOIN_SESSION_KEYRING, a new anonymous one
if libc.syscall(keyctl, 1, None) == -1 and ctypes.get_errno() not in (errno.EPERM, errno.ENOSYS):
    sys.exit("the sandbox could not give tool code a session keyring of its own: "
             + os.strerror(ctypes.get_errno()))
os.chdir(folder)
for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory),
                     (resource.RLIMIT_FSIZE, file_size), (resource.RLIMIT_NPROC, processes),
                     (resource.RLIMIT_NOFILE, open_files), (resource.RLIMIT_CORE, "0")):
    if int(value) >= 0:
        resource.setrlimit(limit, (int(value), int(value)))
def _no_network(event, args):
    if event in ("socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "socket.sendmsg"):
        raise PermissionError("the sandbox has no network (" + event + ")")
sys.addaudithook(_no_network)
del _no_network, uid, cpu_s, memory, file_size, processes, open_files, folder, limit, value, keyctl, libc
__code = sys.stdin.read()
exec(compile(__code, "<tool>", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512  # the whole call's memory (its cgroup's cap), and each process's address space
    max_output_chars: int = 2000  # what a tool result gives back to the model
    max_file_mb: int = 16
    max_processes: int = 32  # processes and threads of one call (RLIMIT_NPROC in its user namespace)
    max_open_files: int = 64  # per process (RLIMIT_NOFILE)


@dataclass(frozen=True)
class ToolRun:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    """Tool code would run without isolation, or without a whole-call cap, and ``sandbox.allow_weak``
    (``sandbox.allow_uncapped``) does not allow that."""


_weak_used = threading.Event()
_uncapped_used = threading.Event()


def figures() -> dict[str, float]:
    """The rollout worker's figures: ``sandbox_weak`` (``sandbox_uncapped``) 1 once an episode in this
    process ran its tools in the weak sandbox (without a whole-call cap)."""
    return {name: 1.0 for name, used in (("sandbox_weak", _weak_used), ("sandbox_uncapped", _uncapped_used))
            if used.is_set()}


class Sandbox:
    """One episode's sandbox; use as a context manager so its folder always goes away."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), bwrap: str = "bwrap", allow_weak: bool = False,
                 allow_uncapped: bool = False) -> None:
        self.limits, self.bwrap, self.allow_weak, self.allow_uncapped = limits, bwrap, allow_weak, allow_uncapped
        self.folder: Path | None = None
        self.weak = False
        self.cgroups: CgroupParents | None = None

    def __enter__(self) -> "Sandbox":
        problem = isolation_problem(self.bwrap)
        if problem is not None and not self.allow_weak:
            raise SandboxUnavailable(f"tools are not run: {problem}; install bubblewrap, or set sandbox.allow_weak: "
                                     "true to run model-written code in the weak sandbox")
        if problem is not None and os.geteuid() == 0:
            raise SandboxUnavailable(f"tools are not run: {problem}, and sandbox.allow_weak does not apply to a worker "
                                     "running as root (the weak sandbox would run model-written code as root); run the "
                                     "rollout workers as an unprivileged user, or make bubblewrap work here")
        self.weak = problem is not None
        if self.weak:
            _warn_weak(problem)
            _weak_used.set()
        self.cgroups = self._whole_call_cap()
        self.folder = Path(tempfile.mkdtemp(prefix="milestream-episode-"))
        if not self.weak and os.geteuid() == 0:
            os.chown(self.folder, NOBODY, NOBODY)
        return self

    def _whole_call_cap(self) -> CgroupParents | None:
        parents = cgroup_parents()
        if isinstance(parents, CgroupParents):
            return parents
        if not (self.allow_uncapped or self.weak):
            raise SandboxUnavailable(f"tools are not run: {parents}; run the rollout workers where they can make "
                                     "cgroups (as root, or in a delegated cgroup subtree), or set "
                                     "sandbox.allow_uncapped: true to limit each process of a call only")
        _warn_uncapped(parents)
        _uncapped_used.set()
        return None

    def __exit__(self, *exc) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def run_python(self, code: str) -> ToolRun:
        if self.folder is None:
            raise RuntimeError("the sandbox is closed: run tools inside `with Sandbox(...)`")
        cap = self.cgroups.call(self.limits.memory_mb * MEGABYTE, self.limits.max_processes + SANDBOX_TASKS) \
            if self.cgroups is not None else contextlib.nullcontext()
        with cap as cgroup, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            if self.weak:
                exit_code, timed_out = _run_weak(self.folder, self.limits, cgroup, code, out, err)
            else:
                exit_code, timed_out = _run_isolated(shutil.which(self.bwrap), self.folder, self.limits, cgroup, code,
                                                     out, err)
            cut = self.limits.max_output_chars
            return ToolRun(_head(out, cut), _tail(err, cut), exit_code, timed_out)


@functools.cache
def isolation_problem(bwrap: str = "bwrap") -> str | None:
    """None where bubblewrap isolates a tool call here, else why not. Probed once per process by a
    real sandboxed run, so a refused namespace or a missing mount shows here, not in an episode."""
    path = shutil.which(bwrap)
    if path is None:
        return f"bubblewrap ({bwrap}) is not installed"
    with tempfile.TemporaryDirectory(prefix="milestream-probe-") as folder, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            if os.geteuid() == 0:
                os.chown(folder, NOBODY, NOBODY)
            exit_code, _ = _run_isolated(path, Path(folder), SandboxLimits(timeout_s=PROBE_TIMEOUT_S), None,
                                         "print('isolated')", out, err)
        except (OSError, RuntimeError) as exc:
            return f"bubblewrap ({path}) cannot isolate a tool call here: {exc}"
        if exit_code != 0 or _head(out, 100) != "isolated\n":
            reason = _tail(err, 300).strip() or f"exit status {exit_code}"
            return f"bubblewrap ({path}) cannot isolate a tool call here: {reason}"
    return None


@functools.cache
def _warn_weak(problem: str) -> None:
    log.warning("tool code runs in the WEAK sandbox (sandbox.allow_weak): %s. It can reach the network where "
                "unshare fails, write outside its folder, read other processes' /proc and leave processes behind",
                problem)


@functools.cache
def _warn_uncapped(problem: str) -> None:
    log.warning("tool calls run WITHOUT a whole-call cap (sandbox.allow_uncapped): %s. Their memory and process "
                "limits are per process: a call can hold max_processes x memory_mb, and more in memfd files", problem)


# ---- the isolated call ------------------------------------------------------------------------------------

def _run_isolated(bwrap: str | None, folder: Path, limits: SandboxLimits, cgroup: CallCgroup | None, code: str,
                  out: IO[bytes], err: IO[bytes]) -> tuple[int, bool]:
    """(exit code, timed out) of one call under bubblewrap; returns once the sandbox's init is gone."""
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap went missing")
    as_root = os.geteuid() == 0
    with _root_user_namespace() if as_root else contextlib.nullcontext() as userns:
        info_read, info_write = os.pipe()
        try:
            command = _bwrap_command(bwrap, folder, limits, userns, info_write)
            process = subprocess.Popen(_host_side(command, cgroup), stdin=subprocess.PIPE, stdout=out, stderr=err,
                                       env={},
                                       pass_fds=[info_write] + ([userns] if as_root else []),
                                       start_new_session=True, extra_groups=[] if as_root else None)
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(info_write)
    init = _init_pidfd(info_read, process)
    try:
        timed_out = _communicate(process, code, limits.timeout_s)
        if init is not None and not select.select([init], [], [], SETUP_GUARD_S)[0]:
            raise RuntimeError(f"the sandbox's init (bubblewrap) outlived its tool call by {SETUP_GUARD_S:g} s")
    finally:
        if init is not None:
            os.close(init)
    return process.returncode, timed_out


def _bwrap_command(bwrap: str, folder: Path, limits: SandboxLimits, userns: int | None, info_fd: int) -> list[str]:
    if userns is not None:  # as root: set up as host root, then the guard switches to TOOL_UID (host nobody)
        user = ["--userns", str(userns), "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        user = ["--unshare-user", "--disable-userns", "--uid", str(TOOL_UID), "--gid", str(TOOL_UID),
                "--cap-drop", "ALL"]
    environment = {"PATH": "/usr/bin:/bin", "HOME": INSIDE, "TMPDIR": INSIDE, "LANG": "C.UTF-8",
                   # a thread per core (OpenBLAS, OpenMP) would pass max_processes on a large machine
                   "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return [bwrap, *user,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
            "--clearenv", *[arg for name, value in environment.items() for arg in ("--setenv", name, value)],
            *_system_mounts(),
            "--bind", str(folder), INSIDE, *_tmp_alias(), "--proc", "/proc", "--dev", "/dev",
            "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/",
            "--", sys.executable, "-I", "-c", _GUARD,
            *_guard_args(limits, str(TOOL_UID) if userns is not None else "", limits.max_processes, INSIDE)]


@functools.cache
def _system_mounts() -> tuple[str, ...]:
    """Read-only: /usr, the top-level links into it (or the folders, on a system without merged /usr),
    and this interpreter's installation and virtual environment, under their own paths (a venv's
    ``python`` is a link to its base interpreter's). Parents are made 0755: bubblewrap 0.8 would make
    them 0700, closed to the tool's uid when root set them up."""
    mounts = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            mounts += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            mounts += ["--ro-bind", top, top]
    roots = _interpreter_roots()
    made = {"/"}
    for root in roots:
        if root == "/usr" or root.startswith("/usr/") or any(root.startswith(other + "/") for other in roots):
            continue  # inside another mount already
        for parent in reversed(Path(root).parents):
            if str(parent) not in made:
                mounts += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        mounts += ["--ro-bind", root, root]
    return tuple(mounts)


def _interpreter_roots() -> list[str]:
    return sorted({os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)})


@functools.cache
def _tmp_alias() -> tuple[str, ...]:
    """/tmp as a link to the episode's folder, so tool code writing to /tmp writes there; unless the
    interpreter lives under /tmp (a checkout in /tmp), whose read-only mount then holds /tmp."""
    if any(root == "/tmp" or root.startswith("/tmp/") for root in _interpreter_roots()):
        return ()
    return ("--symlink", INSIDE, "/tmp")


@contextlib.contextmanager
def _root_user_namespace() -> Iterator[int]:
    """A user namespace (an open fd) whose id 0 is host root and TOOL_UID host nobody; only root may
    map ids other than its own. ``unshare`` holds it while the maps are written, the fd afterwards."""
    helper = subprocess.Popen(["unshare", "--user", "sh", "-c", "echo; exec cat"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env={"PATH": os.defpath})
    try:
        if helper.stdout.readline() != b"\n":  # it prints once in its new namespace
            raise OSError("unshare --user could not make a user namespace")
        ids = f"0 0 1\n{TOOL_UID} {NOBODY} 1\n"
        for name, text in (("uid_map", ids), ("setgroups", "deny"), ("gid_map", ids)):
            Path(f"/proc/{helper.pid}/{name}").write_text(text)
        userns = os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.stdin.close()
        helper.stdout.close()
        helper.wait()
    try:
        yield userns
    finally:
        os.close(userns)


def _init_pidfd(info_read: int, process: subprocess.Popen) -> int | None:
    """A pidfd on the sandbox's init, from bubblewrap's ``--info-fd``. The init cannot have ended yet:
    the tool's process under it waits for its code, which is not sent until this returns. None where
    bubblewrap failed before making one (its error is on stderr)."""
    with os.fdopen(info_read, "rb") as info:
        if not select.select([info], [], [], SETUP_GUARD_S)[0]:
            _kill(process)
            raise RuntimeError(f"bubblewrap did not start a sandbox within {SETUP_GUARD_S:g} s")
        text = info.read()
    try:
        return os.pidfd_open(json.loads(text)["child-pid"])
    except (ValueError, KeyError, ProcessLookupError):
        return None


# ---- the weak call and both ----------------------------------------------------------------------------

def _run_weak(folder: Path, limits: SandboxLimits, cgroup: CallCgroup | None, code: str, out: IO[bytes],
              err: IO[bytes]) -> tuple[int, bool]:
    command = [sys.executable, "-I", "-c", _GUARD, *_guard_args(limits, "", -1, str(folder))]
    if network_namespace_available():
        command = ["unshare", "-rn", *command]
    env = {"PATH": os.defpath, "HOME": str(folder), "TMPDIR": str(folder), "LANG": "C.UTF-8"}
    process = subprocess.Popen(_host_side(command, cgroup), cwd=folder, stdin=subprocess.PIPE, stdout=out, stderr=err,
                               env=env, start_new_session=True)
    timed_out = _communicate(process, code, limits.timeout_s)
    return process.returncode, timed_out


@functools.cache
def network_namespace_available() -> bool:
    """(The weak sandbox) whether ``unshare -rn`` can give a child its own network namespace here."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _guard_args(limits: SandboxLimits, uid: str, processes: int, folder: str) -> list[str]:
    cpu_s = max(1, int(limits.timeout_s) + 1)
    return [uid, str(cpu_s), str(limits.memory_mb * MEGABYTE), str(limits.max_file_mb * MEGABYTE), str(processes),
            str(limits.max_open_files), folder]


def _host_side(command: list[str], cgroup: CallCgroup | None) -> list[str]:
    return ["/bin/sh", "-c", _HOST_SIDE, "sh", *(cgroup.procs_files() if cgroup is not None else []), "--", *command]


def _communicate(process: subprocess.Popen, code: str, timeout_s: float) -> bool:
    """Sends the code and waits; True where the call ran out of time (its process group is killed)."""
    try:
        process.communicate(code.encode("utf-8", "replace"), timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        _kill(process)
        process.communicate()
        return True


def _kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _head(file: IO[bytes], chars: int) -> str:
    file.seek(0)
    return file.read(4 * chars).decode("utf-8", "replace")[:chars]


def _tail(file: IO[bytes], chars: int) -> str:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - 4 * chars))
    return file.read().decode("utf-8", "replace")[-chars:]
