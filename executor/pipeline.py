"""Pipeline stages and schedules from torch.distributed.pipelining, checked against the plan's action order.

The schedule's torch class comes from the registry (cost_models.records.schedule.SCHEDULES). The order the planner
simulated is checked twice: before the first step against the class's `pipeline_order` (multi-stage classes build
one), and on every step against the actions torch actually runs on this rank's stages (every schedule: single-stage
GPipe and 1F1B run a fixed loop that has no order to read). A difference raises with the rank x step grid, the
first differing action marked.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

from cost_models.records.errors import ConfigError
from cost_models.records.schedule import Action, format_grid
from cost_models.records.strategy import Strategy
from cost_models.torch_compat.torch_private import compute_action_strings, schedule_stages


def build_schedule(modules: list[nn.Module], stage_ids: list[int], *, strategy: Strategy, pp_group,
                   device: torch.device, loss_fn: Callable,
                   stage_io: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]],
                   pp_rank: int):
    """PipelineStages for this rank's stages (static shapes: example inputs and outputs of one micro-batch, tuples
    of tensors, the float ones with requires_grad as torch needs) and the schedule object, its actions logged (ActionLog)."""
    s = strategy
    cls = getattr(S, s.spec.torch_class, None)
    if cls is None:
        raise ConfigError(f"this torch has no {s.spec.torch_class} for schedule '{s.schedule}'; upgrade torch")
    stages = []
    for module, sid in zip(modules, stage_ids):
        example_in, example_out = stage_io[sid]
        stages.append(PipelineStage(module, sid, s.n_stages, device, input_args=example_in,
                                    output_args=example_out, group=pp_group))
    order = s.action_order()
    if issubclass(cls, S.PipelineScheduleSingle):
        sched = cls(stages[0], n_microbatches=s.microbatches, loss_fn=loss_fn)
    else:
        sched = cls(stages, n_microbatches=s.microbatches, loss_fn=loss_fn)
        check_order({pp_rank: [Action.parse(a) for a in compute_action_strings(sched.pipeline_order, pp_rank)]},
                    order, pp_rank)
    log = ActionLog(schedule_stages(sched), order, pp_rank)
    run_step = sched.step

    def checked_step(*args, **kwargs):   # however the step is called (pipeline.step or a user's rt.schedule.step)
        result = run_step(*args, **kwargs)
        log.check_step()
        return result
    sched.step = checked_step
    return sched


def _first_difference(ours: Sequence[Action], theirs: Sequence[Action]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _mismatch(what: str, order, pp_rank: int, i: int, theirs: Sequence[Action]) -> RuntimeError:
    ours = order[pp_rank]
    planned = str(ours[i]) if i < len(ours) else "nothing"
    ran = str(theirs[i]) if i < len(theirs) else "nothing"
    return RuntimeError(f"torch's schedule {what} {ran} at step {i} on pipeline rank {pp_rank} where the plan has "
                        f"{planned} (the planned order, '>' marks it):\n" + format_grid(order, mark={pp_rank: i}))


def check_order(torch_order: dict[int, list[Action]], order, pp_rank: int) -> None:
    """Fail loudly if torch would run a different action order than the planner simulated for this rank."""
    i = _first_difference(order[pp_rank], torch_order.get(pp_rank, []))
    if i is not None:
        raise _mismatch("would run", order, pp_rank, i, torch_order.get(pp_rank, []))


class ActionLog:
    """The compute actions torch runs on this rank's stages, in order: each stage's forward, backward, input- and
    weight-gradient entry points are wrapped (the ones every torch schedule calls per micro-batch)."""

    def __init__(self, stages, order, pp_rank: int) -> None:
        self.order, self.pp_rank = order, pp_rank
        self.ran: list[Action] = []
        for stage in stages:
            self._wrap(stage)

    def _wrap(self, stage) -> None:
        sid, forward, backward, weight = (stage.stage_index, stage.forward_one_chunk, stage.backward_one_chunk,
                                          getattr(stage, "backward_weight_one_chunk", None))

        def logged_forward(chunk, *args, **kwargs):
            self.ran.append(Action(sid, "F", chunk))
            return forward(chunk, *args, **kwargs)

        def logged_backward(chunk, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            self.ran.append(Action(sid, "B" if full else "I", chunk))
            return backward(chunk, *args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk = logged_forward, logged_backward
        if weight is not None:
            def logged_weight(chunk, *args, **kwargs):
                self.ran.append(Action(sid, "W", chunk))
                return weight(chunk, *args, **kwargs)
            stage.backward_weight_one_chunk = logged_weight

    def check_step(self) -> None:
        """Compare the step just run with the planned order, then start the next step's log."""
        ran, self.ran = self.ran, []
        i = _first_difference(self.order[self.pp_rank], ran)
        if i is not None:
            raise _mismatch("ran", self.order, self.pp_rank, i, ran)


def step(sched, *, is_first: bool, is_last: bool, inputs, targets, own_loss: bool = False) -> list[torch.Tensor]:
    """One pipeline step over the rank's per-replica batch; the micro-batch losses on the last stage. Raises if torch
    ran another action order than the plan's (build_schedule's checked step). `own_loss`: the model computes its
    loss from its targets (cost_models.models.losses.takes_targets), so the first stage takes them beside the input
    (traced stages hand them on to the last)."""
    losses: list[torch.Tensor] = []
    args = (inputs, targets) if own_loss else (inputs,)
    if is_first and is_last:
        sched.step(*args, target=targets, losses=losses)
    elif is_first:
        sched.step(*args)
    elif is_last:
        sched.step(target=targets, losses=losses)
    else:
        sched.step()
    return losses
