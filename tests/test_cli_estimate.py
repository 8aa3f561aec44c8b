"""`planner estimate`: JSON for scripts, a per-rank breakdown, exit 3 when the strategy does not fit."""
import json

import pytest
from typer.testing import CliRunner

from cli import app
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ProfileFile
from cost_models.records.formatting import size
from cost_models.records.presets import preset
from cost_models.records.schedule import SCHEDULES

runner = CliRunner()


def _profile_file(tmp_path, prof, cluster):
    return str(write_atomic(tmp_path / "profile.json", dumps(ProfileFile(model=prof, cluster=cluster).to_dict())))


def test_estimate_json(tmp_path, tiny_profiles):
    path = _profile_file(tmp_path, tiny_profiles["llama-tiny", True], preset("dgx-a100"))
    res = runner.invoke(app, ["estimate", path, "--dp", "4", "--pp", "2", "--zero", "1", "--schedule", "1f1b",
                              "--microbatches", "8", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["step_time_s"] > 0 and data["fits"] is True
    assert len(data["memory_per_rank"]) == 8
    rank = data["memory_per_rank"][5]
    cats = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "overhead")
    assert rank["total_bytes"] == sum(rank[c] for c in cats)
    assert data["strategy"]["stages"][0][0] == "embed" and len(data["strategy"]["stages"]) == 2
    assert len(data["pipeline_order"]) == 2 and data["pipeline_order"]["0"][:2] == ["0F0", "0F1"]
    # every figure the text prints is in the JSON: ZeRO-1's all-reduce and broadcast over 4 ranks put a ring's
    # 2(4-1)/4 of the all-reduce's buffer and (4-1)/4 of the broadcast's on the wire
    comm = data["comm"]
    wire = 1.5 * comm["dp_collectives"]["all_reduce"] + 0.75 * comm["dp_collectives"]["broadcast"]
    assert comm["dp_wire_bytes_per_rank"] == pytest.approx(wire) and wire > 0
    text = runner.invoke(app, ["estimate", path, "--dp", "4", "--pp", "2", "--zero", "1", "--schedule", "1f1b",
                               "--microbatches", "8"]).stdout
    assert f"({size(comm['dp_wire_bytes_per_rank'])} on the wire" in text


def test_estimate_that_does_not_fit_exits_3(tmp_path):
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    prof = profile_model(resolve("llama2-7b"), micro_batch_size=1, seq_len=64, meta=True, dtype="bf16")
    path = _profile_file(tmp_path, prof, preset("l4-pcie"))
    res = runner.invoke(app, ["estimate", path, "--dp", "1", "--pp", "1", "--microbatches", "1"])
    assert res.exit_code == 3
    assert "capacity 22.49 GiB" in res.stdout and "NO" in res.stdout      # the per-rank breakdown and capacity
    lines = res.stderr.strip().splitlines()
    # 16 bytes of model states per parameter and autocast's 2-byte bf16 weight copies (memory.autocast_copy_bytes)
    assert len(lines) == 1 and lines[0].startswith("error: does not fit: rank 0 needs 114")
    res = runner.invoke(app, ["estimate", path, "--dp", "8", "--zero", "3", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["fits"] is True


def test_estimate_input_errors(tmp_path, tiny_profiles):
    path = _profile_file(tmp_path, tiny_profiles["gpt-tiny", True], preset("dgx-h100"))
    for args, message in {("--dp", "16"): "cluster has 8", ("--pp", "8"): "only 6 units",
                          ("--pp", "4", "--microbatches", "2"): "at least as many micro-batches",
                          ("--dp", "1", "--zero", "2"): "with --dp 1 use --zero 0",
                          ("--precision", "fp8"): "--precision must be"}.items():
        res = runner.invoke(app, ["estimate", path, *args])
        assert res.exit_code == 2 and message in res.stderr, (args, res.output)


def test_estimate_of_a_strategy_the_executor_refuses_says_so(tmp_path, tiny_profiles):
    # zbv puts gpt-tiny's first and last stage (tied embedding and head) on rank 0: estimated, with a note
    args = ["--dp", "1", "--pp", "2", "--v", "2", "--schedule", "zbv", "-m", "4", "--precision", "fp32"]
    res = runner.invoke(app, ["estimate", _profile_file(tmp_path, tiny_profiles["gpt-tiny", True],
                                                       preset("dgx-a100")), *args])
    assert res.exit_code == 0, res.output
    assert "step time:" in res.stdout
    assert res.stderr.strip() == ("note: planner run would refuse this strategy: zbv puts stages [0, 3], which share a "
                                  "tied parameter, on one rank: " + SCHEDULES["zbv"].same_rank_tie)
    (tmp_path / "llama").mkdir()
    untied = runner.invoke(app, ["estimate", _profile_file(tmp_path / "llama", tiny_profiles["llama-tiny", True],
                                                          preset("dgx-a100")), *args])
    assert untied.exit_code == 0 and "refuse" not in untied.stderr


def test_estimate_o_writes_a_plan_of_exactly_that_strategy(tmp_path, tiny_profiles):
    from planner.plan import Plan
    path = _profile_file(tmp_path, tiny_profiles["llama-tiny", True], preset("dgx-a100"))
    args = ["estimate", path, "--dp", "2", "--pp", "2", "--zero", "1", "--schedule", "gpipe", "-m", "4",
            "--precision", "fp32", "-o", str(tmp_path / "plan.json")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    p = Plan.load(tmp_path / "plan.json")   # loads and passes check_plan
    s = p.strategy
    assert (s.dp, s.pp, s.zero, s.schedule, s.microbatches, s.precision) == (2, 2, 1, "gpipe", 4, "fp32")
    assert p.gpus == 4 and p.global_batch_size == 2 * 4 * s.micro_batch_size and p.alternatives == ()
    assert p.provenance.milp_status == "not run (chosen by hand)" and p.provenance.points_costed == 1
    assert p.rationale.summary.startswith("chosen by hand: ") and p.rationale.winner_family == "hybrid"
    assert p.prediction.step_time_s > 0 and "step time:" in res.stdout
    again = runner.invoke(app, args)   # nothing a user made is overwritten without asking
    assert again.exit_code == 2 and "already exists" in again.stderr


def test_estimate_o_refuses_what_planner_run_would_refuse(tmp_path, tiny_profiles):
    path = _profile_file(tmp_path, tiny_profiles["gpt-tiny", True], preset("dgx-a100"))
    res = runner.invoke(app, ["estimate", path, "--pp", "2", "--v", "2", "--schedule", "zbv", "-m", "4",
                              "--precision", "fp32", "-o", str(tmp_path / "plan.json")])
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: planner run would refuse this strategy: zbv puts")
    assert not (tmp_path / "plan.json").exists()


def test_a_profile_timed_on_an_overloaded_machine_is_named_where_its_times_price_the_plan(tmp_path, tiny_profiles):
    """A real profile records the load while it timed its units; where that passed the CPUs and the cluster prices
    units by those times (CPU ranks), `planner estimate` and `planner plan` say so in one line; not on a quiet
    profile, and not where the times are not used (a GPU preset prices FLOPs)."""
    import dataclasses
    import os

    from tests.clusters import cpu_cluster
    real = tiny_profiles["gpt-tiny", False]
    assert len(real.load_1min) == 2 and min(real.load_1min) >= 0 and real.cpus == os.cpu_count()
    assert len(real.runnable_beside) == 2 and min(real.runnable_beside) >= 0
    meta = tiny_profiles["gpt-tiny", True]
    assert meta.load_1min == () and meta.runnable_beside == () and meta.cpus == 0
    # one torch thread on CPU: timed by the thread's CPU time (host.work_clock), which leaves out waiting for a core
    assert real.threads == 1 and real.clock == "thread-cpu" and tiny_profiles["gpt-tiny", True].clock == ""
    cpu = cpu_cluster(ranks=2, threads=real.threads, cores=2)
    head = "warning: machine load while timing the units (1-minute average): 3.8 to 5.0 on 2 CPUs; more runnable work "
    said = {"wall": head + "than CPUs: the unit times include waiting for a core, and every step predicted from them "
                           "with it; re-profile on a quieter machine or `planner calibrate` from a run",
            "thread-cpu": head + "than CPUs: the units were timed by their thread's CPU time, which leaves out waiting "
                                 "for a core (the cores' sharing with other programs is priced from the cluster "
                                 "probe); to check the prediction, `planner calibrate` from a run"}
    # a load that started just before the profile: the 1-minute average still low, the runnable count not
    just = ("warning: machine load while timing the units (1-minute average): 0.5 to 0.7 on 2 CPUs, other programs' "
            "runnable tasks 2 before and 3 after; more runnable work "
            + said["thread-cpu"].split("more runnable work ")[1])
    cases = {"loaded": ((3.8, 5.0), (), cpu, "wall"), "loaded-cpu-clock": ((3.8, 5.0), (), cpu, "thread-cpu"),
             "quiet": ((0.5, 0.7), (0.0, 1.0), cpu, None), "just-started": ((0.5, 0.7), (2.0, 3.0), cpu, "just"),
             "preset": ((3.8, 5.0), (), preset("dgx-a100"), None)}
    said["just"] = just
    for name, (load, beside, cluster, warned) in cases.items():
        (tmp_path / name).mkdir()
        clock = "wall" if warned in (None, "wall") else "thread-cpu"
        loaded = dataclasses.replace(real, load_1min=load, runnable_beside=beside, cpus=2, clock=clock)
        path = _profile_file(tmp_path / name, loaded, cluster)
        runs = (["estimate", path, "--dp", "2", "--precision", "fp32"],
                ["plan", path, "-B", "4", "--precision", "fp32", "--no-report", "-o", str(tmp_path / name / "p.json")])
        for args in runs:
            res = runner.invoke(app, args)
            assert res.exit_code == 0, (name, res.output)
            lines = [line for line in res.stderr.splitlines() if line.startswith("warning: machine load")]
            assert lines == ([said[warned]] if warned else []), (name, args)
