"""planner export: a checkpoint's model weights as a transformers folder (--hf DIR) or one safetensors file (-o).

The quick tests write checkpoints from this one process the way executor.checkpoint.save does (DCP files of the
model's and optimizer's entries in the incomplete folder, then the signed commit); the slow one exports what a real
2-rank ZeRO-3 run saved. Tests that need transformers skip without it."""
import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli import app
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.formatting import size
from executor import checkpoint_layout as layout
from executor.export import canonical_keys
from executor.launch import RunConfig, launch
from executor.testing_hooks import DUMP_STATE_ENV
from tests.plans import plan_for
from tests.test_executor import S

runner = CliRunner()
GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=128"                 # tied head
LLAMA = ("hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
         "&num_key_value_heads=2&vocab_size=128")                               # GQA, rotary, own head
ZOO = "gpt-tiny"


def _plan(ref: str, strategy=None):
    """A plan of `ref` (one rank, all its units in one stage, unless `strategy`)."""
    profile = profile_model(resolve(ref), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    return plan_for(strategy or S(1, 1, stages=[tuple(u.name for u in profile.units)]), profile)


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their canonical names (a tied parameter once), as a run's checkpoint keys them."""
    sd = model.state_dict()
    return {key: sd[key].detach().clone() for key in dict.fromkeys(canonical_keys(model).values())}


def make_checkpoint(root: Path, ref: str, tensors: dict[str, torch.Tensor], step: int = 3) -> Path:
    """A signed checkpoint of `tensors` (canonical names) with optimizer states beside them, written by one
    process: DCP into the incomplete folder, then layout.commit lists, signs and renames it."""
    tmp = layout.incomplete_dir(root, step)
    tmp.mkdir(parents=True)
    sd = {f"model.{k}": v for k, v in tensors.items()}
    sd.update({f"optim.{k}.exp_avg": torch.full_like(v, 7.0) for k, v in tensors.items() if v.is_floating_point()})
    with warnings.catch_warnings():    # without a process group DCP warns that it saves from one process: intended
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)))
    return layout.commit(root, step, {"samples_seen": step * 8, "seed": 0, "lr": 1e-3, "loss": 1.0, "world_size": 1,
                                      "plan": _plan(ref), "torch_version": torch.__version__}, [])


def _export(*args) -> dict:
    res = runner.invoke(app, ["export", *map(str, args), "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def _refused(*args) -> str:
    res = runner.invoke(app, ["export", *map(str, args)])
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def zoo_state():
    model = resolve(ZOO).build(device="cpu", dtype=torch.float32, seed=5)
    return model, _model_state(model)


def test_safetensors_export_holds_every_model_tensor_under_its_own_name(tmp_path, zoo_state):
    model, state = zoo_state
    step_dir = make_checkpoint(tmp_path / "ck", ZOO, state, step=4)
    got = _export(tmp_path / "ck", "-o", tmp_path / "out" / "w.safetensors")   # the folder: its latest checkpoint
    n_params = sum(p.numel() for p in model.parameters())
    # gpt-tiny ties its head to the embedding: the alias is written too (a copy), as the model's state_dict has it
    aliases = {k: state[first] for k, first in canonical_keys(model).items() if k != first}
    assert list(aliases) == ["head.lm_head.weight"]
    every = {**state, **aliases}
    assert got == {"checkpoint": str(step_dir), "step": 4, "source": ZOO, "format": "safetensors",
                   "path": str(tmp_path / "out" / "w.safetensors"), "tensors": len(every), "parameters": n_params,
                   "bytes": sum(t.numel() * 4 for t in every.values()), "dtype": "float32"}
    written = load_file(tmp_path / "out" / "w.safetensors")
    assert sorted(written) == sorted(every) and all(torch.equal(written[k], v) for k, v in every.items())
    assert not any(k.startswith(("optim.", "model.")) for k in written)   # no optimizer state, no prefix
    fresh = resolve(ZOO).build(device="cpu", dtype=torch.float32, seed=6)
    fresh.load_state_dict(written, strict=True)   # every key the model's own state_dict has
    assert all(torch.equal(p, state[n]) for n, p in fresh.named_parameters())
    with safe_open(tmp_path / "out" / "w.safetensors", "pt") as fh:
        assert fh.metadata() == {"zeropipe_source": ZOO, "step": "4"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["w.safetensors"]   # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out" / "w.safetensors").stat().st_mode) == 0o666 & ~umask   # as open() makes
    # the summary line, and the default output
    res = runner.invoke(app, ["export", str(step_dir)])
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip() == (f"exported step 4 of {ZOO} to a safetensors file, model.safetensors: "
                                  f"{len(every)} tensors, {n_params:,} parameters, "
                                  f"{size(got['bytes'])} (float32)")
    default = load_file("model.safetensors")        # in the current folder
    assert default.keys() == every.keys() and all(torch.equal(default[k], v) for k, v in every.items())


def test_refusals_are_one_line_before_anything_is_written(tmp_path, zoo_state):
    model, state = zoo_state
    step_dir = make_checkpoint(tmp_path / "ck", ZOO, state)
    out = tmp_path / "w.safetensors"
    assert _refused(step_dir, "--hf", tmp_path / "hf") == (
        f"error: checkpoint {step_dir} is of model {ZOO}, not a transformers one (hf:...); export it with "
        f"-o FILE.safetensors instead of --hf")
    assert _refused(step_dir, "--hf", tmp_path / "hf", "-o", out) == (
        "error: give --hf DIR (a transformers folder) or -o FILE (one safetensors file), not both")
    out.write_text("mine")
    assert _refused(step_dir, "-o", out) == (f"error: {out} already exists; pass --force to replace it or name "
                                             f"another file")
    assert out.read_text() == "mine"
    _export(step_dir, "-o", out, "--force")
    assert torch.equal(load_file(out)[next(iter(state))], state[next(iter(state))])
    # unsigned: refused unless trusted, and then still checked
    (step_dir / layout.SIG_NAME).unlink()
    assert "is not signed" in _refused(step_dir, "-o", tmp_path / "u.safetensors")
    assert not (tmp_path / "u.safetensors").exists()
    trusted = _export(step_dir, "-o", tmp_path / "u.safetensors", "--trust-checkpoint")
    assert trusted["tensors"] == len(state) + 1   # and the tied alias
    # a damaged file is named
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert f"checkpoint {step_dir} is damaged: {shard.name} has" in _refused(step_dir, "-o", tmp_path / "d.st",
                                                                              "--trust-checkpoint")


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path, zoo_state):
    _, state = zoo_state
    first, second = list(state)[:2]
    fewer = make_checkpoint(tmp_path / "a", ZOO, {k: v for k, v in state.items() if k != second})
    assert _refused(fewer, "-o", tmp_path / "x.st") == (
        f"error: checkpoint {fewer} (model {ZOO}) has no model.{second}, which the model has; was it written "
        f"for another model?")
    extra = make_checkpoint(tmp_path / "b", ZOO, {**state, "blocks.9.w": torch.ones(2), "zz": torch.ones(1)})
    assert _refused(extra, "-o", tmp_path / "x.st") == (
        f"error: checkpoint {extra} (model {ZOO}) holds model.blocks.9.w (and 1 more), which the model does not "
        f"have; was it written for another version of the model?")
    shape = make_checkpoint(tmp_path / "c", ZOO, {**state, first: torch.zeros(3, 5)})
    assert _refused(shape, "-o", tmp_path / "x.st") == (
        f"error: checkpoint {shape} (model {ZOO}) holds model.{first} of shape [3, 5], the model's is "
        f"{list(state[first].shape)}; was it written for another config?")
    assert not (tmp_path / "x.st").exists()


@pytest.mark.parametrize("ref", [GPT2, LLAMA], ids=["gpt2-tied-head", "llama-gqa-rotary"])
def test_hf_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, ref):
    transformers = pytest.importorskip("transformers")
    model = resolve(ref).build(device="cpu", dtype=torch.float32, seed=11).eval()
    state = _model_state(model)
    step_dir = make_checkpoint(tmp_path / "ck", ref, state, step=6)
    (tmp_path / "hf").mkdir()                       # an empty folder is no user's work: no --force needed
    got = _export(step_dir, "--hf", tmp_path / "hf")
    assert (got["format"], got["step"], got["tensors"], got["parameters"], got["dtype"]) == (
        "hf", 6, len(state), model.num_parameters(), "float32")
    assert "lm_head.weight" not in state if ref == GPT2 else "lm_head.weight" in state
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is type(model) and loaded.dtype == torch.float32
    batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, have = model(batch).logits, loaded(batch).logits
    torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    if ref == GPT2:                                 # the tie survives: one tensor, loaded once
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]   # no temporary sibling left
    # a folder with files in it is replaced only with --force, whole
    assert _refused(step_dir, "--hf", tmp_path / "hf").endswith("is a folder with files in it; pass --force to "
                                                                "replace it or name another folder")
    (tmp_path / "hf" / "stale.txt").write_text("old")
    _export(step_dir, "--hf", tmp_path / "hf", "--force")
    assert not (tmp_path / "hf" / "stale.txt").exists() and (tmp_path / "hf" / "config.json").is_file()


def _merged_model_state(folder: Path, tag: str) -> dict[str, torch.Tensor]:
    """The model entries of every rank's dumped full state (executor.checkpoint.dump_for_tests), merged; a replica
    held by several ranks must agree bitwise."""
    out: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob(f"{tag}-rank*.pt"))
    assert files, f"no {tag} dumps in {folder}"
    for f in files:
        for key, value in torch.load(f).items():
            if key.startswith("model."):
                assert key not in out or torch.equal(out[key], value), key
                out[key[len("model."):]] = value
    return out


@pytest.mark.slow
def test_export_of_a_real_2_rank_zero3_checkpoint(tmp_path, monkeypatch):
    """FSDP2 shards every parameter over the 2 ranks: the export reassembles each whole, equal to what the ranks
    held at the save."""
    monkeypatch.setenv(DUMP_STATE_ENV, str(tmp_path))
    run = launch(_plan(ZOO, S(2, 1, 3)), RunConfig(steps=2, warmup=0, seed=3, lr=1e-2,
                                                   checkpoint_dir=str(tmp_path / "ck")))
    monkeypatch.delenv(DUMP_STATE_ENV)
    step_dir = tmp_path / "ck" / "step-00000002"
    assert run.checkpoints == (str(step_dir),)
    saved = _merged_model_state(tmp_path, "saved-step2")
    got = _export(step_dir, "-o", tmp_path / "w.safetensors")
    written = load_file(tmp_path / "w.safetensors")
    model = resolve(ZOO).build(device="meta", dtype=torch.float32)
    keys = canonical_keys(model)   # every state_dict key (a tied alias too) -> the key the checkpoint holds it under
    assert set(written) == set(keys) and set(saved) == set(keys.values())
    assert all(torch.equal(written[k], saved[first]) for k, first in keys.items())
    assert all(written[n].shape == p.shape for n, p in model.named_parameters())
    assert got["parameters"] == sum(p.numel() for p in model.parameters()) and got["step"] == 2
    initial = resolve(ZOO).build(device="cpu", dtype=torch.float32)
    assert not all(torch.equal(written[n], p) for n, p in initial.named_parameters())   # trained: not the init


def test_a_safetensors_file_not_written_whole_is_an_error_not_a_success(tmp_path):
    """safetensors' writer returns normally when the disk fills, so what export writes is checked against its own
    header: a file cut short (as a full disk leaves it) raises OSError, which export reports in one line, exit 2."""
    import errno

    from executor.export import check_written, save_safetensors
    good = tmp_path / "whole.safetensors"
    save_safetensors({"w": torch.ones(64, 8)}, good, metadata={"format": "pt"})
    check_written(good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(OSError) as exc:
        check_written(cut)
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(cut)
