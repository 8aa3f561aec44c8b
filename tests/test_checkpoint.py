"""Checkpoints for real: DCP files from multi-process gloo runs, a rank killed with SIGKILL, resharding into another
plan, replanning, and damaged checkpoints. (The layout tests at the top need no processes.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ProfileFile
from cost_models.records.strategy import Strategy
from executor import checkpoint_layout as layout
from executor.launch import RunConfig, launch
from executor.testing_hooks import DUMP_STATE_ENV
from executor.train import TrainConfig, single_process_losses
from tests.plans import plan_file, plan_for
from tests.test_executor import CFG, S


@pytest.fixture(scope="module")
def profile():
    return profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")


def _cli(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def token_file(path: Path, tokens) -> Path:
    """`tokens` written as a flat uint16 token file (executor.data.TokenFile's .bin)."""
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return path


def _losses(proc) -> list[float]:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["losses"]


def _fake_checkpoint(root: Path, step: int, plan, payload: bytes = b"shard") -> Path:
    """A checkpoint made by the commit protocol around stand-in data files (the layout does not read DCP)."""
    tmp = layout.incomplete_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload * 100)
    (tmp / ".metadata").write_bytes(b"meta")
    return layout.commit(root, step, {"samples_seen": step * 8, "seed": 0, "lr": 1e-3, "loss": 1.0, "world_size": 1,
                                      "plan": plan, "torch_version": torch.__version__}, [])


def test_a_checkpoint_is_complete_or_invisible(tmp_path, profile):
    plan = plan_for(S(2, 1), profile)
    _fake_checkpoint(tmp_path, 2, plan)
    four = _fake_checkpoint(tmp_path, 4, plan)
    layout.incomplete_dir(tmp_path, 6).mkdir()                  # a save killed half-way
    (tmp_path / "step-00000008").mkdir()                        # a folder without the meta: not made by the protocol
    assert [s for s, _ in layout.complete_steps(tmp_path)] == [2, 4]
    assert layout.resolve(tmp_path) == four
    meta = layout.read_meta(four)
    assert meta.step == 4 and meta.samples_seen == 32 and meta.plan == plan
    assert {f.name for f in meta.files} == {"__0_0.distcp", ".metadata"}
    layout.verify(four, meta)                                   # intact: no error
    with pytest.raises(layout.CheckpointError, match="not a complete checkpoint"):
        layout.resolve(tmp_path / "step-00000008")
    # retention keeps the newest and drops leftovers of killed saves older than it
    layout.incomplete_dir(tmp_path, 1).mkdir()                  # killed before the newest complete one
    assert layout.prune(tmp_path, keep=1) == [tmp_path / "step-00000002"]
    assert not layout.incomplete_dir(tmp_path, 1).exists()
    assert layout.incomplete_dir(tmp_path, 6).exists()          # newer than step 4: maybe a save in progress
    assert [s for s, _ in layout.complete_steps(tmp_path)] == [4]


def test_damage_is_named_with_the_checkpoint_to_use_instead(tmp_path, profile):
    plan = plan_for(S(2, 1), profile)
    _fake_checkpoint(tmp_path, 3, plan)
    six = _fake_checkpoint(tmp_path, 6, plan)
    data = six / "__0_0.distcp"
    original = data.read_bytes()
    data.write_bytes(original[:-7])
    with pytest.raises(layout.CheckpointError) as exc:
        layout.verify(six, layout.read_meta(six))
    assert str(exc.value) == (f"checkpoint {six} is damaged: __0_0.distcp has 493 of its 500 bytes; resume from "
                              f"{tmp_path / 'step-00000003'}, the latest checkpoint before it that verifies")
    data.write_bytes(original[:-1] + b"X")                      # same size, other bytes
    with pytest.raises(layout.CheckpointError, match="does not match its sha256"):
        layout.verify(six, layout.read_meta(six))
    (six / layout.META_NAME).write_text("{")
    with pytest.raises(layout.CheckpointError, match="is damaged .*not valid JSON"):
        layout.read_meta(six)


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_uninterrupted_losses(tmp_path, profile):
    """ZeRO-1 over 2 ranks (DDP + ZeroRedundancyOptimizer: each rank owns half the optimizer states), on a token
    file: the resumed run reads the windows the killed one would have, and the checkpoint records the file."""
    rng = np.random.default_rng(1)
    data = str(token_file(tmp_path / "tokens.bin", rng.integers(0, 512, size=100 * 17)))   # gpt-tiny's vocabulary
    plan = plan_file(tmp_path, S(2, 1, 1), profile)
    common = ["--data", data, "--seed", "3", "--lr", "0.01", "-o", "-", "--json", "--warmup", "0"]
    uninterrupted = _losses(_cli("run", plan, "--steps", "8", *common))
    ck = tmp_path / "ck"
    killed = _cli("run", plan, "--steps", "8", "--checkpoint-dir", ck, "--checkpoint-every", "3", *common,
                  env={"ZEROPIPE_INJECT_FAILURE": "1:5:kill"})
    assert killed.returncode == 1
    assert killed.stderr.strip().splitlines() == ["error: rank 1 failed: killed by SIGKILL (signal 9)"]
    assert [s for s, _ in layout.complete_steps(ck)] == [3]    # step 5 was between checkpoints
    # the checkpoint recorded its data file: another file, or none, is refused before any rank starts
    other = str(token_file(tmp_path / "other.bin", rng.integers(0, 512, size=100 * 17)))
    for given, words in ((["--data", other], f"this run has --data {other} (size"), ([], "this run has no --data")):
        args = [a for a in common if a not in ("--data", data)] + given
        refused = _cli("run", plan, "--steps", "8", "--resume", ck, *args)
        assert refused.returncode == 2 and words in refused.stderr and "was trained on --data with size" in \
            refused.stderr, refused.stderr
    resumed = _losses(_cli("run", plan, "--steps", "8", "--resume", ck, "--checkpoint-dir", ck,
                           "--checkpoint-every", "3", *common))
    assert resumed == pytest.approx(uninterrupted[3:], rel=1e-6, abs=0)
    assert [s for s, _ in layout.complete_steps(ck)] == [3, 6, 8]
    # new checkpoints never silently replace old ones
    again = _cli("run", plan, "--steps", "8", "--checkpoint-dir", ck, *common)
    assert again.returncode == 2 and "already holds 3 checkpoint(s) past step 0" in again.stderr

    # a truncated latest checkpoint: one line, exit 2, naming the one before it, which still loads
    shard = ck / "step-00000008" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    broken = _cli("run", plan, "--steps", "9", "--resume", ck, "--data", data, "-o", "-")
    assert broken.returncode == 2
    assert broken.stderr.strip().splitlines() == [
        f"error: checkpoint {ck / 'step-00000008'} is damaged: __1_0.distcp has {shard.stat().st_size:,} of its "
        f"{shard.stat().st_size + 100:,} bytes; resume from {ck / 'step-00000006'}, the latest checkpoint before it "
        f"that verifies"]
    earlier = _losses(_cli("run", plan, "--steps", "8", "--resume", ck / "step-00000006", *common))
    assert earlier == pytest.approx(uninterrupted[6:], rel=1e-6, abs=0)


def _merged(folder: Path, tag: str) -> dict[str, torch.Tensor]:
    """Every rank's dumped full state, merged; a key held by several ranks (a replica) must agree bitwise."""
    out: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob(f"{tag}-rank*.pt"))
    assert files, f"no {tag} dumps"
    for f in files:
        for key, value in torch.load(f).items():
            if key in out:
                assert torch.equal(out[key], value), key
            out[key] = value
    return out


@pytest.fixture(scope="module")
def zero3_checkpoint(tmp_path_factory, profile):
    """Plan A: ZeRO-3 (FSDP2) over 4 ranks, 3 steps, checkpoint after step 3, its full state dumped at the save."""
    root = tmp_path_factory.mktemp("zero3")
    os.environ[DUMP_STATE_ENV] = str(root)
    try:
        run = launch(plan_for(S(4, 1, 3), profile), RunConfig(steps=3, warmup=0, seed=CFG.seed, lr=CFG.lr,
                                                              checkpoint_dir=str(root / "ck")))
    finally:
        del os.environ[DUMP_STATE_ENV]
    return root, run


@pytest.mark.slow
def test_zero3_on_4_ranks_resumes_as_a_2_stage_1f1b_pipeline(zero3_checkpoint, profile, tmp_path, monkeypatch):
    root, run_a = zero3_checkpoint
    ck = root / "ck" / "step-00000003"
    assert run_a.checkpoints == (str(ck),)
    monkeypatch.setenv(DUMP_STATE_ENV, str(tmp_path))
    run_b = launch(plan_for(S(1, 2, m=4), profile), RunConfig(steps=5, warmup=0, resume=str(root / "ck")))
    assert run_b.start_step == 3 and run_b.resumed_from == str(ck)

    at_save, loaded = _merged(root, "saved-step3"), _merged(tmp_path, "loaded")
    assert set(at_save) == set(loaded)
    params = [k for k in at_save if k.startswith("model.")]
    states = [k for k in at_save if k.startswith("optim.")]
    model = resolve("gpt-tiny").build(device="meta", dtype=torch.float32)
    assert len(params) == len(list(model.parameters()))     # every tensor once (the tied head is the embedding)
    assert {k.rsplit(".", 1)[1] for k in states} == {"exp_avg", "exp_avg_sq", "step"}
    assert len(states) == 3 * len(params)
    for key in at_save:
        assert torch.equal(at_save[key], loaded[key]), key
    assert {float(loaded[k]) for k in states if k.endswith(".step")} == {3.0}

    # the pipeline goes on exactly as one process continued from the same state would
    reference = single_process_losses(S(1, 1), TrainConfig.from_dict(
        {**CFG.to_dict(), "start_step": 3, "resume_from": str(ck)}))
    assert list(run_b.losses) == pytest.approx(reference, rel=1e-6, abs=0)
    # and they continue the run: not the losses of a fresh start at the same steps
    fresh = single_process_losses(S(1, 1), CFG)
    assert list(run_a.losses) == pytest.approx(fresh[:3], rel=1e-4)
    assert list(run_b.losses) == pytest.approx(fresh[3:5], rel=1e-4)


@pytest.mark.slow
def test_replan_for_2_gpus_then_run_resumes_from_the_checkpoint(zero3_checkpoint, profile, tmp_path):
    root, _ = zero3_checkpoint
    ck = root / "ck"
    no_profile = _cli("replan", "--gpus", "2", "--checkpoint", ck, "-o", tmp_path / "x.json")
    assert no_profile.returncode == 2
    assert no_profile.stderr.strip().splitlines() == [
        "error: the checkpoint's plan does not record the profile it was made from; pass --profile PROFILE"]
    prof = write_atomic(tmp_path / "profile.json", dumps(ProfileFile(model=profile).to_dict()))
    new_plan = tmp_path / "plan2.json"
    proc = _cli("replan", "--gpus", "2", "--checkpoint", ck, "--profile", prof, "-o", new_plan)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 3" in proc.stdout and "ZeRO-3 dp=4" in proc.stdout
    plan = json.loads(new_plan.read_text())
    assert plan["gpus"] == 2 and plan["global_batch_size"] == 8
    assert plan["strategy"]["dp"] * plan["strategy"]["pp"] == 2
    assert plan["strategy"]["precision"] == "fp32" and plan["strategy"]["optimizer"] == "adamw"
    assert (tmp_path / "plan2.html").is_file()
    resumed = _losses(_cli("run", new_plan, "--steps", "5", "--resume", ck, "-o", "-", "--json", "--warmup", "0"))
    reference = single_process_losses(S(1, 1), TrainConfig.from_dict(
        {**CFG.to_dict(), "start_step": 3, "resume_from": str(ck / "step-00000003")}))
    assert resumed == pytest.approx(reference, rel=1e-6, abs=0)


@pytest.mark.slow
def test_resume_refuses_another_batch_or_no_steps_left_in_one_line(zero3_checkpoint, profile, tmp_path):
    root, _ = zero3_checkpoint
    half = Strategy.from_dict({**S(2, 1).to_dict(), "microbatches": 1, "micro_batch_size": 2})   # global batch 4
    other_batch = plan_file(tmp_path, half, profile)
    proc = _cli("run", other_batch, "--steps", "5", "--resume", root / "ck", "-o", "-")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.strip().startswith(
        f"error: checkpoint {root / 'ck' / 'step-00000003'} was trained with global batch 8, the plan has 4")
    done = _cli("run", plan_file(tmp_path, S(2, 1), profile, "same.json"), "--steps", "3", "--resume", root / "ck",
                "-o", "-")
    assert done.returncode == 2 and "leaves nothing to run" in done.stderr
