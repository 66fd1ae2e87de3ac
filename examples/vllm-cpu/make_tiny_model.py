"""Make a tiny random-weight model with its own tokenizer, for running the real vLLM CPU
engine without a model hub (see ../../shared/reference/VLLM_CPU.md).

    python make_tiny_model.py OUT_DIR [--arch llama|gemma3|granite-hybrid|qwen3-next]

Runs in vLLM's venv (needs ``tokenizers``, ``transformers``, ``torch``). A few seconds, ~2 MB.
The weights are random: the text it generates is noise, but the engine's prefix cache, block
pool and KV events behave exactly as with a real model.

* ``llama``: two full-attention layers (one KV-cache group).
* ``gemma3``: a Gemma-3-style hybrid text model: one ``sliding_attention`` layer (window 64)
  and one ``full_attention`` layer, so vLLM keeps two KV-cache groups.
* ``granite-hybrid`` / ``qwen3-next``: a Mamba-2 layer / a gated-delta-net linear-attention
  layer beside one full-attention layer (a Granite-4- / Qwen3-Next-style hybrid).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 512
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefix cache keeps the key and value tensors of prompt blocks for reuse.",
    "Requests that share a system prompt share its cached blocks.",
    "When the block pool is full, the least recently used free block is evicted.",
    "kvmiss labels every request with the reason it missed the prefix cache.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ ,.;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


SLIDING_WINDOW = 64
ARCHS = ("llama", "gemma3", "granite-hybrid", "qwen3-next")


def make(out: Path, arch: str = "llama") -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model_for(arch, ids).save_pretrained(out)
    (out / "kvmiss-tiny-model.json").write_text(json.dumps({"vocab": VOCAB, "random_weights": True, "arch": arch}))


def model_for(arch: str, ids: dict):
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, **ids)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common))
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(Gemma3TextConfig(
            **common, head_dim=32, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"]))
    if arch == "granite-hybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            **common, layer_types=["mamba", "attention"], num_local_experts=0, shared_intermediate_size=256,
            mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, position_embedding_type="rope"))
    if arch == "qwen3-next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        # Wide attention heads: vLLM sizes the attention block so that its page holds at least
        # one layer's recurrent state; with 32-wide heads that was 544 tokens, more than the
        # prompts, and no block was ever cached.
        return Qwen3NextForCausalLM(Qwen3NextConfig(
            **{**common, "num_key_value_heads": 4}, head_dim=128, layer_types=["linear_attention", "full_attention"],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            decoder_sparse_step=1, mlp_only_layers=[],  # vLLM's Qwen3-Next needs its MoE layers
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, full_attention_interval=2))
    raise ValueError(f"unknown arch {arch!r}: one of {', '.join(ARCHS)}")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    args = parser.parse_args()
    make(args.out, args.arch)
    print(args.out)
