"""Cut a model into the plan's stages and materialise them exactly as a single-process run would.

The model is built once on the meta device (no memory), each rank keeps the unit modules of its own stages, and
only those are materialised. Initial values depend only on the seed and each parameter's canonical name (the
first name it has in the full model), never on which rank materialises it or in what order, so every layout of
the same plan (and the single-process reference) starts from identical weights:
    biases and norm shifts 0, norm scales 1, everything else N(0, 0.02) (GPT-2 / nanoGPT initialisation),
    from a generator seeded with (seed, crc32 of the canonical name).
A tied parameter (GPT-2's embedding and LM head) used by stages on different ranks is materialised on each with
the same values; its gradients are summed across those ranks every step (as Megatron-LM's embedding group does).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cost_models.errors import ConfigError
from cost_models.torch_private import persistent_buffers

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


class Stage(nn.Module):
    """The units of one pipeline stage, run in order; one tensor flows between them.

    Units are registered under their model names with '.' spelled '__' (module names cannot contain dots);
    `unit_names` keeps the real names. `recompute` runs each unit under activation checkpointing
    (torch.utils.checkpoint, non-reentrant), keeping only the unit inputs for backward.
    """

    def __init__(self, units: list[tuple[str, nn.Module]], *, recompute: bool = False) -> None:
        super().__init__()
        self.unit_names = [name for name, _ in units]
        for name, module in units:
            self.add_module(name.replace(".", "__"), module)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.unit_names:
            unit = getattr(self, name.replace(".", "__"))
            x = checkpoint(unit, x, use_reentrant=False) if self.recompute and torch.is_grad_enabled() else unit(x)
        return x


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name (aliases included) -> the parameter's first name in the model (its canonical name)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _init_value(name: str, shape: torch.Size, dtype: torch.dtype, owner: nn.Module, seed: int) -> torch.Tensor:
    if name.endswith("bias") or (isinstance(owner, _NORMS) and not name.endswith("weight")):
        return torch.zeros(shape, dtype=dtype)
    if isinstance(owner, _NORMS):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype)


def materialize(units: list[tuple[str, nn.Module]], model: nn.Module, *, seed: int, device: torch.device) -> None:
    """Allocate the meta parameters and buffers of the named unit modules of `model` on `device`, initialised by
    canonical name (the module doc's rule)."""
    canon = canonical_names(model)
    for _, m in units:
        m.to_empty(device=device)
    # to_empty gives every module its own new tensor, so a parameter shared by two units (a tied embedding) is
    # untied; point every alias back at one tensor per canonical name.
    first: dict[str, nn.Parameter] = {}
    for unit_name, m in units:
        for name, p in list(m.named_parameters(prefix=unit_name, remove_duplicate=False)):
            keep = first.setdefault(canon[name], p)
            if keep is not p:
                owner_path, _, attr = name[len(unit_name) + 1:].rpartition(".")
                setattr(m.get_submodule(owner_path) if owner_path else m, attr, keep)
    with torch.no_grad():
        for unit_name, m in units:
            for name, p in m.named_parameters(prefix=unit_name, remove_duplicate=False):
                c = canon[name]
                owner = model.get_submodule(c.rsplit(".", 1)[0]) if "." in c else model
                p.copy_(_init_value(c, p.shape, p.dtype, owner, seed).to(device))
            for _, b in m.named_buffers():
                if b.is_floating_point():
                    b.zero_()


@dataclass(frozen=True)
class TiedParam:
    """A parameter whose aliases live in stages on more than one pipeline rank."""

    canonical: str
    pp_ranks: tuple[int, ...]


def _unit(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ConfigError(f"the plan's unit '{name}' is not a module of this model; was the plan made for another "
                          "model?") from None


def check_covers_model(model: nn.Module, stages: tuple[tuple[str, ...], ...]) -> None:
    """Refuse (ConfigError, one line) stages that name a module the model lacks, or that leave some of the model's
    parameters out: a plan edited to drop a block would otherwise train a different function without a word."""
    held = {id(p) for name in (u for stage in stages for u in stage) for p in _unit(model, name).parameters()}
    left_out = [n for n, p in model.named_parameters() if id(p) not in held]
    if left_out:
        raise ConfigError(f"the plan's stages leave out {len(left_out)} parameter tensor(s) of the model (first: "
                          f"{left_out[0]}); re-create the plan from a profile of this model")


def build_stages(model: nn.Module, stages: tuple[tuple[str, ...], ...], stage_ids: list[int], *,
                 recompute: tuple[bool, ...], seed: int, device: torch.device) -> list[Stage]:
    """The Stage modules for `stage_ids` (this rank's), materialised and initialised."""
    built = []
    for sid in stage_ids:
        units = [(name, _unit(model, name)) for name in stages[sid]]
        built.append(Stage(units, recompute=bool(recompute) and recompute[sid]))
    materialize([u for st in built for u in zip(st.unit_names, st.children())], model, seed=seed, device=device)
    return built


def tied_params(model: nn.Module, stages: tuple[tuple[str, ...], ...], stage_rank: Callable[[int], int]) -> list[TiedParam]:
    """Parameters reachable from units of stages that live on different pipeline ranks (call before materialising);
    stage_rank maps a stage to its pipeline rank (Strategy.stage_rank: the schedule's placement)."""
    canon = canonical_names(model)
    ranks_of: dict[str, set[int]] = {}
    for sid, names in enumerate(stages):
        for name in names:
            for pname, _ in model.get_submodule(name).named_parameters(prefix=name, remove_duplicate=False):
                ranks_of.setdefault(canon[pname], set()).add(stage_rank(sid))
    return sorted((TiedParam(canonical=c, pp_ranks=tuple(sorted(r))) for c, r in ranks_of.items() if len(r) > 1),
                  key=lambda t: t.canonical)


def tied_units(model: nn.Module, stages: tuple[tuple[str, ...], ...]) -> list[tuple[str, ...]]:
    """For each parameter used by more than one unit, the units using it (the executor's view of
    ModelProfile.shared[i].units)."""
    canon = canonical_names(model)
    units_of: dict[str, list[str]] = {}
    for name in (u for stage in stages for u in stage):
        for pname, _ in model.get_submodule(name).named_parameters(prefix=name, remove_duplicate=False):
            users = units_of.setdefault(canon[pname], [])
            if name not in users:
                users.append(name)
    return [tuple(users) for users in units_of.values() if len(users) > 1]


def params_by_canonical(stage_modules: list[Stage], canon: dict[str, str]) -> dict[str, nn.Parameter]:
    """This rank's parameters keyed by canonical name (one entry per tensor, aliases folded). `canon` must come
    from canonical_names() on the model before materialising: afterwards a tie across ranks is no longer visible."""
    out: dict[str, nn.Parameter] = {}
    for st in stage_modules:
        for unit_name, module in zip(st.unit_names, st.children()):
            for name, p in module.named_parameters(prefix=unit_name, remove_duplicate=False):
                out.setdefault(canon[name], p)
    return out


def buffers_by_canonical(stage_modules: list[Stage]) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers (what a state_dict holds) keyed by their names in the full model."""
    out: dict[str, torch.Tensor] = {}
    for st in stage_modules:
        for unit_name, unit in zip(st.unit_names, st.children()):
            for mod_name, mod in unit.named_modules(prefix=unit_name):
                for name, b in persistent_buffers(mod):
                    out.setdefault(f"{mod_name}.{name}", b)
    return out

