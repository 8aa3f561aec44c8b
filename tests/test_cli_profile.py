"""`planner profile` as a user runs it: exit codes, one-line errors, JSON on stdout, files written safely."""
import json
import shlex
import subprocess
import sys
from unittest import mock

import pytest
from typer.testing import CliRunner

from cli import app

runner = CliRunner()


def run(*args):
    # the command line as the installed `planner` script would see it (profiles record it)
    with mock.patch.object(sys, "argv", ["planner", *map(str, args)]):
        return runner.invoke(app, list(args))


def test_profile_json_and_file(tmp_path):
    out = tmp_path / "profile.json"
    res = run("profile", "--model", "mlp-deep", "-b", "2", "-s", "4", "--dtype", "fp32", "--repeats", "1", "--cluster", "none",
              "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["model"]["total_params"] == 270_048
    assert data["schema_version"] == 1 and data["kind"] == "zeropipe.profile"
    assert json.loads(out.read_text())["model"]["units"][0]["name"] == "embed"
    assert data["model"]["command"] == shlex.join(["planner", "profile", "--model", "mlp-deep", "-b", "2", "-s", "4",
                                                    "--dtype", "fp32", "--repeats", "1", "--cluster", "none",
                                                    "-o", str(out), "--json"])
    assert data["model"]["threads"] == 1   # timed as each CPU rank runs, whatever the machine's default


def test_dtype_auto_is_what_the_ranks_compute_in():
    """CPU ranks run every plan in fp32, so a CPU profile defaults to fp32; meta profiles (for GPU clusters) to bf16."""
    for extra, dtype in (((), "fp32"), (("--meta",), "bf16")):
        res = run("profile", "--model", "mlp-deep", "-b", "2", "-s", "4", "--repeats", "1", "--warmup", "0",
                  "--cluster", "none", "-o", "-", "--json", *extra)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["model"]["dtype"] == dtype, extra


def test_existing_output_is_not_overwritten(tmp_path):
    out = tmp_path / "profile.json"
    out.write_text("mine")
    res = run("profile", "--model", "gpt-tiny", "-b", "1", "-s", "4", "--meta", "--cluster", "none", "-o", str(out))
    assert res.exit_code == 2 and "--force" in res.stderr
    assert out.read_text() == "mine"
    res = run("profile", "--model", "gpt-tiny", "-b", "1", "-s", "4", "--meta", "--cluster", "none", "-o", str(out), "--force")
    assert res.exit_code == 0 and json.loads(out.read_text())["model"]["mode"] == "meta"


def test_user_errors_are_one_line_exit_2():
    cases = {
        ("--model", "no-such-model", "-b", "1", "-s", "8"): "unknown model 'no-such-model'",
        ("--model", "tests.custom_models:broken_model", "-b", "1", "-s", "8"): "ValueError: out of coffee",
        ("--model", "gpt-tiny", "-b", "0", "-s", "8"): "--micro-batch-size must be positive",
        ("--model", "gpt-tiny", "-b", "1", "-s", "8", "--dtype", "fp8"): "--dtype must be auto or one of",
        ("--model", "gpt-tiny", "-b", "1", "-s", "8", "--threads", "0"): "--threads must be >= 1",
        ("--model", "gpt-tiny", "-b", "1", "-s", "8", "--device", "tpu"): "--device must be auto, cpu or cuda",
        ("--model", "gpt-tiny", "-b", "1", "-s", "8", "--meta", "--device", "tpu"): "--device must be auto, cpu or",
        # the suite hides GPUs (conftest), as CI has none
        ("--model", "gpt-tiny", "-b", "1", "-s", "8", "--device", "cuda"): "--device cuda: torch sees no GPU here",
    }
    for args, message in cases.items():
        res = run("profile", *args, "--cluster", "none", "-o", "-")
        assert res.exit_code == 2, (args, res.output)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error: "), res.stderr


def test_installed_entry_point_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "cli", "profile", "--model", "nope", "-b", "1", "-s", "8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown model 'nope'; use a zoo name (see `planner models`), module:factory, or hf:TYPE"]


def test_profile_embeds_a_preset_cluster(tmp_path):
    res = run("profile", "--model", "llama3-70b", "-b", "1", "-s", "16", "--meta", "--cluster", "dgx-h100",
              "--nodes", "128", "-o", "-", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["model"]["total_params"] == 70_553_706_496
    assert data["cluster"]["nodes"] == 128 and data["cluster"]["source"] == "preset:dgx-h100"


@pytest.mark.slow
def test_profile_probes_this_machine_by_default(tmp_path):
    res = run("profile", "--model", "mlp-deep", "-b", "2", "-s", "4", "--dtype", "fp32", "--repeats", "1",
              "--ranks", "2", "--probe-sizes", "64K..16M", "-o", "-", "--json")
    # sizes up to 16M: on 2 shared cores the send/recv times of 64K..4M alone once fitted a non-positive slope
    assert res.exit_code == 0, res.output
    cluster = json.loads(res.stdout)["cluster"]
    assert cluster["source"] == "probe" and cluster["devices_per_node"] == 2
    assert {f["op"] for f in cluster["fits"]} == {"all_gather", "reduce_scatter", "all_reduce", "send_recv", "broadcast",
                                                "all_to_all"}
    assert any(n.startswith("no NVIDIA driver") for n in cluster["notes"])  # this machine: said in one line
    assert "no NVIDIA driver" in res.stderr


def test_cluster_flag_errors_are_one_line():
    for args, message in {("--cluster", "dgx-h200"): "unknown --cluster 'dgx-h200'",
                          ("--cluster", "local", "--nodes", "4"): "--nodes applies to presets",
                          ("--cluster", "dgx-h100", "--nodes", "0"): "--nodes must be >= 1"}.items():
        res = run("profile", "--model", "gpt-tiny", "-b", "1", "-s", "8", "--meta", *args, "-o", "-")
        assert res.exit_code == 2 and res.stderr.strip().splitlines() == [f"error: {res.stderr.strip()[7:]}"]
        assert message in res.stderr, res.stderr


def test_a_bad_cluster_file_is_refused_before_torch_is_imported(tmp_path):
    """A cluster file is read before anything imports torch (seconds on a small machine): its error comes at once."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "kind": ')
    code = ("import sys, cli\n"
            f"sys.argv = ['planner', 'profile', '--model', 'gpt-tiny', '-b', '1', '-s', '8', '--meta', '--cluster', "
            f"{str(bad)!r}, '-o', '-']\n"
            "try:\n    cli.main()\nexcept SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {bad}: not valid JSON (Expecting value: line 1 column 31 "
                                                 "(char 30))"]
