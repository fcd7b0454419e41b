"""One rank of test_routing's split-sequence balance loss test (gloo, CPU).

Every rank draws the same whole sequences and computes their loss and its gradient in one piece (no group),
then its own contiguous slice of every sequence's tokens with group=WORLD (and, as a control, without); writes
the ranks' summed shares and how far its slice's gradient is from the whole one's there.

usage: python balance_loss_worker.py RANK WORLD_SIZE INIT_METHOD OUT_DIR
"""
from __future__ import annotations

import sys

from dist_moe_rank_report import write_rank_report


def run(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import dist_moe

    gen = torch.Generator().manual_seed(0)
    b, s, e, k, alpha = 3, 6 * world, 8, 2, 0.7
    scores = torch.rand(b, s, e, generator=gen).requires_grad_()
    ids = torch.rand(b, s, e, generator=gen).topk(k, dim=-1).indices  # skewed on purpose: not balanced
    whole = dist_moe.sequence_balance_loss(scores, ids, alpha=alpha)
    whole.backward()
    part = slice(rank * s // world, (rank + 1) * s // world)
    mine = scores.detach()[:, part].clone().requires_grad_()
    share = dist_moe.sequence_balance_loss(mine, ids[:, part], alpha=alpha, group=dist.group.WORLD)
    share.backward()
    total = share.detach().clone()
    dist.all_reduce(total)
    alone = dist_moe.sequence_balance_loss(mine.detach(), ids[:, part], alpha=alpha)  # the slice taken as whole
    return {"whole": whole.item(), "alone": alone.item(), "summed_shares": total.item(),
            "grad_max_error": (mine.grad - scores.grad[:, part]).abs().max().item(),
            "grad_max": scores.grad.abs().max().item()}


def main() -> None:
    rank, world, init_method, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    write_rank_report(rank, world, init_method, out_dir, lambda: run(rank, world))


if __name__ == "__main__":
    main()
