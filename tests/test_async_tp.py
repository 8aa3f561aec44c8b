"""Async tensor parallelism (Strategy.async_tp): what the estimate charges for it, and the executor's refusal where
it cannot run (CPU ranks). It runs only on CUDA GPUs: unchecked in CI, which has none."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_models.cost.estimate import estimate
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from executor.tensor_parallel import enable_async_tp

UNITS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")


def _s(**kw) -> Strategy:
    base = dict(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=2, stages=(UNITS,), tp=4,
                sp=True, async_tp=True)
    return Strategy(**{**base, **kw})


def test_it_needs_sequence_parallelism_and_says_so_in_the_label():
    assert _s().name == "TP4+SP+async, 2x2"
    with pytest.raises(ConfigError, match="needs --sp"):
        _s(sp=False)


def test_the_first_of_tp_steps_shows_and_what_compute_cannot_cover():
    """Per unit and pass the exposed TP time is max(t / tp, t - compute): at least a tp-th of the plain collective
    time, never more of it, and the step no slower."""
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=64, meta=True, dtype="bf16")
    cluster = preset("dgx-h100")
    fused, plain = estimate(_s(), prof, cluster), estimate(_s(async_tp=False), prof, cluster)
    assert plain.breakdown.tp_comm_s / 4 <= fused.breakdown.tp_comm_s < plain.breakdown.tp_comm_s
    assert fused.step_time_s < plain.step_time_s
    assert fused.comm.tp_collectives == plain.comm.tp_collectives   # the same bytes move, later hidden
    assert fused.peak_memory_bytes == plain.peak_memory_bytes
    assert dataclasses.replace(_s(), async_tp=False).tp_label == "TP4+SP"


def test_cpu_ranks_refuse_it_in_one_line():
    with pytest.raises(ConfigError, match="drop --async-tp"):
        enable_async_tp([], None, torch.device("cpu"))
