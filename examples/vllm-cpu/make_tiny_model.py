"""Make a tiny random-weight Llama model with its own tokenizer, for running the real vLLM CPU
engine without a model hub (see ../../shared/reference/VLLM_CPU.md).

    python make_tiny_model.py OUT_DIR

Runs in vLLM's venv (needs ``tokenizers``, ``transformers``, ``torch``). A few seconds, ~1.7 MB.
The weights are random: the text it generates is noise, but the engine's prefix cache, block
pool and KV events behave exactly as with a real model.
"""

from __future__ import annotations

import json
import sys
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


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    (out / "kvmiss-tiny-model.json").write_text(json.dumps({"vocab": VOCAB, "random_weights": True}))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    make(Path(sys.argv[1]))
    print(sys.argv[1])
