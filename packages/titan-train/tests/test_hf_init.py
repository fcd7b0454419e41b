"""Training from a Hugging Face folder (`model.hf_path`) on the `random` source: the first step's loss
equals transformers' loss for the same weights and tokens, and the random loader resumes exactly."""
from __future__ import annotations

import torch
import transformers

from titan_train.data import RandomTokenLoader, random_rows
from titan_train.trainer import train


def test_first_loss_matches_transformers_on_the_same_weights_and_tokens(tmp_path, jobs):
    hf_config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(hf_config).eval()
    reference.save_pretrained(tmp_path / "hf")

    config = jobs.tiny(tmp_path / "job", **{
        "model.hf_path": str(tmp_path / "hf"), "data.source": "random", "training.steps": "2",
        "training.batch_size": "2", "training.seq_len": "32", "training.mixed_precision": "fp32"})
    result = train(config)

    window = random_rows(300, 32, seed=config.job.seed, first_row=0, rows=2)  # the trainer's first batch
    tokens, labels = window[:, :-1].contiguous(), window[:, 1:].contiguous()
    with torch.no_grad():
        expected = reference(input_ids=tokens, labels=labels, shift_labels=labels).loss.item()
    assert abs(result.losses[1] - expected) / expected < 1e-5


def test_random_loader_is_a_function_of_its_position():
    loader = RandomTokenLoader(50, seq_len=8, seed=3)
    first, second = loader.next_batch(2), loader.next_batch(3)
    state = loader.state_dict()
    third = loader.next_batch(2)
    resumed = RandomTokenLoader(50, seq_len=8, seed=3)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch(2).tokens, third.tokens)
    assert torch.equal(first.labels[:, :-1], first.tokens[:, 1:])  # labels are the next tokens
    assert not torch.equal(second.tokens[:2], first.tokens)
    assert int(first.tokens.max()) < 50
