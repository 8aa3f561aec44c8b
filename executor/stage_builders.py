"""Pipeline stages built by the way the model can be cut (cost_models.models.pipelining.pipeline_support's answer):
one registry from that answer to its builder, so that a new way to cut a model is one entry here."""
from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from cost_models.records.errors import ConfigError
from executor import hf_stages
from executor.stages import Stage, UnitMap, chain_stage, recompute_units
from executor.traced_stages import traced_stages

# (model, stage -> unit names, the stage ids to build, units) -> the Stage modules of those ids
Builder = Callable[[nn.Module, tuple[tuple[str, ...], ...], Sequence[int], UnitMap], list[nn.Module]]


def _per_stage(adapter: Callable[..., Stage]) -> Builder:
    """A builder from a per-stage adapter (it is told whether its stage is the first or the last)."""
    def build(model: nn.Module, stages: tuple[tuple[str, ...], ...], stage_ids: Sequence[int],
              units: UnitMap) -> list[nn.Module]:
        return [adapter(model, stages[sid], units, first=sid == 0, last=sid == len(stages) - 1) for sid in stage_ids]
    return build


BUILDERS: dict[str, Builder] = {
    "chain": _per_stage(lambda model, names, units, *, first, last: chain_stage(model, names, units)),
    "traced": traced_stages,
    # a transformers decoder, whatever its family; "hf-llama" / "hf-gpt2": profiles written before "hf-decoder"
    **{name: hf_stages.decoder_stages for name in ("hf-decoder", "hf-llama", "hf-gpt2")},
}


def build_stages(model: nn.Module, stages: tuple[tuple[str, ...], ...], stage_ids: list[int], *, units: UnitMap,
                 support: str, recompute: tuple[bool, ...]) -> list[nn.Module]:
    """The Stage modules for `stage_ids`, over `model`'s own module objects (meta or real: nothing is allocated
    here), with the planned stages' units recomputed."""
    builder = BUILDERS.get(support)
    if builder is None:
        raise ConfigError(f"this model cannot be pipelined: {support.removeprefix('no: ')}; use a plan with pp=1")
    built = builder(model, stages, stage_ids, units)
    recompute_units(model, stages, stage_ids, units, recompute)
    return built
