"""The profile file: what the profilers measured, as plain frozen records (no torch import needed to read one).

Conventions (see README "Conventions"): bytes are bytes; FLOPs count one multiply-add as 2 FLOPs (as
torch.utils.flop_counter does); times are seconds; `*_bytes` of activations are at the profile's dtype.
"""
from __future__ import annotations

import functools
from typing import Literal

from cost_models.cluster import ClusterProfile
from cost_models.file_record import FileRecord
from cost_models.records import Record, record
from cost_models.tensor_parallel import TPShape

SCHEMA_VERSION = 1
PROFILE_KIND = "zeropipe.profile"
# What ModelProfile.pipelining may say besides "no: <why>" (cost_models.pipelining decides which)
PIPELINE_KINDS = ("chain", "hf-llama", "hf-gpt2", "traced")


def pipeline_refusal(pipelining: str) -> str | None:
    """The reason in a recorded `pipelining` value that refuses pipelines ("no: <why>"), or None: a kind the
    executor can cut, or "" (not recorded: pipelines offered as before, the executor checks at run time)."""
    if not pipelining.startswith("no"):
        return None
    return pipelining.removeprefix("no").lstrip(":").strip() or "it cannot be pipelined"


@record
class Timing(Record):
    """A measured duration: median of `repeats` runs after warm-up, with the fastest and slowest run."""

    median_s: float
    min_s: float
    max_s: float
    repeats: int


@record
class InputSpec(Record):
    """One micro-batch of model input (shape of the first positional input)."""

    kind: str  # "tokens" (integer ids) | "features" (float, a sequence axis) | "custom" (no sequence axis)
    shape: tuple[int, ...]
    dtype: str
    vocab_size: int | None = None


@record
class UnitProfile(Record):
    """One pipeline unit: the smallest piece a stage boundary may not cut (embedding, one block, norm + head)."""

    name: str
    modules: tuple[str, ...]             # module names (model.named_modules) that make up the unit, in call order
    params: int                          # parameters counted here (a tied parameter is counted in its first unit)
    param_bytes: int
    param_tensors: int = 0               # parameter tensors counted here (collectives issued per tensor cost alpha each)
    param_numels: tuple[int, ...] = ()   # their sizes (ZeroRedundancyOptimizer partitions whole tensors)
    shared_params: tuple[str, ...] = ()  # parameter names used here but counted in an earlier unit (tied weights)
    fwd_flops: int                       # FlopCounterMode, forward of the unit alone on its real input
    bwd_flops: int                       # FlopCounterMode, backward incl. the input gradient (what a stage computes)
    output_bytes: int                    # bytes of the unit's output: what crosses a pipeline boundary after it
    saved_bytes: int                     # bytes saved for backward (saved_tensors_hooks, by storage, params excluded)
    fwd_time: Timing | None = None       # real mode only
    bwd_time: Timing | None = None
    fwd_time_one: Timing | None = None   # real mode, micro-batch > 1: the same unit on one sample
    bwd_time_one: Timing | None = None


@record
class SharedParam(Record):
    """A parameter reachable under several names (tied weights): counted once, in `units[0]`."""

    name: str
    aliases: tuple[str, ...]
    units: tuple[str, ...]
    numel: int


@record
class UnitEdge(Record):
    """Unit `src`'s output feeds unit `dst` (by index), `bytes` per micro-batch. Consecutive pairs form the chain;
    an edge that skips units is a skip connection, and makes the units a DAG."""

    src: int
    dst: int
    bytes: int


@record
class ModelProfile(Record):
    name: str
    source: str                          # the --model reference, enough to rebuild the module
    mode: Literal["real", "meta"]
    dtype: str
    micro_batch_size: int
    seq_len: int
    input: InputSpec
    loss: str                            # loss the last unit was profiled with ("cross_entropy" | "mse")
    units: tuple[UnitProfile, ...]
    total_params: int
    total_param_bytes: int
    unassigned_params: int               # parameters outside every unit (e.g. on the root module); in the totals
    shared: tuple[SharedParam, ...]
    model_fwd_flops: int                 # the whole model's forward; minus the units' sum = work outside any unit
    attention_kernels: tuple[str, ...]   # SDPA kernels seen (meta mode substitutes the fused CPU kernel)
    largest_unit: str
    edges: tuple[UnitEdge, ...] = ()     # data flow between units; empty in files written before edges were recorded
    pipelining: str = ""                 # cost_models.pipelining: "chain" | "hf-llama" | "hf-gpt2" | "no: <why>";
                                         # "" in files written before it was recorded (pipelines offered as before)
    tensor_parallel: TPShape | None = None  # cost_models.tensor_parallel: the model's TP plan and dimensions; None in
                                         # files written before it was recorded (no TP offered: re-profile)
    device: str
    threads: int
    torch_version: str
    command: str
    created_at: str

    def unit(self, name: str) -> UnitProfile:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, UnitProfile]:
        return {u.name: u for u in self.units}

    @property
    def pipeline_refusal(self) -> str | None:
        """Why the executor cannot pipeline this model (then only pp = 1 is planned), or None."""
        return pipeline_refusal(self.pipelining)

    @property
    def is_chain(self) -> bool:
        return all(e.dst == e.src + 1 for e in self.edges)


@record
class ProfileFile(FileRecord):
    """profile.json: the model profile (and, from `planner profile`, the cluster it was taken on)."""

    schema_version: int = SCHEMA_VERSION
    kind: str = PROFILE_KIND
    model: ModelProfile
    cluster: ClusterProfile | None = None

    def check(self, where: str) -> None:
        """Numbers the planner cannot trust are refused in one line naming the field (cost_models.validate)."""
        from cost_models.validate import validate_profile_file   # validate imports this module
        validate_profile_file(self, where)
