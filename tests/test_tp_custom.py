"""`planner profile --tp-plan module:function` (issue 17, item 2): a user's tensor-parallel plan for a model with no
built-in one, checked at profile time and recorded in the profile (TPShape.rules), so that planning and runs use
the recorded rules without importing the plan function again."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_models.models.source import resolve
from cost_models.models.tp_shape import check_rules, custom_tp_plan, tp_shape
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError, ModelSourceError
from cost_models.records.profile import ModelProfile
from cost_models.records.strategy import Strategy
from cost_models.records.tensor_parallel import TPRule, TPShape, rules_for, style_of

MODEL = "tests.test_tp_custom:tiny_model"
PLAN = "tests.test_tp_custom:tiny_plan"
VOCAB, DIM, WIDTH = 96, 32, 64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, WIDTH)
        self.down = nn.Linear(WIDTH, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyTP(nn.Module):
    """A token model with no built-in tensor-parallel plan: embedding, residual MLP blocks, an untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def tiny_model() -> nn.Module:
    return TinyTP()


class GluMLP(nn.Module):
    """A gated MLP with one fused up-projection its forward cuts at the full width (an int attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.width = WIDTH
        self.up = nn.Linear(DIM, 2 * WIDTH)
        self.down = nn.Linear(WIDTH, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(x).split(self.width, dim=-1)
        return self.down(a * torch.sigmoid(b))


def glu_model() -> nn.Module:
    model = TinyTP()
    for block in model.blocks:
        block.mlp = GluMLP()
    return model


def glu_plan(model: nn.Module) -> list:
    """The fused projection split in 2 parts, and the width its forward cuts at divided by tp on every rank."""
    return [("embed", "embedding"), ("blocks.*.norm", "norm"), ("blocks.*.mlp", "region"),
            ("blocks.*.mlp.up", "colwise", 2), ("blocks.*.mlp.down", "rowwise"), ("out", "head"),
            ("blocks.*.mlp.width", "local_width")]


def glu_plan_without_width(model: nn.Module) -> list:
    return glu_plan(model)[:-1]


def tiny_plan(model: nn.Module) -> list:
    return [("embed", "embedding"), ("blocks.*.norm", "norm"), ("blocks.*.mlp", "region"),
            ("blocks.*.mlp.up", "colwise"), TPRule(pattern="blocks.*.mlp.down", style="rowwise"), ("out", "head")]


def plan_unknown_style(model):
    return [("blocks.*.up", "columnwise")]


def plan_matching_nothing(model):
    return [("layers.*.mlp.up", "colwise")]


def plan_wrong_kind(model):
    return [("blocks.*.norm", "colwise")]


def plan_shadowed(model):   # the first matching rule wins: "blocks.*" takes the linears too
    return [("blocks.*", "norm"), ("blocks.*.mlp.up", "colwise")]


def plan_wide_region(model):   # the block's norm would run on the region's DTensor input
    return [("blocks.*.mlp.up", "colwise"), ("blocks.*.mlp.down", "rowwise"), ("blocks.?", "region")]


def plan_not_rules(model):
    return 42


def _meta(ref: str = MODEL) -> nn.Module:
    return resolve(ref).build(device="meta", dtype=torch.float32)


def _profile(plan: str | None = PLAN) -> ModelProfile:
    with custom_tp_plan(plan):
        return profile_model(resolve(MODEL), micro_batch_size=2, seq_len=8, meta=True)


def test_the_custom_plan_is_checked_and_recorded_in_the_profile():
    prof = _profile()
    shape = prof.tensor_parallel
    assert shape.plan == f"custom: {PLAN}" and shape.refusal is None
    assert shape.rules == tuple(TPRule(pattern=p, style=s) for p, s in (
        ("embed", "embedding"), ("blocks.*.norm", "norm"), ("blocks.*.mlp", "region"), ("blocks.*.mlp.up", "colwise"),
        ("blocks.*.mlp.down", "rowwise"), ("out", "head")))
    # no config: no heads to divide; the split widths' gcd (64 MLP, 96 vocabulary) and the residual width decide
    assert (shape.heads, shape.ffn, shape.hidden, shape.vocab, shape.vocab_split) == (0, 32, DIM, VOCAB, True)
    assert shape.tp_refusal(2) is None and shape.tp_refusal(64) == "tp=64 does not divide the 32 split widths' gcd"
    assert shape.tp_refusal(2, sp=True, seq_len=8).startswith("sequence parallelism is not offered for custom plans")
    # the profile file keeps the rules: a reloaded profile has the same plan, without the plan function
    assert ModelProfile.from_dict(prof.to_dict()).tensor_parallel == shape
    # the per-unit attribution follows the rules: up's weight and bias and down's weight split, down's bias whole
    block = prof.unit("blocks.0")
    assert block.tp.param_split == (0, 0, 1, 1, 1, 0)
    assert block.tp.split_params == 2 * DIM * WIDTH + WIDTH and block.tp.row_calls == 1
    assert prof.unit("embed").tp.vocab_params == VOCAB * DIM
    # outside the context the model has no plan again
    assert tp_shape(_meta()).refusal.startswith("no tensor-parallel plan for TinyTP")


def test_the_recorded_rules_split_the_model_as_the_plan_function_said():
    from executor.tensor_parallel import model_shape
    rules = _profile().tensor_parallel.rules
    model = _meta()
    shape = model_shape(model, rules)
    assert (shape.ffn, shape.vocab_split) == (32, True)
    split = rules_for(shape.tp_plan, vocab_split=True)
    assert [n for n, _ in model.named_modules() if (r := style_of(n, split)) and r.style == "colwise"] == \
        ["blocks.0.mlp.up", "blocks.1.mlp.up"]


@pytest.mark.parametrize("fn, message", [
    ("plan_unknown_style", "--tp-plan tests.test_tp_custom:plan_unknown_style: unknown style 'columnwise' for "
                           "'blocks.*.up'; use one of colwise, rowwise, embedding, head, norm, head_norm, region, "
                           "sp_entry, local_width"),
    ("plan_matching_nothing", "--tp-plan tests.test_tp_custom:plan_matching_nothing: 'layers.*.mlp.up' matches "
                              "no module of TinyTP; patterns are module names (model.named_modules()) with * "
                              "wildcards"),
    ("plan_wrong_kind", "--tp-plan tests.test_tp_custom:plan_wrong_kind: colwise splits Linear or Conv1D modules, "
                        "but blocks.0.norm is a LayerNorm"),
    ("plan_shadowed", "--tp-plan tests.test_tp_custom:plan_shadowed: 'blocks.*.mlp.up' only matches modules an "
                      "earlier rule styles (the first matching rule wins); put it before them"),
    ("plan_wide_region", "--tp-plan tests.test_tp_custom:plan_wide_region: region blocks.0 holds blocks.0.norm, "
                         "whose parameters are not split; a region holds only its split linears (as an attention or "
                         "MLP module does)"),
    ("plan_not_rules", "--tp-plan tests.test_tp_custom:plan_not_rules must return a non-empty list of (pattern, "
                       "style) or (pattern, style, parts) tuples with parts >= 1"),
])
def test_bad_plans_are_one_line_errors(fn, message):
    with pytest.raises(ConfigError) as err:
        _profile(f"tests.test_tp_custom:{fn}")
    assert str(err.value) == message


def test_a_missing_plan_function_fails_before_profiling():
    with pytest.raises(ModelSourceError, match="tests.test_tp_custom has no callable 'nope'"):
        with custom_tp_plan("tests.test_tp_custom:nope"):
            raise AssertionError("not reached")


def test_old_profiles_without_rules_still_load():
    d = TPShape(plan="zoo-gpt", heads=4, kv_heads=4, ffn=256, hidden=64, vocab=512).to_dict()
    d.pop("rules")
    assert TPShape.from_dict(d).rules == ()


def test_validate_accepts_a_custom_plan_with_rules_only():
    from cost_models.records.validate import validate_model
    prof = _profile()
    validate_model(prof, "profile.json")
    bare = ModelProfile.from_dict({**prof.to_dict(), "tensor_parallel": {**prof.tensor_parallel.to_dict(), "rules": []}})
    with pytest.raises(ConfigError, match="tensor_parallel.plan"):
        validate_model(bare, "profile.json")


def test_planner_profile_records_the_plan_and_reports_a_bad_one_in_one_line(tmp_path):
    import json

    from typer.testing import CliRunner

    from cli import app
    out = tmp_path / "profile.json"
    args = ["profile", "--model", MODEL, "-b", "1", "-s", "8", "--meta", "--cluster", "none", "-o", str(out)]
    res = CliRunner().invoke(app, [*args, "--tp-plan", PLAN])
    assert res.exit_code == 0, res.output
    shape = json.loads(out.read_text())["model"]["tensor_parallel"]
    assert shape["plan"] == f"custom: {PLAN}" and len(shape["rules"]) == 6
    res = CliRunner().invoke(app, [*args, "--force", "--tp-plan", "tests.test_tp_custom:plan_matching_nothing"])
    assert res.exit_code == 2 and "'layers.*.mlp.up' matches no module of TinyTP" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_planner_searches_tp_with_the_recorded_rules():
    from cost_models.records.presets import preset
    from planner.request import PlanRequest
    from planner.search import plan
    found = plan(_profile(), preset("dgx-a100"), PlanRequest(gpus=8, global_batch_size=32, tp_degrees=(2,)))
    assert found.strategy.tp == 2


def test_a_local_width_rule_is_checked_and_divides_tp():
    with custom_tp_plan("tests.test_tp_custom:glu_plan"):
        shape = tp_shape(_meta("tests.test_tp_custom:glu_model"))
    assert shape.tp_plan.local_widths == ("blocks.*.mlp.width",)
    assert all(r.style != "local_width" for r in shape.tp_plan.rules)
    bad = [("blocks.*.mlp.wide", "local_width")]
    with pytest.raises(ConfigError, match=r"local_width 'blocks.\*.mlp.wide': the modules 'blocks.\*.mlp' names need "
                                          r"an int attribute 'wide'"):
        check_rules(_meta("tests.test_tp_custom:glu_model"), tuple(TPRule(pattern=p, style=st) for p, st in bad), "f")


@pytest.mark.slow
def test_a_projection_cut_at_a_declared_width_trains_under_tp_like_one_process():
    """Under tp = 2 each rank holds half of the fused projection: with the width declared local_width, its forward
    cuts the local half and the run equals one process; without it, every rank fails, named in one line."""
    from executor.launch import RunFailed, run_many
    from executor.train import TrainConfig, single_process_losses
    ref = "tests.test_tp_custom:glu_model"
    results = {}
    for plan in ("glu_plan", "glu_plan_without_width"):
        with custom_tp_plan(f"tests.test_tp_custom:{plan}"):
            prof = profile_model(resolve(ref), micro_batch_size=2, seq_len=8, meta=True)
        units = tuple(u.name for u in prof.units)
        cfg = TrainConfig(model_source=ref, seq_len=8, input_kind="tokens", steps=3, warmup=1, seed=1, lr=1e-2,
                          tp_rules=prof.tensor_parallel.rules)
        one = Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=4, v=1, stages=(units,),
                       precision="fp32", optimizer="adamw")
        tp2 = Strategy(**{**one.to_dict(), "tp": 2})
        try:
            results[plan] = (single_process_losses(one, cfg), run_many(2, [tp2], cfg)[0][0].losses)
        except RunFailed as exc:
            results[plan] = str(exc)
    reference, losses = results["glu_plan"]
    assert list(losses) == pytest.approx(reference, rel=1e-5)
    assert "not enough values to unpack" in results["glu_plan_without_width"]
