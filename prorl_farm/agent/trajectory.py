"""Token-in/token-out trajectories.

The prompt is rendered with the model's chat template once. After that, the context only
grows: the IDs the backend sampled are appended exactly as they came back, then the tokens
of new messages (tool observations, user turns) and the template's glue between turns.
Nothing already in context is ever re-tokenised, so the trajectory holds exactly the IDs
the policy saw and sampled, and the logprobs the backend returned for them.

The glue for new messages is found by rendering a small probe conversation whose assistant
turn is a placeholder, with and without the new messages, and taking the text the template
puts after the placeholder; that works for any chat template, not one model family.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field

from prorl_farm.errors import TokenMismatch

PLACEHOLDER = "\u2063PRORL\u2063PLACEHOLDER\u2063"
PROBE_HISTORY = [{"role": "user", "content": "x"}]
# Texts on which the tokenizers backend, called directly, must agree with the tokenizer's
# own encode before the loop takes the shorter path (special tokens, spaces, newlines, code,
# non-Latin text).
ENCODE_PROBES = ["", " ", "\n\n", "  leading and trailing  ", "x = [1, 2]\nprint(x)\n",
                 "<tool_response>\nhi\n</tool_response>", "caf\u00e9 \u65e5\u672c \U0001f600",
                 "\t\ttabs\r\nand CRLF"]


class ChatTokens:
    """A tokenizer's chat template, seen as token deltas."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._mid_system: bool | None = None
        self._backend = self._direct_backend(tokenizer)
        ended = self._render(PROBE_HISTORY + [{"role": "assistant", "content": PLACEHOLDER}])
        if PLACEHOLDER not in ended:
            raise ValueError("the chat template drops assistant content; cannot find turn glue")
        # What the template writes after an assistant message when it is the last one.
        self.assistant_end = ended[ended.index(PLACEHOLDER) + len(PLACEHOLDER):]

    def _render(self, messages, add_generation_prompt=False, tools=None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    def accepts_mid_system(self) -> bool:
        """Whether the template renders a system message after the conversation began (Qwen
        templates raise on one; some drop it silently)."""
        if self._mid_system is None:  # probed once per tokenizer, not once per job
            marker = "\u2063mid-system\u2063"
            try:
                text = self._render([{"role": "user", "content": "a"},
                                     {"role": "system", "content": marker},
                                     {"role": "user", "content": "b"}],
                                    add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - jinja's raise_exception, any template error
                text = ""
            self._mid_system = marker in text
        return self._mid_system

    def encode_text(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tok.encode(text, add_special_tokens=False))

    def _direct_backend(self, tokenizer):
        """The ``tokenizers`` object behind a fast tokenizer, when calling it directly gives
        the same IDs as ``tokenizer.encode`` (checked here on probe texts and on the text
        around every special token); else None. It skips the per-call argument handling of
        transformers, a third of a turn's glue time."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "encode") or \
                getattr(tokenizer, "split_special_tokens", False):
            return None
        specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])][:32]
        probes = ENCODE_PROBES + [f"a{t}b {t}\n" for t in specials]
        try:
            for text in probes:
                if backend.encode(text, add_special_tokens=False).ids != \
                        list(tokenizer.encode(text, add_special_tokens=False)):
                    return None
        except Exception:  # noqa: BLE001 - any doubt: the tokenizer's own path
            return None
        return backend

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The initial prompt with the generation prompt, rendered once."""
        ids = self.tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
        return list(ids)

    def continuation_ids(self, new_messages: list[dict], sampled: list[int],
                         finish_reason: str) -> list[int]:
        """Tokens that follow an assistant turn ending in ``sampled``: the rest of the
        assistant turn's closing glue, the new messages, and the next generation prompt."""
        probe = PROBE_HISTORY + [{"role": "assistant", "content": PLACEHOLDER}]
        full = self._render(probe + new_messages, add_generation_prompt=True)
        after = full[full.index(PLACEHOLDER) + len(PLACEHOLDER):]
        if sampled and finish_reason == "stop":
            # The model stopped on the template's end-of-turn marker (one special token or
            # several plain ones): it sampled that part of the glue already, so drop it.
            tail = self.tok.decode(sampled[-16:], skip_special_tokens=False)
            for k in range(min(len(self.assistant_end), len(after), len(tail)), 0, -1):
                if tail.endswith(after[:k]):
                    after = after[k:]
                    break
        return self.encode_text(after)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


_tokenizers: dict[str, ChatTokens] = {}
_tokenizers_lock = threading.Lock()


def load_chat_tokens(path: str) -> ChatTokens:
    """Load a tokenizer from a local path (never a hub), once per process.

    Under a lock: transformers' lazy imports are not safe to race from many pool threads.
    What is alive once it is loaded (transformers, torch, the tokenizer: millions of objects
    that live as long as the process) is moved out of the garbage collector's sight
    (``gc.freeze``): else each full collection walks all of it again, a pause of a tenth of
    a second or more for every thread of the process (every gateway call in flight).
    """
    with _tokenizers_lock:
        if path not in _tokenizers:
            from transformers import AutoTokenizer

            _tokenizers[path] = ChatTokens(AutoTokenizer.from_pretrained(path,
                                                                         local_files_only=True))
            gc.freeze()
        return _tokenizers[path]


@dataclass
class Trajectory:
    """The trajectory fields of DESIGN.md, built turn by turn."""

    chat: ChatTokens
    prompt_ids: list[int]
    messages: list[dict]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)

    @classmethod
    def start(cls, chat: ChatTokens, messages: list[dict], tools: list[dict] | None = None
              ) -> Trajectory:
        return cls(chat, chat.prompt_ids(messages, tools), [dict(m) for m in messages])

    def context(self) -> list[int]:
        """The token prompt for the next turn: prompt_ids + response_ids."""
        return self.prompt_ids + self.response_ids

    def add_generation(self, sent: list[int], token_ids: list[int], logprobs: list[float],
                       finish_reason: str, backend: str, policy_version: int,
                       logprobs_mode: str, versions: list[tuple[int, int]] | None = None
                       ) -> None:
        """Append what the backend sampled for prompt ``sent``, exactly as returned.
        ``versions``: (first token, policy version) at each change within the turn (a turn
        that went on across a weight update); default: all of it ``policy_version``."""
        offset = len(self.response_ids)
        if sent != self.prompt_ids + self.response_ids[:offset]:
            raise TokenMismatch(f"turn {len(self.turns)}: the prompt sent is not "
                                f"prompt_ids + response_ids[:{offset}]")
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
        versions = [(int(i), int(v)) for i, v in (versions or [(0, policy_version)])]
        self.response_ids += token_ids
        self.response_mask += [1] * len(token_ids)
        self.response_logprobs += [float(x) for x in logprobs]
        turn = {"offset": offset, "prompt_len": len(sent), "generated": len(token_ids),
                "finish_reason": finish_reason, "backend": backend,
                "policy_version": min(v for _, v in versions),
                "logprobs_mode": logprobs_mode, "prefix_checked": True}
        if len(versions) > 1:  # the turn went on under newer weights from these tokens on
            turn["versions"] = [[i, v] for i, v in versions]
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": self.chat.decode(token_ids)})

    def add_turn(self, sent: list[int], turn) -> None:
        """Append a backend session's turn (llm.session.Turn) sampled for ``sent``."""
        g, b = turn.generation, turn.backend
        self.add_generation(sent, g.token_ids, g.logprobs, g.finish_reason, b.id,
                            b.policy_version, b.logprobs_mode, turn.versions)

    def add_messages(self, new_messages: list[dict], limit: int | None = None) -> bool:
        """Append observations (tool results, user turns) and the next generation prompt.

        With ``limit`` (the model's context length), nothing is appended and False comes
        back when the context would then leave no room to generate."""
        last = self.turns[-1] if self.turns else None
        sampled = self.response_ids[last["offset"]:] if last else []
        ids = self.chat.continuation_ids(new_messages, sampled,
                                         last["finish_reason"] if last else "stop")
        if limit is not None and len(self.prompt_ids) + len(self.response_ids) + len(ids) \
                >= limit:
            return False
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.response_logprobs += [0.0] * len(ids)
        self.messages += [dict(m) for m in new_messages]
        return True

    def version_boundaries(self) -> list[list[int]]:
        """[response index, policy version] where the version of the sampled tokens changes
        (the first sampled token's included): every sampled token's version, compactly."""
        out: list[list[int]] = []
        for t in self.turns:
            for i, v in t.get("versions") or [[0, t["policy_version"]]]:
                if not out or out[-1][1] != v:
                    out.append([t["offset"] + i, v])
        return out

    def to_dict(self) -> dict:
        bounds = self.version_boundaries()
        versions = [v for _, v in bounds]
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                "response_mask": self.response_mask,
                "response_logprobs": self.response_logprobs, "turns": self.turns,
                "messages": self.messages,
                # The oldest policy any of its tokens came from (what staleness is about).
                "policy_version": min(versions, default=None),
                "min_version": min(versions, default=None),
                "max_version": max(versions, default=None),
                "version_boundaries": bounds}
