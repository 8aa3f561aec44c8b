"""A parallel training strategy as plain data: what the planner searches over and the executor runs."""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from cost_models.records.base import Record, record
from cost_models.records.errors import ConfigError
from cost_models.records.limits import check_global_batch, check_gpus, check_microbatches
from cost_models.records.precision import Optimizer, Precision, check_training
from cost_models.records.schedule import DEFAULT_SCHEDULE, Action, ScheduleSpec, cached_order, get_spec


def family_of(*, dp: int, pp: int, tp: int = 1) -> str:
    """'zero' (no pipeline), 'pipeline' (no data parallelism) or 'hybrid': the ZeRO-or-pipeline question's terms;
    with tensor parallelism '+tp' is added ('tensor' alone when it is the only split)."""
    base = "zero" if pp == 1 else ("pipeline" if dp == 1 else "hybrid")
    if tp == 1:
        return base
    return "tensor" if dp == 1 and pp == 1 else base + "+tp"


@record
class Strategy(Record):
    dp: int                              # data-parallel degree (the ZeRO group)
    pp: int                              # pipeline degree (ranks per pipeline)
    zero: int                            # ZeRO stage over dp: 0 (DDP), 1, 2, 3
    schedule: str                        # a name in cost_models.records.schedule.SCHEDULES
    microbatches: int                    # m: micro-batches per step per pipeline
    micro_batch_size: int                # sequences per micro-batch
    v: int = 1                           # stage chunks per rank (interleaved schedules)
    stages: tuple[tuple[str, ...], ...]  # stage -> unit names, pp * v stages in pipeline order
    recompute: tuple[bool, ...] = ()     # per stage: full activation recompute (empty: none)
    tp: int = 1                          # tensor-parallel degree (Megatron column/row splits; mesh (pp, dp, tp))
    sp: bool = False                     # sequence parallelism over the tp group (Korthikanti et al. 2022)
    selective: bool = False              # selective recompute: the attention core of stages not fully recomputed
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    distributed_optimizer: bool = False  # ZeRO-1 as Megatron-LM's distributed optimizer (zero_label)
    async_tp: bool = False               # SP's collectives fused with their matmuls (tp_label), CUDA GPUs only
    sp_save_shard: bool = False          # SP's gathered inputs saved as their shard, gathered again (tp_label)
    ep: int = 1                          # expert parallelism: routed experts split over groups of ep dp ranks
                                         # (cost_models.cost.moe); the world size is unchanged
    cp: int = 1                          # context parallelism: each sequence split over cp ranks (data_view)

    @property
    def zero_label(self) -> str:
        """'ZeRO-1', or 'ZeRO-1 dist-opt': ZeRO-1 run as Megatron-LM's distributed optimizer with
        --overlap-param-gather and --overlap-grad-reduce (executor.zero): FSDP2 gathers each unit's parameters
        ahead of the step's first forward and keeps them, gradients accumulate whole and are reduce-scattered in
        fp32 during the last micro-batch's backward; the optimizer updates fp32 shards."""
        return f"ZeRO-{self.zero}" + (" dist-opt" if self.distributed_optimizer else "")

    @property
    def gathers_per_unit(self) -> bool:
        """Whether FSDP2 holds the parameters (ZeRO-2/3, or the distributed optimizer) over dp > 1."""
        return self.dp > 1 and (self.zero >= 2 or self.distributed_optimizer)

    @property
    def family(self) -> str:
        return family_of(dp=self.dp, pp=self.pp, tp=self.tp)

    @property
    def tp_label(self) -> str:
        """'TP2', 'TP2+SP', 'TP2+SP+async' or '' (no tensor parallelism). Async TP: torch's micro-pipelined
        tensor parallelism (torch._inductor's _micro_pipeline_tp over symmetric memory, executor.tensor_parallel)
        cuts each all-gather -> matmul and matmul -> reduce-scatter of sequence parallelism into tp steps, each
        transfer overlapping a partial matmul (Wang et al. 2023, "Overlap Communication with Dependent Computation
        via Decomposition in Large Deep Learning Models", ASPLOS; Megatron-LM's --tp-comm-overlap does the same).
        '+shard': SP saves each gathered input as its sequence shard and gathers it again in backward (Korthikanti
        et al. 2022, section 4.2.2, as Megatron-LM runs it; executor.sp_shard)."""
        if self.tp == 1:
            return ""
        return (f"TP{self.tp}" + ("+SP" if self.sp else "") + ("+shard" if self.sp_save_shard else "")
                + ("+async" if self.async_tp else ""))

    @property
    def name(self) -> str:
        """Short label for tables: 'ZeRO-3 dp=8, 4x2', 'TP2+SP x ZeRO-1 dp=4, 4x2' or
        'PP4 1f1b x DP2 ZeRO-1, 16x1 +recompute 2/4' (m x mbs)."""
        if self.pp == 1:
            shape = (f"{self.tp_label} x " if self.tp > 1 and self.dp * self.cp > 1 else self.tp_label if self.tp > 1
                     else "")
            shape += f"{self.zero_label} dp={self.dp}" if self.dp * self.cp > 1 or self.tp == 1 else ""
        else:
            shape = (f"PP{self.pp} {self.schedule}" + (f" v={self.v}" if self.v > 1 else "")
                     + (f" x {self.tp_label}" if self.tp > 1 else "")
                     + (f" x DP{self.dp} {self.zero_label}" if self.dp * self.cp > 1 else ""))
        shape += f" EP{self.ep}" if self.ep > 1 else ""
        shape += f" CP{self.cp}" if self.cp > 1 else ""
        rec = sum(self.recompute) if self.recompute else 0
        return (f"{shape}, {self.microbatches}x{self.micro_batch_size}" + (f" +recompute {rec}/{self.n_stages}" if rec else "")
                + (" +selective" if self.selective and rec < self.n_stages else ""))

    @property
    def summary(self) -> str:
        """The same strategy in words, for rationales and run records: '4-stage 1f1b x 2-way ZeRO-1, 8 micro-batch(es) of 2'."""
        tensor = "" if self.tp == 1 else f"{self.tp}-way tensor parallel" + (
            (" with sequence parallelism" + (" saving shards" if self.sp_save_shard else "")) if self.sp else "")
        if self.pp == 1:
            # ZeRO shards over the dp x cp ranks (data_view)
            ranks = self.dp * self.cp
            shape = (f"{self.zero_label} over {ranks} ranks" if ranks > 1 else "") or tensor or "one device"
            shape = f"{tensor} x {shape}" if tensor and ranks > 1 else shape
        else:
            shape = f"{self.pp}-stage {self.schedule}" + (f" (v={self.v})" if self.v > 1 else "")
            shape += f" x {tensor}" if tensor else ""
            shape += f" x {self.dp * self.cp}-way ZeRO-{self.zero}" if self.dp * self.cp > 1 else ""
        shape += f", experts split {self.ep} ways" if self.ep > 1 else ""
        shape += f", each sequence split {self.cp} ways (context parallel)" if self.cp > 1 else ""
        rec = sum(self.recompute) if self.recompute else 0
        recompute = "" if not rec else (", full recompute" if rec == self.n_stages
                                        else f", recompute on {rec} of {self.n_stages} stages")
        if self.selective and rec < self.n_stages:
            recompute += ", selective recompute (attention core)"
        return shape + f", {self.microbatches} micro-batch(es) of {self.micro_batch_size}" + recompute

    @property
    def ranks_per_stage(self) -> int:
        """dp x cp x tp: the ranks holding each stage, hence the pipelines running at once and the stride between
        pipeline ranks' first global ranks on the (pp, dp, tp) mesh (cp inside dp: data_view)."""
        return self.dp * self.cp * self.tp

    def data_view(self) -> "Strategy":
        """Context parallelism as the rest of the product sees it: dp x cp data-parallel ranks, each running a
        micro-batch of micro_batch_size sequences of seq_len / cp tokens (torchtitan's layout: parameters sharded
        and gradients averaged over dp x cp; a CP group is cp consecutive of those ranks, holding the same
        sequences). Only attention differs, where the CP group's keys and values meet (executor.context_parallel,
        cost.context_parallel). The strategy itself without context parallelism."""
        if self.cp == 1:
            return self
        return dataclasses.replace(self, dp=self.dp * self.cp, cp=1)

    @property
    def world_size(self) -> int:
        return self.ranks_per_stage * self.pp

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.microbatches * self.micro_batch_size

    def without_tp(self) -> "Strategy":
        """The same strategy with no tensor parallelism (its TP-only switches off): fewer devices, for comparisons."""
        return dataclasses.replace(self, tp=1, sp=False, async_tp=False, sp_save_shard=False)

    def stage_recompute(self, stage: int) -> bool:
        return bool(self.recompute) and self.recompute[stage]

    @property
    def spec(self) -> ScheduleSpec:
        return get_spec(self.schedule)

    @property
    def simulated_schedule(self) -> str:
        """The schedule the estimate simulates: one stage (pp = v = 1) is plain gradient accumulation, whatever the
        plan names, and simulates as the default's order."""
        return self.schedule if self.n_stages > 1 else DEFAULT_SCHEDULE

    def action_order(self) -> Mapping[int, Sequence[Action]]:
        """Every pipeline rank's compute actions in order (the shared cached copy: read it, do not modify it)."""
        return cached_order(self.simulated_schedule, self.pp, self.microbatches, self.v)

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank running `stage` (the schedule's placement: looped or V)."""
        return self.spec.stage_rank(stage, self.pp)

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank `pp_rank` holds, ascending."""
        return self.spec.rank_stages(pp_rank, self.pp, self.v)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks holding `stage`: mesh (pp, dp, tp) with tp innermost (torchtitan's order), so a tp group is
        adjacent ranks inside a node and, without tp, a dp group is contiguous ranks."""
        pp_rank = self.stage_rank(stage)
        per_stage = self.ranks_per_stage
        return tuple(pp_rank * per_stage + i for i in range(per_stage))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank on the (pp, dp, tp) mesh (dp: data_view's dp x cp)."""
        dp = self.dp * self.cp
        return rank // self.ranks_per_stage, rank // self.tp % dp, rank % self.tp

    def rank_at(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """The global rank at these mesh coordinates (coords' inverse)."""
        return (pp_rank * self.dp * self.cp + dp_rank) * self.tp + tp_rank

    def split_tie(self, tied_units: Iterable[Sequence[str]]) -> str | None:
        """Why this schedule cannot run a parameter shared by units in two stages on one pipeline rank, or None.
        tied_units: for each tied parameter, the units using it (ModelProfile.shared[i].units)."""
        why = self.spec.same_rank_tie if self.n_stages > 1 else None
        if not why:
            return None
        stage_of = {u: sid for sid, units in enumerate(self.stages) for u in units}
        for units in tied_units:
            sids = sorted({stage_of[u] for u in units if u in stage_of})
            ranks = [self.stage_rank(sid) for sid in sids]
            if len(set(ranks)) < len(ranks):
                return f"{self.schedule} puts stages {sids}, which share a tied parameter, on one rank: {why}"
        return None

    def unsafe_reason(self) -> str | None:
        """Why the executor cannot run this strategy correctly, or None: the schedule registry's guard for this ZeRO
        stage, and async TP's compiled units with saved SP shards (their saved-tensor hooks would see the compiled
        graph's plain tensors, not the gathered DTensor: unchecked, so not run)."""
        if self.async_tp and self.sp_save_shard:
            return ("--async-tp with --sp-save-shard is priced but not run: saving shards inside async TP's compiled "
                    "units is unchecked; drop one of them")
        return self.spec.unsafe(self.zero, self.dp) if self.n_stages > 1 else None

    def __post_init__(self) -> None:
        """A strategy checks its own shape when it is made (from flags, a plan file or the search): one-line
        ConfigErrors that say what to change. Whether it covers a model's units is `validate`."""
        for name, value in (("dp", self.dp), ("pp", self.pp), ("tp", self.tp), ("microbatches", self.microbatches),
                            ("micro_batch_size", self.micro_batch_size), ("v", self.v), ("ep", self.ep),
                            ("cp", self.cp)):
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        # caps that keep the estimate's work bounded (cost_models/records/limits.py); a plan file can hold any number
        check_gpus(self.world_size, "dp x cp x tp x pp =" if self.cp > 1 else "dp x tp x pp =")
        check_microbatches(self.microbatches, "microbatches")
        check_global_batch(self.global_batch_size, "dp x microbatches x micro_batch_size =")
        check_training(self.precision, self.optimizer)
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        spec = get_spec(self.schedule)   # an unknown name is a one-line ConfigError
        if self.zero > 0 and self.dp * self.cp == 1:
            raise ConfigError(f"ZeRO-{self.zero} shards over data parallel ranks; with --dp 1 use --zero 0")
        check_cp_degree(self.cp)
        if self.cp > 1 and self.ep > 1:
            raise ConfigError("context parallelism with expert parallelism is not built yet; plan one of --cp and "
                              "--ep")
        if self.pp > 1 or self.v > 1:
            spec.check(self.pp, self.microbatches, self.v)
        if len(self.stages) != self.n_stages:
            raise ConfigError(f"{len(self.stages)} stages given for pp={self.pp} x v={self.v} = {self.n_stages}")
        if self.recompute and len(self.recompute) != self.n_stages:
            raise ConfigError(f"recompute has {len(self.recompute)} entries for {self.n_stages} stages")
        check_tp_degree(self.tp, self.sp)
        if self.async_tp and not self.sp:
            raise ConfigError("--async-tp overlaps sequence parallelism's all-gathers and reduce-scatters with their "
                              "matmuls; it needs --sp (and --tp 2 or more)")
        if self.sp_save_shard and not self.sp:
            raise ConfigError("--sp-save-shard saves sequence parallelism's gathered inputs as their shard; it needs "
                              "--sp (and --tp 2 or more)")
        if self.sp_save_shard and spec.split_backward:
            raise ConfigError(f"--sp-save-shard with {self.schedule}, whose backward runs twice over a retained graph "
                              f"(input, then weight gradients), would gather each input twice; choose another "
                              f"schedule or drop --sp-save-shard")
        if self.dp % self.ep:
            raise ConfigError(f"--ep {self.ep} must divide --dp {self.dp}: expert-parallel ranks are data-parallel "
                              f"ranks holding different experts")
        if self.distributed_optimizer and (self.zero != 1 or self.pp > 1):
            raise ConfigError("--distributed-optimizer runs ZeRO-1 without a pipeline (--zero 1 --pp 1); a pipeline's "
                              "ZeRO-2 stages already gather once and reduce-scatter once per step")

    def validate(self, unit_names: tuple[str, ...]) -> None:
        """Raise ConfigError (one line, what to change) unless the stages cover a model with these units."""
        flat = tuple(u for stage in self.stages for u in stage)
        if flat != unit_names:
            raise ConfigError("stages must cover the model's units in order, each exactly once")
        if any(not stage for stage in self.stages):
            raise ConfigError(f"a stage has no units: the model's {len(unit_names)} units cannot fill {self.n_stages} stages")


def priced_digest(s: Strategy, *, model: str, source: str, seq_len: int, units: Sequence[str]) -> str:
    """sha256 (hex, 16 digits) of what an estimate priced: the strategy's every field and the model's identity and
    sequence length. A plan keeps it in its prediction (Estimate.priced); a plan edited after it was estimated
    (another optimizer, precision, model or layout) no longer matches and is refused before any rank starts."""
    import hashlib
    import json
    # fields at their default are left out: a field added later (at its default) leaves older plans' digests as
    # they were
    defaults = {f.name: f.default for f in dataclasses.fields(Strategy) if f.default is not dataclasses.MISSING}
    fields = {k: v for k, v in s.to_dict().items() if k not in defaults or getattr(s, k) != defaults[k]}
    text = json.dumps({"strategy": fields, "model": [model, source, seq_len, list(units)]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_cp_degree(cp: int) -> None:
    """The context-parallel degree alone: a power of two (each sequence is cut into 2 x cp chunks)."""
    if cp < 1 or cp & (cp - 1):
        raise ConfigError(f"--cp must be a power of two (it splits each sequence into 2 x cp chunks), got {cp}")


def check_tp_degree(tp: int, sp: bool) -> None:
    """The tensor-parallel degree alone: a power of two (the mesh's groups tile a node's devices), and sequence
    parallelism only over a group of two or more."""
    if tp < 1 or tp & (tp - 1):
        raise ConfigError(f"--tp must be a power of two, got {tp}")
    if sp and tp == 1:
        raise ConfigError("--sp splits the sequence over the tensor-parallel group; it needs --tp 2 or more")


def tp_node_refusal(tp: int, devices_per_node: int) -> str | None:
    """Why `tp` ranks cannot form a group inside one node (mesh (pp, dp, tp), tp innermost), or None."""
    if devices_per_node % tp:
        return (f"--tp {tp} does not divide the {devices_per_node} devices per node: a tensor-parallel group must "
                "stay inside one node")
    return None
