"""Pipeline stages of HF causal LMs that run the model's own forward (never a chain that skips code in it).

A stage holding decoder layers i..j runs the model's own decoder forward (LlamaModel.forward, GPT2Model.forward:
position ids, rotary embeddings, the causal mask, the layer calls, as the model computes them) over a *view* of the
decoder: a shallow copy that shares every module object with the model but lists only the layers the stage holds,
with the parts that belong to other stages replaced by what makes the forward pass the hidden states through:
  first stage   takes token ids; the embedding runs as in the model.
  later stages  take the hidden states as `inputs_embeds`. Llama / Mistral / Qwen2 use inputs_embeds as the
                hidden states directly. GPT-2 adds its learned positions to inputs_embeds and applies embedding
                dropout: on later stages its `wpe` is replaced by zeros (x + 0 is x, bit for bit) and `drop` by
                identity, so those happen once, on the first stage, as in the whole model.
  last stage    the final norm runs in the decoder forward and the LM head after it (`logits = lm_head(h)`, as
                LlamaForCausalLM / GPT2LMHeadModel do); earlier stages replace the final norm by identity.
The view is not registered as a submodule of the Stage (its modules are, once, under their model names), so
parameters are not listed twice and FSDP2 / DDP see each once.
"""
from __future__ import annotations

from typing import Any, Sequence, cast

import torch
from torch import nn

from cost_models.records.errors import ConfigError
from cost_models.torch_compat.torch_private import module_view
from executor.stages import Stage, UnitMap


class _Zeros(nn.Module):
    """Stands in for GPT-2's position table on stages after the first: zeros of the embedding width."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.width, self.dtype = width, dtype

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*position_ids.shape, self.width, dtype=self.dtype, device=position_ids.device)


def _layers(model: nn.Module, decoder_path: str, layer_list: str, unit_names: Sequence[str],
            units: UnitMap) -> list[tuple[str, nn.Module]]:
    prefix = f"{decoder_path}.{layer_list}."
    out = []
    for u in unit_names:
        for name, module in units.parts(model, u):
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                out.append((name, module))
    return out


def _parts(model: nn.Module, unit_names: Sequence[str], units: UnitMap) -> list[tuple[str, nn.Module]]:
    return [part for u in unit_names for part in units.parts(model, u)]


def _check_units(model: nn.Module, unit_names: Sequence[str], units: UnitMap, layers, expected: set[str]) -> None:
    """Every module the stage holds is a decoder layer or one of the model's known non-layer parts."""
    layer_names = {n for n, _ in layers}
    for name, _ in _parts(model, unit_names, units):
        if name not in layer_names and name not in expected:
            raise ConfigError(f"the HF adapter for {type(model).__name__} does not know the unit module '{name}'; "
                              "re-profile the model with its default units")


def llama_stage(model: nn.Module, unit_names: Sequence[str], units: UnitMap, *, first: bool, last: bool) -> Stage:
    """LlamaForCausalLM and the families with its decoder shape (Mistral, Qwen2): embed_tokens, layers, norm,
    rotary_emb under `model`, and lm_head."""
    decoder: Any = model.model   # an HF decoder: nn.Module's stubs type its submodules as Tensor | Module
    layers = _layers(model, "model", "layers", unit_names, units)
    _check_units(model, unit_names, units, layers, {"model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"})
    view = module_view(decoder, embed_tokens=decoder.embed_tokens if first else None,
                 layers=nn.ModuleList([m for _, m in layers]), norm=decoder.norm if last else nn.Identity())
    head = cast(nn.Module, model.lm_head)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = view(input_ids=x, use_cache=False) if first else view(inputs_embeds=x, use_cache=False)
        h = out.last_hidden_state
        return head(h) if last else h
    parts = dict(_parts(model, unit_names, units))
    parts.setdefault("model.rotary_emb", decoder.rotary_emb)   # every stage computes the rotary embeddings
    return Stage(list(parts.items()), run)


def gpt2_stage(model: nn.Module, unit_names: Sequence[str], units: UnitMap, *, first: bool, last: bool) -> Stage:
    """GPT2LMHeadModel: wte, wpe, drop, h, ln_f under `transformer`, and lm_head (tied to wte)."""
    decoder: Any = model.transformer   # an HF decoder: nn.Module's stubs type its submodules as Tensor | Module
    layers = _layers(model, "transformer", "h", unit_names, units)
    _check_units(model, unit_names, units, layers,
                 {"transformer.wte", "transformer.wpe", "transformer.drop", "transformer.ln_f", "lm_head"})
    width, dtype = decoder.wte.weight.shape[1], decoder.wte.weight.dtype
    view = module_view(decoder, h=nn.ModuleList([m for _, m in layers]),
                 wpe=decoder.wpe if first else _Zeros(width, dtype),
                 drop=decoder.drop if first else nn.Identity(), ln_f=decoder.ln_f if last else nn.Identity())
    head = cast(nn.Module, model.lm_head)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = view(input_ids=x, use_cache=False) if first else view(inputs_embeds=x, use_cache=False)
        h = out.last_hidden_state
        return head(h) if last else h
    return Stage(_parts(model, unit_names, units), run)


# keyed by the family's name (cost_models.models.families: the pipeline kind pipeline_support answers)
ADAPTERS = {"hf-llama": llama_stage, "hf-gpt2": gpt2_stage}
