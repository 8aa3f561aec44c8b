"""Pipeline stages of transformers causal LMs that run the model's own forward (never a chain that skips code in it),
for every decoder family alike (cost_models.models.pipelining.DecoderLayout says where the pieces are).

A stage holding decoder layers i..j runs the model's own forward (LlamaModel.forward, GPT2Model.forward,
OPTDecoder.forward: position ids, rotary embeddings, the causal and sliding-window masks, the layer calls, as the
model computes them) over a *view* of the decoder: a shallow copy that shares every module object with the model but
lists only the layers the stage holds, with the parts that belong to other stages replaced:
  first stage   takes token ids; the embedding runs as in the model.
  later stages  take the hidden states, passed as `inputs_embeds` (so the token embedding is not called) and put
                into the stage's first layer as its input: whatever the decoder does to inputs_embeds before its
                layers (Gemma's sqrt(hidden) scale, GPT-2's and OPT's learned positions, embedding dropout) happened
                once, on the first stage, as in the whole model. The embedding modules that hold parameters (owned by
                the first stage) are replaced by zeros, so that discarded prologue reads no parameter this stage
                does not hold; the parameter-free ones (rotary tables) run on every stage.
  last stage    runs the root's forward (the *ForCausalLM): final norm, head and whatever the family does to the
                logits (Gemma 2's soft-capping, Granite's scaling); earlier stages call the decoder alone, its final
                norm replaced by identity, and hand on their last layer's output.
The view is not registered as a submodule of the Stage (its modules are, once, under their model names), so
parameters are not listed twice and FSDP2 / DDP see each once.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from cost_models.models.pipelining import DecoderLayout, decoder_layout
from cost_models.records.errors import ConfigError
from cost_models.torch_compat.torch_private import module_view
from executor.stages import Stage, UnitMap


class _Zeros(nn.Module):
    """Stands in, on stages after the first, for an embedding module that holds parameters (GPT-2's position table):
    a zero the prologue adds to inputs_embeds, whose result the stage's first module never reads."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        like = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        return torch.zeros((), device=like.device if like is not None else None)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


@contextlib.contextmanager
def _entering(module: nn.Module | None, x: torch.Tensor | None) -> Iterator[None]:
    """While the stage runs, `module` (its first layer, or the first head module of a stage without layers) takes
    `x`, the stage's input, as its input (its first positional argument, or `hidden_states=`)."""
    if module is None or x is None:
        yield
        return

    def replace(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (x, *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": x}
        raise ConfigError(f"{type(_module).__name__} is called without a positional input or hidden_states=; "
                          "this model cannot be pipelined (use a plan with pp=1)")
    handle = module.register_forward_pre_hook(replace, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _nested_view(model: nn.Module, path: str, innermost: nn.Module) -> nn.Module:
    """A view of `model` whose module at `path` (a dotted path) is `innermost`, through views of the modules
    between them (OPT's decoder sits at model.decoder)."""
    parts = path.split(".")
    view = innermost
    for k in reversed(range(len(parts))):
        view = module_view(model.get_submodule(".".join(parts[:k])), **{parts[k]: view})
    return view


def _layer_config(config: Any, indices: list[int]) -> Any:
    """A copy of the decoder's config whose per-layer lists (`layer_types`: which layers attend in a sliding
    window) hold the stage's layers' entries: decoders index them by the position in their layer list (Gemma 2,
    Qwen3: `config.layer_types[i]` for the i-th layer they run)."""
    import copy
    n = getattr(config, "num_hidden_layers", None)
    lists = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and n and len(v) == n
             and k.endswith("layer_types")}
    if not lists:
        return config
    view = copy.copy(config)
    for k, v in lists.items():
        object.__setattr__(view, k, type(v)(v[i] for i in indices))
    return view


def _hidden(out: Any) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def decoder_stage(model: nn.Module, layout: DecoderLayout, parts: list[tuple[str, nn.Module]], *, first: bool,
                  last: bool) -> Stage:
    """The Stage holding `parts` (its units' modules, by model name)."""
    decoder: Any = model.get_submodule(layout.decoder)
    prefix = f"{layout.decoder}.{layout.layers}."
    held_layers = [(int(name[len(prefix):]), m) for name, m in parts if name.startswith(prefix)]
    layers = [m for _, m in held_layers]
    replace: dict[str, nn.Module | None] = {layout.layers: nn.ModuleList(layers)}
    if not first:
        held = dict(parts)
        for name in layout.embed:
            child = getattr(decoder, name)
            if _holds_parameters(child):
                replace[name] = _Zeros()
            else:   # every stage runs it (a rotary table: its buffers must be on this rank's device)
                held.setdefault(f"{layout.decoder}.{name}", child)
        parts = list(held.items())
    if not last:
        replace.update({name: nn.Identity() for name in layout.post})
    view = module_view(decoder, **replace)
    if hasattr(decoder, "config"):
        view.config = _layer_config(decoder.config, [i for i, _ in held_layers])
    root = _nested_view(model, layout.decoder, view) if last else None
    heads = [getattr(decoder, n) for n in layout.post] + [getattr(model, n) for n in layout.head]
    enters = None if first else (layers[0] if layers else heads[0])

    def run(x: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": x} if first else {"inputs_embeds": x}
        with _entering(enters, None if first else x):
            if root is not None:
                return root(**given, use_cache=False).logits
            return _hidden(view(**given, use_cache=False))
    return Stage(parts, run)


def decoder_stages(model: nn.Module, stages: tuple[tuple[str, ...], ...], stage_ids: Sequence[int],
                   units: UnitMap) -> list[nn.Module]:
    """The Stage of each stage in `stage_ids` (typed as stage_builders.Builder returns them)."""
    layout = decoder_layout(model, [(u, units.names(u)) for stage in stages for u in stage])
    if isinstance(layout, str):
        raise ConfigError(f"this model cannot be pipelined: {layout}; re-profile it with its default units")
    return [decoder_stage(model, layout, [p for u in stages[sid] for p in units.parts(model, u)], first=sid == 0,
                          last=sid == len(stages) - 1) for sid in stage_ids]
