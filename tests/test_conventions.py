"""Conventions the README states, checked where code could drift from them: MFU (model FLOPs, PaLM) vs HFU
(hardware FLOPs), and how both are printed. The memory and byte conventions are checked in test_memory_model.py
(ZeRO-2: paper vs FSDP2) and test_comm.py (full-buffer vs wire bytes)."""
import dataclasses

import pytest

from cost_models.cost.estimate import estimate, hardware_flops_per_step
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from planner.report import render_markdown
from tests.plans import plan_for


def _s(prof, **kw):
    names = tuple(u.name for u in prof.units)
    base = dict(dp=4, pp=1, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=2, stages=(names,),
                precision="bf16-mixed")
    base.update(kw)
    return Strategy(**base)


def test_mfu_counts_palm_model_flops_and_hfu_the_hardware_flops(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", True]
    cluster = preset("dgx-h100")
    peak = cluster.device.peak_flops["bf16"]
    s = _s(prof)
    est = estimate(s, prof, cluster)
    per_step = s.global_batch_size / prof.micro_batch_size
    denom = est.step_time_s * s.world_size * peak
    # PaLM appendix B: 6N + 12LHQT per token = 3 x the forward's matmul and attention FLOPs, no recompute
    assert est.mfu == pytest.approx(3 * sum(u.fwd_flops for u in prof.units) * per_step / denom)
    # HFU: the profile's measured forward + backward (torch's attention backward recomputes QK^T)
    hw = sum(u.fwd_flops + u.bwd_flops for u in prof.units) * per_step
    assert est.hfu == pytest.approx(hw / denom) and est.hfu > est.mfu
    # full recompute runs every forward again: HFU grows by the forward, MFU's numerator does not move
    rec = estimate(_s(prof, recompute=(True,)), prof, cluster)
    fwd = sum(u.fwd_flops for u in prof.units) * per_step
    assert rec.hfu * rec.step_time_s == pytest.approx((hw + fwd) / (s.world_size * peak))
    assert rec.mfu * rec.step_time_s == pytest.approx(est.mfu * est.step_time_s)
    assert hardware_flops_per_step(_s(prof, recompute=(True,)), prof) == pytest.approx(hw + fwd)


def test_selective_recompute_adds_the_attention_core_to_hfu_only(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", True]
    core = sum(u.tp.core_flops for u in prof.units if u.tp is not None)
    assert core > 0
    per_step = _s(prof).global_batch_size / prof.micro_batch_size
    base = hardware_flops_per_step(_s(prof), prof)
    assert hardware_flops_per_step(_s(prof, selective=True), prof) == pytest.approx(base + core * per_step)


def test_no_peak_no_utilisation_and_the_report_names_both(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", True]
    cpu = dataclasses.replace(preset("dgx-h100"), device=dataclasses.replace(preset("dgx-h100").device, kind="cpu"))
    est = estimate(_s(prof), prof, cpu)
    assert est.mfu is None and est.hfu is None
    text = render_markdown(plan_for(_s(prof), prof, cluster=preset("dgx-h100")))
    assert "MFU" in text and "model FLOPs, PaLM convention" in text
    assert "HFU" in text and "hardware FLOPs" in text
