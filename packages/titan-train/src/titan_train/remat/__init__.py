"""activation_checkpoint.mode=remat: per-op and per-block recomputation, explicit or planned under a budget."""
from .apply import apply_remat
from .measure import BlockProfile, profile_blocks
from .peak import PeakModel, StaticMemory, peak_model, peak_plan, planned_under_budget
from .plan import BlockChoice, budget_plan, explicit_plan

__all__ = ["BlockChoice", "BlockProfile", "PeakModel", "StaticMemory", "apply_remat", "budget_plan", "explicit_plan",
           "peak_model", "peak_plan", "planned_under_budget", "profile_blocks"]
