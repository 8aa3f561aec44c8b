"""A prediction above the best MFU published for its GPU class is flagged (cost_models/records/published.py), in
`planner estimate`'s text and JSON and in the report; below it, or where no bound is published, nothing is said."""
import json

from typer.testing import CliRunner

from cli import app
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ProfileFile
from cost_models.records.presets import preset
from cost_models.records.published import implausible_mfu, mfu_bound

runner = CliRunner()


def test_the_bound_by_device_and_precision():
    assert mfu_bound("A100-SXM4-80GB", "bf16-mixed").mfu == 0.60
    assert mfu_bound("NVIDIA H100 80GB HBM3", "bf16-mixed").mfu == 0.465
    assert mfu_bound("H100-SXM5-80GB", "fp32") is None and mfu_bound("L4", "bf16-mixed") is None
    assert implausible_mfu(0.47, "H100-SXM5-80GB", "bf16-mixed").startswith("predicted MFU 47.0% is above the best "
                                                                          "published for H100 in bf16-mixed (46.5%")
    assert implausible_mfu(0.46, "H100-SXM5-80GB", "bf16-mixed") is None
    assert implausible_mfu(None, "H100-SXM5-80GB", "bf16-mixed") is None


def _llama8b(tmp_path) -> str:
    prof = profile_model(resolve("llama3-8b"), micro_batch_size=1, seq_len=8192, meta=True, dtype="bf16")
    return str(write_atomic(tmp_path / "p.json", dumps(ProfileFile(model=prof, cluster=preset("dgx-a100")).to_dict())))


def test_estimate_and_report_flag_an_mfu_above_the_published_best(tmp_path):
    """llama3-8b under ZeRO-3 on 64 A100s at 1 x 8192 with selective recompute, torchtitan's published layout: the
    estimate puts its MFU above the best published for A100."""
    path = _llama8b(tmp_path)
    args = ["estimate", path, "--nodes", "8", "--dp", "64", "--zero", "3", "--recompute", "selective"]
    data = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    assert data["mfu"] > 0.60 and data["implausible_mfu"] == implausible_mfu(data["mfu"], "A100-SXM4-80GB",
                                                                              "bf16-mixed")
    res = runner.invoke(app, args + ["-o", str(tmp_path / "plan.json")])
    assert res.exit_code == 0 and f"warning: {data['implausible_mfu']}" in " ".join(res.output.split())
    assert runner.invoke(app, ["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "r.html")]).exit_code == 0
    assert f"Warning: {data['implausible_mfu']}." in (tmp_path / "r.md").read_text()
    # the same model at 8-way tensor parallelism predicts far below the bound: nothing said
    low = json.loads(runner.invoke(app, ["estimate", path, "--nodes", "8", "--dp", "8", "--tp", "8", "--zero", "1",
                                         "--json"]).stdout)
    assert low["mfu"] < 0.60 and low["implausible_mfu"] is None
