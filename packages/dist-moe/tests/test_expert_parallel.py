"""Expert parallelism on 2 and 4 gloo ranks equals one process (outputs and every gradient),
with uneven token counts per rank, skewed loads and experts that receive nothing; and the layer
reads device data on the host exactly once per forward (the split sizes), never in backward.
The torch path also checks overlap_all_to_all (bitwise, one hand-over per exchange) and TakingTurns
(a forward against another microbatch's backward: bitwise the in-order results, and the recorded
turn order showing each exchange in flight while the other computes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_moe_rank_report import file_rendezvous

WORKER = Path(__file__).with_name("ep_worker.py")


def _launch(world: int, backends: str, tmp_path: Path) -> list[dict]:
    init_method = file_rendezvous(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), init_method, str(tmp_path), backends],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(world)]
    logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    reports = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report:\n{logs[rank]}"
        report = json.loads(path.read_text())
        assert "error" not in report, f"rank {rank} failed:\n{report['error']}\n{logs[rank]}"
        reports.append(report)
    return reports


def _assert_matches_single_process(reports: list[dict], backend: str) -> None:
    failures = [f"rank {r[backend]['rank']} {scenario}.{key}: {result}"
                for r in reports for scenario, results in r[backend]["checks"].items()
                for key, result in results.items() if not result["ok"]]
    assert not failures, "\n".join(failures)


def _assert_host_reads(reports: list[dict], backend: str, expected_forward: list[str]) -> None:
    for report in reports:
        for scenario, reads in report[backend]["host_reads"].items():
            assert sorted(reads["forward"]) == sorted(expected_forward), (scenario, reads)
            assert reads["backward"] == [], (scenario, reads)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    # One launch runs both paths: the torch one (float64) and the Triton kernels interpreted on CPU.
    return _launch(2, "torch,triton", tmp_path_factory.mktemp("ep2"))


def test_two_ranks_torch_path_matches_one_process(two_ranks):
    _assert_matches_single_process(two_ranks, "torch")
    # The split sizes, plus the torch expert path's own read of the per-expert row ends.
    _assert_host_reads(two_ranks, "torch", ["dispatch: all-to-all split sizes",
                                            "expert_mlp: per-expert row ends (torch path)"])


def test_two_ranks_triton_path_matches_one_process_with_one_host_read(two_ranks):
    _assert_matches_single_process(two_ranks, "triton")
    _assert_host_reads(two_ranks, "triton", ["dispatch: all-to-all split sizes"])


def test_four_ranks_torch_path_matches_one_process(tmp_path):
    reports = _launch(4, "torch", tmp_path)
    _assert_matches_single_process(reports, "torch")
