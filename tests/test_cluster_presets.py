"""Presets, cluster files, and the one-line errors for malformed ones."""
import json

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from cost_models.profiling.cluster_source import parse_sizes, resolve_cluster
from cost_models.records.errors import ConfigError, FileFormatError
from cost_models.records.files import ClusterFile
from cost_models.records.presets import PRESETS, preset


def test_presets_load_with_sourced_numbers():
    assert set(PRESETS) >= {"dgx-h100", "dgx-a100", "a100-pcie-40g", "l4-pcie"}
    h100 = preset("dgx-h100")
    assert h100.devices_per_node == 8 and h100.device.peak_flops["bf16"] == 989.4e12
    assert h100.intra_node.bandwidth_Bps == pytest.approx(450e9 * 0.8)   # NVLink 4 per direction, achievable
    assert h100.inter_node.bandwidth_Bps == pytest.approx(50e9 * 0.92)   # 400 Gb/s per GPU, 46 GB/s achievable
    pcie = preset("a100-pcie-40g")
    assert pcie.inter_node.bandwidth_Bps == pytest.approx(100e9 / 8 / 8 * 0.8)  # one 100 GbE NIC per 8 GPUs
    assert all(p.intra_node.source and p.device.source for p in PRESETS.values())


def test_nodes_scale_a_preset():
    big = resolve_cluster("dgx-h100", nodes=128)
    assert big.world_size == 1024 and big.nodes == 128 and big.name == "dgx-h100 x 128"
    assert preset("dgx-h100").world_size == 8
    with pytest.raises(ConfigError, match="unknown --cluster"):
        resolve_cluster("dgx-h200")


def test_cluster_file_round_trip_json_and_yaml(tmp_path):
    data = ClusterFile(cluster=preset("l4-pcie", nodes=3)).to_dict()
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    for name in ("c.json", "c.yaml"):
        c = ClusterFile.load(tmp_path / name).cluster
        assert c == preset("l4-pcie", nodes=3) and c.world_size == 24
    assert resolve_cluster(str(tmp_path / "c.yaml"), nodes=2).world_size == 16


def test_malformed_cluster_files_are_one_line_errors(tmp_path):
    good = ClusterFile(cluster=preset("dgx-a100", nodes=2)).to_dict()
    cases = {
        "broken.yaml": ("nodes: [1, 2", "not valid YAML"),
        "wrongkind.json": (json.dumps({"kind": "other"}), "not a zeropipe cluster file"),
        "missing.json": (json.dumps({**good, "cluster": {k: v for k, v in good["cluster"].items() if k != "device"}}),
                         "missing field 'device'"),
        "typo.json": (json.dumps({**good, "cluster": {**good["cluster"], "nodez": 2}}), "unknown field"),
        "badbw.json": (json.dumps({**good, "cluster": {**good["cluster"], "intra_node": {
            **good["cluster"]["intra_node"], "bandwidth_Bps": 0}}}), "bandwidth_Bps > 0"),
        "badtype.json": (json.dumps({**good, "cluster": {**good["cluster"], "nodes": "two"}}), "expected an integer"),
    }
    runner = CliRunner()
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(FileFormatError, match=message):
            ClusterFile.load(path)
        res = runner.invoke(app, ["profile-cluster", "--cluster", str(path), "-o", "-"])
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and message.split()[0] in lines[0], (name, res.output)


def test_parse_sizes():
    assert parse_sizes("4K..64M") == tuple(4096 * 4**i for i in range(8))
    assert parse_sizes("64K,1M") == (65536, 2**20)
    with pytest.raises(ConfigError):
        parse_sizes("12Q..3")


def test_profile_cluster_cli_for_a_preset(tmp_path):
    out = tmp_path / "cluster.json"
    res = CliRunner().invoke(app, ["profile-cluster", "--cluster", "dgx-h100", "--nodes", "128", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["cluster"]["nodes"] * data["cluster"]["devices_per_node"] == 1024
    assert ClusterFile.load(out).cluster.world_size == 1024
