"""The per-unit numbers of the model profiler against formulas and hand counts."""
import pytest

from cost_models.errors import ConfigError, ModelSourceError, ProfileError
from cost_models.model_profiler import profile_model
from cost_models.models.source import resolve


def test_gpt_block_flops_match_narayanan():
    # Narayanan et al. 2021 (Megatron-LM, appendix): a GPT layer's forward is 24*b*s*h^2 + 4*b*s^2*h FLOPs.
    b, s, h = 2, 256, 768
    prof = profile_model(resolve("gpt2-small"), micro_batch_size=b, seq_len=s, meta=True)
    block = prof.unit("blocks.3")
    expected = 24 * b * s * h**2 + 4 * b * s**2 * h
    assert block.fwd_flops == pytest.approx(expected, rel=0.01)
    assert block.bwd_flops == pytest.approx(2 * block.fwd_flops, rel=0.05)


def test_real_mode_counts_attention_flops(tiny_profiles):
    # Without a formula for the CPU flash kernel FlopCounterMode would count attention as zero.
    prof = tiny_profiles["gpt-tiny", False]
    b, s, h = 2, 16, 64
    assert prof.unit("blocks.0").fwd_flops == 24 * b * s * h**2 + 4 * b * s**2 * h
    assert any("flash_attention" in k for k in prof.attention_kernels)


def test_saved_bytes_equal_hand_count(tiny_profiles):
    # mlp-deep block: x + LayerNorm(x) -> fc1 -> GELU -> fc2, fp32. Saved for backward, by hand:
    #   LayerNorm: its input x (b*s*d) and per-row mean and rstd (2*b*s); fc1: its input, the LN output (b*s*d);
    #   GELU: its input, fc1's output (b*s*H); fc2: its input, GELU's output (b*s*H). Weights are not activations.
    b, s, d, hidden = 2, 16, 64, 256
    expected = 4 * (2 * b * s * d + 2 * b * s + 2 * b * s * hidden)
    for meta in (False, True):
        assert tiny_profiles["mlp-deep", meta].unit("blocks.0").saved_bytes == expected


def test_output_bytes_are_the_boundary_tensor(tiny_profiles):
    prof = tiny_profiles["llama-tiny", False]
    assert prof.unit("embed").output_bytes == 2 * 16 * 64 * 4
    assert prof.unit("blocks.2").output_bytes == 2 * 16 * 64 * 4
    assert prof.unit("head").output_bytes == 2 * 16 * 512 * 4  # logits


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mlp-deep"])
def test_meta_profile_equals_real_profile(tiny_profiles, name):
    real, meta = tiny_profiles[name, False], tiny_profiles[name, True]
    assert [u.name for u in real.units] == [u.name for u in meta.units]
    for r, m in zip(real.units, meta.units):
        assert (r.params, r.fwd_flops, r.bwd_flops, r.output_bytes, r.saved_bytes) == \
               (m.params, m.fwd_flops, m.bwd_flops, m.output_bytes, m.saved_bytes), r.name
    assert real.attention_kernels == meta.attention_kernels
    assert meta.units[1].fwd_time is None


def test_real_mode_timings(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", False]
    for u in prof.units:
        t = u.fwd_time
        assert t is not None and t.repeats == 3
        assert 0 < t.min_s <= t.median_s <= t.max_s
        assert u.bwd_time.median_s > 0


def test_head_includes_the_loss(tiny_profiles):
    # Cross-entropy keeps float log-probabilities (b*s*V*4 bytes) for backward; the head must own them.
    head = tiny_profiles["gpt-tiny", False].unit("head")
    assert head.saved_bytes >= 2 * 16 * 512 * 4


def test_factory_model_outside_the_zoo():
    prof = profile_model(resolve("tests.custom_models:make_model", input_ref="tests.custom_models:make_input"),
                         micro_batch_size=3, seq_len=4, meta=False, repeats=1, warmup=0)
    assert [u.name for u in prof.units] == ["stem", "layers.0", "layers.1", "layers.2", "out"]
    assert prof.total_params == 12 * 24 + 24 + 3 * (24 * 48 + 48) + 24 * 5 + 5
    assert prof.unit("layers.0").fwd_flops == 2 * 3 * 4 * 24 * 48
    assert prof.input.shape == (3, 4, 12) and prof.loss == "mse"


def test_explicit_units():
    prof = profile_model(resolve("tests.custom_models:make_model", input_ref="tests.custom_models:make_input"),
                         micro_batch_size=1, seq_len=2, meta=True, units="stem+layers.0,layers.1,layers.2+out")
    assert [u.modules for u in prof.units] == [("stem", "layers.0"), ("layers.1",), ("layers.2", "out")]
    assert sum(u.params for u in prof.units) == prof.total_params
    with pytest.raises(ConfigError, match="no module 'nope'"):
        profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=2, meta=True, units="embed,nope")


def test_user_errors_are_typed():
    with pytest.raises(ModelSourceError, match="unknown model"):
        resolve("gpt5-huge")
    with pytest.raises(ModelSourceError, match="out of coffee"):
        resolve("tests.custom_models:broken_model").build(device="meta", dtype=__import__("torch").float32)
    with pytest.raises(ModelSourceError, match="not a torch.nn.Module"):
        resolve("tests.custom_models:not_a_model").build(device="meta", dtype=__import__("torch").float32)
    with pytest.raises(ModelSourceError, match="cannot guess the input"):
        profile_model(resolve("tests.custom_models:make_model"), micro_batch_size=1, seq_len=2, meta=True)
    with pytest.raises(ConfigError, match="positive"):
        profile_model(resolve("gpt-tiny"), micro_batch_size=-1, seq_len=2, meta=True)
    with pytest.raises(ModelSourceError, match="up to 128"):
        profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=4096, meta=True)


def test_real_mode_refuses_a_model_too_big_for_this_machine():
    with pytest.raises(ProfileError, match="--meta"):
        profile_model(resolve("llama3-405b"), micro_batch_size=1, seq_len=8)
