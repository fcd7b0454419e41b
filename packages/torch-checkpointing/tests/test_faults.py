"""Fault injection: a checkpointed run killed (SIGKILL) 24 times at random moments — at storage
operations of its saves and of retention, inside the first step after a resume, after random delays —
and now and then a flipped bit in the newest step; every resume must restore the newest intact step
and continue bit for bit like a run that was never stopped (ckpt_faults.py has the runs and the driver)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

KILLS, SEED = 24, 27


def test_killed_24_times_every_resume_continues_bitwise(tmp_path):
    out = tmp_path / "trace.json"
    # a fresh interpreter forks the runs: this process may have run autograd, which must not be forked
    driver = [sys.executable, str(Path(__file__).with_name("ckpt_faults.py")), str(out), str(tmp_path / "work"),
              str(SEED), str(KILLS)]
    subprocess.run(driver, check=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    trace = json.loads(out.read_text())
    reference = {int(step): digest for step, digest in trace["reference"].items()}
    steps = max(reference)
    runs = trace["runs"]
    killed = [r for r in runs if r["code"] == -signal.SIGKILL]
    assert len(killed) == KILLS and all(r["code"] in (0, -signal.SIGKILL) for r in runs), [r["code"] for r in runs]

    damaged: dict[str, int] = {}  # folder -> the step a bit was flipped in, until a resume moved it aside
    for run in runs:
        for line in run["log"]:
            words = line.split()
            if words[0] in ("step", "resume"):  # the model, optimizer and RNG after that step: bitwise
                assert words[2] == reference[int(words[1])], (run["folder"], run["kind"], line)
        resumed = [line.split() for line in run["log"] if line.startswith("resume ")]
        before = run["committed_before"]
        if run["flipped"]:
            damaged[run["folder"]] = int(run["flipped"].split("/")[0].removeprefix("step-"))
        if not run["log"] and run["code"] == -signal.SIGKILL:
            continue  # killed while loading, before it said what it resumed
        if damaged.get(run["folder"]) in before:  # the newest step is damaged: the resume falls back from it
            assert before[-1] == damaged[run["folder"]], run
            assert resumed and int(resumed[0][1]) == before[-2] and resumed[0][3] == "1", run
        elif before:  # nothing committed was lost, and the newest committed step is the one resumed
            assert resumed and int(resumed[0][1]) == before[-1] and resumed[0][3] == "0", run
        else:
            assert not resumed, run
        damaged.pop(run["folder"], None)
        if run["code"] == 0:
            assert run["log"][-1].startswith("done") and run["committed_after"][-1] == steps, run

    kinds = [r["kind"] for r in killed]
    for kind in ("data", "record", "metadata", "commit", "rename", "retention", "retention folder", "time"):
        assert kinds.count(kind) >= 2, kinds
    # inside the first step after a resume: its optimizer step or an operation of its save
    assert sum(r["kind"] == "first step" and r["log"][0].startswith("resume") for r in killed) >= 2, kinds
    where = [line for r in killed for line in r["log"] if line.startswith("kill ")]
    assert any(w.startswith("kill remove step-") and w.endswith("/commit.json") for w in where), where  # retention
    assert sum(bool(r["flipped"]) for r in runs) >= 3
    finals = [r for r in runs if r["kind"] == "final"]
    assert finals and all(r["code"] == 0 for r in finals)
