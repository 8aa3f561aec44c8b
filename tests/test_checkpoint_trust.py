"""Checkpoints that cannot be trusted, saved, or shared: the signed listing (a resume runs code a checkpoint
carries, torch DCP unpickles `.metadata`), RNG states without pickles, a save on a full disk, the lock on a
checkpoint folder, and which earlier checkpoint a damaged one points to. (Tests marked slow spawn ranks.)"""
import fcntl
import json
import os
import pickle
import re
import stat
import subprocess
import sys

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from typer.testing import CliRunner

from cli import app
from cost_models.records.errors import ConfigError
from cost_models.records.fileio import dumps, write_atomic
from executor import checkpoint, trust
from executor import checkpoint_layout as layout
from executor.launch import RunConfig, launch
from executor.testing_hooks import SAVE_FILE_LIMIT_ENV
from tests.plans import plan_file, plan_for
from tests.test_checkpoint import _fake_checkpoint
from tests.test_executor import S

runner = CliRunner()
UNTRUSTED = ("resuming runs code stored in it (torch DCP unpickles its .metadata); pass --trust-checkpoint if you made "
             "it or trust who did")


@pytest.fixture(autouse=True)
def own_checkpoint_key(tmp_path, monkeypatch):
    """A key of this test's own, never the user's (~/.config/zeropipe); subprocesses inherit it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    return tmp_path / "config" / "zeropipe" / "checkpoint.key"


@pytest.fixture(scope="module")
def profile():
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    return profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")


class _Payload:
    """What a crafted `.metadata` can hold: unpickling it calls open(marker, "w"), i.e. runs the attacker's code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _rewrite_with_digest(step_dir, name: str, data: bytes) -> None:
    """What someone with write access to the folder does: replace a file and its size and sha256 in the listing."""
    (step_dir / name).write_bytes(data)
    meta = json.loads((step_dir / layout.META_NAME).read_text())
    for f in meta["files"]:
        if f["name"] == name:
            f.update(bytes=len(data), sha256=layout.digest(step_dir / name).sha256)
    write_atomic(step_dir / layout.META_NAME, dumps(meta), overwrite=True)


def test_the_key_is_private_made_once_and_kept_outside_checkpoints(tmp_path, monkeypatch, own_checkpoint_key):
    path = trust.key_path()
    assert path == own_checkpoint_key and trust.load_key(path) is None
    key = trust.load_or_create_key(path)
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert trust.load_or_create_key(path) == key                 # made once
    assert list(path.parent.iterdir()) == [path]                 # no temporary file left beside it
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert trust.key_path() == tmp_path / "home" / ".config" / "zeropipe" / "checkpoint.key"
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "shared.key"))
    assert trust.key_path() == tmp_path / "shared.key"

    signature = trust.sign(b"listing", key)
    assert trust.verify(b"listing", signature, key) and trust.verify(b"listing", signature + "\n", key)
    assert not trust.verify(b"listinG", signature, key)
    assert not trust.verify(b"listing", signature, bytes(32))
    assert not trust.verify(b"listing", "\u00e9", key)
    (tmp_path / "short.key").write_bytes(b"0123")
    (tmp_path / "short.key").chmod(0o600)
    with pytest.raises(ConfigError, match="holds 4 bytes, a key needs 32"):
        trust.load_key(tmp_path / "short.key")


def test_a_key_others_can_read_or_that_is_no_file_is_refused(tmp_path):
    """As ssh refuses a private key others can read: a copied key at 0644 signs nothing; a device is no key (reading
    /dev/zero would never end)."""
    shared = tmp_path / "copied.key"
    shared.write_bytes(bytes(range(32)))
    for mode in (0o644, 0o660, 0o606):
        shared.chmod(mode)
        with pytest.raises(ConfigError) as err:
            trust.load_key(shared)
        assert str(err.value) == (f"the checkpoint key {shared} is accessible to other users (mode {mode:04o}): anyone "
                                  f"who can read it can sign checkpoints; chmod 600 {shared}")
    shared.chmod(0o600)
    assert trust.load_key(shared) == bytes(range(32))
    shared.write_bytes(bytes(200))   # a longer key is read whole (HMAC takes any length), never cut short
    assert trust.load_key(shared) == bytes(200)
    shared.write_bytes(bytes(trust.KEY_FILE_MAX + 1))
    with pytest.raises(ConfigError, match="more than a key file holds"):
        trust.load_key(shared)
    with pytest.raises(ConfigError, match="is not a regular file"):
        trust.load_key(Path("/dev/zero"))
    with pytest.raises(ConfigError, match="is not a regular file"):
        trust.load_key(tmp_path)


def test_a_checkpoint_with_rewritten_files_and_digests_is_refused_before_anything_unpickles_it(
        tmp_path, profile, own_checkpoint_key, monkeypatch):
    plan = plan_for(S(2, 1), profile)
    plan_path = plan_file(tmp_path, S(2, 1), profile)
    ck = tmp_path / "ck"
    step = _fake_checkpoint(ck, 3, plan)
    assert (step / layout.SIG_NAME).read_text().strip() == trust.signature_line(
        (step / layout.META_NAME).read_bytes(), own_checkpoint_key.read_bytes())
    assert layout.check_signature(step) is True
    marker = tmp_path / "payload-ran"
    _rewrite_with_digest(step, ".metadata", pickle.dumps(_Payload(marker)))
    layout.verify(step, layout.read_meta(step))                  # the digests alone no longer tell

    # the listing this installation's key signed has changed: damaged, and no --trust-checkpoint offered (trusting
    # it would run the payload)
    refusal = (f"checkpoint {step} is damaged: its {layout.META_NAME} no longer matches the signature this "
               f"installation's key made; no earlier complete checkpoint is there, so start without --resume")
    with pytest.raises(layout.CheckpointError) as exc:
        launch(plan, RunConfig(steps=5, warmup=0, resume=str(ck)))
    assert str(exc.value) == refusal
    res = runner.invoke(app, ["run", str(plan_path), "--steps", "5", "--resume", str(ck), "-o", "-"])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [f"error: {refusal}"]
    with pytest.raises(layout.CheckpointError, match=f"is damaged: its {layout.META_NAME}"):
        launch(plan, RunConfig(steps=5, warmup=0, resume=str(ck), trust_checkpoint=True))
    assert not marker.exists()

    # without a signature, or with one made by another key
    (step / layout.SIG_NAME).unlink()
    with pytest.raises(layout.CheckpointError) as exc:
        launch(plan, RunConfig(steps=5, warmup=0, resume=str(ck)))
    assert str(exc.value) == f"checkpoint {step} is not signed (it has no {layout.SIG_NAME}): {UNTRUSTED}"
    (step / layout.SIG_NAME).write_text(trust.sign((step / layout.META_NAME).read_bytes(), bytes(range(32))))
    with pytest.raises(layout.CheckpointError, match="is not signed by this installation's key"):
        launch(plan, RunConfig(steps=5, warmup=0, resume=str(ck)))
    # a signed checkpoint, and no key here to check it with
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "absent.key"))
    with pytest.raises(layout.CheckpointError, match=r"is signed, but this installation has no key to check it \("):
        launch(plan, RunConfig(steps=5, warmup=0, resume=str(ck)))
    assert not (tmp_path / "absent.key").exists()                # resuming never makes a key
    monkeypatch.delenv(trust.KEY_ENV)

    # --trust-checkpoint skips the signature only: sizes and digests are still checked (before any rank starts)
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + b"X")
    with pytest.raises(layout.CheckpointError, match="is damaged: __0_0.distcp does not match its sha256"):
        launch(plan, RunConfig(steps=5, warmup=0, resume=str(ck), trust_checkpoint=True))
    assert not marker.exists()

    # the payload is live: DCP's reader runs it, which is what the refusal keeps from happening
    try:
        dcp.FileSystemReader(str(step)).read_metadata()
    except Exception:
        pass                                                     # what it returns is no Metadata: too late
    assert marker.exists()


def test_replan_checks_the_signature_of_the_listing_it_plans_from(tmp_path, profile, monkeypatch):
    """replan reads only the JSON listing, but the plan it writes names the model code `planner run` imports."""
    step = _fake_checkpoint(tmp_path / "ck", 3, plan_for(S(2, 1), profile))
    (step / layout.SIG_NAME).unlink()
    res = runner.invoke(app, ["replan", "--gpus", "2", "--checkpoint", str(tmp_path / "ck"), "-o", "new.json"])
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"error: checkpoint {step} is not signed (it has no {layout.SIG_NAME}): {UNTRUSTED}"]
    trusted = runner.invoke(app, ["replan", "--gpus", "2", "--checkpoint", str(tmp_path / "ck"), "-o", "new.json",
                                  "--trust-checkpoint"])
    assert trusted.exit_code == 2 and "does not record the profile it was made from" in trusted.stderr


def test_the_hint_names_the_latest_earlier_checkpoint_that_verifies(tmp_path, profile):
    plan = plan_for(S(2, 1), profile)
    two, four, six, eight = (_fake_checkpoint(tmp_path, s, plan) for s in (2, 4, 6, 8))
    shard = eight / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-7])                   # the one resumed from: truncated
    six_shard = six / "__0_0.distcp"
    six_shard.write_bytes(six_shard.read_bytes()[:-1] + b"X")    # complete, same size, other bytes
    _rewrite_with_digest(four, "__0_0.distcp", b"other")         # digests match, the signature does not
    with pytest.raises(layout.CheckpointError) as exc:
        layout.verify(eight, layout.read_meta(eight))
    assert str(exc.value) == (f"checkpoint {eight} is damaged: __0_0.distcp has 493 of its 500 bytes; resume from "
                              f"{two}, the latest checkpoint before it that verifies")
    (two / ".metadata").unlink()
    with pytest.raises(layout.CheckpointError) as exc:
        layout.verify(eight, layout.read_meta(eight))
    assert str(exc.value).endswith("; no earlier checkpoint there verifies, so start without --resume")


def test_a_second_run_on_a_checkpoint_folder_is_refused_before_it_touches_it(tmp_path, profile, monkeypatch):
    plan_path = plan_file(tmp_path, S(2, 1), profile)
    ck = tmp_path / "ck"
    later = _fake_checkpoint(ck, 9, plan_for(S(2, 1), profile))  # --overwrite-checkpoints would remove it
    fd = os.open(ck / layout.LOCK_NAME, os.O_RDWR | os.O_CREAT)  # the first run, as its launcher holds the lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242\nplanner run first.json --checkpoint-dir ck\n")
        res = runner.invoke(app, ["run", str(plan_path), "--steps", "2", "--checkpoint-dir", str(ck),
                                  "--overwrite-checkpoints", "-o", "-"])
    finally:
        os.close(fd)
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"error: checkpoint folder {ck} is in use by another planner run (pid 4242: planner run first.json "
        f"--checkpoint-dir ck); wait for it to finish or choose another --checkpoint-dir"]
    assert later.is_dir()

    # a holder that dies leaves no lock behind (the kernel drops flock locks with the process)
    code = (f"import fcntl, os; fd = os.open({str(ck / layout.LOCK_NAME)!r}, os.O_RDWR); "
            f"fcntl.flock(fd, fcntl.LOCK_EX); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    with layout.locked(ck, "planner run second.json"):
        assert (ck / layout.LOCK_NAME).read_text() == f"{os.getpid()}\nplanner run second.json\n"
    assert layout.prune(ck, keep=1) == [] and (ck / layout.LOCK_NAME).is_file()   # pruning leaves the lock file


def test_rng_states_round_trip_exactly_through_tensors():
    import random

    import numpy as np
    random.seed(5)
    np.random.seed(7)
    random.gauss(0, 1)                                           # leaves gauss_next cached
    np.random.standard_normal()                                  # leaves numpy's cached gaussian
    saved = checkpoint.rng_state()
    assert {k: v.dtype for k, v in saved.items() if k != "torch"} == {
        "py.version": torch.int64, "py.state": torch.int64, "py.gauss": torch.float64, "np.state": torch.int64,
        "np.pos": torch.int64, "np.gauss": torch.float64}
    expected = (random.random(), random.gauss(0, 1), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    checkpoint.set_rng_state({k: v.clone() for k, v in saved.items()})
    again = (random.random(), random.gauss(0, 1), np.random.standard_normal(), np.random.rand(), torch.rand(3))
    assert again[:4] == expected[:4] and torch.equal(again[4], expected[4])


def _cli(cwd, *args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-c", "import cli; cli.main()", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.mark.slow
def test_a_failed_save_says_why_in_one_line_and_removes_its_partial_folder(tmp_path, profile):
    """ZeRO-1 over 2 ranks, a checkpoint after each step; from the save after step 2 on, no file may grow past
    64 KiB (each rank's shard is ~1.6 MB): the writes fail with a real EFBIG from the kernel, as on a full disk
    (a 4 MiB tmpfs gives the same line with "[Errno 28] No space left on device")."""
    plan = plan_file(tmp_path, S(2, 1, 1), profile)
    proc = _cli(tmp_path, "run", plan.name, "--steps", "3", "--warmup", "0", "--checkpoint-dir", "ck",
                "--checkpoint-every", "1", "-o", "-", env={SAVE_FILE_LIMIT_ENV: "2:65536"})
    ck = tmp_path / "ck"
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.fullmatch(r"error: rank [01] failed: CheckpointSaveError: saving checkpoint step 2 to ck failed: "
                        r"\[Errno 27\] File too large; the partial folder was removed", lines[0]), lines[0]
    assert sorted(p.name for p in ck.iterdir()) == [layout.LOCK_NAME, "step-00000001"]   # no .incomplete-*
    pid, command = (ck / layout.LOCK_NAME).read_text().splitlines()
    assert int(pid) > 0 and command.endswith("run plan.json --steps 3 --warmup 0 --checkpoint-dir ck "
                                             "--checkpoint-every 1 -o -")

    # the checkpoint before it is whole and signed, its RNG states are tensors (nothing pickled but DCP's own
    # .metadata, which the signature vouches for), and a resume from it runs
    step = ck / "step-00000001"
    layout.verify(step, layout.read_meta(step))
    assert layout.check_signature(step)
    saved = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    rng = {k: v for k, v in saved.items() if k.startswith("rng.")}
    assert not [k for k, v in saved.items() if not isinstance(v, TensorStorageMetadata)]
    assert {k: v.properties.dtype for k, v in rng.items()} == {
        f"rng.rank{r}.{name}": dtype for r in (0, 1) for name, dtype in (
            ("torch", torch.uint8), ("py.version", torch.int64), ("py.state", torch.int64),
            ("py.gauss", torch.float64), ("np.state", torch.int64), ("np.pos", torch.int64),
            ("np.gauss", torch.float64))}
    assert rng["rng.rank0.py.state"].size == torch.Size([625]) and rng["rng.rank1.np.state"].size == torch.Size([624])
    resumed = _cli(tmp_path, "run", plan.name, "--steps", "2", "--warmup", "0", "--resume", "ck", "-o", "-")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from ck/step-00000001, signature and checksums verified; same plan" in resumed.stderr


def test_a_planted_lock_file_is_refused_and_what_it_points_at_is_untouched(tmp_path):
    """The checkpoint folder's lock is opened without following links: a symlink planted as DIR/.zeropipe.lock
    would otherwise have every run truncate and write the file it names; a FIFO or device is no lock either."""
    folder, target = tmp_path / "ck", tmp_path / "precious.txt"
    folder.mkdir()
    target.write_text("the user's own file\n")
    (folder / layout.LOCK_NAME).symlink_to(target)
    with pytest.raises(layout.CheckpointError) as err:
        with layout.locked(folder, "planner run"):
            pass
    assert str(err.value) == f"cannot use --checkpoint-dir {folder}: {layout.LOCK_NAME} is a symbolic link; remove it"
    assert target.read_text() == "the user's own file\n"
    (folder / layout.LOCK_NAME).unlink()
    os.mkfifo(folder / layout.LOCK_NAME)
    with pytest.raises(layout.CheckpointError, match=f"{layout.LOCK_NAME} is not a regular file; remove it"):
        with layout.locked(folder, "planner run"):
            pass
    (folder / layout.LOCK_NAME).unlink()
    with layout.locked(folder, "planner run"):   # a real lock file: taken, and it records the holder
        assert (folder / layout.LOCK_NAME).read_text() == f"{os.getpid()}\nplanner run\n"
