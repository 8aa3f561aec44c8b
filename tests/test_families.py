"""The model-family registry (cost_models/models/families.py) names pieces that live elsewhere by string: every
name an entry gives must resolve, so that adding a family is one entry plus the pieces it names."""
import pytest
import torch

from cost_models.models.families import FAMILIES, HF_MODEL_TYPES, family_of, hf_family
from cost_models.models.source import resolve
from cost_models.records.tensor_parallel import PLANS


def test_every_family_names_a_tp_plan_and_every_plan_has_a_family():
    assert sorted(f.name for f in FAMILIES) == sorted(PLANS)


def test_a_model_type_belongs_to_one_tp_family():
    assert len(HF_MODEL_TYPES) == len(set(HF_MODEL_TYPES))
    assert hf_family("qwen2").name == "hf-llama" and hf_family("gpt2").name == "hf-gpt2" and hf_family("t5") is None


@pytest.mark.parametrize("ref,family", [("gpt-tiny", "zoo-gpt"), ("llama-tiny", "zoo-llama"), ("mlp-deep", None),
                                        ("hf:qwen2?num_hidden_layers=1&hidden_size=64&num_attention_heads=4"
                                         "&num_key_value_heads=2&intermediate_size=128&vocab_size=128", "hf-llama"),
                                        ("moe-tiny", "zoo-moe"),
                                        ("hf:mixtral?num_hidden_layers=1&hidden_size=64&num_attention_heads=4"
                                         "&num_key_value_heads=2&intermediate_size=128&vocab_size=128"
                                         "&num_local_experts=4", "hf-moe")])
def test_a_model_is_recognised_by_its_family(ref, family):
    model = resolve(ref).build(device="meta", dtype=torch.float32)
    found = family_of(model)
    assert (found.name if found else None) == family
