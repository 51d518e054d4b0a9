"""Instruction data (data.format: sft): a record as a conversation, rendered with a chat template
into token ids and the mask of the tokens the loss is on (the assistant's).

A record is a conversation, `{"messages": [{"role": ..., "content": ...}, ...]}`, or a pair,
`{"prompt": ..., "completion": ...}` (strings: a user turn and an assistant turn; or lists of
messages). The template renders the whole conversation once; the assistant's spans are found by
rendering its prefixes (the text before each assistant turn with the generation prompt, and the
text through that turn), as Hugging Face's `{% generation %}` marking would mark them: the
assistant's reply and the end-of-turn text the template writes after it (so the model learns to
stop), never the system or user turns nor the template's role headers. Each span is tokenised on
its own, so no token straddles a boundary.
"""

from __future__ import annotations

import numpy as np

from ds_train.errors import UserError

ROLES = ("system", "developer", "user", "assistant", "tool")


def conversation(record: dict, where: str) -> list[dict]:
    """The checked messages of a record; one line naming the record and the field otherwise."""
    if "messages" in record:
        messages = record["messages"]
        field = "messages"
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        messages = [*_turns(prompt, "user", where, "prompt"), *_turns(completion, "assistant", where, "completion")]
        field = "prompt/completion"
    else:
        missing = "completion" if "prompt" in record else "prompt" if "completion" in record else "messages"
        raise UserError(f"{where}: no {missing!r} field (data.format sft reads 'messages', a conversation, "
                        f"or 'prompt' and 'completion'); fix the record or set data.format=text")
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: {field!r} is {_short(messages)}, not a list of messages")
    for j, m in enumerate(messages):
        at = f"{where}: {field}[{j}]"
        if not isinstance(m, dict):
            raise UserError(f"{at} is {_short(m)}, not an object with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in m:
                raise UserError(f"{at} has no {key!r} field")
        if m["role"] not in ROLES:
            raise UserError(f"{at}.role is {_short(m['role'])}, not one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise UserError(f"{at}.content is {_short(m['content'])}, not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant turn (roles: {', '.join(m['role'] for m in messages)}); "
                        f"there is nothing to train on: add the reply or remove the record")
    return messages


def _turns(value, role: str, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise UserError(f"{where}: {field!r} is {_short(value)}, not a string or a list of messages")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Renderer:
    """Renders conversations with `tokenizer`'s chat template, or `template` when given."""

    def __init__(self, tokenizer, template: str = ""):
        self.tok = tokenizer
        self.template = template or getattr(tokenizer, "chat_template", None) or ""
        if not self.template:
            raise UserError("data.chat_template: the tokenizer has no chat template; set data.chat_template "
                            "(a Jinja template, as in tokenizer_config.json) or use a tokenizer that has one")

    def _render(self, messages: list[dict], prompt: bool, where: str) -> str:
        try:
            return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=prompt)
        except Exception as e:  # jinja2's errors, and raise_exception() in templates
            said = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise UserError(f"{where}: the chat template cannot render this conversation ({said}); fix the "
                            f"record or data.chat_template") from None

    def render(self, messages: list[dict], where: str = "the chat template") -> str:
        """A whole conversation as text."""
        return self._render(messages, False, where)

    def render_prompt(self, messages: list[dict], where: str) -> str:
        """The conversation so far and the header of the assistant's turn: what a reply continues."""
        return self._render(messages, True, where)

    def segments(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, is_target) pieces, in order."""
        full = self._render(messages, False, where)
        out, pos = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], True, where) if i else ""
            through = self._render(messages[:i + 1], False, where)
            if not (full.startswith(through) and through.startswith(before) and len(before) >= pos):
                raise UserError(f"{where}: the chat template renders the conversation up to message {i} as "
                                f"other text than the start of the whole, so the assistant's tokens cannot "
                                f"be found; use a template that renders each turn the same whatever follows")
            out += [(full[pos:len(before)], False), (full[len(before):len(through)], True)]
            pos = len(through)
        out.append((full[pos:], False))
        return [(text, target) for text, target in out if text]

    def encode(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and the target mask (1 on the assistant's tokens) of one record."""
        pieces = self.segments(conversation(record, where), where)
        ids = self.tok([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
        tokens = np.fromiter((t for piece in ids for t in piece), dtype=np.int64)
        mask = np.fromiter((target for piece, (_, target) in zip(ids, pieces) for _ in piece), dtype=np.uint8)
        return tokens, mask
