import os

import pytest
import torch

# The vLLM tests need vLLM's own environment (tools/vllm-env/run.sh); the normal run skips the folder
# by not collecting it.
collect_ignore = [] if os.environ.get("TITAN_RL_VLLM_TESTS") else ["vllm"]

# Model-level tests run single-threaded: on a shared 2-core machine OpenMP's spinning threads make
# tiny GEMMs 10x slower. The op-level invariance tests restore the default thread count
# (test_batch_invariant_ops.py) so that multi-threaded kernels are covered too.
DEFAULT_THREADS = torch.get_num_threads()
torch.set_num_threads(1)


@pytest.fixture
def tiny_llama():
    """A small Llama 3 (dim 128, 2 query heads sharing 1 kv head, head_dim 64, vocab 512), seed 0."""
    import titan_models as tm

    def build(num_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32):
        config = tm.llama3.Llama3Config(vocab_size=512, dim=128, num_layers=num_layers, num_heads=2, num_kv_heads=1,
                                        ffn_dim=384, max_seq_len=512, dtype=dtype)
        with torch.device("meta"):
            model = config.build()
        model.to_empty(device="cpu")
        model.init_weights(seed=seed)
        return model

    return build


@pytest.fixture
def all_threads():
    """Run with torch's default thread count (at least 2) instead of the suite's single thread."""
    torch.set_num_threads(max(2, DEFAULT_THREADS))
    yield
    torch.set_num_threads(1)
