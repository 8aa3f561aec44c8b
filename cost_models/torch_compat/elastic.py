"""Helpers around torchrun's elastic launcher shared by the cluster probe and the executor.

Single-node jobs listen on no network port. torchrun's c10d rendezvous hosts a TCPStore, and the store the ranks
bootstrap from is another; TCPStore's server binds every interface whatever host it is given (measured with
`ss -ltnp` on torch 2.13: `*:PORT`) and has no authentication, so any host that can reach the machine could join
or feed the job. Locally there is no need for a network store: the rendezvous uses c10d's FileStore backend
(`rdzv_configs={"store_type": "file"}`, torch.distributed.elastic.rendezvous.c10d_rendezvous_backend), the agent
is told not to start its shared TCPStore (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, dynamic_rendezvous.py), and the
ranks build their process group on a FileStore in a private temporary folder (mode 0700). gloo's pair sockets
and NCCL's bootstrap socket are bound to the loopback interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=lo, as
NCCL's environment-variable docs describe) unless the user chose an interface; on one node NCCL's data moves over
NVLink / PCIe / shared memory, not sockets. (NCCL's binding follows its docs; no measurement has checked it.)
Multi-node jobs need a network rendezvous: there the endpoint is the user's and the README says to keep it on a
trusted network.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import uuid
from typing import Any, Callable, Iterator

from cost_models.records.errors import ConfigError
from cost_models.torch_compat.host import keep_freed_memory

# Set for the ranks of a single-node job: the file their process group's store lives in.
STORE_FILE_ENV = "ZEROPIPE_STORE_FILE"

# Messages a rank raises because another rank died first: never the root cause when a real error exists.
# "Wait timeout": the store's wait for a peer's key at start-up (a peer that never joined the process group)
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Timed out waiting",
                 "Wait timeout")


@contextlib.contextmanager
def quiet_elastic_logs():
    """The agent logs multi-line tracebacks of failed workers; callers turn them into one line instead."""
    # torch.multiprocessing.spawn logs "Terminating process N via signal SIGTERM" for every peer the agent stops;
    # several elastic modules set their own level (WARNING), so the parent's level alone does not silence them
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (creates the agent's loggers)
    names = ["torch.distributed.elastic", "torch.multiprocessing.spawn",
             *(n for n in logging.Logger.manager.loggerDict if n.startswith("torch.distributed.elastic."))]
    logs = [logging.getLogger(name) for name in names]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def is_consequence(message: str) -> bool:
    return any(c in message for c in _CONSEQUENCES)


def root_failure(exc) -> tuple[int, str]:
    """(rank, first line of its error) of the failure that caused a ChildFailedError: a rank that raised on its
    own rather than one that lost its connection to it; the earliest and lowest rank among equals."""
    candidates = []
    for rank, failure in exc.failures.items():
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        line = _signal_line(message.strip().splitlines()[0]) if message.strip() else f"exit code {failure.exitcode}"
        consequence = is_consequence(message)
        candidates.append((consequence, failure.timestamp, rank, line))
    _, _, rank, line = min(candidates)
    return rank, line


def _signal_line(line: str) -> str:
    """A rank killed by a signal (kill -9, the OOM killer) leaves no exception, only the agent's record of the
    signal: 'Signal 9 (SIGKILL) received by PID 123' -> 'killed by SIGKILL (signal 9)'."""
    m = re.match(r"Signal (\d+) \((\w+)\) received by PID \d+", line)
    return f"killed by {m.group(2)} (signal {m.group(1)})" if m else line


@contextlib.contextmanager
def environ(updates: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the launch (the agent and its ranks inherit them), then restore them."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


START_METHOD_ENV = "ZEROPIPE_START_METHOD"
# Modules every rank imports before its work (its entry point's module and what that imports): the rank server
# imports them once, then forks each rank from itself (start_rank_server).
_RANK_MODULES: list[str] = []
# This process's environment when this module was imported: in the rank server, the one it started with
_SERVER_ENV = dict(os.environ)


def import_in_ranks(*modules: str) -> None:
    """Name modules that define rank entry points, for the rank server to import once (call at import time)."""
    _RANK_MODULES.extend(m for m in modules if m not in _RANK_MODULES)


# multiprocessing's fork server passes a new process fewer than 252 file descriptors (forkserver.MAXFDS_TO_SEND,
# 256, less 4 of its own) and torch hands each rank two per local rank (a result queue each: torch.multiprocessing
# api.MultiprocessContext): more local ranks than this are spawned
FORKSERVER_MAX_RANKS = 120


def rank_start_method(nproc_per_node: int = 1) -> str:
    """How the agent starts ranks: $ZEROPIPE_START_METHOD (spawn | forkserver) where set, else "forkserver" where the
    platform has it, else torch's default "spawn". A spawned rank is a fresh interpreter that imports torch and
    this package again, seconds of every launch, once per rank. multiprocessing's fork server is one such
    interpreter, started once per launcher process, which imports the rank modules once and forks each rank from
    itself (benchmarks/rank_start.py compares the two; results/measurements.md, "Process start-up time"): like
    spawned ranks, forked ones hold only a fresh interpreter's memory (a plain fork would carry the launcher's, and
    the measured peak RSS with it), and never a launcher's CUDA state (PyTorch's "Multiprocessing best practices":
    the CUDA runtime does not survive fork; the server never touches CUDA). Python 3.14 made it Linux's default."""
    import multiprocessing
    available = [m for m in ("forkserver", "spawn") if m in multiprocessing.get_all_start_methods()]
    chosen = os.environ.get(START_METHOD_ENV) or (available[0] if nproc_per_node <= FORKSERVER_MAX_RANKS else "spawn")
    if chosen not in available:
        raise ConfigError(f"${START_METHOD_ENV}={chosen!r}: use one of {', '.join(available)}")
    return chosen


def start_rank_server(*modules: str) -> None:
    """Start the rank server now (if this platform has one and it is not running), importing `modules` and those
    named by import_in_ranks: a launcher that calls this before its own imports has both done at once."""
    import_in_ranks(*modules)
    if rank_start_method() != "forkserver":
        return
    import multiprocessing
    from multiprocessing import forkserver
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_RANK_MODULES))
    # the server lives as long as this process: what it and its ranks print before torch's redirection starts
    # (warnings at import, a Ctrl-C traceback) goes nowhere rather than into the user's terminal (_children_stderr_to)
    with _children_stderr_to(os.devnull), environ({
            # it imports from this process's sys.path (Python 3.11's forkserver.main takes sys_path and ignores it)
            "PYTHONPATH": os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path),
            # nor may anything it imports initialise CUDA, which its forked ranks could not use: torch counts
            # devices through NVML instead (torch.cuda.is_available's docs, "fork-safe")
            "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}):
        forkserver.ensure_running()


def launch_ranks(config: Any, entry: Callable[..., Any], *args: Any) -> Any:
    """elastic_launch(config, entry)(*args), each rank in this process's environment as it is now (elastic_job's
    `start`). A rank forked by the rank server inherits the server's environment from when it started (elastic_launch
    alone would leave a stale store file there); the launch's own settings (elastic_job's store file, the user's
    variables, a test's injected failure) come after that."""
    from torch.distributed.launcher.api import elastic_launch
    if config.start_method == "forkserver":
        start_rank_server()
    done = threading.Event()
    threading.Thread(target=_end_stopped_ranks, args=(done,), name="zeropipe-stopped-ranks", daemon=True).start()
    try:
        return elastic_launch(config, _rank_entry)(entry, dict(os.environ), *args)
    finally:
        done.set()


STOPPED_POLL_S = 0.5   # how often the launcher looks for a stopped rank the agent has asked to end


def _end_stopped_ranks(done: threading.Event) -> None:
    """Until `done`: end_stopped over this launcher's ranks (spawned, or forked by its rank server) every
    STOPPED_POLL_S."""
    import psutil
    me = psutil.Process()
    while not done.wait(STOPPED_POLL_S):
        ranks = []
        for proc in me.children(recursive=True):
            try:
                if is_rank_process(proc):
                    ranks.append(proc)
            except psutil.Error:
                continue   # it ended meanwhile
        end_stopped(ranks)


def end_stopped(procs: list) -> None:
    """SIGKILL each of `procs` (psutil.Process) that is stopped (SIGSTOP; state T) with SIGTERM pending: the agent
    sends SIGTERM to every rank when a job ends, a stopped process keeps it pending until continued, and the agent
    waits LaunchConfig.shutdown_timeout (30 s by default) before its own SIGKILL, which the user would wait
    through for the error line. A process stopped without SIGTERM pending (job control) is left alone."""
    import psutil
    for proc in procs:
        try:
            if proc.status() == psutil.STATUS_STOPPED and _sigterm_pending(proc.pid):
                proc.send_signal(signal.SIGKILL)   # psutil checks the pid is still this process
        except psutil.Error:
            continue   # it ended meanwhile


def _sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits to be delivered to process `pid` (Linux's /proc/PID/status; elsewhere never known)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except OSError:
        return False
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in masks)


def is_rank_process(proc: Any) -> bool:
    """Whether a psutil.Process is a rank some launcher started: spawned (multiprocessing's spawn_main) or forked
    by the rank server (a process running the fork server's code whose parent runs it too)."""
    cmdline = " ".join(proc.cmdline())
    if "spawn_main" in cmdline:
        return True
    parent = proc.parent()
    return "multiprocessing.forkserver" in cmdline and parent is not None and \
        "multiprocessing.forkserver" in " ".join(parent.cmdline())


def _rank_entry(entry: Callable[..., Any], env: dict[str, str], *args: Any) -> Any:
    """A rank: take the launcher's environment, keeping what the agent set for this rank (RANK, WORLD_SIZE, ...:
    whatever differs from the environment this process started with), then run `entry`."""
    from_agent = {k: v for k, v in os.environ.items() if _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(from_agent)
    _end_with_launcher()
    return entry(*args)


def _end_with_launcher() -> None:
    """Exit when the launcher does (killed, crashed): a spawned rank got SIGINT then (torch's _wrap sets it as the
    parent-death signal), but a forked rank's parent is the rank server, which outlives the launcher while ranks
    hold its pipe. multiprocessing keeps the launcher's end of each rank's data pipe open for exactly this
    (popen_forkserver: "a sentinel of the parent process used by the child process"; parent_process().sentinel)."""
    import multiprocessing
    import multiprocessing.connection
    import threading
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        # nobody will read this rank's result, and a collective it blocks in would not return
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="zeropipe-launcher-watch", daemon=True).start()


@contextlib.contextmanager
def elastic_job(name: str, nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0,
                rdzv_endpoint: str | None = None) -> Iterator[tuple[Callable[..., Any], str]]:
    """(start, private work folder): start(entry, *args) runs `entry(*args)` on every rank through torch's
    elastic_launch (launch_ranks: in this process's environment) and returns {rank: result}; the agent's
    multi-line logs are silenced.

    One node and no endpoint given: file stores only, nothing listens on a network port (module doc). Otherwise a
    c10d TCP rendezvous at `rdzv_endpoint` (default 127.0.0.1, any free port). max_restarts=0: a rank that fails
    ends the job, and the caller names it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig
    with tempfile.TemporaryDirectory(prefix=f"zeropipe-{name}-") as workdir:   # mkdtemp: mode 0700
        local = nnodes == 1 and rdzv_endpoint is None
        # the ranks' own stdout/stderr go to files in the work folder (and before torch redirects them, their
        # inherited fd 2 does: _children_stderr_to): what a failed rank says reaches the user as one line through
        # the failure notes and the agent's error files
        logs = DefaultLogsSpecs(log_dir=os.path.join(workdir, "logs"), redirects=Std.ALL)
        common: dict[str, Any] = dict(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
                                      rdzv_backend="c10d", max_restarts=0, monitor_interval=0.1, logs_specs=logs,
                                      start_method=rank_start_method(nproc_per_node))
        if local:
            config = LaunchConfig(run_id=f"zeropipe-{name}-{uuid.uuid4().hex[:8]}",
                                  rdzv_endpoint=os.path.join(workdir, "rendezvous"),
                                  rdzv_configs={"store_type": "file"}, **common)
            env = {STORE_FILE_ENV: os.path.join(workdir, "store"), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                   **{var: os.environ.get(var, "lo") for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}
        else:
            config = LaunchConfig(run_id=f"zeropipe-{name}" if nnodes > 1 else f"zeropipe-{name}-{uuid.uuid4().hex[:8]}",
                                  rdzv_endpoint=rdzv_endpoint or "127.0.0.1:0",
                                  rdzv_configs={"rank": node_rank} if nnodes > 1 else {}, **common)
            env = {}
        with environ(env), quiet_elastic_logs(), _children_stderr_to(os.path.join(workdir, "ranks.log")):
            yield functools.partial(launch_ranks, config), workdir


@contextlib.contextmanager
def _children_stderr_to(path: str) -> Iterator[None]:
    """Processes started inside write their fd 2 to `path`, while this process's sys.stderr stays on the terminal.
    A Ctrl-C reaches every process of the terminal's group, and ranks that are still unpickling their entry point
    (importing torch takes seconds) print a KeyboardInterrupt traceback each before torch's own redirection starts;
    the user hears "interrupted" from the launcher instead."""
    sys.stderr.flush()
    terminal = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 2)
    os.close(log)
    saved = sys.stderr
    sys.stderr = open(terminal, "w", buffering=1, encoding=saved.encoding or "utf-8", errors="backslashreplace",
                      closefd=False)
    try:
        yield
    finally:
        sys.stderr.flush()
        sys.stderr = saved
        os.dup2(terminal, 2)
        os.close(terminal)


def init_process_group(backend: str, timeout_s: float) -> None:
    """In a rank started by `elastic_job`: join the job's process group (its file store on one node, else the
    env:// TCP store torchrun set up). Collectives time out after `timeout_s`."""
    import torch.distributed as dist
    if backend == "gloo":   # CPU ranks: as the profile computed (host.keep_freed_memory)
        keep_freed_memory()
    timeout = dt.timedelta(seconds=timeout_s)
    path = os.environ.get(STORE_FILE_ENV)
    if not path:
        dist.init_process_group(backend, timeout=timeout)
        return
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=dist.FileStore(path, world), rank=int(os.environ["RANK"]),
                            world_size=world, timeout=timeout)
