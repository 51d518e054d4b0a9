"""Token-in/token-out chat turns: an episode of several assistant turns keeps the ids the engine sampled,
and appends the ids of the environment's messages (tool results, a user's reply) as the chat template
renders them after an assistant's turn. The history is never rendered again, so a template that rewrites
earlier turns (one that drops `<think>` blocks from them, one that trims them) cannot change a token the
policy sampled, and the log-probs the update recomputes are those of exactly the tokens sampled.

What follows a turn is what the template writes after it in the longer conversation: the turn's text is a
placeholder, the environment's messages follow it, and the text after the placeholder is taken (the rest
of the template's close of the turn, the messages, the next assistant turn's header). Nothing before the
placeholder is compared, so a template that renders the turn itself differently once messages follow (Qwen3's
empty `<think>` block on the last assistant turn only) or a header that changes (a date) cannot refuse it.
After a turn that ended with its stop token (the close's first token: Qwen's `<|im_end|>`, Llama 3's
`<|eot_id|>`) the rest of the close follows; after a turn cut at max_new_tokens, the whole close (the
end-of-turn token is then the environment's, with loss mask 0). A template's clock (`strftime_now`, Llama
3.2's date) reads the time the ChatTurns was built (or `today`), so every prompt of a run has one date.

The environment's text is only text. Each message's content is rendered as a stand-in first, so the
template's own text (its role headers, its control tokens) is known apart from the content the template
places; content in which a special token's text appears (a tool result spelling `<|im_end|>` and
`<|im_start|>assistant`) is encoded with the tokenizer's `split_special_tokens`, as characters, never as the control
token; the template's structure keeps its tokens. Content without such text is encoded with its
surroundings, so its ids are those of the whole text, as before. A message the template cannot take is a
`TurnFault` with its reason (the episode's, not the run's):

    env_text      a message that is not an object of strings ({"role": str, "content": str, ...}), a string
                  that is not text (a lone surrogate: no UTF-8 encodes it), a special token's text anywhere
                  but in the content (a tool's name)
    env_role      a role the template writes no content for (found by rendering a probe message of that role
                  once), or a role spelling a special token
    env_template  the template raises on the messages (raise_exception: a role it refuses, alternation), or
                  does not write each content once, after the turn, as a piece of its own text

Tool calls are parsed as the template writes them (the template's source says which form):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more (Qwen2.5, Qwen3, Hermes)
    json     the whole turn one JSON object {"name": ..., "parameters": {...}} (Llama 3.1 / 3.2's JSON
             tool calling; "arguments" is taken too)

The vendored templates (recipes/templates/, README.md there) are each tested over an episode with a tool call
and a user's reply (tests/test_chat_turns.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ds_train.data.chat import Renderer
from ds_train.errors import UserError

PLACEHOLDER = "\x00turn\x00"
STYLES = ("hermes", "json")
FAULTS = ("env_template", "env_role", "env_text")  # a TurnFault's reasons (the module says when)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
# A content's stand-in while the template places it: private-use characters, which tojson, trim and strip keep
_MARK = "\ue000{}\ue001"
_PROBE = _MARK.format("")


class TurnFault(UserError):
    """Messages the chat template cannot take as text: raised by ChatTurns.prompt_ids and after_turn_ids,
    with `.reason` one of FAULTS. It ends the episode (environments.Session counts the reason); where nothing
    catches it (a dataset's prompt at load) it is a user error naming the record."""

    def __init__(self, reason: str, message: str):
        assert reason in FAULTS, reason
        super().__init__(message)
        self.reason = reason


def _said(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _not_text(value: Any) -> bool:
    """Whether `value` holds anything but JSON data whose strings are text (UTF-8 encodes them)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (an undecodable byte kept by surrogateescape)
            return True
        return False
    if isinstance(value, dict):
        return any(not isinstance(k, str) or _not_text(k) or _not_text(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_not_text(v) for v in value)
    return not (value is None or isinstance(value, (bool, int, float)))


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


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
    `tokenizer`'s chat template (or `template`) and `tools` (JSON schemas, as the template takes them); a
    template's clock reads `today` (default: now, once)."""

    def __init__(self, tokenizer, template: str = "", tools: list[dict] | None = None, where: str = "ript.tasks",
                 today: datetime | None = None):
        self.tok, self.where, self.tools = tokenizer, where, tools or None
        self.today = today or datetime.now()
        self.renderer = Renderer(tokenizer, template)
        self.style = tool_style(self.renderer.template)
        if self.tools and self.style is None:
            raise UserError(f"{where}.tools: the chat template writes tool calls in no form ds_train parses (it "
                            f"parses {' and '.join(STYLES)}: Qwen / Hermes <tool_call> JSON and Llama 3's JSON "
                            f"call); use such a template (data.chat_template) or no tools")
        base = [{"role": "user", "content": "\x00q\x00"}, {"role": "assistant", "content": PLACEHOLDER}]
        self._base = self.renderer.render_tools(base, False, self.tools, where)
        if self._base.count(PLACEHOLDER) != 1:
            raise UserError(f"{where}: the chat template does not write an assistant's turn as it is, so its "
                            f"turns cannot be kept as sampled; use another template (data.chat_template)")
        self._base_messages = base
        self.close = self._base.split(PLACEHOLDER, 1)[1]  # what the template writes after a turn's text
        first = self.encode(self.close)[:1]
        self.end = self.tok.decode(first) if first else ""  # its first token: the one a turn stops at
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._specials = sorted({t.content for t in added.values() if getattr(t, "special", False)}
                                | set(getattr(tokenizer, "all_special_tokens", [])) - {""})
        self._roles: dict[str, bool] = {}  # role -> whether the template writes a message's content

    def strftime_now(self, fmt: str) -> str:
        """The templates' clock (transformers gives them `strftime_now`), fixed at `today`."""
        return self.today.strftime(fmt)

    def _render(self, messages: list[dict], prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, chat_template=self.renderer.template, tokenize=False,
                                                add_generation_prompt=prompt, tools=self.tools,
                                                strftime_now=self.strftime_now)
        except Exception as e:  # jinja2's errors, and raise_exception() in templates
            raise TurnFault("env_template", f"{self.where}: the chat template cannot render the environment's "
                                            f"messages ({_said(e)})") from None

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation so far and the header of the assistant's turn, as ids (TurnFault when the
        template cannot take the messages as text)."""
        return self._ids(self._place([], messages, True))

    def after_turn(self, messages: list[dict], turn_text: str) -> str:
        """The text after an assistant turn whose sampled text is `turn_text`: the rest of the template's close
        of the turn, `messages` (the environment's), and the next assistant turn's header."""
        return "".join(text for text, _ in self._after(messages, turn_text))

    def after_turn_ids(self, messages: list[dict], turn_text: str) -> list[int]:
        """after_turn's text as ids, the messages' content as text (TurnFault when the template cannot take
        them)."""
        return self._ids(self._after(messages, turn_text))

    def _after(self, messages: list[dict], turn_text: str) -> list[tuple[str, bool]]:
        pieces = self._place(self._base_messages, messages, True)
        close = pieces[0][0]  # what the template writes after the turn in this conversation
        if self.end and turn_text.endswith(self.end) and close.startswith(self.end):
            pieces[0] = (close[len(self.end):], False)
        return pieces

    def _fault(self, reason: str, what: str) -> TurnFault:
        return TurnFault(reason, f"{self.where}: {what}")

    def _check(self, messages: Any) -> list[dict]:
        """The messages, each an object of strings whose role the template writes; TurnFault otherwise."""
        if not isinstance(messages, (list, tuple)):
            raise self._fault("env_text", f"the environment's messages are {_short(messages)}, not a list")
        for i, m in enumerate(messages):
            at = f"the environment's message {i}"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise self._fault("env_text", f"{at} is {_short(m)}, not an object with a string role and content")
            if _not_text(m):
                raise self._fault("env_text", f"{at} ({m['role']!r}) holds a string that is not text (a lone "
                                              f"surrogate: not UTF-8) or a value that is not JSON data")
            for key, value in m.items():
                spelled = None if key == "content" else next(
                    (s for s in _strings(value) for t in self._specials if t in s), None)
                if spelled is not None and key == "role":
                    raise self._fault("env_role", f"{at}'s role {_short(m['role'])} spells a special token")
                if spelled is not None:
                    raise self._fault("env_text", f"{at} ({m['role']!r}): its {key!r} spells a special token "
                                                  f"({_short(spelled)}); only the content is written as text")
            if not self._writes(m["role"]):
                raise self._fault("env_role", f"{at}'s role {m['role']!r} is one the chat template does not "
                                              f"write (it renders none of its content)")
        return list(messages)

    def _writes(self, role: str) -> bool:
        """Whether the template writes the content of a `role` message after an assistant turn (probed once)."""
        if role not in self._roles:
            try:
                text = self._render(self._base_messages + [{"role": role, "content": _PROBE}], True)
                self._roles[role] = _PROBE in text  # where it is written is _place's to check
            except TurnFault:  # refused outright: the conversation's own render says so (env_template)
                self._roles[role] = True
        return self._roles[role]

    def _place(self, prefix: list[dict], messages: Any, prompt: bool) -> list[tuple[str, bool]]:
        """The rendering of `prefix` + `messages` after the prefix's placeholder turn (the whole, without a
        prefix), as (text, is_content) pieces: the template's own text, and each message's content as the
        template writes it, found by rendering each content in place of its stand-in."""
        messages = self._check(messages)
        real = self._render(prefix + messages, prompt)
        marks = [_MARK.format(i) for i in range(len(messages))]
        masked = [{**m, "content": k} for m, k in zip(messages, marks)]
        text = self._render(prefix + masked, prompt)
        start = 0
        if prefix:
            if text.count(PLACEHOLDER) != 1:
                raise self._fault("env_template", "the chat template does not write the sampled turn once when "
                                                  "the environment's messages follow it")
            start = text.index(PLACEHOLDER) + len(PLACEHOLDER)
        at = {}
        for i, k in enumerate(marks):
            if text.count(k) != 1 or text.find(k) < start:
                raise self._fault("env_template", f"the chat template does not write the content of the "
                                                  f"environment's message {i} ({messages[i]['role']!r}) once, "
                                                  f"after the turn")
            at[i] = text.find(k)
        pieces, pos = [], start
        for i in sorted(at, key=at.get):
            before, after = text[start:at[i]], text[at[i] + len(marks[i]):]
            one = real if len(messages) == 1 else self._render(prefix + masked[:i] + [messages[i]] + masked[i + 1:],
                                                               prompt)
            begin = self._after_turn_in(one, prefix)  # the text before the turn is never used: not compared
            if not (one.startswith(before, begin) and one.endswith(after)
                    and len(one) - begin >= len(before) + len(after)):
                raise self._fault("env_template", f"the chat template renders the environment's message {i} "
                                                  f"({messages[i]['role']!r}) as other text around its content "
                                                  f"than around another content")
            pieces += [(text[pos:at[i]], False), (one[begin + len(before):len(one) - len(after)], True)]
            pos = at[i] + len(marks[i])
        pieces.append((text[pos:], False))
        if real[self._after_turn_in(real, prefix):] != "".join(t for t, _ in pieces):
            raise self._fault("env_template", "the chat template renders the environment's messages together as "
                                              "other text than each on its own")
        return pieces

    @staticmethod
    def _after_turn_in(rendered: str, prefix: list[dict]) -> int:
        """Where the text after the prefix's placeholder turn begins in `rendered` (0 without a prefix): its first
        placeholder is the turn's, as the environment's contents are all written after it."""
        return rendered.find(PLACEHOLDER) + len(PLACEHOLDER) if prefix and PLACEHOLDER in rendered else 0

    def _ids(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """The pieces' ids: the whole text's, unless a special token's text lies in a content piece: that
        piece is then encoded on its own with special-token text split into characters."""
        text = "".join(t for t, _ in pieces)
        found = [(i, i + len(s)) for s in self._specials for i in _occurrences(text, s)]
        spans, pos = [], 0
        for t, content in pieces:
            spans.append((pos, pos + len(t), content))
            pos += len(t)
        spelled = {j for j, (a, b, content) in enumerate(spans) if content and any(s < b and a < e for s, e in found)}
        if not spelled:
            return self.encode(text)
        ids: list[int] = []
        run = ""
        for j, (t, _) in enumerate(pieces):
            if j not in spelled:
                run += t
                continue
            ids += self.encode(run) if run else []
            ids += self.tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            run = ""
        return ids + (self.encode(run) if run else [])


def _occurrences(text: str, s: str):
    i = text.find(s)
    while i >= 0:
        yield i
        i = text.find(s, i + 1)
