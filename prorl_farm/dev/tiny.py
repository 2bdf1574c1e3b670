"""Build a tiny causal LM and tokenizer offline, for development and tests without a GPU.

The tokenizer is a byte-level BPE trained on local text (Python's standard library
sources), wrapped with a ChatML chat template; the model is a randomly initialised Qwen2
(hidden 64, 2 layers). Nothing is downloaded. Needs ``torch`` and ``transformers``.
"""

from __future__ import annotations

import json
import logging
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus(max_bytes: int) -> list[str]:
    """Local text: the standard library's own sources, up to ``max_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def build_tokenizer(out_dir: Path, vocab_size: int = 2000, corpus_bytes: int = 2_000_000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(corpus_bytes), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    # transformers 5 records its own backend class name, which 4.x (as inference servers may
    # pin) cannot load; the generic fast class loads in both.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHATML_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return fast


def build_tiny_model(out_dir: str | Path, seed: int = 0, vocab_size: int = 2000,
                     hidden_size: int = 64, layers: int = 2) -> Path:
    """Write a tokenizer and a random Qwen2 model to ``out_dir``; returns the directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(out))
    log.info("tiny model written to %s (%d tokens in vocabulary)", out, len(tok))
    return out
