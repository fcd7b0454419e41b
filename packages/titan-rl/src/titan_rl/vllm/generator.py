"""VLLMGenerator: the Generator interface over a vLLM engine running titan-models' definition."""
from __future__ import annotations

import io
import json
import os
import tempfile
import threading
from pathlib import Path

import titan_models as tm
import torch
from torch import nn
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from titan_rl.generation.base import Completion
from titan_rl.generation.sampling import SamplingConfig
from titan_rl.vllm.plugin import architectures
from titan_rl.vllm.support import check_servable


def _load_titan_weights(worker, payload: bytes) -> int:
    """Runs inside the vLLM worker (collective_rpc): hands the tensors to the model's load_weights.
    They come as torch.save bytes: a worker in another process (the multiprocessing engine) gets the
    arguments through vLLM's msgpack, which returns tensors nested in a dict as lists."""
    weights = torch.load(io.BytesIO(payload), weights_only=True)
    model = worker.model_runner.model
    return len(model.load_weights(weights.items()))


class VLLMGenerator:
    """Generates with vLLM from a titan model's weights.

    `from_model(model)` writes the model as a Hugging Face folder (titan_models.to_hf) and starts an
    engine on it, with the architecture routed to the titan plugin. `update_weights` pushes new
    weights into the running engine (no restart) through `collective_rpc` -> the model's `load_weights`.
    Logprobs are vLLM's of the sampled token (logprobs=0), under the temperature-scaled distribution
    ("processed_logprobs"), which is what titan_rl.token_logprobs(temperature=T) computes.
    """

    def __init__(self, llm: LLM, *, policy_version: int = 0) -> None:
        self.llm = llm
        self.policy_version = policy_version
        # LLM is not thread-safe: a background rollout thread generates while the trainer syncs weights.
        self._lock = threading.Lock()

    @classmethod
    def from_model(cls, model: nn.Module, *, max_model_len: int = 512, seed: int = 0, batch_invariant: bool = False,
                   workdir: str | Path | None = None, **llm_kwargs) -> "VLLMGenerator":
        check_servable(model, batch_invariant=batch_invariant)  # before writing a folder or starting an engine
        folder = Path(workdir or tempfile.mkdtemp(prefix="titan-vllm-"))
        tm.to_hf(model, folder)
        arch = json.loads((folder / "config.json").read_text())["architectures"][0]
        titan_arch = {hf: ours for ours, hf in architectures().items()}
        if arch not in titan_arch:
            raise ValueError(f"no titan vLLM architecture for {arch}; supported: {sorted(titan_arch)}")
        os.environ["TITAN_RL_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
        if torch.distributed.is_initialized():
            # A generator rank of disaggregated generation: an in-process engine would build vLLM's groups
            # on this process's torch.distributed world (trainer ranks included), so the engine runs in a
            # process of its own, spawned (a forked one would inherit this process group). update_weights
            # then sends _load_titan_weights (our function) to that process, which needs pickle.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        dtype = next(model.parameters()).dtype
        llm = LLM(model=str(folder), tokenizer=None, skip_tokenizer_init=True, hf_overrides={"architectures": [titan_arch[arch]]},
                  dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=True,
                  logprobs_mode="processed_logprobs", enable_prefix_caching=False, **llm_kwargs)
        return cls(llm)

    def close(self) -> None:
        """Drops the engine (in-process engines free their memory once unreferenced)."""
        import gc
        self.llm = None
        gc.collect()

    def update_weights(self, state_dict: dict[str, torch.Tensor], *, version: int) -> None:
        weights = {k: v.detach().to("cpu") for k, v in state_dict.items()}
        payload = io.BytesIO()
        torch.save(weights, payload)
        with self._lock:
            if weights:
                self.llm.collective_rpc(_load_titan_weights, args=(payload.getvalue(),))
            self.policy_version = version

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        # One SamplingParams per prompt: a shared seed would give every sample of a group the same draws.
        params = [SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_token_ids), logprobs=0, detokenize=False, ignore_eos=True,
            seed=None if sampling.seed is None else sampling.seed + i,
        ) for i in range(len(prompts))]
        with self._lock:
            version = self.policy_version
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        completions = []
        for prompt, out in zip(prompts, outputs):
            seq = out.outputs[0]
            tokens = list(seq.token_ids)
            logprobs = torch.tensor([float(step[tok].logprob) for tok, step in zip(tokens, seq.logprobs)])
            tokens, logprobs, reason = _apply_stop_sequences(tokens, logprobs, sampling, seq.finish_reason)
            completions.append(Completion(prompt=list(prompt), tokens=tokens, logprobs=logprobs,
                                          finish_reason=reason, policy_version=version))
        return completions


def _apply_stop_sequences(tokens, logprobs, sampling: SamplingConfig, finish_reason):
    """vLLM stops on strings, not token sequences; cut at the first token-id stop sequence."""
    reason = "stop" if finish_reason == "stop" else "length"
    for end in range(1, len(tokens) + 1):
        if any(tuple(tokens[max(0, end - len(s)):end]) == tuple(s) for s in sampling.stop_sequences):
            return tokens[:end], logprobs[:end], "stop"
    return tokens, logprobs, reason
