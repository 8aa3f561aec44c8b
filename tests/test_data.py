"""`planner run --data FILE`: the token file's order, its refusals, and training on it for real."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError
from executor.data import TokenFile
from executor.launch import run_many
from executor.train import TrainConfig, single_process_losses
from tests.plans import plan_file
from tests.test_checkpoint import token_file as _bin
from tests.test_executor import S

ROOT = Path(__file__).resolve().parents[1]
SEQ = 16
VOCAB = 512   # gpt-tiny's


def test_windows_steps_and_the_wrap_are_the_documented_order(tmp_path):
    tokens = (np.arange(10 * 5 + 3) * 7) % 1000          # 10 windows of s+1 = 5 tokens, 3 left over
    data = TokenFile(_bin(tmp_path / "t.bin", tokens), seq_len=4)
    assert data.windows == 10
    x, y = data.batch(step=3, global_batch=4)            # windows 12..15 -> 2, 3, 4, 5
    expected = np.stack([tokens[i * 5:(i + 1) * 5] for i in (2, 3, 4, 5)])
    assert x.dtype == torch.int64 and x.shape == (4, 4)
    assert x.tolist() == expected[:, :-1].tolist() and y.tolist() == expected[:, 1:].tolist()
    npy = tmp_path / "t.npy"
    np.save(npy, tokens.astype(np.int32))
    assert TokenFile(npy, seq_len=4).batch(3, 4)[0].tolist() == x.tolist()   # .npy reads the same tokens


@pytest.mark.parametrize("make,fragment", [
    (lambda d: _bin(d / "short.bin", range(4)), "4 tokens, shorter than one window of seq_len + 1 = 5"),
    (lambda d: (d / "odd.bin").write_bytes(b"\x01\x00\x02"), "not a whole number of uint16 tokens"),
    (lambda d: np.save(d / "f.npy", np.zeros(20, dtype=np.float32)), "a 1-d float32 array"),
    (lambda d: np.save(d / "m.npy", np.zeros((4, 5), dtype=np.int64)), "a 2-d int64 array"),
    (lambda d: (d / "t.txt").write_text("1 2 3"), "unknown format '.txt'"),
])
def test_a_bad_token_file_is_one_config_error(tmp_path, make, fragment):
    make(tmp_path)
    path = next(p for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TokenFile(path, seq_len=4)


@pytest.fixture(scope="module")
def profile():
    return profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=SEQ, meta=True, dtype="fp32")


def test_planner_run_refuses_a_token_outside_the_vocabulary_before_any_rank_starts(tmp_path, profile):
    plan = plan_file(tmp_path, S(2, 1, 1), profile)
    tokens = np.arange(200) % VOCAB
    tokens[123] = VOCAB                                    # one id past the embedding
    res = CliRunner().invoke(app, ["run", str(plan), "--data", str(_bin(tmp_path / "t.bin", tokens)), "-o", "-"])
    assert res.exit_code == 2
    assert res.stderr.strip() == (f"error: --data {tmp_path / 't.bin'}: token 123 is 512, outside the model's "
                                  f"vocabulary 0..511; tokenize with the model's tokenizer")
    missing = CliRunner().invoke(app, ["run", str(plan), "--data", str(tmp_path / "none.bin"), "-o", "-"])
    assert missing.exit_code == 2 and missing.stderr.strip() == f"error: --data {tmp_path / 'none.bin'}: no such file"


@pytest.mark.slow
def test_training_on_a_token_file_equals_one_process_on_the_same_windows(tmp_path):
    rng = np.random.default_rng(0)
    path = _bin(tmp_path / "tokens.bin", rng.integers(0, VOCAB, size=40 * (SEQ + 1) + 5))   # wraps after 5 steps
    cfg = TrainConfig(model_source="gpt-tiny", seq_len=SEQ, input_kind="tokens", steps=6, warmup=1, seed=3, lr=1e-2,
                      data=str(path))
    strategies = [S(2, 1, 1), S(1, 2, m=4)]
    reference = single_process_losses(strategies[0], cfg)
    synthetic = single_process_losses(strategies[0], TrainConfig(**{**cfg.to_dict(), "data": None}))
    assert all(abs(a - b) > 1e-3 for a, b in zip(reference, synthetic))   # the file's windows, not random tokens
    for s, ranks in zip(strategies, run_many(2, strategies, cfg)):
        for r in ranks:
            assert list(r.losses) == pytest.approx(reference, rel=1e-4), (s.name, r.rank)
