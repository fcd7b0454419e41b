"""Generators behind one interface: the built-in one (KV cache over titan-models) and, with the
`vllm` extra, titan_rl.vllm's."""
from titan_rl.generation.base import Completion, Generator
from titan_rl.generation.builtin import BuiltinGenerator
from titan_rl.generation.kv_cache import GenerationContext, KVCacheAttention, install_kv_cache
from titan_rl.generation.sampling import SamplingConfig, sample_next

__all__ = ["BuiltinGenerator", "Completion", "GenerationContext", "Generator", "KVCacheAttention",
           "SamplingConfig", "install_kv_cache", "sample_next"]
