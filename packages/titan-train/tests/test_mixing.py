"""Data mixing: rows come from each source in the weights' proportion, in an order fixed by the seed, and
a resumed run (mixing state in the checkpoint) sees the data and losses of the unbroken run."""
from __future__ import annotations

import json

import pytest
import torch

from titan_train import train
from titan_train.config import DataConfig


@pytest.fixture
def two_sources(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    a.write_text("".join(json.dumps({"text": f"alpha {i} " * 20}) + "\n" for i in range(50)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"BETA-{i}|" * 25 for i in range(50)]}), b)
    return a, b


def loader(a, b, seed=0):
    config = DataConfig(sources=((str(a), 0.7), (str(b), 0.3)))
    return config.build(config.build_tokenizer(), vocab_size=384, seq_len=32, seed=seed)


def test_rows_follow_the_weights_and_resume_exactly(two_sources):
    a, b = two_sources
    mixed = loader(a, b)
    first = mixed.next_batch(200)
    from_b = [bool((row == ord("|")).any()) for row in first.tokens]  # b's rows hold '|', a's never
    assert 0.6 < 1 - sum(from_b) / 200 < 0.8
    assert from_b == [mixed.source_of(r) == 1 for r in range(200)]
    state = mixed.state_dict()
    unbroken = mixed.next_batch(30)
    resumed = loader(a, b)
    resumed.load_state_dict(state)
    again = resumed.next_batch(30)
    assert torch.equal(again.tokens, unbroken.tokens) and torch.equal(again.labels, unbroken.labels)
    assert not torch.equal(loader(a, b, seed=1).next_batch(200).tokens, first.tokens)  # the seed decides


def test_resumed_run_with_mixing_matches_the_unbroken_run(tmp_path, jobs, two_sources):
    a, b = two_sources
    job = {"data.sources": f"{a}=0.7,{b}=0.3", "lr_schedule.kind": "constant", "checkpoint.interval": "2",
           "checkpoint.resume": "true"}
    unbroken = train(jobs.tiny(tmp_path / "whole", **job, **{"training.steps": "5"})).losses
    train(jobs.tiny(tmp_path / "broken", **job, **{"training.steps": "2"}))
    resumed = train(jobs.tiny(tmp_path / "broken", **job, **{"training.steps": "5"}))
    assert resumed.start_step == 2
    assert resumed.losses == {s: unbroken[s] for s in (3, 4, 5)}  # bitwise
