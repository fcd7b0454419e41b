"""Starts one sandboxed program: `python -I -S sandbox_launcher.py JOB_JSON`, run by `sandbox.run_sandboxed`.

Process chain (isolated mode):
  launcher (the trainer's credentials; writes the uid/gid maps of)
  -> holder (new user, PID, mount, network, IPC, UTS and cgroup namespaces)
  -> init (PID 1 of the new PID namespace): builds the filesystem view, drops to uid 1000 without
     capabilities, starts the program, adds up the memory and CPU time of every process in the
     namespace, and kills them all when the program ends or a limit is crossed.
When init dies the kernel kills everything left in its PID namespace, so nothing outlives the call
or holds the trainer's pipes. Each process dies with its parent (PR_SET_PDEATHSIG), so killing the
launcher's process group from the trainer tears the whole chain down.

Standard library only: this file runs with `-S`, before and without the project's environment.
Reports go to the status pipe as JSON lines; the program never holds that pipe.
"""
import ctypes
import json
import os
import platform
import resource
import signal
import sys
import time

_libc = ctypes.CDLL(None, use_errno=True)
_NAMESPACES = 0x10000000 | 0x20000000 | 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000 | 0x02000000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_MNT_DETACH, _AT_FDCWD, _AT_RECURSIVE = 2, -100, 0x8000
_ATTR_RDONLY, _ATTR_NOSUID, _ATTR_NODEV = 1, 2, 4
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_MOUNT_SETATTR = 442  # same number on every architecture (added after the syscall tables were unified)
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 1, 38, 22, 2
# (audit arch, memfd_create) per machine; memfd_secret is 447 on both
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 319), "aarch64": (0xC00000B7, 279)}
INSIDE_UID = 1000      # the program's uid (and gid) inside the namespace
_NOBODY = 65534        # what INSIDE_UID maps to outside when the trainer is root
# Read-only system directories; the Python installation is added from the job. Everything else
# (/home, /root, /tmp, /run, /var, /proc and /sys of the host, the repository) is not mounted.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_POLL_SECONDS = 0.01


class SetupError(Exception):
    """The sandbox could not be built; nothing untrusted has run."""


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else os.fsencode(s)
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or ''} on {target}")


def _set_read_only(path: str, *, recursive: bool) -> None:
    attr = _MountAttr(attr_set=_ATTR_RDONLY | _ATTR_NOSUID | _ATTR_NODEV)
    rc = _libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, os.fsencode(path), _AT_RECURSIVE if recursive else 0,
                       ctypes.byref(attr), ctypes.sizeof(attr))
    _check(rc, f"mount_setattr(read-only) {path} (needs Linux >= 5.12)")


def _report(status_fd: int, **fields) -> None:
    os.write(status_fd, (json.dumps(fields) + "\n").encode())


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# ---------------------------------------------------------------- the chain of processes

def run_isolated(job: dict, status_fd: int) -> int:
    """Forks the holder, which unshares the namespaces; writes its uid/gid maps from out here."""
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        _guarded(status_fd, lambda: _holder(job, status_fd, unshared_w, mapped_r))
    os.close(unshared_w)
    os.close(mapped_r)
    if os.read(unshared_r, 1) == b"1":
        try:
            _write_id_maps(holder)
            os.write(mapped_w, b"1")
        except (OSError, SetupError) as e:
            _report(status_fd, setup_error=f"writing the uid/gid maps: {e}")
    os.close(mapped_w)
    _, status = os.waitpid(holder, 0)
    return os.waitstatus_to_exitcode(status)


def _guarded(status_fd: int, body) -> None:
    """Runs a forked child's body; a setup failure is reported and the child exits 125."""
    try:
        body()
    except (SetupError, OSError) as e:
        _report(status_fd, setup_error=str(e))
        os._exit(125)
    os._exit(0)


def _write_id_maps(pid: int) -> None:
    """Maps inside 0 to the launcher's uid and, where the launcher may (root with uid 65534 mapped),
    INSIDE_UID to nobody; otherwise only 0 is mapped and init drops through a nested namespace."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        try:
            _write(f"/proc/{pid}/uid_map", f"0 0 1\n{INSIDE_UID} {_NOBODY} 1\n")
            _write(f"/proc/{pid}/gid_map", f"0 0 1\n{INSIDE_UID} {_NOBODY} 1\n")
            return
        except OSError:  # root of a user namespace where nobody is not mapped
            pass
    _write(f"/proc/{pid}/setgroups", "deny")
    _write(f"/proc/{pid}/uid_map", f"0 {uid} 1\n")
    _write(f"/proc/{pid}/gid_map", f"0 {gid} 1\n")


def _holder(job: dict, status_fd: int, unshared_w: int, mapped_r: int) -> None:
    _check(_libc.unshare(_NAMESPACES), "unshare(user, pid, mount, network, ipc, uts, cgroup namespaces)")
    _die_with_parent()  # after unshare: changing credentials clears the setting
    os.write(unshared_w, b"1")
    os.close(unshared_w)
    if os.read(mapped_r, 1) != b"1":
        os._exit(125)  # the launcher reported why
    init = os.fork()
    if init == 0:
        _guarded(status_fd, lambda: _init(job, status_fd))
    _, status = os.waitpid(init, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _init(job: dict, status_fd: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # init ignores default-action signals from inside
    two_ids = _inside_uid_mapped()
    enforced = _build_view(job, nested_drop=not two_ids)
    workdir, stdin_fd = _prepare_workdir(job, chown=two_ids)
    _write("/proc/self/oom_score_adj", "1000")  # the cgroup's OOM killer takes the sandbox, not the launcher
    enforced += _drop_privileges(two_ids, job["trainer_uid"])
    enforced += _deny_anonymous_memory_files()
    _die_with_parent()  # again: dropping privileges cleared it
    _report(status_fd, setup="ok", enforced=enforced, workdir=workdir)
    program = os.fork()
    if program == 0:
        _exec_program(job, workdir, stdin_fd, status_fd)
    os.close(stdin_fd)
    for fd in (0, 1, 2):  # only the program's processes hold the trainer's pipes
        os.dup2(os.open("/dev/null", os.O_RDWR), fd)
    try:
        outcome = _supervise(program, job["limits"])
    except OSError as e:  # after setup: the program's result is lost, not the sandbox
        _kill_all()
        outcome = {"returncode": None, "killed_for": None, "supervisor_error": str(e)}
    _report(status_fd, **outcome)


# ---------------------------------------------------------------- the filesystem view

def _build_view(job: dict, *, nested_drop: bool) -> list[str]:
    """A tmpfs root holding read-only binds of the system and the Python installation, a fresh /dev,
    /proc of the new PID namespace, and a size-limited writable /tmp; then pivot_root into it."""
    root = job["newroot"]
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount propagates back to the host
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
    os.mkdir(root + "/tmp")  # first: a Python installation under /tmp is bound inside it below
    _mount("tmpfs", root + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={job['limits']['scratch_bytes']},nr_inodes=4096,mode=1777")
    exposed: list[str] = []
    for path in list(_SYSTEM_DIRS) + sorted(job["expose"], key=len):
        _expose(path, root, exposed)
    _make_dev(root)
    enforced = ["user, PID, mount, network, IPC, UTS and cgroup namespaces",
                "read-only root with only /tmp writable (%d bytes)" % job["limits"]["scratch_bytes"]]
    enforced += _make_proc(root, nested_drop=nested_drop)
    for secret in _SECRETS:
        if os.path.isfile(root + secret):
            _mount(root + "/dev/null", root + secret, None, _MS_BIND)
    _set_read_only(root, recursive=False)
    os.chdir(root)
    _check(_libc.syscall(_SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "detaching the host's root")
    os.chdir("/")
    return enforced


def _expose(path: str, root: str, exposed: list[str]) -> None:
    """Binds `path` read-only at the same place under `root`; a symlinked path becomes a symlink."""
    real = os.path.realpath(path)
    if not os.path.exists(real):
        return
    if not any(real == e or real.startswith(e.rstrip("/") + "/") for e in exposed):
        target = root + real
        if os.path.isdir(real):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        _mount(real, target, None, _MS_BIND | _MS_REC)
        _set_read_only(target, recursive=True)
        exposed.append(real)
    if path != real and not os.path.lexists(root + path):
        try:
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(real, root + path)
        except OSError:
            pass  # its directory lies inside a read-only bind, where the host's own link already is


def _make_dev(root: str) -> None:
    dev = root + "/dev"
    os.mkdir(dev)
    _mount("tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=755")
    for name in _DEVICES:
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, _MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, f"{dev}/{name}")
    _set_read_only(dev, recursive=False)


def _make_proc(root: str, *, nested_drop: bool) -> list[str]:
    """/proc of the new PID namespace (only the sandbox's processes: init accounts them through it),
    and no memory that no process maps: no nested user namespaces (a program could mount its own
    tmpfs in one), no System V shared memory or message queues (the IPC namespace's own limits).
    Any of these refused means the sandbox is refused: each would be a way around the limits."""
    proc = root + "/proc"
    os.mkdir(proc)
    try:
        _mount("proc", proc, "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except SetupError as e:  # e.g. containers whose /proc is partly masked
        raise SetupError(f"{e}: a fresh /proc for the PID namespace, needed to account its total memory "
                         "and CPU") from None
    limits = (("user/max_user_namespaces", "1" if nested_drop else "0", "no nested user namespaces"),
              ("kernel/shmmni", "0", "no System V shared memory"), ("kernel/msgmni", "0", "no System V message queues"))
    for key, value, _ in limits:  # init's own drop may need the one nested user namespace
        try:
            _write(f"{proc}/sys/{key}", value)
        except OSError as e:
            raise SetupError(f"setting {key} to {value} in the namespace: {e.strerror}") from None
    return ["fresh /proc: total memory and CPU of all processes accounted"] + [what for _, _, what in limits]


def _inside_uid_mapped() -> bool:
    with open("/proc/self/uid_map") as f:
        return any(line.split()[0] == str(INSIDE_UID) for line in f if line.strip())


def _prepare_workdir(job: dict, *, chown: bool) -> tuple[str, int]:
    workdir = "/tmp/" + job["workdir_name"]
    os.mkdir(workdir, 0o700)
    for name, text in job["files"].items():
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    with open("/tmp/.stdin", "w", encoding="utf-8") as f:
        f.write(job["stdin"])
    stdin_fd = os.open("/tmp/.stdin", os.O_RDONLY)
    os.unlink("/tmp/.stdin")
    if chown:
        for dirpath, _, names in os.walk(workdir):
            for p in [dirpath] + [os.path.join(dirpath, n) for n in names]:
                os.chown(p, INSIDE_UID, INSIDE_UID)
    return workdir, stdin_fd


def _drop_privileges(two_ids: bool, trainer_uid: int) -> list[str]:
    if two_ids:
        os.setgroups([])
        how = f"runs as uid {INSIDE_UID} (uid {_NOBODY} outside), no capabilities, no supplementary groups"
    else:  # a nested namespace whose only uid maps to ours; setresuid away from 0 clears capabilities
        _check(_libc.unshare(_CLONE_NEWUSER), "unshare(user namespace) to drop capabilities")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{INSIDE_UID} 0 1\n")
        _write("/proc/self/gid_map", f"{INSIDE_UID} 0 1\n")
        how = f"runs as uid {INSIDE_UID} (the trainer's uid outside), no capabilities"
        if trainer_uid == 0:
            how += "; RLIMIT_NPROC not enforced (the kernel exempts root outside), total CPU/memory still are"
    os.setresgid(INSIDE_UID, INSIDE_UID, INSIDE_UID)
    os.setresuid(INSIDE_UID, INSIDE_UID, INSIDE_UID)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    return [how]


def _deny_anonymous_memory_files() -> list[str]:
    """seccomp: memfd_create and memfd_secret fail with EPERM (their pages, written and never mapped,
    are in no process's resident size, so init could not account them); other ABIs are killed."""
    arch, memfd = _SECCOMP_ARCH[platform.machine()]
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    deny, allow, kill = 0x00050000 | 1, 0x7FFF0000, 0x80000000  # SECCOMP_RET_ERRNO | EPERM, ALLOW, KILL_PROCESS
    program = [(ld_abs, 0, 0, 4), (jeq, 0, 6, arch), (ld_abs, 0, 0, 0),
               (jge, 3, 0, 0x40000000),  # the x32 ABI numbers syscalls from here
               (jeq, 2, 0, memfd), (jeq, 1, 0, 447), (ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, kill)]
    filters = (_SockFilter * len(program))(*(_SockFilter(*i) for i in program))
    prog = _SockFprog(len(program), filters)
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp filter")
    return ["no memfd (seccomp)"]


# ---------------------------------------------------------------- the program and its supervision

def _set_limits(limits: dict, *, extra_processes: int) -> None:
    cpu = limits["cpu_seconds"]
    for which, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
                         (resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2),
                         (resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2),
                         (resource.RLIMIT_NPROC, (limits["max_processes"] + extra_processes,) * 2),
                         (resource.RLIMIT_MSGQUEUE, (0, 0)),  # POSIX message queues: unaccounted memory
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(which, value)


def _exec_program(job: dict, workdir: str, stdin_fd: int, status_fd: int) -> None:
    try:
        _set_limits(job["limits"], extra_processes=1)  # init shares the uid and counts
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        os.close(status_fd)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(workdir)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": "/tmp"}
        os.execve(job["python"], [job["python"], "-I", job["main"]], env)
    except BaseException as e:  # noqa: BLE001 - nothing may escape a forked child
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
    os._exit(127)


def _supervise(program: int, limits: dict) -> dict:
    """Reaps every process (init is the namespace's reaper) until the program exits or the namespace's
    total resident memory or CPU time crosses its limit; then kills whatever is left."""
    page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    program_status, killed_for, peak = None, None, 0
    # The trainer kills the namespace at the wall limit; this is a backstop should it have died.
    deadline = time.monotonic() + limits["wall_seconds"] + 5.0
    while program_status is None and time.monotonic() < deadline:
        program_status = _reap(program)
        if program_status is not None:
            break
        resident, live_ticks = _account_live(page)
        peak = max(peak, resident)
        t = os.times()
        if resident > limits["memory_bytes"]:
            killed_for = "memory"
        elif live_ticks / tick + t.children_user + t.children_system > limits["cpu_seconds"]:
            killed_for = "cpu"
        if killed_for:
            break
        time.sleep(_POLL_SECONDS)
    if program_status is None and killed_for is None:
        killed_for = "wall"
    _kill_all()
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == program:
            program_status = status
    t = os.times()
    return {"returncode": None if program_status is None else os.waitstatus_to_exitcode(program_status),
            "killed_for": killed_for, "peak_memory_bytes": peak,
            "cpu_seconds": round(t.children_user + t.children_system, 3)}


def _reap(program: int):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        if pid == program:
            return status


def _account_live(page: int) -> tuple[int, int]:
    """Sum of resident memory (bytes) and CPU clock ticks of every live process but init."""
    resident = ticks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/statm") as f:
                resident += int(f.read().split()[1]) * page
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
    return resident, ticks


def _kill_all() -> None:
    try:
        os.kill(-1, signal.SIGKILL)  # from init: every process of the namespace but init itself
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- opt-in mode without isolation

def run_unisolated(job: dict, status_fd: int) -> int:
    """Resource limits only (the user opted in): the program sees what the trainer sees."""
    workdir = os.path.join(job["host_dir"], job["workdir_name"])
    os.mkdir(workdir, 0o700)
    for name, text in job["files"].items():
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    stdin_path = os.path.join(job["host_dir"], ".stdin")
    with open(stdin_path, "w", encoding="utf-8") as f:
        f.write(job["stdin"])
    stdin_fd = os.open(stdin_path, os.O_RDONLY)
    _report(status_fd, setup="ok", workdir=workdir,
            enforced=["per-process rlimits (CPU, address space, file size, open files, processes)"])
    program = os.fork()
    if program == 0:
        _exec_program(job, workdir, stdin_fd, status_fd)
    _, status = os.waitpid(program, 0)
    t = os.times()
    _report(status_fd, returncode=os.waitstatus_to_exitcode(status), killed_for=None, peak_memory_bytes=0,
            cpu_seconds=round(t.children_user + t.children_system, 3))
    return 0


def main(job_path: str) -> int:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    status_fd = job["status_fd"]
    _die_with_parent()  # the trainer (its thread that started us waits for us)
    if os.getppid() != job["trainer_pid"]:
        return 125  # the trainer died before PR_SET_PDEATHSIG took hold
    try:
        for procs in job["cgroup_procs"]:  # the trainer made them; everything forked from here is inside
            _write(procs, str(os.getpid()))
    except OSError as e:
        _report(status_fd, setup_error=f"joining the run's cgroup {procs}: {e.strerror}")
        return 125
    if job["isolate"]:
        return run_isolated(job, status_fd)
    return run_unisolated(job, status_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
