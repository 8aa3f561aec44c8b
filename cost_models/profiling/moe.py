"""Mixture-of-experts blocks in a profiled model: which they are, what of each unit's work and memory their routed
experts are, and (real mode) how the router spread the profile's tokens over the experts.

A block is recognised by its shape, the one transformers 5 gives Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3 and
gpt-oss and the zoo's MoE has (cost_models.models.moe): a module with a router child (`gate` or `router`) and an
`experts` child that holds `num_experts` routed experts and is called as experts(hidden (tokens, H), top_k_index
(tokens, k), top_k_weights (tokens, k)); `top_k` on the block or its router. A custom block declares the same
two integers; one with a router and experts but no such declaration is refused in one line. A meta profile counts
only experts that say they route evenly on meta (`meta_routing = True`, as the zoo's do: models.moe.expert_order);
others are refused there.

The routed experts' FLOPs are counted by formula: an expert is linear maps, each weight element one multiply-add
(2 FLOPs) per token routed to it in forward and two in backward (input and weight gradients; Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", section 2.1: C_forward ~ 2N, backward twice that), so a block's routed
forward is 2 x tokens x top_k x (its expert parameters / E), whatever the routing (dropless: every pair runs).
What they save for backward is counted in one forward: the storages packed while an `experts` call runs.

The load per expert a real profile records comes from its own synthetic tokens through freshly drawn weights;
`planner profile --init-from DIR --data FILE` measures it again on the user's tokens through the user's weights
(routed_load, with_routed_load), as the router will spread them in training.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from cost_models.models.moe import ROUTERS, Block, moe_blocks
from cost_models.records.errors import ConfigError
from cost_models.records.profile import ModelProfile, MoEUnit
from cost_models.torch_compat.torch_private import storage_id

class _Watch:
    """Hooks on every block's `experts` for one forward: tokens and hidden width dispatched, the routing's load
    per expert (not on meta), and the bytes packed for backward while the experts run; `unweighted`: only those
    bytes, with routing weights of one that need no gradient (as expert parallelism calls the experts:
    executor.expert_parallel.Dispatch), which keep less (a product keeps the factor whose gradient it needs)."""

    def __init__(self, blocks: list[Block], excluded: set[int], *, unweighted: bool = False) -> None:
        self.inside: str | None = None
        self.excluded, self.unweighted = excluded, unweighted
        self.tokens: dict[str, tuple[int, int]] = {}
        self.calls: dict[str, list[tuple[int, ...]]] = {}   # the load per expert of each call, in order
        self.saved: dict[str, dict[int, int]] = {b.name: {} for b in blocks}
        self.handles = []
        for b in blocks:
            self.handles.append(b.experts.register_forward_pre_hook(self._pre(b.name, b.n_experts), with_kwargs=True))
            self.handles.append(b.experts.register_forward_hook(self._post))

    def _pre(self, name: str, n_experts: int):
        def hook(module, args, kwargs):
            self.inside = name
            if self.unweighted:
                return _unit_weights(args, kwargs)
            hidden = args[0] if args else kwargs["hidden_states"]
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self.tokens[name] = (hidden.shape[0], hidden.shape[-1])
            if not index.is_meta:
                counts = torch.bincount(index.reshape(-1).long(), minlength=n_experts)[:n_experts].tolist()
                self.calls.setdefault(name, []).append(tuple(counts))
            return None
        return hook

    def _post(self, module, args, output):
        self.inside = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.inside is not None:
            sid = storage_id(t)
            if sid not in self.excluded:
                self.saved[self.inside][sid] = t.untyped_storage().nbytes()
        return t

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _unit_weights(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An experts call's arguments with its routing weights replaced by ones that need no gradient."""
    if len(args) > 2:
        return (*args[:2], torch.ones_like(args[2]).detach(), *args[3:]), kwargs
    return args, {**kwargs, "top_k_weights": torch.ones_like(kwargs["top_k_weights"]).detach()}


def measure_moe(model: nn.Module, inputs: tuple[torch.Tensor, ...], units: list[tuple[str, tuple[str, ...]]], *,
                excluded: set[int]) -> dict[str, MoEUnit]:
    """Unit name -> its MoEUnit, for the units holding mixture-of-experts blocks (none: {}), from two forwards of
    the whole model on the profile's inputs (run inside the profiler's contexts): as it runs, and with the experts'
    routing weights as expert parallelism gives them (_Watch)."""
    blocks = moe_blocks(model)
    if not blocks:
        return {}
    watches = []
    for flag in (False, True):   # one at a time: each watch hooks the experts from its making until remove()
        w = _Watch(blocks, excluded, unweighted=flag)
        watches.append(w)
        try:
            with torch.autograd.graph.saved_tensors_hooks(w.pack, lambda t: t):
                model(*inputs)
        finally:
            w.remove()
    out: dict[str, MoEUnit] = {}
    for unit, mods in units:
        mine = [b for b in blocks if any(b.name == m or b.name.startswith(m + ".") for m in mods)]
        if mine:
            out[unit] = _unit(unit, mine, watches[0], sum(sum(watches[1].saved[b.name].values()) for b in mine))
    return out


def _params(m: Any) -> tuple[int, int]:
    if not isinstance(m, nn.Module):
        return 0, 0
    ps = list(m.parameters())
    return sum(p.numel() for p in ps), len(ps)


def _unit(unit: str, blocks: list[Block], watch: _Watch, unweighted: int) -> MoEUnit:
    shapes = {(b.n_experts, b.top_k) for b in blocks}
    if len(shapes) > 1:
        raise ConfigError(f"unit {unit} holds mixture-of-experts blocks of different shapes {sorted(shapes)}; give "
                          f"each its own unit (--units)")
    (n_experts, top_k), = shapes
    expert_params = expert_tensors = router = shared = flops = tokens = hidden = 0
    saved = 0
    load = [0] * n_experts
    for b in blocks:
        p, t = _params(b.experts)
        expert_params, expert_tensors = expert_params + p, expert_tensors + t
        router += sum(_params(getattr(b.module, r, None))[0] for r in ROUTERS)
        shared += sum(_params(getattr(b.module, s, None))[0]
                      for s in ("shared_experts", "shared_expert", "shared_expert_gate"))
        tokens, hidden = watch.tokens.get(b.name, (0, 0))
        flops += 2 * tokens * top_k * p // n_experts
        saved += sum(watch.saved[b.name].values())
        load = [a + c for a, c in zip(load, map(sum, zip(*watch.calls.get(b.name, [(0,) * n_experts]))))]
    return MoEUnit(blocks=len(blocks), experts=n_experts, top_k=top_k, hidden=hidden, expert_params=expert_params,
                   expert_tensors=expert_tensors, router_params=router, shared_expert_params=shared, tokens=tokens,
                   routed_fwd_flops=flops, routed_bwd_flops=2 * flops, routed_saved_bytes=saved,
                   routed_unweighted_bytes=unweighted,
                   expert_load=tuple(load) if any(load) else ())


def routed_load(model: nn.Module,
                windows: Iterable[tuple[torch.Tensor, ...]]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Block name -> per forward of `windows` (one sequence each), the token-expert pairs the router sent each
    expert (no gradients)."""
    blocks = moe_blocks(model)
    watch = _Watch(blocks, set())
    count = 0
    try:
        with torch.no_grad():
            for inputs in windows:
                model(*inputs)
                count += 1
    finally:
        watch.remove()
    return {b.name: tuple(watch.calls.get(b.name, [(0,) * b.n_experts] * count)) for b in blocks}


def with_routed_load(profile: ModelProfile, loads: dict[str, tuple[tuple[int, ...], ...]],
                     routing: str) -> ModelProfile:
    """`profile` with each MoE unit's load per window (window_load) the sum of its blocks' `loads` (routed_load),
    expert_load their sum over the windows, and where they came from."""
    units = []
    for u in profile.units:
        mine = [load for name, load in loads.items() if any(name == m or name.startswith(m + ".") for m in u.modules)]
        if u.moe is not None and mine:
            windows = tuple(tuple(map(sum, zip(*per_block))) for per_block in zip(*mine))
            u = dataclasses.replace(u, moe=dataclasses.replace(u.moe, window_load=windows,
                                                               expert_load=tuple(map(sum, zip(*windows)))))
        units.append(u)
    return dataclasses.replace(profile, units=tuple(units), routing=routing)
