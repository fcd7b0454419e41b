"""Multi-turn code execution: the write-the-function task family (splits, hidden tests, demonstrations),
the sandboxed python tool, and the loss mask over tool outputs."""
from __future__ import annotations

import json
import random

import pytest
import titan_models as tm
import torch

from titan_rl import ByteTokenizer, Completion, SamplingConfig, TrainBatch, collect_rollouts, dapo, grpo, gspo
from titan_rl import policy_loss, token_logprobs
from titan_rl.envs import SandboxConfig, sandbox_support
from titan_rl.envs.function_tasks import FAMILY_NAMES, FunctionTask, code_exec_env
from titan_rl.envs.python_tool import PythonTool

SUPPORT = sandbox_support()
needs_isolation = pytest.mark.skipif(not SUPPORT.isolated, reason=f"this machine cannot isolate: {SUPPORT.problem}")
FAST = SandboxConfig(cpu_seconds=1, wall_seconds=3.0, memory_bytes=256 * 2**20)
TOK = ByteTokenizer()


def test_train_and_heldout_splits_are_disjoint_and_cover_every_family():
    train, heldout = FunctionTask(split="train"), FunctionTask(split="heldout")
    rng = random.Random(0)
    train_problems = [train.sample(rng) for _ in range(2000)]
    heldout_problems = [heldout.sample(rng) for _ in range(500)]
    key = lambda p: p.prompt + repr(p.checks)  # noqa: E731
    assert not {key(p) for p in train_problems} & {key(p) for p in heldout_problems}
    assert {p.family for p in heldout_problems} == set(FAMILY_NAMES) == {p.family for p in train_problems}
    # About heldout_fraction of all problems are held out (the hash is not biased towards either split).
    drawn = [train._draw(random.Random(i)) for i in range(4000)]
    share = sum(train.in_heldout(p.prompt + repr(p.checks)) for p in drawn) / len(drawn)
    assert 0.17 < share < 0.23, share
    with pytest.raises(ValueError, match="allowed"):
        FunctionTask(families=("sorted", "nope"))


@needs_isolation
def test_demonstrations_replay_through_the_sandbox_and_score_one():
    """Every family's demonstration, played through the real environment: the python tool's output is the
    demonstration's text, and the answer passes the hidden tests. A wrong program scores what it passes."""
    task = FunctionTask(sandbox=FAST)
    seen = set()
    for seed in range(400):
        env = code_exec_env(task)
        prompt = env.reset(seed=seed)
        if env.problem.family in seen:
            continue
        seen.add(env.problem.family)
        demo = task.demonstration(env.problem)
        call = demo[:demo.index("</tool>") + len("</tool>")]
        first = env.step(call)
        assert not first.done and demo[len(call):].startswith(first.observation), (first, demo)
        last = env.step(demo[len(call) + len(first.observation):])
        assert last.done and last.reward == 1.0, (prompt, demo, last)
    assert seen == set(FAMILY_NAMES)
    problem = next(p for p in (task.sample(random.Random(i)) for i in range(100)) if p.family == "sum")
    inputs = [json.loads(expr[len("f("):-1]) for expr, _ in problem.checks]  # 'f([1,2])' -> [1, 2]
    agree = sum(max(x) == expected for x, (_, expected) in zip(inputs, problem.checks))
    assert task.reward(problem, "def f(x):return max(x)") == agree / len(problem.checks)


@needs_isolation
@pytest.mark.parametrize("code, answers", [
    ("while True:\n    pass", ("error: cpu_limit", "error: wall_timeout")),  # which comes first: the load
    # a fork bomb's processes write concurrently: the last stderr line may be any of theirs (a BlockingIOError,
    # a limit, or a traceback line cut short when the sandbox stopped them): an error, bounded
    ("import os\nwhile True:\n    os.fork()", ("error: ",)),
    ("open('/usr/pwned', 'w').write('x')", ("error: OSError: [Errno 30] Read-only file system",)),
    ("print('x' * 10_000)", ("x" * 200,)),
])
def test_python_tool_stops_bad_programs_and_bounds_its_answer(code, answers):
    out = PythonTool(config=FAST)(code)
    assert out.startswith(answers) and len(out) <= 200, out


class ScriptedGenerator:
    """Answers each turn from a script (turn k of every episode gets script[k]); logprobs from `logprob`."""

    policy_version = 0

    def __init__(self, script: list[str]) -> None:
        self.script = script

    def generate(self, prompts, sampling):
        outs = []
        for p in prompts:
            turn = TOK.decode(p).count("<result>")
            tokens = TOK.encode(self.script[turn])  # a turn ends at its stop string, as with stop_sequences
            outs.append(Completion(prompt=p, tokens=tokens, logprobs=torch.linspace(-3, -0.1, len(tokens)),
                                   finish_reason="stop", policy_version=0))
        return outs


def tiny_policy() -> torch.nn.Module:
    config = tm.llama3.Llama3Config(vocab_size=TOK.vocab_size, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    ffn_dim=64, max_seq_len=512)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _episodes():
    task = FunctionTask(sandbox=FAST)
    script = ["<tool>python: print(sum([1, 2]) * 7)</tool>", "<answer>def f(x):return sorted(x)</answer>"]
    return collect_rollouts(make_env=lambda: code_exec_env(task), seeds=[0, 1], group_size=2,
                            generator=ScriptedGenerator(script), tokenizer=TOK, sampling=SamplingConfig(),
                            max_turns=3).samples


@needs_isolation
def test_loss_mask_is_zero_exactly_on_tool_output_tokens():
    for s in _episodes():
        observation = TOK.encode("<result>21\n</result>")  # what the sandbox printed, as the env answers
        starts = [i for i in range(len(s.completion)) if s.completion[i:i + len(observation)] == observation]
        assert len(starts) == 1, s.text
        start = starts[0]
        expected = [0 if start <= i < start + len(observation) else 1 for i in range(len(s.completion))]
        assert s.loss_mask == expected
        assert s.turns == 2 and all(s.behavior_logprobs[i] == 0 for i in range(start, start + len(observation)))


@needs_isolation
@pytest.mark.parametrize("algorithm", [grpo, dapo, gspo])
def test_gradients_do_not_depend_on_tool_output_logprobs(algorithm):
    """The loss's gradient with respect to each token's logprob is zero on tool-output tokens, and the
    parameter gradients stay bitwise the same when those logprobs are replaced by anything else."""
    samples = _episodes()
    batch = TrainBatch.from_samples(samples, [1.0, -1.0, 0.5, -0.5], pad_id=TOK.pad_id, device=torch.device("cpu"))
    loss_config = algorithm().loss
    policy = tiny_policy()

    def grads(corrupt: bool):
        policy.zero_grad(set_to_none=True)
        logp = token_logprobs(policy, batch.tokens)
        logp.retain_grad()
        used = logp
        if corrupt:  # tool-output positions get an unrelated, differentiable value
            used = torch.where(batch.mask.bool(), logp, logp * 7.0 + 3.0)
        out = policy_loss(loss_config, logprobs=used, advantages=batch.advantages, mask=batch.mask,
                          behavior_logprobs=batch.behavior_logprobs)
        out.loss.backward()
        return logp.grad.clone(), [p.grad.clone() for p in policy.parameters()]

    dlogp, clean = grads(corrupt=False)
    tool_positions = (batch.mask == 0) & (torch.arange(batch.mask.shape[1]) < batch.tokens.shape[1] - 1)
    assert int(((batch.mask == 0) & (dlogp == 0)).sum()) == int((batch.mask == 0).sum())
    assert bool((dlogp[batch.mask == 1] != 0).any())  # the model's own tokens do carry the gradient
    assert tool_positions.any()
    _, corrupted = grads(corrupt=True)
    assert all(torch.equal(a, b) for a, b in zip(clean, corrupted))


def test_python_tool_memoises_what_the_code_decides_but_not_a_wall_timeout(monkeypatch):
    """A timeout under load must not become the code's permanent answer (the policy would see it in every
    later episode running that code); what the code itself decides is run once."""
    import titan_rl.envs.python_tool as python_tool
    from titan_rl.envs import SandboxResult

    outcomes = iter([SandboxResult(status="wall_timeout", returncode=None, stdout="", stderr=""),
                     SandboxResult(status="ok", returncode=0, stdout="3\n", stderr="")])
    calls = []
    monkeypatch.setattr(python_tool, "run_sandboxed", lambda code, config: calls.append(code) or next(outcomes))
    monkeypatch.setattr(python_tool, "_MEMO", {})
    tool = PythonTool(config=FAST)
    assert tool("print(1 + 2)") == "error: wall_timeout"
    assert tool("print(1 + 2)") == "3\n" and tool("print(1 + 2)") == "3\n"
    assert len(calls) == 2  # run again after the timeout, then remembered
