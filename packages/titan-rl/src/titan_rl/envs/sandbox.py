"""Runs untrusted Python (model output) isolated by the kernel, not by Python.

The program runs in new user, PID, mount, network, IPC, UTS and cgroup namespaces
(`sandbox_launcher.py` builds them with unshare(2); no extra package is needed):
- as uid 1000 without capabilities (uid 65534 outside when the trainer is root, else the trainer's uid);
- on a read-only view holding only the system directories (/usr, /etc, ...) and the Python installation,
  a fresh /dev and /proc, and a size-limited throwaway /tmp (its working directory) as the only writable
  place; /etc/shadow and /etc/gshadow read as empty; home directories, the repository, the host's /tmp
  and /proc are not there;
- without network (only a downed loopback) and without sight of any process outside its namespace;
- under per-process rlimits (CPU seconds, address space, file size, open files, processes) and, from
  the namespace's init, limits on the total resident memory and CPU time of all its processes (polled
  every 10 ms); memory no process maps (memfd, System V IPC, POSIX queues) cannot be made, so beyond
  the resident size there is only /tmp's tmpfs and kernel buffers; where the trainer may create a
  cgroup (sandbox_cgroup.py), the kernel also caps the run's memory and processes, all of it;
- with stdout and stderr read incrementally up to `max_output_bytes` each (more kills the program), and
  the whole namespace killed at the end, so no process outlives the call or holds its pipes.

Where the kernel refuses any of that, `run_sandboxed` raises `SandboxUnavailable` saying what failed;
`SandboxConfig(allow_unisolated=True)` opts in to running with rlimits only, which is not safe for
untrusted code. `sandbox_support()` reports what this machine allows.
"""
from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

from titan_rl.envs.sandbox_cgroup import make_run_cgroup

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
_STATUS_CAP_BYTES = 1 << 20
_SETUP_ATTEMPTS, _CGROUP_VANISHED = 3, "joining the run's cgroup"  # sandbox_launcher's error when it is gone
_KILL_GRACE_SECONDS = 2.0  # after a kill, how long the pipes may take to close (the kernel's teardown)

Status = Literal["ok", "error", "cpu_limit", "wall_timeout", "memory_limit", "output_limit"]


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate the program and the config did not opt in to running it anyway."""


@dataclass(kw_only=True, frozen=True)
class SandboxConfig:
    cpu_seconds: int = 2
    """CPU seconds, per process (RLIMIT_CPU) and in total over the namespace."""
    wall_seconds: float = 5.0
    """Wall-clock limit of the whole call, setup included."""
    memory_bytes: int = 512 * 2**20
    """Address space per process (RLIMIT_AS) and total resident memory over the namespace."""
    file_size_bytes: int = 8 * 2**20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    scratch_bytes: int = 32 * 2**20
    """Size of the writable /tmp (a tmpfs holding the working directory); memory outside `memory_bytes`."""
    max_output_bytes: int = 64 * 2**10
    """Bytes kept of stdout and of stderr each; writing more ends the program (status 'output_limit')."""
    max_processes: int = 16
    """Processes the program may run at once (RLIMIT_NPROC in its own user namespace)."""
    max_open_files: int = 64
    """Open files per process (RLIMIT_NOFILE)."""
    allow_unisolated: bool = False
    """Run with rlimits only where the kernel refuses namespaces; the program can then read and write
    what the trainer can, use the network and signal the trainer. Never for untrusted code."""

    def __post_init__(self) -> None:
        if self.cpu_seconds < 1 or self.wall_seconds <= 0:
            raise ValueError(f"cpu_seconds={self.cpu_seconds}, wall_seconds={self.wall_seconds}; need cpu_seconds >= 1, wall_seconds > 0")
        if self.memory_bytes < 64 * 2**20:
            raise ValueError(f"memory_bytes={self.memory_bytes}; Python needs at least 64 MiB to start")
        for name in ("file_size_bytes", "scratch_bytes", "max_output_bytes", "max_processes", "max_open_files"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; must be >= 1")
        if self.max_open_files < 8:
            raise ValueError(f"max_open_files={self.max_open_files}; Python needs at least 8 to start")


@dataclass(kw_only=True)
class SandboxResult:
    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    enforced: tuple[str, ...] = ()  # what isolated this run, in words
    isolated: bool = True           # False only when allow_unisolated ran it with rlimits alone
    peak_memory_bytes: int = 0      # largest total resident memory seen over the namespace
    cpu_seconds: float = 0.0        # CPU time of all its processes
    seconds: float = 0.0            # wall clock of the call


@dataclass(kw_only=True, frozen=True)
class SandboxSupport:
    isolated: bool                  # namespaces and the read-only view could be built here
    enforced: tuple[str, ...]       # what a run here enforces
    problem: str | None             # why not, when not isolated


@functools.cache
def sandbox_support() -> SandboxSupport:
    """Builds the sandbox once around an empty program and reports what this machine allows."""
    report, _, err, _ = _launch("", {}, "", SandboxConfig(wall_seconds=60.0), isolate=True)
    if report.get("setup") == "ok" and report.get("returncode") == 0:
        return SandboxSupport(isolated=True, enforced=tuple(report.get("enforced", ())), problem=None)
    problem = report.get("setup_error") or f"the launcher failed: {err.decode(errors='replace')[-500:] or report}"
    return SandboxSupport(isolated=False, enforced=(), problem=problem)


def network_namespaces_available() -> bool:
    """Whether the full sandbox (network namespace included) can be built on this machine."""
    return sandbox_support().isolated


def run_sandboxed(source: str, config: SandboxConfig | None = None, *, stdin: str = "",
                  files: dict[str, str] | None = None) -> SandboxResult:
    """Runs `source` as the main Python program (`main.py` in a fresh working directory, next to
    `files`, name -> text) under the limits of `config` (default SandboxConfig()); never raises for
    what the program does. Raises SandboxUnavailable where it cannot isolate (see allow_unisolated)."""
    config = config or SandboxConfig()
    files = dict(files or {})
    if "main.py" in files or any(os.sep in name or name.startswith(".") for name in files):
        raise ValueError(f"files={sorted(files)}; names must be plain, not hidden, and not 'main.py'")
    size = sum(len(t.encode()) for t in [source, stdin, *files.values()])
    if size > config.scratch_bytes // 2:
        raise ValueError(f"source, stdin and files hold {size} bytes; the sandbox's /tmp holds scratch_bytes="
                         f"{config.scratch_bytes}: keep them under half of it, or raise scratch_bytes")
    support = sandbox_support()
    if not support.isolated and not config.allow_unisolated:
        raise SandboxUnavailable(
            f"cannot isolate untrusted code on this machine: {support.problem}. The sandbox needs "
            "unprivileged user namespaces (with PID, mount and network namespaces inside them; see "
            "sysctls user.max_user_namespaces, kernel.unprivileged_userns_clone, "
            "kernel.apparmor_restrict_unprivileged_userns, or a container's seccomp profile), a fresh "
            "/proc, mount_setattr (Linux >= 5.12) and pivot_root. To run anyway with resource limits only "
            "(the program could then read and write what the trainer can, use the network and signal "
            "the trainer), pass SandboxConfig(allow_unisolated=True).")
    start = time.monotonic()
    for _ in range(_SETUP_ATTEMPTS):
        report, out, err, killed = _launch(source, files, stdin, config, isolate=support.isolated)
        # Another process's stale-cgroup sweep can remove this run's cgroup between its creation and the
        # join; nothing untrusted has run at setup, so the run is built again with a fresh cgroup.
        if not str(report.get("setup_error", "")).startswith(_CGROUP_VANISHED):
            break
    if "setup_error" in report or (killed is None and report.get("setup") != "ok"):
        problem = report.get("setup_error") or err.decode(errors="replace")[-500:]
        raise SandboxUnavailable(f"the sandbox could not be built for this run: {problem}")
    stderr = err.decode(errors="replace")
    rc = report.get("returncode")
    return SandboxResult(
        status=killed or _status(report, rc, stderr, config), returncode=rc,
        stdout=out.decode(errors="replace"), stderr=stderr, enforced=tuple(report.get("enforced", ())),
        isolated=support.isolated, peak_memory_bytes=report.get("peak_memory_bytes", 0),
        cpu_seconds=report.get("cpu_seconds", 0.0), seconds=time.monotonic() - start,
    )


def _status(report: dict, rc: int | None, stderr: str, config: SandboxConfig) -> Status:
    if report.get("killed_for") == "memory" or "MemoryError" in stderr:
        return "memory_limit"
    cpu_killed = rc == -signal.SIGKILL and report.get("cpu_seconds", 0.0) >= config.cpu_seconds * 0.9
    if report.get("killed_for") == "cpu" or rc == -signal.SIGXCPU or cpu_killed:
        return "cpu_limit"
    return "ok" if rc == 0 else "error"


def _launch(source: str, files: dict[str, str], stdin: str, config: SandboxConfig, *,
            isolate: bool) -> tuple[dict, bytes, bytes, Status | None]:
    """Starts the launcher and reads its pipes until they close; returns the merged status reports,
    stdout, stderr, and the status if the call killed the program (wall clock, output size)."""
    status_r, status_w = os.pipe()
    with tempfile.TemporaryDirectory(prefix="titan-sandbox-") as host_dir:
        cgroup, no_cgroup = (None, "") if not isolate else make_run_cgroup(
            os.path.basename(host_dir), memory_bytes=config.memory_bytes + config.scratch_bytes,
            max_processes=config.max_processes)
        try:
            job_path = _write_job(host_dir, source, files, stdin, config, isolate=isolate, status_fd=status_w,
                                  cgroup_procs=[os.path.join(d, "cgroup.procs") for d in cgroup.dirs] if cgroup else [])
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-S", _LAUNCHER, job_path], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                                        start_new_session=True)
            finally:
                os.close(status_w)
            try:
                streams, killed = _read_pipes(proc, status_r, config, deadline=time.monotonic() + config.wall_seconds)
            finally:
                _kill_group(proc)
                proc.wait()
                proc.stdout.close()
                proc.stderr.close()
            report = _merged_reports(streams["status"])
            if cgroup is not None:
                peak, oom_kills = cgroup.peak_and_oom_kills()
                report["peak_memory_bytes"] = max(report.get("peak_memory_bytes", 0), peak)
                if oom_kills:
                    report["killed_for"] = "memory"
        finally:
            if cgroup is not None:
                cgroup.remove()
    if "enforced" in report and isolate:
        report["enforced"].append(cgroup.describe() if cgroup else
                                  f"no cgroup ({no_cgroup}): the total is init's accounting of resident memory")
    return report, bytes(streams["stdout"]), bytes(streams["stderr"]), killed


def _write_job(host_dir: str, source: str, files: dict[str, str], stdin: str, config: SandboxConfig, *,
               isolate: bool, status_fd: int, cgroup_procs: list[str]) -> str:
    """The launcher's instructions, as a file in the run's host directory."""
    job = {
        "isolate": isolate, "status_fd": status_fd, "host_dir": host_dir, "newroot": os.path.join(host_dir, "root"),
        "workdir_name": os.path.basename(host_dir), "files": {**files, "main.py": source}, "main": "main.py",
        "stdin": stdin, "python": sys.executable, "expose": _python_paths(), "cgroup_procs": cgroup_procs,
        "trainer_uid": os.geteuid(), "trainer_pid": os.getpid(),
        "limits": {name: getattr(config, name) for name in (
            "cpu_seconds", "wall_seconds", "memory_bytes", "file_size_bytes", "scratch_bytes", "max_processes",
            "max_open_files")},
    }
    os.mkdir(job["newroot"])
    job_path = os.path.join(host_dir, "job.json")
    with open(job_path, "w", encoding="utf-8") as f:
        json.dump(job, f)
    return job_path


def _merged_reports(status: bytes) -> dict:
    report: dict = {}
    for line in status.decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except json.JSONDecodeError:
            pass
    return report


def _read_pipes(proc: subprocess.Popen, status_r: int, config: SandboxConfig, *,
                deadline: float) -> tuple[dict[str, bytearray], Status | None]:
    """Reads stdout, stderr and the status pipe as data comes, keeping at most the cap of each; kills
    the process group at the deadline or when output exceeds the cap, then drains until EOF."""
    assert proc.stdout is not None and proc.stderr is not None
    names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_r: "status"}
    streams = {name: bytearray() for name in names.values()}
    killed: Status | None = None
    with selectors.DefaultSelector() as selector:
        for fd in names:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if killed is not None:
                    break  # killed, and the pipes still did not close: stop waiting for them
                killed = "wall_timeout"
                _kill_group(proc)
                deadline = time.monotonic() + _KILL_GRACE_SECONDS
                continue
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                name = names[key.fd]
                buf = streams[name]
                room = (_STATUS_CAP_BYTES if name == "status" else config.max_output_bytes) - len(buf)
                buf += chunk[:max(room, 0)]
                if len(chunk) > room and name != "status" and killed is None:
                    killed = "output_limit"
                    _kill_group(proc)
                    deadline = time.monotonic() + _KILL_GRACE_SECONDS
    os.close(status_r)
    return streams, killed


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the launcher's process group: launcher, namespace holder and init, whose death
    makes the kernel kill every process left in the namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _python_paths() -> list[str]:
    """The interpreter and the environment it runs in (site-packages of the venv, the base install)."""
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)}
    return sorted(p for p in paths if p and os.path.isabs(p))
