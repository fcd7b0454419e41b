"""vLLM tests run only in the environment tools/vllm-env/run.sh builds (it sets TITAN_RL_VLLM_TESTS=1).
There a missing or broken vLLM is an error, never a skip."""
import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: faster start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")          # GiB; the test models are tiny


def pytest_configure(config):
    if importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("TITAN_RL_VLLM_TESTS is set but vllm is not importable: build the environment "
                                "with tools/vllm-env/run.sh")
