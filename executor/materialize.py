"""The model a rank trains, built with the model's own initialisation, identical on every rank and every layout.

Two ways, chosen by size (`init_mode`):
  "factory"     torch.manual_seed(seed), then the model's own constructor on the CPU, exactly as
                `torch.manual_seed(seed); model = factory()` in one process: a rank keeps the modules of its share
                and drops the rest. Used when every local rank can hold the whole model for a moment.
  "per-module"  for models too large for that: the model is built with its parameters on the meta device and
                its buffers real (buffers are small, and non-persistent ones such as rotary frequencies are only
                right as the constructor computes them), then each rank allocates the parameters it holds and draws
                each by its owning module's own init (`reset_parameters()`, or an HF model's `_init_weights`),
                from a generator seeded by (seed, the module's name): the same values whichever rank holds it,
                but not the same draw as one `factory()` call (the draws are per module, not one sequence).
A module that holds parameters but has no init function of its own keeps the GPT-2 rule for them: biases and norm
shifts 0, norm scales 1, everything else N(0, 0.02) (Radford et al. 2019; nanoGPT's `_init_weights`).
ZEROPIPE_INIT=factory|per-module forces one way (tests use it to check both).
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Iterable, Iterator

import psutil
import torch
from torch import nn

from cost_models.torch_compat.torch_private import hf_init_weights, own_parameters
from executor.testing_hooks import INIT_ENV, hook

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


def init_mode(meta_model: nn.Module, local_ranks: int) -> str:
    """"factory" when `local_ranks` copies of the whole model fit in half the host's available memory (each rank
    builds it once, then frees what it does not hold), else "per-module"; ZEROPIPE_INIT overrides."""
    forced = hook(INIT_ENV)
    if forced in ("factory", "per-module"):
        return forced
    need = sum(p.numel() * p.element_size() for p in meta_model.parameters()) * max(local_ranks, 1)
    return "factory" if need <= psutil.virtual_memory().available // 2 else "per-module"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and their buffers where they are made (what
    accelerate's init_empty_weights(include_buffers=False) does): every nn.Module.register_parameter moves the new
    parameter to meta, so at most one parameter is ever allocated."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    # patched on the class for the duration of the context (mypy refuses assigning to a method)
    nn.Module.register_parameter = register  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def allocate(model: nn.Module, held: Iterable[nn.Module], device: torch.device) -> None:
    """Give the meta parameters of the `held` modules real (uninitialised) storage on `device`, keeping ties: a
    parameter shared by several modules (a tied embedding) becomes one new tensor set on every module of `model`
    (and of `held`) that holds it."""
    held = list(held)
    # the meta originals stay referenced until the end: a freed one's id could be given to a new parameter, which
    # the walk below would then take for the original
    originals = [p for m in held for p in m.parameters() if p.device.type == "meta"]
    wanted = {id(p) for p in originals}
    new: dict[int, nn.Parameter] = {}
    # the held modules too: a traced stage (executor.traced_stages) holds a parameter read outside the units
    # (a position table) in a slot of its own
    for module in [*model.modules(), *(sub for m in held for sub in m.modules())]:
        slots = own_parameters(module)
        for name, p in list(slots.items()):
            if p is not None and id(p) in wanted:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                slots[name] = new[id(p)]


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """id(parameter) -> (name, module) of the module that holds it under its first (canonical) name."""
    out: dict[int, tuple[str, nn.Module]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p in own_parameters(module).values():
            if p is not None:
                out.setdefault(id(p), (mod_name, module))
    return out


def _fallback_init(module: nn.Module, gen: torch.Generator) -> None:
    for name, p in module.named_parameters(recurse=False):
        if p.device.type == "meta":
            continue
        if name.endswith("bias") or (isinstance(module, _NORMS) and name != "weight"):
            p.zero_()
        elif isinstance(module, _NORMS):
            p.fill_(1.0)
        else:
            p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen).to(p.dtype))


def _init_function(model: nn.Module, module: nn.Module) -> Callable[[], None] | None:
    hf_init = hf_init_weights(model)
    if hf_init is not None:   # transformers' PreTrainedModel: its per-module initialisation
        return lambda: hf_init(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def init_held(model: nn.Module, held: Iterable[nn.Module], seed: int, *,
              shard: tuple[int, int] | None = None) -> None:
    """Draw the allocated parameters of the `held` modules by their owning modules' own init functions, each
    module from a generator seeded by (seed, its name); the module doc's fallback where a module has none.
    `shard` = (dp rank, dp size) when the parameters are already FSDP2 shards (DTensors, dimension 0 split as
    torch.chunk splits it): each owner module is drawn whole into temporary full tensors, one module at a time,
    and each rank keeps its chunk, so the values are the unsharded draw's and no rank holds more than one
    module's full parameters at once."""
    owners = _owners(model)
    todo: dict[str, nn.Module] = {}
    for m in held:
        for p in m.parameters():
            if p.device.type != "meta":
                name, owner = owners[id(p)]
                todo.setdefault(name, owner)
    with torch.no_grad():
        for name in sorted(todo):
            owner = todo[name]
            module_seed = seed * 1_000_003 + zlib.crc32(name.encode())
            with torch.random.fork_rng(devices=[]), _whole(owner, shard):
                torch.manual_seed(module_seed)
                init = _init_function(model, owner)
                if init is not None:
                    init()
                else:
                    _fallback_init(owner, torch.Generator().manual_seed(module_seed))


@contextlib.contextmanager
def _whole(module: nn.Module, shard: tuple[int, int] | None) -> Iterator[None]:
    """While inside: the module's sharded parameters replaced by full-size temporary tensors; on leaving, each
    rank's chunk of them copied into its shard and the shards put back."""
    slots = own_parameters(module)
    sharded = {n: p for n, p in slots.items() if shard is not None and p is not None and hasattr(p, "to_local")}
    for n, p in sharded.items():
        slots[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device))
    try:
        yield
    finally:
        for n, p in sharded.items():
            full = slots[n]
            assert shard is not None and full is not None   # sharded is empty without a shard; full: set above
            local, chunks = p.to_local(), full.chunk(shard[1], dim=0)
            if shard[0] < len(chunks) and local.numel():
                local.copy_(chunks[shard[0]][: local.shape[0]])
            slots[n] = p
def release_unheld(model: nn.Module, held: Iterable[nn.Module]) -> None:
    """Swap every parameter no `held` module uses for a meta placeholder, so that a rank that built the whole
    model ("factory") keeps only its share; names and ties stay for the canonical-name maps."""
    keep = {id(p) for m in held for p in m.parameters()}
    meta: dict[int, nn.Parameter] = {}
    for module in model.modules():
        slots = own_parameters(module)
        for name, p in list(slots.items()):
            if p is not None and id(p) not in keep and p.device.type != "meta":
                if id(p) not in meta:
                    meta[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                slots[name] = meta[id(p)]
