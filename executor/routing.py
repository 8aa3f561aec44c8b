"""`planner profile --init-from DIR --data FILE`: a mixture-of-experts model's load per expert measured on the
user's tokens through the user's weights (cost_models.profiling.moe.routed_load), in place of the profile's own
synthetic tokens through freshly drawn weights. An untrained router spreads tokens near evenly; a trained one does
not, and the busiest expert-parallel rank's load over the mean is what the estimate prices EP's routed compute at
(cost_models.cost.moe.imbalance).

The model is built once more, for real, on the profile's device in its dtype, loaded as `planner run --init-from`
loads it (executor.weights, after its checks), and run forward without gradients over the first `windows` windows
of the token file in the order `planner run --data` reads them (executor.data), a window at a time: the load per
window, which the estimate deals into the plan's micro-batches as the run will (cost_models.cost.moe.peak_imbalance:
memory waits for no average, the worst micro-batch's routing sets the peak).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from cost_models.models.moe import moe_blocks
from cost_models.models.source import DTYPES, resolve
from cost_models.profiling.moe import routed_load, with_routed_load
from cost_models.records.errors import ConfigError
from cost_models.records.profile import ModelProfile
from executor.data import TokenFile
from executor.stages import canonical_names, state_maps
from executor.weights import check_weights, load_weights

DEFAULT_WINDOWS = 64   # sequences routed: at seq_len 4,096, 262,144 tokens x top_k pairs spread over the experts


def check_routing_args(init_from: Path | None, data: Path | None, windows: int | None, source=None) -> None:
    """One line for options that cannot go together, and (given the model's `source`) for routing a model without
    MoE blocks: before any profiling."""
    if (init_from is None) != (data is None):
        raise ConfigError("--init-from and --data go together in planner profile: the router's load per expert "
                          "means something only with trained weights on real tokens; give both, or neither")
    if windows is not None and data is None:
        raise ConfigError("--routing-windows counts the windows of --data routed; give --init-from and --data")
    if windows is not None and windows < 1:
        raise ConfigError(f"--routing-windows must be >= 1, got {windows}")
    if data is not None and source is not None and not moe_blocks(source.build(device="meta", dtype=torch.float32)):
        raise ConfigError(_NO_MOE.format(name=source.name))


_NO_MOE = ("--data measures the router's load per expert, and {name} has no mixture-of-experts blocks; drop "
           "--init-from and --data")


def measure_routing(profile: ModelProfile, *, init_from: Path, data: Path, windows: int = DEFAULT_WINDOWS,
                    device: str = "cpu", on_warning: Callable[[str], None] | None = None) -> ModelProfile:
    """`profile` with its MoE units' expert_load and window_load measured on `windows` windows of `data` through the
    weights in `init_from` (module doc); one-line ConfigError for a model without MoE blocks or inputs that are not
    tokens."""
    if not profile.moe_units:
        raise ConfigError(_NO_MOE.format(name=profile.name))
    if profile.input.kind != "tokens":
        raise ConfigError(f"--data feeds token ids; {profile.name} takes {profile.input.kind} inputs")
    tokens = TokenFile(data, profile.seq_len)
    meta = resolve(profile.source).build(device="meta", dtype=torch.float32)
    # every check planner run makes, before the model is built; tensors the model has no place for only warn: the
    # routing reads what it has
    for line in check_weights(meta, init_from, allow_extra=True):
        if on_warning:
            on_warning(line)
    dtype = DTYPES[profile.dtype]
    model = resolve(profile.source).build(device=device, dtype=dtype)
    if profile.input.vocab_size:
        tokens.check_ids(vocab=profile.input.vocab_size)
    params, buffers = state_maps(model, [model], canonical_names(model))
    load_weights(params, buffers, init_from, model=model)
    model.eval()
    assert moe_blocks(model)   # the profile found them in the same model
    count = min(windows, tokens.windows)
    if count < windows and on_warning:
        on_warning(f"--data {data} holds {tokens.windows:,} window(s) of {profile.seq_len + 1} tokens, fewer than "
                   f"the {windows:,} --routing-windows asked for: routing all of them")
    # one window per forward: the load per window, which cost.moe deals into the plan's micro-batches
    loads = routed_load(model, ((tokens.batch(i, 1)[0].to(device),) for i in range(count)))
    return with_routed_load(profile, loads, f"{count} windows of {data} through the weights in {init_from}")
