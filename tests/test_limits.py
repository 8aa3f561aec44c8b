"""Caps on degrees, batch, nodes and micro-batches (cost_models/records/limits.py): huge numbers are refused in one line
before any work sized by them; the largest allowed sizes still plan; zero is never read as "default"."""
import dataclasses
import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from cost_models.cost.memory import zero1_partition
from cost_models.records.errors import ConfigError
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ProfileFile
from cost_models.records.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_MICROBATCHES
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from planner.request import PlanRequest
from planner.search import plan

runner = CliRunner()


@pytest.fixture
def profile_path(tmp_path, tiny_profiles):
    prof = tiny_profiles["gpt-tiny", True]
    data = dumps(ProfileFile(model=prof, cluster=preset("dgx-h100")).to_dict())
    return str(write_atomic(tmp_path / "profile.json", data))


def _refused(args: list[str]) -> str:
    res = runner.invoke(app, args)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, res.output)
    return lines[0]


def test_the_issues_huge_numbers_are_refused_in_one_line(profile_path):
    # each of these grew to 24 GB or ended in MemoryError after 50-155 s before the caps
    line = _refused(["estimate", profile_path, "--dp", "1000000000", "--cluster", "dgx-h100", "--nodes", "125000000"])
    assert "--nodes 125000000 makes 1,000,000,000 devices" in line and "use at most 16,384 nodes" in line
    line = _refused(["plan", profile_path, "-B", "1000000000", "--cluster", "dgx-h100", "-o", "-"])
    assert line.startswith("error: --global-batch-size 1000000000 is above the 4,194,304 this planner supports")
    line = _refused(["plan", profile_path, "-B", "64", "--gpus", "1000000000", "--cluster", "dgx-h100", "-o", "-"])
    assert line.startswith("error: --gpus 1000000000 is above the 131,072 this planner supports")


def test_a_sequence_length_or_fused_parts_past_the_caps_are_refused_before_any_allocation(tmp_path, profile_path):
    line = _refused(["profile", "--model", "gpt-tiny", "-b", "1", "-s", "1000000000", "--meta", "--cluster", "none",
                     "-o", str(tmp_path / "p.json")])
    assert line.startswith("error: --seq-len 1000000000 is above the 4,194,304 this planner supports")
    # a profile (or a plan's model) edited to such a length, or to a rule with 10^9 fused parts
    data = json.loads(Path(profile_path).read_text())
    data["model"]["seq_len"] = 10**9
    write_atomic(tmp_path / "long.json", json.dumps(data))
    assert "model.seq_len is 1000000000; need seq_len <= 4,194,304" in _refused(["estimate", str(tmp_path / "long.json")])
    from cost_models.models.tp_shape import _plan_rules
    with pytest.raises(ConfigError, match="'blocks.*.up' parts 1000000000 is above the 1,024"):
        _plan_rules([("blocks.*.up", "colwise", 10**9)], "m:f")


def test_estimate_flags_above_the_caps_are_refused(profile_path):
    assert "--dp 1000000000 is above the 131,072" in _refused(["estimate", profile_path, "--dp", "1000000000"])
    assert f"--microbatches {MAX_MICROBATCHES + 1} is above the {MAX_MICROBATCHES:,}" in _refused(
        ["estimate", profile_path, "--microbatches", str(MAX_MICROBATCHES + 1)])
    assert "--micro-batch-size = 5000000 is above the 4,194,304" in _refused(
        ["estimate", profile_path, "--micro-batch-size", "5000000"])


def test_an_explicit_zero_micro_batch_size_is_an_error_not_the_default(profile_path):
    assert "--micro-batch-size must be >= 1" in _refused(["estimate", profile_path, "-b", "0"])
    res = runner.invoke(app, ["estimate", profile_path, "--json"])   # not given: the profile's micro-batch size
    assert res.exit_code == 0, res.output


def test_plan_refuses_gpus_below_one_and_none_means_the_whole_cluster(tiny_profiles):
    prof, cluster = tiny_profiles["gpt-tiny", True], preset("dgx-h100")
    for gpus in (0, -2):
        with pytest.raises(ConfigError, match=rf"^--gpus must be >= 1, got {gpus}$"):
            plan(prof, cluster, PlanRequest(gpus=gpus, global_batch_size=64))
    assert plan(prof, cluster, PlanRequest(gpus=None, global_batch_size=64)).gpus == 8


def test_a_batch_needing_more_micro_batches_than_simulated_is_refused(tiny_profiles):
    # 8 devices x 64 sequences per micro-batch x MAX_MICROBATCHES micro-batches is far below 4M sequences
    with pytest.raises(ConfigError, match=rf"more than {MAX_MICROBATCHES:,} micro-batches of up to 64 sequences"):
        plan(tiny_profiles["gpt-tiny", True], preset("dgx-h100"), PlanRequest(gpus=8, global_batch_size=MAX_GLOBAL_BATCH))


def test_the_largest_allowed_plan_completes(tiny_profiles):
    # every device the planner supports (16,384 DGX H100 nodes) at the largest global batch
    p = plan(tiny_profiles["gpt-tiny", True], preset("dgx-h100", nodes=MAX_GPUS // 8),
             PlanRequest(gpus=MAX_GPUS, global_batch_size=MAX_GLOBAL_BATCH))
    assert p.gpus == MAX_GPUS and p.strategy.world_size == MAX_GPUS
    assert p.strategy.global_batch_size == MAX_GLOBAL_BATCH
    assert len(p.prediction.memory_per_rank) == MAX_GPUS            # the winner still lists every rank
    assert p.strategy.microbatches <= MAX_MICROBATCHES


def test_a_large_plan_on_128_nodes_completes(tiny_profiles):
    p = plan(tiny_profiles["gpt-tiny", True], preset("dgx-h100", nodes=128), PlanRequest(gpus=1024, global_batch_size=2**16))
    assert p.gpus == 1024 and p.strategy.world_size == 1024 and p.strategy.global_batch_size == 2**16


def test_scaling_a_cluster_past_the_device_cap_is_refused():
    h100 = preset("dgx-h100")
    assert h100.with_nodes(MAX_GPUS // 8).world_size == MAX_GPUS
    with pytest.raises(ConfigError, match=r"^--nodes 16385 makes 131,080 devices \(8 per node\), above the 131,072 .*"
                                          r"use at most 16,384 nodes$"):
        h100.with_nodes(16385)


def test_a_plan_files_strategy_above_the_caps_is_refused():
    units = ("embed", "head")
    ok = Strategy(dp=MAX_GPUS, pp=1, zero=1, schedule="1f1b", microbatches=1, micro_batch_size=1, stages=(units,))
    ok.validate(units)
    for changes, message in (({"dp": 10**9}, r"^dp x tp x pp = 1000000000 is above the 131,072"),
                             ({"dp": 1, "zero": 0, "microbatches": 10**6}, rf"^microbatches 1000000 is above the {MAX_MICROBATCHES:,}"),
                             ({"micro_batch_size": 10**9},
                              r"^dp x microbatches x micro_batch_size = .* above the 4,194,304")):
        with pytest.raises(ConfigError, match=message):
            dataclasses.replace(ok, **changes).validate(units)


def _torch_greedy(numels: list[int], n: int) -> list[int]:
    """torch's ZeroRedundancyOptimizer._partition_parameters as it is written: a linear scan for the least rank."""
    sizes = [0] * n
    for numel in sorted(numels, reverse=True):
        sizes[sizes.index(min(sizes))] += numel
    return sizes


def test_zero1_partition_matches_torchs_greedy_without_a_list_of_n_ranks():
    rng = random.Random(14)
    for _ in range(300):
        numels = [rng.choice((0, 1, rng.randint(1, 50), rng.randint(1, 10**6))) for _ in range(rng.randint(1, 40))]
        n = rng.choice((1, 2, 3, rng.randint(1, 60)))
        old, new = _torch_greedy(numels, n), zero1_partition(numels, n)
        assert len(new) == min(n, len(numels))
        assert new == old[:len(new)] and not any(old[len(new):])   # ranks past the tensor count own nothing
        assert max(new) == max(old)
    assert zero1_partition([5, 3, 2], 10**9) == [5, 3, 2]           # no list of a billion ranks
