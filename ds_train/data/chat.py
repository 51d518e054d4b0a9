"""Instruction data (data.format: sft): a record as a conversation, rendered with a chat template
into token ids and the mask of the tokens the loss is on (the assistant's). Preference data
(data.format: preference): a prompt and two completions, chosen and rejected, each rendered after
the prompt with targets on the completion's assistant tokens alone.

An sft record is a conversation, `{"messages": [{"role": ..., "content": ...}, ...]}`, or a pair,
`{"prompt": ..., "completion": ...}` (strings: a user turn and an assistant turn; or lists of
messages). A conversation that calls tools may carry `tools`, the JSON schemas its template shows the model
(`tools=`, as the chat templates and ds-train ript's tool tasks take them; assistant turns with
`tool_calls` and `tool` turns are the template's to render).

The template renders the whole conversation once; the assistant's spans are found by
rendering its prefixes (the text before each assistant turn with the generation prompt, and the
text through that turn), as Hugging Face's `{% generation %}` marking would mark them: the
assistant's reply and the end-of-turn text the template writes after it (so the model learns to
stop), never the system or user turns nor the template's role headers. Each span is tokenised on
its own, so no token straddles a boundary.

A preference record is `{"prompt": ..., "chosen": ..., "rejected": ...}` (strings: a user turn and
two assistant replies; or lists of messages), or, without a prompt, two conversations `chosen` and
`rejected` that share their start (the prompt) and differ in their ending (TRL's implicit prompt).
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
    check_messages(messages, field, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant turn (roles: {', '.join(m['role'] for m in messages)}); "
                        f"there is nothing to train on: add the reply or remove the record")
    return messages


def record_tools(record: dict, where: str) -> list[dict] | None:
    """The record's `tools` (a list of JSON schemas, each an object), or None; one line naming it otherwise."""
    tools = record.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{where}: 'tools' is {_short(tools)}, not a list of JSON schemas (objects such as "
                        f'{{"type": "function", "function": {{"name": ..., "parameters": ...}}}}); fix the record')
    return tools


def check_messages(messages, field: str, where: str) -> None:
    """A non-empty list of {role, content} messages; one line naming the record and the field otherwise."""
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


def preference(record: dict, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """The checked (prompt, chosen, rejected) messages of a preference record; one line naming the
    record and the field otherwise."""
    for key in ("chosen", "rejected"):
        if key not in record:
            raise UserError(f"{where}: no {key!r} field (data.format preference reads 'prompt', 'chosen' and "
                            f"'rejected'); fix the record or remove it")
    if "prompt" in record:
        prompt = _turns(record["prompt"], "user", where, "prompt")
        chosen = _turns(record["chosen"], "assistant", where, "chosen")
        rejected = _turns(record["rejected"], "assistant", where, "rejected")
        if prompt:
            check_messages(prompt, "prompt", where)
    else:  # implicit prompt: what the two conversations share
        chosen, rejected = record["chosen"], record["rejected"]
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, list):
                raise UserError(f"{where}: no 'prompt' field, and {key!r} is {_short(value)}, not a conversation "
                                f"(without a prompt, chosen and rejected are conversations that share their "
                                f"start); add 'prompt'")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        check_messages(value, key, where)
        if not any(m["role"] == "assistant" for m in value):
            raise UserError(f"{where}: {key!r} has no assistant turn after the prompt (roles: "
                            f"{', '.join(m['role'] for m in value)}); a completion is the assistant's reply")
    return prompt, chosen, rejected


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

    def _render(self, messages: list[dict], prompt: bool, where: str, tools: list[dict] | None = None) -> str:
        try:
            return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=prompt, tools=tools)
        except Exception as e:  # jinja2's errors, and raise_exception() in templates
            said = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            raise UserError(f"{where}: the chat template cannot render this conversation ({said}); fix the "
                            f"record or data.chat_template") from None

    def render(self, messages: list[dict], where: str = "the chat template") -> str:
        """A whole conversation as text."""
        return self._render(messages, False, where)

    def render_tools(self, messages: list[dict], prompt: bool, tools: list[dict] | None, where: str) -> str:
        """A conversation with `tools` (JSON schemas) given to the template; the assistant's header after
        it when `prompt`."""
        return self._render(messages, prompt, where, tools)

    def render_prompt(self, messages: list[dict], where: str) -> str:
        """The conversation so far and the header of the assistant's turn: what a reply continues."""
        return self._render(messages, True, where)

    def segments(self, messages: list[dict], where: str, first: int = 0,
                 tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        """The rendered conversation (with `tools` given to the template) as (text, is_target) pieces, in
        order: the assistant's turns from message `first` on are targets."""
        full = self._render(messages, False, where, tools)
        out, pos = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < first:
                continue
            before = self._render(messages[:i], True, where, tools) if i else ""
            through = self._render(messages[:i + 1], False, where, tools)
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
        return self._tokens(self.segments(conversation(record, where), where, tools=record_tools(record, where)))

    def encode_completion(self, prompt: list[dict], completion: list[dict], where: str) -> tuple[np.ndarray,
                                                                                                  np.ndarray]:
        """Token ids of prompt + completion and the target mask (1 on the completion's assistant tokens)."""
        return self._tokens(self.segments(prompt + completion, where, first=len(prompt)))

    def _tokens(self, pieces: list[tuple[str, bool]]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tok([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
        tokens = np.fromiter((t for piece in ids for t in piece), dtype=np.int64)
        mask = np.fromiter((target for piece, (_, target) in zip(ids, pieces) for _ in piece), dtype=np.uint8)
        return tokens, mask
