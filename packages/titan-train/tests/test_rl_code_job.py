"""The multi-turn code-execution RL job (env.task=code): its sandbox limits under the job's own traffic,
and its recipe.

The limit tests run the real job (`run_rl`: episodes, python tool, hidden-test reward, update, held-out
evaluation) with the policy's generator replaced by one that writes the given programs, so what reaches
the sandbox is what a policy's output would: the tool call and the answer of every episode.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import titan_train.rl.job as rl_job
from titan_rl import ByteTokenizer, Completion
from titan_rl.envs import sandbox_support
from titan_rl.envs.function_tasks import FAMILIES
from titan_train.rl import RLConfig, run_rl
from titan_train.rl.recipes import RL_RECIPES

SUPPORT = sandbox_support()
needs_isolation = pytest.mark.skipif(not SUPPORT.isolated, reason=f"this machine cannot isolate: {SUPPORT.problem}")
TOK = ByteTokenizer()


class ScriptedPolicy:
    """A generator whose sample i of a batch writes `programs[i % len(programs)]`: first as a python tool
    call, then (the turn after the tool's answer) as its answer. Records the tool answers it was shown."""

    policy_version = 0

    def __init__(self, programs) -> None:
        self.programs = programs
        self.tool_answers: list[str] = []

    def generate(self, prompts, sampling):
        outs = []
        for i, p in enumerate(prompts):
            text = TOK.decode(p)
            program = self.programs[i % len(self.programs)]
            program = program(text) if callable(program) else program
            if "<result>" in text:
                self.tool_answers.append(text.rsplit("<result>", 1)[1])
                turn = f"<answer>{program}</answer>"
            else:
                turn = f"<tool>python: {program}</tool>"
            tokens = TOK.encode(turn)
            outs.append(Completion(prompt=p, tokens=tokens, logprobs=torch.full((len(tokens),), -1.0),
                                   finish_reason="stop", policy_version=self.policy_version))
        return outs

    def update_weights(self, state_dict, *, version):
        self.policy_version = version


def solve(prompt: str) -> str:
    """The reference program of the family every example of `prompt` agrees with (the control)."""
    examples = [(json.loads(x), json.loads(y)) for x, y in re.findall(r"^f\((\[[\d,]*\])\)=(.+)$", prompt, re.M)]
    for _, body, fn in FAMILIES:
        if all(fn(x) == y for x, y in examples):
            return f"def f(x):{body}"
    return "def f(x):return x"


def code_job(folder: Path, policy: ScriptedPolicy, monkeypatch, *, prompts: int) -> list[dict]:
    monkeypatch.setattr(rl_job, "_make_generator", lambda config, model, pad_id: policy)
    config = RLConfig()
    config.job.folder, config.job.device = str(folder), "cpu"
    config.env.task, config.env.max_turns = "code", 2
    config.pretrain.steps = 0
    config.policy.num_layers = 1
    config.training.steps = 1
    config.rollout.prompts_per_step, config.algorithm.group_size = prompts, 2
    config.rollout.max_new_tokens = 8  # unused by the scripted policy
    config.eval.problems, config.eval.interval = 1, 0
    config.metrics.progress = False
    result = run_rl(config)
    return result


@needs_isolation
def test_programs_that_loop_fork_or_write_outside_are_stopped_and_score_zero(tmp_path, monkeypatch):
    outside = Path(tempfile.mkdtemp(prefix="titan-rl-outside-", dir=sys.prefix))  # visible, read-only inside
    os.chmod(outside, 0o777)
    targets = [tmp_path / "escaped.txt", outside / "escaped.txt"]  # the job's folder; the environment's
    programs = [
        "while True:\n    pass\ndef f(x):return sorted(x)",
        "def f(x):\n    while True:\n        pass",  # loops only when the hidden tests call it
        "import os\nwhile True:\n    os.fork()\ndef f(x):return sorted(x)",
        *(f"open({str(t)!r}, 'w').write('x')\ndef f(x):return sorted(x)" for t in targets),
    ]
    policy = ScriptedPolicy(programs)
    began = time.monotonic()
    result = code_job(tmp_path / "job", policy, monkeypatch, prompts=3)
    seconds = time.monotonic() - began
    try:
        assert [m["reward_mean"] for m in result.curve] == [0.0] and result.evals == {0: 0.0, 1: 0.0}
        assert not any(t.exists() for t in targets), "a program wrote outside its folder"
        answers = policy.tool_answers[1:7]  # after the first evaluation: the 6 training episodes' tool answers
        assert answers[0].startswith(("error: cpu_limit", "error: wall_timeout")), answers
        assert answers[1] == "</result>", answers  # defining f printed nothing; its hidden tests loop
        # the fork bomb: an error, whose last stderr line depends on which of its processes wrote last (a
        # BlockingIOError, a limit, or a traceback line cut short when the sandbox stopped them all)
        assert answers[2].startswith("error: "), answers
        assert answers[3].startswith("error: FileNotFoundError"), answers  # the job's folder is not there
        assert answers[4].startswith("error: OSError: [Errno 30] Read-only file system"), answers
        # Each sandbox run is bounded by its wall limit (5 s): 14 runs, most of them far shorter.
        assert seconds < 120, seconds
    finally:
        os.chmod(outside, 0o700)
        for child in outside.iterdir():
            child.unlink()
        outside.rmdir()


@needs_isolation
def test_the_same_job_path_scores_correct_programs(tmp_path, monkeypatch):
    """The control: through the same path, the reference program of each prompt passes the hidden tests."""
    policy = ScriptedPolicy([solve])
    result = code_job(tmp_path, policy, monkeypatch, prompts=2)
    assert result.curve[0]["reward_mean"] > 0.7, result.curve
    assert all(not a.startswith("error") for a in policy.tool_answers), policy.tool_answers


def test_rl_code_recipe_is_a_multi_turn_code_job():
    config = RL_RECIPES["rl_code"]()
    assert config.env.task == "code" and config.env.max_turns >= 2 and config.pretrain.steps > 0
    assert config.job.device == "cpu"


class HalfRight(ScriptedPolicy):
    """Even samples of a batch write the prompt's reference program, odd ones a wrong one."""

    def __init__(self) -> None:
        super().__init__([solve, "def f(x):return x"])


@needs_isolation
def test_the_update_moves_the_policy_towards_programs_that_pass_hidden_tests():
    """A deterministic quantity instead of a sampled reward: on fixed episodes (half the programs right,
    scored by the hidden tests in the sandbox), five GRPO updates of the job's PolicyUpdate make each passing
    episode more likely against its failing twin by a margin (nats) far above rounding.
    (The reward curve of the whole job is measured in titan-rl's README.)"""
    import titan_models as tm
    from titan_rl import SamplingConfig, collect_rollouts, grpo
    from titan_rl.envs import SandboxConfig
    from titan_rl.envs.function_tasks import FunctionTask, code_exec_env
    from titan_train.rl.update import PolicyUpdate

    torch.manual_seed(0)
    task = FunctionTask(sandbox=SandboxConfig(cpu_seconds=1, wall_seconds=3.0, memory_bytes=256 * 2**20))
    samples = collect_rollouts(make_env=lambda: code_exec_env(task, max_turns=2), seeds=[0, 1, 2, 3], group_size=2,
                               generator=HalfRight(), tokenizer=TOK, sampling=SamplingConfig(), max_turns=2).samples
    rewards = torch.tensor([s.reward for s in samples]).view(-1, 2)
    assert bool((rewards[:, 0] > rewards[:, 1]).all()), rewards  # the reference passes more hidden tests
    algorithm = grpo(group_size=2)
    advantages = algorithm.advantages(rewards)[0].flatten().tolist()
    config = tm.llama3.Llama3Config(vocab_size=TOK.vocab_size, dim=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                    ffn_dim=128, max_seq_len=512)
    with torch.device("meta"):
        policy = config.build()
    policy.to_empty(device="cpu")
    policy.init_weights(seed=0)
    for s in samples:  # on-policy behaviour logprobs: the ratio starts at 1
        with torch.no_grad():
            logp = titan_rl_logprobs(policy, s)
        s.behavior_logprobs = logp
    update = PolicyUpdate(policy=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=3e-3), loss=algorithm.loss,
                          pad_id=TOK.pad_id)
    before = [float(titan_rl_logprobs(policy, s) @ torch.tensor(s.loss_mask, dtype=torch.float32)) for s in samples]
    for _ in range(5):
        update(samples, advantages)
    after = [float(titan_rl_logprobs(policy, s) @ torch.tensor(s.loss_mask, dtype=torch.float32)) for s in samples]
    # Per group: how much more likely the passing episode became than the failing one (their shared
    # prefix, the same tokens after the same context, cancels out).
    margin = [(after[i] - after[i + 1]) - (before[i] - before[i + 1]) for i in range(0, len(samples), 2)]
    assert all(m > 2.0 for m in margin), margin


def titan_rl_logprobs(policy, sample) -> torch.Tensor:
    """The policy's logprobs of a sample's completion tokens (the model's and the tool's alike)."""
    from titan_rl import token_logprobs

    tokens = torch.tensor([sample.prompt + sample.completion])
    with torch.no_grad():
        return token_logprobs(policy, tokens)[0, len(sample.prompt) - 1:]
