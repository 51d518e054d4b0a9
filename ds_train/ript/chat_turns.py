"""Token-in/token-out chat turns: an episode of several assistant turns keeps the ids the engine sampled,
and appends the ids of the environment's messages (tool results, a user's reply) as the chat template
renders them after an assistant's turn. The history is never rendered again, so a template that rewrites
earlier turns (one that drops `<think>` blocks from them, one that trims them) cannot change a token the
policy sampled, and the log-probs the update recomputes are those of exactly the tokens sampled.

What the template writes after a turn is found once per template: a conversation whose last assistant
turn is a placeholder is rendered, and what follows the placeholder is the template's close of a turn
(Qwen's `<|im_end|>` and a newline, Llama 3's `<|eot_id|>`). After a turn that ended with its stop token
the rest of that close follows (the newline); after a turn cut at max_new_tokens, the whole close (the
end-of-turn token is then the environment's, with loss mask 0). Then come the messages, and the header of
the next assistant turn: the text the template adds for them after the placeholder conversation.

Tool calls are parsed as the template writes them (the template's source says which form):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more (Qwen2.5, Qwen3, Hermes)
    json     the whole turn one JSON object {"name": ..., "parameters": {...}} (Llama 3.1 / 3.2's JSON
             tool calling; "arguments" is taken too)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ds_train.data.chat import Renderer
from ds_train.errors import UserError

PLACEHOLDER = "\x00turn\x00"
STYLES = ("hermes", "json")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Parsed:
    """An assistant turn read: its text without tool calls, the calls, and what was wrong with a call
    ("" when nothing)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    malformed: str = ""
    message: dict = field(default_factory=dict)  # the turn as a chat message (tool_calls as the templates take)


def tool_style(template: str) -> str | None:
    """How `template` writes a tool call (STYLES), or None when it writes none ds_train reads."""
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template or "'\"parameters\": '" in template:
        return "json"
    return None


def _call(obj: Any, keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from a decoded object, or what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return "a call is not an object with a \"name\""
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"the arguments of {obj['name']!r} are not JSON"
    if not isinstance(args, dict):
        return f"the arguments of {obj['name']!r} are not an object"
    return ToolCall(obj["name"], args)


def _decoded(raw: str, keys: tuple[str, ...], not_json: str) -> ToolCall | str:
    """A call's JSON text as a ToolCall (its arguments under the first of `keys`), or what is wrong with it."""
    try:
        return _call(json.loads(raw), keys)
    except json.JSONDecodeError:
        return not_json


def parse_turn(text: str, style: str | None) -> Parsed:
    """An assistant turn's text (stop strings and special tokens removed) as content and tool calls."""
    calls: list[ToolCall] = []
    if style == "hermes":
        found = _HERMES.findall(text)
        opened = text.count("<tool_call>")
        content = text.split("<tool_call>", 1)[0].strip()
        if opened != len(found):
            return Parsed(content, (), "a <tool_call> is not closed by </tool_call>")
        for raw in found:
            got = _decoded(raw, ("arguments", "parameters"), "a <tool_call> does not hold JSON")
            if isinstance(got, str):
                return Parsed(content, (), got)
            calls.append(got)
    elif style == "json":
        content = text.strip()
        if content.startswith("{"):
            got = _decoded(content, ("parameters", "arguments"), "the turn starts a JSON call that does not parse")
            if isinstance(got, str):
                return Parsed(content, (), got)
            calls, content = [got], ""
    else:
        content = text.strip()
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return Parsed(content, tuple(calls), "", message)


class ChatTurns:
    """The ids of a conversation's start and of what the environment adds after each assistant turn, with
    `tokenizer`'s chat template (or `template`) and `tools` (JSON schemas, as the template takes them)."""

    def __init__(self, tokenizer, template: str = "", tools: list[dict] | None = None, where: str = "ript.tasks"):
        self.tok, self.where, self.tools = tokenizer, where, tools or None
        self.renderer = Renderer(tokenizer, template)
        self.style = tool_style(self.renderer.template)
        if self.tools and self.style is None:
            raise UserError(f"{where}.tools: the chat template writes tool calls in no form ds_train parses (it "
                            f"parses {' and '.join(STYLES)}: Qwen / Hermes <tool_call> JSON and Llama 3's JSON "
                            f"call); use such a template (data.chat_template) or no tools")
        base = [{"role": "user", "content": "\x00q\x00"}, {"role": "assistant", "content": PLACEHOLDER}]
        self._base = self._render(base, False)
        if self._base.count(PLACEHOLDER) != 1:
            raise UserError(f"{where}: the chat template does not write an assistant's turn as it is, so its "
                            f"turns cannot be kept as sampled; use another template (data.chat_template)")
        self._base_messages = base
        self.close = self._base.split(PLACEHOLDER, 1)[1]  # what the template writes after a turn's text
        first = self.encode(self.close)[:1]
        self.end = self.tok.decode(first) if first else ""  # its first token: the one a turn stops at

    def _render(self, messages: list[dict], prompt: bool) -> str:
        return self.renderer.render_tools(messages, prompt, self.tools, self.where)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation so far and the header of the assistant's turn, as ids."""
        return self.encode(self._render(messages, True))

    def after_turn(self, messages: list[dict], turn_text: str) -> str:
        """The text after an assistant turn whose sampled text is `turn_text`: the rest of the template's close
        of the turn, `messages` (the environment's), and the next assistant turn's header."""
        full = self._render(self._base_messages + list(messages), True)
        if not full.startswith(self._base):
            raise UserError(f"{self.where}: the chat template renders a conversation's start differently once "
                            f"{', '.join(m.get('role', '?') for m in messages)} message(s) follow it, so the "
                            f"environment's tokens cannot follow the sampled ones; use another template")
        ended = self.end and turn_text.endswith(self.end) and self.close.startswith(self.end)
        return self.close[len(self.end) if ended else 0:] + full[len(self._base):]

    def after_turn_ids(self, messages: list[dict], turn_text: str) -> list[int]:
        return self.encode(self.after_turn(messages, turn_text))
