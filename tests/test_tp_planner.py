"""Tensor parallelism in the planner: the space (tp inside a node), `planner estimate --tp/--sp/--recompute`, the
rationale's TP lines, and the direction of the choice for a 70B model (printed, and checked against the estimate of
every other family, never against a hard-coded answer). No processes are started."""
import json

import pytest
from typer.testing import CliRunner

from cli import app
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ProfileFile
from cost_models.records.presets import preset
from cost_models.records.tensor_parallel import TPShape
from planner.plan import Plan
from planner.rationale import explain, tp_lines
from planner.request import PlanRequest
from planner.search import search
from planner.space import enumerate_points, tp_options

runner = CliRunner()
# The direction searches are narrowed (micro-batches of 1 or 2, v <= 2, top 3) to keep them in seconds; every
# ZeRO stage, pipeline depth, schedule and tensor-parallel degree is still searched.
NARROW = dict(top_k=3, micro_batch_sizes=(1, 2), max_v=2, time_limit_s=1.0)


def _profile_file(tmp_path, prof, cluster, name="profile.json"):
    return str(write_atomic(tmp_path / name, dumps(ProfileFile(model=prof, cluster=cluster).to_dict())))


# --- the space ----------------------------------------------------------------------------------------------------

def test_tp_degrees_divide_the_node_and_the_model():
    shape = TPShape(plan="zoo-llama", heads=64, kv_heads=8, ffn=28672, hidden=8192, vocab=128256, vocab_split=True)
    opts = tp_options(shape, devices_per_node=8, gpus=64, seq_len=4096)
    assert opts.pairs == ((1, False), (2, False), (2, True), (4, False), (4, True), (8, False), (8, True))
    assert opts.refusal is None and opts.notes == ()
    # 4 GPUs per node: tp 8 would leave the node
    assert max(tp for tp, _ in tp_options(shape, devices_per_node=4, gpus=64, seq_len=4096).pairs) == 4
    # 6 key/value heads: tp 4 and 8 do not divide them, said why; an odd sequence: no sequence parallelism
    odd = TPShape(plan="zoo-llama", heads=12, kv_heads=6, ffn=1536, hidden=768, vocab=1000, vocab_split=True)
    opts = tp_options(odd, devices_per_node=8, gpus=8, seq_len=1023)
    assert opts.pairs == ((1, False), (2, False))
    assert any("tp=4" in n and "key/value heads" in n for n in opts.notes)
    assert any(n.startswith("sequence parallelism not searched") for n in opts.notes)
    # a model with no TP plan, and an old profile: tp = 1 only, with the reason
    assert tp_options(TPShape(plan="no: no plan for Foo"), devices_per_node=8, gpus=8, seq_len=64).refusal == "no plan for Foo"
    assert "re-run planner profile" in tp_options(None, devices_per_node=8, gpus=8, seq_len=64).refusal


def test_sequence_parallelism_of_a_transformers_llama_is_searched_without_pipelines_only():
    hf = TPShape(plan="hf-llama", heads=32, kv_heads=8, ffn=14336, hidden=4096, vocab=128256, vocab_split=True)
    opts = tp_options(hf, devices_per_node=8, gpus=16, seq_len=4096)
    assert (2, True) in opts.pairs and not opts.sp_pipelines
    assert [n for n in opts.notes if n.startswith("sequence parallelism searched at pp = 1 only: ")]
    points = list(enumerate_points(gpus=16, global_batch=32, n_units=6, tp_pairs=opts.pairs,
                                   sp_pipelines=opts.sp_pipelines))
    assert {p.pp for p in points if p.sp} == {1} and max(p.pp for p in points if not p.sp) > 1
    assert hf.tp_refusal(2, sp=True, seq_len=4096) is None and hf.tp_refusal(2, sp=True, seq_len=4096, pp=2)


def test_points_split_the_devices_over_dp_tp_and_pp():
    pairs = ((1, False), (2, False), (2, True), (8, True))
    points = list(enumerate_points(gpus=16, global_batch=32, n_units=6, tp_pairs=pairs))
    assert all(p.dp * p.tp * p.pp == 16 for p in points)
    assert {(p.tp, p.sp) for p in points} == set(pairs)
    assert {p.family for p in points if p.tp == 8 and p.pp == 1} == {"zero+tp"}


# --- planner estimate --tp ------------------------------------------------------------------------------------------

def test_estimate_with_tp_writes_a_plan_on_the_pp_dp_tp_mesh(tmp_path, tiny_profiles):
    path = _profile_file(tmp_path, tiny_profiles["llama-tiny", True], preset("dgx-a100"))
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["estimate", path, "--dp", "2", "--pp", "2", "--tp", "2", "--sp", "--zero", "1",
                              "--schedule", "1f1b", "-m", "4", "--recompute", "selective", "-o", str(out)])
    assert res.exit_code == 0, res.output
    p = Plan.load(out)
    s = p.strategy
    assert (s.tp, s.sp, s.selective, s.recompute) == (2, True, True, ()) and p.gpus == 8
    data = json.loads(out.read_text())
    assert data["strategy"]["tp"] == 2 and data["strategy"]["sp"] is True
    assert p.stage_ranks == ((0, 1, 2, 3), (4, 5, 6, 7))   # (pp, dp, tp), tp innermost
    assert p.rationale.winner_family == "hybrid+tp"
    assert any(line.startswith("tensor parallelism: 2-way with sequence parallelism") and "per rank per step" in line
               for line in p.rationale.lines)
    # --recompute keeps its old forms: all = full
    res = runner.invoke(app, ["estimate", path, "--dp", "4", "--tp", "2", "--recompute", "all", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["strategy"]["recompute"] == [True]


def test_estimate_tp_input_errors(tmp_path, tiny_profiles):
    path = _profile_file(tmp_path, tiny_profiles["llama-tiny", True], preset("dgx-a100"))
    for args, message in {("--tp", "3"): "power of two", ("--sp",): "needs --tp 2",
                          ("--tp", "4"): "key/value heads", ("--tp", "2", "--dp", "8"): "cluster has 8",
                          ("--recompute", "some"): "none, selective, full"}.items():
        res = runner.invoke(app, ["estimate", path, *args])
        assert res.exit_code == 2 and message in res.stderr, (args, res.output)
    two_per_node = preset("dgx-a100").with_nodes(1)
    two_per_node = type(two_per_node).from_dict({**two_per_node.to_dict(), "devices_per_node": 2, "nodes": 4})
    path = _profile_file(tmp_path, tiny_profiles["llama-tiny", True], two_per_node, "two.json")
    res = runner.invoke(app, ["estimate", path, "--tp", "4"])
    assert res.exit_code == 2 and "inside one node" in res.stderr
    path = _profile_file(tmp_path, tiny_profiles["mlp-deep", True], preset("dgx-a100"), "mlp.json")
    res = runner.invoke(app, ["estimate", path, "--tp", "2"])
    assert res.exit_code == 2 and "use --tp 1" in res.stderr


def test_a_model_without_a_tp_plan_is_planned_without_tp_and_says_why(tiny_profiles):
    from planner.search import plan
    p = plan(tiny_profiles["mlp-deep", True], preset("dgx-a100"), PlanRequest(gpus=8, global_batch_size=32))
    assert p.strategy.tp == 1
    assert any(line.startswith("no tensor-parallel strategies searched: ") for line in p.rationale.lines)


def test_plan_tp_narrows_the_degrees(tmp_path, tiny_profiles):
    path = _profile_file(tmp_path, tiny_profiles["llama-tiny", True], preset("dgx-a100"))
    res = runner.invoke(app, ["plan", path, "-B", "32", "--tp", "1", "-o", str(tmp_path / "p.json"), "--no-report"])
    assert res.exit_code == 0, res.output
    assert Plan.load(tmp_path / "p.json").strategy.tp == 1 and "pp x dp x tp" in res.stdout
    res = runner.invoke(app, ["plan", path, "-B", "32", "--tp", "3", "-o", "-"])
    assert res.exit_code == 2 and "powers of two" in res.stderr


# --- the direction of the choice ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama70b():
    return profile_model(resolve("llama3-70b"), micro_batch_size=1, seq_len=4096, meta=True, dtype="bf16")


def _check_direction(prof, cluster, global_batch: int) -> str:
    """Search, print what wins and why, and check the choice against every other family's best estimate."""
    req = PlanRequest(global_batch_size=global_batch, **NARROW)
    found = search(prof, cluster, req)
    win = found.feasible[0]
    wt = win.estimate.step_time_s
    unfit = min(found.infeasible, key=lambda c: c.estimate.step_time_s, default=None)
    r = explain(win.strategy, win.estimate, found.feasible, unfit, cluster, found.pruned_bounds)
    lines = list(r.lines) + tp_lines(win.strategy, win.estimate, found.feasible, cluster, found.tp,
                                     pruned_tp_bounds=found.pruned_tp_bounds)
    print(f"\n{prof.name} on {found.gpus} x {cluster.device.name} ({cluster.name}): {r.summary}")
    print("\n".join(f"  {line}" for line in lines))
    # TP groups never leave a node: tp divides the GPUs per node, and the tp adjacent ranks share one
    for c in found.feasible + found.infeasible:
        s = c.strategy
        assert cluster.devices_per_node % s.tp == 0
        groups = {}
        for rank in range(s.world_size):
            pp_rank, dp_rank, _ = s.coords(rank)
            groups.setdefault((pp_rank, dp_rank), set()).add(rank // cluster.devices_per_node)
        assert all(len(nodes) == 1 for nodes in groups.values())
    # the chosen plan is no slower than the best estimate of every other family; a family never costed is
    # pruned by a lower bound no better than the choice
    best = {}
    for c in found.feasible:
        best[c.strategy.family] = min(best.get(c.strategy.family, float("inf")), c.estimate.step_time_s)
    assert all(t >= wt for t in best.values()), best
    assert all(bound >= wt * (1 - 1e-12) for bound in found.pruned_bounds.values()), found.pruned_bounds
    assert win.estimate.fits and best[win.strategy.family] == wt
    assert any("tp=" in line or line.startswith("tensor parallelism") for line in lines)
    return win.strategy.family


def test_70b_on_1024_h100s(llama70b):
    _check_direction(llama70b, preset("dgx-h100", nodes=128), 2048)


def test_70b_on_64_h100s(llama70b):
    _check_direction(llama70b, preset("dgx-h100", nodes=8), 256)


def test_70b_on_pcie_a100s_with_slow_links(llama70b):
    _check_direction(llama70b, preset("a100-pcie-40g", nodes=8), 256)
