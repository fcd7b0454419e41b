"""Ring attention over gloo ranks against one process's dense SDPA (titan-models' inner attention), in float64.

Tolerance: 1e-10 absolute on outputs and on dQ/dK/dV. In float64 the only difference is the order of
the sums (blockwise online softmax, gradients accumulated around the ring), a relative error near
1e-15 per operation; a wrong mask, a block merged with the wrong weight or a dK/dV that ends at the
wrong rank is off by 1e-2 or more. The bf16 case (products in bf16, statistics in fp32, as on GPUs) is
held to 3e-2: bf16 keeps 8 bits of mantissa (relative 4e-3 per rounding) and the values here are O(1).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from titan_train_ranks import file_rendezvous, join_gloo, spawn_ranks

import titan_models as tm
from titan_models.components.attention import SDPAttention
from titan_train.context_parallel import (
    RingAttention,
    _Pairing,
    chunk_size,
    local_indices,
    shard_sequence,
    unshard_sequence,
)

B, S, HQ, HKV, D, DV = 2, 24, 4, 2, 8, 6


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, HQ, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, S, HKV, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, S, HKV, DV, dtype=torch.float64, generator=g)
    dout = torch.randn(B, S, HQ, DV, dtype=torch.float64, generator=g)
    # Packed documents: row 0 in three documents (boundaries off the chunk edges), row 1 one document.
    docs = torch.zeros(B, S, dtype=torch.long)
    docs[0, 5:], docs[0, 17:] = 1, 2
    return q, k, v, dout, docs


def test_layout_is_balanced_and_round_trips():
    assert local_indices(0, 2, 8).tolist() == [0, 1, 6, 7] and local_indices(1, 2, 8).tolist() == [2, 3, 4, 5]
    x = torch.arange(2 * 24).reshape(2, 24)
    shards = [shard_sequence(r, 3, x)[0] for r in range(3)]
    assert torch.equal(unshard_sequence(shards, 3), x)
    # Every rank's queries have the same number of causal (query, key) pairs: balanced work.
    work = [int((local_indices(r, 3, 24)[:, None] >= torch.arange(24)[None]).sum()) for r in range(3)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="divisible by 2 \\* parallelism.cp"):
        chunk_size(10, 3)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_pairing_covers_exactly_the_causal_pairs(cp):
    """The rows/columns each ring step visits (and its mask) are exactly the causal pairs of that block."""
    seq = 4 * cp
    local = seq // cp
    for rank in range(cp):
        q_idx = local_indices(rank, cp, seq)
        for source in range(cp):
            k_idx = local_indices(source, cp, seq)
            want = q_idx[:, None] >= k_idx[None, :]
            pair = _Pairing(rank, source, cp, local, None, torch.device("cpu"))
            got = torch.zeros_like(want)
            got[pair.rows, pair.cols] = True if pair.mask is None else pair.mask
            assert torch.equal(got, want), (rank, source)


def _reference(docs):
    q, k, v, dout, _ = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = SDPAttention(scale=D**-0.5)(q, k, v, context=tm.AttentionContext(document_ids=docs))
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


CASES = {  # id -> (cp, document-masked, variant)
    "cp2-causal": (2, False, "float64"), "cp4-causal": (4, False, "float64"), "cp2-documents": (2, True, "float64"),
    "cp4-documents": (4, True, "float64"), "cp2-documents-row-chunks": (2, True, "row-chunks"),
    "cp2-bf16": (2, True, "bf16"),
}


def _ring_rank(rank: int, world: int, init_method: str, folder: str, cases: list[str]) -> None:
    """Each of `cases` (ids of CASES) in turn on the same ranks; saves this rank's output and gradients."""
    import torch.distributed as dist

    import titan_train.context_parallel as context_parallel

    join_gloo(rank, world, init_method)
    score_elements = context_parallel._SCORE_ELEMENTS
    try:
        for case in cases:
            _, masked, variant = CASES[case]
            # row-chunks: a few query rows at a time
            context_parallel._SCORE_ELEMENTS = 3 * B * HQ * S // world if variant == "row-chunks" else score_elements
            q, k, v, dout, docs = _inputs()
            q, k, v, dout, docs = shard_sequence(rank, world, q, k, v, dout, docs)
            dtype = torch.bfloat16 if variant == "bf16" else torch.float64
            q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            context = tm.AttentionContext(document_ids=docs if masked else None)
            out = RingAttention(scale=D**-0.5, group=dist.group.WORLD)(q, k, v, context=context)
            out.backward(dout)
            torch.save([out.detach(), q.grad, k.grad, v.grad], os.path.join(folder, f"{case}-{rank}.pt"))
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def ring_outputs(tmp_path_factory) -> Path:
    """The folder of every case's per-rank results: the cases of one cp in one spawn."""
    folder = tmp_path_factory.mktemp("ring")
    for cp in (2, 4):
        cases = [case for case, (n, _, _) in CASES.items() if n == cp]
        spawn_ranks(_ring_rank, cp, (cp, file_rendezvous(folder), str(folder), cases))
    return folder


@pytest.mark.parametrize("case", CASES)
def test_ring_attention_matches_dense_attention(ring_outputs, case):
    cp, masked, variant = CASES[case]
    per_rank = [torch.load(ring_outputs / f"{case}-{r}.pt") for r in range(cp)]
    _, _, _, _, docs = _inputs()
    expected = _reference(docs if masked else None)
    atol = 3e-2 if variant == "bf16" else 1e-10
    for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = unshard_sequence([p[i] for p in per_rank], cp).double()
        torch.testing.assert_close(got, expected[i], atol=atol, rtol=0, msg=lambda m: f"{name}: {m}")
