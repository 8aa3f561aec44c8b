"""Tiny configurations of transformers causal-LM families (an `hf:` reference each) for the tests that train them:
4 layers, width 64, a 128-token vocabulary, dropout off (with it on, no two layouts draw the same masks), and each
family's own features switched on where the defaults would hide them at this size (sliding windows shorter than
the tests' 16-token windows, Granite's multipliers, Gemma 2's soft-capping)."""
_DENSE = ("num_hidden_layers=4&hidden_size=64&intermediate_size=128&num_attention_heads=4&num_key_value_heads=2"
          "&vocab_size=128&max_position_embeddings=64")

FAMILIES_TINY = {
    "llama": f"hf:llama?{_DENSE}",
    "mistral": f"hf:mistral?{_DENSE}&sliding_window=8",
    "qwen2": f"hf:qwen2?{_DENSE}",
    "qwen3": f"hf:qwen3?{_DENSE}&head_dim=16",
    "phi": f"hf:phi?{_DENSE}",
    "phi3": f"hf:phi3?{_DENSE}&pad_token_id=0",
    "gemma": f"hf:gemma?{_DENSE}&head_dim=16",
    "gemma2": f"hf:gemma2?{_DENSE}&head_dim=16&sliding_window=8&attn_implementation=eager",
    "gemma3": (f"hf:gemma3_text?{_DENSE}&head_dim=16&sliding_window=8"
               '&layer_types=["sliding_attention","full_attention","sliding_attention","full_attention"]'),
    "olmo2": f"hf:olmo2?{_DENSE}",
    "granite": f"hf:granite?{_DENSE}&embedding_multiplier=3.0&logits_scaling=2.0&residual_multiplier=0.5",
    "gpt_neox": ("hf:gpt_neox?num_hidden_layers=4&hidden_size=64&intermediate_size=128&num_attention_heads=4"
                 "&vocab_size=128&max_position_embeddings=64"),
    "opt": ("hf:opt?num_hidden_layers=4&hidden_size=64&ffn_dim=128&num_attention_heads=4&vocab_size=128"
            "&max_position_embeddings=64&word_embed_proj_dim=64&dropout=0&attention_dropout=0"),
    "gpt2": ("hf:gpt2?n_layer=4&n_embd=64&n_head=4&vocab_size=128&n_positions=64&resid_pdrop=0&embd_pdrop=0"
             "&attn_pdrop=0"),
}
