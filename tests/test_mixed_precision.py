"""bf16-mixed as the executor runs it on GPUs (executor.zero.mixed_precision): fp32 master parameters, bf16 compute
through FSDP2's MixedPrecisionPolicy or torch.autocast, gradients reduced in bf16; and the memory model's split of
the same bytes. The multi-process test forces the GPU path's compute dtype onto gloo CPU ranks (the plan path runs
CPU ranks in fp32); benchmarks/gpu_check.sh runs it through `planner run` on a GPU."""
import dataclasses
from typing import Any

import pytest
import torch

from cost_models.cost.estimate import estimate
from cost_models.cost.kernels import work_seconds
from cost_models.cost.memory import executor_state_bytes
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from executor.zero import mixed_precision

UNITS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")   # gpt-tiny


def S(dp=2, zero=0, pp=1, precision="bf16-mixed"):
    stages = (UNITS,) if pp == 1 else (UNITS[:3], UNITS[3:])
    return Strategy(dp=dp, pp=pp, zero=zero, schedule="1f1b", microbatches=2, micro_batch_size=2, v=1, stages=stages,
                    precision=precision, optimizer="adamw")


def test_mixed_precision_runs_fp32_masters_on_gpus_without_a_pipeline():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert (mixed_precision("bf16-mixed", gpu, 1).build, mixed_precision("bf16-mixed", gpu, 1).compute) == (
        torch.float32, torch.bfloat16)
    assert (mixed_precision("bf16-mixed", gpu, 2).build, mixed_precision("bf16-mixed", gpu, 2).compute) == (
        torch.bfloat16, None)                       # pipelines: plain bf16 (not yet mixed)
    assert (mixed_precision("bf16-mixed", cpu, 1).build, mixed_precision("bf16-mixed", cpu, 1).compute) == (
        torch.float32, None)                        # CPU ranks: fp32
    assert mixed_precision("fp32", gpu, 1).compute is None


def test_the_estimate_splits_mixed_bytes_as_torch_holds_them_on_gpus(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", True]
    psi = prof.total_params
    gpu = preset("dgx-h100")
    zero0 = estimate(S(dp=1), prof, gpu).memory_per_rank[0]
    assert (zero0.parameters, zero0.gradients, zero0.optimizer_states) == (4 * psi, 4 * psi, 8 * psi)
    assert zero0.buffers == 2 * psi                       # autocast's bf16 weight copies
    zero3 = estimate(S(dp=2, zero=3), prof, gpu).memory_per_rank[0]
    assert (zero3.parameters, zero3.gradients, zero3.optimizer_states) == (2 * psi, 2 * psi, 4 * psi)
    # FSDP2 casts (its gathered bf16 units are the buffers), so no autocast copy: 2 x largest unit + 1 x its grads
    largest = max(u.params for u in prof.units)
    assert zero3.buffers == pytest.approx(2 * 2 * largest + 2 * largest, rel=0.01)
    piped = estimate(S(dp=1, pp=2), prof, gpu).memory_per_rank[0]   # plain bf16 stages keep the paper's split
    assert piped.optimizer_states == 6 * piped.parameters and piped.gradients == piped.parameters
    # CPU ranks run bf16-mixed plans in fp32, and the estimate counts what they hold: the fp32 plan's bytes
    cpu = dataclasses.replace(gpu, device=dataclasses.replace(gpu.device, kind="cpu"))
    on_cpu = estimate(S(dp=1), prof, cpu)
    assert on_cpu.memory_per_rank == estimate(S(dp=1, precision="fp32"), prof, cpu).memory_per_rank
    mem = on_cpu.memory_per_rank[0]
    assert (mem.parameters, mem.gradients, mem.optimizer_states, mem.buffers) == (4 * psi, 4 * psi, 8 * psi, 0)


def _mixed_runs(items: list[tuple[dict, bool]]) -> list | None:
    import torch.distributed as dist

    from cost_models.models.losses import compute_loss
    from cost_models.models.source import resolve
    from cost_models.torch_compat.elastic import init_process_group
    from executor.runtime import ModelSpec, build_runtime
    from executor.stages import UnitMap
    from executor.train import optimizer_for
    torch.set_num_threads(1)
    init_process_group("gloo", 120)
    try:
        src, rank, out = resolve("gpt-tiny"), dist.get_rank(), []
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 512, (8, 16), generator=gen), torch.randint(0, 512, (8, 16), generator=gen)
        for s_dict, mixed in items:
            s = Strategy.from_dict(s_dict)
            spec = ModelSpec(build=lambda: src.build(device=None, dtype=torch.float32, seed=0),
                             units=UnitMap.of(list(UNITS)))
            rt = build_runtime(s, spec, loss_fn=lambda o, t: compute_loss("cross_entropy", o, t),
                               optimizer_fn=optimizer_for(s, 1e-2), example=x[:2], seed=0,
                               compute=torch.bfloat16 if mixed else None)
            linear_out: list[str] = []
            hook = rt.model.get_submodule("blocks.0.attn.c_attn").register_forward_hook(
                lambda m, i, o: linear_out.append(str(o.dtype)))
            losses, grads = [], set()
            for _ in range(3):
                loss = rt.forward_backward(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
                grads |= {str(p.grad.dtype) for p in rt.wrapped.params if p.grad is not None}
                states = rt.local_bytes()   # before zero_grad: gradients too (and the last step's moments)
                rt.optimizer_step()
                rt.optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss))
            hook.remove()
            out.append({"losses": losses, "linear_out": sorted(set(linear_out)), "grads": sorted(grads),
                        "params": sorted({str(p.dtype) for p in rt.wrapped.params}),
                        "states": states})
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        return gathered if rank == 0 else None
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_mixed_precision_computes_in_bf16_and_keeps_fp32_masters_on_two_ranks(tiny_profiles):
    """ZeRO-0 (DDP + autocast + bf16 gradient reduce) and ZeRO-3 (FSDP2 MixedPrecisionPolicy), each against the same
    plan in fp32: bf16 where compute runs, fp32 parameters and gradients, losses within bf16's error of fp32's but
    not equal to them, and the bytes each rank holds equal to the estimate's torch split."""
    from cost_models.torch_compat.elastic import elastic_job
    plans = [S(zero=0), S(zero=3)]
    items = [(s.to_dict(), mixed) for s in plans for mixed in (False, True)]
    with elastic_job("mixed-precision", 2) as (start, _):
        per_rank = start(_mixed_runs, items)[0]
    psi = tiny_profiles["gpt-tiny", True].total_params
    for i, s in enumerate(plans):
        for rank in (0, 1):
            plain, mixed = per_rank[rank][2 * i], per_rank[rank][2 * i + 1]
            assert plain["linear_out"] == ["torch.float32"] and mixed["linear_out"] == ["torch.bfloat16"], s.zero
            assert mixed["params"] == mixed["grads"] == ["torch.float32"], s.zero
            assert mixed["losses"] == pytest.approx(plain["losses"], rel=1e-2), s.zero
            assert mixed["losses"] != pytest.approx(plain["losses"], rel=1e-6), s.zero   # bf16 did run
            expected = executor_state_bytes(psi, 2, s.zero, "bf16-mixed", "adamw", mixed=True)
            assert tuple(mixed["states"]) == pytest.approx(expected, rel=1e-6), (s.zero, rank)


def test_gpu_profile_times_price_only_their_own_dtype_and_mixed_plans_pay_the_measured_autocast_factor(tiny_profiles):
    """A bf16 profile timed on a GPU (fields set by hand: CI has none) prices bf16-mixed plans with its unit times,
    times its mixed_factor where torch's mixed precision runs (no pipeline), and fp32 plans by their work by kind at
    the fp32 rates (cost.kernels): on an H200 an fp32 gpt2-small plan priced from bf16 times was predicted at 101 ms and ran 590 ms."""
    h100 = preset("dgx-h100")
    gpu = dataclasses.replace(tiny_profiles["gpt-tiny", False], device="gpu", device_name=h100.device.name,
                              dtype="bf16")
    slower = dataclasses.replace(gpu, mixed_factor=2.0)
    flat, piped = S(dp=1), S(dp=1, pp=2)
    base, mixed = estimate(flat, gpu, h100), estimate(flat, slower, h100)
    assert base.compute_source == mixed.compute_source == "measured"
    assert mixed.stages[0].fwd_s == pytest.approx(2 * base.stages[0].fwd_s)
    assert mixed.stages[0].bwd_s == pytest.approx(2 * base.stages[0].bwd_s)
    # FSDP2 casts the ZeRO-3 shards to bf16 itself, as plain bf16 runs: no autocast, no factor
    fsdp = S(dp=2, zero=3)
    assert estimate(fsdp, slower, h100).stages[0].fwd_s == pytest.approx(estimate(fsdp, gpu, h100).stages[0].fwd_s)
    # a pipeline runs plain bf16: no autocast, no factor
    assert estimate(piped, slower, h100).stages[0].fwd_s == pytest.approx(estimate(piped, gpu, h100).stages[0].fwd_s)
    fp32 = estimate(S(dp=1, precision="fp32"), slower, h100)
    assert fp32.compute_source == "kernels"
    assert fp32.stages[0].fwd_s == pytest.approx(sum(work_seconds(u.fwd_work, h100.device, "fp32", backward=False)
                                                     for u in gpu.units))


def test_a_measured_transient_adds_to_the_ranks_that_hold_its_unit(tiny_profiles):
    """The profiler measures transients on GPUs only; set by hand here: 1 MiB in the head at the profile's
    micro-batch, twice that at a micro-batch twice as large, only on the pipeline rank holding the head."""
    prof = tiny_profiles["gpt-tiny", True]
    with_head = dataclasses.replace(prof, units=tuple(
        dataclasses.replace(u, transient_bytes=2**20 if u.name == "head" else 0) for u in prof.units))
    cluster = preset("dgx-h100")
    flat = S(dp=1, precision="fp32")
    for s, factor in ((flat, 1), (dataclasses.replace(flat, micro_batch_size=4), 2)):
        before, after = estimate(s, prof, cluster), estimate(s, with_head, cluster)
        assert after.memory_per_rank[0].buffers - before.memory_per_rank[0].buffers == factor * 2**20
    piped = S(dp=1, pp=2, precision="fp32")
    before, after = estimate(piped, prof, cluster).memory_per_rank, estimate(piped, with_head, cluster).memory_per_rank
    assert after[0].buffers == before[0].buffers and after[1].buffers - before[1].buffers == 2**20
