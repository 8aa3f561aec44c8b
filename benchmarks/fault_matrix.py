"""Bad-input and fault matrix for the `planner` CLI: the acceptance check of issue 14, re-runnable.

Every case runs `planner ...` in its own folder (a copy of the fixture files) and records what happened: exit code,
stderr lines, whether "Traceback" appears, partial files left behind (`.*.tmp`, `.incomplete-*`), outputs that
should not exist, orphan processes, wall time. A case passes when the command refused in one `error: ...` line with
its exit code (2 bad input, 1 a failed rank, 3 nothing fits; "interrupted" and 130 for a signal), with no traceback
and nothing left behind; or, for the controls, when it worked. Nothing here assumes a fix: it reports.

Fixtures (in a fresh temporary folder, XDG_CONFIG_HOME pointed inside it so no real checkpoint key is touched):
  full mode   `planner demo` (spawns ranks) -> profile.json, plan.json, run.json; a 4-step run with checkpoints
              every 2 steps -> ck/; plan2.json (another plan of the same profile); cluster.json (a preset)
  --quick     no ranks: a real-mode gpt-tiny profile on the dgx-a100 preset and a 4-GPU plan of it; the cases
              that need run.json or a checkpoint are skipped, and so is every case that may spawn ranks.
Every command that may spawn ranks runs while this script holds /tmp/zeropipe-mp.lock (flock, as
`flock /tmp/zeropipe-mp.lock ...` does), so concurrent cases such as two runs sharing a folder still run together.

Usage: python benchmarks/fault_matrix.py [--quick] [--out DIR] [--only SUBSTR] [--jobs N] [--keep]
Writes DIR/fault-matrix.json (default ./fault-matrix.json) and prints a table and "N cases: P passed, F failed".
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import fcntl
import hashlib
import ipaddress
import json
import os
import pickle
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

MP_LOCK = "/tmp/zeropipe-mp.lock"     # the lock every rank-spawning command on this machine takes
MEMORY_LIMIT = 4 << 30                # RLIMIT_AS for the huge-number cases: a regression fails, the machine lives
TIME_LIMIT_S = 120.0                  # per non-spawning case
SPAWN_TIME_LIMIT_S = 240.0            # per rank-spawning case (ranks on 2 shared cores start slowly)
PARTIAL = re.compile(r"^(\..*\.tmp|\.incomplete-.*)$")   # what write_atomic and a checkpoint save leave mid-way
TRACEBACK = "Traceback (most recent call last)"
FSIZE_LIMIT = 1024                    # RLIMIT_FSIZE standing in for a full disk where tmpfs cannot be mounted


def limited(*, memory: int | None = None, fsize: int | None = None) -> tuple[str, ...]:
    """A prefix that runs the command after it (same pid: exec) under these rlimits. Not preexec_fn: that is unsafe
    while this process runs threads. SIGXFSZ is ignored so a write past RLIMIT_FSIZE fails with EFBIG instead of
    killing the process (an ignored signal stays ignored across exec)."""
    if memory is None and fsize is None:
        return ()
    code = ["import os, resource, signal, sys"]
    if memory is not None:
        code.append(f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))")
    if fsize is not None:
        code += ["signal.signal(signal.SIGXFSZ, signal.SIG_IGN)",
                 f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))"]
    code.append("os.execv(sys.argv[1], sys.argv[1:])")
    return sys.executable, "-c", "; ".join(code)


# ---------------------------------------------------------------------------------------------------------------
# cases

Prepare = Callable[[Path], None]                       # mutates the case folder before the command runs
Check = Callable[[dict, Path], "str | None"]           # extra pass condition: a reason to fail, or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    category: str
    argv: tuple[str, ...]                   # after `planner`
    prepare: Prepare | None = None
    action: Callable[["Ctx"], str] | None = None   # signal / timing, while the command runs; returns a note
    expect: tuple[int, ...] = (2,)          # exit codes that count
    kind: str = "refuse"                    # refuse | interrupt | usage | ok
    mentions: str | None = None             # regex the error line must match (the fault, not something else)
    absent: tuple[str, ...] = ()            # outputs that must not exist afterwards
    present: tuple[str, ...] = ()           # outputs that must exist afterwards (controls)
    check: Check | None = None
    spawns: bool = False                    # may start ranks: under the lock, not in --quick
    needs: tuple[str, ...] = ()             # fixtures beyond profile/plan/cluster: "run", "ck", "plan2"
    limits: bool = False                    # RLIMIT_AS 4 GiB
    mount: str | None = None                # "ro": DIR/ro is a read-only bind mount; "full": DIR/full a full tmpfs
    env: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None


# --- file mutations -----------------------------------------------------------------------------------------------

def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _dump(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=2))    # allow_nan: NaN / Infinity literals are the point of some cases


def edit(name: str, fn: Callable[[Any], None], *, to: str | None = None) -> Prepare:
    """Load `name`, let `fn` change it in place, write it to `to` (default: over itself)."""
    def prepare(d: Path) -> None:
        doc = _load(d / name)
        fn(doc)
        _dump(d / (to or name), doc)
    return prepare


def write(name: str, data: bytes) -> Prepare:
    return lambda d: (d / name).write_bytes(data)


def truncated(src: str, name: str) -> Prepare:
    return lambda d: (d / name).write_bytes((d / src).read_bytes()[: (d / src).stat().st_size // 2])


def copied(src: str, name: str) -> Prepare:
    return lambda d: shutil.copyfile(d / src, d / name)


def both(*steps: Prepare | None) -> Prepare:
    def prepare(d: Path) -> None:
        for step in steps:
            if step:
                step(d)
    return prepare


def mkdir(name: str) -> Prepare:
    return lambda d: (d / name).mkdir(parents=True, exist_ok=True)


NOT_JSON = b"\x89PNG\r\n\x1a\n\x00\xff not json at all"


# --- (a) every command with broken input files ---------------------------------------------------------------------

def file_variants(cmd: str, slot: str, argv: Callable[[str], tuple[str, ...]], base: str, wrong_kind: str,
                  *, spawns: bool = False, needs: tuple[str, ...] = (), absent: tuple[str, ...] = ("out.json",),
                  only: tuple[str, ...] | None = None) -> list[Case]:
    """One case per way a file can be broken; `argv(path)` is the command line with the broken file at `path`."""
    base_needs = ("run",) if base == "run.json" else ()
    variants = {
        "missing": ("nofile.json", None, ()),
        "empty": ("bad.json", write("bad.json", b""), ()),
        "truncated": ("bad.json", truncated(base, "bad.json"), base_needs),
        "non-json": ("bad.json", write("bad.json", NOT_JSON), ()),
        "folder": ("bad.json", mkdir("bad.json"), ()),
        "wrong-kind": ("bad.json", copied(wrong_kind, "bad.json"), ("run",) if wrong_kind == "run.json" else ()),
        "schema-99": ("bad.json", edit(base, lambda doc: doc.update(schema_version=99), to="bad.json"), base_needs),
    }
    cases = []
    for variant, (path, prepare, extra) in variants.items():
        if only and variant not in only:
            continue
        cases.append(Case(name=f"{cmd}:{slot}:{variant}", category="a-files", argv=argv(path), prepare=prepare,
                          mentions=re.escape(path), absent=absent, spawns=spawns, needs=needs + extra))
    return cases


PROFILE_META = ("profile", "--model", "gpt-tiny", "-b", "2", "-s", "16", "--dtype", "fp32", "--meta")


def _checkpoint_listing(d: Path) -> Path:
    return d / "ck" / "step-00000004" / "zeropipe-checkpoint.json"


def cases_a() -> list[Case]:
    cases: list[Case] = []
    cases += file_variants("profile", "cluster", lambda f: (*PROFILE_META, "--cluster", f, "-o", "out.json"),
                           "cluster.json", "plan.json")
    cases += file_variants("profile-cluster", "cluster",
                           lambda f: ("profile-cluster", "--cluster", f, "-o", "out.json"), "cluster.json", "plan.json")
    cases += file_variants("estimate", "profile", lambda f: ("estimate", f, "--dp", "4"), "profile.json", "plan.json",
                           absent=())
    cases += file_variants("estimate", "cluster", lambda f: ("estimate", "profile.json", "--dp", "4", "--cluster", f),
                           "cluster.json", "plan.json", absent=(), only=("truncated", "wrong-kind", "schema-99"))
    cases += file_variants("plan", "profile", lambda f: ("plan", f, "-B", "64", "--no-report", "-o", "out.json"),
                           "profile.json", "plan.json")
    cases += file_variants("plan", "cluster", lambda f: ("plan", "profile.json", "-B", "64", "--cluster", f,
                                                         "--no-report", "-o", "out.json"),
                           "cluster.json", "plan.json", only=("truncated", "wrong-kind", "schema-99"))
    cases += file_variants("report", "plan", lambda f: ("report", f, "-o", "out.html"), "plan.json", "profile.json",
                           absent=("out.html", "out.md"))
    cases += file_variants("report", "run", lambda f: ("report", "plan.json", "--run", f, "-o", "out.html"),
                           "run.json", "plan.json", absent=("out.html", "out.md"))
    # a plan that cannot be read is refused before any rank starts (if not, --steps 2 keeps the damage small)
    cases += file_variants("run", "plan", lambda f: ("run", f, "--steps", "2", "-o", "out.json"), "plan.json",
                           "profile.json")
    cases += file_variants("replan", "profile", lambda f: ("replan", "--gpus", "2", "--checkpoint", "ck", "--profile",
                                                           f, "--no-report", "-o", "out.json"),
                           "profile.json", "plan.json", needs=("ck",))
    replan_ck = lambda f: ("replan", "--gpus", "2", "--checkpoint", f, "--profile", "profile.json", "--no-report",
                           "-o", "out.json")
    cases += [
        Case(name="replan:checkpoint:missing", category="a-files", argv=replan_ck("nock"), mentions="nock",
             absent=("out.json",)),
        Case(name="replan:checkpoint:empty-folder", category="a-files", argv=replan_ck("emptyck"),
             prepare=mkdir("emptyck"), mentions="emptyck", absent=("out.json",)),
        Case(name="replan:checkpoint:a-file", category="a-files", argv=replan_ck("plan.json"), mentions="plan.json",
             absent=("out.json",)),
        Case(name="replan:checkpoint:listing-truncated", category="a-files", argv=replan_ck("ck/step-00000004"),
             prepare=lambda d: _checkpoint_listing(d).write_bytes(_checkpoint_listing(d).read_bytes()[:500]),
             mentions="step-00000004", absent=("out.json",), needs=("ck",)),
        Case(name="replan:checkpoint:listing-non-json", category="a-files", argv=replan_ck("ck/step-00000004"),
             prepare=lambda d: _checkpoint_listing(d).write_bytes(NOT_JSON), mentions="step-00000004",
             absent=("out.json",), needs=("ck",)),
        Case(name="replan:checkpoint:listing-schema-99", category="a-files", argv=replan_ck("ck/step-00000004"),
             prepare=lambda d: _dump(_checkpoint_listing(d), {**_load(_checkpoint_listing(d)), "schema_version": 99}),
             mentions="step-00000004", absent=("out.json",), needs=("ck",)),
    ]
    # presets and models read no file: a bad flag is their only bad input (click's usage error, exit 2)
    for cmd in ("presets", "models"):
        cases.append(Case(name=f"{cmd}:unknown-option", category="a-files", argv=(cmd, "--bogus"), kind="usage",
                          mentions="bogus"))
    return cases


# --- (b) edited plans ------------------------------------------------------------------------------------------------

def _stages(doc: dict) -> list[list[str]]:
    return doc["strategy"]["stages"]


def _swap01(doc: dict) -> None:
    for st in _stages(doc):
        if "blocks.0" in st and "blocks.1" in st:
            i, j = st.index("blocks.0"), st.index("blocks.1")
            st[i], st[j] = st[j], st[i]


def _duplicate(doc: dict) -> None:
    for st in _stages(doc):
        if "blocks.1" in st:
            st.insert(st.index("blocks.1") + 1, "blocks.1")


def _split_in_two(doc: dict) -> None:
    units = [u for st in _stages(doc) for u in st]
    doc["strategy"]["stages"] = [units[: len(units) // 2], units[len(units) // 2:]]
    doc["strategy"]["pp"] = 1


PLAN_EDITS: dict[str, tuple[Callable[[dict], None], str]] = {   # edit, what the refusal must name
    "dropped-unit": (lambda doc: [st.remove("blocks.2") for st in _stages(doc) if "blocks.2" in st],
                     r"blocks\.2|cover|missing"),
    "reordered-units": (_swap01, r"blocks\.[01]|order"),
    "duplicated-unit": (_duplicate, r"blocks\.1|twice|duplicat|exactly once"),
    "dp=0": (lambda doc: doc["strategy"].update(dp=0), r"\bdp\b|data.parallel"),
    "dp=3": (lambda doc: doc["strategy"].update(dp=3), r"\bdp\b|data.parallel|batch|gpus|ranks"),
    "zero=7": (lambda doc: doc["strategy"].update(zero=7), r"zero"),
    "microbatches=0": (lambda doc: doc["strategy"].update(microbatches=0), r"micro.?batch"),
    "two-stages-pp=1": (_split_in_two, r"stage|\bpp\b|pipeline"),
    "nan-prediction": (lambda doc: doc["prediction"].update(step_time_s=float("nan")), r"nan|finite|step_time"),
}


def cases_b() -> list[Case]:
    cases = []
    for edit_name, (fn, mentions) in PLAN_EDITS.items():
        prepare = edit("plan.json", fn)
        cases.append(Case(name=f"report:plan:{edit_name}", category="b-plans", argv=("report", "plan.json", "-o",
                          "out.html"), prepare=prepare, mentions=mentions, absent=("out.html", "out.md")))
        cases.append(Case(name=f"run:plan:{edit_name}", category="b-plans", argv=("run", "plan.json", "--steps", "2",
                          "-o", "out.json"), prepare=prepare, mentions=mentions, absent=("out.json",), spawns=True,
                          check=_no_ranks_started))
    return cases


# --- (c) edited profiles and cluster files ---------------------------------------------------------------------------

def _units(doc: dict) -> list[dict]:
    return doc["model"]["units"]


def _nan_times(doc: dict) -> None:
    for u in _units(doc):
        for key in ("fwd_time", "bwd_time"):
            if isinstance(u.get(key), dict):
                u[key]["median_s"] = float("nan")


PROFILE_EDITS: dict[str, tuple[Callable[[dict], None], str]] = {
    "nan-unit-times": (_nan_times, r"nan|finite|time"),
    "negative-bandwidth": (lambda doc: doc["cluster"]["intra_node"].update(bandwidth_Bps=-1e9), r"bandwidth|negative"),
    "negative-params": (lambda doc: _units(doc)[1].update(params=-_units(doc)[1]["params"]), r"params|negative"),
    "no-units": (lambda doc: doc["model"].update(units=[]), r"unit"),
}


def cases_c() -> list[Case]:
    cases = []
    for edit_name, (fn, mentions) in PROFILE_EDITS.items():
        prepare = edit("profile.json", fn)
        cases.append(Case(name=f"plan:profile:{edit_name}", category="c-profiles", argv=("plan", "profile.json", "-B",
                          "64", "--no-report", "-o", "out.json"), prepare=prepare, mentions=mentions,
                          absent=("out.json",)))
        cases.append(Case(name=f"estimate:profile:{edit_name}", category="c-profiles",
                          argv=("estimate", "profile.json", "--dp", "4"), prepare=prepare, mentions=mentions))
    inf = edit("cluster.json", lambda doc: doc["cluster"]["intra_node"].update(bandwidth_Bps=float("inf")),
               to="inf.json")
    cases += [
        Case(name="profile-cluster:cluster:infinity", category="c-profiles", argv=("profile-cluster", "--cluster",
             "inf.json", "-o", "out.json"), prepare=inf, mentions=r"inf|finite", absent=("out.json",)),
        Case(name="plan:cluster:infinity", category="c-profiles", argv=("plan", "profile.json", "-B", "64",
             "--cluster", "inf.json", "--no-report", "-o", "out.json"), prepare=inf, mentions=r"inf|finite",
             absent=("out.json",)),
        Case(name="estimate:cluster:infinity", category="c-profiles", argv=("estimate", "profile.json", "--dp", "4",
             "--cluster", "inf.json"), prepare=inf, mentions=r"inf|finite"),
        Case(name="profile:cluster:infinity", category="c-profiles", argv=(*PROFILE_META, "--cluster", "inf.json",
             "-o", "out.json"), prepare=inf, mentions=r"inf|finite", absent=("out.json",)),
    ]
    return cases


# --- (d) huge and zero numbers, under a memory and a time limit ------------------------------------------------------

TESTS_MODELS = Path(__file__).resolve().parents[1] / "tests" / "custom_models.py"   # module:factory by path


def cases_d() -> list[Case]:
    plan = ("plan", "profile.json", "--no-report", "-o", "out.json")
    rows = [   # name, argv, accepted exit codes, what the refusal must name
        ("estimate:dp=1e9,nodes=1.25e8", ("estimate", "profile.json", "--dp", "1000000000", "--nodes", "125000000",
                                          "--cluster", "dgx-h100"), (2, 3), r"dp|nodes|gpus|devices|ranks|memory|fit"),
        ("estimate:dp=1e9", ("estimate", "profile.json", "--dp", "1000000000"), (2, 3),
         r"dp|gpus|devices|ranks|memory|fit"),
        ("estimate:microbatches=1e9", ("estimate", "profile.json", "--dp", "4", "-m", "1000000000"), (2, 3),
         r"micro|memory|fit"),
        ("plan:B=1e9", (*plan, "-B", "1000000000"), (2, 3), r"batch|-B|memory|fit"),
        ("plan:gpus=1e9", (*plan, "-B", "64", "--gpus", "1000000000"), (2, 3), r"gpus|devices|memory|fit"),
        ("plan:gpus=0", (*plan, "-B", "64", "--gpus", "0"), (2,), r"gpus"),
        ("plan:gpus=-2", (*plan, "-B", "64", "--gpus", "-2"), (2,), r"gpus"),
        ("plan:nodes=0", (*plan, "-B", "64", "--nodes", "0", "--cluster", "dgx-a100"), (2,), r"nodes"),
        ("plan:B=0", (*plan, "-B", "0"), (2,), r"batch|-B"),
        ("estimate:nodes=0", ("estimate", "profile.json", "--nodes", "0", "--cluster", "dgx-a100"), (2,), r"nodes"),
        ("estimate:b=0", ("estimate", "profile.json", "-b", "0"), (2,), r"micro.?batch|-b"),
        ("estimate:microbatches=0", ("estimate", "profile.json", "-m", "0"), (2,), r"micro"),
        ("estimate:dp=0", ("estimate", "profile.json", "--dp", "0"), (2,), r"\bdp\b"),
        ("profile-cluster:nodes=0", ("profile-cluster", "--cluster", "dgx-a100", "--nodes", "0", "-o", "out.json"),
         (2,), r"nodes"),
        # expert parallelism asked of the demo's dense model (issue 36, item 7)
        ("estimate:ep=2,dense", ("estimate", "profile.json", "--dp", "4", "--ep", "2"), (2,), r"mixture-of-experts"),
        ("estimate:ep=3,dp=4", ("estimate", "profile.json", "--dp", "4", "--ep", "3"), (2,), r"--ep 3"),
        ("estimate:moe-imbalance,dense", ("estimate", "profile.json", "--dp", "4", "--moe-imbalance", "2"), (2,),
         r"mixture-of-experts"),
        ("estimate:moe-imbalance=0.5", ("estimate", "profile.json", "--dp", "4", "--moe-imbalance", "0.5"), (2,),
         r"moe-imbalance"),
        ("plan:ep=2,dense", (*plan, "-B", "64", "--ep", "2"), (2,), r"mixture-of-experts"),
        ("plan:ep=3", (*plan, "-B", "64", "--ep", "3"), (2,), r"powers of two"),
        # context parallelism degrees that cannot split the demo's sequences (issue 37, item 5)
        ("estimate:cp=3", ("estimate", "profile.json", "--dp", "1", "--cp", "3"), (2,), r"power of two"),
        ("estimate:cp=1024", ("estimate", "profile.json", "--cp", "1024"), (2,), r"not a multiple|cp|ranks"),
        ("plan:cp=3", (*plan, "-B", "64", "--cp", "3"), (2,), r"powers of two"),
        # routing measured on the user's data (issue 36, item 1): both options or neither, and an MoE model only
        ("profile:data-without-init-from", (*PROFILE_META, "--cluster", "none", "--data", "x.bin", "-o", "out.json"),
         (2,), r"--init-from and --data go together"),
        ("profile:routing,dense", (*PROFILE_META, "--cluster", "none", "--data", "x.bin", "--init-from", "w", "-o",
                                   "out.json"), (2,), r"no mixture-of-experts blocks"),
        ("profile:undeclared-moe-block", ("profile", "--model", f"{TESTS_MODELS}:undeclared_moe", "-b", "2", "-s",
                                          "8", "--meta", "--cluster", "none", "-o", "out.json"), (2,),
         r"num_experts.*top_k"),
    ]
    cases = [Case(name=name, category="d-numbers", argv=argv, expect=expect, mentions=mentions, limits=True,
                  absent=("out.json",)) for name, argv, expect, mentions in rows]
    # meta profiling allocates nothing, so a huge batch may be answered: any clean outcome within the limits counts
    cases.append(Case(name="profile:meta,b=1e9", category="d-numbers", argv=(*PROFILE_META[:3], "-b", "1000000000",
                      *PROFILE_META[5:], "--cluster", "dgx-a100", "-o", "out.json"), expect=(0, 2), kind="bounded",
                      limits=True))
    return cases


# --- (e) outputs that cannot be written ------------------------------------------------------------------------------

WRITERS: dict[str, tuple[Callable[[str], tuple[str, ...]], bool, tuple[str, ...]]] = {   # argv(out), spawns, needs
    "profile": (lambda o: (*PROFILE_META, "--cluster", "dgx-a100", "-o", o), False, ()),
    "profile-cluster": (lambda o: ("profile-cluster", "--cluster", "dgx-a100", "-o", o), False, ()),
    "plan": (lambda o: ("plan", "profile.json", "-B", "64", "-o", o), False, ()),
    "report": (lambda o: ("report", "plan.json", "-o", o), False, ()),
    "replan": (lambda o: ("replan", "--gpus", "2", "--checkpoint", "ck", "--profile", "profile.json", "-o", o), False,
               ("ck",)),
    "run": (lambda o: ("run", "plan.json", "--steps", "2", "-o", o), True, ()),
}


def _folder_intact(rec: dict, d: Path) -> str | None:
    return None if (d / "adir").is_dir() and (d / "adir" / "keep.txt").read_text() == "mine" else \
        "the folder named by -o was replaced or emptied"


def cases_e() -> list[Case]:
    cases = []
    for cmd, (argv, spawns, needs) in WRITERS.items():
        ext = "html" if cmd == "report" else "json"
        before_work = _no_ranks_started if spawns else None
        cases += [
            Case(name=f"{cmd}:-o:parent-is-a-file", category="e-outputs", argv=argv(f"afile/out.{ext}"),
                 prepare=write("afile", b"mine"), mentions="afile", spawns=spawns, needs=needs, check=before_work),
            Case(name=f"{cmd}:-o:a-folder,--force", category="e-outputs", argv=(*argv("adir"), "--force"),
                 prepare=both(mkdir("adir"), write("adir/keep.txt", b"mine")), mentions="adir", spawns=spawns,
                 needs=needs, check=lambda rec, d, bw=before_work: _folder_intact(rec, d) or (bw and bw(rec, d))),
            Case(name=f"{cmd}:-o:read-only-folder", category="e-outputs", argv=argv(f"ro/out.{ext}"), mount="ro",
                 mentions=r"ro/out|read-only|Read-only", absent=(f"ro/out.{ext}",), spawns=spawns, needs=needs,
                 check=before_work),
            Case(name=f"{cmd}:-o:full-disk", category="e-outputs", argv=argv(f"full/out.{ext}"), mount="full",
                 mentions=r"No space left|space|quota|too large", absent=(f"full/out.{ext}",), spawns=spawns,
                 needs=needs),
        ]
    return cases


# --- (f) interruptions --------------------------------------------------------------------------------------------

def _signal_when_ranks(sig: int, *, group: bool, settle_s: float = 2.0) -> Callable[["Ctx"], str]:
    """Wait until the ranks train (their process group is up: gloo listens on 4 sockets or more), give them
    `settle_s`, then send `sig` (to the whole process group, as Ctrl-C in a terminal does, or to planner alone, as
    `kill` does)."""
    def act(ctx: Ctx) -> str:
        t = ctx.wait_descendants(4)
        if t is None:
            return "ranks never started; no signal sent"
        t_up = ctx.wait_listeners(4)
        if t_up is None:
            return "the ranks' process group never came up (no gloo sockets seen); no signal sent"
        time.sleep(settle_s)
        ctx.send(sig, group=group)
        return (f"{signal.Signals(sig).name} to {'the process group' if group else 'planner'} "
                f"{time.monotonic() - t:.1f} s after 4 processes started under it, "
                f"{time.monotonic() - t_up:.1f} s after their process group was up")
    return act


def _signal_when_ranks_start(sig: int, *, group: bool) -> Callable[["Ctx"], str]:
    """Send `sig` one second after 4 processes started under planner: the ranks are still starting (importing
    torch, ~10 s on 2 busy cores)."""
    def act(ctx: Ctx) -> str:
        t = ctx.wait_descendants(4)
        if t is None:
            return "ranks never started; no signal sent"
        time.sleep(1.0)
        up = len(ctx.watch.listeners)
        ctx.send(sig, group=group)
        return (f"{signal.Signals(sig).name} to {'the process group' if group else 'planner'} "
                f"{time.monotonic() - t:.1f} s after 4 processes started under it, {up} gloo socket(s) up then")
    return act


def _signal_when_loading(sig: int, *, group: bool) -> Callable[["Ctx"], str]:
    """Send `sig` inside the command, before any rank: once planner itself has mapped libtorch (cli imports torch
    only inside a command), while it has no child process."""
    def act(ctx: Ctx) -> str:
        t = ctx.wait_mapped("libtorch", ranks=0)
        if t is None:
            return "planner never loaded torch; no signal sent"
        kids = ctx.descendants_now()
        ctx.send(sig, group=group)
        return (f"{signal.Signals(sig).name} to {'the process group' if group else 'planner'} once planner had "
                f"loaded torch, {kids} child process(es) then")
    return act


def _signal_when_started(sig: int, *, group: bool, after_s: float = 0.0) -> Callable[["Ctx"], str]:
    """Send `sig` once planner's main() runs (it installs its SIGTERM handler: SigCgt bit 15 in /proc/PID/status),
    plus `after_s`, before any rank; the note says how many child processes existed at that moment."""
    def act(ctx: Ctx) -> str:
        t = ctx.wait_handler(signal.SIGTERM)
        if t is None:
            return "planner never installed its SIGTERM handler; no signal sent"
        time.sleep(after_s)
        kids = ctx.descendants_now()
        ctx.send(sig, group=group)
        return (f"{signal.Signals(sig).name} to {'the process group' if group else 'planner'} "
                f"{time.monotonic() - t:.1f} s after main() started, {kids} child process(es) then")
    return act


def _names_rank(rank: int) -> Check:
    def check(rec: dict, d: Path) -> str | None:
        line = rec["first_stderr"]
        if not re.search(rf"\brank {rank}\b", line):
            return f"the error does not name rank {rank}"
        others = sorted(set(re.findall(r"\brank (\d+)\b", line)) - {str(rank)})
        return f"it blames rank {', '.join(others)} too" if others else None
    return check


def cases_f() -> list[Case]:
    run = ("run", "plan.json", "--steps", "40", "-o", "out.json")
    return [
        Case(name="run:SIGINT-while-ranks-run", category="f-signals", argv=run, kind="interrupt", expect=(130,),
             action=_signal_when_ranks(signal.SIGINT, group=True), absent=("out.json",), spawns=True),
        Case(name="run:SIGTERM-while-ranks-run", category="f-signals", argv=run, kind="interrupt", expect=(130,),
             action=_signal_when_ranks(signal.SIGTERM, group=False), absent=("out.json",), spawns=True),
        Case(name="run:SIGINT-while-ranks-start", category="f-signals", argv=run, kind="interrupt", expect=(130,),
             action=_signal_when_ranks_start(signal.SIGINT, group=True), absent=("out.json",), spawns=True),
        Case(name="run:SIGINT-before-ranks", category="f-signals", argv=run, kind="interrupt", expect=(130,),
             action=_signal_when_loading(signal.SIGINT, group=True), absent=("out.json",), spawns=True),
        Case(name="run:SIGTERM-before-ranks", category="f-signals", argv=run, kind="interrupt", expect=(130,),
             action=_signal_when_loading(signal.SIGTERM, group=False), absent=("out.json",), spawns=True),
        # the first moment main() runs (its SIGTERM handler is in): typer is still building the command
        Case(name="run:SIGINT-at-start-up", category="f-signals", argv=run, kind="interrupt", expect=(130,),
             action=_signal_when_started(signal.SIGINT, group=True), absent=("out.json",), spawns=True),
        Case(name="run:SIGTERM-at-start-up", category="f-signals", argv=run, kind="interrupt", expect=(130,),
             action=_signal_when_started(signal.SIGTERM, group=False), absent=("out.json",), spawns=True),
        Case(name="demo:SIGTERM-while-profiling", category="f-signals", argv=("demo", "--out-dir", "d"),
             kind="interrupt", expect=(130,), action=_signal_when_started(signal.SIGTERM, group=False, after_s=3.0),
             absent=("d/plan.json", "d/run.json"), spawns=True),
        # real-mode profiling of one process: no ranks, so it is in --quick too
        Case(name="profile:SIGINT-while-timing", category="f-signals", argv=("profile", "--model", "gpt-tiny", "-b",
             "4", "-s", "64", "--dtype", "fp32", "--cluster", "none", "--repeats", "200", "-o", "out.json"),
             kind="interrupt", expect=(130,), action=_signal_when_started(signal.SIGINT, group=True, after_s=2.0),
             absent=("out.json",)),
        Case(name="run:kill-9-rank-1", category="f-signals", argv=("run", "plan.json", "--steps", "4", "-o",
             "out.json"), env=(("ZEROPIPE_INJECT_FAILURE", "1:2:kill"),), expect=(1,), check=_names_rank(1),
             absent=("out.json",), spawns=True),
        Case(name="run:SIGSTOP-rank-1,--timeout-15", category="f-signals", argv=("run", "plan.json", "--steps", "4",
             "--timeout", "15", "-o", "out.json"), env=(("ZEROPIPE_INJECT_FAILURE", "1:2:stop"),), expect=(1,),
             check=_names_rank(1), absent=("out.json",), spawns=True),
        Case(name="run:SIGSTOP-rank-1-at-start-up,--timeout-15", category="f-signals", argv=(
             "run", "plan.json", "--steps", "4", "--timeout", "15", "-o", "out.json"),
             env=(("ZEROPIPE_INJECT_FAILURE", "1:start:stop"),), expect=(1,), check=_names_rank(1),
             absent=("out.json",), spawns=True),
    ]


# --- (g) checkpoints ----------------------------------------------------------------------------------------------

class _Payload:
    """Unpickling this runs `touch MARKER`: a checkpoint that carries code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _marker(d: Path) -> Path:
    return d.parent / f"{d.name}.code-ran"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_metadata(d: Path) -> None:
    """Replace .metadata with a pickle that runs code, and put its true size and sha256 in the listing, as whoever
    can write the folder can: only the listing's signature (the key lives outside the folder) can tell."""
    step = d / "ck" / "step-00000004"
    payload = pickle.dumps(_Payload(str(_marker(d))))
    (step / ".metadata").write_bytes(payload)
    listing = _load(step / "zeropipe-checkpoint.json")
    for f in listing["files"]:
        if f["name"] == ".metadata":
            f["bytes"], f["sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    _dump(step / "zeropipe-checkpoint.json", listing)


def _no_code_ran(rec: dict, d: Path) -> str | None:
    return "the checkpoint's pickle ran (marker file made)" if _marker(d).exists() else None


def _to_incomplete(d: Path) -> None:
    (d / "ck" / "step-00000004").rename(d / "ck" / ".incomplete-step-00000004")


def _hint_not_damaged(rec: dict, d: Path) -> str | None:
    return "the hint names step-00000002, which is damaged too" if "step-00000002" in rec["first_stderr"] else None


def _concurrent(ctx: Ctx) -> str:
    """Start a second run on the same --checkpoint-dir once the first has started its ranks."""
    ctx.wait_descendants(4)
    second = ctx.start(("run", "plan.json", "--steps", "4", "--checkpoint-dir", "shared", "--checkpoint-every", "1",
                        "-o", "outB.json"), "B")
    ctx.extra["B"] = second
    return "second run started while the first one's ranks ran"


def _pair_check(rec: dict, d: Path) -> str | None:
    b = rec["extra"].get("B")
    if not b:
        return "the second run was not started"
    problems = []
    if b["traceback"]:
        problems.append("second run: traceback")
    if b["exit"] not in (0, 2):
        problems.append(f"second run: exit {b['exit']}")
    elif b["exit"] == 2 and (b["stderr_lines"] != 1 or not b["first_stderr"].startswith("error: ")):
        problems.append(f"second run: {b['stderr_lines']} stderr lines, expected one error line")
    if rec["exit"] != 0 and b["exit"] != 0:
        problems.append("neither run finished")
    if rec["exit"] == 0 and b["exit"] == 0:
        problems.append("both runs saved into one folder at once (no lock refused either)")
    return "; ".join(problems) or None


def cases_g() -> list[Case]:
    # resuming at step 4 with --steps 6 runs 2 steps, so --warmup 1 leaves one timed step (no refusal for that)
    resume = ("run", "plan.json", "--steps", "6", "--resume", "ck", "-o", "out.json")
    shard = lambda n: (lambda d: d / "ck" / "step-00000004" / f"__{n}_0.distcp")
    return [
        Case(name="resume:byte-flipped-shard", category="g-checkpoints", argv=resume,
             prepare=lambda d: _flip_byte(shard(1)(d)), mentions=r"__1_0|sha256|digest|damaged|checksum",
             absent=("out.json",), spawns=True, needs=("ck",), check=_no_ranks_started),
        Case(name="resume:truncated-shard", category="g-checkpoints", argv=resume,
             prepare=lambda d: shard(0)(d).write_bytes(shard(0)(d).read_bytes()[:1000]),
             mentions=r"__0_0|size|bytes|truncat|damaged", absent=("out.json",), spawns=True, needs=("ck",),
             check=_no_ranks_started),
        Case(name="resume:both-checkpoints-damaged,hint", category="g-checkpoints", argv=resume,
             prepare=lambda d: (_flip_byte(shard(1)(d)), _flip_byte(d / "ck" / "step-00000002" / "__1_0.distcp")),
             absent=("out.json",), spawns=True, needs=("ck",), check=_hint_not_damaged),
        Case(name="resume:rewritten-.metadata-pickle", category="g-checkpoints", argv=resume,
             prepare=_rewrite_metadata, mentions=r"sign|trust", absent=("out.json",), spawns=True, needs=("ck",),
             check=_no_code_ran),
        Case(name="resume:.incomplete-step", category="g-checkpoints",
             argv=("run", "plan.json", "--steps", "6", "--resume", "ck/.incomplete-step-00000004", "-o", "out.json"),
             prepare=_to_incomplete, mentions=r"incomplete", absent=("out.json",), spawns=True, needs=("ck",)),
        Case(name="two-runs-one-checkpoint-dir", category="g-checkpoints",
             argv=("run", "plan.json", "--steps", "4", "--checkpoint-dir", "shared", "--checkpoint-every", "1",
                   "-o", "outA.json"), action=_concurrent, expect=(0, 2), kind="pair", spawns=True,
             check=_pair_check),
        Case(name="checkpoint-save:full-disk", category="g-checkpoints",
             argv=("run", "plan.json", "--steps", "2", "--checkpoint-dir", "full/ck", "-o", "out.json"),
             mount="full-empty", mentions=r"No space left", absent=("out.json",), spawns=True,
             expect=(1, 2)),    # the save fails inside the ranks: exit 1 (a failed rank) or 2, root cause named
    ]


# --- (h) report with another plan's run, (i) listening sockets, controls --------------------------------------------

def _loopback_only(rec: dict, d: Path) -> str | None:
    wide = [f"{ip}:{port}" for ip, port in rec["listeners"] if not ipaddress.ip_address(ip).is_loopback]
    return f"listening on {', '.join(sorted(set(wide)))}" if wide else None


def _valid_json_stdout(rec: dict, d: Path) -> str | None:
    try:
        json.loads(rec["stdout_full"])
    except ValueError:
        return "stdout is not JSON"
    return None


def cases_hi() -> list[Case]:
    return [
        Case(name="report:another-plan's-run.json", category="h-report",
             argv=("report", "plan2.json", "--run", "run.json", "-o", "out.html"), mentions=r"run\.json|not of this",
             absent=("out.html", "out.md"), needs=("run", "plan2")),
        Case(name="run:listening-sockets", category="i-sockets", argv=("run", "plan.json", "--steps", "3", "-o",
             "out.json"), kind="ok", expect=(0,), present=("out.json",), check=_loopback_only, spawns=True),
    ]


def cases_controls() -> list[Case]:
    return [
        Case(name="control:estimate", category="control", argv=("estimate", "profile.json", "--dp", "4"), kind="ok",
             expect=(0,)),
        Case(name="control:plan", category="control", argv=("plan", "profile.json", "-B", "64", "-o", "out.json"),
             kind="ok", expect=(0,), present=("out.json", "out.html")),
        Case(name="control:profile-meta", category="control", argv=(*PROFILE_META, "--cluster", "dgx-a100", "-o",
             "out.json"), kind="ok", expect=(0,), present=("out.json",)),
        Case(name="control:profile-cluster", category="control", argv=("profile-cluster", "--cluster", "cluster.json",
             "-o", "out.json"), kind="ok", expect=(0,), present=("out.json",)),
        Case(name="control:report", category="control", argv=("report", "plan.json", "-o", "out.html"), kind="ok",
             expect=(0,), present=("out.html", "out.md")),
        Case(name="control:report-with-run", category="control", argv=("report", "plan.json", "--run", "run.json",
             "-o", "out.html"), kind="ok", expect=(0,), present=("out.html",), needs=("run",)),
        Case(name="control:replan", category="control", argv=("replan", "--gpus", "2", "--checkpoint", "ck",
             "--profile", "profile.json", "--no-report", "-o", "out.json"), kind="ok", expect=(0,),
             present=("out.json",), needs=("ck",)),
        Case(name="control:presets", category="control", argv=("presets", "--json"), kind="ok", expect=(0,),
             check=_valid_json_stdout),
        Case(name="control:models", category="control", argv=("models", "--json"), kind="ok", expect=(0,),
             check=_valid_json_stdout),
    ]


def _no_ranks_started(rec: dict, d: Path) -> str | None:
    """The fault is visible before any work: refusing after the ranks ran wastes the run."""
    return f"refused only after {rec['max_descendants']} processes started" if rec["max_descendants"] >= 4 else None


# --- (j) the second reliability round: edited plans, weights and data that do not match, shared outputs -----------

def _safetensors_of_another_model(folder: str) -> Prepare:
    """A safetensors file (the format by hand: 8-byte header length, JSON header, data) holding one tensor no zoo
    model has."""
    header = json.dumps({"other.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()

    def prepare(d: Path) -> None:
        (d / folder).mkdir()
        (d / folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    return prepare


def _same_output(ctx: "Ctx") -> str:
    """Start a second run writing the same -o once the first has started its ranks."""
    ctx.wait_descendants(4)
    ctx.extra["B"] = ctx.start(("run", "plan.json", "--steps", "4", "-o", "out.json"), "B")
    return "second run with the same -o started while the first one's ranks ran"


def _second_refused_at_once(rec: dict, d: Path) -> str | None:
    b = rec["extra"].get("B")
    if not b:
        return "the second run was not started"
    if b["exit"] != 2 or b["stderr_lines"] != 1 or "being written by another" not in b["first_stderr"]:
        return f"second run: exit {b['exit']}, {b['first_stderr']!r}"
    return None if rec["exit"] == 0 else f"the first run ended with exit {rec['exit']}"


def cases_j() -> list[Case]:
    tp_plan = "def plan(model):\n    raise RuntimeError('boom')\n"
    return [
        Case(name="run:plan-edited-to-sgd", category="j-reliability", argv=("run", "plan-sgd.json", "-o", "out.json"),
             prepare=edit("plan.json", lambda doc: doc["strategy"].update(optimizer="sgd"), to="plan-sgd.json"),
             mentions=r"edited", absent=("out.json",), spawns=True, check=_no_ranks_started),
        Case(name="run:init-from-another-model", category="j-reliability",
             argv=("run", "plan.json", "--init-from", "w", "-o", "out.json"),
             prepare=_safetensors_of_another_model("w"), mentions=r"no weights for", absent=("out.json",),
             spawns=True, check=_no_ranks_started),
        Case(name="run:empty-data-file", category="j-reliability",
             argv=("run", "plan.json", "--data", "empty.bin", "-o", "out.json"), prepare=write("empty.bin", b""),
             mentions=r"is empty", absent=("out.json",), spawns=True, check=_no_ranks_started),
        Case(name="resume:other-data-than-trained-on", category="j-reliability",
             argv=("run", "plan.json", "--steps", "6", "--resume", "ck", "--data", "t.bin", "-o", "out.json"),
             prepare=write("t.bin", bytes(2 * 4096)), mentions=r"synthetic tokens", absent=("out.json",),
             spawns=True, needs=("ck",), check=_no_ranks_started),
        Case(name="profile:output-name-too-long", category="j-reliability",
             argv=(*PROFILE_META, "--cluster", "dgx-a100", "-o", "a" * 300 + ".json"), mentions=r"too long"),
        Case(name="profile:tp-plan-function-raises", category="j-reliability",
             argv=(*PROFILE_META, "--cluster", "dgx-a100", "--tp-plan", "userplan.py:plan", "-o", "out.json"),
             prepare=write("userplan.py", tp_plan.encode()), mentions=r"raised RuntimeError: boom",
             absent=("out.json",)),
        Case(name="two-runs-one-output", category="j-reliability",
             argv=("run", "plan.json", "--steps", "4", "-o", "out.json"), action=_same_output, expect=(0,),
             kind="ok", present=("out.json",), spawns=True, check=_second_refused_at_once),
    ]


def all_cases() -> list[Case]:
    cases = cases_controls() + cases_a() + cases_b() + cases_c() + cases_d() + cases_e() + cases_f() + cases_g() \
        + cases_hi() + cases_j()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names must be unique"
    return cases


def quick_cases() -> list[Case]:
    """The cases that start no ranks (the --quick set)."""
    return [c for c in all_cases() if not c.spawns]


# ---------------------------------------------------------------------------------------------------------------
# running a case

def planner_cmd() -> list[str]:
    """The `planner` script installed beside this interpreter (what a user of this environment runs), else this
    checkout's CLI through this interpreter: never another environment's `planner` found first on PATH."""
    exe = Path(sys.executable).with_name("planner")
    return [str(exe)] if exe.is_file() else [sys.executable, "-c", "import cli; cli.main()"]


@contextlib.contextmanager
def mp_lock(enabled: bool):
    """Hold the machine's rank-spawning lock (flock(2), the same lock `flock /tmp/zeropipe-mp.lock` takes)."""
    if not enabled:
        yield 0.0
        return
    t = time.monotonic()
    with open(MP_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - t
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class Watch(threading.Thread):
    """Every 0.2 s: the processes under `pid` (so orphans can be found after it exits) and, for spawning cases,
    the sockets they listen on."""

    def __init__(self, pid: int, *, sockets: bool) -> None:
        super().__init__(daemon=True)
        self.pid, self.sockets = pid, sockets
        self.seen: dict[int, psutil.Process] = {}
        self.listeners: set[tuple[str, int]] = set()
        self.max_descendants = 0
        self.stopped_at: float | None = None     # when a process under planner was first seen stopped (SIGSTOP)
        self.first_at: dict[int, float] = {}     # count -> monotonic time it was first reached
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                kids = psutil.Process(self.pid).children(recursive=True)
            except psutil.Error:
                kids = []
            for k in kids:
                self.seen.setdefault(k.pid, k)
                if self.stopped_at is None:
                    with contextlib.suppress(psutil.Error):
                        if k.status() == psutil.STATUS_STOPPED:
                            self.stopped_at = time.monotonic()
            n = len(kids)
            self.max_descendants = max(self.max_descendants, n)
            for i in range(1, n + 1):
                self.first_at.setdefault(i, time.monotonic())
            if self.sockets and kids:
                tree = {self.pid, *(k.pid for k in kids)}
                try:
                    for c in psutil.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN and c.pid in tree and c.laddr:
                            self.listeners.add((c.laddr.ip, c.laddr.port))
                except psutil.Error:
                    pass
            self.halt.wait(0.2)

    def orphans(self) -> list[psutil.Process]:
        # the rank server and multiprocessing's resource tracker end once planner's end closes their pipes: give
        # processes on their way out a moment
        psutil.wait_procs(list(self.seen.values()), timeout=2)
        alive = []
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        return alive


class Ctx:
    """What a case's action sees: the running command, its watcher, a way to start a second command."""

    def __init__(self, runner: "Runner", case: Case, d: Path, proc: subprocess.Popen, watch: Watch) -> None:
        self.runner, self.case, self.dir, self.proc, self.watch = runner, case, d, proc, watch
        self.extra: dict[str, Any] = {}
        self.others: list[tuple[str, subprocess.Popen, Watch, float, Path, Path]] = []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_descendants(self, n: int, timeout_s: float = 150.0) -> float | None:
        end = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < end:
            if n in self.watch.first_at:
                return self.watch.first_at[n]
            time.sleep(0.05)
        return None

    def wait_handler(self, sig: int, timeout_s: float = 60.0) -> float | None:
        end = time.monotonic() + timeout_s
        bit = 1 << (sig - 1)
        while self.alive() and time.monotonic() < end:
            with contextlib.suppress(OSError, ValueError, StopIteration):
                status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
                if int(next(s for s in status if s.startswith("SigCgt:")).split()[1], 16) & bit:
                    return time.monotonic()
            time.sleep(0.01)
        return None

    def wait_listeners(self, n: int, timeout_s: float = 150.0) -> float | None:
        end = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < end:
            if len(self.watch.listeners) >= n:
                return time.monotonic()
            time.sleep(0.05)
        return None

    def wait_mapped(self, lib: str, *, ranks: int, timeout_s: float = 150.0) -> float | None:
        """Wait until `lib` is mapped in planner (ranks=0) or in `ranks` of the processes under it."""
        end = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < end:
            pids = [self.proc.pid] if ranks == 0 else list(self.watch.seen)
            hits = 0
            for pid in pids:
                with contextlib.suppress(OSError):
                    hits += lib in Path(f"/proc/{pid}/maps").read_text()
            if hits >= max(1, ranks):
                return time.monotonic()
            time.sleep(0.02)
        return None

    def descendants_now(self) -> int:
        with contextlib.suppress(psutil.Error):
            return len(psutil.Process(self.proc.pid).children(recursive=True))
        return 0

    def send(self, sig: int, *, group: bool) -> None:
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(self.proc.pid, sig)

    def start(self, argv: tuple[str, ...], tag: str) -> dict:
        """Run a second command in the same folder to its end; returns its summary."""
        out, err = self.runner.logs / f"{self.case_slug}.{tag}.out", self.runner.logs / f"{self.case_slug}.{tag}.err"
        t = time.monotonic()
        proc, watch = self.runner.popen(self.case, self.dir, argv, out, err)
        rc, timed_out = self.runner.wait(proc, self.runner.time_limit(self.case))
        watch.halt.set()
        watch.join()
        orphans = self.runner.reap(watch)
        summary = summarize_output(out, err)
        summary.pop("stdout_full")
        return {"argv": ["planner", *argv], **summary, "exit": rc, "timed_out": timed_out,
                "wall_s": round(time.monotonic() - t, 2), "orphans": orphans}

    @property
    def case_slug(self) -> str:
        return slug(self.case.name)


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", name)


def summarize_output(out: Path, err: Path) -> dict:
    stdout = out.read_text(errors="replace")
    stderr = err.read_text(errors="replace")
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return {"stdout_full": stdout, "stdout": stdout[-2000:], "stderr_tail": lines[-25:], "stderr_lines": len(lines),
            "first_stderr": lines[0] if lines else "", "traceback": TRACEBACK in stdout or TRACEBACK in stderr}


def partial_files(d: Path) -> set[str]:
    found = set()
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            if PARTIAL.match(name):
                found.add(os.path.relpath(os.path.join(root, name), d))
    return found


class Runner:
    def __init__(self, work: Path, fixtures: Path, have: set[str]) -> None:
        self.work, self.fixtures, self.have = work, fixtures, have
        self.logs = work / "logs"
        self.logs.mkdir(exist_ok=True)
        self.env = {**os.environ, "XDG_CONFIG_HOME": str(work / "config"), "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("ZEROPIPE_CHECKPOINT_KEY", None)
        self.env.pop("ZEROPIPE_INJECT_FAILURE", None)

    def time_limit(self, case: Case) -> float:
        return case.timeout_s or (SPAWN_TIME_LIMIT_S if case.spawns else TIME_LIMIT_S)

    def popen(self, case: Case, d: Path, argv: tuple[str, ...], out: Path, err: Path, *, fsize: int | None = None):
        cmd = [*limited(memory=MEMORY_LIMIT if case.limits else None, fsize=fsize), *planner_cmd(), *argv]
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(cmd, cwd=d, env={**self.env, **dict(case.env)}, stdin=subprocess.DEVNULL,
                                    stdout=fo, stderr=fe, start_new_session=True)
        watch = Watch(proc.pid, sockets=case.spawns)
        watch.start()
        return proc, watch

    @staticmethod
    def wait(proc: subprocess.Popen, limit_s: float) -> tuple[int, bool]:
        try:
            return proc.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), True

    @staticmethod
    def reap(watch: Watch) -> list[str]:
        """Processes that outlived planner: named, then killed (SIGCONT first for a stopped one)."""
        left = watch.orphans()
        names = []
        for p in left:
            with contextlib.suppress(psutil.Error):
                names.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
                p.send_signal(signal.SIGKILL)
                p.send_signal(signal.SIGCONT)
        return names

    def setup_case_dir(self, case: Case) -> Path:
        d = self.work / "cases" / slug(case.name)
        d.mkdir(parents=True)
        for name in ("profile.json", "plan.json", "run.json", "cluster.json", "plan2.json"):
            if (self.fixtures / name).exists():
                shutil.copyfile(self.fixtures / name, d / name)
        if "ck" in case.needs:
            shutil.copytree(self.fixtures / "ck", d / "ck", symlinks=True)
        return d

    def run(self, case: Case) -> dict:
        rec: dict[str, Any] = {"name": case.name, "category": case.category, "argv": ["planner", *case.argv],
                               "spawns": case.spawns, "expect": list(case.expect), "kind": case.kind,
                               "env": dict(case.env), "exit": None, "stderr_lines": 0, "first_stderr": "",
                               "traceback": False, "leftovers": [], "unexpected_outputs": [], "wall_s": 0.0,
                               "lock_wait_s": 0.0, "note": "", "extra": {}, "listeners": [], "orphans": [],
                               "max_descendants": 0, "mount": None}
        missing = sorted(set(case.needs) - self.have)
        if missing:
            rec["verdict"] = f"skipped: needs {', '.join(missing)} (made by the full set-up, which spawns ranks)"
            return rec
        d = self.setup_case_dir(case)
        try:
            if case.prepare:
                case.prepare(d)
            with mounted(case.mount, d) as how:
                rec["mount"] = how
                if how and how.startswith("not testable"):
                    rec["verdict"] = f"skipped: {how}"
                    return rec
                before = partial_files(d)
                with mp_lock(case.spawns) as waited:
                    rec["lock_wait_s"] = round(waited, 1)
                    self._execute(case, d, rec, fsize=FSIZE_LIMIT if how and how.startswith("RLIMIT") else None)
                rec["leftovers"] = sorted(partial_files(d) - before)
                rec["unexpected_outputs"] = [p for p in case.absent if (d / p).exists()]
                rec["missing_outputs"] = [p for p in case.present if not (d / p).exists()]
                rec["verdict"] = verdict(case, rec, d)
        except Exception as exc:    # the matrix's own failure: say so in the case, keep going
            rec["verdict"] = f"skipped: set-up failed: {type(exc).__name__}: {exc}"
        rec.pop("stdout_full", None)
        return rec

    def _execute(self, case: Case, d: Path, rec: dict, *, fsize: int | None) -> None:
        out, err = self.logs / f"{slug(case.name)}.out", self.logs / f"{slug(case.name)}.err"
        t = time.monotonic()
        proc, watch = self.popen(case, d, case.argv, out, err, fsize=fsize)
        ctx = Ctx(self, case, d, proc, watch)
        if case.action:
            rec["note"] = case.action(ctx)
        rc, timed_out = self.wait(proc, max(1.0, self.time_limit(case) - (time.monotonic() - t)))
        rec["wall_s"] = round(time.monotonic() - t, 2)
        if watch.stopped_at is not None:
            rec["note"] = (rec["note"] + "; " if rec["note"] else "") + \
                f"a process under planner was stopped; planner exited {time.monotonic() - watch.stopped_at:.1f} s later"
        time.sleep(0.3 if case.spawns else 0.0)     # let the watcher see processes that outlive planner
        watch.halt.set()
        watch.join()
        rec["orphans"] = self.reap(watch)
        rec.update(summarize_output(out, err), exit=rc, timed_out=timed_out,
                   listeners=sorted(watch.listeners), max_descendants=watch.max_descendants, extra=ctx.extra)


@contextlib.contextmanager
def mounted(how: str | None, d: Path):
    """"ro": DIR/ro a read-only bind mount (root ignores file modes, so chmod would prove nothing); "full" /
    "full-empty": DIR/full a 64 KiB tmpfs, filled up for "full". Falls back to saying it is not testable here."""
    if how is None:
        yield None
        return
    target = d / ("ro" if how == "ro" else "full")
    target.mkdir()
    if how == "ro":
        src = d / "ro-src"
        src.mkdir()
        cmds = [["mount", "--bind", str(src), str(target)], ["mount", "-o", "remount,bind,ro", str(target)]]
    else:
        cmds = [["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)]]
    done = []
    try:
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise OSError(r.stderr.strip() or f"{cmd[0]} exit {r.returncode}")
            done.append(cmd)
        probe = target / "probe"
        if how == "ro":
            try:
                probe.write_bytes(b"x")
                raise OSError("the read-only bind mount accepted a write")
            except PermissionError:
                raise OSError("writes fail with EACCES, not EROFS") from None
            except OSError as exc:
                if exc.errno != 30:      # EROFS
                    raise
        elif how == "full":
            with open(target / "filler", "wb", buffering=0) as fh, contextlib.suppress(OSError):
                while True:
                    fh.write(b"\0" * 4096)
    except OSError as exc:
        for _ in done:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)
        if how == "ro":
            yield f"not testable here: a read-only bind mount failed ({exc}); as root, chmod would not stop writes"
        else:
            yield f"RLIMIT_FSIZE {FSIZE_LIMIT} B, SIGXFSZ ignored (a 64 KiB tmpfs failed: {exc})"
        return
    try:
        yield {"ro": "read-only bind mount", "full": "64 KiB tmpfs, filled",
               "full-empty": "64 KiB tmpfs"}[how]
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def verdict(case: Case, rec: dict, d: Path) -> str:
    rc = rec["exit"]
    if rec["timed_out"]:
        return f"fail: timed out after {rec['wall_s']:.0f} s (killed)"
    reasons = []
    if rc < 0:
        reasons.append(f"killed by {signal.Signals(-rc).name}")
    elif rc not in case.expect:
        reasons.append(f"exit {rc}, expected {'/'.join(map(str, case.expect))}")
    if rec["traceback"]:
        reasons.append("traceback")
    if rec["leftovers"]:
        reasons.append(f"left {', '.join(rec['leftovers'][:3])}")
    if rec["unexpected_outputs"]:
        reasons.append(f"wrote {', '.join(rec['unexpected_outputs'])}")
    if rec.get("missing_outputs"):
        reasons.append(f"did not write {', '.join(rec['missing_outputs'])}")
    if rec["orphans"]:
        reasons.append(f"{len(rec['orphans'])} process(es) outlived planner")
    first, n = rec["first_stderr"], rec["stderr_lines"]
    if rc in case.expect and rc != 0 and case.kind in ("refuse", "interrupt", "pair", "bounded"):
        want = "interrupted" if rc == 130 else "error: "
        if n != 1:
            reasons.append(f"{n} stderr lines, expected one")
        elif not first.startswith(want):
            reasons.append(f"stderr is not one '{want.strip()}' line")
        elif "already exists" in first:
            reasons.append("refused for an existing output, not for the fault")
        elif case.mentions and rc != 130 and not re.search(case.mentions, first, re.IGNORECASE):
            reasons.append(f"the error line does not name the fault (/{case.mentions}/)")
    if case.kind == "usage" and rc == 2 and case.mentions and not re.search(case.mentions, "\n".join(
            rec["stderr_tail"]), re.IGNORECASE):
        reasons.append("the usage error does not name the option")
    if case.check and not reasons:
        extra = case.check(rec, d)
        if extra:
            reasons.append(extra)
    return "fail: " + "; ".join(reasons) if reasons else "pass"


# ---------------------------------------------------------------------------------------------------------------
# set-up

def sh(cmd: list[str], cwd: Path, env: dict, *, lock: bool = False, timeout: float = 600.0) -> str:
    with mp_lock(lock):
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"`{' '.join(cmd[-len(cmd) + 1:])}` exit {r.returncode}: {tail}")
    return r.stdout


def setup(work: Path, quick: bool, env: dict) -> tuple[Path, set[str], list[str]]:
    """Make the fixtures; returns their folder, which optional ones exist, and notes."""
    fx = work / "fixtures"
    fx.mkdir()
    p = planner_cmd()
    notes = []
    t = time.monotonic()
    if quick:
        # no ranks: real-mode timings (so NaN edits mean something) on a preset, and a 4-GPU plan like the demo's
        sh([*p, "profile", "--model", "gpt-tiny", "-b", "4", "-s", "64", "--dtype", "fp32", "--cluster", "dgx-a100",
            "--repeats", "2", "--warmup", "1", "-o", "profile.json"], fx, env)
        sh([*p, "plan", "profile.json", "-B", "64", "--gpus", "4", "--no-report", "-o", "plan.json"], fx, env)
    else:
        sh([*p, "demo"], fx, env, lock=True, timeout=900)
        for name in ("profile.json", "plan.json", "run.json"):
            shutil.copyfile(fx / "zeropipe-demo" / name, fx / name)
        shutil.rmtree(fx / "zeropipe-demo")
        sh([*p, "run", "plan.json", "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "2", "-o", "-"],
           fx, env, lock=True)
        sh([*p, "plan", "profile.json", "-B", "32", "--gpus", "2", "--no-report", "-o", "plan2.json"], fx, env)
    sh([*p, "profile-cluster", "--cluster", "dgx-a100", "-o", "cluster.json"], fx, env)
    have = {name for name, f in (("run", "run.json"), ("ck", "ck"), ("plan2", "plan2.json")) if (fx / f).exists()}
    notes.append(f"set-up ({'quick: no ranks' if quick else 'planner demo + checkpointed run'}) "
                 f"{time.monotonic() - t:.0f} s")
    return fx, have, notes


# ---------------------------------------------------------------------------------------------------------------
# report

def shorten(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def table(records: list[dict]) -> str:
    rows = [("case", "category", "exit", "lines", "verdict", "first stderr line")]
    for r in records:
        rows.append((r["name"], r["category"], "-" if r["exit"] is None else str(r["exit"]), str(r["stderr_lines"]),
                     shorten(r["verdict"], 60), shorten(r["first_stderr"], 90)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5])
        if i == 0:
            lines.append("-" * (sum(widths) + 2 * 5 + 20))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the cases that start no ranks (no demo set-up)")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for fault-matrix.json (default: .)")
    ap.add_argument("--only", action="append", default=[], help="run only cases whose name contains this")
    ap.add_argument("--jobs", type=int, default=2, help="non-spawning cases run this many at a time (default 2)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = ap.parse_args(argv)

    load_start = os.getloadavg()
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    cases = quick_cases() if args.quick else all_cases()
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only)]
    work = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    records: dict[str, dict] = {}
    try:
        env = {**os.environ, "XDG_CONFIG_HOME": str(work / "config"), "OMP_NUM_THREADS": "1"}
        env.pop("ZEROPIPE_CHECKPOINT_KEY", None)
        fixtures, have, notes = setup(work, args.quick, env)
        runner = Runner(work, fixtures, have)
        single = [c for c in cases if not c.spawns]
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for c, rec in zip(single, pool.map(runner.run, single)):
                records[c.name] = rec
                print(f"  {rec['verdict'][:4]:4}  {c.name}", file=sys.stderr, flush=True)
        for c in (c for c in cases if c.spawns):
            records[c.name] = rec = runner.run(c)
            print(f"  {rec['verdict'][:4]:4}  {c.name} ({rec['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    finally:
        for m in sorted((work / "cases").glob("*/*"), reverse=True) if (work / "cases").exists() else []:
            if os.path.ismount(m):
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    ordered = [records[c.name] for c in cases if c.name in records]
    passed = sum(r["verdict"] == "pass" for r in ordered)
    failed = sum(r["verdict"].startswith("fail") for r in ordered)
    skipped = len(ordered) - passed - failed
    print(table(ordered))
    summary = f"{len(ordered)} cases: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")
    print(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fault-matrix.json").write_text(json.dumps({
        "schema_version": 1, "kind": "zeropipe.benchmark.fault_matrix", "quick": args.quick, "summary": summary,
        "passed": passed, "failed": failed, "skipped": skipped, "cases": ordered, "setup_notes": notes,
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "wall_s": round(time.monotonic() - t0, 1), "started_at": started.isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
