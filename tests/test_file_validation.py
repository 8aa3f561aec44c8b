"""profile.json and cluster files are checked on load (issue 14, defects 5 and 13): numbers finite, non-negative,
within bounds; the parts consistent. Each refusal is one line naming the field, exit 2, and nothing is written."""
import copy
import json

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.cluster import CollectiveFit
from cost_models.records.errors import FileFormatError
from cost_models.records.fileio import dumps
from cost_models.records.files import ClusterFile, ProfileFile
from cost_models.records.presets import PRESETS, preset
from cost_models.records.validate import validate_cluster

runner = CliRunner()


@pytest.fixture(scope="module")
def good():
    """What `planner profile --model gpt-tiny -b 2 -s 16 --dtype fp32 --meta --cluster dgx-a100` writes, as data."""
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=16, dtype="fp32", meta=True)
    return ProfileFile(model=prof, cluster=preset("dgx-a100")).to_dict()


def _write(path, data):
    path.write_text(json.dumps(data))  # json.dumps, not fileio.dumps: it writes NaN / Infinity as the bad files have
    return str(path)


def _edited(good, edit):
    data = copy.deepcopy(good)
    edit(data)
    return data


def _refused(args, *fragments):
    """Run the CLI; assert exit 2 and one stderr line `error: ...` holding every fragment; return the line."""
    res = runner.invoke(app, args)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _nan_time(d):
    d["model"]["units"][3]["fwd_time"] = {"median_s": float("nan"), "min_s": 1e-3, "max_s": 2e-3, "repeats": 3}


def test_nan_unit_time_makes_plan_exit_2_naming_the_field(tmp_path, monkeypatch, good):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "nan.json", _edited(good, _nan_time))
    line = _refused(["plan", path, "-B", "16"], "nan.json", "model.units[3].fwd_time.median_s is NaN")
    assert "re-create the file" in line
    assert not (tmp_path / "plan.json").exists()


def _optimizer_timing(**kw) -> dict:
    """A profile's timed optimizer step (profile.OptimizerTiming) as data."""
    return {"optimizer": "adamw", "step": {"median_s": 1e-3, "min_s": 1e-3, "max_s": 1e-3, "repeats": 3},
            "params": 1000, "tensors": 2, "tensor_s": 1e-5, **kw}


@pytest.mark.parametrize("where, edit, fragments", [
    ("profile", lambda d: d["model"]["units"][2].update(params=-5), ("model.units[2].params is -5", "params >= 0")),
    ("profile", lambda d: d["cluster"]["intra_node"].update(bandwidth_Bps=-1e9),
     ("cluster.intra_node.bandwidth_Bps is -1000000000.0", "bandwidth_Bps > 0", "re-run planner profile")),
    ("profile", lambda d: d["model"].update(units=[], edges=[]), ("model.units is []", "at least one unit")),
    ("profile", lambda d: d["model"]["units"][1].update(name=d["model"]["units"][0]["name"]),
     ("model.units[1].name", "units[0] has it too")),
    ("profile", lambda d: d["model"].update(total_params=d["model"]["total_params"] + 1),
     ("model.total_params is 241025", "= 241024")),
    ("profile", lambda d: d["model"]["edges"][0].update(dst=99), ("model.edges[0]", "src < dst < 6")),
    ("profile", lambda d: d["model"].update(largest_unit="blocks.9"), ("model.largest_unit is 'blocks.9'",)),
    ("profile", lambda d: d["model"]["shared"][0].update(units=["embed", "ghost"]), ("model.shared[0].units[1]",)),
    ("profile", lambda d: d["model"].update(micro_batch_size=0), ("model.micro_batch_size is 0", ">= 1")),
    ("profile", lambda d: d["model"].update(dtype="float32"), ("model.dtype is 'float32'", "one of fp32, bf16, fp16")),
    ("profile", lambda d: d["model"]["units"][1].update(fwd_flops=10**40), ("model.units[1].fwd_flops", "41 digits")),
    ("profile", lambda d: d["model"]["units"][0].update(saved_other_dtype_bytes=d["model"]["units"][0]["saved_bytes"] + 1),
     ("model.units[0].saved_other_dtype_bytes", "0 to saved_bytes")),
    ("profile", lambda d: d["model"]["units"][0].update(saved_other_fixed_bytes=10**6),
     ("model.units[0].saved_other_fixed_bytes is 1000000", "within saved_fixed_bytes")),
    ("profile", lambda d: d["cluster"]["device"].update(matmul_efficiency=1.5), ("matmul_efficiency in [1e-06, 1]",)),
    ("profile", lambda d: d["model"].update(optimizer_timings=[_optimizer_timing(optimizer="lamb")]),
     ("model.optimizer_timings[0].optimizer is 'lamb'", "one of adamw, adam, sgd")),
    ("profile", lambda d: d["model"].update(optimizer_timings=[_optimizer_timing(params=0)]),
     ("model.optimizer_timings[0].params", "params >= 1")),
    ("cluster", lambda d: d["cluster"]["device"].update(memory_bandwidth_Bps=-2e12),
     ("cluster.device.memory_bandwidth_Bps is -2000000000000.0", "memory_bandwidth_Bps >= 0", "profile-cluster")),
    ("cluster", lambda d: d["cluster"]["intra_node"].update(bandwidth_Bps=-3.0), ("cluster.intra_node.bandwidth_Bps",)),
    ("cluster", lambda d: d["cluster"]["inter_node"].update(bandwidth_Bps=1e-300), ("bandwidth_Bps >= 1 per second",)),
    ("cluster", lambda d: d["cluster"].update(devices_per_node=0), ("cluster.devices_per_node is 0",)),
    ("cluster", lambda d: d["cluster"].update(nodes=10**9), ("cluster.nodes is 1000000000", "<= 131,072")),
], ids=[
    "negative-params", "negative-profile-bandwidth", "no-units", "duplicate-unit", "params-sum",
    "edge-out-of-range", "largest-unit", "shared-unit", "zero-micro-batch", "unknown-dtype", "huge-flops", "other-dtype-above-saved",
    "other-fixed-outside-fixed",
    "efficiency-above-1", "unknown-optimizer-timed", "optimizer-timed-over-no-parameters",
    "cluster-negative-memory-bandwidth", "cluster-negative-bandwidth",
    "cluster-tiny-bandwidth", "cluster-zero-devices", "cluster-too-many-nodes",
])
def test_bad_numbers_make_plan_exit_2(tmp_path, monkeypatch, good, where, edit, fragments):
    monkeypatch.chdir(tmp_path)
    if where == "profile":
        path = _write(tmp_path / "p.json", _edited(good, edit))
        _refused(["plan", path, "-B", "16"], "p.json", *fragments)
        _refused(["estimate", path, "--dp", "1"], *fragments)
        with pytest.raises(FileFormatError, match="need"):
            ProfileFile.load(path)
    else:
        profile = _write(tmp_path / "p.json", good)
        cluster = _write(tmp_path / "c.json", _edited({"schema_version": 1, "kind": "zeropipe.cluster",
                                                         "cluster": good["cluster"]}, edit))
        _refused(["plan", profile, "-B", "16", "--cluster", cluster], "c.json", *fragments)
    assert not (tmp_path / "plan.json").exists()


def test_infinity_in_a_cluster_file_is_refused_and_never_written_back(tmp_path, monkeypatch, good):
    monkeypatch.chdir(tmp_path)
    data = {"schema_version": 1, "kind": "zeropipe.cluster", "cluster": good["cluster"]}
    path = _write(tmp_path / "c.json",
                  _edited(data, lambda d: d["cluster"]["inter_node"].update(bandwidth_Bps=float("inf"))))
    assert '"bandwidth_Bps": Infinity' in (tmp_path / "c.json").read_text()
    with pytest.raises(FileFormatError, match=r"cluster\.inter_node\.bandwidth_Bps is Infinity"):
        ClusterFile.load(path)
    _refused(["profile-cluster", "--cluster", path, "-o", "out.json"], "cluster.inter_node.bandwidth_Bps is Infinity")
    assert not (tmp_path / "out.json").exists()
    _refused(["plan", _write(tmp_path / "p.json", good), "-B", "16", "--cluster", path], "Infinity")
    # a float that overflows (1e400 parses as inf) and YAML's .inf are refused the same way
    (tmp_path / "big.json").write_text((tmp_path / "c.json").read_text().replace("Infinity", "1e400"))
    with pytest.raises(FileFormatError, match=r"cluster\.inter_node\.bandwidth_Bps is 1e400"):
        ClusterFile.load(tmp_path / "big.json")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(json.loads((tmp_path / "c.json").read_text())))
    assert "bandwidth_Bps: .inf" in (tmp_path / "c.yaml").read_text()
    with pytest.raises(FileFormatError, match=r"cluster\.inter_node\.bandwidth_Bps is inf; need a finite number"):
        ClusterFile.load(tmp_path / "c.yaml")


def test_nothing_writes_non_finite_json():
    with pytest.raises(ValueError, match="not JSON compliant"):
        dumps({"x": float("inf")})
    assert json.loads(dumps({"x": 1.5})) == {"x": 1.5}


def test_a_real_profile_still_loads(tmp_path, monkeypatch, tiny_profiles):
    """What the profilers write always passes: every tiny zoo model, meta and real, with a preset cluster."""
    monkeypatch.chdir(tmp_path)
    for (name, meta), prof in tiny_profiles.items():
        original = ProfileFile(model=prof, cluster=preset("dgx-h100"))
        (tmp_path / "p.json").write_text(dumps(original.to_dict()))
        loaded = ProfileFile.load(tmp_path / "p.json")
        assert loaded == original, (name, meta)
        m = loaded.model
        assert m.total_params == sum(u.params for u in m.units) + m.unassigned_params
    gpt = ProfileFile(model=tiny_profiles["gpt-tiny", False], cluster=preset("dgx-a100"))
    (tmp_path / "gpt.json").write_text(dumps(gpt.to_dict()))
    m = ProfileFile.load(tmp_path / "gpt.json").model
    assert m.mode == "real" and len(m.units) == 6 and m.total_params == 241024 and m.unassigned_params == 0
    assert all(u.fwd_time.median_s > 0 and u.bwd_time.median_s > 0 for u in m.units)
    assert m.largest_unit in {u.name for u in m.units}
    res = runner.invoke(app, ["estimate", "gpt.json", "--dp", "2", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["strategy"]["dp"] == 2, res.output


def test_what_our_own_probe_may_write_loads(tmp_path):
    """fit.py's R^2 is negative when a fit is worse than the mean: a noisy probe writes that, and it must load."""
    fit = CollectiveFit(op="all_reduce", group_size=4, scope="intra", alpha_s=2e-5, beta_s_per_byte=1e-10, r2=-0.4)
    cluster = preset("dgx-a100", nodes=2)
    data = ClusterFile(cluster=cluster).to_dict()
    data["cluster"]["fits"] = [fit.to_dict()]
    (tmp_path / "c.json").write_text(dumps(data))
    loaded = ClusterFile.load(tmp_path / "c.json").cluster
    assert loaded.fits == (fit,) and loaded.world_size == 16
    for p in PRESETS.values():
        validate_cluster(p, "preset")
        validate_cluster(p.with_nodes(4), "preset")
    # a negative fitted latency is not what fit.py writes (it refits through the origin)
    data["cluster"]["fits"][0]["alpha_s"] = -1e-6
    (tmp_path / "c.json").write_text(dumps(data))
    with pytest.raises(FileFormatError, match=r"cluster\.fits\[0\]\.alpha_s is -1e-06; need alpha_s >= 0"):
        ClusterFile.load(tmp_path / "c.json")
