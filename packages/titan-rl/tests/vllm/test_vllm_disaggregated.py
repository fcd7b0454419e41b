"""vLLM as a generator rank of disaggregated generation (2 gloo ranks): rank 0 trains a batch-invariant
float32 Llama, rank 1 receives the weights by broadcast (WeightReceiver), starts a vLLM engine on them in
a process of its own, serves rollouts (RolloutServer) and loads every new version into the running engine.
The trainer's logprobs of the sampled tokens are bitwise vLLM's at each step, the second one after an
update: the new weights reached the engine."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import titan_rl
from titan_rl import SamplingConfig, collect_rollouts
from titan_rl.envs import SingleTurn, SortingTask

TOK = titan_rl.CharTokenizer("0123456789sort:=\n")
STEPS = 2


def small_llama() -> torch.nn.Module:
    import titan_models as tm

    config = tm.llama3.Llama3Config(vocab_size=64, dim=128, num_layers=2, num_heads=2, num_kv_heads=1,
                                    ffn_dim=384, max_seq_len=512)  # head_dim 64, as vLLM's CPU attention needs
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return titan_rl.batch_invariant(model)


def _rank_main(rank: int, init_method: str, folder: str) -> None:
    import torch.distributed as dist
    from rank_runner import join_gloo

    join_gloo(rank, 2, init_method)
    try:
        sync, rollout = dist.new_group([0, 1]), dist.new_group([0, 1])
        if rank == 1:
            from titan_rl.vllm.generator import VLLMGenerator

            model = small_llama().requires_grad_(False)
            receiver = titan_rl.WeightReceiver(model, group=sync, source=0, planner=1)
            first = receiver.receive()
            with torch.no_grad():
                model.load_state_dict(first.weights)
            generator = VLLMGenerator.from_model(model, max_model_len=256, batch_invariant=True)
            sampling = SamplingConfig(max_new_tokens=6, stop_token_ids=(TOK.eos_id,))
            produce = lambda i: collect_rollouts(  # noqa: E731
                make_env=lambda: SingleTurn(SortingTask(min_length=3, max_length=3)), seeds=[2 * i, 2 * i + 1],
                group_size=2, generator=generator, tokenizer=TOK, sampling=sampling, first_group=2 * i)
            titan_rl.RolloutServer(generator=generator, receiver=receiver, produce=produce, max_policy_lag=0,
                                   leader=0, rollout_group=rollout, consumed=first.consumed).run()
            generator.close()
        else:
            policy = small_llama()
            optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
            remote = titan_rl.RemoteRollouts(generator_ranks=[1], leader=0, max_policy_lag=0, trainer_group=None,
                                             rollout_group=rollout,
                                             sender=titan_rl.WeightSender(group=sync, source=0, planner=1))
            remote.publish(titan_rl.full_tensors(policy), version=0)
            mismatches = []
            for version in range(STEPS):
                samples = remote.get(version).parts[0].samples
                tb = titan_rl.TrainBatch.from_samples(samples, [1.0] * len(samples), pad_id=TOK.pad_id, device="cpu")
                logp = titan_rl.token_logprobs(policy, tb.tokens)
                mismatches.append(float(((logp.detach() - tb.behavior_logprobs).abs() * tb.mask).max()))
                optimizer.zero_grad()
                (-(logp * tb.mask).sum()).backward()
                optimizer.step()
                remote.publish(titan_rl.full_tensors(policy), version=version + 1)
            remote.close(version=STEPS)
            torch.save(mismatches, os.path.join(folder, "mismatches.pt"))
    except BaseException:
        import traceback

        traceback.print_exc()  # the engine's process would keep an exiting rank waiting: report, then _exit
        os._exit(1)
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_vllm_generator_rank_gets_each_update_and_agrees_bitwise(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent.parent))  # rank_runner
    from rank_runner import file_rendezvous, spawn_ranks

    spawn_ranks(_rank_main, 2, (file_rendezvous(tmp_path), str(tmp_path)))
    assert torch.load(tmp_path / "mismatches.pt") == [0.0] * STEPS
