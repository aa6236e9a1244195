"""Tool code tries to escape the sandbox as an attacker would, and fails.

None of these tests skips: where bubblewrap cannot isolate a call, entering ``Sandbox()`` raises
``SandboxUnavailable`` and every escape test fails. The sandbox, bubblewrap, the servers and the
processes are real; each attempt's outcome is printed by the tool code and checked from the host.
"""
from __future__ import annotations

import ast
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

from milestream.config import Config
from milestream.producers.environments import sandbox as sandbox_module
from milestream.producers.environments.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from milestream.producers.environments.tool_use import run_tool_call

# each attempt prints "REACHED <how>" if it got through, or the error that stopped it
_CONNECT = """
import ctypes, ctypes.util, errno, shutil, socket, struct, subprocess, sys
targets = {targets!r}
for host, port in targets:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("REACHED python", port)
    except OSError as exc:
        print("python", port, repr(exc))
    dial = f"import socket; socket.create_connection(({{host!r}}, {{port}}), timeout=2); print('REACHED subprocess')"
    child = subprocess.run([sys.executable, "-I", "-c", dial], capture_output=True, text=True)
    print("subprocess", port, (child.stdout + child.stderr).strip().splitlines()[-1])
    if shutil.which("bash"):
        shell = subprocess.run(["bash", "-c", f"echo > /dev/tcp/{{host}}/{{port}} && echo REACHED bash {{port}}"],
                               capture_output=True, text=True)
        print("bash", port, (shell.stdout + shell.stderr).strip())
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    address = struct.pack("=HH4s8x", socket.AF_INET, socket.htons(port), socket.inet_aton(host))
    if libc.connect(fd, address, len(address)) == 0:
        print("REACHED ctypes", port)
    else:
        print("ctypes", port, errno.errorcode[ctypes.get_errno()])
"""


def _processes_named(marker: str) -> list[int]:
    """Host pids whose name (comm) is ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == marker:
                found.append(int(entry.name))
        except OSError:
            continue  # ended while listed
    return found


@pytest.fixture
def marker():
    """A unique process name for tool code to take; whatever still carries it afterwards is killed."""
    name = f"ms{uuid.uuid4().hex[:10]}"
    yield name
    for pid in _processes_named(name):
        os.kill(pid, signal.SIGKILL)


def test_no_connection_reaches_the_hosts_loopback(live_services: Config):
    """Python, a subprocess, bash's /dev/tcp and libc through ctypes: none reaches a server listening on
    the host's 127.0.0.1, nor the run's broker and Redis."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    broker = live_services.broker.bootstrap_servers.split(",")[0].rsplit(":", 1)
    redis = urlparse(live_services.redis.url)
    targets = [("127.0.0.1", server.getsockname()[1]), (broker[0], int(broker[1])), (redis.hostname, redis.port)]
    with server, Sandbox(SandboxLimits(timeout_s=30.0)) as sandbox:
        run = sandbox.run_python(_CONNECT.format(targets=targets))
        assert run.ok, run.stderr
        assert "REACHED" not in run.stdout
        assert run.stdout.count("python ") == 3 and "no network" in run.stdout  # the audit hook
        assert run.stdout.count("ConnectionRefusedError") == 3  # the subprocess: a loopback of its own, empty
        assert run.stdout.count("ECONNREFUSED") == 3  # ctypes: below Python, the same
        with pytest.raises(BlockingIOError):  # the sandbox's calls have returned: a connection would be queued
            server.accept()


def test_writes_land_only_in_the_private_folder(cfg: Config, tmp_path: Path):
    run_folder = cfg.run_path
    run_folder.mkdir(parents=True, exist_ok=True)
    name = f"escaped-{uuid.uuid4().hex}"
    outside = [tmp_path / name, run_folder / name, Path("/") / name, Path("/usr") / name, Path.home() / name,
               Path(__file__).parent / name]
    code = "import os\n" + "".join(
        f"try:\n    os.makedirs({str(path.parent)!r}, exist_ok=True)\n    open({str(path)!r}, 'w').write('x')\n"
        f"    print('WROTE', {str(path)!r})\nexcept OSError as exc:\n    print('refused', {str(path)!r}, exc)\n"
        for path in outside)
    with Sandbox() as sandbox:
        run = sandbox.run_python(code)
        escaped = [path for path in outside if path.exists()]
        for path in escaped:  # not left behind by a failing sandbox
            path.unlink()
        assert run.ok, run.stderr
        assert escaped == []
        # /tmp inside is a link to the private folder (unless the interpreter lives under /tmp): a path
        # under it may be written there, and only there
        landed = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("WROTE")]
        assert all(Path(path).is_relative_to("/tmp") for path in landed)
        assert all((sandbox.folder / Path(path).relative_to("/tmp")).exists() for path in landed)
        assert "Read-only file system" in run.stdout


def test_no_other_process_environment_or_files(cfg: Config, tmp_path: Path, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("MILESTREAM_TEST_SECRET", secret)  # in the worker's (the test's) environment
    run_folder = cfg.run_path
    run_folder.mkdir(parents=True, exist_ok=True)
    planted = [run_folder / "secret.txt", run_folder.parent / "secret.txt"]
    for path in planted:
        path.write_text(secret)
    code = f"""
import os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print('pids', pids)
for path in [f'/proc/{{pid}}/environ' for pid in pids] + ['/proc/{os.getpid()}/environ', '/proc/1/environ',
             *{[str(p) for p in planted]!r}, {str(Path.home() / ".bash_history")!r}]:
    try:
        print(path, open(path, 'rb').read())
    except OSError as exc:
        print(path, 'refused', exc)
print('env', dict(os.environ))
"""
    with Sandbox() as sandbox:
        run = sandbox.run_python(code)
    assert run.ok, run.stderr
    assert secret not in run.stdout
    pids = ast.literal_eval(run.stdout.splitlines()[0].removeprefix("pids "))
    assert max(pids) < 10  # its own PID namespace: bubblewrap's init and the tool's processes
    assert f"/proc/{os.getpid()}/environ refused" in run.stdout
    assert "/proc/1/environ refused" in run.stdout or "/proc/1/environ b''" in run.stdout
    assert all(f"{path} refused" in run.stdout for path in planted)


def test_fork_bomb_is_contained(marker: str):
    """Processes and threads stop at max_processes; a fork bomb runs into its timeout and nothing of
    it is left on the host."""
    limits = SandboxLimits(timeout_s=3.0, max_processes=16)
    forks = f"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, {marker!r}.encode())  # PR_SET_NAME
forks = 0
try:
    while forks < 1000:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forks += 1
except OSError as exc:
    print(forks, exc)
"""
    threads = """
import threading, time
threads = 0
try:
    while threads < 1000:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        threads += 1
except RuntimeError as exc:
    print(threads, exc)
"""
    bomb = f"""
import ctypes, os
ctypes.CDLL(None).prctl(15, {marker!r}.encode())  # PR_SET_NAME
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    with Sandbox(limits) as sandbox:
        for code in (forks, threads):
            run = sandbox.run_python(code)
            assert run.ok and 0 < int(run.stdout.split()[0]) < limits.max_processes, (run.stdout, run.stderr)
        assert _processes_named(marker) == []  # the sleepers went with their call
        started = time.monotonic()
        run = sandbox.run_python(bomb)
        assert run.timed_out and time.monotonic() - started < limits.timeout_s + 30  # hang guard only
        assert _processes_named(marker) == []


def test_detached_child_is_gone_when_the_call_returns(marker: str):
    """A double fork and setsid, the grandchild sleeping with its output closed: the call returns as soon
    as the tool's own process ends, and nothing of it is left on the host."""
    code = f"""
import os, time
ready_read, ready_write = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        import ctypes
        ctypes.CDLL(None).prctl(15, {marker!r}.encode())  # PR_SET_NAME
        for fd in (0, 1, 2):
            os.close(fd)
        os.write(ready_write, b'x')
        time.sleep(600)
    os._exit(0)
os.read(ready_read, 1)
print('detached')
"""
    with Sandbox(SandboxLimits(timeout_s=30.0)) as sandbox:
        started = time.monotonic()
        run = sandbox.run_python(code)
        assert run.ok and run.stdout == "detached\n", run.stderr
        assert time.monotonic() - started < 30.0
        assert _processes_named(marker) == []


def test_a_memory_hog_is_refused_with_a_clear_error():
    with Sandbox(SandboxLimits(timeout_s=30.0)) as sandbox:
        run = sandbox.run_python("block = bytearray(4 * 1024 ** 3)\nprint(len(block))")
        assert not run.ok and not run.timed_out and "MemoryError" in run.stderr
        call = {"function": {"name": "python", "arguments": {"code": "block = bytearray(4 * 1024 ** 3)"}}}
        assert run_tool_call(sandbox, call) == "error: MemoryError"


def test_without_bubblewrap_tools_are_refused_unless_weak_is_allowed(monkeypatch):
    """(The weak sandbox, where allowed: test_weak_sandbox.py.)"""
    monkeypatch.setattr(sandbox_module, "_weak_used", threading.Event())  # this test's figure only
    missing = f"/nonexistent/bwrap-{uuid.uuid4().hex}"
    with pytest.raises(SandboxUnavailable, match="not installed.*sandbox.allow_weak"):
        with Sandbox(bwrap=missing):
            pass
    assert sandbox_module.figures() == {}
