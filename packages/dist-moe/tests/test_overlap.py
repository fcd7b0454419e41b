"""TakingTurns and overlap_all_to_all in one process (the expert-parallel cases run on gloo ranks in
ep_worker.py): work with no all-to-all runs each turn whole, first then second; an error in either turn
is raised on the calling thread after the other has finished; blocks do not nest."""
from __future__ import annotations

import pytest
import torch

import dist_moe


def test_turns_without_all_to_alls_run_one_after_the_other_with_the_callers_grad_mode():
    trace, seen = [], []
    moe = dist_moe.MoEConfig(dim=8, num_experts=4, top_k=2, expert_dim=4).build()  # no group: no all-to-all
    x = torch.randn(1, 5, 8)
    with torch.no_grad():
        dist_moe.TakingTurns(trace=trace).run(lambda: seen.append(moe(x).requires_grad),
                                              lambda: seen.append(torch.is_grad_enabled()))
    assert seen == [False, False]  # the helper thread ran under the caller's no_grad
    assert trace == [("forward", "start"), ("forward", "end"), ("backward", "start"), ("backward", "end")]


@pytest.mark.parametrize("failing", ["forward", "backward"])
def test_an_error_in_either_turn_reaches_the_caller_after_the_other_finished(failing):
    done = []

    def work(name):
        def run():
            if name == failing:
                raise RuntimeError(f"{name} failed")
            done.append(name)
        return run

    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        dist_moe.TakingTurns().run(work("forward"), work("backward"))
    assert done == [n for n in ("forward", "backward") if n != failing]
    with dist_moe.overlap_all_to_all(lambda: None):  # the failed run left no block active
        with pytest.raises(ValueError, match="do not nest"):
            with dist_moe.overlap_all_to_all(lambda: None):
                pass
