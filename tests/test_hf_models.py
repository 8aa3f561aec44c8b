"""hf: references build transformers models from configs alone (skipped where the hf extra is not installed)."""
import pytest
import torch

pytest.importorskip("transformers")

from cost_models.models.source import resolve  # noqa: E402
from cost_models.profiling.model_profiler import profile_model  # noqa: E402

GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=1000&n_positions=64"
LLAMA = ("hf:llama?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&num_key_value_heads=2"
         "&intermediate_size=128&vocab_size=1000&max_position_embeddings=64")


def test_hf_gpt2_units_params_and_tied_head():
    src = resolve(GPT2)
    prof = profile_model(src, micro_batch_size=2, seq_len=16, meta=True)
    assert [u.name for u in prof.units] == ["embed", "transformer.h.0", "transformer.h.1", "head"]
    assert prof.unit("embed").modules == ("transformer.wte", "transformer.wpe", "transformer.drop")
    assert prof.unit("head").modules == ("transformer.ln_f", "lm_head")
    import torch
    model = src.build(device="meta", dtype=torch.float32)
    assert prof.total_params == model.num_parameters()
    assert [s.name for s in prof.shared] == ["transformer.wte.weight"]


def test_hf_llama_meta_equals_real():
    src = resolve(LLAMA)
    real = profile_model(src, micro_batch_size=2, seq_len=16, repeats=1, warmup=0)
    meta = profile_model(src, micro_batch_size=2, seq_len=16, meta=True)
    assert [u.name for u in real.units] == ["embed", "model.layers.0", "model.layers.1", "head"]
    # transformers computes the rotary tables once, before the layers: that module joins the embedding unit.
    assert real.unit("embed").modules == ("model.embed_tokens", "model.rotary_emb")
    for r, m in zip(real.units, meta.units):
        assert (r.fwd_flops, r.bwd_flops, r.saved_bytes, r.output_bytes) == (m.fwd_flops, m.bwd_flops, m.saved_bytes, m.output_bytes)
    b, s, h, ffn = 2, 16, 64, 128
    # q,k,v,o projections (kv heads 2 of 4: k and v are h/2 wide) + SwiGLU + attention
    expected = 2 * b * s * (h * h + 2 * h * h // 2 + h * h + 3 * h * ffn) + 4 * b * s * s * h
    assert real.unit("model.layers.0").fwd_flops == expected


def test_hf_errors_are_one_line():
    from cost_models.records.errors import ModelSourceError
    with pytest.raises(ModelSourceError, match="key=value"):
        resolve("hf:gpt2?n_layer")
    with pytest.raises(ModelSourceError, match="transformers cannot make a config"):
        resolve("hf:not-a-model-type")


@pytest.mark.parametrize("key", ["trust_remote_code", "revision", "cache_dir", "_commit_hash"])
def test_hf_overrides_are_config_fields_never_loading_options(tmp_path, key):
    """A folder whose config names code to run (auto_map) with ?trust_remote_code=true: refused in one line before
    transformers sees it, and the folder's code never runs (it would leave a marker file)."""
    import json

    from cost_models.records.errors import ModelSourceError
    marker = tmp_path / "ran"
    (tmp_path / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                                            "AutoModelForCausalLM": "modeling_evil.EvilModel"}}))
    with pytest.raises(ModelSourceError) as err:
        resolve(f"hf:{tmp_path}?{key}=true")
    assert str(err.value) == (f"hf override '{key}' is a loading option, not a config field; hf: models are built "
                              "from their config alone and never run code from a folder")
    assert not marker.exists()


@pytest.mark.parametrize("meta", [True, False])
def test_grouped_query_attention_counts_the_same_where_torch_cannot_count_it(monkeypatch, meta):
    """torch 2.11's SDPA FLOP formula refuses K/V with fewer heads than the query (HF Llama, Mistral and Qwen2 failed
    to profile on a GPU machine with torch 2.11); there the profiler repeats K/V to the query's heads. Forced on
    here, with a torch that counts GQA natively: the same FLOPs per unit."""
    import torch.nn.functional as F

    import cost_models.profiling.flops as mp
    src = resolve(LLAMA)
    native = profile_model(src, micro_batch_size=2, seq_len=16, meta=meta, repeats=1, warmup=0)
    monkeypatch.setattr(mp, "COUNTS_GQA", False)
    grouped = []   # SDPA calls the model made with fewer K/V heads than query heads: what gets repeated
    forward = mp._ExpandGQA.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and args[1].shape[-3] < args[0].shape[-3]:
            grouped.append(args[1].shape[-3])
        return forward(self, func, types, args, kwargs)
    monkeypatch.setattr(mp._ExpandGQA, "__torch_function__", spy)
    expanded = profile_model(src, micro_batch_size=2, seq_len=16, meta=meta, repeats=1, warmup=0)
    assert grouped and set(grouped) == {2}      # 2 key/value heads for 4 query heads
    assert native.model_fwd_flops == expanded.model_fwd_flops > 0
    for a, b in zip(native.units, expanded.units):
        assert (a.fwd_flops, a.bwd_flops) == (b.fwd_flops, b.bwd_flops), a.name
    assert native.attention_kernels == expanded.attention_kernels and native.attention_kernels


def test_encoders_and_seq2seq_models_are_refused_in_one_line_unless_configured_as_decoders():
    """transformers builds BERT's causal-LM class from a plain BertConfig without a causal mask: trained on
    next-token targets every position would see what it predicts. Refused at resolve time, before any work; with
    is_decoder=true it is a causal decoder and resolves. An encoder-decoder (T5) is refused too."""
    from cost_models.records.errors import ModelSourceError
    bert = "hf:bert?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&intermediate_size=128&vocab_size=128"
    with pytest.raises(ModelSourceError, match=r"bert is an encoder \(a masked LM\).*\?is_decoder=true"):
        resolve(bert)
    with pytest.raises(ModelSourceError, match=r"xlnet is an encoder"):   # a causal-LM class that sees both ways
        resolve("hf:xlnet?n_layer=2&d_model=64&n_head=4&d_inner=128&vocab_size=128")
    with pytest.raises(ModelSourceError, match=r"t5 is an encoder-decoder \(seq2seq\) model"):
        resolve("hf:t5?num_layers=2&d_model=64")
    model = resolve(bert + "&is_decoder=true").build(device="meta", dtype=torch.float32)
    assert model.config.is_decoder and type(model).__name__ == "BertLMHeadModel"


def test_attention_implementations_are_transformers_own_only():
    """`?attn_implementation=` picks one of transformers' built-in kernels (eager for soft-capped Gemma 2); a kernel
    repository name, which transformers would fetch and run, is refused in one line."""
    from cost_models.records.errors import ModelSourceError
    eager = resolve("hf:gemma2?num_hidden_layers=1&hidden_size=64&intermediate_size=128&num_attention_heads=4"
                    "&num_key_value_heads=2&head_dim=16&vocab_size=128&attn_implementation=eager")
    assert eager.build(device="meta", dtype=torch.float32).config._attn_implementation == "eager"
    with pytest.raises(ModelSourceError, match=r"^hf:llama\?attn_implementation=kernels-community/flash-attn2: "
                                               r"attn_implementation=kernels-community/flash-attn2 is not one of sdpa, "
                                               r"eager, flex_attention, flash_attention_2, flash_attention_3"):
        resolve("hf:llama?attn_implementation=kernels-community/flash-attn2")
