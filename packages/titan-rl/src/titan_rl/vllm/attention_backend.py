"""A vLLM attention backend for batch-invariant mode on CPU.

vLLM keeps everything it owns: the KV cache allocation (the CPU backend's shape
[num_blocks, num_kv_heads, block_size, 2 * head_size]), block tables, slot mapping, scheduling and
metadata (the CPU backend's builder). Only the two kernels change: the cache write stores k and v
plainly (keys in the first block_size rows of a block, values in the next, as the CPU backend's
view of the cache reads), and attention gathers each sequence's keys from its blocks and runs
titan-rl's fixed-order attention, so a token's result does not depend on the other sequences in the
step or on whether it is prefilled or decoded.
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from titan_rl.batch_invariant import ops


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, hkv, block_size, _ = kv_cache.shape
    view = kv_cache.view(num_blocks, hkv, 2 * block_size, -1)
    return view[:, :, :block_size], view[:, :, block_size:]  # [blocks, hkv, block_size, d] each


class TitanBatchInvariantImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = _split(kv_cache)
        block_size = key_cache.shape[2]
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        valid = slots >= 0  # padded tokens carry slot -1
        slots, k, v = slots[valid], key[:n][valid], value[:n][valid]
        key_cache[slots // block_size, :, slots % block_size] = k.to(key_cache.dtype)
        value_cache[slots // block_size, :, slots % block_size] = v.to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if attn_metadata is None:  # warm-up
            return output
        key_cache, value_cache = _split(kv_cache)
        block_size = key_cache.shape[2]
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        n_seqs = len(seq_lens)
        q_lens = [starts[i + 1] - starts[i] for i in range(n_seqs)]
        max_q, max_len = max(q_lens), max(seq_lens)
        hq, d = query.shape[1], query.shape[2]
        hkv = key_cache.shape[1]
        # One padded batch: q [B, max_q, hq, d], keys [B, max_len, hkv, d] gathered from each
        # sequence's blocks (slot j = position j), positions of each query token.
        q = query.new_zeros(n_seqs, max_q, hq, d)
        k = key_cache.new_zeros(n_seqs, max_len, hkv, d)
        v = value_cache.new_zeros(n_seqs, max_len, hkv, value_cache.shape[-1])
        positions = torch.zeros(n_seqs, max_q, dtype=torch.long)
        for i in range(n_seqs):
            L, ql = seq_lens[i], q_lens[i]
            q[i, :ql] = query[starts[i]:starts[i + 1]]
            blocks = attn_metadata.block_table[i, : -(-L // block_size)].long()
            k[i, :L] = key_cache[blocks].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:L]
            v[i, :L] = value_cache[blocks].permute(0, 2, 1, 3).reshape(-1, hkv, v.shape[-1])[:L]
            positions[i, :ql] = torch.arange(L - ql, L)
        out = ops.attention(q, k, v, q_positions=positions, scale=self.scale)  # [B, max_q, hq, d_v]
        for i in range(n_seqs):
            output[starts[i]:starts[i + 1]] = out[i, :q_lens[i]].to(output.dtype)
        return output


class TitanBatchInvariantBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TitanBatchInvariantImpl
