"""A memory + pids cgroup per sandbox run, where the trainer may create one (cgroup v2, or v1 controllers).

The kernel then bounds everything the run's processes use, resident or not (tmpfs, page cache, kernel
memory), which init's polled accounting cannot. Without a writable cgroup the sandbox still runs: init's
accounting holds the total resident memory, and `reason` says why no cgroup was used.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

_ROOT = "/sys/fs/cgroup"
_LAUNCHER_SLACK_BYTES = 64 * 2**20  # launcher, namespace holder and init are in the cgroup too
_CHAIN_PROCESSES = 3                # the same three, against pids.max
STALE_PREFIX, STALE_SECONDS = "titan-sandbox-", 60.0


@dataclass(kw_only=True)
class RunCgroup:
    dirs: list[str]        # one per hierarchy (v2: one; v1: memory and pids)
    version: int
    limit_bytes: int

    def describe(self) -> str:
        return f"cgroup v{self.version}: memory of all the run's processes <= {self.limit_bytes} bytes, kernel-enforced"

    def peak_and_oom_kills(self) -> tuple[int, int]:
        """The kernel's peak memory of the run and how many of its processes the OOM killer ended."""
        memory_dir = self.dirs[0]
        peak_file, events_file = (("memory.peak", "memory.events") if self.version == 2
                                  else ("memory.max_usage_in_bytes", "memory.oom_control"))
        peak = _read_int(os.path.join(memory_dir, peak_file))
        try:
            with open(os.path.join(memory_dir, events_file)) as f:
                kills = next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
        except OSError:
            kills = 0
        return peak, kills

    def remove(self, *, wait_seconds: float = 2.0) -> None:
        """Removes the run's cgroups once their (killed) processes are gone."""
        deadline = time.monotonic() + wait_seconds
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        warnings.warn(f"sandbox: could not remove cgroup {d}: {e.strerror}", RuntimeWarning)
                        break
                    time.sleep(0.02)


def _read_int(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _own_cgroups() -> dict[str, str]:
    """Controller (v1) or "" (v2) -> this process's cgroup path."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                own[c] = path
    return own


def _remove_stale(parent: str) -> None:
    """Empty run cgroups left by a trainer that died (it could not remove them); a minute old at least,
    so that a run being set up right now (created, not yet joined) is left alone."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(STALE_PREFIX)]
    except OSError:
        return
    for n in names:
        path = os.path.join(parent, n)
        try:
            if time.time() - os.stat(path).st_ctime > STALE_SECONDS:
                os.rmdir(path)  # fails (EBUSY) while any process is inside
        except OSError:
            pass


def make_run_cgroup(name: str, *, memory_bytes: int, max_processes: int) -> tuple[RunCgroup | None, str]:
    """Creates the run's cgroup(s) with the limits set; returns (cgroup, "") or (None, why not)."""
    limit = memory_bytes + _LAUNCHER_SLACK_BYTES
    pids = max_processes + _CHAIN_PROCESSES
    try:
        own = _own_cgroups()
        if os.path.exists(os.path.join(_ROOT, "cgroup.controllers")) and "" in own:
            parent = _ROOT + own[""].rstrip("/")
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            if not {"memory", "pids"} <= set(enabled):
                return None, (f"cgroup v2: memory and pids are not delegated to {parent} "
                              f"(cgroup.subtree_control: {enabled})")
            d = os.path.join(parent, name)
            _remove_stale(parent)
            os.mkdir(d)
            cgroup = RunCgroup(dirs=[d], version=2, limit_bytes=limit)
            files = [(d, "memory.max", limit), (d, "memory.swap.max", 0), (d, "pids.max", pids)]
        elif os.path.isdir(os.path.join(_ROOT, "memory")) and os.path.isdir(os.path.join(_ROOT, "pids")):
            dirs = [os.path.join(_ROOT, c) + own.get(c, "/").rstrip("/") + "/" + name for c in ("memory", "pids")]
            cgroup = RunCgroup(dirs=[], version=1, limit_bytes=limit)
            for d in dirs:
                _remove_stale(os.path.dirname(d))
                os.mkdir(d)
                cgroup.dirs.append(d)
            files = [(dirs[0], "memory.limit_in_bytes", limit), (dirs[0], "memory.memsw.limit_in_bytes", limit),
                     (dirs[1], "pids.max", pids)]
        else:
            return None, f"no cgroup v2 nor v1 memory and pids controllers under {_ROOT}"
    except OSError as e:
        return None, f"cannot create a cgroup: {e.strerror} ({e.filename})"
    optional = ("memory.memsw.limit_in_bytes", "memory.swap.max")  # absent without swap accounting
    try:
        for d, key, value in files:
            if key not in optional or os.path.exists(os.path.join(d, key)):
                _write(os.path.join(d, key), value)
    except OSError as e:
        cgroup.remove(wait_seconds=0)
        return None, f"cannot set {key} in {d}: {e.strerror}"
    return cgroup, ""
