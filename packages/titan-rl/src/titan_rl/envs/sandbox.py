"""Runs untrusted Python (model output) in a separate, limited process.

Layers, from strongest to weakest:

1. Kernel limits set in the child before exec (`resource`): CPU seconds (RLIMIT_CPU), address space
   (RLIMIT_AS), file size (RLIMIT_FSIZE), open files, and a wall-clock timeout in the parent that
   kills the child's whole process group.
2. No network: the child enters new user + network namespaces (`unshare(CLONE_NEWUSER | CLONE_NEWNET)`
   through libc) where only a downed loopback exists, so no socket can reach anything. Where the
   kernel forbids unprivileged namespaces, `SandboxConfig.network="audit"` (or "auto" falling back)
   relies on layer 3 alone; `SandboxResult.network_isolation` says which one was used.
3. An audit hook (PEP 578) installed before the untrusted code runs: it refuses sockets, subprocesses,
   exec/fork, ctypes, and opening files for writing outside the throwaway directory, and reports each
   attempt to the parent over a pipe. Audit hooks are not a security boundary on their own (the
   kernel layers are); they make escape attempts fail early and visible.

The child runs `python -I` (no user site, no PYTHON* variables) with an empty environment, in a fresh
temporary directory that is deleted afterwards.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

NetworkIsolation = Literal["namespace", "audit"]
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

# Runs in the child before the untrusted code; argv: [report_fd, workdir, program_path].
_BOOTSTRAP = r'''
import os, sys
_fd, _root, _prog = int(sys.argv[1]), os.path.realpath(sys.argv[2]), sys.argv[3]
_BLOCKED = ("socket.", "subprocess.", "os.exec", "os.fork", "os.posix_spawn", "os.spawn", "os.system",
            "os.kill", "os.killpg", "pty.", "ctypes.", "os.chdir", "os.chroot", "os.chmod", "os.chown")
def _report(what):
    try:
        os.write(_fd, (what.replace("\n", " ")[:300] + "\n").encode())
    except OSError:
        pass
def _hook(event, args):
    if event.startswith(_BLOCKED):
        _report(event)
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args and args[0] in ("ctypes", "_ctypes"):
        _report("import " + args[0])
        raise PermissionError("sandbox: ctypes is not allowed")
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "r", args[2] or 0
        writing = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND)
        if writing:
            path = os.path.realpath(os.fsdecode(args[0]))
            if path != _root and not path.startswith(_root + os.sep):
                _report(f"open for writing outside the sandbox: {path}")
                raise PermissionError(f"sandbox: writing {path} is not allowed")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.link"):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path != _root and not path.startswith(_root + os.sep):
            _report(f"{event} outside the sandbox: {path}")
            raise PermissionError(f"sandbox: {event} on {path} is not allowed")
with open(_prog, encoding="utf-8") as _f:
    _code = compile(_f.read(), "solution.py", "exec")
sys.addaudithook(_hook)
del _hook
exec(_code, {"__name__": "__main__"})
'''


@dataclass(kw_only=True, frozen=True)
class SandboxConfig:
    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20
    file_size_bytes: int = 8 * 2**20
    max_output_bytes: int = 64 * 2**10
    network: Literal["auto", "namespace", "audit"] = "auto"

    def __post_init__(self) -> None:
        if self.cpu_seconds < 1 or self.wall_seconds <= 0:
            raise ValueError(f"cpu_seconds={self.cpu_seconds}, wall_seconds={self.wall_seconds}; need cpu_seconds >= 1, wall_seconds > 0")
        if self.memory_bytes < 64 * 2**20:
            raise ValueError(f"memory_bytes={self.memory_bytes}; Python needs at least 64 MiB to start")
        if self.network not in ("auto", "namespace", "audit"):
            raise ValueError(f"network={self.network!r}; allowed: 'auto', 'namespace', 'audit'")


@dataclass(kw_only=True)
class SandboxResult:
    status: Literal["ok", "error", "cpu_limit", "wall_timeout", "memory_limit", "violation"]
    returncode: int | None
    stdout: str
    stderr: str
    violations: list[str] = field(default_factory=list)  # blocked escape attempts, in order
    network_isolation: NetworkIsolation = "audit"
    seconds: float = 0.0


_namespaces_work: bool | None = None


def network_namespaces_available() -> bool:
    """Whether this kernel lets the child unshare a user + network namespace (probed once, in a fork)."""
    global _namespaces_work
    if _namespaces_work is None:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os._exit(0 if _unshare_network() else 1)
        _, status = os.waitpid(pid, 0)
        _namespaces_work = os.waitstatus_to_exitcode(status) == 0
    return _namespaces_work


def _unshare_network() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0


def run_sandboxed(source: str, config: SandboxConfig | None = None, *, stdin: str = "") -> SandboxResult:
    """Runs `source` as a Python program under the limits of `config` (default SandboxConfig());
    never raises for what the program does."""
    config = config or SandboxConfig()
    if config.network == "namespace" and not network_namespaces_available():
        raise ValueError("network='namespace' but this kernel refuses unprivileged network namespaces; use 'auto' or 'audit'")
    use_namespace = config.network != "audit" and network_namespaces_available()

    def limit_child() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_seconds, config.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (config.memory_bytes, config.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (config.file_size_bytes, config.file_size_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if use_namespace and not _unshare_network():
            os._exit(121)

    read_fd, write_fd = os.pipe()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="titan-sandbox-") as workdir:
        program = os.path.join(workdir, "solution.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP, str(write_fd), workdir, program],
                cwd=workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(write_fd,), preexec_fn=limit_child, start_new_session=True,
            )
        finally:
            os.close(write_fd)
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=config.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        with os.fdopen(read_fd, "rb") as reports:
            violations = [line for line in reports.read().decode(errors="replace").splitlines() if line]
    rc = proc.returncode
    stderr = err[: config.max_output_bytes].decode(errors="replace")
    if timed_out:
        status = "wall_timeout"
    elif rc in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out and time.monotonic() - start >= config.cpu_seconds * 0.5:
        status = "cpu_limit"
    elif "MemoryError" in stderr:
        status = "memory_limit"
    elif violations:
        status = "violation"
    elif rc == 0:
        status = "ok"
    else:
        status = "error"
    return SandboxResult(
        status=status, returncode=rc, stdout=out[: config.max_output_bytes].decode(errors="replace"), stderr=stderr,
        violations=violations, network_isolation="namespace" if use_namespace else "audit",
        seconds=time.monotonic() - start,
    )
