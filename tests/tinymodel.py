"""A tiny random Llama with a locally trained byte-level BPE tokenizer, for fast tests.

Builds in about a second; nothing is downloaded. Its text is noise, but every code path that a
real model takes (chat template, batching, KV cache, logprobs, save/load) is exercised.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Yes. No. yes no YES NO Yes No",
    "What is 2 + 2? The answer is 4. What is 7 * 6? It is 42.",
    "Write a haiku about the sea. Answer in one word. List three colours: red, green, blue.",
    "Does the response state the final answer? Does it follow the requested format?",
    '{"items": [{"id": "a", "text": "States the answer", "weight": 3, "polarity": 1}]}',
    "0123456789 + - * / = ( ) [ ] { } : ; , . ! ? ' \"",
]


def build_tiny_model(path: Path, seed: int = 0, hidden: int = 256, layers: int = 4) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
