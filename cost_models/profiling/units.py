"""The profiler's units and what it captures of them: one forward of the whole model under the FLOP counter, with
hooks on the candidate modules that record the order they run in, each one's inputs and output storages and its
forward FLOPs (Capture); the units found from that run (the model's largest nn.ModuleList, one unit per block, with
the modules before and after it as the embedding and head units) or parsed from --units; and the data flow between
them (which unit's output feeds which unit's input)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from cost_models.models.losses import output_refusal, takes_targets
from cost_models.profiling.flops import flop_counter
from cost_models.profiling.tensors import tensor_bytes
from cost_models.records.errors import ConfigError, ProfileError
from cost_models.records.profile import UnitEdge
from cost_models.torch_compat.torch_private import storage_id, tree_leaves, tree_map


class Capture:
    """Hooks that record module call order, the first call's inputs of each watched module, the storages of
    its outputs (to find which unit's output feeds which unit: the data-flow edges), and, read off the running
    FLOP counter, the forward FLOPs of that call (known before any unit is measured: the progress weights)."""

    def __init__(self, modules: dict[str, nn.Module], counter: FlopCounterMode,
                 model_inputs: tuple[Any, ...] = ()) -> None:
        self.order: list[str] = []
        self.inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.outputs: dict[str, set[int]] = {}
        self.fwd_flops: dict[str, int] = {}
        self.calls: dict[str, int] = {}      # how many times each ran in the forward (a block reused at two depths)
        self._flops_before: dict[str, int] = {}
        self._counter = counter
        self.keep_alive: list[torch.Tensor] = []
        self._model_inputs = {storage_id(t) for t in tree_leaves(model_inputs) if isinstance(t, torch.Tensor)}
        self.handles = [m.register_forward_pre_hook(self._pre(name), with_kwargs=True) for name, m in modules.items()]
        self.handles += [m.register_forward_hook(self._post(name)) for name, m in modules.items()]

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name not in self.inputs:
                self.order.append(name)
                self.inputs[name] = tree_map(self._leaf, (args, kwargs))
                self._flops_before[name] = self._counter.get_total_flops()
        return hook

    def _leaf(self, t: Any) -> Any:
        """A captured tensor as a leaf that requires grad where training computes its gradient (a float tensor
        made from the parameters, such as an earlier unit's output, and the model's own float input, as a stage's
        received activations), and not otherwise: position tables made from buffers (transformers' rotary cos and
        sin, passed to every layer), which as gradient-requiring inputs would make each layer keep its queries and
        keys again for their gradient (tensors.fresh keeps the flag)."""
        if not isinstance(t, torch.Tensor):
            return t
        grad = t.is_floating_point() and (t.requires_grad or storage_id(t) in self._model_inputs)
        return t.detach().requires_grad_(grad)

    def _post(self, name: str):
        def hook(module, args, output):
            if name not in self.outputs:
                tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
                self.outputs[name] = {storage_id(t) for t in tensors}
                self.keep_alive.extend(tensors)  # a freed storage's address could be reused: hold them all
                self.fwd_flops[name] = self._counter.get_total_flops() - self._flops_before.get(name, 0)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _is_block_container(m: nn.Module) -> bool:
    """An nn.ModuleList, or an nn.ModuleDict of blocks of one class (blocks keyed by name; a dict of unlike parts,
    nanoGPT's `transformer` of embeddings, blocks and norm, is not one)."""
    if isinstance(m, nn.ModuleList):
        return len(m) > 0
    return isinstance(m, nn.ModuleDict) and len(m) > 0 and len({type(c) for _, c in m.named_children()}) == 1


def _largest_module_list(model: nn.Module) -> str:
    """The model's block container (_is_block_container) holding the most parameters."""
    lists = [(name, m) for name, m in model.named_modules() if name and _is_block_container(m)]
    if not lists:
        raise ProfileError("the model has no nn.ModuleList or nn.ModuleDict of blocks to take pipeline units from; "
                           "pass --units with module names")
    def size(item):
        return (sum(p.numel() for p in item[1].parameters()), len(item[1]))
    return max(lists, key=size)[0]


def _path_siblings(model: nn.Module, list_name: str) -> list[str]:
    """Modules next to the block list along its path from the root: candidates for the embedding and head units."""
    parts = list_name.split(".")
    siblings: list[str] = []
    for depth in range(len(parts)):
        parent_name = ".".join(parts[:depth])
        parent = model.get_submodule(parent_name)
        for child_name, _ in parent.named_children():
            if child_name != parts[depth]:
                siblings.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return siblings


def _parse_units(spec: str | list[str], model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise ConfigError("--units is empty; give comma-separated module names, '+' joining modules of one unit")
    names = {n for n, _ in model.named_modules() if n}
    units, seen = [], set()
    for item in items:
        mods = tuple(m.strip() for m in item.split("+"))
        for m in mods:
            if m not in names:
                raise ConfigError(f"--units: the model has no module '{m}'")
            if m in seen:
                raise ConfigError(f"--units: module '{m}' appears in two units")
            seen.add(m)
        units.append((item, mods))
    return units


def _block_names(model: nn.Module, list_name: str) -> list[str]:
    """The module names of the blocks in `list_name`, the container _largest_module_list found (a list's indices,
    a dict's keys)."""
    return [f"{list_name}.{key}" for key, _ in model.get_submodule(list_name).named_children()]


def _derive_units(model: nn.Module, list_name: str, order: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    blocks = _block_names(model, list_name)
    pos = {name: i for i, name in enumerate(order)}
    missing = [b for b in blocks if b not in pos]
    if missing:
        raise ProfileError(f"block {missing[0]} never ran in the forward pass; pass --units with the modules that run")
    first, last = pos[blocks[0]], pos[blocks[-1]]
    siblings = [s for s in _path_siblings(model, list_name) if s in pos]
    before = tuple(sorted((s for s in siblings if pos[s] < first), key=pos.__getitem__))
    after = tuple(sorted((s for s in siblings if pos[s] > last), key=pos.__getitem__))
    units = []
    if before:
        units.append((before[0] if len(before) == 1 else "embed", before))
    units += [(b, (b,)) for b in blocks]
    if after:
        units.append((after[0] if len(after) == 1 else "head", after))
    return units


def find_units(model: nn.Module, inputs: tuple[torch.Tensor, ...], model_name: str, units: str | list[str] | None,
               ) -> tuple[list[tuple[str, tuple[str, ...]]], Capture, FlopCounterMode]:
    """Steps 1-2 of the profiler (model_profiler's module doc): the whole model's forward under a FLOP counter, a
    Capture on the candidate modules (those `units` names, else the largest nn.ModuleList's blocks and the modules
    beside it along its path), then the units. Returns the units, the capture and the whole model's FLOP counter."""
    explicit = _parse_units(units, model) if units else None
    if explicit:
        watched = {m: model.get_submodule(m) for _, mods in explicit for m in mods}
    else:
        list_name = _largest_module_list(model)
        names = _path_siblings(model, list_name) + _block_names(model, list_name)
        watched = {n: model.get_submodule(n) for n in names}
    model_fc = flop_counter()
    capture = Capture(watched, model_fc, inputs)
    # with grad, so that the capture sees which inputs training differentiates (Capture._leaf); nothing is kept
    # for a backward that never runs (the hooks drop every saved tensor)
    dropped = torch.autograd.graph.saved_tensors_hooks(_drop, _drop)
    try:
        with torch.enable_grad(), dropped, model_fc:
            refusal = output_refusal(model(*inputs), own=takes_targets(model))
    except Exception as exc:
        raise ProfileError(f"the forward pass of {model_name} failed: {type(exc).__name__}: {exc}") from None
    finally:
        capture.remove()
    if refusal:   # what training could not take a loss on: refused now, not on a rank after start-up
        raise ProfileError(f"{model_name}: {refusal}")
    unit_defs = explicit or _derive_units(model, list_name, capture.order)
    for name, mods in unit_defs:
        for m in mods:
            if m not in capture.inputs:
                raise ProfileError(f"unit '{name}': module '{m}' never ran in the forward pass")
    return unit_defs, capture, model_fc


def _drop(_: Any) -> Any:
    """What a saved-tensor hook keeps of a tensor no backward will read: nothing."""
    return None


def feeds(capture: Capture, prev: str, name: str) -> bool:
    """Module `name`'s one positional input is module `prev`'s output."""
    args, _ = capture.inputs[name]
    return (len(args) == 1 and isinstance(args[0], torch.Tensor)
            and storage_id(args[0]) in capture.outputs.get(prev, ()))



def data_flow_edges(unit_defs, capture: Capture) -> tuple[UnitEdge, ...]:
    """(src unit, dst unit, bytes) for every tensor a unit's output hands to a later unit's input. A chain has
    only (i, i+1) edges; a skip connection across units shows as an edge that jumps."""
    producer: dict[int, int] = {}
    for i, (_, mods) in enumerate(unit_defs):
        for key in capture.outputs.get(mods[-1], ()):
            producer[key] = i
    found: dict[tuple[int, int], int] = {}
    for j, (_, mods) in enumerate(unit_defs):
        seen: set[int] = set()
        for m in mods:
            for t in tree_leaves(capture.inputs[m]):
                if not isinstance(t, torch.Tensor):
                    continue
                key = storage_id(t)
                src = producer.get(key)
                if src is not None and src < j and key not in seen:
                    seen.add(key)
                    found[src, j] = found.get((src, j), 0) + tensor_bytes(t)
    return tuple(UnitEdge(src=a, dst=b, bytes=n) for (a, b), n in sorted(found.items()))
