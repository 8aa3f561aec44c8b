"""benchmarks/published_runs.py converts a prediction into each source's unit with the source's FLOPs formula:
checked against the estimate's own MFU, which counts model FLOPs as PaLM does (the same terms as Megatron-LM's)."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from published_runs import ROWS, flops_per_token, predict  # noqa: E402

H100_BF16_PEAK = 989e12   # dense bf16, H100 SXM5 datasheet (the dgx-h100 preset's figure)


def _row(id_: str):
    return next(r for r in ROWS if r.id == id_)


def test_the_sources_formulas_per_token():
    n1, h1 = _row("N1"), _row("H1")
    # Narayanan et al. 2021 eq. 3 for l 24, h 2304, s 2048, V 51200: 96 l h^2 (1 + s/6h + V/16lh)
    assert flops_per_token(n1) == pytest.approx(96 * 24 * 2304**2 * (1 + 2048 / 13824 + 51200 / 884736))
    # Megatron-LM's for l 24, h 2048, s 4096, V 131072: 72 l h^2 + 12 l h s + 6 V h (PaLM's 6N + 12LHQT, head in N)
    assert flops_per_token(h1) == pytest.approx(72 * 24 * 2048**2 + 12 * 24 * 2048 * 4096 + 6 * 131072 * 2048)


def test_a_megatron_row_in_tflops_is_the_estimates_mfu_times_the_peak():
    """Megatron-LM's FLOPs formula and the estimate's MFU count the same model FLOPs (less the norms' and biases'
    parameters, and the learned positions, which the formula leaves out): the two agree within 2%."""
    row = replace(_row("H1"), microbatches=1)   # one micro-batch: the same step per token, a faster test
    result = predict(row, {})
    assert result["fits"] and result["mfu"] is not None
    assert result["predicted"] * 1e12 == pytest.approx(result["mfu"] * H100_BF16_PEAK, rel=0.02)
