"""A parallel training strategy as plain data: what the planner searches over and the executor runs."""
from __future__ import annotations

from typing import Literal

from cost_models.errors import ConfigError
from cost_models.limits import check_global_batch, check_gpus, check_microbatches
from cost_models.records import Record, record
from cost_models.schedule import SCHEDULES, check_schedule

Precision = Literal["fp32", "bf16-mixed"]
Optimizer = Literal["adamw", "adam", "sgd"]


@record
class Strategy(Record):
    dp: int                              # data-parallel degree (the ZeRO group)
    pp: int                              # pipeline degree (ranks per pipeline)
    zero: int                            # ZeRO stage over dp: 0 (DDP), 1, 2, 3
    schedule: str                        # see cost_models.schedule.SCHEDULES
    microbatches: int                    # m: micro-batches per step per pipeline
    micro_batch_size: int                # sequences per micro-batch
    v: int = 1                           # stage chunks per rank (interleaved schedules)
    stages: tuple[tuple[str, ...], ...]  # stage -> unit names, pp * v stages in pipeline order
    recompute: tuple[bool, ...] = ()     # per stage: full activation recompute (empty: none)
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"

    @property
    def family(self) -> str:
        """'zero' (no pipeline), 'pipeline' (no data parallelism) or 'hybrid': the ZeRO-or-pipeline question's terms."""
        return "zero" if self.pp == 1 else ("pipeline" if self.dp == 1 else "hybrid")

    @property
    def name(self) -> str:
        """Short label for tables: 'ZeRO-3 dp=8, 4x2' or 'PP4 1f1b x DP2 ZeRO-1, 16x1 +recompute 2/4' (m x mbs)."""
        shape = (f"ZeRO-{self.zero} dp={self.dp}" if self.pp == 1 else
                 f"PP{self.pp} {self.schedule}" + (f" v={self.v}" if self.v > 1 else "")
                 + (f" x DP{self.dp} ZeRO-{self.zero}" if self.dp > 1 else ""))
        rec = sum(self.recompute) if self.recompute else 0
        return f"{shape}, {self.microbatches}x{self.micro_batch_size}" + (f" +recompute {rec}/{self.n_stages}" if rec else "")

    @property
    def summary(self) -> str:
        """The same strategy in words, for rationales and run records: '4-stage 1f1b x 2-way ZeRO-1, 8 micro-batch(es) of 2'."""
        if self.pp == 1:
            shape = f"ZeRO-{self.zero} over {self.dp} ranks" if self.dp > 1 else "one device"
        else:
            shape = f"{self.pp}-stage {self.schedule}" + (f" (v={self.v})" if self.v > 1 else "")
            shape += f" x {self.dp}-way ZeRO-{self.zero}" if self.dp > 1 else ""
        rec = sum(self.recompute) if self.recompute else 0
        recompute = "" if not rec else (", full recompute" if rec == self.n_stages
                                        else f", recompute on {rec} of {self.n_stages} stages")
        return shape + f", {self.microbatches} micro-batch(es) of {self.micro_batch_size}" + recompute

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.microbatches * self.micro_batch_size

    def stage_recompute(self, stage: int) -> bool:
        return bool(self.recompute) and self.recompute[stage]

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks holding `stage`: mesh (pp, dp) with dp innermost, so a dp group is contiguous ranks."""
        pp_rank = stage % self.pp
        return tuple(pp_rank * self.dp + d for d in range(self.dp))

    def validate(self, unit_names: tuple[str, ...]) -> None:
        """Raise ConfigError (one line, what to change) unless this strategy can run on a model with these units."""
        for name, value in (("dp", self.dp), ("pp", self.pp), ("microbatches", self.microbatches),
                            ("micro_batch_size", self.micro_batch_size), ("v", self.v)):
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        # caps that keep the estimate's work bounded (cost_models/limits.py); a plan file can hold any number
        check_gpus(self.world_size, "dp x pp =")
        check_microbatches(self.microbatches, "microbatches")
        check_global_batch(self.global_batch_size, "dp x microbatches x micro_batch_size =")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule '{self.schedule}'; choose one of {', '.join(SCHEDULES)}")
        if self.zero > 0 and self.dp == 1:
            raise ConfigError(f"ZeRO-{self.zero} shards over data parallel ranks; with --dp 1 use --zero 0")
        if self.pp > 1 or self.v > 1:
            check_schedule(self.schedule, self.pp, self.microbatches, self.v)
        if len(self.stages) != self.n_stages:
            raise ConfigError(f"{len(self.stages)} stages given for pp={self.pp} x v={self.v} = {self.n_stages}")
        flat = tuple(u for stage in self.stages for u in stage)
        if flat != unit_names:
            raise ConfigError("stages must cover the model's units in order, each exactly once")
        if any(not stage for stage in self.stages):
            raise ConfigError(f"a stage has no units: the model's {len(unit_names)} units cannot fill {self.n_stages} stages")
        if self.recompute and len(self.recompute) != self.n_stages:
            raise ConfigError(f"recompute has {len(self.recompute)} entries for {self.n_stages} stages")
