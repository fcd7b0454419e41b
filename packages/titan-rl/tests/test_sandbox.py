"""The code sandbox: limits are enforced, escapes fail and are reported, correct code scores."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from titan_rl.envs import CodeTask, SandboxConfig, code_reward, network_namespaces_available, run_sandboxed
from titan_rl.envs.sandbox import _unshare_network

FAST = SandboxConfig(cpu_seconds=1, wall_seconds=3.0, memory_bytes=256 * 2**20)


def test_correct_program_runs_in_a_fresh_directory_that_is_removed():
    r = run_sandboxed("import os; print(os.getcwd()); open('scratch.txt', 'w').write('ok')", FAST)
    assert r.status == "ok" and r.violations == []
    workdir = r.stdout.strip()
    assert "titan-sandbox-" in workdir and not os.path.exists(workdir)


def test_cpu_limit():
    # A generous wall clock, so that only the CPU limit can stop it even on a loaded machine.
    r = run_sandboxed("while True:\n    pass", SandboxConfig(cpu_seconds=1, wall_seconds=60.0))
    assert r.status == "cpu_limit" and r.returncode in (-24, -9), r


def test_wall_clock_limit_kills_a_sleeping_program():
    r = run_sandboxed("import time; time.sleep(60)", SandboxConfig(cpu_seconds=1, wall_seconds=1.0))
    assert r.status == "wall_timeout" and r.seconds < 5


def test_memory_limit():
    r = run_sandboxed("x = bytearray(1 << 30)\nprint('allocated')", FAST)
    assert r.status == "memory_limit" and "allocated" not in r.stdout


@pytest.mark.parametrize("attack, reported", [
    ("import socket; socket.create_connection(('127.0.0.1', 9))", "socket"),
    ("open('/tmp/titan-escape-test', 'w').write('x')", "outside the sandbox"),
    ("import os; os.system('echo pwned')", "os.system"),
    ("import subprocess; subprocess.run(['echo', 'pwned'])", "subprocess"),
    ("import ctypes", "ctypes"),
    ("import os; os.remove('/etc/hostname')", "os.remove"),
])
def test_escape_attempts_fail_and_are_reported(attack, reported):
    # The attack swallows the error and carries on: the report still reaches the parent.
    r = run_sandboxed(f"try:\n    {attack}\nexcept BaseException as e:\n    print('caught', type(e).__name__)\nprint('done')", FAST)
    assert r.status == "violation", r
    assert any(reported in v for v in r.violations), r.violations
    assert "pwned" not in r.stdout
    assert not os.path.exists("/tmp/titan-escape-test")


@pytest.mark.skipif(not network_namespaces_available(), reason="kernel refuses unprivileged network namespaces here")
def test_network_namespace_cuts_the_network_even_without_the_audit_hook():
    # A server in our namespace; a child that only unshared (no audit hook) cannot reach it.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    probe = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\nexcept OSError as e:\n    print('refused', e.errno)"
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    isolated = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30,
                              preexec_fn=lambda: _unshare_network() or os._exit(3))
    server.close()
    assert plain.stdout.startswith("connected")
    assert isolated.returncode == 0 and isolated.stdout.startswith("refused"), isolated
    assert run_sandboxed("print(1)", FAST).network_isolation == "namespace"


def test_code_reward_counts_checks_and_cannot_be_forged():
    checks = ["f(2) == 4", "f(3) == 9", "f(0) == 1"]
    assert code_reward("def f(x):\n    return x * x", checks, config=FAST)[0] == pytest.approx(2 / 3)
    # Printing a fake harness line does not help: the nonce is unknown to the program.
    forged = "def f(x):\n    return 0\nprint('\\nTITAN-0000000000000000 3')"
    assert code_reward(forged, checks, config=FAST)[0] == 0.0
    reward, result = code_reward("import socket\nsocket.socket()\ndef f(x):\n    return x*x", checks, config=FAST)
    assert reward == 0.0 and result.violations
    task = CodeTask(sandbox=FAST)
    import random
    p = task.sample(random.Random(0))
    assert task.reward(p, p.answer) == 1.0 and task.reward(p, "syntax error(") == 0.0


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxConfig(memory_bytes=1024)
    with pytest.raises(ValueError, match="network"):
        SandboxConfig(network="none")
