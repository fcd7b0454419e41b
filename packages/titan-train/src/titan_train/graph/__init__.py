"""GraphTrainer's explicit training graph: capture (capture.py), graph passes (passes.py)."""
from .capture import GraphStep, op_counts, write_graph
from .optimizer_graph import GraphAdamW
from .passes import GraphPass, apply_passes, graph_passes, register_graph_pass

__all__ = ["GraphAdamW", "GraphPass", "GraphStep", "apply_passes", "graph_passes", "op_counts", "register_graph_pass",
           "write_graph"]
