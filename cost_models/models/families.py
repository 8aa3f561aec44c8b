"""Every model family zeropipe has a tensor-parallel plan for, one entry each: how its torch model is recognised and
the dimensions that decide its tensor-parallel degrees.

An entry's `name` is its tensor-parallel plan's name in cost_models.records.tensor_parallel.PLANS (data the cost
model reads without torch). Pipelines need no entry: every transformers decoder is cut by one adapter
(cost_models.models.pipelining.DecoderLayout, executor.hf_stages), the zoo's models are unit chains. Adding a
family: an entry here and its plan in PLANS (tests/test_families.py checks that every name an entry gives resolves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from cost_models.models.gpt import GPT
from cost_models.models.llama import Llama
from cost_models.models.moe import MoETransformer


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str                                     # its TP plan in PLANS
    dims: Callable[[Any], dict[str, Any]]         # model -> TPShape's dimension fields
    zoo_class: type[nn.Module] | None = None      # a zoo family: its model class
    model_types: tuple[str, ...] = ()             # a transformers family: the config.model_type values it covers
    refusal: Callable[[Any], str | None] = lambda model: None   # why a member has no TP plan after all, or None

    def matches(self, model: nn.Module) -> bool:
        if self.zoo_class is not None:
            return isinstance(model, self.zoo_class)
        return getattr(getattr(model, "config", None), "model_type", None) in self.model_types


def _zoo_llama(model: Any) -> dict[str, Any]:
    c = model.cfg
    return dict(heads=c.n_heads, kv_heads=c.n_kv_heads, ffn=c.ffn_dim, hidden=c.dim, vocab=c.vocab_size,
                vocab_split=True)


def _zoo_gpt(model: Any) -> dict[str, Any]:
    g = model.cfg
    # tied or not, the embedding and head split on the vocabulary: a tied weight has one layout for both
    # (executor.tensor_parallel ties them again after the split)
    return dict(heads=g.n_heads, kv_heads=g.n_heads, ffn=4 * g.dim, hidden=g.dim, vocab=g.vocab_size,
                vocab_split=True)


def _hf_llama(model: Any) -> dict[str, Any]:
    config = model.config
    return dict(heads=config.num_attention_heads,
                kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                ffn=config.intermediate_size, hidden=config.hidden_size, vocab=config.vocab_size,
                vocab_split=not bool(getattr(config, "tie_word_embeddings", False)))


def _hf_gpt2(model: Any) -> dict[str, Any]:
    # tied head (GPT2LMHeadModel ties it to wte): the vocabulary stays whole, the plan has no vocab rules
    config = model.config
    return dict(heads=config.n_head, kv_heads=config.n_head, ffn=config.n_inner or 4 * config.n_embd,
                hidden=config.n_embd, vocab=config.vocab_size)


# Multi-head latent attention's replicated low-rank projections feed every head, so under a head split their
# gradients would need summing over the tp ranks (torchtitan's DeepSeek plan keeps them replicated so): not built,
# refused. (Qwen3's per-head q/k norms are the same case, planned: records.tensor_parallel's head_norm style.)
_MLA = ("multi-head latent attention (DeepSeek-V3's) has no tensor-parallel plan yet: its replicated low-rank "
        "projections feed every head, so their gradients would need summing over the tensor-parallel ranks")


def _zoo_moe_refusal(model: Any) -> str | None:
    return _MLA if model.cfg.mla is not None else None


def _zoo_moe(model: Any) -> dict[str, Any]:
    # the dense MLP splits (its width must divide) where the model has one; the MoE blocks run whole
    c = model.cfg
    return dict(heads=c.n_heads, kv_heads=c.n_heads if c.mla is not None else c.n_kv_heads,
                ffn=c.ffn_dim if c.first_dense else 0, hidden=c.dim, vocab=c.vocab_size, vocab_split=True)


def _hf_moe(model: Any) -> dict[str, Any]:
    # the width of the dense MLPs a model has between its MoE blocks (Qwen3-MoE's mlp_only_layers), else none
    dense = next((m.gate_proj.out_features for n, m in model.named_modules()
                  if n.endswith(".mlp") and isinstance(getattr(m, "gate_proj", None), nn.Linear)), 0)
    return {**_hf_llama(model), "ffn": dense}


FAMILIES: tuple[Family, ...] = (
    Family(name="zoo-llama", zoo_class=Llama, dims=_zoo_llama),
    Family(name="zoo-gpt", zoo_class=GPT, dims=_zoo_gpt),
    Family(name="zoo-moe", zoo_class=MoETransformer, dims=_zoo_moe, refusal=_zoo_moe_refusal),
    Family(name="hf-llama", model_types=("llama", "mistral", "qwen2"), dims=_hf_llama),
    Family(name="hf-moe", model_types=("mixtral", "qwen3_moe"), dims=_hf_moe),
    Family(name="hf-gpt2", model_types=("gpt2",), dims=_hf_gpt2),
)
HF_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model: nn.Module) -> Family | None:
    """The family this torch model belongs to, or None (a user's own model)."""
    return next((f for f in FAMILIES if f.matches(model)), None)


def hf_family(model_type: str) -> Family | None:
    """The transformers family covering `model_type`, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)
