"""Test hooks: environment variables with which tests make the executor fail, or choose a path, on purpose. None is
for users. Product code reads them only through `hook` here, so that every way a test steers the product is in
this one file."""
from __future__ import annotations

import os

# "RANK:STEP" makes that rank raise at the start of that step, "RANK:STEP:kill" makes it SIGKILL itself there (what
# kill -9 or the OOM killer does: no exception, no cleanup, no note), "RANK:STEP:stop" SIGSTOP itself (a hung rank:
# alive, silent, its peers time out waiting for it), "RANK:STEP:nan" sets one of its parameters to NaN after that
# step's update (executor.train); STEP "start" does it during start-up, before the process group (executor.launch)
INJECT_FAILURE_ENV = "ZEROPIPE_INJECT_FAILURE"
# a full disk: "STEP:BYTES" makes every rank's files stop growing at BYTES from the save after STEP on (RLIMIT_FSIZE,
# with SIGXFSZ ignored, so write(2) fails with a real EFBIG: setrlimit(2), getrlimit(2)) (executor.train)
SAVE_FILE_LIMIT_ENV = "ZEROPIPE_SAVE_FILE_LIMIT"
# "TRIAL:RANK:STEP[:kind]" sets INJECT_FAILURE_ENV=RANK:STEP[:kind] for the ranks of trial number TRIAL (0 = the
# first candidate run) of `planner plan --verify` only, so a test can make one candidate fail (executor.verify)
VERIFY_INJECT_ENV = "ZEROPIPE_TEST_VERIFY_INJECT"
# a folder: ranks torch.save their full state after checkpoint loads and saves (executor.checkpoint)
DUMP_STATE_ENV = "ZEROPIPE_DUMP_STATE"
# "factory" | "per-module": force one way of initialising a model's weights, so tests check both
# (executor.materialize.init_mode)
INIT_ENV = "ZEROPIPE_INIT"


def hook(name: str) -> str:
    """The hook's value in this process's environment ("" when a test did not set it)."""
    return os.environ.get(name, "")
