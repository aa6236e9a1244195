"""A throw-away sandbox per episode: a fresh working folder, tool code in a limited subprocess.

Every tool call runs ``python -I`` in the episode's own temporary folder, with
- time: a wall-clock timeout (the process group is killed) and ``RLIMIT_CPU``;
- memory: ``RLIMIT_AS``; files: ``RLIMIT_FSIZE``; processes: ``RLIMIT_NPROC`` where it applies;
- no network: a fresh network namespace with only a down loopback (``unshare -rn``, unprivileged
  user namespaces) where the kernel allows it, and in every case an audit hook installed before the
  tool's code runs that refuses socket connect / bind / getaddrinfo (a Python-level guard: it also
  covers kernels without user namespaces, but not native code that opens sockets itself).
Nothing is kept: the folder is deleted when the episode ends, whatever happened.
"""
from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# runs first in the child: no sockets from Python, then the tool's code from stdin
_GUARD = """
import sys
def _no_network(event, args):
    if event in ("socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "socket.sendmsg"):
        raise PermissionError("the sandbox has no network (" + event + ")")
sys.addaudithook(_no_network)
del _no_network
__code = sys.stdin.read()
exec(compile(__code, "<tool>", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_chars: int = 2000  # what a tool result gives back to the model
    max_file_mb: int = 16


@dataclass(frozen=True)
class ToolRun:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` can give a child its own (empty) network namespace here."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Sandbox:
    """One episode's sandbox; use as a context manager so its folder always goes away."""

    def __init__(self, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits
        self.folder: Path | None = None

    def __enter__(self) -> "Sandbox":
        self.folder = Path(tempfile.mkdtemp(prefix="milestream-episode-"))
        return self

    def __exit__(self, *exc) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def run_python(self, code: str) -> ToolRun:
        if self.folder is None:
            raise RuntimeError("the sandbox is closed: run tools inside `with Sandbox(...)`")
        command = [sys.executable, "-I", "-c", _GUARD]
        if network_namespace_available():
            command = ["unshare", "-rn", *command]
        process = subprocess.Popen(command, cwd=self.folder, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=self._env(),
                                   preexec_fn=self._limit, start_new_session=True)
        try:
            stdout, stderr = process.communicate(code, timeout=self.limits.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            timed_out = True
        cut = self.limits.max_output_chars
        return ToolRun(stdout[:cut], stderr[-cut:], process.returncode, timed_out)

    def _env(self) -> dict[str, str]:
        return {"PATH": os.defpath, "HOME": str(self.folder), "TMPDIR": str(self.folder), "LANG": "C.UTF-8"}

    def _limit(self) -> None:
        """In the child, before exec: the resource limits (inherited through unshare)."""
        megabyte = 1024 * 1024
        cpu_s = max(1, int(self.limits.timeout_s) + 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (self.limits.memory_mb * megabyte,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limits.max_file_mb * megabyte,) * 2)
