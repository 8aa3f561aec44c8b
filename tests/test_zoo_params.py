"""Exact parameter counts of the zoo, taken through the profiler (meta mode) so the unit accounting is checked too."""
import pytest

from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model

# Published counts: GPT-2 (tied head, vocab 50257) and Meta's Llama releases.
EXPECTED = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parameter_count_is_exact(name):
    prof = profile_model(resolve(name), micro_batch_size=1, seq_len=8, meta=True, dtype="bf16")
    assert prof.total_params == EXPECTED[name]
    # Each parameter counted in exactly one unit; none left over in the zoo.
    assert sum(u.params for u in prof.units) == EXPECTED[name]
    assert prof.unassigned_params == 0
    assert prof.total_param_bytes == 2 * EXPECTED[name]


def test_gpt2_units_and_tied_head():
    prof = profile_model(resolve("gpt2-small"), micro_batch_size=1, seq_len=8, meta=True)
    assert [u.name for u in prof.units] == ["embed"] + [f"blocks.{i}" for i in range(12)] + ["head"]
    assert prof.unit("head").shared_params == ("head.lm_head.weight",)
    assert prof.unit("head").params == 2 * 768  # only ln_f: the tied lm_head weight is counted in embed
    assert prof.unit("embed").params == 50257 * 768 + 1024 * 768
    (shared,) = prof.shared
    assert shared.name == "embed.wte.weight" and shared.units == ("embed", "head") and shared.numel == 50257 * 768


def test_llama_head_is_untied():
    prof = profile_model(resolve("llama2-7b"), micro_batch_size=1, seq_len=8, meta=True)
    assert prof.shared == ()
    assert prof.unit("head").params == 32000 * 4096 + 4096
    assert prof.largest_unit == "blocks.0"  # 202M per block vs 131M head
