"""The compute model by kind of work: what the profiler counts per pass (profiling.work_counter) and what a GPU
takes for it (cost.kernels): products by shape, fused attention, memory-bound bytes, kernel gaps."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cost_models.cost.compute import compute_source, tp_split, unit_times
from cost_models.cost.kernels import (KERNEL_GAP_S, MEMORY_EFFICIENCY, Split, gemm_seconds, tile_share,
                                      work_seconds)
from cost_models.models.gpt import _unfused_attention
from cost_models.models.source import resolve, zoo_source
from cost_models.models.zoo import ZOO, ZooEntry
from cost_models.profiling.model_profiler import profile_model
from cost_models.profiling.work_counter import WorkCounter
from cost_models.records.presets import preset
from cost_models.records.profile import UnitProfile
from cost_models.records.work import Gemm, WorkCounts

H100 = preset("dgx-h100").device


def test_the_counter_sorts_a_pass_into_products_attention_and_bytes():
    x = torch.randn(2, 16, 32)
    q = torch.randn(2, 4, 16, 8)
    lin = torch.nn.Linear(32, 64)
    with WorkCounter() as w:
        y = lin(x)                                       # view + addmm + view: one kernel
        r = y.relu()                                     # 2 x 16 x 64 floats read, as many written
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        a.transpose(1, 2).reshape(2, 16, 32)             # a copy (transposed): read + write
    c = w.counts()
    assert c.gemms == (Gemm(m=32, n=64, k=32, batch=1, count=1, itemsize=4),)
    full = 4 * 2 * 4 * 16 * 16 * 8                       # torch's SDPA formula: 4 b h s^2 d, the whole square
    assert c.attention_flops == full // 2                # the causal kernel skips half
    relu_bytes = 2 * r.numel() * 4
    assert c.memory_bytes == relu_bytes + 2 * a.numel() * 4
    assert c.kernels == 4                                # addmm, relu, attention, the copy; views launch nothing
    del y


def test_an_embedding_reads_the_rows_it_gathers_not_its_table():
    emb = torch.nn.Embedding(50_000, 64)
    idx = torch.randint(0, 50_000, (2, 8))
    with WorkCounter() as w:
        out = emb(idx)
    assert w.counts().memory_bytes == 2 * out.numel() * 4 + idx.numel() * 8


def test_a_gpt_block_s_counted_kinds_add_up_to_torch_s_flops():
    """Products plus attention (counted whole, as torch's formula does) are the block's FLOPs, forward and backward;
    the unfused attention (Megatron-LM before FlashAttention) turns attention into batched products and bytes."""
    fused = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=32, meta=True, dtype="bf16")
    block = fused.unit("blocks.0")
    assert block.fwd_work.gemm_flops + 2 * block.fwd_work.attention_flops == block.fwd_flops
    assert block.bwd_work.gemm_flops + 2 * block.bwd_work.attention_flops == block.bwd_flops
    cfg = dataclasses.replace(ZOO["gpt-tiny"].config, attention="unfused")
    unfused = profile_model(zoo_source(ZooEntry(name="gpt-tiny-unfused", family="gpt", description="test",
                                                config=cfg)), micro_batch_size=2, seq_len=32, meta=True, dtype="bf16")
    ublock = unfused.unit("blocks.0")
    assert ublock.fwd_work.attention_flops == 0 and ublock.fwd_work.gemm_flops == ublock.fwd_flops
    heads = cfg.n_heads * 2
    assert any(g.batch == heads and g.m == g.n == 32 for g in ublock.fwd_work.gemms)   # scores: batched s x s
    assert ublock.fwd_work.memory_bytes > block.fwd_work.memory_bytes + heads * 32 * 32 * 2   # the score matrix moves
    assert ublock.saved_bytes > block.saved_bytes


def test_unfused_attention_computes_what_sdpa_computes():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    torch.testing.assert_close(_unfused_attention(q, k, v, 0.0), F.scaled_dot_product_attention(q, k, v,
                                                                                                is_causal=True))


def test_tiles_waste_what_the_last_wave_leaves_idle():
    # 132 SMs: a 2 x 66 grid of 256 x 128 tiles is exactly one wave; one more column of tiles needs a second wave
    assert tile_share(Gemm(m=512, n=66 * 128, k=1024), 132) == 1.0
    one_more = Gemm(m=512, n=67 * 128, k=1024)
    waves = 2 * 132   # two waves of slots, 2 x 67 = 134 tiles busy at 256 x 128, or 4 x 67 = 268 at 128 x 128
    assert tile_share(one_more, 132) == pytest.approx(max(134 / waves, 268 / (3 * 132)))
    assert tile_share(one_more, 0) == 1.0   # SMs unknown: no quantization


def test_products_run_at_the_best_rate_or_at_their_bytes():
    big = Gemm(m=8192, n=8448, k=8192)      # 32 x 66 tiles: whole waves
    assert gemm_seconds(big, H100, "bf16") == pytest.approx(big.flops / (989.4e12 * H100.matmul_efficiency))
    skinny = Gemm(m=8192, n=8192, k=1)      # an outer product: its bytes, not its FLOPs, take the time
    moved = (8192 + 8192 + 8192 * 8192) * 2
    assert gemm_seconds(skinny, H100, "bf16") == pytest.approx(moved / (H100.memory_bandwidth_Bps
                                                                         * MEMORY_EFFICIENCY))


def test_a_pass_adds_its_kinds_and_tensor_parallelism_divides_its_split_shares():
    work = WorkCounts(attention_flops=10**12, memory_bytes=10**9, kernels=100)
    attention = 10**12 / (989.4e12 * H100.attention_efficiency["bwd"])
    memory = 10**9 / (H100.memory_bandwidth_Bps * MEMORY_EFFICIENCY)
    assert work_seconds(work, H100, "bf16", backward=True) == pytest.approx(attention + memory + 100 * KERNEL_GAP_S)
    split = Split(tp=4, gemm=1.0, memory=0.5, attention=True)
    assert work_seconds(work, H100, "bf16", backward=True, split=split) == pytest.approx(
        attention / 4 + memory * (0.5 + 0.5 / 4) + 100 * KERNEL_GAP_S)


def test_gpu_presets_price_profiled_units_by_kind_and_older_profiles_by_flops():
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=32, meta=True, dtype="bf16")
    cluster = preset("dgx-h100")
    u = prof.unit("blocks.0")
    fwd, bwd = unit_times(u, prof, cluster, micro_batch_size=4, precision="bf16", ranks_running=8)
    gaps = u.fwd_work.kernels * KERNEL_GAP_S   # the batch doubles the work, not the kernels
    assert fwd == pytest.approx(2 * (work_seconds(u.fwd_work, cluster.device, "bf16", backward=False) - gaps) + gaps)
    assert compute_source(prof, cluster, "bf16") == "kernels"
    older = dataclasses.replace(prof, units=tuple(dataclasses.replace(u, fwd_work=None, bwd_work=None)
                                                  for u in prof.units))
    rate = cluster.device.peak_flops["bf16"] * cluster.device.matmul_efficiency
    assert unit_times(older.unit("blocks.0"), older, cluster, micro_batch_size=4, precision="bf16",
                      ranks_running=8)[0] == pytest.approx(2 * u.fwd_flops / rate)
    assert compute_source(older, cluster, "bf16") == "flops"


def test_tensor_parallelism_splits_a_block_s_products_and_attention():
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=32, meta=True, dtype="bf16")
    block: UnitProfile = prof.unit("blocks.0")
    split = tp_split(block, tp=2, vocab=False, sp=False)
    assert split.attention and split.gemm == pytest.approx(1.0)   # every product of a GPT block is a split linear's
    assert 0 < split.memory < tp_split(block, tp=2, vocab=False, sp=True).memory <= 1.0   # SP splits norms too
    assert tp_split(block, tp=1, vocab=False, sp=True) == Split()


def test_a_vocabulary_split_divides_the_loss_s_log_probabilities_in_the_head_s_memory_bound_share():
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=32, meta=True, dtype="bf16")
    head: UnitProfile = prof.unit("head")
    tu = head.tp
    assert tu is not None and tu.saved_logits > 0
    whole, split = (tp_split(head, tp=2, vocab=v, sp=False) for v in (False, True))
    # the log-probabilities' share of the head's saved bytes moves into the split share
    assert split.memory - whole.memory == pytest.approx(tu.saved_logits / head.saved_bytes)
