"""The two collectives flexshard issues, under their current names (torch 2.14 renamed them;
the old names still work there but warn, and are the only ones on torch 2.11)."""
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
