"""The model's units and the pipeline stages cut from them, running the model's own code.

A plan names units (profile units: `blocks.0`, or a group such as HF's `embed` = `model.embed_tokens` +
`model.rotary_emb`); `UnitMap` turns them into the model's modules. With pp = 1 there are no stages: the executor
trains the model itself (executor.runtime). With pp > 1 each rank builds the Stage modules of its stages
(executor.stage_builders, one builder per answer), in one of three ways, chosen by
cost_models.models.pipelining.pipeline_support (the profiler and planner use the same check):
  "chain"             the model's forward is exactly its units called one after another on one tensor (checked by
                      tracing it, not assumed): a stage calls its units in that order.
  "hf-decoder"        a transformers causal LM of any family: a stage runs the model's own forward over the decoder
                      layers it holds (executor.hf_stages), so positions, rotary embeddings and masks are computed
                      as the model computes them ("hf-llama"/"hf-gpt2" in older profiles: the same).
  "traced"            any other forward fx can trace that runs each unit once, in order (a unit may be several
                      modules; a model computing its own loss takes its targets too): the traced graph is cut
                      at the stage boundaries, each stage running the model's own operations between its units
                      (executor.traced_stages).
Anything else is refused before ranks start; never a chain that skips code in the model's forward.

A Stage registers the model's own module objects (not copies), so a parameter keeps its identity and its name in
the full model; parameters are keyed everywhere by their canonical name, the first name they have in the full
model (`canonical_names`), which is what a DCP checkpoint stores: the same keys under every layout.
A tied parameter (GPT-2's embedding and LM head) used by stages on different ranks is held by each of them; its
gradients are summed across those ranks every step (as Megatron-LM's embedding group does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import fx, nn

from cost_models.records.errors import ConfigError
from cost_models.torch_compat.torch_private import persistent_buffers
from executor.activations import RECOMPUTED, checkpointed


@dataclass(frozen=True)
class UnitMap:
    """unit name -> the names of the model modules it is made of (ModelRef.unit_modules); a unit not listed is
    the module of that name (every zoo unit, and plans made before units were recorded)."""

    modules: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, units: Sequence[str], unit_modules: Sequence[Sequence[str]] = ()) -> "UnitMap":
        return cls(modules={u: tuple(m) for u, m in zip(units, unit_modules)} if unit_modules else {})

    def names(self, unit: str) -> tuple[str, ...]:
        return self.modules.get(unit, (unit,))

    def parts(self, model: nn.Module, unit: str) -> list[tuple[str, nn.Module]]:
        out = []
        for name in self.names(unit):
            try:
                out.append((name, model.get_submodule(name)))
            except AttributeError:
                raise ConfigError(f"the plan's unit '{unit}' names '{name}', which is not a module of this model; "
                                  "was the plan made for another model?") from None
        return out


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name (aliases included) -> the parameter's first name in the model (its canonical name)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def check_covers_model(model: nn.Module, stages: tuple[tuple[str, ...], ...], units: UnitMap, *,
                       model_level: bool) -> None:
    """Refuse (ConfigError, one line) stages that name a module the model lacks, or that leave some of the model's
    parameters out: a plan edited to drop a block would otherwise train a different function without a word.
    Parameters of the model's own level (of the root or of a module that holds units: a learned position table the
    forward adds) belong to no unit: `model_level` says whether they run (pp = 1: the model itself; traced stages:
    the stage that reads them) or no stage holds them (chains and HF adapters run only the units)."""
    unit_modules = [name for stage in stages for u in stage for name, _ in units.parts(model, u)]
    held = {id(p) for name in unit_modules for p in model.get_submodule(name).parameters()}
    above = {""} | {name.rsplit(".", k)[0] for name in unit_modules for k in range(1, name.count(".") + 1)}
    left_out = [n for n, p in model.named_parameters() if id(p) not in held
                and (not model_level or (n.rpartition(".")[0] not in above))]
    if left_out:
        raise ConfigError(f"the plan's stages leave out {len(left_out)} parameter tensor(s) of the model (first: "
                          f"{left_out[0]}); re-create the plan from a profile of this model")


def recomputed(module: nn.Module) -> None:
    """Run `module` under activation checkpointing (torch.utils.checkpoint, non-reentrant: it keeps only the
    module's inputs for backward and runs its forward again there), whatever arguments it takes."""
    forward = module.forward

    def forward_recomputed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpointed(forward, *args, **kwargs)
    module.forward = forward_recomputed
    RECOMPUTED.add(module)


class Stage(nn.Module):
    """One pipeline stage: the model's modules it holds, registered under their model names with '.' spelled '__'
    (module names cannot hold dots; `module_names` keeps the real ones), and `run(x)`, the stage's forward (a
    chain of units or an HF adapter, see the module doc)."""

    run: Callable[[torch.Tensor], torch.Tensor]   # declared for the type checker; set in __init__

    def __init__(self, parts: list[tuple[str, nn.Module]], run: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.module_names = [name for name, _ in parts]
        for name, module in parts:
            self.add_module(name.replace(".", "__"), module)
        object.__setattr__(self, "run", run)   # a plain attribute: the modules it calls are registered above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def chain_stage(model: nn.Module, unit_names: Sequence[str], units: UnitMap) -> Stage:
    parts = [part for u in unit_names for part in units.parts(model, u)]
    if len(parts) != len(unit_names):
        raise ConfigError("a chain stage needs one module per unit; this plan's units are groups (re-profile)")
    modules = [m for _, m in parts]

    def run(x: torch.Tensor) -> torch.Tensor:
        for module in modules:
            x = module(x)
        return x
    return Stage(parts, run)


def recompute_units(model: nn.Module, stages: tuple[tuple[str, ...], ...], stage_ids: list[int], units: UnitMap,
               recompute: tuple[bool, ...]) -> None:
    """Activation checkpointing on the units (with parameters) of the stages the plan recomputes."""
    for sid in stage_ids:
        if recompute and recompute[sid]:
            for u in stages[sid]:
                for _, m in units.parts(model, u):
                    if any(True for _ in m.parameters()):
                        recomputed(m)


@dataclass(frozen=True)
class TiedParam:
    """A parameter whose aliases live in stages on more than one pipeline rank."""

    canonical: str
    pp_ranks: tuple[int, ...]


def _unit_param_names(model: nn.Module, unit: str, units: UnitMap) -> list[str]:
    return [pname for name, m in units.parts(model, unit) for pname, _ in m.named_parameters(prefix=name, remove_duplicate=False)]


def tied_params(model: nn.Module, stages: tuple[tuple[str, ...], ...], stage_rank: Callable[[int], int],
                units: UnitMap) -> list[TiedParam]:
    """Parameters reachable from units of stages that live on different pipeline ranks; stage_rank maps a stage
    to its pipeline rank (Strategy.stage_rank: the schedule's placement)."""
    canon = canonical_names(model)
    ranks_of: dict[str, set[int]] = {}
    for sid, names in enumerate(stages):
        for name in names:
            for pname in _unit_param_names(model, name, units):
                ranks_of.setdefault(canon[pname], set()).add(stage_rank(sid))
    return sorted((TiedParam(canonical=c, pp_ranks=tuple(sorted(r))) for c, r in ranks_of.items() if len(r) > 1),
                  key=lambda t: t.canonical)


def tied_units(model: nn.Module, stages: tuple[tuple[str, ...], ...], units: UnitMap) -> list[tuple[str, ...]]:
    """For each parameter used by more than one unit, the units using it (the executor's view of
    ModelProfile.shared[i].units)."""
    canon = canonical_names(model)
    units_of: dict[str, list[str]] = {}
    for name in (u for stage in stages for u in stage):
        for pname in _unit_param_names(model, name, units):
            users = units_of.setdefault(canon[pname], [])
            if name not in users:
                users.append(name)
    return [tuple(users) for users in units_of.values() if len(users) > 1]


def state_maps(model: nn.Module, held: Sequence[nn.Module],
               canon: dict[str, str]) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """This rank's parameters by canonical name (aliases folded) and persistent buffers by their names in the full
    model, restricted to what the `held` modules (after wrapping: FSDP2's DTensors) hold. `canon` comes from
    canonical_names() before anything was wrapped or allocated: afterwards a tie whose other end is on another
    rank is no longer visible in the model."""
    held_params = {id(p) for m in held for p in m.parameters()}
    held_modules = {id(sub) for m in held for sub in m.modules()}
    params: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in held_params:
            params.setdefault(canon[name], p)
    # a traced stage (executor.traced_stages) holds a parameter read outside the units (a position table) in a slot
    # of its own, under the model's name; FSDP2 replaces it there, not in the model
    found = {id(p) for p in params.values()}
    for m in held:
        for name, p in m.named_parameters(remove_duplicate=False):
            if id(p) not in found and isinstance(m, fx.GraphModule) and name in canon:
                params.setdefault(canon[name], p)
    buffers = {f"{mod_name}.{name}" if mod_name else name: b
               for mod_name, mod in model.named_modules() if id(mod) in held_modules
               for name, b in persistent_buffers(mod)}
    # likewise a persistent buffer read outside the units (a root's mixing vector): the stage that reads it holds it
    persistent = {f"{mod_name}.{name}" if mod_name else name for mod_name, mod in model.named_modules()
                  for name, _ in persistent_buffers(mod)}
    for m in held:
        if isinstance(m, fx.GraphModule):
            for name, b in m.named_buffers():
                if name in persistent and name not in buffers:
                    buffers[name] = b
    return params, buffers
