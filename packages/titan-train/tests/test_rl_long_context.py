"""Long-context RL: the retrieval task, and the context-parallel RL loss and gradients on 2 gloo ranks
equal to one process's for a batch of 4k-token retrieval episodes (float64; ~1-3 min on a loaded 2-core
machine: two 4k-token forwards and backwards per rank, the ring's attention in explicit matmuls)."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks

import titan_models as tm
from titan_rl import ByteTokenizer, Sample, TrainBatch, dapo, grpo, policy_loss, token_logprobs
from titan_rl.envs.retrieval import KeyValueRetrievalTask

TOK = ByteTokenizer()


def test_retrieval_prompts_have_the_asked_length_and_one_answer():
    task = KeyValueRetrievalTask(context_chars=16384)
    problem = task.sample(random.Random(3))
    lines = problem.prompt.split("\n")
    context, query = lines[:-1], lines[-1]
    assert 16384 - 9 < len(problem.prompt) - len(query) <= 16384 and len(TOK.encode(problem.prompt)) > 16000
    key = query[1:-1]
    assert [line for line in context if line.startswith(key + "=")] == [f"{key}={problem.answer}"]
    assert len({line.split("=")[0] for line in context}) == len(context)  # every key once
    assert task.reward(problem, problem.answer + "\n") == 1.0
    assert task.reward(problem, problem.answer[:2] + "x") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="context_chars"):
        KeyValueRetrievalTask(context_chars=10)


def tiny_policy() -> torch.nn.Module:
    config = tm.llama3.Llama3Config(vocab_size=TOK.vocab_size, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    ffn_dim=64, max_seq_len=8192)  # one layer: the ring runs in each alike
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.double()


def long_batch() -> TrainBatch:
    """Two retrieval episodes of different lengths (3.2k and 4.1k tokens; right-padded), sampled answers."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, chars in enumerate((3200, 4096)):
        problem = KeyValueRetrievalTask(context_chars=chars).sample(random.Random(i))
        completion = TOK.encode(problem.answer if i else "07") + [TOK.eos_id]
        samples.append(Sample(prompt=TOK.encode(problem.prompt), completion=completion, loss_mask=[1] * len(completion),
                              behavior_logprobs=-torch.rand(len(completion), generator=gen), reward=float(i),
                              group=0, policy_version=0))
    batch = TrainBatch.from_samples(samples, [-1.0, 1.0], pad_id=TOK.pad_id, device=torch.device("cpu"))
    batch.behavior_logprobs = batch.behavior_logprobs.double()
    return batch


def _loss(logp: torch.Tensor, batch: TrainBatch, algorithm) -> torch.Tensor:
    return policy_loss(algorithm().loss, logprobs=logp, advantages=batch.advantages.double(),
                       mask=batch.mask.double(), behavior_logprobs=batch.behavior_logprobs).loss


def _cp_rank(rank: int, world: int, init_method: str, out: str) -> None:
    import torch.distributed as dist

    from titan_train.context_parallel import apply_context_parallel
    from titan_train.rl.context_parallel_logprobs import cp_token_logprobs

    join_gloo(rank, world, init_method)
    try:
        torch.set_num_threads(1)
        batch, results = long_batch(), {}
        reference = tiny_policy()  # one process: the whole sequences
        logp = token_logprobs(reference, batch.tokens)
        model = tiny_policy()
        apply_context_parallel(model, dist.group.WORLD)
        cp_logp = cp_token_logprobs(model, batch.tokens, group=dist.group.WORLD, pad_id=TOK.pad_id)
        for name, algorithm in (("grpo", grpo), ("dapo", dapo)):  # sequence-mean and token-mean losses
            loss, cp_loss = _loss(logp, batch, algorithm), _loss(cp_logp, batch, algorithm)
            grads = torch.autograd.grad(loss, list(reference.parameters()), retain_graph=True)
            cp_grads = torch.autograd.grad(cp_loss, list(model.parameters()), retain_graph=True)
            worst = 0.0
            for g, cp_g in zip(grads, cp_grads):
                summed = cp_g.clone()
                dist.all_reduce(summed)  # each rank's gradient is cp x its tokens' share (see the module)
                worst = max(worst, float((summed / world - g).abs().max() / g.abs().max().clamp_min(1e-30)))
            own_share = max(float((cp_g - g).abs().max()) for g, cp_g in zip(grads, cp_grads))
            results[name] = {"loss": float(loss), "cp_loss": float(cp_loss), "grad_rel_err": worst,
                             "own_share_diff": own_share}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_context_parallel_rl_loss_and_gradients_equal_one_process(tmp_path):
    init_method = file_rendezvous(tmp_path)
    out = tmp_path / "cp.json"
    spawn_ranks(_cp_rank, 2, (2, init_method, str(out)))
    results = json.loads(out.read_text())
    for name, r in results.items():
        assert abs(r["cp_loss"] - r["loss"]) <= 1e-12 * max(1.0, abs(r["loss"])), (name, r)
        assert r["grad_rel_err"] < 1e-10, (name, r)
        assert r["own_share_diff"] > 1e-6, (name, r)  # a rank's own gradient alone is not the answer


def _job_rank(rank: int, world: int, init_method: str, folder: str) -> None:
    from titan_train.rl import RLConfig, run_rl
    from titan_train.rl.recipes import RL_RECIPES

    # no group made here: run_rl joins one itself by TITAN_INIT_METHOD (titan_train.process_group), as a
    # job on a cluster's shared file system would; with no MASTER_PORT, env:// could not bring the ranks together
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TITAN_INIT_METHOD=init_method)
    os.environ.pop("MASTER_PORT", None)
    config: RLConfig = RL_RECIPES["rl_long_context"]()
    config.job.folder, config.metrics.progress = folder, False
    config.env.context_chars = 1024
    config.pretrain.steps, config.training.steps, config.eval.problems = 0, 2, 2
    run_rl(config)
    os._exit(0)


def test_long_context_job_trains_with_context_parallel_ranks(tmp_path):
    """The rl_long_context recipe on 2 ranks (context_parallel=2, the update's sequences split): the trainer's
    ring-attention logprobs of every sampled token match what each rank's generator (whole sequences, KV
    cache) reported, so the split reassembles the right sequences; a wrong layout would be off by far more."""
    init_method = file_rendezvous(tmp_path)
    spawn_ranks(_job_rank, 2, (2, init_method, str(tmp_path)))
    records = [json.loads(line) for line in (tmp_path / "rl_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["trained_samples"] == 8 and r["completion_len"] >= 1 for r in records)
    assert max(r["logprob_mismatch_max"] for r in records) < 1e-4, records
