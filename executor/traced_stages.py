"""Pipeline stages cut from the model's own forward, traced (cost_models.models.pipelining's "traced" models).

The forward is traced with torch.fx, every unit module one call_module node (cost_models.models.pipelining.trace_units),
and the graph is cut where the plan's stages end, as torch.distributed.pipelining's tracer cuts at split points:
  - a unit's call runs on the unit's stage; every other operation (the model's own code between units: a scaled
    embedding, a position table added, a residual kept) on the earliest stage that has all its inputs; a parameter
    or buffer read outside the units (`self.pos`) on the stage of its first use (read on two stages: refused);
  - a stage takes every value an earlier stage made that it or a later one uses, and hands on every such value a
    later stage uses (a value needed two stages on passes through the stage between, as a fresh copy so each
    stage's outputs are its own tensors);
  - the first stage takes the model's input (and, for a model that computes its own loss, its targets, which pass
    through every stage to the last: cost_models.models.losses.takes_targets), the last returns the model's output
    (or, for such a model, its loss: loss_vector).
Each stage is an fx.GraphModule over the model's own module and parameter objects (registered under their model
paths), so parameters keep their identity and canonical names (executor.stages.state_maps) and run exactly the
operations the model's forward runs, in its order. Values crossing a boundary must be tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx, nn

from cost_models.models.losses import own_loss, takes_targets
from cost_models.models.pipelining import trace_units
from cost_models.records.errors import ConfigError
from executor.stages import UnitMap


def _stage_of(graph: fx.Graph, unit_stage: dict[str, int], last: int) -> dict[fx.Node, int]:
    """Each node's stage (the module doc's rule)."""
    stage: dict[fx.Node, int] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            stage[n] = 0
        elif n.op == "call_module" and str(n.target) in unit_stage:
            stage[n] = unit_stage[str(n.target)]
        elif n.op == "output":
            stage[n] = last
        elif n.op != "get_attr":
            stage[n] = max((stage[i] for i in n.all_input_nodes if i.op != "get_attr"), default=0)
    for n in graph.nodes:
        if n.op == "get_attr":
            users = {stage[u] for u in n.users}
            if len(users) > 1:
                raise ConfigError(f"the model reads self.{n.target} on pipeline stages {sorted(users)}; only a "
                                  "pipeline that keeps it on one stage (or pp=1) can run it")
            stage[n] = min(users, default=0)
    return stage


def _crossing(graph: fx.Graph, stage: dict[fx.Node, int], boundary: int) -> list[fx.Node]:
    """Values made at or before stage `boundary` that a later stage uses, in graph order."""
    return [n for n in graph.nodes if n.op != "get_attr" and stage[n] <= boundary
            and any(stage[u] > boundary for u in n.users)]


def loss_vector(output) -> torch.Tensor:
    """The loss in a model's output (losses.own_loss) as a 1-element vector: what the last stage of a model that
    computes its own loss returns, since torch's schedule concatenates the last stage's outputs over micro-batches,
    which a 0-dim tensor cannot be (stacked, not reshaped: stage outputs must not be views)."""
    return torch.stack([own_loss(output)])


def _stage_graph(graph: fx.Graph, stage: dict[fx.Node, int], sid: int, last: int, own: bool) -> fx.Graph:
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if sid == 0:   # the model's input (an input its forward never reads, such as an unused default, is left out)
        inputs = [n for n in graph.nodes if n.op == "placeholder" and n.users]
    else:
        inputs = _crossing(graph, stage, sid - 1)
    for n in inputs:
        env[n] = out.placeholder(n.name if n.op != "placeholder" else str(n.target))
    for n in graph.nodes:
        if stage[n] == sid and n.op not in ("placeholder", "output"):
            env[n] = out.node_copy(n, lambda x: env[x])
    if sid == last:
        (result,) = [n for n in graph.nodes if n.op == "output"]
        value = fx.node.map_arg(result.args[0], env.__getitem__)
        out.output(out.call_function(loss_vector, (value,)) if own else value)
        return out
    handed = []
    for n in _crossing(graph, stage, sid):
        value = env[n]
        if n in inputs:   # passes through this stage: a copy, so the stage's output is a tensor it made
            value = out.call_method("clone", (value,))
        handed.append(value)
    out.output(handed[0] if len(handed) == 1 else tuple(handed))
    return out


def traced_stages(model: nn.Module, stages: Sequence[Sequence[str]], stage_ids: Sequence[int],
                  units: UnitMap) -> list[nn.Module]:
    """The fx.GraphModule of each stage in `stage_ids`, over `model`'s own modules and parameters (typed as
    stage_builders.Builder returns them)."""
    unit_stage = {name: sid for sid, unit_names in enumerate(stages) for u in unit_names for name in units.names(u)}
    graph = trace_units(model, list(unit_stage))
    last = len(stages) - 1
    stage = _stage_of(graph, unit_stage, last)
    own = takes_targets(model)
    return [fx.GraphModule(model, _stage_graph(graph, stage, sid, last, own)) for sid in stage_ids]


def as_tuple(value) -> tuple[torch.Tensor, ...]:
    """A stage's inputs or outputs as the tuple torch's PipelineStage sends."""
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if not isinstance(v, torch.Tensor):
            raise ConfigError(f"a value the model hands between pipeline stages is a {type(v).__name__}, not a "
                              "tensor; plan it with pp=1")
    return values
