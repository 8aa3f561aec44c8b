"""Context parallelism: every sequence split over the cp ranks of a CP group, attention meeting over their keys and
values, on any backend (gloo on CPU included).

The split is Llama 3's (Grattafiori et al. 2024, "The Llama 3 Herd of Models", section 3.3.2): the sequence is cut
into 2 x cp chunks and rank i of the group holds chunks i and 2cp-1-i, so that under a causal mask every rank does
the same attention work. Each attention kernel call (torch's scaled_dot_product_attention, causal) becomes: an
all-gather of the group's keys and values (their gradients reduce-scattered in backward), then, per local chunk g,
attention of its queries over the keys of chunks 0..g with the mask aligned to the lower right (the chunk's last
query sees every key before it). Rotary positions are the tokens' global places (cost_models.models.positions);
the loss of each rank is the mean over its tokens, which are as many on every rank, so averaging gradients over
the dp x cp ranks (Strategy.data_view: FSDP2 and DDP do) trains on the mean over all tokens.

Where it applies: a model whose attention modules (named as executor.tensor_parallel.ATTENTION_NAMES) call
scaled_dot_product_attention with is_causal=True and no mask: the zoo's Llama and GPT, transformers' decoders with
attn_implementation="sdpa" and rotary positions (their *RotaryEmbedding module's position_ids are replaced).
Anything else is refused in one line when it runs (a mask, a non-causal or hand-written attention).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cost_models.cost.context_parallel import split_refusal
from cost_models.models.positions import sequence_positions
from cost_models.records.errors import ConfigError
from executor.measure import comm_label
from executor.tensor_parallel import ATTENTION_NAMES


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPContext:
    """This rank's place in its CP group and the sequence it splits."""
    group: Any             # the CP group's process group (a ProcessGroup)
    cp: int                # ranks in it
    index: int             # this rank's place in it
    seq_len: int           # tokens of a whole sequence
    device: torch.device = torch.device("cpu")   # the rank's: positions are kept there (no copy per layer)

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    @property
    def chunks(self) -> tuple[int, int]:
        """The two chunks this rank holds, in the order its tokens are laid out."""
        return self.index, 2 * self.cp - 1 - self.index

    @functools.cached_property
    def placed_positions(self) -> torch.Tensor:
        """The global positions of this rank's seq_len / cp tokens, on the rank's device, made once."""
        c = self.chunk
        return torch.cat([torch.arange(g * c, (g + 1) * c) for g in self.chunks]).to(self.device)

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `t` (whole sequences along `dim`): its two chunks, concatenated."""
        c = self.chunk
        return torch.cat([t.narrow(dim, g * c, c) for g in self.chunks], dim=dim)

    @functools.cached_property
    def biases(self) -> tuple:
        """Per local chunk g, the causal mask of its queries over the keys of chunks 0..g, aligned to the lower
        right (torch's CausalBias: no mask tensor is made where a kernel takes the alignment, as the memory-efficient
        one does on GPUs). Made before the step (runtime._context_parallel): a tensor subclass cannot be created
        under a dispatch mode (executor.measure's counter), in torch 2.13."""
        from torch.nn.attention.bias import causal_lower_right
        c = self.chunk
        return tuple(causal_lower_right(c, (g + 1) * c) for g in self.chunks)

    def steps(self):
        """The span of a training step: forwards see this rank's global positions."""
        return sequence_positions(self.placed_positions)


def rank_example(example: torch.Tensor | None, cp: int) -> tuple[torch.Tensor | None, int]:
    """(one micro-batch of this rank's tokens of `example`, the whole sequence's length; 0 without one): under
    context parallelism its first seq_len / cp tokens (their shape is what counts: stage shapes, checks), refused in
    one line where there is no example or its sequence does not split (cost.context_parallel.split_refusal)."""
    seq_len = example.shape[1] if example is not None and example.dim() > 1 else 0
    if cp == 1:
        return example, seq_len
    why = split_refusal(seq_len, cp) if seq_len else (
        "context parallelism needs an example micro-batch of token sequences (apply_plan's example_input) to know "
        "the sequence it splits")
    if why:
        raise ConfigError(why)
    assert example is not None   # seq_len > 0
    return example.narrow(1, 0, seq_len // cp), seq_len


class _GatherSequence(torch.autograd.Function):
    """All-gather of a (b, h, s/cp, d) tensor's CP group into the whole sequence (b, h, s, d) in global order;
    backward: the gradient reduce-scattered (summed) back to each rank's chunks. gloo has no reduce-scatter: there
    it is an all-to-all and a sum, which moves the same bytes (torch.distributed.nn.functional's all_gather does
    the same on backends without one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: CPContext) -> torch.Tensor:   # type: ignore[override]
        ctx.cp = cp
        x = x.contiguous()
        buf = x.new_empty((cp.cp * x.shape[0], *x.shape[1:]))
        with comm_label("cp"):
            dist.all_gather_into_tensor(buf, x, group=cp.group)
        parts = buf.view(cp.cp, *x.shape)
        c = cp.chunk
        # chunk g is rank g's first (g < cp) or rank 2cp-1-g's second
        pieces = [parts[g].narrow(2, 0, c) if g < cp.cp else parts[2 * cp.cp - 1 - g].narrow(2, c, c)
                  for g in range(2 * cp.cp)]
        return torch.cat(pieces, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):   # type: ignore[override]
        cp: CPContext = ctx.cp
        c = cp.chunk
        per_rank = torch.stack([torch.cat([grad.narrow(2, r * c, c), grad.narrow(2, (2 * cp.cp - 1 - r) * c, c)],
                                          dim=2) for r in range(cp.cp)]).contiguous()
        out = grad.new_empty(per_rank.shape[1:])
        with comm_label("cp"):
            if dist.get_backend(cp.group) == "gloo":
                received = torch.empty_like(per_rank)
                dist.all_to_all_single(received, per_rank, group=cp.group)
                out = received.sum(dim=0)
            else:
                dist.reduce_scatter_tensor(out, per_rank.view(-1, *per_rank.shape[2:]), group=cp.group)
        return out, None


def attention(cp: CPContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
              scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of this rank's queries (b, h, s/cp, d) over the CP group's keys and values (module doc):
    query i of chunk g sees the keys up to g x chunk + i (CPContext.biases; on GPUs torch runs it as the
    memory-efficient kernel's lower-right causal mask, on CPUs it makes the mask)."""
    k_all, v_all = _GatherSequence.apply(k, cp), _GatherSequence.apply(v, cp)
    c = cp.chunk
    out = []
    for j, (g, bias) in enumerate(zip(cp.chunks, cp.biases)):
        end = (g + 1) * c
        out.append(F.scaled_dot_product_attention(
            q.narrow(2, j * c, c), k_all.narrow(2, 0, end), v_all.narrow(2, 0, end),
            attn_mask=bias, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(out, dim=2)


def _cp_mode(run, module_name: str):
    """A function mode that runs an attention module's scaled_dot_product_attention calls as `run(q, k, v,
    dropout_p=, scale=, enable_gqa=)` (`attention` on its CP group), refusing a mask or a non-causal call, and
    counts them (a module with none computes attention some other way, which context parallelism cannot split)."""
    from torch.overrides import TorchFunctionMode

    class ContextParallelAttention(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not F.scaled_dot_product_attention:
                return func(*args, **kwargs)
            q, k, v, *rest = args
            named = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), rest), **kwargs)
            if named.get("attn_mask") is not None or not named.get("is_causal", False):
                raise ConfigError(f"context parallelism splits causal attention without a mask; {module_name} calls "
                                  f"scaled_dot_product_attention with " + ("an attention mask (sliding windows, "
                                  "padding)" if named.get("attn_mask") is not None else "is_causal=False")
                                  + "; plan it with cp = 1")
            type(self).calls += 1
            return run(q, k, v, dropout_p=named.get("dropout_p", 0.0), scale=named.get("scale"),
                       enable_gqa=named.get("enable_gqa", False))
    return ContextParallelAttention


def apply(model: nn.Module, held: list[nn.Module], cp: CPContext) -> int:
    """Run the attention modules of the held modules under context parallelism (module doc), and give a transformers
    model's rotary embeddings the tokens' global positions. Call before selective recompute wraps the same
    modules, so that its checkpoint keeps the gathered keys and values (its recompute then needs no collective).
    Returns the attention modules wrapped; one line where there are none."""
    return _apply(model, held, functools.partial(attention, cp), cp.placed_positions)


def check_model(model: nn.Module, cp: int, seq_len: int) -> None:
    """Before any rank starts, on the (meta) model the launcher checks: the sequence splits into 2 x cp chunks, and
    its attention can be split (module doc), found when its next forward runs: each attention module's kernel calls
    are refused in one line unless causal without a mask, run whole here; rotary embeddings must take position_ids.
    The model's modules are changed for that forward: a model to check, not to train."""
    why = split_refusal(seq_len, cp)
    if why:
        raise ConfigError(why)

    def whole(q, k, v, **kwargs):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    _apply(model, [model], whole, None)


def _apply(model: nn.Module, held: list[nn.Module], run, positions: torch.Tensor | None) -> int:
    held_ids = {id(sub) for m in held for sub in m.modules()}
    count = rotary = 0
    for name, module in model.named_modules():
        if id(module) not in held_ids:
            continue
        if name.rpartition(".")[2] in ATTENTION_NAMES:
            _wrap(module, name, run)
            count += 1
        elif type(module).__name__.endswith("RotaryEmbedding"):
            _global_rotary(module, name, positions)
            rotary += 1
    if type(model).__module__.startswith("transformers.") and not rotary and count:
        # its positions would be counted from 0 on every rank (GPT-2's and OPT's learned position tables)
        raise ConfigError(f"context parallelism sets a transformers model's positions through its rotary embedding; "
                          f"{type(model).__name__} has none (learned positions): plan it with cp = 1")
    if count == 0 and any(any(True for _ in m.parameters()) for m in held):
        raise ConfigError(f"context parallelism needs attention modules named one of {', '.join(ATTENTION_NAMES)} "
                          f"calling scaled_dot_product_attention; {type(model).__name__} has none here")
    return count


def _wrap(module: nn.Module, name: str, run) -> None:
    mode = _cp_mode(run, name)
    forward = module.forward

    def forward_cp(*args, **kwargs):
        before = mode.calls
        with mode():
            out = forward(*args, **kwargs)
        if mode.calls == before:
            raise ConfigError(f"context parallelism needs {name} ({type(module).__name__}) to compute attention with "
                              f"scaled_dot_product_attention (transformers: attn_implementation=sdpa); it did "
                              f"not, so its sequence cannot be split: plan it with cp = 1")
        return out
    module.forward = forward_cp


def _global_rotary(module: nn.Module, name: str, positions: torch.Tensor | None) -> None:
    """A transformers rotary embedding (forward(x, position_ids)) computed at the tokens' global `positions` (None:
    only checked): the decoder counts positions from 0 over the tokens it sees (passing position_ids to the decoder
    instead would make its mask builder read the jump between the two chunks as two packed sequences)."""
    params = list(inspect.signature(module.forward).parameters)
    if "position_ids" not in params:
        raise ConfigError(f"context parallelism needs rotary positions it can set; {name} "
                          f"({type(module).__name__}) takes no position_ids: plan it with cp = 1")
    at = params.index("position_ids")

    def hook(_module, args, kwargs):
        ids = kwargs.get("position_ids", args[at] if len(args) > at else None)
        if ids is None or positions is None:
            return None
        new = (positions if positions.device == ids.device else positions.to(ids.device)).expand(ids.shape[0], -1)
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": new}
        return (*args[:at], new, *args[at + 1:]), kwargs
    module.register_forward_pre_hook(hook, with_kwargs=True)
