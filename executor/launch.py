"""`planner run`: start the plan's ranks with torchrun's own machinery, gather what they measured, compare it with
the plan's prediction, and write run.json.

Local runs use torch.distributed.launcher.elastic_launch on file stores (cost_models.torch_compat.elastic.elastic_job:
nothing listens on a network port); --nnodes / --node-rank / --rdzv-endpoint use a c10d TCP rendezvous. max_restarts=0:
a rank that raises makes the agent stop every other rank, and the error comes back as one line naming the rank.
Collectives time out after `timeout_s` (init_process_group's timeout), so a hung peer cannot hang the job.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from cost_models.models.losses import scalar_loss, takes_targets
from cost_models.models.pipelining import pipeline_support
from cost_models.models.source import DTYPES, load_attr, meta_forward_context, resolve
from cost_models.records.base import Record, record
from cost_models.records.errors import ConfigError, PlannerError
from cost_models.records.fileio import write_atomic
from cost_models.records.formatting import fixed, now_utc
from cost_models.records.strategy import Strategy
from cost_models.torch_compat.devices import claim_device, rank_backend
from cost_models.torch_compat.elastic import (elastic_job, import_in_ranks, init_process_group, is_consequence,
                                             root_failure)
from executor import context_parallel
from executor import checkpoint_layout as layout
from executor import trust
from executor.data import TokenFile, data_identity
from executor.runtime import example_logits
from executor.stages import UnitMap, check_covers_model
from executor.train import TrainConfig, fail_at_start_up, run_on_rank, summarize_times
from executor.weights import check_weights
from planner.plan import Plan, check_plan
from planner.run_record import Measure, RankResult, RunFile


class RunFailed(PlannerError):
    """A rank failed during `planner run`; the message names it, `rank_traceback` holds the failing rank's own
    traceback where it left one (the CLI prints it under ZEROPIPE_DEBUG=1)."""

    exit_code = 1
    rank_traceback: str = ""


def _note_failure(failure_dir: str, exc: BaseException) -> None:
    """The agent may see a peer's "connection reset" before this rank's own error: leave the evidence where the
    launcher looks, with a precise time, before dying."""
    import traceback
    rank = int(os.environ.get("RANK", -1))
    line = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    # Atomic: the agent may kill this rank mid-write once a peer has died, and the launcher must never read half a note
    write_atomic(os.path.join(failure_dir, f"rank{rank}.txt"),
                 f"{time.time()}\n{line}\n{''.join(traceback.format_exception(exc))}", overwrite=True)


import_in_ranks(__name__)   # the ranks' entry points (worker, _many_worker) live here

CONSEQUENCE_GRACE_S = 2.0   # how long a rank that failed because a peer did waits before exiting
HEARTBEAT_S = 0.5   # how often a rank shows it is alive; a stopped rank's last sign then dates from when it stopped


def _heartbeat(failure_dir: str) -> None:
    """Touch alive-rank<R> every HEARTBEAT_S from a daemon thread. A rank that is stopped (SIGSTOP), frozen or
    swapped out stops touching it, while its peers, blocked in a collective waiting for it, go on: that is what
    tells the hung rank from the ranks that time out waiting for it (_root_cause)."""
    path = os.path.join(failure_dir, f"alive-rank{os.environ.get('RANK', -1)}")

    def beat() -> None:
        while True:
            with open(path, "w"):
                pass
            time.sleep(HEARTBEAT_S)
    threading.Thread(target=beat, name="zeropipe-heartbeat", daemon=True).start()


def _guarded(failure_dir: str, fn, *args):
    """Run a rank's work with a heartbeat, noting an exception where the launcher looks before re-raising it."""
    _heartbeat(failure_dir)
    try:
        return fn(*args)
    except BaseException as exc:
        _note_failure(failure_dir, exc)
        if is_consequence(f"{exc}"):
            # another rank's end seen first (a closed connection): give the agent, which records only the first
            # exit it sees, time to see that rank's before this one's (_root_cause names the cause from it)
            time.sleep(CONSEQUENCE_GRACE_S)
        raise


def worker(plan_data: dict, cfg_data: dict, timeout_s: float, failure_dir: str) -> list[dict] | None:
    """Entry point of every rank (env:// rendezvous set up by the elastic agent)."""
    return _guarded(failure_dir, _work, plan_data, cfg_data, timeout_s)


def _noted_ranks(failure_dir: str) -> set[int]:
    return {int(name[4:-4]) for name in os.listdir(failure_dir) if name.startswith("rank") and name.endswith(".txt")}


def _last_sign_of_life(failure_dir: str, rank: int) -> float:
    path = os.path.join(failure_dir, f"alive-rank{rank}")
    return os.path.getmtime(path) if os.path.exists(path) else 0.0


def _failure_from_files(failure_dir: str) -> tuple[int, str] | None:
    """The root cause among the ranks' own failure notes: a rank that raised on its own, earliest first."""
    notes = []
    for name in os.listdir(failure_dir):
        if name.startswith("rank") and name.endswith(".txt"):
            with open(os.path.join(failure_dir, name), encoding="utf-8") as fh:
                stamp, _, rest = fh.read().partition("\n")
            line = rest.partition("\n")[0]
            notes.append((is_consequence(line), float(stamp), int(name[4:-4]), line.strip()))
    if not notes:
        return None
    _, _, rank, line = min(notes)
    return rank, line


def _work(plan_data: dict, cfg_data: dict, timeout_s: float) -> list[dict] | None:
    plan = Plan.from_dict(plan_data)
    cfg = TrainConfig.from_dict(cfg_data)
    claim_device(one_thread=True)
    fail_at_start_up()
    init_process_group(rank_backend(), timeout_s)
    try:
        result = run_on_rank(plan.strategy, cfg, plan)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result.to_dict())
        return gathered if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


# Untimed steps before a run's timed ones. The second step is still slow under DDP (its buckets are rebuilt after
# the first step), TP2, ZeRO-3 and PP2, so one warm-up step biased every measured median up (measured:
# benchmarks/results/measurements.md, "Warm-up steps").
WARMUP_STEPS = 2


@record
class RunConfig(Record):
    """How `planner run` runs a plan (its flags): how long, with what seed and learning rate, on which nodes, and
    where checkpoints go and come from. `steps` counts from the start of training: resuming from a checkpoint at
    step k runs steps k .. steps - 1, with the checkpoint's seed and learning rate unless given."""

    steps: int
    warmup: int | None = None            # untimed steps at the start of this run; None: WARMUP_STEPS, fewer where
                                         # the run makes no more steps than that (one step stays timed)
    seed: int | None = None              # None: the checkpoint's when resuming, else 0
    lr: float | None = None              # None: the checkpoint's when resuming, else 1e-3
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None     # host:port of a c10d rendezvous (multi-node); None: file stores, no port
    timeout_s: float = 60.0              # collectives' timeout: a hung peer ends the job after this
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0            # steps between checkpoints (0: none during the run)
    checkpoint_keep: int = 0             # newest checkpoints kept (0: all)
    resume: str | None = None            # a checkpoint folder (step-N) or the folder holding them
    overwrite_checkpoints: bool = False  # replace checkpoints past this run's start in checkpoint_dir
    trust_checkpoint: bool = False       # resume from a checkpoint this installation's key did not sign
    data: str | None = None              # a token file (executor.data); None: synthetic batches
    init_from: str | None = None         # pretrained weights: an HF folder or a checkpoint (executor.weights)
    allow_extra: bool = False            # load init_from even where it holds tensors the model has no place for
    loss: str | None = None              # module:fn, fn(logits, targets) -> loss (losses.declared_loss)

    def check(self, world_size: int) -> None:
        """The flags' own constraints, as one-line ConfigErrors, before anything is read or started."""
        if self.steps < 1 or (self.warmup is not None and self.warmup < 0):
            raise ConfigError("--steps must be >= 1 and --warmup >= 0")
        if world_size % self.nnodes:
            raise ConfigError(f"the plan's {world_size} ranks do not divide into {self.nnodes} nodes")
        if self.checkpoint_every < 0 or self.checkpoint_keep < 0:
            raise ConfigError("--checkpoint-every and --checkpoint-keep must be >= 0")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir (where to write them)")
        if self.init_from and self.resume:
            raise ConfigError("--init-from starts training from given weights and --resume continues a run; "
                              "give one of them")


def launch(plan: Plan, run: RunConfig, *, on_resume=None, on_warning=None) -> RunFile | None:
    """Run the plan; returns the RunFile on the node holding global rank 0 (None on other nodes).

    `on_resume(step_dir, meta, signed)` is told which checkpoint was taken (after it was verified, before ranks
    start) and whether this installation's key signed it (an unsigned one is refused unless run.trust_checkpoint:
    resuming runs code stored in it). `on_warning(line)` gets what the checks before the ranks let through."""
    run.check(plan.strategy.world_size)
    check_plan(plan)
    model = _check_model(plan, run.loss)
    if run.data:
        _check_data(plan, run.data, model)
    if run.init_from:   # every check a rank's load makes, on the whole model, and tensors it has no place for
        for line in check_weights(model, Path(run.init_from), trusted=run.trust_checkpoint,
                                  allow_extra=run.allow_extra):
            if on_warning is not None:
                on_warning(line)
    start, step_dir, seed, lr = 0, None, run.seed, run.lr
    if run.resume:
        step_dir, meta = _resume_point(run.resume, plan, run.steps, trusted=run.trust_checkpoint, on_resume=on_resume,
                                       data=run.data)
        start, seed, lr = meta.step, meta.seed if seed is None else seed, meta.lr if lr is None else lr
    warmup = max(0, min(WARMUP_STEPS, run.steps - start - 1)) if run.warmup is None else run.warmup
    if run.warmup is None:
        run = dataclasses.replace(run, warmup=warmup)
    if warmup >= run.steps - start:
        raise ConfigError(f"--warmup {warmup} leaves no timed step of the {run.steps - start} this run makes; "
                          f"use fewer warm-up steps")
    per_node = plan.strategy.world_size // run.nnodes
    check_fits_here(plan, per_node)
    cfg = TrainConfig(model_source=plan.model.source, seq_len=plan.model.seq_len, input_kind=plan.model.input_kind,
                      steps=run.steps, warmup=warmup, seed=0 if seed is None else seed,
                      lr=1e-3 if lr is None else lr, start_step=start, resume_from=str(step_dir) if step_dir else None,
                      trust_checkpoint=run.trust_checkpoint, checkpoint_dir=run.checkpoint_dir,
                      checkpoint_every=run.checkpoint_every, checkpoint_keep=run.checkpoint_keep, data=run.data,
                      unit_modules=plan.model.unit_modules, init_from=run.init_from, tp_rules=plan.model.tp_rules,
                      loss_fn=run.loss)
    load_before = os.getloadavg()[0]
    gathered = _start_ranks(plan, run, cfg, per_node)
    if gathered is None:
        return None
    result = summarize(plan, [RankResult.from_dict(r) for r in gathered], steps=run.steps, warmup=warmup,
                       backend=rank_backend())
    # ranks save only into a checkpoint_dir: without one they saved nothing
    written = (tuple(str(Path(run.checkpoint_dir) / layout.step_dir_name(s)) for s in result.ranks[0].checkpoint_steps)
               if run.checkpoint_dir else ())
    # how loaded the machine was, beside the measured times: a shared machine's noise is not the model's error
    return dataclasses.replace(result, start_step=start, resumed_from=str(step_dir) if step_dir else None,
                               checkpoints=written, load_1min=(load_before, os.getloadavg()[0]),
                               cpus=os.cpu_count() or 0)


def _start_ranks(plan: Plan, run: RunConfig, cfg: TrainConfig, per_node: int) -> list[dict] | None:
    """This node's ranks, started and awaited (the checkpoint folder locked and checked right before they start,
    until they end); every rank's result on the node holding global rank 0, None elsewhere."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    folder = _checkpoint_folder(Path(run.checkpoint_dir), cfg.start_step, run.overwrite_checkpoints,
                                lock=run.node_rank == 0) if run.checkpoint_dir else contextlib.nullcontext()
    local_ranks = range(run.node_rank * per_node, (run.node_rank + 1) * per_node)
    # Ctrl-C / SIGTERM: torch's agent stops every rank, then raises its SignalException (the CLI says "interrupted")
    with folder, elastic_job("run", per_node, nnodes=run.nnodes, node_rank=run.node_rank,
                             rdzv_endpoint=run.rdzv_endpoint) as (start, failure_dir):
        try:
            results = start(worker, plan.to_dict(), cfg.to_dict(), run.timeout_s, failure_dir)
        except ChildFailedError as exc:
            rank, line = _root_cause(failure_dir, exc, local_ranks, run.timeout_s)
            raise failed(failure_dir, rank, line) from None
    return results.get(0) if isinstance(results, dict) else None


def _resume_point(resume: str, plan: Plan, steps: int, *, trusted: bool, on_resume,
                  data: str | None = None) -> tuple[Path, layout.CheckpointMeta]:
    """The checkpoint `resume` names, verified before any rank starts (ranks load with DCP, which unpickles), and
    `on_resume` told about it; `data` (--data) must be the file it was trained on, where it recorded one."""
    step_dir = layout.resolve(resume)
    meta, signed = layout.read_verified(step_dir, trusted=trusted)   # before anything else is read
    layout.check_resumable(meta, step_dir, plan, steps)
    _check_same_data(meta, step_dir, data)
    layout.verify(step_dir, meta)
    if on_resume:
        on_resume(step_dir, meta, signed)
    return step_dir, meta


def _check_same_data(meta: layout.CheckpointMeta, step_dir: Path, data: str | None) -> None:
    """A resumed run reads the windows an uninterrupted one would (executor.data), so only from the same file."""
    if meta.data is None:   # an older checkpoint: not recorded
        return
    now = data_identity(data) if data else ""
    if now != meta.data:
        was = f"--data with {meta.data}" if meta.data else "synthetic tokens (no --data)"
        given = f"--data {data} ({now})" if data else "no --data"
        raise layout.CheckpointError(f"checkpoint {step_dir} was trained on {was}, this run has {given}; resume "
                                     f"with the same data, or start a new run from its weights with --init-from")


@contextlib.contextmanager
def _checkpoint_folder(root: Path, start: int, overwrite: bool, *, lock: bool) -> Iterator[None]:
    """While a run saves into `root`: the folder's lock held (on the node of global rank 0, which commits the
    checkpoints; `lock`), the key that signs its checkpoints made, and the folder checked."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--checkpoint-dir {root} is a file; name a folder")
    with layout.locked(root, shlex.join(sys.argv)) if lock else contextlib.nullcontext():
        if lock:
            trust.load_or_create_key(trust.key_path())   # a key that cannot be made fails here, not after training
        _check_checkpoint_dir(root, start, overwrite)
        yield


def _check_model(plan: Plan, loss: str | None = None):
    """Before any rank starts: the plan's model builds (on the meta device: no memory), its stages hold all of it
    (executor.stages.check_covers_model), a pipeline plan's model can be pipelined
    (cost_models.models.pipelining), and its output is one training can take a loss on. Returns the meta model."""
    model = resolve(plan.model.source).build(device="meta", dtype=DTYPES["fp32"])
    units = UnitMap.of(plan.model.units, plan.model.unit_modules)
    support = ""
    if plan.strategy.pp > 1:
        support = pipeline_support(model, [(u, units.names(u)) for u in plan.model.units])
        if support.startswith("no"):
            raise ConfigError(f"{plan.model.name} cannot be pipelined: {support.removeprefix('no: ')}; plan it "
                              f"with pp=1 (planner plan does not offer pipelines for it)")
    check_covers_model(model, plan.strategy.stages, units, model_level=plan.strategy.pp == 1 or support == "traced")
    if plan.strategy.cp > 1:   # its attention must split; found in the forward below
        if plan.model.input_kind != "tokens":
            raise ConfigError(f"context parallelism splits token sequences; {plan.model.name} takes "
                              f"{plan.model.input_kind} inputs: plan it with cp = 1")
        context_parallel.check_model(model, plan.strategy.cp, plan.model.seq_len)
    example = resolve(plan.model.source).example_input(model, 1, plan.model.seq_len, "cpu")[0].to("meta")
    with meta_forward_context(model), torch.no_grad():   # a loss can be taken on what it returns (one line if not)
        logits = _meta_logits(model, example)
        if loss:
            _check_loss(model, loss, logits, example if plan.model.input_kind == "tokens" else logits)
    return model


def _check_loss(model, ref: str, logits: torch.Tensor | None, targets: torch.Tensor | None) -> None:
    """--loss: the function is there, the model does not compute its own, and on the meta logits (where the
    forward runs on meta) it returns one number."""
    fn = load_attr(ref, "--loss")
    if takes_targets(model):
        raise ConfigError(f"--loss {ref}: the model computes its own loss (its forward takes targets); drop --loss")
    if logits is not None and targets is not None:
        value = _check_on_meta(lambda: fn(logits, torch.zeros_like(targets)))
        if value is not None:
            scalar_loss(ref, value)


def _meta_logits(model, example: torch.Tensor) -> torch.Tensor | None:
    """The model's logits on the meta device (example_logits: one line if its output has none), or None where its
    forward cannot run on meta (data-dependent code: `.item()`); the ranks then meet it for real."""
    return _check_on_meta(lambda: example_logits(model, example))


def _check_on_meta(check):
    """`check()`, letting its ConfigError (a refusal) through; None if it cannot run on meta tensors."""
    try:
        return check()
    except PlannerError:
        raise
    except Exception:   # the user's code on meta tensors: the ranks run it for real
        return None


def _check_data(plan: Plan, path: str, model) -> None:
    """Before any rank starts: the token file opens, holds a window, and every id is in the (meta) model's
    vocabulary."""
    if plan.model.input_kind != "tokens":
        raise ConfigError(f"--data feeds token ids; {plan.model.name} takes {plan.model.input_kind} inputs")
    tokens = TokenFile(path, plan.model.seq_len)
    source = resolve(plan.model.source)
    example = source.example_input(model, 1, plan.model.seq_len, "cpu")[0]
    with meta_forward_context(model), torch.no_grad():
        tokens.check_ids(vocab=example_logits(model, example.to("meta")).shape[-1])


def _check_checkpoint_dir(root: Path, start: int, overwrite: bool) -> None:
    """Nothing a user made is overwritten without asking: checkpoints past this run's start would be replaced
    (or would shadow this run's as the latest)."""
    stale = layout.newer_than(root, start)
    if stale and not overwrite:
        raise ConfigError(f"{root} already holds {len(stale)} checkpoint(s) past step {start} (latest "
                          f"{stale[-1].name}); pass --overwrite-checkpoints to replace them or choose another "
                          f"--checkpoint-dir")
    for d in stale:
        shutil.rmtree(d)
    root.mkdir(parents=True, exist_ok=True)


def rank_traceback(failure_dir: str, rank: int) -> str:
    """The traceback rank `rank` noted before it died (_note_failure), or ""."""
    path = os.path.join(failure_dir, f"rank{rank}.txt")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as fh:
        return fh.read().split("\n", 2)[-1]


def failed(failure_dir: str, rank: int, line: str) -> RunFailed:
    """The RunFailed naming `rank`, carrying its traceback."""
    exc = RunFailed(f"rank {rank} failed: {line}")
    exc.rank_traceback = rank_traceback(failure_dir, rank)
    return exc


def _root_cause(failure_dir: str, exc, local_ranks: range, timeout_s: float) -> tuple[int, str]:
    """The ranks' own notes name an exception; a rank killed by a signal leaves none, and its peers' notes only
    say they lost it: then the agent's record of the signal (root_failure) is the cause. When every rank that
    failed only timed out waiting, the cause is a rank that did not fail and left no note: it stopped answering
    (SIGSTOP, a hung kernel, swapped out), and the agent stops it with the rest."""
    noted = _failure_from_files(failure_dir)
    if noted and not is_consequence(noted[1]):
        return noted
    rank, line = root_failure(exc)
    if not is_consequence(line):
        return rank, line
    silent = [r for r in local_ranks if r not in _noted_ranks(failure_dir) and r not in exc.failures]
    if not silent:
        return noted or (rank, line)
    last = {r: _last_sign_of_life(failure_dir, r) for r in local_ranks}
    hung = min(silent, key=lambda r: last[r])
    others = [last[r] for r in local_ranks if r != hung]
    # the hung rank fell silent at least a timeout before its peers gave up; every rank alive till the end means
    # none was stopped (a deadlock, a lost message), and the silent ones are all suspects
    if others and min(others) - last[hung] >= timeout_s / 2:
        return hung, (f"stopped responding: no sign of life for {max(others) - last[hung]:.0f} s before the job "
                      f"ended (its peers timed out after --timeout {timeout_s:g} s waiting for it)")
    names = ", ".join(map(str, silent))
    return (noted or (rank, line))[0], (f"timed out after --timeout {timeout_s:g} s waiting for a peer; ranks "
                                        f"{names} raised nothing and were alive: a collective they never joined?")


def check_fits_here(plan: Plan, per_node: int) -> None:
    """Refuse, in one line, a plan this node cannot host: more ranks than its GPUs (or than its cores can bear),
    or ranks whose predicted memory exceeds what the host has free (CPU ranks share it)."""
    import psutil
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if per_node > gpus:
            raise ConfigError(f"the plan puts {per_node} ranks on each node, this node has {gpus} GPUs; "
                              f"spread it with --nnodes or plan for {gpus} GPUs")
        return
    cores = os.cpu_count() or 1
    if per_node > max(8, 4 * cores):
        raise ConfigError(f"the plan puts {per_node} ranks on this node and it has {cores} CPU cores; plan for fewer "
                          f"GPUs (planner plan --gpus) or spread it with --nnodes")
    need = sum(m.total_bytes for m in plan.prediction.memory_per_rank[:per_node])
    avail = psutil.virtual_memory().available
    if need > avail:
        raise ConfigError(f"the plan's {per_node} local ranks need about {fixed(need, 'GiB', 1)}, this machine has "
                          f"{fixed(avail, 'GiB', 1)} free; run it where it was planned for, or plan a smaller model")


def summarize(plan: Plan, ranks: list[RankResult], *, steps: int, warmup: int, backend: str) -> RunFile:
    """Predicted against measured: step time (slowest rank's median), per-rank memory categories, traffic."""
    per_rank = [summarize_times(r.step_times_s, warmup) for r in ranks]
    slowest = max(per_rank, key=lambda t: t["median_s"])
    est = plan.prediction
    rows = [Measure(quantity="step time", unit="s", predicted=est.step_time_s, measured=slowest["median_s"])]
    for r in ranks:
        m = est.memory_per_rank[r.rank]
        for label, pred, meas in (("parameters", m.parameters, r.parameter_bytes),
                                  ("gradients", m.gradients, r.gradient_bytes),
                                  ("optimizer states", m.optimizer_states, r.optimizer_state_bytes),
                                  ("activations", m.activations, r.activation_bytes),
                                  ("peak total", m.total_bytes, r.peak_memory_bytes)):
            if meas < 0:   # not measured (executor.activations runs in the counted step only)
                continue
            rows.append(Measure(quantity=f"rank {r.rank} {label}", unit="B", predicted=float(pred),
                                measured=float(meas)))
    dp_measured = sum(v for k, v in ranks[0].comm_bytes.items()
                      if not k.startswith(("p2p", "tp_", "all_to_all", "cp_")))
    # the tied gradients' all-reduce across pipeline ranks is counted among them (estimate._tied_sync)
    rows.append(Measure(quantity="rank 0 data-parallel and tied-gradient bytes per step (full buffers)", unit="B",
                        predicted=est.comm.dp_bytes_per_rank + est.comm.tied_bytes_per_rank,
                        measured=float(dp_measured)))
    if plan.strategy.tp > 1:   # DTensor's collectives, counted apart (executor.measure.CommCounter)
        tp_measured = sum(v for k, v in ranks[0].comm_bytes.items() if k.startswith("tp_"))
        rows.append(Measure(quantity="rank 0 tensor-parallel bytes per step", unit="B",
                            predicted=est.comm.tp_bytes_per_rank, measured=float(tp_measured)))
    if plan.strategy.ep > 1:   # a rank's share varies with the routing: the mean over ranks is the prediction's
        rows.append(Measure(quantity="expert-parallel all-to-all bytes per step (mean over ranks)", unit="B",
                            predicted=est.comm.ep_bytes_per_rank,
                            measured=sum(r.comm_bytes.get("all_to_all", 0) for r in ranks) / len(ranks)))
        rows.append(Measure(quantity="busiest expert-parallel rank's routed tokens over the mean (worst block)",
                            unit="x", predicted=est.ep_load, measured=routed_load(ranks)))
        rows.append(Measure(quantity="the same in the worst micro-batch (activations are priced there)",
                            unit="x", predicted=est.ep_peak_load, measured=peak_routed_load(ranks)))
    if plan.strategy.cp > 1:   # the gathers of keys and values and their gradients' reduce-scatters
        rows.append(Measure(quantity="context-parallel bytes per step (mean over ranks)", unit="B",
                            predicted=est.comm.cp_bytes_per_rank,
                            measured=sum(v for r in ranks for k, v in r.comm_bytes.items() if k.startswith("cp_"))
                            / len(ranks)))
    # one pipeline's: there are dp x cp of them (Strategy.data_view)
    p2p_measured = sum(r.comm_bytes.get("p2p_send", 0) for r in ranks) / (plan.strategy.dp * plan.strategy.cp)
    rows.append(Measure(quantity="p2p bytes per step (one pipeline)", unit="B",
                        predicted=est.comm.p2p_bytes_per_step, measured=float(p2p_measured)))
    return RunFile(model=plan.model.name, strategy_summary=plan.strategy.summary, world_size=len(ranks), steps=steps,
                   warmup=warmup, backend=backend, losses=ranks[0].losses, step_time_s=slowest,
                   tokens_per_s=est.tokens_per_step / slowest["median_s"], throughput_unit=est.throughput_unit,
                   predicted_step_time_s=est.step_time_s, ranks=tuple(ranks), measures=tuple(rows),
                   created_at=now_utc())


def routed_load(ranks: list[RankResult]) -> float:
    """The measured counterpart of Estimate.ep_load: per MoE block, the most rows any rank's experts were sent in
    the counted step over the mean of the ranks holding that block (every EP group routes the same number of rows,
    so that mean is each group's), the largest over blocks; 1 where nothing was counted."""
    return max((_over_mean([sum(calls) for calls in by_rank]) for by_rank in _calls_by_block(ranks)), default=1.0)


def peak_routed_load(ranks: list[RankResult]) -> float:
    """The measured counterpart of Estimate.ep_peak_load: routed_load call by call (each rank calls a block's
    experts once per micro-batch forward, in the same order), the largest over calls and blocks."""
    return max((_over_mean(rows) for by_rank in _calls_by_block(ranks) for rows in zip(*by_rank)), default=1.0)


def _calls_by_block(ranks: list[RankResult]) -> list[list[tuple[int, ...]]]:
    """Per MoE block, each rank's rows per experts call (RankResult.expert_calls) of the ranks holding it."""
    per_block: dict[str, list[tuple[int, ...]]] = {}
    for r in ranks:
        for block, calls in r.expert_calls.items():
            per_block.setdefault(block, []).append(calls)
    return list(per_block.values())


def _over_mean(rows) -> float:
    return max(rows) * len(rows) / sum(rows) if sum(rows) else 1.0


def _many_worker(strategy_dicts: list[dict], cfg_data: list[dict], plan_data: list[dict | None], timeout_s: float,
                 failure_dir: str) -> list | None:
    """Every rank: run each strategy in turn in one process group (spawning ranks costs seconds each time)."""
    return _guarded(failure_dir, _many, strategy_dicts, cfg_data, plan_data, timeout_s)


def _many(strategy_dicts: list[dict], cfg_data: list[dict], plan_data: list[dict | None],
          timeout_s: float) -> list | None:
    claim_device(one_thread=True)
    init_process_group(rank_backend(), timeout_s)
    try:
        results = []
        for data, c, p in zip(strategy_dicts, cfg_data, plan_data, strict=True):
            s, cfg = Strategy.from_dict(data), TrainConfig.from_dict(c)
            try:
                results.append(run_on_rank(s, cfg, Plan.from_dict(p) if p else None).to_dict())
            except Exception as exc:
                raise RuntimeError(f"{cfg.model_source} {s.name}: {type(exc).__name__}: {exc}") from exc
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        return gathered if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def run_many(nproc: int, strategies: list, cfg: TrainConfig | list[TrainConfig], *, plans: list | None = None,
             timeout_s: float = 120.0) -> list[list[RankResult]]:
    """Run several strategies of the same world size on one set of local ranks: [strategy][rank] -> RankResult;
    `cfg` one training setup for all, or one per strategy (several models in one launch); `plans` the Plan (or
    None) of each, where its config saves checkpoints (they hold the plan). (The fidelity benchmark and the
    executor tests; `planner run` runs one plan.)"""
    cfgs = cfg if isinstance(cfg, list) else [cfg] * len(strategies)
    plan_data = [p.to_dict() if p is not None else None for p in (plans or [None] * len(strategies))]
    if not len(cfgs) == len(plan_data) == len(strategies):
        raise ValueError(f"run_many: {len(strategies)} strategies, {len(cfgs)} configs, {len(plan_data)} plans")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    with elastic_job("many", nproc) as (start, failure_dir):
        try:
            per_rank = start(_many_worker, [s.to_dict() for s in strategies], [c.to_dict() for c in cfgs],
                             plan_data, timeout_s, failure_dir)[0]
        except ChildFailedError as exc:
            rank, line = _root_cause(failure_dir, exc, range(nproc), timeout_s)
            raise failed(failure_dir, rank, line) from None
    return [[RankResult.from_dict(per_rank[r][i]) for r in range(nproc)] for i in range(len(strategies))]
