"""The fault-injection test's runs and the driver that kills them (`python ckpt_faults.py OUT WORKDIR SEED KILLS`).

A run trains a tiny model with AdamW on generated gradients, checkpoints asynchronously every step
(keep_last=2, so retention deletes a step at every commit) and resumes from the latest intact step;
it logs a digest of the model, optimizer and generator after every step and after a resume, and can
SIGKILL itself at the n-th storage operation of a kind. The driver, a fresh interpreter started by
the test, forks the runs (it never runs autograd, and neither do they: gradients come from a seeded
generator), kills them at storage operations, inside the first step after a resume or after a random
delay, flips a bit in the newest step now and then, and writes what every run logged as JSON.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 - optimizers import it on first use: once in the fork server, not per run

import torch_checkpointing as tc

STEPS = 10
# Where kills land: (storage operation, a part of its path); each is the n-th such operation of a run,
# so a plan names the same place whatever order the writer and committer threads interleave in.
TARGETS = {
    "data": ("write_at", ".safetensors"),  # opening a rank's data file, or after a write into it
    "record": ("write_file", "/rank-"),  # the rank's record: its part is done
    "metadata": ("write_file", "metadata.json"),
    "commit": ("write_file", "commit.json"),
    "rename": ("rename", ""),  # .tmp-step-N -> step-N
    # retention deletes an old step's commit record, then its folder; the two are separate targets, so that
    # both are hit whatever earlier kills left behind (leftover folders are removed through "step-" too)
    "retention": ("remove", "/commit.json"),
    "retention folder": ("remove", "step-"),
}


class KillingStorage(tc.LocalStorage):
    """Local storage that SIGKILLs its own process at the n-th storage operation `kill` = (kind or
    "any", part of the path, n) names, counted once `armed` (after the resume). No fsync: a killed
    process loses no write that reached the page cache."""

    def __init__(self, root, kill: tuple[str, str, int] | None, log: str):
        super().__init__(root, fsync=False)
        self.kill, self.log, self.armed = kill, log, False
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def _op(self, kind: str, path: str) -> None:
        if not self.armed:
            return
        with self._lock:
            self.counts[kind] += 1
            if self.kill is None or self.kill[0] not in (kind, "any") or self.kill[1] not in path:
                return
            self.counts["matched"] += 1
            if self.counts["matched"] == self.kill[2]:
                append(self.log, f"kill {kind} {path}")
                os.kill(os.getpid(), signal.SIGKILL)

    def open_sink(self, path):
        self._op("write_at", path)  # opening the file: before the header is written
        sink = super().open_sink(path)
        write_at = sink.write_at

        def counted(offset, data):
            write_at(offset, data)
            self._op("write_at", path)  # after some bytes of the file are there
        sink.write_at = counted
        return sink

    def write_file(self, path, data):
        self._op("write_file", path)
        super().write_file(path, data)

    def rename(self, src, dst):
        self._op("rename", f"{src}->{dst}")
        super().rename(src, dst)

    def remove(self, path):
        self._op("remove", path)
        super().remove(path)


class GeneratorState:
    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self) -> dict:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["state"])


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        for value in optimizer.state[p].values():
            h.update(value.numpy().tobytes())
    h.update(generator.get_state().numpy().tobytes())
    return h.hexdigest()[:16]


def append(log: str, line: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # unbuffered: a kill loses no logged line
    finally:
        os.close(fd)


def run(root: str, log: str, kill: tuple | None) -> None:
    """Train to STEPS (resuming if a step is committed); kill=("step", "", n): die in the n-th step
    after the resume, between the optimizer step and its save; otherwise at that storage operation."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    storage = KillingStorage(root, kill, log)
    ckpt = tc.Checkpointer(storage, keep_last=2, per_rank=("rng",), io_threads=2)
    state = {"model": tc.ModelState(model), "optim": tc.OptimizerState(model, optimizer),
             "rng": GeneratorState(generator), "step": 0}
    start = 0
    if ckpt.latest_step() is not None:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            start = ckpt.load(state)
        fell_back = sum("is damaged" in str(w.message) for w in warned)
        append(log, f"resume {start} {digest(model, optimizer, generator)} {fell_back}")
    storage.armed = True
    for step in range(start + 1, STEPS + 1):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        if kill == ("step", "", step - start):
            os.kill(os.getpid(), signal.SIGKILL)
        append(log, f"step {step} {digest(model, optimizer, generator)}")
        ckpt.save(step, {**state, "step": step})
    ckpt.close()
    append(log, "done " + " ".join(f"{k}={v}" for k, v in sorted(storage.counts.items())))


# ---- the driver ---------------------------------------------------------------------------------

def forked_run(root: Path, log: Path, kill, delay_s: float | None = None) -> int:
    """One run in a forked child (killed after `delay_s` if given); returns its wait status as a code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            run(str(root), str(log), kill)
            code = 0
        finally:
            os._exit(code)
    if delay_s is not None:
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)  # fine if it has finished: it is a zombie until waited for
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "commit.json").exists())


def flip_a_bit(root: Path, rng: random.Random) -> str:
    """Flip one random bit of one random file of the newest committed step."""
    files = sorted((root / f"step-{committed(root)[-1]}").iterdir())
    path = rng.choice(files)
    raw = bytearray(path.read_bytes())
    position = rng.randrange(len(raw))
    raw[position] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(raw))
    return f"{path.relative_to(root)}@{position}"


def pick_kill(kind: str, totals: dict[str, int], rng: random.Random):
    """(kill, delay): a storage operation drawn among those of a whole run, a point of the first
    step after a resume (its optimizer step, or an operation of its save), or a delay."""
    if kind == "time":
        return None, rng.uniform(0.0, 0.25)
    if kind == "first step":
        per_save = sum(totals.values()) // STEPS
        return (("step", "", 1) if rng.random() < 0.3 else ("any", "", rng.randint(1, per_save))), None
    operation, part = TARGETS[kind]
    removals = {"retention": totals["remove"] // 2, "retention folder": totals["remove"]}
    most = {"data": totals["write_at"], **removals}.get(kind, STEPS)  # else one per step
    return (operation, part, rng.randint(1, most)), None


def record_run(root: Path, name, kind: str, kill, delay: float | None, flipped: str | None) -> dict:
    log = root.with_suffix(f".{name}.log")
    before = committed(root)
    code = forked_run(root, log, kill, delay)
    return {"folder": root.name, "kind": kind, "kill": kill, "delay": delay, "flipped": flipped, "code": code,
            "committed_before": before, "committed_after": committed(root),
            "log": log.read_text().splitlines() if log.exists() else []}


def drive(workdir: Path, seed: int, kills: int) -> dict:
    rng = random.Random(seed)
    reference_log = workdir / "reference.log"
    assert forked_run(workdir / "reference", reference_log, None) == 0
    lines = reference_log.read_text().split("\n")
    reference = {int(line.split()[1]): line.split()[2] for line in lines if line.startswith("step ")}
    totals = {k: int(v) for k, v in (item.split("=") for item in lines[-2].split()[1:])}
    plan = [*TARGETS, "first step", "time"]
    folders, runs, killed, slot, eligible = [], [], 0, 0, 0  # slot: the plan's next kind, taken once it killed
    while killed < kills and len(runs) < 4 * kills:
        if not folders or runs[-1]["code"] == 0:  # the last folder's run finished: start another
            folders.append(workdir / f"folder-{len(folders)}")
        root = folders[-1]
        kind = plan[slot % len(plan)]
        # "first step" kills the first step after a resume: it needs a folder with a step to resume
        # that is not the last one
        steps = committed(root)
        if kind == "first step" and not (steps and steps[-1] < STEPS):
            kind = "record"
        flipped = None
        unresolved = runs and runs[-1]["folder"] == root.name and runs[-1]["flipped"] and not runs[-1]["log"]
        if len(committed(root)) >= 2 and not unresolved:
            eligible += 1  # every third run that can fall back gets a flipped bit: a count, not a draw,
            if eligible % 3 == 1:  # so that every seed and machine timing damages several steps
                flipped = flip_a_bit(root, rng)  # the resume must fall back from it
        kill, delay = pick_kill(kind, totals, rng)
        runs.append(record_run(root, len(runs), kind, kill, delay, flipped))
        if runs[-1]["code"] == -signal.SIGKILL:
            killed += 1
            slot += kind == plan[slot % len(plan)]
    for root in folders:  # every folder is resumed to the end
        runs.append(record_run(root, "final", "final", None, None, None))
    return {"reference": reference, "totals": totals, "runs": runs}


if __name__ == "__main__":
    out, workdir, seed, kills = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    Path(out).write_text(json.dumps(drive(workdir, seed, kills)))
