"""Pipeline stages and schedules from torch.distributed.pipelining, checked against the plan's action order.

This is the one module that touches torch's private pipelining API (the `_ComputationType` of the actions in a
schedule's `pipeline_order`), to check that the order torch will run equals the order the planner simulated.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from cost_models.errors import ConfigError

SCHEDULE_CLASSES = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B,
                    "interleaved-1f1b": S.ScheduleInterleaved1F1B, "zb-interleaved": S.ScheduleInterleavedZeroBubble}
_COMPUTE = (S._ComputationType.FORWARD, S._ComputationType.FULL_BACKWARD, S._ComputationType.BACKWARD_INPUT,
            S._ComputationType.BACKWARD_WEIGHT)


def build_schedule(modules: list[nn.Module], stage_ids: list[int], *, n_stages: int, pp_group, device: torch.device,
                   schedule: str, microbatches: int, loss_fn: Callable, stage_io: list[tuple[torch.Tensor, torch.Tensor]],
                   plan_order: dict[str, list[str]] | None, pp_rank: int):
    """PipelineStages for this rank's stages (static shapes: example input and output of one micro-batch, the
    float ones with requires_grad as torch needs) and the schedule object."""
    if schedule not in SCHEDULE_CLASSES:
        raise ConfigError(f"the executor cannot run schedule '{schedule}'")
    stages = []
    for module, sid in zip(modules, stage_ids):
        example_in, example_out = stage_io[sid]
        stages.append(PipelineStage(module, sid, n_stages, device, input_args=(example_in,),
                                    output_args=(example_out,), group=pp_group))
    cls = SCHEDULE_CLASSES[schedule]
    if issubclass(cls, S.PipelineScheduleSingle):
        sched = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        sched = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
        if plan_order is not None:
            check_order(sched.pipeline_order, plan_order, pp_rank)
    return sched


def check_order(torch_order, plan_order: dict[str, list[str]], pp_rank: int) -> None:
    """Fail loudly if torch would run a different action order than the planner simulated for this rank.
    (Single-stage GPipe and 1F1B execute a fixed loop in torch; tests/test_schedule.py checks those orders.)"""
    ours = plan_order.get(str(pp_rank))
    theirs = [str(a) for a in torch_order[pp_rank] if a is not None and a.computation_type in _COMPUTE]
    if ours is not None and ours != theirs:
        raise RuntimeError(f"torch's schedule for rank {pp_rank} differs from the plan's simulated order: "
                           f"{theirs[:8]}... vs {ours[:8]}...")


def step(sched, *, is_first: bool, is_last: bool, inputs, targets) -> list[torch.Tensor]:
    """One pipeline step over the rank's per-replica batch; the micro-batch losses on the last stage."""
    losses: list[torch.Tensor] = []
    if is_first and is_last:
        sched.step(inputs, target=targets, losses=losses)
    elif is_first:
        sched.step(inputs)
    elif is_last:
        sched.step(target=targets, losses=losses)
    else:
        sched.step()
    return losses
