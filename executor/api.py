"""apply_plan: run a zeropipe plan inside your own training script, under torchrun.

    import torch, torch.nn.functional as F
    from executor.api import apply_plan
    rt = apply_plan("plan.json", model_fn=lambda: MyModel(cfg), optimizer_fn=lambda ps: torch.optim.AdamW(ps, lr=3e-4),
                    loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    for inputs, targets in my_loader():      # each step's whole global batch, the same on every rank
        loss = rt.step(*rt.rank_batch(inputs, targets))   # this rank's share: forward + backward, sync, update
        if loss is not None: print(loss.item())   # ranks holding the last stage see their replica's loss

`model_fn` builds the model the plan was made for (the same unit names), in whatever device context it is called:
on meta first (names, shapes), then for real after torch.manual_seed(seed), so the model's own initialisation is
what trains (executor.materialize: a model too large for every local rank to build once is drawn module by module
instead), identical under every layout; `init_from=` loads pretrained weights over it. With pp = 1 the model itself
is wrapped (its own forward and parameter names); with pp > 1 each rank builds its stages from it
(executor.stages). The loss is taken on the model's output, or on its `.logits` (HF models). The runtime exposes
what a custom loop needs: `rt.model` (your model object), `rt.wrapped.modules` (the wrapped model or stage
modules), `rt.optimizer`, `rt.schedule` (torch.distributed.pipelining's, when pp > 1), `rt.pp_rank`, `rt.dp_rank`,
`rt.is_first`, `rt.is_last`. Under expert parallelism with ZeRO-1, `rt.optimizer` is an executor.zero.OptimizerPair
(step and zero_grad of two optimizers: the dense parameters' and the experts'); give an LR scheduler each of its
`.parts`.
"""
from __future__ import annotations

import datetime as dt
import os
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from cost_models.records.errors import ConfigError
from cost_models.records.strategy import Strategy
from cost_models.torch_compat.devices import claim_device, rank_backend, rank_device
from cost_models.torch_compat.host import keep_freed_memory
from executor.runtime import LossFn, ModelSpec, Runtime, build_runtime
from executor.stages import UnitMap
from executor.weights import check_weights, load_weights
from executor.zero import mixed_precision
from planner.plan import Plan, check_plan


def apply_plan(plan: Plan | Strategy | str | Path, model_fn: Callable[[], nn.Module],
               optimizer_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer], loss_fn: LossFn, *,
               init_from: str | Path | None = None, example_input: torch.Tensor | None = None, seed: int = 0,
               timeout_s: float = 300.0, allow_extra: bool = False) -> Runtime:
    """Set up this rank for `plan` (a Plan, its Strategy, or a plan.json path) and return its Runtime.

    Initialises the default process group from torchrun's environment if the script has not. `init_from`: an HF
    folder (config.json + safetensors) or a `planner run` checkpoint whose weights replace the model's own
    initialisation (each rank reads only what it holds), checked against the whole model first (missing tensors,
    shapes, integer/float dtypes, and tensors it has no place for: refused unless `allow_extra`, then a warning).
    `example_input` is one micro-batch of model input (whole sequences, also under context parallelism; feed each
    step `rt.rank_batch(global inputs, global targets)`, the rank's sequences and tokens);
    pipelines need it for their static shapes (default: token ids of the plan's micro-batch size and sequence
    length when the plan is a Plan whose model takes tokens). A bf16-mixed plan without a pipeline computes in
    bf16 on GPUs (FSDP2's MixedPrecisionPolicy or torch.autocast, in Runtime.step): build the model in fp32, its
    parameters are the master weights (executor.zero.mixed_precision). With a pipeline, build it in bf16: pipelines
    run plain bf16 for now, as the estimate prices them.
    """
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    if isinstance(plan, Plan):
        check_plan(plan)     # Plan.load checked a file; a Plan built in code is checked here
    strategy = plan.strategy if isinstance(plan, Plan) else plan
    strategy.validate(tuple(u for stage in strategy.stages for u in stage))
    _init_process_group(strategy, timeout_s)
    device = rank_device()
    units = UnitMap.of(plan.model.units, plan.model.unit_modules) if isinstance(plan, Plan) else UnitMap()
    if example_input is None and isinstance(plan, Plan) and plan.model.input_kind == "tokens":
        example_input = torch.zeros(strategy.micro_batch_size, plan.model.seq_len, dtype=torch.long)
    if example_input is None and strategy.n_stages > 1:
        raise ConfigError("apply_plan needs example_input (one micro-batch) to set up a pipeline's static shapes")
    if init_from is not None:   # one line before any work if the weights do not fit the model
        with torch.device("meta"):
            whole = model_fn()
        for line in check_weights(whole, Path(init_from), allow_extra=allow_extra):
            warnings.warn(line, stacklevel=2)
        del whole
    tp_rules = plan.model.tp_rules if isinstance(plan, Plan) else ()   # a custom TP plan's, recorded in the profile
    rt = build_runtime(strategy, ModelSpec(build=model_fn, units=units, tp_rules=tp_rules), loss_fn=loss_fn,
                       optimizer_fn=optimizer_fn,
                       example=example_input, seed=seed, device=device,
                       local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), loading=init_from is not None,
                       compute=mixed_precision(strategy.precision, device, strategy.pp).compute)
    if init_from is not None:
        load_weights(rt.params_by_name, rt.buffers_by_name, Path(init_from), model=rt.model)
    if rt.own_loss:
        warnings.warn("the model's forward takes targets and returns its loss: rt.step trains on that loss, and "
                      "loss_fn is not used", stacklevel=2)
    return rt


def _init_process_group(strategy: Strategy, timeout_s: float) -> None:
    if not dist.is_initialized():
        if claim_device(one_thread=False).type == "cpu":   # freed blocks stay for reuse, as the profile computed
            keep_freed_memory()
        dist.init_process_group(rank_backend(), timeout=dt.timedelta(seconds=timeout_s))
    if dist.get_world_size() != strategy.world_size:
        raise ConfigError(f"the plan runs on {strategy.world_size} ranks (dp {strategy.dp} x cp {strategy.cp} x tp "
                          f"{strategy.tp} x pp {strategy.pp}), this job "
                          f"has {dist.get_world_size()}; start it with torchrun --nproc-per-node {strategy.world_size} "
                          f"(per node) or re-plan for {dist.get_world_size()} GPUs")
