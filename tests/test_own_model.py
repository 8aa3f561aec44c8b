"""The executor runs the user's model as written (issue 16): its own forward (work between units included), its
own initialisation, under every plan family offered for it; what cannot be offered is refused in one line."""
import os

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from cli import app
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError, ProfileError
from cost_models.records.strategy import Strategy
from cost_models.torch_compat.elastic import elastic_job, init_process_group
from executor.testing_hooks import INIT_ENV
from executor.train import TrainConfig, single_process_losses
from tests.plans import plan_for
from tests.shared_launch import run_shared

WORK_BETWEEN_UNITS = ("tests.custom_models:make_scaled", "tests.custom_models:make_posnet",
                      "tests.custom_models:make_residual2", "tests.custom_models:make_skipnet",
                      "tests.custom_models:make_nanogpt")


def _zero(units, dp: int, zero: int, m: int = 2) -> Strategy:
    return Strategy(dp=dp, pp=1, zero=zero, schedule="1f1b", microbatches=m, micro_batch_size=8 // (dp * m), v=1,
                    stages=(tuple(units),), precision="fp32", optimizer="adamw")


def _pipe(units, schedule: str, v: int = 1) -> Strategy:
    k = 2 * v
    cuts = [round(len(units) * (i + 1) / k) for i in range(k)]
    stages = tuple(tuple(units[a:b]) for a, b in zip([0] + cuts[:-1], cuts))
    return Strategy(dp=1, pp=2, zero=0, schedule=schedule, microbatches=4, micro_batch_size=2, v=v, stages=stages,
                    precision="fp32", optimizer="adamw")


def _traced_setup(ref: str, **cfg_fields):
    prof = profile_model(resolve(ref), micro_batch_size=1, seq_len=8, meta=True)
    units = [u.name for u in prof.units]
    cfg = TrainConfig(model_source=ref, seq_len=8, input_kind=prof.input.kind, steps=4, warmup=1, seed=2, lr=1e-2,
                      unit_modules=tuple(u.modules for u in prof.units), **cfg_fields)
    return prof, units, cfg


@pytest.fixture(scope="module")
def traced_runs():
    """Every model of WORK_BETWEEN_UNITS under every plan family, and make_posnet with a declared loss (ZeRO-2,
    1F1B), in one 2-rank launch (each launch spawns ranks that import torch): {ref or "loss": (units, cfg,
    strategies, results)}."""
    jobs = []
    for ref in WORK_BETWEEN_UNITS:
        prof, units, cfg = _traced_setup(ref)
        assert prof.pipelining == "traced", ref
        jobs.append((ref, units, cfg, [_zero(units, 2, z) for z in range(4)] + [
            _pipe(units, "gpipe"), _pipe(units, "1f1b"), _pipe(units, "interleaved-1f1b", v=2),
            _pipe(units, "zb-interleaved")]))
    _, units, cfg = _traced_setup("tests.custom_models:make_posnet", loss_fn="tests.custom_models:smoothed_loss")
    jobs.append(("loss", units, TrainConfig(**{**cfg.to_dict(), "steps": 3}),
                 [_zero(units, 2, 2), _pipe(units, "1f1b")]))
    results = run_shared(2, [(key, cfg, strategies, None) for key, _, cfg, strategies in jobs])
    return {key: (units, cfg, strategies, results[key]) for key, units, cfg, strategies in jobs}


@pytest.mark.slow
@pytest.mark.parametrize("ref", WORK_BETWEEN_UNITS)
def test_a_model_doing_work_between_units_trains_like_its_own_forward_under_every_plan_family(ref, traced_runs):
    """ZeRO 0-3 run the model itself; pipelines run its traced forward cut at the stage boundaries
    (executor.traced_stages: the scale, the position table, the residual and SkipNet's skip input on the stages
    that need them)."""
    units, cfg, strategies, results = traced_runs[ref]
    reference = single_process_losses(_zero(units, 1, 0, m=1), cfg)
    for s, ranks in zip(strategies, results):
        seen = [r.losses for r in ranks if r.losses]
        assert seen, (ref, s.name)
        for losses in seen:
            assert list(losses) == pytest.approx(reference, rel=1e-5), (ref, s.name)


def test_a_pipeline_plan_for_a_model_that_cannot_be_pipelined_is_refused_in_one_line(tmp_path):
    ref = "tests.custom_models:make_looped"   # block 0 runs at two depths: no stage can hold it
    prof = profile_model(resolve(ref), micro_batch_size=1, seq_len=8, meta=True)
    units = tuple(u.name for u in prof.units)
    chain_prof = type(prof).from_dict({**prof.to_dict(), "pipelining": "chain"})   # a plan made as if it could
    s = Strategy(dp=1, pp=2, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=4, v=1,
                 stages=(units[:2], units[2:]), precision="fp32", optimizer="adamw")
    path = plan_for(s, chain_prof).save(tmp_path / "plan.json")
    res = CliRunner().invoke(app, ["run", str(path), "--steps", "2", "-o", str(tmp_path / "run.json")])
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert line.count("\n") == 0 and "cannot be pipelined: unit blocks.0 runs 2 times in its forward" in line
    assert not (tmp_path / "run.json").exists()


def _initial_state(strategies: list[dict], mode: str, factory: str) -> list[dict]:
    """A rank's step-0 parameters (full tensors) under each strategy, by canonical name (runs on every rank)."""
    from executor.api import apply_plan
    from tests import custom_models
    make = getattr(custom_models, factory)
    torch.set_num_threads(1)
    os.environ[INIT_ENV] = mode
    init_process_group("gloo", 60)
    out = []
    for data in strategies:
        rt = apply_plan(Strategy.from_dict(data), make, lambda ps: torch.optim.SGD(ps, lr=0.1),
                        lambda out, y: out.sum(), example_input=torch.zeros(2, 8, dtype=torch.long), seed=5)
        state = {}
        for name in sorted(rt.params_by_name):
            p = rt.params_by_name[name]
            state[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        out.append(state)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return gathered if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["make_tiny_lm", "make_posnet"])
def test_every_layout_starts_from_the_models_own_init(factory):
    """factory mode: every layout's step-0 parameters are factory()'s after torch.manual_seed(seed); per-module
    mode (for models too large to build on every rank): drawn by each module's own reset_parameters, identical
    under every layout. PosNet's position table (read outside the units) rides on its traced first stage."""
    from tests import custom_models
    units = ("emb", "blocks.0", "blocks.1", "head")
    layouts = [_zero(units, 2, 0), _zero(units, 2, 3),
               Strategy(dp=1, pp=2, zero=0, schedule="1f1b", microbatches=2, micro_batch_size=4, v=1,
                        stages=(units[:2], units[2:]), precision="fp32", optimizer="adamw")]
    torch.manual_seed(5)
    expected = {n: p.detach() for n, p in getattr(custom_models, factory)().named_parameters()}
    by_mode = {}
    for mode in ("factory", "per-module"):
        with elastic_job("init", 2) as (start, _):
            per_rank = start(_initial_state, [s.to_dict() for s in layouts], mode, factory)[0]
        merged = []
        for i in range(len(layouts)):
            state = {}
            for rank_states in per_rank:
                state.update(rank_states[i])
            assert sorted(state) == sorted(expected), (mode, i)
            merged.append(state)
        by_mode[mode] = merged
    for state in by_mode["factory"]:
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
    first = by_mode["per-module"][0]
    assert any(not torch.equal(first[n], expected[n]) for n in expected)   # its own draw, not factory()'s
    assert first["head.bias"].abs().max() <= 1 / 16 ** 0.5                 # nn.Linear.reset_parameters' bound
    for state in by_mode["per-module"][1:]:
        for name in expected:
            assert torch.equal(state[name], first[name]), name


def test_a_model_that_takes_targets_is_profiled_on_its_training_branch_and_pipelined_without_units():
    """A single-file GPT: `forward(idx, targets)` gives (logits, loss), without targets the last position's logits
    only. Profiled as it trains (with targets), every count equals a hand count; its default units (the embedding
    and head as groups of modules) are cut by traced stages, no --units needed."""
    b, s, d, vocab = 2, 16, 32, 128
    prof = profile_model(resolve("tests.custom_models:make_nanogpt"), micro_batch_size=b, seq_len=s, meta=True)
    assert [u.modules for u in prof.units] == [("transformer.wte", "transformer.wpe", "transformer.drop"),
                                               *[(f"transformer.h.{i}",) for i in range(4)],
                                               ("transformer.ln_f", "lm_head")]
    assert prof.pipelining == "traced"
    # per block: q/k/v, attention scores and values (all s x s positions), output projection, the 4x MLP
    block = 2 * b * s * d * 3 * d + 2 * 2 * b * s * s * d + 2 * b * s * d * d + 2 * 2 * b * s * d * 4 * d
    assert [u.fwd_flops for u in prof.units[1:-1]] == [block] * 4
    head = prof.units[-1]
    assert head.fwd_flops == 2 * b * s * d * vocab          # every position (the inference branch: one)
    assert head.output_bytes == b * s * vocab * 4           # fp32 logits of every position


@pytest.mark.slow
def test_a_pipelined_checkpoint_holds_a_buffer_read_between_units_so_it_exports_and_resumes_into_pp1(tmp_path):
    """BufNet's root buffer is read between its units: PP2 1F1B saves it with the stage that reads it, so the
    checkpoint exports, and resumed under ZeRO-0 over 2 ranks the run goes on as one process does."""
    from safetensors.torch import load_file

    from executor.launch import RunConfig, launch
    ref = "tests.custom_models:make_bufnet"
    prof = profile_model(resolve(ref), micro_batch_size=2, seq_len=8, meta=True)
    units = [u.name for u in prof.units]
    cfg = TrainConfig(model_source=ref, seq_len=8, input_kind="tokens", steps=4, warmup=0, seed=2, lr=1e-2,
                      unit_modules=tuple(u.modules for u in prof.units))
    reference = single_process_losses(_zero(units, 1, 0, m=1), cfg)
    ck = tmp_path / "ck"
    first = launch(plan_for(_pipe(units, "1f1b"), prof), RunConfig(steps=2, warmup=0, seed=2, lr=1e-2,
                                                                   checkpoint_dir=str(ck)))
    assert list(first.losses) == pytest.approx(reference[:2], rel=1e-5)
    res = CliRunner().invoke(app, ["export", str(ck), "-o", str(tmp_path / "w.safetensors")])
    assert res.exit_code == 0, res.output
    assert torch.equal(load_file(tmp_path / "w.safetensors")["mix"], torch.linspace(0.5, 1.5, 16))
    resumed = launch(plan_for(_zero(units, 2, 0), prof), RunConfig(steps=4, warmup=0, resume=str(ck)))
    assert list(resumed.losses) == pytest.approx(reference[2:], rel=1e-5)


def test_an_output_no_loss_can_be_taken_on_is_refused_at_profile_time_and_before_ranks_start(tmp_path):
    """A forward returning (logits, mean) would fail on a rank after start-up: the profiler refuses it in one line
    naming the wrapper to write, and so does the launcher for a plan made with another model's profile."""
    from executor.launch import RunConfig, launch
    res = CliRunner().invoke(app, ["profile", "--model", "tests.custom_models:make_pair_out", "--meta",
                                   "--seq-len", "8", "-b", "2", "-o", str(tmp_path / "p.json"),
                                   "--cluster", "none"])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and not (tmp_path / "p.json").exists(), res.output
    assert lines[0] == (
        "error: make_pair_out: its forward returns a tuple, not a tensor of logits (or an output with .logits); wrap "
        "the model in a module whose forward returns the logits, or give its forward a `targets` parameter and "
        "return (logits, loss) when targets are given")
    import dataclasses
    prof = profile_model(resolve("tests.custom_models:make_tiny_lm"), micro_batch_size=2, seq_len=8, meta=True)
    prof = dataclasses.replace(prof, source="tests.custom_models:make_pair_out")   # the same modules, other output
    plan = plan_for(_zero([u.name for u in prof.units], 2, 0), prof)
    with pytest.raises(ConfigError, match=r"^its forward returns a tuple, not a tensor of logits"):
        launch(plan, RunConfig(steps=1, warmup=0))
    with pytest.raises(ProfileError, match=r"^make_loss_only: its forward, given targets=, returns no logits beside "
                                           r"its loss; return \(logits, loss\)"):
        profile_model(resolve("tests.custom_models:make_loss_only"), micro_batch_size=2, seq_len=8, meta=True)


def test_a_forward_that_cannot_run_on_meta_is_left_to_the_ranks():
    """A data-dependent forward (`.item()`) profiles for real; the launcher's checks on the meta device cannot run
    it, and let it through rather than fail with a traceback (the ranks run it for real)."""
    from executor.launch import _check_model
    prof = profile_model(resolve("tests.custom_models:make_meta_shy"), micro_batch_size=2, seq_len=8, meta=False,
                         repeats=1, warmup=0)
    plan = plan_for(_zero([u.name for u in prof.units], 2, 0), prof)
    assert _check_model(plan, "tests.custom_models:smoothed_loss").__class__.__name__ == "MetaShy"


def test_a_block_the_forward_runs_twice_is_counted_twice():
    """Looped runs blocks.0 at two depths (ALBERT-style sharing): its unit does its work and keeps its activations
    twice a step, so its counts are twice its twin blocks.1's (the same module class and shapes)."""
    prof = profile_model(resolve("tests.custom_models:make_looped"), micro_batch_size=2, seq_len=8, meta=True)
    units = {u.name: u for u in prof.units}
    once, twice = units["blocks.1"], units["blocks.0"]
    assert once.fwd_flops > 0 and once.saved_bytes > 0
    assert (twice.fwd_flops, twice.bwd_flops, twice.saved_bytes) == (
        2 * once.fwd_flops, 2 * once.bwd_flops, 2 * once.saved_bytes)
    assert sum(u.fwd_flops for u in prof.units) == prof.model_fwd_flops   # the whole forward, every unit's share


def test_blocks_in_a_module_dict_are_units():
    prof = profile_model(resolve("tests.custom_models:make_keyed_blocks"), micro_batch_size=2, seq_len=8, meta=True)
    assert [u.name for u in prof.units] == ["emb", "blocks.early", "blocks.late", "head"]
    assert prof.pipelining == "chain"


def test_a_declared_loss_is_checked_on_the_meta_model_before_ranks_start(tmp_path):
    """`planner run --loss module:fn`: a function that is not there, or returns one value per token, is refused in
    one line before any rank starts."""
    from tests.plans import plan_file
    prof = profile_model(resolve("tests.custom_models:make_tiny_lm"), micro_batch_size=2, seq_len=8, meta=True)
    path = plan_file(tmp_path, _zero([u.name for u in prof.units], 2, 0), prof)
    for fn, message in (("tests.custom_models:no_such_loss", "error: --loss 'tests.custom_models:no_such_loss': "
                                                              "tests.custom_models has no callable 'no_such_loss'"),
                        ("tests.custom_models:per_token_loss", "error: --loss tests.custom_models:per_token_loss "
                                                               "returned Tensor(8,), not a scalar floating-point "
                                                               "tensor; return the mean loss")):
        res = CliRunner().invoke(app, ["run", str(path), "--steps", "1", "--loss", fn, "-o", "-"])
        assert (res.exit_code, res.stderr.strip().splitlines()) == (2, [message])


@pytest.mark.slow
def test_a_declared_loss_trains_sharded_and_pipelined_like_one_process(traced_runs):
    units, cfg, strategies, results = traced_runs["loss"]
    reference = single_process_losses(_zero(units, 1, 0, m=1), cfg)
    plain = single_process_losses(_zero(units, 1, 0, m=1), TrainConfig(**{**cfg.to_dict(), "loss_fn": None}))
    assert reference[0] != pytest.approx(plain[0], rel=1e-4)   # the same model and batch: the declared loss trained
    for s, ranks in zip(strategies, results):
        for losses in [r.losses for r in ranks if r.losses]:
            assert list(losses) == pytest.approx(reference, rel=1e-5), s.name
