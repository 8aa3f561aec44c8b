"""`planner`: the command line. It parses, calls one function, and prints; no logic lives here.

Data goes to stdout (a table, or JSON with --json), progress and errors to stderr. Errors a user can cause are
PlannerError subclasses: one line, no traceback, exit code 2 (bad input) or 3 (nothing fits).
"""
from __future__ import annotations

import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional, cast

import typer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table
from typer.core import TyperGroup

from cost_models.records.errors import PlannerError, interrupted
from cost_models.records.fileio import dumps
from cost_models.records.schedule import DEFAULT_SCHEDULE, SCHEDULES


class _ErrorBoundary(TyperGroup):
    """The one error boundary of every command (main() and tests' CliRunner both go through it): a PlannerError is
    one line on stderr and its exit code; Ctrl-C and SIGTERM are "interrupted", exit 130. ZEROPIPE_DEBUG=1 prints
    the traceback before the line."""

    def invoke(self, ctx):
        from cost_models.records.fileio import release_outputs
        try:
            return super().invoke(ctx)
        except PlannerError as exc:
            _debug_traceback()
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:   # a path the system refuses (too long, no space, no permission) that no check named
            _debug_traceback()
            where = f": {exc.filename}" if exc.filename else ""
            print(f"error: {exc.strerror or exc}{where}; choose another path or free the resource "
                  f"(ZEROPIPE_DEBUG=1 shows where)", file=sys.stderr)
            raise typer.Exit(2) from None
        except BaseException as exc:
            if not interrupted(exc):
                raise
            _debug_traceback()
            _say_interrupted()
            raise typer.Exit(130) from None
        finally:
            release_outputs()   # the command's output claims (_prepare_output), however it ended


def _start_rank_server(*modules: str) -> None:
    """Before a command that starts ranks imports torch: the rank server imports what the ranks need meanwhile
    (cost_models.torch_compat.elastic.start_rank_server)."""
    from cost_models.torch_compat.elastic import start_rank_server
    start_rank_server(*modules)


def _debug_traceback() -> None:
    """Under ZEROPIPE_DEBUG=1, the traceback: a failed rank's own (RunFailed.rank_traceback), else this process's."""
    if os.environ.get("ZEROPIPE_DEBUG") == "1":
        rank_traceback = getattr(sys.exc_info()[1], "rank_traceback", "")
        if rank_traceback:
            print(f"the failing rank's traceback:\n{rank_traceback}", file=sys.stderr)
        else:
            traceback.print_exc()


app = typer.Typer(cls=_ErrorBoundary, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="zeropipe: profile a model and a cluster, plan ZeRO / pipeline / hybrid training, run it.")
# Options and arguments several commands share, declared once (typer's Annotated form; each command sets the default).
Force = Annotated[bool, typer.Option("--force", "-f", help="overwrite the output file(s) if they exist")]
AsJson = Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")]
Output = Annotated[Path, typer.Option("--output", "-o", help="where to write the file ('-' for none)")]
Nodes = Annotated[Optional[int], typer.Option("--nodes", help="scale the cluster (a preset or cluster file) to N nodes")]
ClusterOverride = Annotated[Optional[str], typer.Option(
    "--cluster", help="plan for a preset (see `planner presets`) or a cluster file instead of the profile's cluster")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="bf16-mixed | fp32")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="adamw | adam | sgd")]
TopK = Annotated[int, typer.Option("--top-k", help="alternatives to keep, with why each lost")]
EPDegree = typer.Option(1, "--ep", help="expert-parallel degree: routed experts split over groups of ep data-parallel "
                        "ranks (divides --dp and the experts; MoE models)")
CPDegree = typer.Option(1, "--cp", help="context-parallel degree: each sequence split over cp ranks (a power of two; "
                        "2 x cp divides the sequence length; dp x cp ranks shard the parameters)")
SeqLenAt = typer.Option(None, "--seq-len", "-s", help="tokens per sequence to plan for (default: the profile's); "
                        "a profile at another length is scaled: attention's FLOPs by the square of the ratio, the "
                        "rest by the ratio (dense models using scaled_dot_product_attention)")
MoEImbalance = typer.Option(None, "--moe-imbalance", help="MoE models: the busiest expert-parallel rank's routed "
                            "tokens over the mean that expert parallelism is priced at (default: the profile's "
                            "measured routing, else 1.25)")
TimeLimit = Annotated[Optional[float], typer.Option("--time-limit", help="seconds for the MILP cross-check of the winner's stage cut (the exact DP chooses it); default: up to 1 s where the MILP can settle it (units x stages <= 256), skipped on larger cuts")]
WithReport = Annotated[bool, typer.Option("--report/--no-report", help="write report.html and report.md beside the plan")]
ProfileArg = Annotated[Path, typer.Argument(metavar="PROFILE", help="profile.json from `planner profile`")]
PlanArg = Annotated[Path, typer.Argument(metavar="PLAN", help="plan.json from `planner plan`")]

# A pipe gets a wide fixed width so tables are not truncated to 80 columns.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _command_line() -> str:
    return shlex.join(["planner", *sys.argv[1:]])


def _confirm_overwrite(path: Path, force: bool) -> bool:
    """Overwrite only with --force, or after a yes at an interactive prompt."""
    if force or not path.exists():
        return force
    if sys.stdin.isatty():
        return typer.confirm(f"{path} exists. Overwrite?", default=False, err=True)
    return False


def _prepare_output(output: Path, force: bool, *, also: tuple[Path, ...] = (),
                    claim: bool = True) -> tuple[Path | None, bool]:
    """(where to write or None for '-', may overwrite): refuses, before any work, to clobber a user's file or to
    start work whose output cannot be written."""
    from cost_models.records.errors import OutputExistsError
    from cost_models.records.fileio import check_writable, claim_output
    write_to = None if str(output) == "-" else output
    for path in (write_to, *also) if write_to else ():
        check_writable(path)
        if claim:   # a second command writing it is refused now, not at its end
            claim_output(path, " ".join(sys.argv))
    overwrite = _confirm_overwrite(write_to, force) if write_to else False
    for path in (write_to, *also) if write_to else ():
        if path.exists() and not overwrite:
            raise OutputExistsError(f"{path} already exists; pass --force to overwrite it or -o to write elsewhere")
    return write_to, overwrite


def _emit(record, write_to: Path | None, overwrite: bool, as_json: bool) -> bool:
    """Save the file (a FileRecord) atomically; with --json print it. True when JSON was printed (the caller stops
    there)."""
    if write_to:
        record.save(write_to, overwrite=overwrite)
    if as_json:
        print(record.dumps(), end="")
    return as_json


def _progress(*, counts: bool = True) -> Progress:
    """A bar on stderr with elapsed and remaining time; `counts` shows done/total (items), else a percentage (the
    profiler reports shares of its expected time). The time left is the whole task's average rate applied to
    what remains (rich's default averages the last 30 s only, and a profiled unit can take longer than that)."""
    amount = MofNCompleteColumn() if counts else TaskProgressColumn()
    return Progress(TextColumn("{task.description}"), BarColumn(), amount, TimeElapsedColumn(), TextColumn("left"),
                    TimeRemainingColumn(), console=err, transient=True, speed_estimate_period=7 * 24 * 3600)


LONG_PROFILE_S = 30.0   # real-mode profiles whose timed runs will take longer than this say so when they start


def _table(columns: list[str], rows: list[list[str]], title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    return table


@app.command()
def profile(
    model: str = typer.Option(..., "--model", "-m", help="zoo name (see `planner models`), package.module:factory, or hf:TYPE[?k=v&...]"),
    micro_batch_size: int = typer.Option(..., "--micro-batch-size", "-b", help="sequences per micro-batch"),
    seq_len: int = typer.Option(..., "--seq-len", "-s", help="tokens per sequence"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (fp32 on CPU, where ranks run fp32; bf16 on a GPU and with --meta) | bf16 | fp32 | fp16"),
    meta: bool = typer.Option(False, "--meta", help="build on the meta device: exact counts, no weights, no timings"),
    device: str = typer.Option("auto", "--device", help="real mode: auto (the GPU when torch sees one, else CPU) | cpu | cuda"),
    units: Optional[str] = typer.Option(None, "--units", help="pipeline units as module names: 'a+b,c,d' ('+' joins modules of one unit)"),
    input_fn: Optional[str] = typer.Option(None, "--input", help="package.module:function(batch_size, seq_len) -> input, for module:factory models"),
    tp_plan: Optional[str] = typer.Option(None, "--tp-plan", help="package.module:function(model) -> [(pattern, style[, parts])]: a tensor-parallel plan, recorded in the profile"),
    cluster: str = typer.Option("local", "--cluster", help="local (probe this machine) | a preset (see `planner presets`) | a cluster file | none"),
    nodes: Nodes = None,
    ranks: Optional[int] = typer.Option(None, "--ranks", help="local probe: ranks to start (default: GPUs, or 4 CPU ranks)"),
    probe_sizes: Optional[str] = typer.Option(None, "--probe-sizes", help="local probe: message sizes, e.g. 4K..64M or 64K,1M,16M"),
    threads: int = typer.Option(1, "--threads", help="torch threads while timing units (real mode); 1 = as each CPU rank runs"),
    repeats: int = typer.Option(5, "--repeats", help="timed repeats per unit (real mode) and per probe size"),
    warmup: int = typer.Option(2, "--warmup", help="untimed warm-up runs per unit (real mode)"),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="MoE models, with --data: trained weights (an HF folder or a checkpoint) the router's load per expert is measured through"),
    data: Optional[Path] = typer.Option(None, "--data", help="MoE models, with --init-from: a token file (.bin uint16 or .npy) whose windows are routed to measure the load per expert (the imbalance expert parallelism is priced at)"),
    routing_windows: Optional[int] = typer.Option(None, "--routing-windows", help="with --data: sequences routed (the file's first windows, in planner run's order; default 64)"),
    output: Output = Path("profile.json"),
    force: Force = False,
    as_json: AsJson = False,
) -> None:
    """Measure a model unit by unit (parameters, FLOPs, activation bytes, times) and write profile.json."""
    from cost_models.profiling.cluster_source import check_cluster_args, parse_sizes, resolve_cluster
    from cost_models.records.files import ProfileFile
    from planner.summaries import UNIT_COLUMNS, unit_rows

    write_to, overwrite = _prepare_output(output, force)
    sizes = parse_sizes(probe_sizes) if probe_sizes else None
    check_cluster_args(cluster, nodes=nodes, ranks=ranks)
    if cluster != "local":  # presets and files before anything imports torch (its import alone takes seconds)
        cluster_prof = resolve_cluster(cluster, nodes=nodes, ranks=ranks, dtype=dtype, sizes=sizes)
    from cost_models.models.source import resolve
    from executor.routing import DEFAULT_WINDOWS, check_routing_args
    source = resolve(model, input_ref=input_fn)
    check_routing_args(init_from, data, routing_windows, source)
    prof = _profiled(source, tp_plan, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, meta=meta,
                     device=device, units=units, warmup=warmup, repeats=repeats, threads=threads)
    if init_from is not None and data is not None:
        prof = _routed(prof, init_from, data, routing_windows or DEFAULT_WINDOWS)
    if cluster == "local":
        cluster_prof = _probe(nodes=nodes, ranks=ranks, dtype=prof.dtype, sizes=sizes, repeats=repeats)
    if _emit(ProfileFile(model=prof, cluster=cluster_prof), write_to, overwrite, as_json):
        return
    out.print(_table(UNIT_COLUMNS, unit_rows(prof),
                     title=f"{prof.name} ({prof.mode}, {prof.dtype}, micro-batch {prof.micro_batch_size} x {prof.seq_len})"))
    _print_params(prof)
    if cluster_prof is not None:
        _print_cluster(cluster_prof)
    if write_to:
        err.print(f"wrote {write_to}", highlight=False)


def _profiled(source, tp_plan: str | None, **options):
    """profile_model of `source` under a progress bar (and the custom --tp-plan, imported here and recorded)."""
    from cost_models.models.tp_shape import custom_tp_plan
    from cost_models.profiling.model_profiler import SETTLE_S, profile_model
    from cost_models.records.formatting import about
    with _progress(counts=False) as bar, custom_tp_plan(tp_plan):
        task = bar.add_task(f"profiling {source.name}: forward pass of the whole model", total=None)
        def on_progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=f"profiling {source.name}: {name}")
        def on_estimate(seconds: float) -> None:
            if seconds >= LONG_PROFILE_S:
                err.print(f"profiling {source.name} in real mode: timing the units takes {about(seconds)} more (from "
                          f"one forward and backward of each, just run); --meta counts without timing in seconds",
                          highlight=False)
        return profile_model(source, command=_command_line(), on_progress=on_progress, on_estimate=on_estimate,
                             settle_s=SETTLE_S, **options)


def _routed(prof, init_from: Path, data: Path, windows: int):
    """`prof` with its load per expert measured on `data` through `init_from` (executor.routing)."""
    import torch

    from executor.routing import measure_routing
    device = "cuda" if prof.device == "gpu" or (prof.device == "meta" and torch.cuda.is_available()) else "cpu"
    with err.status(f"routing {windows} windows of {data} through {init_from}"):
        return measure_routing(prof, init_from=init_from, data=data, windows=windows, device=device,
                               on_warning=lambda line: err.print(f"warning: {line}", highlight=False))


def _print_params(prof) -> None:
    from cost_models.records.formatting import size
    tied = "; ".join(f"{s.name} = {', '.join(s.aliases)}" for s in prof.shared)
    out.print(f"parameters: {prof.total_params:,} ({size(prof.total_param_bytes)} at {prof.dtype})"
              + (f"; tied: {tied}" if tied else ""), highlight=False)
    if prof.unassigned_params:
        out.print(f"note: {prof.unassigned_params:,} parameters belong to no unit (counted in the total)", highlight=False)
    from planner.summaries import profile_load_line, routing_line
    for line in (profile_load_line(prof), routing_line(prof)):
        if line:
            out.print(line, highlight=False)
    for note in prof.timing_notes:   # what the profiler did about noise it saw (timing.pool_identical)
        out.print(f"note: {note}", highlight=False, soft_wrap=True)


def _probe(*, nodes, ranks, dtype, sizes, repeats):
    from cost_models.profiling.cluster_source import resolve_cluster
    with err.status("probing this machine's collectives and matmul rate"):
        return resolve_cluster("local", nodes=nodes, ranks=ranks, dtype=dtype, sizes=sizes, repeats=repeats,
                               on_status=lambda line: err.print(line, highlight=False))


def _print_cluster(cluster) -> None:
    from planner.summaries import CLUSTER_FIT_COLUMNS, cluster_fit_rows, cluster_lines
    for line in cluster_lines(cluster):
        out.print(line, highlight=False)
    if cluster.fits:
        out.print(_table(CLUSTER_FIT_COLUMNS, cluster_fit_rows(cluster), title="probed collectives: t(S) = alpha + S * beta"))


@app.command("profile-cluster")
def profile_cluster(
    cluster: str = typer.Option("local", "--cluster", help="local (probe this machine) | a preset | a cluster file"),
    nodes: Nodes = None,
    ranks: Optional[int] = typer.Option(None, "--ranks", help="local probe: ranks to start (default: GPUs, or 4 CPU ranks)"),
    probe_sizes: Optional[str] = typer.Option(None, "--probe-sizes", help="message sizes, e.g. 4K..64M or 64K,1M,16M"),
    repeats: int = typer.Option(5, "--repeats", help="timed repeats per probe size"),
    dtype: str = typer.Option("bf16", "--dtype", help="dtype of the compute probe"),
    output: Output = Path("cluster.json"),
    force: Force = False,
    as_json: AsJson = False,
) -> None:
    """Describe a cluster (probe this machine, or expand a preset / file) and write cluster.json."""
    from cost_models.profiling.cluster_source import parse_sizes, resolve_cluster
    from cost_models.records.errors import ConfigError
    from cost_models.records.files import ClusterFile

    if cluster == "none":
        raise ConfigError("--cluster none describes nothing; use local, a preset or a cluster file")
    write_to, overwrite = _prepare_output(output, force)
    sizes = parse_sizes(probe_sizes) if probe_sizes else None
    if cluster == "local":
        prof = _probe(nodes=nodes, ranks=ranks, dtype=dtype, sizes=sizes, repeats=repeats)
    else:
        prof = resolve_cluster(cluster, nodes=nodes, ranks=ranks, dtype=dtype, sizes=sizes)
    if _emit(ClusterFile(cluster=prof), write_to, overwrite, as_json):
        return
    _print_cluster(prof)
    if write_to:
        err.print(f"wrote {write_to}", highlight=False)


@app.command()
def presets(as_json: AsJson = False) -> None:
    """List the cluster presets (one node each; scale with --nodes)."""
    from cost_models.records.formatting import fixed
    from cost_models.records.presets import PRESETS
    if as_json:
        print(dumps({k: v.to_dict() for k, v in PRESETS.items()}), end="")
        return
    rows = [[p.name, f"{p.devices_per_node} x {p.device.name}",
             fixed(p.device.peak_flops["bf16"], "TFLOP/s", 0, show_unit=False),
             f"{p.intra_node.kind} {fixed(p.intra_node.bandwidth_Bps, 'GB/s', 0, show_unit=False)}",
             f"{p.inter_node.kind} {fixed(p.inter_node.bandwidth_Bps, 'GB/s', show_unit=False)}" if p.inter_node
             else "-"] for p in PRESETS.values()]
    out.print(_table(["preset", "node", "bf16 TFLOP/s", "intra GB/s (achievable)", "inter GB/s per GPU"], rows))


@app.command()
def models(as_json: AsJson = False) -> None:
    """List the built-in model zoo."""
    from cost_models.models.zoo import ZOO
    rows = [[e.name, e.family, e.input_kind, str(e.max_seq_len or "-"), e.description] for e in ZOO.values()]
    if as_json:
        print(dumps([e.to_dict() for e in ZOO.values()]), end="")
        return
    out.print(_table(["name", "family", "input", "max seq", "description"], rows))


@app.command()
def demo(out_dir: Path = typer.Option(Path("zeropipe-demo"), "--out-dir", help="folder for the demo's files (its own, overwritten on rerun)")) -> None:
    """Run the main job on a built-in default model on this machine."""
    from executor.demo import run_demo
    from planner.summaries import UNIT_COLUMNS, unit_rows

    with _progress(counts=False) as bar:
        task = bar.add_task("demo: profiling", total=None)
        def on_progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=f"demo: profiling {name}")
        result = run_demo(out_dir, command=_command_line(), on_progress=on_progress,
                          on_status=lambda line: bar.update(task, description=f"demo: {line}"))
    from cost_models.records.files import ProfileFile
    pf = ProfileFile.load(result.profile_path)
    prof = pf.model
    out.print(_table(UNIT_COLUMNS, unit_rows(prof), title=f"{prof.name}: measured on this machine "
                     f"({prof.dtype}, micro-batch {prof.micro_batch_size} x {prof.seq_len}, {prof.threads} thread(s))"))
    _print_params(prof)   # with the load while the units were timed: the predictions below inherit it
    _print_cluster(pf.cluster)
    _print_plan(result.plan)
    _print_run(result.run)
    out.print(f"wrote {result.profile_path}, {result.plan_path}, {result.run_path} and {result.report_path} "
              f"(+ .md)", highlight=False)


@app.command()
def estimate(
    profile_path: ProfileArg,
    dp: int = typer.Option(1, "--dp", help="data-parallel degree (the ZeRO group)"),
    pp: int = typer.Option(1, "--pp", help="pipeline degree"),
    zero: int = typer.Option(0, "--zero", help="ZeRO stage over dp: 0, 1, 2, 3"),
    distributed_optimizer: bool = typer.Option(
        False, "--distributed-optimizer", help="ZeRO-1 as Megatron-LM's distributed optimizer: parameters gathered "
        "ahead of the forward, gradients reduce-scattered in fp32 on the last micro-batch (--zero 1, --pp 1)"),
    schedule: str = typer.Option(DEFAULT_SCHEDULE, "--schedule", help=" | ".join(SCHEDULES)),
    microbatches: int = typer.Option(1, "--microbatches", "-m", help="micro-batches per step"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", "-b", help="default: the profile's"),
    v: int = typer.Option(1, "--v", help="stage chunks per rank (interleaved and V schedules)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel degree: a power of two dividing the GPUs per node (mesh (pp, dp, tp), TP groups stay inside a node)"),
    sp: bool = typer.Option(False, "--sp", help="sequence parallelism over the tensor-parallel group (needs --tp 2 or more)"),
    async_tp: bool = typer.Option(False, "--async-tp", help="overlap SP's all-gathers and reduce-scatters with their "
                                  "matmuls (torch's micro-pipelined TP; CUDA GPUs, needs --sp)"),
    sp_save_shard: bool = typer.Option(False, "--sp-save-shard", help="save SP's gathered inputs as their sequence "
                                       "shard and gather them again in backward, as Megatron-LM (needs --sp)"),
    ep: int = EPDegree,
    cp: int = CPDegree,
    seq_len: Optional[int] = SeqLenAt,
    moe_imbalance: Optional[float] = MoEImbalance,
    recompute: str = typer.Option("none", "--recompute", help="none | selective (the attention core) | full (or all) | stage indices, e.g. 0,1"),
    precision: PrecisionOpt = "bf16-mixed",
    optimizer: OptimizerOpt = "adamw",
    cluster: ClusterOverride = None,
    nodes: Nodes = None,
    as_json: AsJson = False,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="also write plan.json of exactly this strategy, for `planner run`")] = None,
    force: Force = False,
) -> None:
    """Predict step time and per-rank memory of one strategy; exit 3 if it does not fit. With -o, write it as a plan
    (the same format as `planner plan`'s, chosen by hand) that `planner run` runs."""
    from cost_models.cost.estimate import estimate as run_estimate
    from cost_models.records.precision import Optimizer, Precision, check_training
    from planner.manual import (StrategyRequest, build_strategy, check_fits, executor_refuses, load_profile_for,
                                manual_plan)
    from planner.summaries import estimate_json
    check_training(precision, optimizer)   # before any file is read
    write_to, overwrite = _prepare_output(output, force) if output else (None, False)
    pf, target = _with_imbalance(load_profile_for(profile_path, cluster=cluster, nodes=nodes, seq_len=seq_len),
                                 moe_imbalance)
    _warn_loaded_profile(pf.model, target, precision)
    strategy = build_strategy(pf.model, target, StrategyRequest(
        dp=dp, pp=pp, zero=zero, schedule=schedule, microbatches=microbatches, micro_batch_size=micro_batch_size, v=v,
        tp=tp, sp=sp, recompute=recompute, distributed_optimizer=distributed_optimizer, async_tp=async_tp,
        sp_save_shard=sp_save_shard, ep=ep, cp=cp, precision=cast(Precision, precision),
        optimizer=cast(Optimizer, optimizer)))   # check_training: no other
    est = run_estimate(strategy, pf.model, target)
    if as_json:
        print(dumps(estimate_json(strategy, est, target.device.name)), end="")
    else:
        _print_estimate(strategy, est, target.device.name, refused=executor_refuses(strategy, pf.model))
    check_fits(est)
    if write_to:   # refused (one line, exit 2) where planner run would refuse it
        manual_plan(strategy, pf.model, target, profile_path=str(profile_path),
                    command=_command_line()).save(write_to, overwrite=overwrite)
        err.print(f"wrote {write_to}", highlight=False)


def _with_imbalance(loaded, moe_imbalance: float | None):
    """(profile file, cluster) with `--moe-imbalance` set on the file's model (ModelProfile.moe_imbalance), checked."""
    import dataclasses

    from cost_models.records.errors import ConfigError
    pf, target = loaded
    if moe_imbalance is None:
        return pf, target
    if not 1.0 <= moe_imbalance <= 64.0:
        raise ConfigError(f"--moe-imbalance is the busiest expert-parallel rank's routed tokens over the mean: "
                          f"1 (even) to 64, got {moe_imbalance}")
    if not pf.model.moe_units:
        raise ConfigError(f"--moe-imbalance prices routed experts, and {pf.model.name} has no mixture-of-experts "
                          f"blocks; drop it")
    return dataclasses.replace(pf, model=dataclasses.replace(pf.model, moe_imbalance=moe_imbalance)), target


def _print_estimate(strategy, est, device: str, *, refused: str | None = None) -> None:
    """The estimate's lines and memory table; `refused`: why `planner run` would refuse the strategy (the estimate
    stands; the planner never offers it)."""
    from cost_models.records.formatting import fixed
    from cost_models.records.published import implausible_mfu
    from planner.summaries import MEMORY_COLUMNS, estimate_lines, memory_rows
    for line in estimate_lines(strategy, est):
        out.print(line, highlight=False)
    out.print(_table(MEMORY_COLUMNS, memory_rows(est), title=f"memory per rank (GiB = 2^30 B), capacity "
                     f"{fixed(est.capacity_bytes, 'GiB')}"))
    warning = implausible_mfu(est.mfu, device, strategy.precision)
    if warning:
        err.print(f"warning: {warning}", highlight=False, soft_wrap=True)
    if refused:
        err.print(f"note: planner run would refuse this strategy: {refused}", highlight=False, soft_wrap=True)


@app.command()
def plan(
    profile_path: ProfileArg,
    gpus: Optional[int] = typer.Option(None, "--gpus", "-g", help="devices to plan for (default: all of the cluster)"),
    global_batch_size: int = typer.Option(..., "--global-batch-size", "-B", help="sequences per optimizer step"),
    cluster: ClusterOverride = None,
    nodes: Nodes = None,
    top_k: TopK = 5,
    time_limit: TimeLimit = None,
    precision: PrecisionOpt = "bf16-mixed",
    optimizer: OptimizerOpt = "adamw",
    tp: Optional[str] = typer.Option(None, "--tp", help="tensor-parallel degrees to search, e.g. 1 (none) or 1,2,4 (default: every power of two the model and the nodes admit)"),
    ep: Optional[str] = typer.Option(None, "--ep", help="MoE models: expert-parallel degrees to search, e.g. 1 (none) or 1,8,64 (default: every power of two dividing the experts)"),
    cp: Optional[str] = typer.Option(None, "--cp", help="context-parallel degrees to search, e.g. 1 (none) or 1,8,16 (default: 1 below 16,384 tokens per sequence; from there every power of two whose 2 x cp chunks divide the sequence and hold 1,024 tokens or more)"),
    seq_len: Optional[int] = SeqLenAt,
    moe_imbalance: Optional[float] = MoEImbalance,
    output: Output = Path("plan.json"),
    force: Force = False,
    as_json: AsJson = False,
    report: WithReport = True,
    verify: int = typer.Option(0, "--verify", help="after the search, run the top K candidates that this machine can host for a few steps each and keep the measured best; predicted and measured of each go into plan.json (default 0: no trials)"),
    verify_steps: int = typer.Option(3, "--verify-steps", help="timed steps per --verify candidate, after two warm-up steps"),
    verify_timeout: float = typer.Option(120.0, "--verify-timeout", help="seconds one --verify candidate may take, start-up included, before its ranks are stopped and it counts as failed"),
) -> None:
    """Search every strategy (tensor parallelism x ZeRO 0-3 x pipeline depth x schedule x micro-batching x
    recompute), pick the fastest that fits, and explain why; writes plan.json. With --verify K, run the top K for
    a few steps here and keep the measured best."""
    from cost_models.records.precision import Optimizer, Precision
    from planner.manual import load_profile_for
    from planner.request import PlanRequest, parse_degrees
    from planner.search import plan as run_plan

    outputs = _plan_outputs(output, force, report)
    if verify:
        _start_rank_server("executor.launch")
    verify_cfg = _verify_config(verify, verify_steps, verify_timeout) if verify else None
    pf, target = _with_imbalance(load_profile_for(profile_path, cluster=cluster, nodes=nodes, seq_len=seq_len),
                                 moe_imbalance)
    _warn_loaded_profile(pf.model, target, precision)
    # typer passes any string; the search refuses other precisions and optimizers (PlanRequest.resolved_gpus)
    request = PlanRequest(gpus=gpus, global_batch_size=global_batch_size, top_k=max(top_k, verify),
                          time_limit_s=time_limit, precision=cast(Precision, precision),
                          optimizer=cast(Optimizer, optimizer), tp_degrees=parse_degrees(tp) if tp else None,
                          ep_degrees=parse_degrees(ep, "--ep") if ep else None,
                          cp_degrees=parse_degrees(cp, "--cp") if cp else None)
    result = _planning("planning", lambda on_progress: run_plan(
        pf.model, target, request, profile_path=str(profile_path), command=_command_line(), on_progress=on_progress))
    if verify_cfg:
        result = _verifying(result, pf.model, verify_cfg)
    write_to = outputs[0]
    if _emit_plan(result, outputs, as_json):
        return
    _print_plan(result)
    if result.trials:
        from planner.report import TRIAL_COLUMNS, trial_rows
        out.print(_table(TRIAL_COLUMNS, trial_rows(result), title="verified on this machine (--verify)"))
    if write_to:
        err.print(f"wrote {write_to}", highlight=False)


def _warn_loaded_profile(profile, cluster, precision: str) -> None:
    """One line on stderr where the predictions use unit times (compute.uses_measured_times) that were taken on an
    overloaded machine (summaries.profile_loaded): they inherit the wait for a core. A note where the cluster probe
    saw other programs' tasks (summaries.cluster_conditions), a warning where the cluster's calibration was fitted
    on runs of other models (calibration_mismatch), and a note where the profile was measured at another sequence
    length (--seq-len: cost.lengths.length_line)."""
    from cost_models.cost.compute import uses_measured_times
    from cost_models.cost.lengths import length_line
    from planner.summaries import calibration_mismatch, cluster_conditions, profile_load_line, profile_loaded
    if profile_loaded(profile) and uses_measured_times(profile, cluster, precision):
        err.print(f"warning: {profile_load_line(profile)}", highlight=False, soft_wrap=True)
    for line in cluster_conditions(cluster):
        err.print(f"note: {line}", highlight=False, soft_wrap=True)
    scaled = length_line(profile)
    if scaled:
        err.print(f"note: {scaled}", highlight=False, soft_wrap=True)
    mismatch = calibration_mismatch(profile, cluster)
    if mismatch:
        err.print(f"warning: {mismatch}", highlight=False, soft_wrap=True)


def _verify_config(k: int, steps: int, timeout_s: float):
    """--verify's settings, refused in one line before the search if out of range (executor.verify)."""
    from executor.verify import VerifyConfig
    cfg = VerifyConfig(k=k, steps=steps, timeout_s=timeout_s)
    cfg.check()
    return cfg


def _verifying(the_plan, profile, cfg):
    """Run the plan's top candidates (executor.verify.verify); one line on stderr as each ends."""
    from cost_models.records.formatting import duration
    from executor.verify import verify

    def ended(i: int, t) -> None:
        how = (f"measured {duration(t.measured_s)}, predicted {duration(t.predicted_s)} (x{t.ratio:.2f})"
               if t.measured_s is not None else t.failure)
        err.print(f"verify {i + 1}: {t.strategy}: {how}", highlight=False, soft_wrap=True)
    with err.status(f"verify: running up to {cfg.k} candidates, {cfg.warmup} + {cfg.steps} steps each"):
        return verify(the_plan, profile, cfg, on_trial=ended)


def _plan_outputs(output: Path, force: bool, report: bool) -> tuple[Path | None, bool, Path | None]:
    """(plan path or None, overwrite, report.html path or None), refused up front if any would overwrite a file."""
    report_path = _report_path(output) if str(output) != "-" and report else None
    write_to, overwrite = _prepare_output(output, force, also=(report_path, report_path.with_suffix(".md"))
                                          if report_path else ())
    return write_to, overwrite, report_path


def _planning(label: str, search):
    """Run `search(on_progress)` under a progress bar."""
    with _progress() as bar:
        task = bar.add_task(f"{label}: costing strategies", total=None)
        return search(lambda done, total: bar.update(task, completed=done, total=total))


def _emit_plan(result, outputs: tuple[Path | None, bool, Path | None], as_json: bool) -> bool:
    """Write the plan (and its report); True when it went to stdout as JSON (print nothing else)."""
    write_to, overwrite, report_path = outputs
    printed = _emit(result, write_to, overwrite, as_json)
    if report_path:
        _write_report(result, None, report_path, overwrite)
    return printed


def _report_path(plan_path: Path) -> Path:
    """plan.json -> report.html beside it; other names keep their stem (myplan.json -> myplan.html)."""
    stem = "report" if plan_path.stem == "plan" else plan_path.stem
    return plan_path.with_name(stem + ".html")


def _write_report(the_plan, the_run, html_path: Path, overwrite: bool) -> tuple[Path, Path]:
    """report.html and report.md with the same content (planner.report); the caller checked for clobbering."""
    from cost_models.records.fileio import write_atomic
    from planner.report import render_html, render_markdown
    md_path = html_path.with_suffix(".md")
    write_atomic(html_path, render_html(the_plan, the_run), overwrite=overwrite)
    write_atomic(md_path, render_markdown(the_plan, the_run), overwrite=overwrite)
    err.print(f"wrote {html_path} and {md_path}", highlight=False)
    return html_path, md_path


@app.command("report")
def report_cmd(
    plan_path: PlanArg,
    run_path: Optional[Path] = typer.Option(None, "--run", help="run.json from `planner run`: adds predicted vs measured"),
    output: Path = typer.Option(Path("report.html"), "--output", "-o", help="the HTML file; the Markdown goes beside it"),
    force: Force = False,
) -> None:
    """Write a plan report for review: report.html (self-contained, SVG pictures) and report.md."""
    from planner.plan import Plan
    from planner.run_record import load_run
    _, overwrite = _prepare_output(output, force, also=(output.with_suffix(".md"),))
    the_plan = Plan.load(plan_path)
    the_run = load_run(run_path, the_plan) if run_path else None
    _write_report(the_plan, the_run, output, overwrite)


def _print_plan(p) -> None:
    from cost_models.records.formatting import duration, fixed
    r, pv = p.rationale, p.provenance
    out.print(f"{p.model.name} on {p.gpus} x {p.cluster.device.name} ({p.cluster.name}), global batch "
              f"{p.global_batch_size} x {p.model.seq_len}", highlight=False)
    for line in r.lines:
        out.print(line, highlight=False)
    _print_estimate(p.strategy, p.prediction, p.cluster.device.name)
    from planner.report import mesh_cell
    gib = (lambda n: fixed(n, "GiB", show_unit=False))
    rows = [[p.strategy.name, mesh_cell(p.strategy), duration(p.prediction.step_time_s),
             gib(p.prediction.peak_memory_bytes), "chosen"]]
    rows += [[a.strategy.name, mesh_cell(a.strategy), duration(a.step_time_s), gib(a.peak_memory_bytes),
              a.lost_because] for a in p.alternatives]
    out.print(_table(["strategy", "pp x dp x tp", "step time", "peak GiB", "why not"], rows, title="top candidates"))
    out.print(f"searched {pv.points_considered} points: {pv.points_pruned} pruned, {pv.points_costed} estimates, "
              f"{duration(pv.planning_time_s)}; partition {pv.partitioner}, MILP {pv.milp_status}", highlight=False)


@app.command()
def run(
    plan_path: PlanArg,
    steps: int = typer.Option(6, "--steps", help="training steps to run"),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="first steps left out of the timing (default 2, fewer when the run makes 2 or fewer steps)"),
    output: Output = Path("run.json"),
    force: Force = False,
    nnodes: int = typer.Option(1, "--nnodes", help="nodes (run the same command on each)"),
    node_rank: int = typer.Option(0, "--node-rank", help="this node's rank"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (default 127.0.0.1, any free port)"),
    timeout: float = typer.Option(60.0, "--timeout", help="seconds a collective may wait before the job fails"),
    seed: Optional[int] = typer.Option(None, "--seed", help="initialisation and data seed (default 0, or the checkpoint's)"),
    lr: Optional[float] = typer.Option(None, "--lr", help="learning rate (default 1e-3, or the checkpoint's)"),
    checkpoint_dir: Optional[Path] = typer.Option(None, "--checkpoint-dir", help="save checkpoints (DCP, one folder per step) here, signed with this installation's key: the file $ZEROPIPE_CHECKPOINT_KEY names, else $XDG_CONFIG_HOME/zeropipe/checkpoint.key or ~/.config/zeropipe/checkpoint.key (made on the first save); give machines that resume each other's checkpoints the same key file"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="save after every K steps (default: after the last step only)"),
    checkpoint_keep: int = typer.Option(0, "--checkpoint-keep", help="keep only the newest K checkpoints (default: all)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue from a checkpoint: a step folder, or a --checkpoint-dir (its latest complete one); any plan of the same model and batch"),
    overwrite_checkpoints: bool = typer.Option(False, "--overwrite-checkpoints", help="replace checkpoints in --checkpoint-dir past the step this run starts at"),
    trust_checkpoint: bool = typer.Option(False, "--trust-checkpoint", help="--resume from a checkpoint this installation's key did not sign (see --checkpoint-dir; ZEROPIPE_CHECKPOINT_KEY names another key file): loading it runs code stored in it (torch DCP unpickles .metadata), so only for checkpoints you made or trust who made; sizes and sha256 are still checked"),
    data: Optional[Path] = typer.Option(None, "--data", help="train on a token file: nanoGPT's uint16 .bin or a 1-d .npy (uint16/uint32/int32/int64), memory-mapped; step k reads windows k*B .. k*B+B-1 of seq_len+1 tokens (default: synthetic tokens)"),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="start from pretrained weights instead of the model's own initialisation: an HF folder (config.json + model.safetensors or a sharded index) or a planner run checkpoint; each rank reads only what it holds"),
    allow_extra: bool = typer.Option(False, "--allow-extra", help="load --init-from even where it holds tensors the model has no place for (refused by default: a sign of another configuration); they are named and left unread"),
    loss: Optional[str] = typer.Option(None, "--loss", help="package.module:fn, fn(logits, targets) -> scalar: the loss on the model's logits and the step's targets (next-token ids for a token model), instead of cross-entropy; checked on the meta model before any rank starts"),
    as_json: AsJson = False,
) -> None:
    """Run a plan with real torch.distributed code (torchrun's launcher) and compare it with its prediction.
    --steps counts from the start of training: with --resume at step k, steps k .. STEPS-1 run."""
    from planner.plan import Plan
    # every node runs this command; only node 0 writes -o (the others would claim it against each other)
    write_to, overwrite = _prepare_output(output, force, claim=node_rank == 0)
    the_plan = Plan.load(plan_path)   # before torch is imported (seconds): a bad plan file fails at once
    _start_rank_server("executor.launch")
    from executor.launch import RunConfig, launch

    config = RunConfig(steps=steps, warmup=warmup, seed=seed, lr=lr, nnodes=nnodes, node_rank=node_rank,
                       rdzv_endpoint=rdzv_endpoint, timeout_s=timeout,
                       checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                       checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep,
                       resume=str(resume) if resume else None, overwrite_checkpoints=overwrite_checkpoints,
                       trust_checkpoint=trust_checkpoint, data=str(data) if data else None,
                       init_from=str(init_from) if init_from else None, allow_extra=allow_extra, loss=loss)
    with err.status(f"running {the_plan.strategy.world_size} ranks up to step {steps}"):
        result = launch(the_plan, config, on_resume=lambda d, meta, signed: _print_resume(
            d, meta, the_plan, signed=signed, saving=checkpoint_dir is not None),
            on_warning=lambda line: err.print(f"warning: {line}", highlight=False, soft_wrap=True))
    if result is None:
        err.print("this node's ranks finished; global rank 0's node writes run.json", highlight=False)
        return
    if _emit(result, write_to, overwrite, as_json):
        return
    _print_run(result)
    if write_to:
        err.print(f"wrote {write_to}", highlight=False)


@app.command()
def calibrate(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN", help="run.json files from `planner run`, or folders holding one (the demo's folder)")],
    plans: Annotated[Optional[list[Path]], typer.Option("--plan", help="plan.json a run ran, if it is not beside its run.json (repeat; each run is matched to its plan by strategy and prediction)")] = None,
    output: Output = Path("cluster.json"),
    force: Force = False,
    any_factor: bool = typer.Option(False, "--any-factor", help="keep a fitted factor beyond x10 either way "
                                    "(refused by default: such runs measured something else than their plans)"),
    as_json: AsJson = False,
) -> None:
    """Fit what runs measured (compute, optimizer, per-action and data-parallel costs) and write the plans' cluster
    with that calibration; plan with it by `planner plan PROFILE --cluster cluster.json`."""
    from cost_models.records.files import ClusterFile
    from planner.calibrate import calibrate as run_calibrate
    write_to, overwrite = _prepare_output(output, force)
    cluster, fitted = run_calibrate(runs, plans or (), any_factor=any_factor)
    if _emit(ClusterFile(cluster=cluster), write_to, overwrite, as_json):
        return
    _print_calibration(cluster.calibration, fitted)
    if write_to:
        err.print(f"wrote {write_to}; plan with it: planner plan PROFILE --cluster {write_to} ...", highlight=False)


def _print_calibration(cal, fitted) -> None:
    from cost_models.records.formatting import duration
    rows = [[r.path, r.strategy, duration(r.measured_step_s), duration(r.predicted_before_s),
             duration(r.predicted_after_s)] for r in cal.runs]
    out.print(_table(["run", "strategy", "measured step", "predicted", "calibrated"], rows,
                     title=f"{cal.describe()} (step time: slowest rank's median)"))
    action = duration(cal.pipeline_action_s) if cal.pipeline_action_s is not None else "as probed"
    out.print(f"fitted: {', '.join(fitted.fitted)}; cluster now: compute x {cal.compute_scale:.3f}, optimizer x "
              f"{cal.optimizer_scale:.3f}, data-parallel comm x {cal.dp_comm_scale:.3f}, per pipeline action "
              f"{action}", highlight=False)
    out.print(f"step-time MAPE over these runs: {fitted.mape_before:.1%} as planned, {fitted.mape_after:.1%} "
              f"calibrated (in-sample)", highlight=False)


@app.command()
def replan(
    gpus: int = typer.Option(..., "--gpus", "-g", help="devices the job will have from now on"),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="a --checkpoint-dir (its latest complete checkpoint) or one step folder"),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="the profile to plan with (default: the one the checkpoint's plan was made from, if unchanged)"),
    cluster: Optional[str] = typer.Option(None, "--cluster", help="plan for a preset or cluster file (default: the checkpoint plan's cluster)"),
    nodes: Nodes = None,
    top_k: TopK = 5,
    time_limit: TimeLimit = None,
    output: Output = Path("plan.json"),
    force: Force = False,
    as_json: AsJson = False,
    report: WithReport = True,
    trust_checkpoint: bool = typer.Option(False, "--trust-checkpoint", help="re-plan from a checkpoint this installation's key did not sign (see planner run --checkpoint-dir): the new plan takes its model, which `planner run` imports, from the checkpoint"),
) -> None:
    """Re-plan a checkpointed job for another GPU count (same model, batch, precision, optimizer); then
    `planner run PLAN --resume CHECKPOINT` carries its training state over."""
    from executor.checkpoint_layout import read_verified, resolve
    from planner.replan import replan as run_replan

    step_dir = resolve(checkpoint)
    # only the JSON listing is read here (no pickle), but the plan written from it names the model code every rank
    # of `planner run` imports, with or without --resume: the same signature as a resume
    meta, _ = read_verified(step_dir, trusted=trust_checkpoint)
    outputs = _plan_outputs(output, force, report)
    result = _planning("re-planning", lambda on_progress: run_replan(
        meta.plan, gpus=gpus, profile_path=str(profile_path) if profile_path else None, cluster=cluster,
        nodes=nodes, top_k=top_k, time_limit_s=time_limit, command=_command_line(), on_progress=on_progress))
    write_to = outputs[0]
    for line in result.provenance.profile_conditions:   # how the profile it planned from was taken (or scaled)
        err.print(f"note: {line}", highlight=False, soft_wrap=True)
    if _emit_plan(result, outputs, as_json):
        return
    loss = f", loss {meta.loss:.4f}" if meta.loss is not None else ""
    out.print(f"checkpoint {step_dir}: step {meta.step}{loss}, trained as {meta.plan.strategy.name} on "
              f"{meta.world_size} ranks", highlight=False)
    _print_plan(result)
    if write_to:
        err.print(f"wrote {write_to}; continue training with: planner run {write_to} --resume {checkpoint} "
                  f"--steps N", highlight=False)


def _print_resume(step_dir, meta, the_plan, *, signed: bool, saving: bool) -> None:
    was, now = meta.plan.strategy.name, the_plan.strategy.name
    how = "same plan" if meta.plan.strategy == the_plan.strategy else f"resharded from {was} on {meta.world_size} ranks to {now}"
    checked = "signature and checksums verified" if signed else "checksums verified (not signed: --trust-checkpoint)"
    err.print(f"resuming at step {meta.step} ({meta.samples_seen:,} sequences seen) from {step_dir}, {checked}; "
              f"{how}", highlight=False)
    if not saving:   # --resume only reads: saving again is a separate choice (and another folder is allowed)
        err.print("this run saves no checkpoints: add --checkpoint-dir to keep saving", highlight=False)


def _print_run(r) -> None:
    from cost_models.records.formatting import duration, load_line
    from planner.report import MEASURE_COLUMNS, measure_rows
    first = f"steps {r.start_step}-{r.steps - 1}" if r.start_step else f"{r.steps} steps"
    out.print(f"ran {r.strategy_summary} on {r.world_size} ranks ({r.backend}), {first}, "
              f"{r.warmup} warm-up", highlight=False)
    out.print(f"loss per step (from step {r.start_step}): " + ", ".join(f"{x:.4f}" for x in r.losses), highlight=False)
    if r.resumed_from:
        out.print(f"resumed from {r.resumed_from}: loaded in {duration(max(x.restore_s for x in r.ranks))} (slowest "
                  f"rank)", highlight=False)
    if r.checkpoints:
        save_s = max((s for x in r.ranks for s in x.checkpoint_s), default=0.0)
        out.print(f"checkpoints: {len(r.checkpoints)} saved (slowest save {duration(save_s)}), latest "
                  f"{r.checkpoints[-1]}", highlight=False)
    out.print(_table(MEASURE_COLUMNS, measure_rows(r), title="predicted vs measured"))
    out.print(f"throughput: {r.tokens_per_s:,.0f} {r.throughput_unit}/s measured", highlight=False)
    if r.load_1min:
        out.print(load_line(r.load_1min, r.cpus, r.world_size), highlight=False)


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(metavar="CHECKPOINT", help="a step folder written by planner run --checkpoint-dir (or that folder: its latest complete checkpoint)")],
    hf: Optional[Path] = typer.Option(None, "--hf", help="write a transformers folder (config.json + safetensors) that AutoModelForCausalLM.from_pretrained(DIR) loads; hf: models only"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="write one safetensors file of the full state dict under the model's own parameter names, any model (default: model.safetensors, when --hf is not given)"),
    force: Force = False,
    trust_checkpoint: bool = typer.Option(False, "--trust-checkpoint", help="export a checkpoint this installation's key did not sign (see planner run --checkpoint-dir): reading it runs code stored in it (torch DCP unpickles .metadata), so only for checkpoints you made or trust who made; sizes and sha256 are still checked"),
    as_json: AsJson = False,
) -> None:
    """Write a checkpoint's model weights for other tools: a transformers folder (--hf DIR) or one safetensors
    file (-o FILE). Optimizer and RNG states are not read."""
    from executor import export as exporting

    target, _ = exporting.target_of(hf, output)
    overwrite = force or (exporting.occupied(target) and _confirm_overwrite(target, force))
    with err.status(f"exporting {checkpoint}"):
        result = exporting.export(checkpoint, hf_dir=hf, output=output, overwrite=overwrite, trusted=trust_checkpoint)
    if as_json:
        print(dumps(result.to_dict()), end="")
        return
    out.print(exporting.summary_line(result), highlight=False)


def _sigterm(signum, frame) -> None:
    raise KeyboardInterrupt   # handled like Ctrl-C: "interrupted", exit 130, files written atomically or not at all


_INTERRUPT_SAID: list[bool] = []   # whether "interrupted" was printed (once, whoever caught the signal)


def _say_interrupted() -> None:
    if not _INTERRUPT_SAID:
        _INTERRUPT_SAID.append(True)
        print("interrupted", file=sys.stderr)


def main() -> None:
    import signal
    try:   # a signal that arrives as the handler goes in is raised on this line: inside the boundary too
        signal.signal(signal.SIGTERM, _sigterm)
        app()
    except KeyboardInterrupt:   # before the commands' boundary (_ErrorBoundary) is entered: typer building it
        _say_interrupted()
        sys.exit(130)
    except SystemExit as exc:   # typer turns a Ctrl-C while it parses the command line into exit 130, silently
        if exc.code == 130:
            _say_interrupted()
        raise


if __name__ == "__main__":
    main()
