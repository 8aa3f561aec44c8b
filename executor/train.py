"""The training loop `planner run` executes on every rank, its synthetic data, and the single-process reference
the equivalence tests compare against."""
from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from cost_models.models.losses import compute_loss, declared_loss, own_loss, takes_targets
from cost_models.models.source import meta_forward_context, resolve
from cost_models.records.base import Record, record
from cost_models.records.errors import ConfigError
from cost_models.records.strategy import Strategy
from cost_models.records.tensor_parallel import TPRule
from cost_models.torch_compat import optimizers
from cost_models.torch_compat.devices import rank_device
from executor import checkpoint, checkpoint_layout
from executor.activations import ActivationMeter
from executor.data import TokenFile, data_identity
from executor.expert_parallel import routed_rows
from executor.measure import CommCounter, peak_memory_bytes
from executor.runtime import ModelSpec, build_runtime, example_logits, logits_of
from executor.stages import UnitMap, canonical_names, state_maps
from executor.testing_hooks import INJECT_FAILURE_ENV, SAVE_FILE_LIMIT_ENV, hook
from executor.weights import load_weights
from executor.zero import Precision, mixed_precision
from planner.plan import Plan
from planner.run_record import RankResult


@record
class TrainConfig(Record):
    model_source: str
    seq_len: int
    input_kind: str
    steps: int = 5
    warmup: int = 1
    seed: int = 0
    lr: float = 1e-3
    count_comm: bool = True
    start_step: int = 0                    # steps already done (a resumed run starts here)
    resume_from: str | None = None         # a complete checkpoint folder (executor.checkpoint_layout)
    trust_checkpoint: bool = False         # resume_from need not be signed by this installation's key
    checkpoint_dir: str | None = None      # where to save checkpoints
    checkpoint_every: int = 0              # save after every K steps (0: only after the last step)
    checkpoint_keep: int = 0               # keep the newest K complete checkpoints (0: all)
    data: str | None = None                # a token file (executor.data); None: synthetic batches
    unit_modules: tuple[tuple[str, ...], ...] = ()   # the modules of each unit (ModelRef.unit_modules)
    init_from: str | None = None           # pretrained weights (executor.weights): an HF folder or a checkpoint
    tp_rules: tuple[TPRule, ...] = ()      # a custom tensor-parallel plan's rules (ModelRef.tp_rules)
    loss_fn: str | None = None             # --loss module:fn on the model's logits (losses.declared_loss)


def _loss_fn(cfg: TrainConfig, kind: str):
    """The run's loss on the logits: `--loss` where given, else `kind`."""
    if cfg.loss_fn:
        return declared_loss(cfg.loss_fn)
    return lambda out, tgt: compute_loss(kind, out, tgt)


def optimizer_for(strategy: Strategy, lr: float):
    """The plan's optimizer, built as the profiler timed it (cost_models.torch_compat.optimizers)."""
    return lambda params: optimizers.build(strategy.optimizer, params, lr)


def synthetic_batch(cfg: TrainConfig, example: torch.Tensor, out_shape: tuple[int, ...], global_batch: int,
                    step: int, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of step `step`, identical on every rank (each takes its replica's slice)."""
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    if not example.is_floating_point():
        vocab = out_shape[-1]
        inputs = torch.randint(0, vocab, (global_batch, *example.shape[1:]), generator=gen)
    else:
        inputs = torch.randn((global_batch, *example.shape[1:]), generator=gen, dtype=example.dtype)
    if loss == "cross_entropy":
        targets = torch.randint(0, out_shape[-1], (global_batch, *out_shape[1:-1]), generator=gen)
    else:
        targets = torch.randn((global_batch, *out_shape[1:]), generator=gen)
    return inputs, targets


def batch_source(cfg: TrainConfig, example: torch.Tensor, out_shape: tuple[int, ...], global_batch: int,
                 loss: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """step -> the whole global batch of that step, identical on every rank (each takes its replica's slice): the
    token file's windows (executor.data) with --data, else synthetic_batch."""
    if cfg.data:
        tokens = TokenFile(cfg.data, cfg.seq_len)
        return lambda step: tokens.batch(step, global_batch)
    return lambda step: synthetic_batch(cfg, example, out_shape, global_batch, step, loss)


def _precision(strategy: Strategy) -> Precision:
    device = rank_device()
    return mixed_precision(strategy.precision, device, strategy.pp)


# (model source, the folder a relative one is read from, seq_len, micro-batch, build dtype) -> (ModelSource, example
# input, output shape): the strategies of one launch (run_many) mostly share a model, and resolving it and running it
# on meta for the output's shape is a good part of a small model's set-up
_SHAPES: dict[tuple, tuple[Any, torch.Tensor, tuple[int, ...]]] = {}


def _setup(cfg: TrainConfig, strategy: Strategy):
    """(model spec, one micro-batch of example input, the output's shape, the loss kind) for the plan's model."""
    dtype = _precision(strategy).build
    key = (cfg.model_source, os.getcwd(), cfg.seq_len, strategy.micro_batch_size, dtype)
    if key not in _SHAPES:
        source = resolve(cfg.model_source)
        with torch.device("meta"):
            model = source.build(device=None, dtype=dtype, seed=cfg.seed)
        example = source.example_input(model, strategy.micro_batch_size, cfg.seq_len, "cpu")[0]
        with meta_forward_context(model), torch.no_grad():
            out = example_logits(model, example.to("meta"))
        _SHAPES[key] = source, example, tuple(out.shape)
    source, example, out_shape = _SHAPES[key]
    spec = ModelSpec(build=lambda: source.build(device=None, dtype=dtype, seed=cfg.seed),
                     units=UnitMap.of([u for st in strategy.stages for u in st], cfg.unit_modules),
                     tp_rules=cfg.tp_rules)
    loss = "cross_entropy" if cfg.input_kind == "tokens" else "mse"
    return spec, example.clone(), out_shape, loss


@dataclass
class _Progress:
    """What the loop of run_on_rank gathers, step by step, for the RankResult."""
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=lambda: {"compute": [], "sync": [], "optimizer": []})
    saved: list[int] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    param_grad: tuple[int, int] = (0, 0)
    optim_bytes: int = 0


def _load_init(cfg: TrainConfig, params, buffers, model) -> None:
    """cfg.init_from's weights into `params` and `buffers` of `model` (executor.weights)."""
    assert cfg.init_from is not None
    load_weights(params, buffers, Path(cfg.init_from), trusted=cfg.trust_checkpoint, model=model)


def run_on_rank(strategy: Strategy, cfg: TrainConfig, plan: Plan | None = None) -> RankResult:
    """Train steps cfg.start_step .. cfg.steps - 1 of `strategy` on this rank of an initialised process group,
    resuming from and saving checkpoints as `cfg` says (saves need the `plan`, which goes into them), and measure
    the steps."""
    spec, example, out_shape, loss = _setup(cfg, strategy)
    device = rank_device()
    loading = bool(cfg.init_from and not cfg.resume_from)
    # expert parallelism loads the whole model's weights before it keeps this rank's experts (build_runtime)
    load = functools.partial(_load_init, cfg) if loading else None
    rt = build_runtime(strategy, spec, loss_fn=_loss_fn(cfg, loss), optimizer_fn=optimizer_for(strategy, cfg.lr),
                       example=example, seed=cfg.seed, device=device,
                       local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                       loading=loading and strategy.ep == 1, preload=load if strategy.ep > 1 else None,
                       builtin_cross_entropy=loss == "cross_entropy" and not cfg.loss_fn,
                       compute=_precision(strategy).compute)
    if load is not None and strategy.ep == 1:
        load(rt.params_by_name, rt.buffers_by_name, rt.model)
    restore_s = _resume(rt, cfg) if cfg.resume_from else 0.0
    fail_rank, fail_step, how = _injected_failure()
    progress, counter, meter, rows = _Progress(), None, None, {}
    batches = batch_source(cfg, example, out_shape, strategy.global_batch_size, loss)
    for step in range(cfg.start_step, cfg.steps + (1 if cfg.count_comm else 0)):
        counting = cfg.count_comm and step == cfg.steps
        inputs, targets = batches(step)
        x, y = rt.rank_batch(inputs, targets)
        x, y = x.to(device), y.to(device)
        injected = step == fail_step and dist.get_rank() == fail_rank
        if injected and how != "nan":
            _fail_now(step, how)
        counter = CommCounter() if counting else None
        meter = ActivationMeter(rt.wrapped.modules, batch=(x, y)) if counting else None
        routed_rows(rt.model, rt.wrapped.modules, count=counting)
        with meter or contextlib.nullcontext():
            replica_loss, elapsed = _timed_step(rt, x, y, device, counter, progress, poison=injected and how == "nan")
        if counting:
            assert counter is not None   # made above for the counting step
            _count_ddp_buckets(rt, counter)
            rows = routed_rows(rt.model, rt.wrapped.modules)
            break
        _finish_step(rt, cfg, plan, step, device, progress, elapsed, replica_loss)
    peak, source_name = peak_memory_bytes()
    return RankResult(rank=dist.get_rank(), pp_rank=rt.pp_rank, dp_rank=rt.dp_rank, stages=tuple(rt.stage_ids),
                      step_times_s=tuple(progress.times), losses=tuple(progress.losses),
                      parameter_bytes=progress.param_grad[0], gradient_bytes=progress.param_grad[1],
                      optimizer_state_bytes=progress.optim_bytes, peak_memory_bytes=peak,
                      peak_memory_source=source_name, comm_bytes=dict(counter.bytes) if counter else {},
                      comm_calls=dict(counter.calls) if counter else {}, compute_s=tuple(progress.parts["compute"]),
                      sync_s=tuple(progress.parts["sync"]), optimizer_s=tuple(progress.parts["optimizer"]),
                      restore_s=restore_s, checkpoint_steps=tuple(progress.saved), checkpoint_s=tuple(progress.save_s),
                      activation_bytes=meter.peak if meter else -1,
                      expert_rows={block: sum(calls) for block, calls in rows.items()}, expert_calls=rows)


def fail_at_start_up() -> None:
    """INJECT_FAILURE_ENV's "RANK:start[:kind]": this rank fails during start-up, before the process group exists."""
    rank, step, how = _injection()
    if step == "start" and str(rank) == os.environ.get("RANK"):
        _fail_now(-1, how)


def _fail_now(step: int, how: str) -> None:
    """The injected failure of INJECT_FAILURE_ENV at the start of `step` (all kinds but "nan")."""
    if how in ("kill", "stop"):
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    raise RuntimeError(f"injected failure at step {step} ({INJECT_FAILURE_ENV})")


def _timed_step(rt, x: torch.Tensor, y: torch.Tensor, device: torch.device, counter: CommCounter | None,
                progress: _Progress, *, poison: bool) -> tuple[torch.Tensor | None, float]:
    """Forward, backward and update of one step; (this replica's loss, seconds). The bytes of parameters and
    gradients (counted while gradients exist) and of optimizer state go into `progress`, their counting left out
    of the step time. `poison`: an update that broke the weights while the loss was still finite."""
    rt.reset_timings()
    t0 = time.perf_counter()
    with counter or contextlib.nullcontext():
        replica_loss = rt.forward_backward(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_count = time.perf_counter()
        progress.param_grad = rt.local_bytes()[:2]
        t_count = time.perf_counter() - t_count
        rt.optimizer_step()
        if poison:
            with torch.no_grad():
                next(iter(rt.params_by_name.values())).fill_(float("nan"))
    rt.optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0 - t_count
    progress.optim_bytes = rt.local_bytes()[2]
    return replica_loss, elapsed


def _count_ddp_buckets(rt, counter: CommCounter) -> None:
    # DDP's reducer all-reduces its buckets from autograd's thread: on CPU that is this thread and the counter saw
    # them; on GPUs it is a device thread the counter does not see, so count the buckets here
    if rt.wrapped.ddp and "all_reduce" not in counter.calls:
        low = rt.wrapped.reduce_dtype   # mixed precision reduces in its compute dtype (executor.zero)
        size = (lambda p: low.itemsize) if low is not None else (lambda p: p.element_size())
        counter.add("all_reduce", sum(p.numel() * size(p) for p in rt.wrapped.params))


def _finish_step(rt, cfg: TrainConfig, plan: Plan | None, step: int, device: torch.device, progress: _Progress,
                 elapsed: float, replica_loss: torch.Tensor | None) -> None:
    """Record a timed step's time, phase timings and global loss; stop on divergence; save a checkpoint when due."""
    progress.times.append(elapsed)
    for key in progress.parts:
        progress.parts[key].append(rt.timings[key])
    loss = _global_loss(replica_loss, rt, device)
    progress.losses.append(loss)
    if not math.isfinite(loss):   # the same all-reduced value on every rank: they all stop here, before a save
        raise ConfigError(f"training diverged: the loss is {loss} at step {step}; lower --lr (now "
                          f"{cfg.lr:g}) or check the data")
    done = step + 1
    if cfg.checkpoint_dir and (done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0)):
        t0 = time.perf_counter()
        _save(rt, cfg, plan, done, loss, device)
        progress.save_s.append(time.perf_counter() - t0)
        progress.saved.append(done)


def _resume(rt, cfg: TrainConfig) -> float:
    """Load the checkpoint into this rank's share of the (possibly differently laid out) state; seconds taken."""
    assert cfg.resume_from is not None   # run_on_rank resumes only when it is set
    t0 = time.perf_counter()
    checkpoint.init_optimizer_state(rt.optimizer, list(rt.params_by_name.values()))
    sd = rt.state_dict()
    loaded = checkpoint.load(sd, Path(cfg.resume_from), trusted=cfg.trust_checkpoint)
    checkpoint.restore_rng(loaded, dist.get_rank())
    elapsed = time.perf_counter() - t0
    checkpoint.dump_for_tests(sd, "loaded")
    return elapsed


def _save(rt, cfg: TrainConfig, plan: Plan | None, step: int, last_loss: float, device: torch.device) -> None:
    if plan is None:
        raise ConfigError("saving a checkpoint needs the plan the run is under")
    # the loss is taken before the update: an update that made the weights NaN shows only in the weights
    local = [getattr(p, "to_local", lambda: p)().detach() for p in rt.params_by_name.values()]   # FSDP2: its shard
    finite = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in local))], device=device)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item() < 1:
        raise ConfigError(f"training diverged: parameters are not finite after step {step}, so no checkpoint was "
                          f"saved; lower --lr (now {cfg.lr:g}) or check the data")
    sd = rt.state_dict()
    meta = {"samples_seen": step * plan.strategy.global_batch_size, "seed": cfg.seed, "lr": cfg.lr,
            "loss": last_loss, "world_size": dist.get_world_size(), "plan": plan, "torch_version": torch.__version__,
            "data": data_identity(cfg.data) if cfg.data else ""}
    assert cfg.checkpoint_dir is not None   # _finish_step saves only when it is set
    root = Path(cfg.checkpoint_dir)
    _limit_file_size(step)
    checkpoint.save(sd, root, step, meta)
    if dist.get_rank() == 0:
        checkpoint_layout.prune(root, cfg.checkpoint_keep)
    checkpoint.dump_for_tests(sd, f"saved-step{step}")


def _global_loss(replica_loss: torch.Tensor | None, rt, device: torch.device) -> float:
    """Mean over data-parallel replicas of the last stage's loss, made known to every rank (a replica's tp ranks
    all compute its loss from the gathered logits: it is counted once, from tp rank 0)."""
    value = torch.zeros(2, dtype=torch.float64, device=device)
    if replica_loss is not None and getattr(rt, "tp_rank", 0) == 0:
        value[0] = float(replica_loss)
        value[1] = 1.0
    dist.all_reduce(value)
    return float(value[0] / value[1])


def _limit_file_size(step: int) -> None:
    spec = hook(SAVE_FILE_LIMIT_ENV)
    if spec and step >= int(spec.split(":")[0]):
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(spec.split(":")[1]), hard))


def _injection() -> tuple[int, str, str]:
    """INJECT_FAILURE_ENV as (rank, step or "start", kind); (-1, "", "") when unset."""
    spec = hook(INJECT_FAILURE_ENV)
    if not spec:
        return -1, "", ""
    rank, step, *how = spec.split(":")
    return int(rank), step or "0", how[0] if how else "raise"


def _injected_failure() -> tuple[int, int, str]:
    """The step failure to inject (rank, step, kind); a start-up one (fail_at_start_up) is not a step's."""
    rank, step, how = _injection()
    return (-1, -1, "") if step in ("", "start") else (rank, int(step), how)


def single_process_losses(strategy: Strategy, cfg: TrainConfig) -> list[float]:
    """The reference: the model itself in one process (`torch.manual_seed(seed)`, then its constructor: its own
    init; or cfg.init_from's weights), the same global batches, the same optimizer; steps cfg.start_step ..
    cfg.steps - 1, from cfg.resume_from's state when given (DCP loads without a process group)."""
    spec, example, out_shape, loss = _setup(cfg, strategy)
    torch.manual_seed(cfg.seed)
    with torch.device("cpu"):
        model = spec.build()
    canon = canonical_names(model)
    params, buffers = state_maps(model, [model], canon)
    opt = optimizer_for(strategy, cfg.lr)(list(model.parameters()))
    if cfg.init_from and not cfg.resume_from:
        load_weights(params, buffers, Path(cfg.init_from), trusted=cfg.trust_checkpoint, model=model)
    if cfg.resume_from:
        checkpoint.init_optimizer_state(opt, list(params.values()))
        checkpoint.load(checkpoint.state_dict(params, buffers, opt, rng_rank=None), Path(cfg.resume_from))
    out = []
    batches = batch_source(cfg, example, out_shape, strategy.global_batch_size, loss)
    loss_fn, own = _loss_fn(cfg, loss), takes_targets(model)
    for step in range(cfg.start_step, cfg.steps):
        x, y = batches(step)
        value = own_loss(model(x, y)) if own else loss_fn(logits_of(model(x)), y)
        value.backward()
        value = value.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(value.item())
    return out


def summarize_times(times: tuple[float, ...], warmup: int) -> dict[str, Any]:
    timed = list(times[warmup:]) or list(times)
    return {"median_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed), "steps": len(timed)}
