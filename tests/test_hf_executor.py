"""HF causal LMs trained by the executor with their own code: every decoder family of tests/hf_families.py, saved
with save_pretrained and loaded with --init-from, sharded (ZeRO-3) and pipelined (PP2 1F1B) on a token file, against
the same HF model trained in one process and against its own from_pretrained loss; LlamaForCausalLM (grouped-query
attention, rotary embeddings) and GPT2LMHeadModel (tied head, learned positions) under every plan family."""
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cost_models.models.source import resolve  # noqa: E402
from cost_models.profiling.model_profiler import profile_model  # noqa: E402
from cost_models.records.strategy import Strategy  # noqa: E402
from executor.train import TrainConfig, batch_source, single_process_losses  # noqa: E402
from tests.hf_families import FAMILIES_TINY as MODELS  # noqa: E402
from tests.shared_launch import run_shared  # noqa: E402

GLOBAL, SEQ = 8, 16


def _saved(ref: str, folder) -> str:
    """The model with its own init (seed 11, unlike the run's seed) saved by save_pretrained: what --init-from
    loads; sharded into several files so the index is read too."""
    torch.manual_seed(11)
    model = resolve(ref).build(device="cpu", dtype=torch.float32, seed=11)
    model.save_pretrained(folder, max_shard_size="100KB")
    return str(folder)


def _strategy(units, dp, pp, zero=0, schedule="1f1b", v=1, m=None) -> Strategy:
    m = m or GLOBAL // dp
    k = pp * v
    cuts = [round(len(units) * (i + 1) / k) for i in range(k)]
    stages = tuple(tuple(units[a:b]) for a, b in zip([0] + cuts[:-1], cuts))
    return Strategy(dp=dp, pp=pp, zero=zero, schedule=schedule, microbatches=m, micro_batch_size=GLOBAL // (dp * m),
                    v=v, stages=stages, precision="fp32", optimizer="adamw")


def _tokens(path, count: int = 2000) -> str:
    """A token file (nanoGPT's .bin, uint16) of `count` random ids below the tiny configs' 128-token vocabulary."""
    np.random.default_rng(5).integers(0, 128, count).astype(np.uint16).tofile(path)
    return str(path)


def _setup(name, tmp_path, *, data: bool = False, with_profile: bool = False):
    ref = MODELS[name]
    prof = profile_model(resolve(ref), micro_batch_size=1, seq_len=SEQ, meta=True)
    units = tuple(u.name for u in prof.units)
    cfg = TrainConfig(model_source=ref, seq_len=SEQ, input_kind="tokens", steps=5, warmup=1, seed=3, lr=1e-2,
                      unit_modules=tuple(u.modules for u in prof.units), init_from=_saved(ref, tmp_path / name),
                      data=_tokens(tmp_path / "tokens.bin") if data else None)
    return (units, cfg, prof) if with_profile else (units, cfg)


def _attention(ref: str) -> str:
    return "eager" if "attn_implementation=eager" in ref else "sdpa"


def _own_loss(folder, cfg: TrainConfig, step: int = 0) -> float:
    """The saved model's own loss on a step's global batch, from `model(input_ids).logits` (from_pretrained)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=_attention(cfg.model_source))
    example = torch.zeros(1, SEQ, dtype=torch.long)
    x, y = batch_source(cfg, example, (1, SEQ, 128), GLOBAL, "cross_entropy")(step)
    with torch.no_grad():
        return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()


def _own_step0_loss(cfg: TrainConfig) -> float:
    return _own_loss(cfg.init_from, cfg)


def _check(strategies, results, reference, own_step0):
    for s, ranks in zip(strategies, results):
        seen = [r.losses for r in ranks if r.losses]
        assert seen, s.name
        for losses in seen:
            assert losses[0] == pytest.approx(own_step0, rel=1e-5), s.name
            assert list(losses) == pytest.approx(reference, rel=1e-4), s.name


PLAN_FAMILIES = ("llama", "gpt2")


def _plan_families(units):
    return [_strategy(units, 2, 1, z) for z in range(4)] + [
        _strategy(units, 1, 2, schedule="gpipe", m=4), _strategy(units, 1, 2, m=4),
        _strategy(units, 1, 2, schedule="interleaved-1f1b", v=2, m=4),
        _strategy(units, 1, 2, schedule="zb-interleaved", m=4)]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Every 2-rank run of this module in one launch (each launch spawns ranks that import transformers): per
    decoder family, ZeRO-3 over 2 ranks for four steps on a token file and PP2 1F1B for four steps saving a
    checkpoint; for Llama and GPT-2, every plan family on synthetic batches.
    {(name, kind): (units, cfg, strategies, results, each strategy's config)}"""
    from tests.plans import plan_for
    root = tmp_path_factory.mktemp("hf-two-ranks")
    jobs: list[tuple[tuple[str, str], tuple, TrainConfig, list, list, list]] = []
    for name in sorted(MODELS):
        (root / name).mkdir()
        units, cfg, prof = _setup(name, root / name, data=True, with_profile=True)
        four = TrainConfig(**{**cfg.to_dict(), "steps": 4})
        pp = _strategy(units, 1, 2, m=4)
        saving = TrainConfig(**{**four.to_dict(), "warmup": 0, "checkpoint_dir": str(root / name / "ck")})
        jobs.append(((name, "family"), units, cfg, [_strategy(units, 2, 1, 3), pp], [four, saving],
                     [None, plan_for(pp, prof)]))
    for name in PLAN_FAMILIES:
        (root / f"{name}-plans").mkdir()
        units, cfg = _setup(name, root / f"{name}-plans")
        strategies = _plan_families(units)
        jobs.append(((name, "plans"), units, cfg, strategies, [cfg] * len(strategies), [None] * len(strategies)))
    results = run_shared(2, [(key, cfgs, strategies, plans) for key, _, _, strategies, cfgs, plans in jobs])
    return {key: (units, cfg, strategies, results[key], cfgs) for key, units, cfg, strategies, cfgs, _ in jobs}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_decoder_family_trains_sharded_and_pipelined_like_itself_and_exports(name, two_rank_runs, tmp_path):
    """ZeRO-3 over 2 ranks and PP2 1F1B on a token file: step 0 is the saved model's own loss, four AdamW steps are
    one process's; `planner export --hf` of the PP2 checkpoint loads with from_pretrained (its loss on step 4's
    batch is one process's fifth) and starts another run with --init-from."""
    from typer.testing import CliRunner

    from cli import app
    units, cfg, (zero3, _), (zero3_ranks, pp_ranks), (_, saving) = two_rank_runs[name, "family"]
    reference = single_process_losses(_strategy(units, 1, 1), cfg)
    own = _own_step0_loss(cfg)
    assert reference[0] == pytest.approx(own, rel=1e-5)
    assert len({round(x, 6) for x in reference}) == 5      # it really trains: every step differs
    _check([zero3], [zero3_ranks], reference[:4], own)
    losses = [r.losses for r in pp_ranks if r.losses][0]
    assert list(losses) == pytest.approx(reference[:4], rel=1e-4)
    res = CliRunner().invoke(app, ["export", saving.checkpoint_dir, "--hf", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert _own_loss(tmp_path / "out", cfg, step=4) == pytest.approx(reference[4], rel=1e-5)
    again = TrainConfig(**{**cfg.to_dict(), "steps": 1, "init_from": str(tmp_path / "out")})
    assert single_process_losses(_strategy(units, 1, 1), again)[0] == pytest.approx(
        _own_loss(tmp_path / "out", again), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAN_FAMILIES)
def test_hf_model_trains_like_itself_under_every_plan_family_on_2_ranks(name, two_rank_runs):
    units, cfg, strategies, results, _ = two_rank_runs[name, "plans"]
    reference = single_process_losses(_strategy(units, 1, 1), cfg)
    own = _own_step0_loss(cfg)
    assert reference[0] == pytest.approx(own, rel=1e-5)
    assert len({round(x, 6) for x in reference}) == 5      # it really trains: every step differs
    _check(strategies, results, reference, own)


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    """Llama and GPT-2 on 4 ranks in one launch: every ZeRO stage over 4 ranks once (Llama); GPT-2 for what its
    tied head adds (the tie across 4 and 2 stages); both PP4 and PP2 x DP2 with ZeRO-1 and ZeRO-2.
    {name: (units, cfg, strategies, results)}"""
    root = tmp_path_factory.mktemp("hf-four-ranks")
    jobs = []
    for name in PLAN_FAMILIES:
        (root / name).mkdir()
        units, cfg = _setup(name, root / name)
        zero = [_strategy(units, 4, 1, z) for z in range(4)] if name == "llama" else []
        jobs.append((name, units, cfg, zero + [_strategy(units, 1, 4, m=4), _strategy(units, 2, 2, 1, m=2),
                                               _strategy(units, 2, 2, 2, m=2)]))
    results = run_shared(4, [(name, cfg, strategies, None) for name, _, cfg, strategies in jobs])
    return {name: (units, cfg, strategies, results[name]) for name, units, cfg, strategies in jobs}


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAN_FAMILIES)
def test_hf_model_trains_like_itself_on_4_ranks(name, four_rank_runs):
    units, cfg, strategies, results = four_rank_runs[name]
    _check(strategies, results, single_process_losses(_strategy(units, 1, 1), cfg), _own_step0_loss(cfg))


@pytest.mark.slow
def test_the_hf_example_trains_under_torchrun():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(root / "examples/train_hf_with_plan.py"), "--steps", "3"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in proc.stdout.splitlines() if "loss" in line]
    # a 512-token vocabulary from its own init (N(0, 0.02)): about ln(512) = 6.24 at the start
    assert len(losses) == 3 and all(5.5 < x < 7.0 for x in losses)


@pytest.mark.slow
def test_export_after_a_pipelined_run_loads_with_from_pretrained_and_continues_its_training(tmp_path):
    """GPT-2 trained 3 steps as PP2 1F1B (its tied head on the other rank), checkpointed, exported with
    `planner export --hf`: from_pretrained on the folder gives, on step 3's batch, the loss the one-process
    training of the same model has at step 3 (its parameters after 3 steps)."""
    from typer.testing import CliRunner

    from cli import app
    from executor.launch import RunConfig, launch
    from tests.plans import plan_for
    units, cfg = _setup("gpt2", tmp_path)
    prof = profile_model(resolve(MODELS["gpt2"]), micro_batch_size=2, seq_len=SEQ, meta=True)
    run = launch(plan_for(_strategy(units, 1, 2, m=4), prof),
                 RunConfig(steps=3, warmup=0, seed=cfg.seed, lr=cfg.lr, init_from=cfg.init_from,
                           checkpoint_dir=str(tmp_path / "ck")))
    assert run.checkpoints == (str(tmp_path / "ck" / "step-00000003"),)
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ck"), "--hf", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="sdpa")
    x, y = batch_source(cfg, torch.zeros(1, SEQ, dtype=torch.long), (1, SEQ, 128), GLOBAL, "cross_entropy")(3)
    with torch.no_grad():
        exported = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
    continued = single_process_losses(_strategy(units, 1, 1), TrainConfig(**{**cfg.to_dict(), "steps": 4}))
    assert exported == pytest.approx(continued[3], rel=1e-5)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()   # still tied
