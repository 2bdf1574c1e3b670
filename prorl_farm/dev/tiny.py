"""Build a tiny causal LM and tokenizer offline, for development and tests without a GPU.

The tokenizer is a byte-level BPE trained on local text (Python's standard library
sources), wrapped with a ChatML chat template; the model is a randomly initialised Qwen2
(hidden 128, 4 heads of 32, 2 layers, output layer untied from the embeddings), which real
inference engines serve: vLLM's CPU attention needs heads of 32 or more, and vLLM reloads an
untied model's weights exactly. ``small=True`` gives hidden 64 (heads of 16) where speed
matters and only the farm's own server serves it. Nothing is downloaded. Needs ``torch`` and
``transformers``.
"""

from __future__ import annotations

import json
import logging
import sysconfig
from pathlib import Path

log = logging.getLogger(__name__)

# ChatML, with tools the way Qwen2.5 offers them: their JSON schemas in the system turn, calls
# as <tool_call> JSON (the hermes format), results as <tool_response> blocks in a user turn.
# Without tools and tool messages it renders exactly plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, in <tools></tools>:"
    "\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and "
    "arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
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

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(corpus_bytes), trainer=trainer)
    return _save_chatml(tok, out_dir)


def _save_chatml(tok, out_dir: Path):
    """Wrap a ``tokenizers`` tokenizer with ChatML's special tokens and template; save it."""
    from transformers import PreTrainedTokenizerFast

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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies use."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# The characters of ChatML's role names and of the arith task: a vocabulary of about 45.
CHAR_ALPHABET = "0123456789+-=?\n abcdefghijklmnopqrstuvwxyz"


def build_char_tokenizer(out_dir: Path):
    """A character-level tokenizer (one token per character, ChatML's special tokens kept
    whole): small enough that a tiny model learns the arith task in a minute. Byte-level
    BPE with no merges, so that it loads the same as a Qwen2 tokenizer (which transformers
    may rebuild from the vocabulary for a Qwen2 model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_char = _bytes_to_unicode()
    tokens = [*SPECIAL_TOKENS, *(byte_char[b] for b in CHAR_ALPHABET.encode())]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return _save_chatml(tok, out_dir)


def build_tiny_model(out_dir: str | Path, seed: int = 0, vocab_size: int = 2000,
                     hidden_size: int | None = None, layers: int = 2, chars: bool = False,
                     small: bool = False, tie_embeddings: bool = False,
                     max_positions: int = 8192) -> Path:
    """Write a tokenizer and a random Qwen2 model to ``out_dir``; returns the directory.
    ``chars``: the character-level tokenizer (the arith RL loop) instead of the BPE one.
    ``hidden_size``: 128 (4 heads of 32), or 64 with ``small`` (heads of 16: too small for
    vLLM's CPU attention). ``tie_embeddings``: share the output layer with the embeddings,
    as small Qwen models do. ``max_positions``: the context it may be served with (a harness
    such as Claude Code needs 64k)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size is None:
        hidden_size = 64 if small else 128
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(out) if chars else build_tokenizer(out, vocab_size=vocab_size)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_embeddings,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(out))
    log.info("tiny model written to %s (%d tokens in vocabulary)", out, len(tok))
    return out
