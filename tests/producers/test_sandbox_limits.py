"""The sandbox's whole-call limits, tried by tool code as an attacker would: memory spread over many
processes or hidden in memfd files, open files, core dumps, the OOM killer's choice, the caller's keys.

Like the escape tests, none skips where the machine cannot cap a call: entering ``Sandbox()`` raises
``SandboxUnavailable`` there. Each attempt's outcome is printed by the tool code and checked here.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import threading
import uuid
from pathlib import Path

import pytest

from milestream.producers.environments import call_cgroup
from milestream.producers.environments import sandbox as sandbox_module
from milestream.producers.environments.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

CAP_MB = 256

# forks CHILDREN processes that each fill MB MiB and report; once every one has reported or died, each
# still alive says so. A child the OOM killer chose dies with SIGKILL pending and says nothing more.
_MANY_PROCESSES = """
import os
children, size = {children}, {mb} * 1024 * 1024
release_read, release_write = os.pipe()
reports = []
for _ in range(children):
    report_read, report_write = os.pipe()
    if os.fork() == 0:
        os.close(release_write)
        block = b"x" * size
        os.write(report_write, b"h")
        os.read(release_read, 1)
        os.write(report_write, b"a")
        os._exit(0)
    os.close(report_write)
    reports.append(report_read)
held = sum(os.read(fd, 1) == b"h" for fd in reports)
os.close(release_write)
alive = sum(os.read(fd, 1) == b"a" for fd in reports)
print("held", held, "alive", alive, flush=True)
"""

_MEMFD = """
import os
files = []
try:
    for _ in range({files}):
        fd = os.memfd_create("hidden")
        for _ in range(16):
            os.write(fd, b"x" * 1024 * 1024)
        files.append(fd)
        print("memfd MiB", 16 * len(files), flush=True)
except OSError as exc:
    print("refused", exc, flush=True)
"""


def _last_figure(stdout: str, name: str) -> int | None:
    lines = [line.split() for line in stdout.splitlines() if line.startswith(name)]
    return int(lines[-1][-1]) if lines else None


def test_many_processes_together_cannot_hold_more_than_the_call_cap():
    """16 processes x 32 MiB against a 256 MiB cap for the call (each process alone may have 256 MiB
    of address space): those alive at the end hold no more than the cap."""
    limits = SandboxLimits(timeout_s=60.0, memory_mb=CAP_MB, max_processes=32)
    with Sandbox(limits) as sandbox:
        within = sandbox.run_python(_MANY_PROCESSES.format(children=8, mb=8))
        beyond = sandbox.run_python(_MANY_PROCESSES.format(children=16, mb=32))
    assert within.stdout == "held 8 alive 8\n", within  # the harness itself: all alive when they fit
    alive = _last_figure(beyond.stdout, "held")
    # v1 kills one process at a time (the parent reports the rest); v2 kills the whole call at once
    assert (alive is not None and alive * 32 < CAP_MB) or beyond.exit_code != 0, beyond


def test_memory_in_memfd_files_counts_against_the_call_cap():
    """48 memfd files of 16 MiB (768 MiB, each within the file-size limit, none mapped) against 256 MiB:
    the tool is killed, or its writes refused, before it holds more than the cap."""
    with Sandbox(SandboxLimits(timeout_s=60.0, memory_mb=CAP_MB)) as sandbox:
        run = sandbox.run_python(_MEMFD.format(files=48))
    held = _last_figure(run.stdout, "memfd MiB") or 0
    assert held < CAP_MB and (run.exit_code != 0 or "refused" in run.stdout), run


def test_open_files_are_few():
    code = """
import resource
print(*resource.getrlimit(resource.RLIMIT_NOFILE))
files = []
try:
    while len(files) < 1000:
        files.append(open("/dev/null"))
except OSError as exc:
    print(len(files), exc.errno)
"""
    with Sandbox() as sandbox:
        soft, hard, *opened = sandbox.run_python(code).stdout.split()
    limit = SandboxLimits().max_open_files
    assert (int(soft), int(hard)) == (limit, limit)
    assert int(opened[0]) < limit and int(opened[1]) == errno.EMFILE


@pytest.fixture
def core_dumps_allowed_here():
    """The caller allows core dumps (as many machines do): the tool must not inherit that."""
    before = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
                       if os.geteuid() == 0 else (before[1], before[1]))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, before)


def test_no_core_dumps(core_dumps_allowed_here):
    code = """
import os, resource, signal
print(*resource.getrlimit(resource.RLIMIT_CORE))
child = os.fork()
if child == 0:
    os.kill(os.getpid(), signal.SIGABRT)
_, status = os.waitpid(child, 0)
print(os.WTERMSIG(status), os.WCOREDUMP(status), sorted(name for name in os.listdir(".") if "core" in name))
"""
    with Sandbox() as sandbox:
        limits, outcome = sandbox.run_python(code).stdout.splitlines()
    assert limits == "0 0"
    assert outcome == "6 False []"


def test_the_oom_killer_takes_tool_code_first_and_it_cannot_say_otherwise():
    code = """
import subprocess, sys
print(open("/proc/self/oom_score_adj").read().strip())
print(subprocess.run(["cat", "/proc/self/oom_score_adj"], capture_output=True, text=True).stdout.strip())
try:
    open("/proc/self/oom_score_adj", "w").write("0")
    print(open("/proc/self/oom_score_adj").read().strip())
except OSError as exc:
    print(type(exc).__name__)
"""
    with Sandbox() as sandbox:
        assert sandbox.run_python(code).stdout.split() == ["1000", "1000", "PermissionError"]


_KEY_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
KEY_SPEC_SESSION_KEYRING, KEYCTL_REVOKE, KEYCTL_READ = -3, 3, 11


@pytest.fixture
def planted_key() -> tuple[int, bytes]:
    """A key in this process's session keyring (the worker's, in a worker): its serial and payload."""
    add_key, keyctl = _KEY_CALLS.get(os.uname().machine, (None, None))
    if add_key is None:
        pytest.skip(f"no keyctl system call number for {os.uname().machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    payload = uuid.uuid4().hex.encode()
    serial = libc.syscall(add_key, b"user", b"milestream-test", payload, len(payload),
                          ctypes.c_int(KEY_SPEC_SESSION_KEYRING))
    if serial == -1 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        pytest.skip("this kernel (or its seccomp filter) has no keyrings: nothing to leak")
    assert serial > 0, os.strerror(ctypes.get_errno())
    yield serial, payload
    libc.syscall(keyctl, KEYCTL_REVOKE, ctypes.c_int(serial))


def _read_key(keyctl: int, serial: int) -> tuple[bytes, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(256)
    size = libc.syscall(keyctl, KEYCTL_READ, ctypes.c_int(serial), buffer, len(buffer))
    return (buffer.raw[:size] if size >= 0 else b""), ctypes.get_errno()


def test_tool_code_cannot_read_a_key_in_the_callers_session_keyring(planted_key):
    serial, payload = planted_key
    keyctl = _KEY_CALLS[os.uname().machine][1]
    assert _read_key(keyctl, serial)[0] == payload  # the caller can: the key is there
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
buffer = ctypes.create_string_buffer(256)
size = libc.syscall({keyctl}, {KEYCTL_READ}, ctypes.c_int({serial}), buffer, len(buffer))
print(buffer.raw[:size].decode() if size >= 0 else "refused " + str(ctypes.get_errno()))
"""
    with Sandbox() as sandbox:
        run = sandbox.run_python(code)
    assert run.stdout.startswith("refused") and payload.decode() not in run.stdout + run.stderr, run


# four processes print; each waits for its children, which the end of the call would otherwise kill unprinted
FORK_TWICE_AND_WAIT = """
import os
os.fork()
os.fork()
print('ran', flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def test_each_call_has_its_own_cgroup_gone_afterwards():
    parents = call_cgroup.cgroup_parents()
    assert isinstance(parents, call_cgroup.CgroupParents), parents
    ours = f"{call_cgroup.LEAF_PREFIX}{os.getpid()}-"
    with Sandbox() as sandbox:
        assert sandbox.run_python("print('ran')").stdout == "ran\n"
        assert sandbox.run_python(FORK_TWICE_AND_WAIT).stdout.count("ran") == 4
    assert [leaf for folder in {parents.memory, parents.pids} for leaf in folder.iterdir()
            if leaf.name.startswith(ours)] == []


@pytest.fixture
def no_cgroup_here(monkeypatch) -> str:
    """This process as on a machine where no cgroup can be made (as in a container without a writable one)."""
    reason = f"no cgroup can cap a tool call here (test {uuid.uuid4().hex[:8]})"
    monkeypatch.setattr(sandbox_module, "cgroup_parents", lambda: reason)
    monkeypatch.setattr(sandbox_module, "_uncapped_used", threading.Event())  # this test's figure only
    return reason


def test_without_a_cgroup_the_sandbox_refuses_unless_told_to_cap_per_process(no_cgroup_here: str, tmp_path: Path,
                                                                            caplog) -> None:
    with pytest.raises(SandboxUnavailable, match="no cgroup can cap.*sandbox.allow_uncapped: true"):
        with Sandbox() as sandbox:
            sandbox.run_python(f"open({str(tmp_path / 'reached')!r}, 'w').write('ran uncapped')")
    assert not (tmp_path / "reached").exists() and "sandbox_uncapped" not in sandbox_module.figures()
    with caplog.at_level(logging.WARNING, logger=sandbox_module.__name__), \
            Sandbox(allow_uncapped=True) as sandbox:
        assert sandbox.run_python("import resource; print(resource.getrlimit(resource.RLIMIT_CORE))").stdout == \
            "(0, 0)\n"  # the per-process limits still hold
    assert any("WITHOUT a whole-call cap" in r.getMessage() and no_cgroup_here in r.getMessage()
               for r in caplog.records)
    assert sandbox_module.figures()["sandbox_uncapped"] == 1.0
