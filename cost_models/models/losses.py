"""The training loss each kind of model input implies, and a synthetic target for it.

Token models (zoo LMs, hf:, factories fed ids) are language models: next-token cross-entropy over the logits.
Feature models regress: mean squared error. The profiler includes the loss in the last unit (for an LM its
float logits and log-softmax are among the largest activations), and the executor trains with the same loss.

A model whose forward takes `targets` computes its own loss (the single-file GPTs: `forward(idx, targets=None)`
returns `(logits, loss)`, and without targets only the last position's logits, an inference branch): it is
profiled, planned and trained called as `model(inputs, targets)`, and its own loss is what trains (own_loss).
transformers' models are not: their `labels=` loss shifts the targets a second time.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.models.source import load_attr
from cost_models.records.errors import ConfigError

TARGETS = "targets"   # the forward argument a model that computes its own loss takes its targets in


def takes_targets(model: nn.Module) -> bool:
    """Whether `model` computes its own loss: its forward's parameter after the input is `targets` (module doc)."""
    if isinstance(getattr(getattr(model, "config", None), "model_type", None), str):
        return False
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return False
    return params[1:2] == [TARGETS]


def synthetic_token_targets(inputs: torch.Tensor, vocab: int | None, *, seed: int = 4321) -> torch.Tensor:
    """Next-token targets shaped like the token ids `inputs`, for a model that takes targets (made on CPU with a
    fixed seed, moved to the inputs' device)."""
    if vocab is None:
        raise ConfigError(f"the model's forward takes {TARGETS}, but its input is not token ids of a known vocabulary "
                          f"(an nn.Embedding); drop the {TARGETS} parameter or feed it token ids")
    return _token_ids(tuple(inputs.shape), vocab, seed).to(inputs.device)


def _token_ids(shape: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    """Class ids below `vocab`, drawn on CPU from a generator seeded with `seed` (the same on every rank)."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def own_loss(output: Any) -> torch.Tensor:
    """The loss in what a forward given targets returned: the output itself (a 0-dim tensor), the one 0-dim
    floating tensor of a tuple ((logits, loss)), or an output object's `.loss`; else one line saying what to do."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    found = [t for t in (output if isinstance(output, (tuple, list)) else (getattr(output, "loss", None),))
             if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
    if len(found) != 1:
        raise ConfigError(f"the model's forward, given {TARGETS}=, returned {type(output).__name__} without one scalar "
                          f"loss in it; return the loss (or (logits, loss)) when {TARGETS} are given")
    return found[0]


def loss_kind(input_kind: str) -> str:
    return "cross_entropy" if input_kind == "tokens" else "mse"


def compute_loss(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "cross_entropy":
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())
    return F.mse_loss(output.float(), target.float())


def synthetic_target(kind: str, output: torch.Tensor, *, seed: int = 4321) -> torch.Tensor:
    """A target shaped for `output` (class ids for cross-entropy, values for MSE), made on CPU with a fixed seed."""
    if kind == "cross_entropy":
        target = _token_ids(tuple(output.shape[:-1]), output.shape[-1], seed)
    else:
        target = torch.randn(tuple(output.shape), generator=torch.Generator().manual_seed(seed))
    return target.to(output.device)


def own_logits(output: Any) -> torch.Tensor | None:
    """The logits beside the loss in what a forward given targets returned: an output object's `.logits`, or the
    first tensor of 2 or more dimensions in a tuple ((logits, loss)); None if there are none."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = output if isinstance(output, (tuple, list)) else ()
    return next((t for t in items if isinstance(t, torch.Tensor) and t.dim() >= 2), None)


def output_refusal(output: Any, *, own: bool) -> str | None:
    """Why training cannot take a loss on what the forward returned, or None: a model with its own loss must return
    one (own_loss) and its logits (own_logits: their shape sets the targets'); any other must return its logits, as
    a tensor or an output's `.logits`. The reason says what wrapper to write."""
    if own:
        try:
            own_loss(output)
        except ConfigError as exc:
            return str(exc)
        if own_logits(output) is None:
            return (f"its forward, given {TARGETS}=, returns no logits beside its loss; return (logits, loss) (or an "
                    f"output with .logits and .loss)")
        return None
    if isinstance(output, torch.Tensor) or isinstance(getattr(output, "logits", None), torch.Tensor):
        return None
    return (f"its forward returns a {type(output).__name__}, not a tensor of logits (or an output with .logits); "
            f"wrap the model in a module whose forward returns the logits, or give its forward a `{TARGETS}` "
            f"parameter and return (logits, loss) when targets are given")


def declared_loss(ref: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """`planner run --loss module:fn`: fn(logits, targets) -> a scalar loss on the model's logits (what its forward
    returns, or its `.logits`: what every layout's last stage hands on) and the step's targets, in place of
    next-token cross-entropy."""
    fn = load_attr(ref, "--loss")

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        try:
            value = fn(logits, targets)
        except Exception as exc:   # the user's code: one line naming it
            raise ConfigError(f"--loss {ref} raised {type(exc).__name__}: {exc}; fix the function") from None
        return scalar_loss(ref, value)
    return loss


def scalar_loss(ref: str, value: Any) -> torch.Tensor:
    """A declared loss's value as a 0-dim tensor, or one line: it must be one floating-point number (the mean)."""
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()):
        raise ConfigError(f"--loss {ref} returned {type(value).__name__}"
                          f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}, not a scalar "
                          f"floating-point tensor; return the mean loss")
    return value.reshape(())
