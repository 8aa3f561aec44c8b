"""Which models can be pipelined (cost_models.models.pipelining), recorded in the profile, respected by the planner."""
import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from cli import app
from cost_models.models.pipelining import pipeline_support
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError, FileFormatError
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ProfileFile
from cost_models.records.presets import preset
from cost_models.records.profile import ModelProfile
from cost_models.records.strategy import Strategy
from executor.runtime import logits_of
from executor.stage_builders import build_stages
from executor.stages import UnitMap
from planner.manual import StrategyRequest, build_strategy, manual_plan
from planner.plan import Plan, check_plan
from planner.rationale import NO_PIPELINES
from planner.request import PlanRequest
from planner.search import plan, search
from tests.custom_models import Gated
from tests.hf_families import FAMILIES_TINY

runner = CliRunner()
LOOPED = "no: unit blocks.0 runs 2 times in its forward, not once"


def _support(ref: str, input_ref: str | None = None, units=None) -> tuple[str, ModelProfile]:
    """pipeline_support on the meta model with the profiler's units, and the profile, which records the same."""
    src = resolve(ref, input_ref=input_ref)
    prof = profile_model(src, micro_batch_size=2, seq_len=8, meta=True, units=units)
    model = src.build(device="meta", dtype=torch.float32)
    return pipeline_support(model, [(u.name, u.modules) for u in prof.units]), prof


def _units(model: nn.Module):
    return [(n, (n,)) for n, _ in model.named_children() if not isinstance(_, nn.ModuleList)]


# --- which models ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ref", ["gpt-tiny", "llama-tiny", "mlp-deep", "tests.custom_models:make_tiny_lm"])
def test_unit_chains_are_chains(ref):
    verdict, prof = _support(ref)
    assert verdict == "chain" and prof.pipelining == "chain" and prof.pipeline_refusal is None


def test_large_zoo_models_are_checked_on_meta_without_running_anything():
    src = resolve("llama3-70b")
    model = src.build(device="meta", dtype=torch.bfloat16)
    units = [("embed", ("embed",))] + [(f"blocks.{i}", (f"blocks.{i}",)) for i in range(80)] + [("head", ("head",))]
    assert pipeline_support(model, units) == "chain"


def test_a_factory_whose_forward_is_unit_after_unit_is_a_chain():
    verdict, prof = _support("tests.custom_models:make_model", "tests.custom_models:make_input")   # ConvStack
    assert [u.name for u in prof.units] == ["stem", "layers.0", "layers.1", "layers.2", "out"]
    assert verdict == "chain"


@pytest.mark.parametrize("ref", ["make_skipnet", "make_scaled", "make_posnet", "make_residual2", "make_pooled"])
def test_forwards_that_do_more_than_chain_their_units_are_cut_from_their_trace(ref):
    """A skip connection across units, a scaled embedding, a position table, a residual across two units, an
    activation between units: not chains, but each unit runs once, in order, so executor.traced_stages cuts the
    traced forward into stages."""
    verdict, prof = _support(f"tests.custom_models:{ref}")
    assert verdict == "traced" and prof.pipelining == "traced" and prof.pipeline_refusal is None


def test_a_unit_that_runs_at_two_depths_is_refused_naming_it():
    verdict, prof = _support("tests.custom_models:make_looped")
    assert verdict == LOOPED and prof.pipelining == LOOPED
    assert prof.pipeline_refusal == LOOPED.removeprefix("no: ")


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(self.a(x)))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 0:          # data-dependent: fx cannot trace it
            x = -x
        return self.b(x)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return self.b(y), y


class _Flagged(nn.Module):
    """Unit b is called with a constant: fine when it is b's own default, refused otherwise."""

    def __init__(self, flag) -> None:
        super().__init__()
        self.a, self.b, self.flag = nn.Linear(4, 4), _FlagBlock(), flag

    def forward(self, x):
        return self.b(self.a(x), scale=self.flag)


class _FlagBlock(nn.Module):
    def forward(self, x, scale=None):
        return x if scale is None else x * scale


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.drop(self.a(x)))


def test_other_shapes_that_are_not_chains():
    ab = [("a", ("a",)), ("b", ("b",))]
    assert pipeline_support(_Twice(), ab) == "no: unit a runs 2 times in its forward, not once"
    assert pipeline_support(_Twice(), [("b", ("b",)), ("a", ("a",))]).startswith("no: unit a runs 2 times")
    branchy = pipeline_support(_Branchy(), ab)
    assert branchy.startswith("no: torch.fx cannot trace its forward (TraceError:") and "\n" not in branchy
    assert pipeline_support(_Pair(), ab) == "no: its forward returns a tuple, not the output of unit b alone"
    assert pipeline_support(_Flagged(None), ab) == "chain"
    # not chains, but traced stages run them: the constant and the parameter-free module go into the stage's graph
    assert pipeline_support(_Flagged(2.0), ab) == "traced"
    assert pipeline_support(_Dropped(), ab) == "traced"
    assert pipeline_support(_Dropped(), _units(_Dropped())) == "chain"
    # a unit of several modules is no chain, but traced stages hold a unit's modules together
    assert pipeline_support(_Dropped(), [("a+drop", ("a", "drop")), ("b", ("b",))]) == "traced"
    order = pipeline_support(nn.Sequential(Gated(4), Gated(4)), [("1", ("1",)), ("0", ("0",))])
    assert order == "no: its forward runs the units in the order 0, 1"


# --- transformers ----------------------------------------------------------------------------------------------

LLAMA_CFG = ("num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2&intermediate_size=128"
             "&vocab_size=256&max_position_embeddings=64")


@pytest.mark.parametrize("name", sorted(FAMILIES_TINY))
def test_every_transformers_decoder_family_is_pipelined_by_the_one_adapter(name):
    pytest.importorskip("transformers")
    verdict, prof = _support(FAMILIES_TINY[name])
    assert verdict == prof.pipelining == "hf-decoder"


def test_transformers_stages_compute_the_model_s_own_logits_bit_for_bit():
    """Every family, cut into 2 and 4 stages (one holding only the head, one only the embedding): the stages run in
    turn give the whole model's logits exactly. Gemma 3 alternates sliding and full attention, so a stage that
    indexed its layer kinds by its own list position would differ; Granite scales its logits in the root's forward."""
    pytest.importorskip("transformers")
    for name, ref in FAMILIES_TINY.items():
        source = resolve(ref)
        prof = profile_model(source, micro_batch_size=1, seq_len=16, meta=True)
        units = UnitMap.of([u.name for u in prof.units], [u.modules for u in prof.units])
        names = [u.name for u in prof.units]
        model = source.build(device="cpu", dtype=torch.float32, seed=3)
        x = torch.randint(0, 128, (2, 16))
        with torch.no_grad():
            whole = logits_of(model(x))
            for cuts in ((2,), (1, 3, 5)):
                bounds = (0, *cuts, len(names))
                stages = tuple(tuple(names[a:b]) for a, b in zip(bounds, bounds[1:]))
                h = x
                for stage in build_stages(model, stages, list(range(len(stages))), units=units,
                                          support=prof.pipelining, recompute=()):
                    h = stage(h)
                assert torch.equal(h, whole), (name, cuts)


def test_transformers_models_with_other_units_are_refused_with_what_to_do():
    pytest.importorskip("transformers")
    units = "model.embed_tokens+model.rotary_emb,model.layers.0+model.layers.1,model.norm+lm_head"
    verdict, prof = _support(f"hf:llama?{LLAMA_CFG}", units=units)
    assert verdict == prof.pipelining == (
        "no: unit model.layers.0+model.layers.1 holds model.layers.0+model.layers.1, not model.layers.0; "
        "transformers models are pipelined at an embedding unit, one unit per decoder layer and a head unit "
        "(the profiler's default units)")


# --- the profile records it ------------------------------------------------------------------------------------

def _looped_profile() -> ModelProfile:
    return profile_model(resolve("tests.custom_models:make_looped"), micro_batch_size=2, seq_len=4, meta=True)


def test_profile_field_round_trips_and_old_files_offer_pipelines(tmp_path):
    prof = _looped_profile()
    path = write_atomic(tmp_path / "p.json", dumps(ProfileFile(model=prof, cluster=None).to_dict()))
    assert ProfileFile.load(path).model.pipelining == LOOPED
    data = json.loads(path.read_text())
    del data["model"]["pipelining"]                      # a file written before it was recorded
    old = ProfileFile.from_dict(data).model
    assert old.pipelining == "" and old.pipeline_refusal is None
    data["model"]["pipelining"] = "maybe"
    write_atomic(path, json.dumps(data), overwrite=True)
    with pytest.raises(FileFormatError, match=r"model.pipelining is 'maybe'; need one of chain, hf-decoder, traced, hf-llama, hf-gpt2"):
        ProfileFile.load(path)


# --- the planner respects it -----------------------------------------------------------------------------------

def test_plan_offers_only_pp1_for_a_model_that_cannot_be_pipelined():
    prof, cluster = _looped_profile(), preset("dgx-a100")
    found = search(prof, cluster, PlanRequest(gpus=4, global_batch_size=16))
    assert found.feasible and all(c.strategy.pp == 1 for c in found.feasible + found.infeasible)
    p = plan(prof, cluster, PlanRequest(gpus=4, global_batch_size=16))
    assert p.strategy.pp == 1 and all(a.strategy.pp == 1 for a in p.alternatives)
    assert all(c.family == "zero" for c in p.candidates)
    reason = LOOPED.removeprefix("no: ")
    assert [ln for ln in p.rationale.lines if ln.startswith(NO_PIPELINES)] == [f"{NO_PIPELINES}: {reason}"]
    assert not any(ln.startswith(("best pipeline", "best pipeline x ZeRO", "no pipeline strategy fits"))
                   for ln in p.rationale.lines)
    assert p.model.pipelining == LOOPED and p.model.unit_modules == tuple((u.name,) for u in prof.units)
    # the same model under an old profile (not recorded) is planned as before: pipelines in the space
    old = ModelProfile.from_dict({**prof.to_dict(), "pipelining": ""})
    assert any(c.strategy.pp > 1 for c in search(old, cluster, PlanRequest(gpus=4, global_batch_size=16)).feasible)


def test_a_chain_model_still_gets_pipelines_and_its_unit_modules_in_the_plan(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", True]
    found = search(prof, preset("dgx-a100"), PlanRequest(gpus=4, global_batch_size=16))
    assert any(c.strategy.pp > 1 for c in found.feasible)
    p = plan(prof, preset("dgx-a100"), PlanRequest(gpus=4, global_batch_size=16))
    assert p.model.pipelining == "chain" and p.model.unit_modules == tuple((u,) for u in p.model.units)
    assert not any(ln.startswith(NO_PIPELINES) for ln in p.rationale.lines)


def _cli_profile(tmp_path) -> str:
    prof = _looped_profile()
    return str(write_atomic(tmp_path / "profile.json",
                            dumps(ProfileFile(model=prof, cluster=preset("dgx-a100")).to_dict())))


def test_planner_plan_cli_on_a_skip_model(tmp_path):
    path = _cli_profile(tmp_path)
    res = runner.invoke(app, ["plan", path, "--gpus", "4", "-B", "16", "-o", str(tmp_path / "plan.json")])
    assert res.exit_code == 0, res.output
    p = Plan.load(tmp_path / "plan.json")
    assert p.strategy.pp == 1 and all(a.strategy.pp == 1 for a in p.alternatives)
    assert f"{NO_PIPELINES}: {LOOPED.removeprefix('no: ')}" in p.rationale.lines
    res = runner.invoke(app, ["plan", path, "--gpus", "4", "-B", "18", "-o", "-"])
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        f"error: dp = 4 does not divide the global batch 18, and pp > 1 is not offered (make_looped cannot be "
        f"pipelined: {LOOPED.removeprefix('no: ')}); use a batch divisible by 4"]


def test_planner_estimate_pp2_on_a_skip_model_exits_2_in_one_line(tmp_path):
    path = _cli_profile(tmp_path)
    res = runner.invoke(app, ["estimate", path, "--dp", "2", "--pp", "2", "--microbatches", "4"])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"error: --pp 2: make_looped cannot be pipelined: {LOOPED.removeprefix('no: ')}; use --pp 1"], res.output
    res = runner.invoke(app, ["estimate", path, "--dp", "4", "--pp", "1", "--microbatches", "4",
                              "-o", str(tmp_path / "p1.json")])
    assert res.exit_code == 0, res.output
    assert Plan.load(tmp_path / "p1.json").model.pipelining == LOOPED


def test_manual_plans_and_plan_files_refuse_pipelines_of_such_a_model():
    prof, cluster = _looped_profile(), preset("dgx-a100")
    with pytest.raises(ConfigError, match="cannot be pipelined"):
        build_strategy(prof, cluster, StrategyRequest(dp=1, pp=2, microbatches=2))
    names = [u.name for u in prof.units]
    s2 = Strategy(dp=1, pp=2, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=2,
                  stages=(tuple(names[:2]), tuple(names[2:])))
    with pytest.raises(ConfigError, match="planner run would refuse this strategy: .* cannot be pipelined"):
        manual_plan(s2, prof, cluster)
    chain = ModelProfile.from_dict({**prof.to_dict(), "pipelining": "chain"})
    edited = Plan.from_dict({**manual_plan(s2, chain, cluster).to_dict()})
    bad = Plan.from_dict({**edited.to_dict(), "model": {**edited.model.to_dict(), "pipelining": LOOPED}})
    with pytest.raises(ConfigError, match="strategy pp = 2 but the model cannot be pipelined"):
        check_plan(bad)
    short = Plan.from_dict({**edited.to_dict(), "model": {**edited.model.to_dict(), "unit_modules": [["stem"]]}})
    with pytest.raises(ConfigError, match="model.unit_modules lists 1 units but model.units 4"):
        check_plan(short)
    old = {**edited.to_dict(), "model": {k: v for k, v in edited.model.to_dict().items()
                                          if k not in ("unit_modules", "pipelining")}}
    loaded = Plan.from_dict(old)                      # a plan written before: each unit is its own module
    check_plan(loaded)
    assert loaded.model.unit_modules == () and loaded.model.pipelining == ""


CUT_MODELS = ("tests.custom_models:make_scaled", "tests.custom_models:make_posnet",
              "tests.custom_models:make_residual2", "tests.custom_models:make_skipnet",
              "tests.custom_models:make_nanogpt", FAMILIES_TINY["gemma"], FAMILIES_TINY["opt"])


@pytest.mark.parametrize("ref", CUT_MODELS)
def test_p2p_bytes_predicted_equal_what_the_stages_send(ref):
    """Every cut of models with work between units (a scaled embedding, a position table, a residual across units,
    a skip input, a model's own loss whose targets ride to the last stage; Gemma's scaled embedding, OPT's position
    table): the estimate's bytes a stage sends equal the bytes of the tensors the executor's stages hand on (their
    static shapes, stage_io_shapes)."""
    from cost_models.cost.estimate import estimate
    from cost_models.models.losses import takes_targets
    from executor.runtime import stage_io_shapes
    if ref.startswith("hf:"):
        pytest.importorskip("transformers")
    source = resolve(ref)
    prof = profile_model(source, micro_batch_size=2, seq_len=8, meta=True)
    assert prof.pipelining in ("traced", "hf-decoder")
    names = [u.name for u in prof.units]
    units = UnitMap.of(names, [u.modules for u in prof.units])
    meta = source.build(device="meta", dtype=torch.float32)
    example = source.example_input(meta, 2, 8, "cpu")[0]
    for cut in range(1, len(names)):
        s = Strategy(dp=1, pp=2, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=2, v=1,
                     stages=(tuple(names[:cut]), tuple(names[cut:])), precision="fp32", optimizer="adamw")
        io = stage_io_shapes(meta, s, units, prof.pipelining, example, own_loss=takes_targets(meta))
        sent = sum(t.numel() * t.element_size() for t in io[0][1])
        predicted = estimate(s, prof, preset("dgx-a100")).stages[0].boundary_bytes
        assert (cut, predicted) == (cut, sent)


def test_a_buffer_read_between_units_belongs_to_the_stage_that_reads_it():
    """BufNet scales block 0's output by a root buffer: whatever the cut, the stages' state maps hold every
    persistent buffer of the model once, under its own name, so checkpoints hold it (export, resume into pp = 1)."""
    from executor.stages import canonical_names, state_maps
    source = resolve("tests.custom_models:make_bufnet")
    prof = profile_model(source, micro_batch_size=2, seq_len=8, meta=True)
    assert prof.pipelining == "traced"
    names = [u.name for u in prof.units]
    units = UnitMap.of(names, [u.modules for u in prof.units])
    model = source.build(device="cpu", dtype=torch.float32)
    wanted = {n for n in model.state_dict() if n not in dict(model.named_parameters())}
    assert wanted == {"mix"}
    for cut in range(1, len(names)):
        stages = (tuple(names[:cut]), tuple(names[cut:]))
        built = build_stages(model, stages, [0, 1], units=units, support="traced", recompute=())
        held = [set(state_maps(model, [stage], canonical_names(model))[1]) for stage in built]
        assert sorted(held[0] | held[1]) == ["mix"] and not held[0] & held[1], cut
