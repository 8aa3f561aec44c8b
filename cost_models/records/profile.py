"""The profile file: what the profilers measured, as plain frozen records (no torch import needed to read one).

Conventions (see README "Conventions"): bytes are bytes; FLOPs count one multiply-add as 2 FLOPs (as
torch.utils.flop_counter does); times are seconds; `*_bytes` of activations are at the profile's dtype.
"""
from __future__ import annotations

import functools
from typing import Literal

from cost_models.records.base import Record, record
from cost_models.records.tensor_parallel import TPShape
from cost_models.records.work import WorkCounts

SCHEMA_VERSION = 1
PROFILE_KIND = "zeropipe.profile"
# What ModelProfile.pipelining may say besides "no: <why>" (cost_models.models.pipelining decides which);
# "hf-llama" and "hf-gpt2" are what profiles written before "hf-decoder" covered every transformers decoder say
PIPELINE_KINDS = ("chain", "hf-decoder", "traced", "hf-llama", "hf-gpt2")


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


OPTIMIZERS = ("adamw", "adam", "sgd")   # Strategy.optimizer's values, in the order a profile times them


@record
class OptimizerTiming(Record):
    """One optimizer's step (the executor's, cost_models.torch_compat.optimizers.build) timed in a real-mode profile,
    on fp32 copies of the model's parameters (every plan updates fp32 weights: fp32, and bf16-mixed's torch mixed
    precision) with gradients set, beside the same step over many tiny tensors (its fixed cost per tensor)."""

    optimizer: str                       # "adamw" | "adam" | "sgd"
    step: Timing                         # one step over `params` parameters in `tensors` tensors
    params: int
    tensors: int
    tensor_s: float                      # the step per tensor over 64 tensors of 64 elements

    def param_seconds(self) -> float:
        """Seconds per parameter beyond the fixed cost per tensor (which a cluster probes: estimate prices it)."""
        return max(0.0, self.step.median_s - self.tensors * self.tensor_s) / max(1, self.params)


def counts_positions(input_kind: str) -> bool:
    """Whether throughput counts the input's positions (token and feature sequences: "tokens") rather than its
    samples (an input with no sequence axis, "custom")."""
    return input_kind in ("tokens", "features")


def items_per_sequence(input_kind: str, seq_len: int) -> int:
    """What throughput counts per sequence of the input: its seq_len positions, or one sample (counts_positions)."""
    return seq_len if counts_positions(input_kind) else 1


@record
class InputSpec(Record):
    """One micro-batch of model input (shape of the first positional input)."""

    kind: str  # "tokens" (integer ids) | "features" (float, a sequence axis) | "custom" (no sequence axis)
    shape: tuple[int, ...]
    dtype: str
    vocab_size: int | None = None


@record
class TPUnit(Record):
    """What tensor parallelism needs of one unit, measured on its module tree at tp = 1 (one micro-batch of the
    profile, its dtype) against the model's TP plan (cost_models.records.tensor_parallel.rules_for(plan,
    vocab_split=True): the vocabulary-split parts are kept apart because whether they split depends on tp,
    vocab_divides).

    Roles of the bytes saved for backward (Korthikanti et al. 2022, section 4.1, whose per-layer terms they are;
    each saved storage is given to the innermost running module with a TP style):
        saved_split      inside the split region (rowwise inputs, what attention and the MLP keep between their
                         split linears): divided by tp (the "24/t" term)
        saved_seq        norms and the places on the residual stream (dropout after a rowwise linear): divided by
                         tp only under sequence parallelism (the "10" term's norm and dropout parts)
        saved_col_input  inputs of column-split linears and of a vocabulary-split head: whole without SP (the
                         "10" term's linear inputs); under SP torch's DTensor keeps the all-gathered input, so they
                         stay whole there too (Megatron keeps the sequence shard and gathers again in backward)
        saved_core       the attention core (softmax, scores, dropout over them; what SDPA keeps beyond q, k, v):
                         divided by tp, dropped by selective recompute (the "5as/h" term)
        saved_logits     what the loss keeps after a vocabulary-split head (its log-probabilities): divided by tp
                         where the vocabulary splits (loss parallelism keeps the logits split)
    Whatever else the unit saves (the loss's logits, an embedding's indices, a replicated head) stays whole.
    TP collective buffers (full buffers, bytes of one micro-batch; calls = modules run):
        row_*            outputs of rowwise linears (all-reduced; reduce-scattered under SP)
        region_*         inputs of regions that hold split linears (their gradient all-reduced once without SP;
                         under SP all-gathered once, the gradient reduce-scattered once)
        repl_region_*    inputs of regions with replicated weights only (a tied head): all-gathered under SP
        entry_*          outputs of sp_entry modules (sliced to the sequence shard under SP: gradient all-gathered)
        embed_*          outputs of a vocabulary-split embedding (all-reduced / reduce-scattered when it splits)
        whole_embed_*    the same, in a plan that enters the sequence split later (an sp_input): all-reduced when it
                         splits, with or without SP
        input_*          inputs of sp_input modules (sliced to the sequence shard under SP: gradient all-gathered)
        head_in_bytes, logit_bytes, head_calls   a vocabulary-split head's input and its logits (gathered)
    comm.tp_unit_traffic turns these into collectives per style, as executor/tensor_parallel.py places them.
    """

    param_split: tuple[int, ...] = ()    # per parameter tensor (UnitProfile.param_numels' order): 0 whole,
                                         # 1 split by tp, 2 split when the vocabulary splits
    split_params: int = 0                # parameters with param_split 1
    vocab_params: int = 0                # parameters with param_split 2
    norm_params: int = 0                 # parameters of norm-style modules: replicated, and under SP their
    norm_tensors: int = 0                # gradients are all-reduced over tp every backward (partial sums over
                                         # the sequence shards; Korthikanti et al. 2022, section 4.2.2)
    head_norm_params: int = 0            # parameters of head_norm modules (per-head q/k norms): replicated, their
    head_norm_tensors: int = 0           # gradients all-reduced over tp every backward, SP or not
    split_flops: int = 0                 # forward FLOPs inside split linears and regions that hold them
    vocab_flops: int = 0                 # forward FLOPs inside a vocabulary-split head
    core_flops: int = 0                  # forward FLOPs of the attention core (SDPA)
    core_kv_bytes: int = 0               # bytes of the keys and values the attention core reads (SDPA's k and v):
                                         # what context parallelism all-gathers per micro-batch (cost.context_parallel)
    saved_split: int = 0
    saved_seq: int = 0
    saved_col_input: int = 0
    saved_core: int = 0
    saved_logits: int = 0                # 0 in older files (kept whole)
    row_bytes: int = 0
    row_calls: int = 0
    region_bytes: int = 0
    region_calls: int = 0
    repl_region_bytes: int = 0
    repl_region_calls: int = 0
    entry_bytes: int = 0
    entry_calls: int = 0
    embed_bytes: int = 0
    embed_calls: int = 0
    whole_embed_bytes: int = 0
    whole_embed_calls: int = 0
    input_bytes: int = 0
    input_calls: int = 0
    head_in_bytes: int = 0
    logit_bytes: int = 0
    head_calls: int = 0


@record
class MoEUnit(Record):
    """The mixture-of-experts blocks of one unit (cost_models.profiling.moe finds them: a module with a `gate`
    router and an `experts` module holding `num_experts` routed experts, called as experts(hidden, top_k_index,
    top_k_weights), as transformers' Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3 and the zoo's MoE are built).
    The unit's fwd_flops, bwd_flops and saved_bytes hold the blocks as executed (top-k routed tokens); these
    fields say which part of them the routed experts are, which expert parallelism moves and shards."""

    blocks: int                          # MoE blocks in the unit
    experts: int                         # routed experts per block
    top_k: int                           # routed experts per token
    hidden: int                          # the width of what is dispatched to the experts (one token's hidden state)
    expert_params: int                   # every routed expert of every block (of the unit's params)
    expert_tensors: int                  # their parameter tensors
    router_params: int = 0               # the routers' (replicated, as dense parameters)
    shared_expert_params: int = 0        # shared experts' (every token runs them: dense)
    tokens: int                          # tokens per micro-batch at the profile's micro-batch (each block's input)
    routed_fwd_flops: int                # the routed experts' forward FLOPs, every block, tokens x top_k pairs
    routed_bwd_flops: int                # and their backward (input and weight gradients)
    routed_saved_bytes: int = 0          # what the routed experts save for backward (of saved_bytes)
    routed_unweighted_bytes: int = -1    # and called as expert parallelism calls them, with routing weights of one
                                         # that need no gradient (profiling.moe._Watch); -1 in older profiles
    expert_load: tuple[int, ...] = ()    # real mode: token-expert pairs routed to each expert on the profile's
                                         # tokens, summed over the unit's blocks (one in every family here: a
                                         # unit of several would smooth it); () in meta mode (not measured). A
                                         # router as initialised spreads random tokens evenly: optimistic for a
                                         # trained one (planner profile --init-from --data measures a trained one's)
    window_load: tuple[tuple[int, ...], ...] = ()   # with --init-from --data: expert_load per routed window (one
                                         # sequence), in the file's order, which cost.moe deals into micro-batches


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
    tp: TPUnit | None = None             # what tensor parallelism splits here; None in older files (nothing splits)
    split_kept_bytes: int = 0            # of saved_bytes, what torch's split backward (I, then W) frees only with the
                                         # graph (profiling.split_backward); 0 in older files
    split_after_bytes: int = 0           # the same when the unit before it is in its stage (the pair, measured)
    split_suffix_bytes: int | None = None  # what a last stage starting here keeps per micro-batch (to the loss);
                                         # None: not measured (units that do not chain), summed per unit instead
    saved_fixed_bytes: int = 0           # of saved_bytes, what does not grow with the batch (position ids, masks):
                                         # from a second count on one sample (memory.saved_at); 0 in older files
    saved_other_dtype_bytes: int = 0     # of saved_bytes, storages in another dtype than the profile's (token ids,
                                         # masks, a bf16 model's fp32 statistics): a plan in another compute dtype
                                         # does not rescale them (memory.saved_at); 0 in older files
    saved_other_fixed_bytes: int = 0     # of saved_other_dtype_bytes, what does not grow with the batch
    transient_bytes: int = 0             # GPU real mode: the peak the unit's forward + backward allocates beyond what
                                         # it saves, outputs and leaves as gradients (an LM head's float logits and
                                         # their gradient); 0 on CPU (no allocator statistics), meta and older files
    fwd_work: WorkCounts | None = None   # the forward's work by kind (records.work); None in older files
    bwd_work: WorkCounts | None = None   # the backward's (incl. the input gradient); None in older files
    moe: MoEUnit | None = None           # its mixture-of-experts blocks; None for a dense unit and in older files


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
    pipelining: str = ""                 # cost_models.models.pipelining: "chain" | "hf-decoder" | "traced" |
                                         # "no: <why>"; "" in files written before it was recorded (pipelines
                                         # offered as before)
    tensor_parallel: TPShape | None = None  # cost_models.records.tensor_parallel: the model's TP plan and
                                         # dimensions; None in files written before it was recorded (no TP
                                         # offered: re-profile)
    # real mode: the whole model's forward + loss + backward timed end to end (median), over the sum of its units'
    # medians. Units are timed alone, each repeated on its own input, so their weights and activations sit in
    # cache; inside the model the units before evict them (measured by benchmarks/compute_gap.py:
    # benchmarks/results/compute_gap.json; measurements.md, "Profile load and in-model factor").
    # compute.unit_times scales measured times by it; 1.0 in meta
    # profiles and in files written before it was recorded.
    in_model_factor: float = 1.0
    # real mode on a GPU in bf16: the whole model with fp32 parameters under torch.autocast (torch's mixed precision,
    # as the executor runs bf16-mixed: memory.torch_mixed) timed end to end, over the same in plain bf16 (its casts
    # of the weights, fp32 norms, softmax and loss). compute.unit_times scales by it where the plan runs through
    # autocast (ZeRO-0/1 or one data-parallel rank; FSDP2's casting runs plain bf16); 1.0 elsewhere and in files
    # written before it was recorded.
    mixed_factor: float = 1.0
    device: str                          # where real mode ran: "cpu" | "gpu" (a cluster's device kinds) | "meta"
    device_name: str = ""                # a GPU profile's torch.cuda.get_device_name(); "" on CPU and in older files
    threads: int
    torch_version: str
    command: str
    created_at: str
    # real mode: the machine's 1-minute load average (os.getloadavg) before and after the timed runs, and its CPUs.
    # Every predicted step scales with the unit times: timed by the wall clock, they include waiting for a core
    # where the load passed the CPUs (a profile timed under such load overpredicted compute by a third and more:
    # benchmarks/results/measurements.md, "Profile load and in-model factor"). () and 0 in meta profiles and files
    # written before it was recorded.
    load_1min: tuple[float, ...] = ()
    cpus: int = 0
    # real mode: the clock that timed the units and the optimizer (torch_compat.host.work_clock): "thread-cpu" (the
    # timing thread's CPU time, which leaves out waiting for a core: one thread on CPU) or "wall"; "" in meta
    # profiles and files written before it was recorded (wall)
    clock: str = ""
    # real mode on Linux: other programs' tasks runnable beside the profiler (torch_compat.host.background_runnable)
    # before and after the timed runs. The 1-minute load average lags a load that just started by a minute; this
    # count does not (proc(5), /proc/loadavg). () in meta profiles, off Linux and in files written before it was
    # recorded.
    runnable_beside: tuple[float, ...] = ()
    # real mode: what the profiler did about noise it saw (timing.pool_identical: identical units timed far apart,
    # timed again interleaved and pooled), one line each; () when nothing was needed, in meta mode and older files
    timing_notes: tuple[str, ...] = ()
    # the sequence length the units were measured at, where cost.lengths.at_seq_len has seen the profile at seq_len
    # (`planner plan --seq-len`); 0: seq_len is the measured one
    profiled_seq_len: int = 0
    # real mode: each optimizer's step timed on this device (OptimizerTiming); compute.optimizer_step_time
    # prices a rank's update from it. The bandwidth formula it replaces (28 B per parameter at the probe's copy
    # bandwidth) underpriced the measured optimizer step in every fidelity configuration
    # (benchmarks/results/measurements.md, "Optimizer step timing"): torch 2.13's foreach AdamW makes eight passes
    # (decay, lerp, two for the second moment, a sqrt into a new buffer, div, add, addcdiv), several over two or
    # three tensors, and allocates that buffer every step. () in meta profiles and files written before it was
    # recorded (the formula stays).
    optimizer_timings: tuple[OptimizerTiming, ...] = ()
    # the load imbalance the estimate prices expert parallelism at (the busiest expert-parallel rank's routed tokens
    # over the mean, cost_models.cost.moe.imbalance); 0: from the units' measured expert_load, or the stated
    # default where none was measured. `--moe-imbalance` sets it.
    moe_imbalance: float = 0.0
    # where the MoE units' expert_load was measured: "" for the profile's own synthetic tokens (or none, in meta
    # mode); `planner profile --init-from --data` routes the user's tokens through the user's weights and says so
    routing: str = ""

    @property
    def moe_units(self) -> tuple[UnitProfile, ...]:
        return tuple(u for u in self.units if u.moe is not None)

    @property
    def experts(self) -> int:
        """Routed experts per MoE block (0 for a dense model)."""
        return max((u.moe.experts for u in self.units if u.moe is not None), default=0)

    def optimizer_timing(self, optimizer: str) -> OptimizerTiming | None:
        return next((t for t in self.optimizer_timings if t.optimizer == optimizer), None)

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


