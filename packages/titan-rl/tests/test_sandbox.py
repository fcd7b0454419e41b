"""The code sandbox: the attacks of issue 27 (which escaped the audit-hook sandbox) and more, each contained.

"Contained" is checked from outside, every time: files outside untouched, no process of the run left
(the host's process list has neither the program's marker nor the launcher), the trainer and a sentinel
process alive, the call back within the wall limit plus a small slack.
"""
from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from titan_rl.envs import CodeTask, SandboxConfig, code_reward, run_sandboxed
from titan_rl.envs.sandbox import _LAUNCHER, sandbox_support
from titan_rl.envs.sandbox_cgroup import make_run_cgroup

SUPPORT = sandbox_support()
needs_isolation = pytest.mark.skipif(not SUPPORT.isolated, reason=f"this machine cannot isolate: {SUPPORT.problem}")
# Host-wide checks (no process or cgroup of a run outlives it) need the sandbox runs of this file one at a
# time: under pytest-xdist (tools/run-tests-gpu) one worker takes them all, in order.
pytestmark = pytest.mark.xdist_group("sandbox")

FAST = SandboxConfig(cpu_seconds=1, wall_seconds=3.0, memory_bytes=256 * 2**20)
SLACK_SECONDS = 1.5  # kill, namespace teardown and pipe drain on a loaded 2-core machine


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _under_another_worker(pid: int) -> bool:
    """True for a live process of a sibling pytest-xdist worker (a child of our parent other than us):
    the workers of a parallel run start sandboxes of their own at the same time. An orphan (re-parented
    to init) is nobody's: it counts against whichever test looks."""
    chain = []
    try:
        while pid > 1:
            chain.append(pid)
            pid = _parent(pid)
    except OSError:
        return False
    return os.getppid() in chain and os.getpid() not in chain


def host_processes_matching(needle: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (needle in cmdline and int(pid) != os.getpid() and state != "Z"  # a zombie holds nothing
                and not _under_another_worker(int(pid))):
            found.append(f"{pid} ({state}): {cmdline}")
    return found


PROGRAM = f"{sys.executable} -I main.py"  # the command line of the program and of its forks


def _held_by_another_worker(cgroup: str) -> bool:
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as f:
            return any(_under_another_worker(int(pid)) for pid in f.read().split())
    except OSError:
        return False


def leftover_cgroups() -> list[str]:
    parents = {os.path.dirname(d) for d in _CGROUP.dirs} if _CGROUP else set()
    found = [os.path.join(p, n) for p in parents for n in os.listdir(p) if n.startswith("titan-sandbox-")]
    return [cgroup for cgroup in found if not _held_by_another_worker(cgroup)]


_CGROUP, _ = make_run_cgroup("titan-sandbox-test-probe", memory_bytes=2**30, max_processes=1)
if _CGROUP:
    _CGROUP.remove()
USES_CGROUP = _CGROUP is not None


def assert_contained(result, *, wall_seconds: float, marker: str = PROGRAM) -> None:
    for needle in (marker, PROGRAM, _LAUNCHER):
        assert host_processes_matching(needle) == [], f"a process ({needle}) outlived the call"
    assert leftover_cgroups() == [], "the run's cgroup was left behind"
    assert result.seconds < wall_seconds + SLACK_SECONDS, result


def run(source: str, config: SandboxConfig = FAST, **kw):
    return run_sandboxed(textwrap.dedent(source), config, **kw)


@pytest.fixture
def victim():
    """A directory the program can see (the venv is mounted read-only inside) holding a file it must
    not change; checked unchanged afterwards."""
    directory = tempfile.mkdtemp(prefix="titan-sandbox-victim-", dir=sys.prefix)
    os.chmod(directory, 0o777)  # even writable for everyone: only the read-only mount protects it
    path = os.path.join(directory, "victim.txt")
    with open(path, "w") as f:
        f.write("precious\n")
    os.chmod(path, 0o666)
    yield path
    assert sorted(os.listdir(directory)) == ["victim.txt"], "the program created or removed files outside"
    with open(path) as f:
        assert f.read() == "precious\n", "the program changed a file outside"
    shutil.rmtree(directory)


@pytest.fixture
def sentinel():
    """A process of the trainer's user outside the sandbox, which must survive every run."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    assert proc.poll() is None, "the program killed a process outside its sandbox"
    proc.kill()
    proc.wait()


@needs_isolation
def test_correct_program_runs_in_a_fresh_directory_and_normal_output_comes_back():
    r = run("""
        import os
        print(os.getcwd(), os.getuid())
        open('scratch.txt', 'w').write('ok')
        print(open('scratch.txt').read(), input())
    """, stdin="from stdin\n")
    assert r.status == "ok" and r.returncode == 0 and r.isolated, r
    workdir, uid, scratch = r.stdout.split("\n")[0].split() + r.stdout.split("\n")[1:2]
    assert "titan-sandbox-" in workdir and not os.path.exists(workdir) and uid == "1000"
    assert scratch == "ok from stdin"
    assert any("network" in e for e in r.enforced)


@needs_isolation
def test_shell_started_through_fork_exec_cannot_write_outside(victim):
    marker = uuid.uuid4().hex
    shell = (f"echo shell-ran; echo pwned > {victim}; : > {victim}; rm -f {victim}; "
             f"mv {victim} /tmp/x; touch {os.path.dirname(victim)}/new; sleep 30 # {marker}")
    r = run(f"""
        import _posixsubprocess, os
        er, ew = os.pipe()
        pid = _posixsubprocess.fork_exec([b"/bin/sh", b"-c", {shell.encode()!r}], [b"/bin/sh"], True, (ew,), None,
                                         None, -1, -1, -1, -1, -1, -1, er, ew, True, True, -1, None, None, None,
                                         -1, None, False)
        os.system("echo system-ran; echo pwned > {victim}")
        import time; time.sleep(0.5)
    """)
    assert "shell-ran" in r.stdout and "system-ran" in r.stdout, r  # the shells did run, and failed
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr, r.stderr
    assert_contained(r, marker=marker, wall_seconds=FAST.wall_seconds)


@needs_isolation
def test_every_way_of_writing_outside_fails(victim):
    directory = os.path.dirname(victim)
    r = run(f"""
        import os
        print("read:", open({victim!r}).read().strip())  # it is the same file, visible
        dfd = os.open({directory!r}, os.O_RDONLY)
        open("mine", "w").write("x")
        attempts = {{
            "open w": lambda: open({victim!r}, "w"),
            "open a": lambda: open({victim!r}, "a"),
            "O_RDONLY|O_TRUNC": lambda: os.open({victim!r}, os.O_RDONLY | os.O_TRUNC),
            "truncate": lambda: os.truncate({victim!r}, 0),
            "dir_fd write": lambda: os.open("victim.txt", os.O_WRONLY | os.O_TRUNC, dir_fd=dfd),
            "dir_fd create": lambda: os.open("new", os.O_WRONLY | os.O_CREAT, dir_fd=dfd),
            "rename in": lambda: os.rename("mine", {victim!r}),
            "rename out": lambda: os.rename({victim!r}, "stolen"),
            "unlink": lambda: os.unlink({victim!r}),
            "link": lambda: os.link("mine", {directory!r} + "/new"),
            "chmod": lambda: os.chmod({victim!r}, 0o777),
            "utime": lambda: os.utime({victim!r}, (0, 0)),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print(name, "SUCCEEDED")
            except OSError as e:
                print(name, "failed", e.strerror)
    """)
    assert r.status == "ok", r
    assert "read: precious" in r.stdout
    assert "SUCCEEDED" not in r.stdout and r.stdout.count("failed") == 12, r.stdout


@needs_isolation
def test_secrets_home_and_repository_are_not_readable(monkeypatch):
    here = os.path.abspath(__file__)
    token = uuid.uuid4().hex
    monkeypatch.setenv("TITAN_TEST_API_TOKEN", token)  # as a trainer's HF / W&B token would be
    r = run(f"""
        import os
        print(dict(os.environ))
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                print(pid, open(f"/proc/{{pid}}/environ").read())
            except OSError as e:
                print(pid, "environ", e.strerror)  # init's: not dumpable
        for path in ("/etc/shadow", "/etc/gshadow", {here!r}, os.path.expanduser("~root") + "/.bashrc"):
            try:
                print(path, repr(open(path).read()[:20]))
            except OSError as e:
                print(path, "error", e.strerror)
        print("/proc pids:", sorted(p for p in os.listdir("/proc") if p.isdigit()))
        print("/ holds:", sorted(os.listdir("/")))
    """)
    assert r.status == "ok", r
    assert "/etc/shadow ''" in r.stdout or "/etc/shadow error" in r.stdout, r.stdout
    assert "root:" not in r.stdout and token not in r.stdout
    assert f"{here} error No such file or directory" in r.stdout
    assert "/proc pids: ['1', '2']" in r.stdout  # init and the program: no host process is visible
    assert "home" not in r.stdout.split("/ holds:")[1]


@needs_isolation
def test_trainer_and_other_processes_cannot_be_signalled(sentinel):
    r = run(f"""
        import os, signal
        print("ppid", os.getppid())
        # The parent is the namespace's init: the kernel drops its SIGKILL from inside (were init
        # killed, this program would die with it and never print "still running").
        signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)
        os.kill(1, signal.SIGKILL)
        for pid in ({os.getpid()}, {sentinel.pid}, {os.getppid()}, -1):
            try:
                os.kill(pid, signal.SIGKILL)
                print("signalled", pid)
            except OSError as e:
                print("kill failed", e.strerror)
        print("still running")
    """)
    # The host's pids do not exist in the program's pid namespace; -1 finds nobody but init there.
    assert r.status == "ok" and "still running" in r.stdout, r
    assert "ppid 1" in r.stdout and "signalled" not in r.stdout and r.stdout.count("No such process") == 4


@needs_isolation
def test_background_processes_and_pipe_holders_die_with_the_program():
    marker = uuid.uuid4().hex
    r = run(f"""
        import os, subprocess, sys, time
        # a new-session grandchild holding stdout/stderr, and a double-forked daemon
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "{marker}"], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", "{marker}"])
            os._exit(0)
        time.sleep(0.3)
        print("spawned")
    """)
    assert r.status == "ok" and "spawned" in r.stdout, r
    # back as soon as the main program ended (they would sleep 30 s), not at the wall limit
    assert_contained(r, marker=marker, wall_seconds=FAST.wall_seconds)


@needs_isolation
def test_pipe_holding_grandchild_does_not_extend_the_wall_limit():
    marker = uuid.uuid4().hex
    config = SandboxConfig(cpu_seconds=1, wall_seconds=1.5)
    r = run(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "{marker}"], start_new_session=True)
        time.sleep(30)
    """, config)
    assert r.status == "wall_timeout", r
    assert_contained(r, marker=marker, wall_seconds=config.wall_seconds)


@needs_isolation
def test_the_program_dies_with_the_trainer():
    marker = uuid.uuid4().hex
    trainer = _LOAD_SANDBOX + textwrap.dedent(f"""
        import os, threading, time
        sleeper = "[sys.executable, '-c', 'import time; time.sleep(30)', '{marker}']"
        program = f"import subprocess, sys, time\\nsubprocess.Popen({{sleeper}}, start_new_session=True)\\ntime.sleep(30)"
        threading.Thread(target=sandbox.run_sandboxed, args=(program, sandbox.SandboxConfig(wall_seconds=30.0))).start()
        def started():
            for p in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if int(p) != os.getpid() and "{marker}" in open(f"/proc/{{p}}/cmdline").read():
                        return True
                except OSError:
                    pass
        while not started():
            time.sleep(0.05)
        os._exit(0)  # the trainer dies without cleaning up
    """)
    subprocess.run([sys.executable, "-c", trainer], timeout=60, check=True)
    deadline = time.monotonic() + SLACK_SECONDS  # the chain dies one link after the other
    while (host_processes_matching(marker) or host_processes_matching(_LAUNCHER)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes_matching(marker) == [] and host_processes_matching(_LAUNCHER) == []
    # The dead trainer could not remove its run's cgroup: empty, it goes with the next trainer's first
    # run a minute later; here, now.
    for d in leftover_cgroups():
        with open(os.path.join(d, "cgroup.procs")) as f:
            assert f.read() == "", f"processes left in {d}"
        os.rmdir(d)


@needs_isolation
def test_total_memory_of_many_processes_is_limited():
    # 8 processes of 100 MiB each against a 256 MiB total: each alone is under the per-process limit.
    config = SandboxConfig(cpu_seconds=5, wall_seconds=10.0, memory_bytes=256 * 2**20)
    r = run("""
        import os, sys, time
        for _ in range(8):
            if os.fork() == 0:
                chunks = [b"x" * (10 * 2**20) for _ in range(10)]  # written, so resident
                time.sleep(30)
                os._exit(0)
        time.sleep(30)
    """, config)
    assert r.status == "memory_limit", r
    assert config.memory_bytes < r.peak_memory_bytes < 8 * 100 * 2**20
    assert_contained(r, wall_seconds=config.wall_seconds)
    if USES_CGROUP:  # the kernel's own peak: never above the cgroup's limit
        assert r.enforced[-1].startswith("cgroup v")
        assert r.peak_memory_bytes <= config.memory_bytes + config.scratch_bytes + 64 * 2**20


@pytest.mark.skipif(not USES_CGROUP, reason="the trainer cannot create cgroups on this machine")
def test_stale_run_cgroups_are_removed_but_not_busy_ones(monkeypatch):
    import titan_rl.envs.sandbox_cgroup as cgroups
    stale, _ = make_run_cgroup("titan-sandbox-test-stale", memory_bytes=2**30, max_processes=1)
    busy, _ = make_run_cgroup("titan-sandbox-test-busy", memory_bytes=2**30, max_processes=1)
    sleeper = subprocess.Popen(["sleep", "30"])
    for d in busy.dirs:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(sleeper.pid))
    monkeypatch.setattr(cgroups, "STALE_SECONDS", 0.0)
    # Only this test's cgroups count as stale here: with STALE_SECONDS 0 the sweep would also remove the
    # cgroups of other processes' runs that are being set up right now (created, not yet joined).
    monkeypatch.setattr(cgroups, "STALE_PREFIX", "titan-sandbox-test-")
    fresh, _ = make_run_cgroup("titan-sandbox-test-fresh", memory_bytes=2**30, max_processes=1)
    assert not any(map(os.path.exists, stale.dirs)) and all(map(os.path.exists, busy.dirs))
    sleeper.kill()
    sleeper.wait()
    busy.remove()
    fresh.remove()
    assert leftover_cgroups() == []


@pytest.mark.skipif(not USES_CGROUP, reason="the trainer cannot create cgroups on this machine")
def test_run_cgroup_enforces_its_limit_and_counts_oom_kills():
    cgroup, _ = make_run_cgroup("titan-sandbox-test-oom", memory_bytes=0, max_processes=1)  # the 64 MiB slack
    joins = [os.path.join(d, "cgroup.procs") for d in cgroup.dirs]
    code = "import os, sys\nfor p in sys.argv[1:]:\n    open(p, 'w').write(str(os.getpid()))\nb = b'x' * (256 << 20)"
    proc = subprocess.run([sys.executable, "-c", code, *joins], capture_output=True)
    peak, oom_kills = cgroup.peak_and_oom_kills()
    cgroup.remove()
    assert proc.returncode == -signal.SIGKILL and oom_kills == 1 and 32 * 2**20 < peak <= 64 * 2**20, (proc, peak)


@needs_isolation
def test_without_a_writable_cgroup_init_accounting_still_holds(monkeypatch):
    import titan_rl.envs.sandbox as sandbox_module
    monkeypatch.setattr(sandbox_module, "make_run_cgroup", lambda *a, **k: (None, "none for this test"))
    config = SandboxConfig(cpu_seconds=5, wall_seconds=10.0, memory_bytes=128 * 2**20)
    r = run("""
        import os, time
        for _ in range(4):
            if os.fork() == 0:
                chunks = [b"x" * (10 * 2**20) for _ in range(6)]
                time.sleep(30)
                os._exit(0)
        time.sleep(30)
    """, config)
    assert r.status == "memory_limit" and "no cgroup (none for this test)" in r.enforced[-1], r
    assert config.memory_bytes < r.peak_memory_bytes < 4 * 60 * 2**20 + 16 * 2**20
    assert_contained(r, wall_seconds=config.wall_seconds)


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@needs_isolation
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_printing_a_gigabyte_keeps_the_parents_memory_bounded(stream):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident size to the current one
    before = _peak_rss_bytes()
    r = run(f"""
        import sys
        chunk = b"x" * 2**20
        for _ in range(1024):
            sys.{stream}.buffer.write(chunk)
    """)
    grown = _peak_rss_bytes() - before
    assert r.status == "output_limit", r
    assert len(getattr(r, stream)) == FAST.max_output_bytes
    assert grown < 16 * 2**20, f"the parent grew by {grown / 2**20:.1f} MiB"
    assert_contained(r, wall_seconds=FAST.wall_seconds)


@needs_isolation
def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    r = run(f"""
        import socket
        for address in (("127.0.0.1", {port}), ("8.8.8.8", 53)):
            try:
                socket.create_connection(address, timeout=1)
                print("CONNECTED", address)
            except OSError as e:
                print("refused", e.strerror)
    """)
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert r.status == "ok" and "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2, r


@needs_isolation
def test_fork_bomb_is_bounded_and_cleaned_up():
    config = SandboxConfig(cpu_seconds=1, wall_seconds=3.0, max_processes=16)
    r = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, config)
    assert r.status in ("cpu_limit", "wall_timeout"), r
    assert_contained(r, wall_seconds=config.wall_seconds)


@needs_isolation
def test_no_privilege_escalation_no_unaccounted_memory_and_bounded_scratch_space():
    r = run("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        def attempt(name, fn):
            try:
                fn()
                print(name, "SUCCEEDED")
            except OSError as e:
                print(name, "failed", e.strerror)
        attempt("setuid 0", lambda: os.setuid(0))
        def check(rc, what):  # rc: 0 when the call succeeded
            if rc != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        attempt("new user namespace", lambda: check(libc.unshare(0x10000000), "unshare"))
        attempt("mount tmpfs", lambda: check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None), "mount"))
        attempt("read init's environment", lambda: open("/proc/1/environ").read())
        attempt("big file", lambda: open("big", "wb").write(b"x" * (16 * 2**20)))
        def fill():
            for i in range(100):
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * (4 * 2**20))
        attempt("fill /tmp", fill)
        # memory that no process maps is in nobody's resident size: none may be made
        attempt("memfd", lambda: os.memfd_create("hidden"))
        attempt("System V shared memory", lambda: check(libc.shmget(0, 2**20, 0o1600) < 0, "shmget"))
        attempt("System V message queue", lambda: check(libc.msgget(0, 0o1600) < 0, "msgget"))
    """, SandboxConfig(cpu_seconds=2, wall_seconds=5.0, file_size_bytes=8 * 2**20, scratch_bytes=32 * 2**20))
    assert r.status == "ok", r
    assert "SUCCEEDED" not in r.stdout and r.stdout.count("failed") == 9, r.stdout
    assert "big file failed File too large" in r.stdout and "fill /tmp failed No space left on device" in r.stdout


@needs_isolation
def test_cpu_wall_and_memory_limits():
    r = run("while True:\n    pass", SandboxConfig(cpu_seconds=1, wall_seconds=30.0))
    assert r.status == "cpu_limit" and 0.5 <= r.cpu_seconds < 2.0, r  # wall time depends on the load
    r = run("import time; time.sleep(60)", SandboxConfig(cpu_seconds=1, wall_seconds=1.0))
    assert r.status == "wall_timeout" and r.seconds < 1.0 + SLACK_SECONDS, r
    r = run("x = bytearray(1 << 30)\nprint('allocated')")
    assert r.status == "memory_limit" and "allocated" not in r.stdout, r


CHECKS = ["f(2) == 4", "f(3) == 9", "f(0) == 0"]


@needs_isolation
def test_correct_solution_scores_one_and_partial_credit_counts():
    reward, r = code_reward("def f(x):\n    return x * x\nprint('normal output')", CHECKS, config=FAST)
    assert reward == 1.0 and "normal output" in r.stdout
    assert code_reward("def f(x):\n    return x * 2", CHECKS, config=FAST)[0] == pytest.approx(2 / 3)
    assert code_reward("def f(x):\n    return float(x * x)", CHECKS, config=FAST)[0] == 0.0  # 4.0 is not 4
    typed = [("g()", (1, [2.5, None], {"a": {3}})), ("g() == g()", True)]
    source = "def g():\n    return (1, [2.5, None], {'a': {3}})"
    assert code_reward(source, typed, config=FAST)[0] == 1.0
    task = CodeTask(sandbox=FAST)
    p = task.sample(random.Random(0))
    assert task.reward(p, p.answer) == 1.0 and task.reward(p, "syntax error(") == 0.0


@needs_isolation
def test_concurrent_runs_stay_apart():
    # Rollout workers score in threads: each run has its own namespaces, directory and limits.
    from concurrent.futures import ThreadPoolExecutor
    programs = [f"import time\nopen('mark', 'w').write('{i}')\ntime.sleep(0.2)\nassert open('mark').read() == '{i}'\n"
                f"def f(x):\n    return x * x + {i % 2}" for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        rewards = list(pool.map(lambda p: code_reward(p, CHECKS, config=FAST)[0], programs))
    assert rewards == [1.0, 0.0] * 3  # a shared directory would fail the asserts: reward 0 everywhere


@needs_isolation
@pytest.mark.parametrize("attack", [
    # rebinding eval (in builtins and in the namespace the harness evaluates in) to say True
    "import builtins\nbuiltins.eval = lambda *a, **k: True\neval = builtins.eval\ndef f(x):\n    return 0",
    # reading the harness and its arguments, then printing forged results (also from atexit, after it)
    "import atexit, json, sys\nline = '\\nTITAN-RESULTS ' + json.dumps([{'value': True}] * 3)\n"
    "print(sys.argv, open(sys.argv[0]).read()[:50], line)\natexit.register(print, line)\ndef f(x):\n    return 0",
    # objects that claim to equal everything
    "class A:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
    "def f(x):\n    return A()",
    "class S(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
    "def f(x):\n    return S(7)",
    # forged results, then leaving before the harness runs
    "import os, json\nprint('\\nTITAN-RESULTS ' + json.dumps([{'value': 1}] * 3), flush=True)\nos._exit(0)",
])
def test_wrong_solutions_cannot_forge_a_reward(attack):
    assert code_reward(attack, CHECKS, config=FAST)[0] == 0.0


def test_checks_must_say_what_they_expect():
    with pytest.raises(ValueError, match="EXPRESSION == LITERAL"):
        code_reward("", ["f(2) > 3"])
    with pytest.raises(ValueError, match="literal"):
        code_reward("", ["f(2) == g(3)"])
    with pytest.raises(ValueError, match="not a plain value"):
        code_reward("", [("f()", object())])
    with pytest.raises(ValueError, match="empty"):
        code_reward("", [])


def _in_user_namespace(*, allow_more: bool):
    """A preexec_fn: the child enters a user namespace of its own that maps only its uid (as 0), and
    where, unless `allow_more`, no further user namespace may be created."""
    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(0x10000000) != 0:
            os._exit(3)
        writes = [("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                  ("/proc/self/gid_map", f"0 {gid} 1")]
        for path, text in writes + ([] if allow_more else [("/proc/sys/user/max_user_namespaces", "0")]):
            with open(path, "w") as f:
                f.write(text)
    return enter


# Loads sandbox.py by path (not through titan_rl, whose import pulls in torch: seconds per child).
_LOAD_SANDBOX = f"""
import importlib.util, sys
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
load("titan_rl.envs.sandbox_cgroup", {os.path.join(os.path.dirname(_LAUNCHER), "sandbox_cgroup.py")!r})
sandbox = load("sandbox", {os.path.join(os.path.dirname(_LAUNCHER), "sandbox.py")!r})
"""


def test_refuses_to_run_unisolated_unless_the_user_opts_in():
    probe = _LOAD_SANDBOX + textwrap.dedent("""
        print("isolated:", sandbox.sandbox_support().isolated)
        try:
            sandbox.run_sandboxed("print('ran')")
        except sandbox.SandboxUnavailable as e:
            print("refused:", e)
        r = sandbox.run_sandboxed("print('ran')", sandbox.SandboxConfig(allow_unisolated=True))
        print("opted in:", r.status, r.isolated, r.stdout.strip(), r.enforced)
    """)
    # Where this machine isolates, take that away in a child: it may not create user namespaces.
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         preexec_fn=_in_user_namespace(allow_more=False) if SUPPORT.isolated else None)
    assert out.returncode == 0, out.stderr
    assert "isolated: False" in out.stdout
    assert "refused: cannot isolate untrusted code on this machine" in out.stdout
    assert "allow_unisolated=True" in out.stdout
    assert "opted in: ok False ran" in out.stdout


ATTEMPTS_AS_UNPRIVILEGED = """
import ctypes, os
print(os.getuid(), [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1])
libc = ctypes.CDLL(None, use_errno=True)
for attempt in (lambda: open(VICTIM, "w"), lambda: os.unlink(VICTIM),
                lambda: libc.unshare(0x10000000) == 0 or os.strerror(ctypes.get_errno())):
    try:
        print("returned", attempt())
    except OSError as e:
        print("failed", e.strerror)
"""


@needs_isolation
def test_a_trainer_that_can_map_only_its_own_uid_still_gets_an_unprivileged_program(victim):
    # As for an unprivileged trainer: one uid mappable, so init drops through a nested user namespace.
    source = ATTEMPTS_AS_UNPRIVILEGED.replace("VICTIM", repr(victim))
    probe = _LOAD_SANDBOX + textwrap.dedent(f"""
        r = sandbox.run_sandboxed({source!r}, sandbox.SandboxConfig(cpu_seconds=1, wall_seconds=10.0))
        print(r.status, r.isolated, r.enforced)
        print(r.stdout, r.stderr)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         preexec_fn=_in_user_namespace(allow_more=True))
    assert out.returncode == 0, out.stderr
    assert "ok True" in out.stdout and "no nested user namespaces" in out.stdout, out.stdout
    assert "runs as uid 1000 (the trainer's uid outside), no capabilities" in out.stdout
    assert "1000 0000000000000000" in out.stdout  # uid 1000, no effective capabilities
    assert out.stdout.count("failed") == 2 and "returned No space left on device" in out.stdout, out.stdout


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxConfig(memory_bytes=1024)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxConfig(max_processes=0)
    with pytest.raises(ValueError, match="names must be plain"):
        run_sandboxed("", files={"../x": ""})
    with pytest.raises(ValueError, match="scratch_bytes"):
        run_sandboxed("", SandboxConfig(scratch_bytes=2**20), stdin="x" * 2**20)
