"""The plan as remat_plan.json and the start-up line state it: each block's option, and the peak model."""
from __future__ import annotations

from dataclasses import asdict

from .measure import BlockProfile
from .peak import PeakModel, StaticMemory
from .plan import GIB, OPTIONS, BlockChoice, choose


def option_table(profiles: list[BlockProfile], transient: int = 0) -> list[dict]:
    """Per block, every option's bytes on the one basis the planner prices them (held.py): saved, the forward's
    high mark, the backward's transient, and the FLOPs it recomputes."""
    rows = []
    for b in profiles:
        options = {}
        for name, ops in OPTIONS.items():
            c = choose(b, name, ops, transient)
            options[name] = {"saved_bytes": c.saved_bytes, "forward_peak_bytes": c.forward_peak_bytes,
                             "backward_transient_bytes": c.backward_transient_bytes,
                             "recomputed_flops": c.recomputed_flops}
        rows.append({"path": b.path, "options": options})
    return rows


def plan_report(choices: list[BlockChoice], profiles: list[BlockProfile] | None = None, *, memory: StaticMemory,
                peak: PeakModel, transient_bytes: int, budget_bytes: int | None) -> dict:
    return {"blocks": [asdict(c) for c in choices], "options": option_table(profiles or [], transient_bytes),
            "saved_activation_bytes": sum(c.saved_bytes for c in choices),
            "recomputed_flops": sum(c.recomputed_flops for c in choices),
            "forward_static_bytes": memory.forward_bytes, "gradient_bytes": memory.gradient_bytes,
            "gradients_persist": memory.gradients_persist, "loss_bytes": memory.loss_bytes,
            "loss_chunk_bytes": memory.loss_chunk_bytes, "late_gradient_bytes": memory.late_gradient_bytes,
            "block_transient_bytes": transient_bytes, "forward_peak_bytes": peak.forward_bytes,
            "backward_peak_bytes": peak.backward_bytes, "end_of_backward_bytes": peak.end_of_backward_bytes,
            "planned_total_bytes": peak.total_bytes, "budget_bytes": budget_bytes}


def summary_line(report: dict) -> str:
    counts: dict[str, int] = {}
    for b in report["blocks"]:
        counts[b["option"]] = counts.get(b["option"], 0) + 1
    budget = "" if report["budget_bytes"] is None else f" of a {report['budget_bytes'] / GIB:.2f} GiB budget"
    grads = "in the forward (accumulated)" if report["gradients_persist"] else "from the backward on"
    return (f"titan-train remat: {', '.join(f'{n} {k}' for k, n in counts.items())}; saves "
            f"{report['saved_activation_bytes'] / GIB:.3f} GiB of activations beside "
            f"{report['forward_static_bytes'] / GIB:.3f} GiB of weights/moments, gradients "
            f"{report['gradient_bytes'] / GIB:.3f} GiB {grads}; peak {report['planned_total_bytes'] / GIB:.3f} GiB"
            f"{budget} (forward {report['forward_peak_bytes'] / GIB:.3f}, backward "
            f"{report['backward_peak_bytes'] / GIB:.3f}, end of backward {report['end_of_backward_bytes'] / GIB:.3f}),"
            f" recomputes {report['recomputed_flops'] / 1e9:.2f} GFLOP per microbatch")
