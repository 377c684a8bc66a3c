"""`tiny-llama`: a deterministic random 4-layer Llama and a locally trained tokenizer.

For fast unit tests. Untied embeddings and a wide init range keep greedy output varied
(small random models otherwise repeat one token, and equality tests would prove nothing).
Built from a fixed seed and a fixed corpus, so every machine builds the same bytes for a
given torch/transformers/tokenizers version.
"""

from __future__ import annotations

import random
from pathlib import Path

SOURCE = "built locally (seed 0)"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (  # noqa: SIM905 (a sentence reads better than 45 quoted words)
    "prefill decode region cache token layer stream link price tenant job queue shipment "
    "gpu cheap scarce fast slow wire byte chunk ack retry deadline ticket model the a of to "
    "and in is on for with as by at from"
).split()


def _corpus(num_lines: int = 4000) -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"]) + f" {rng.randint(0, 999)}")
    return lines


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # float32
    model.save_pretrained(out, safe_serialization=True)
