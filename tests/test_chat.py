"""ds_train.data.chat: conversations rendered with a chat template, targets on the assistant's tokens only."""

from __future__ import annotations

import pytest

from ds_train.data.chat import Renderer, conversation
from ds_train.data.tokenizer import train_tokenizer
from ds_train.errors import UserError

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "2 plus 3 is 5."},
                {"role": "user", "content": "And times 4?"},
                {"role": "assistant", "content": "Twenty."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [f"<|im_start|>user\nWhat is {a} plus {a + 1}?<|im_end|>\n<|im_start|>assistant\n{a} plus "
             f"{a + 1} is {2 * a + 1}. Twenty. terse.<|im_end|>\n" for a in range(40)]
    return train_tokenizer(texts, 300, tmp_path_factory.mktemp("tok"))


def test_every_assistant_token_is_a_target_and_no_other_token_is(tok):
    tokens, mask = Renderer(tok, CHATML).encode({"messages": CONVERSATION}, "f.jsonl:1")
    full = tok.apply_chat_template(CONVERSATION, chat_template=CHATML, tokenize=False)
    # Independently: the spans of the assistant's replies and the end-of-turn the template writes.
    spans = []
    for m in CONVERSATION:
        if m["role"] == "assistant":
            start = full.index("<|im_start|>assistant\n" + m["content"]) + len("<|im_start|>assistant\n")
            spans.append((start, start + len(m["content"]) + len("<|im_end|>\n")))
    pos, targets = 0, []
    for t, is_target in zip(tokens.tolist(), mask.tolist()):
        piece = tok.decode([t])
        assert full[pos:pos + len(piece)] == piece  # the tokens spell the rendered text, in order
        inside = any(a <= pos and pos + len(piece) <= b for a, b in spans)
        outside = all(pos + len(piece) <= a or b <= pos for a, b in spans)
        assert inside or outside, f"token {piece!r} straddles a boundary"
        assert bool(is_target) == inside, f"token {piece!r} at {pos}: target={is_target}"
        targets.append(piece) if is_target else None
        pos += len(piece)
    assert pos == len(full)
    assert "".join(targets) == "2 plus 3 is 5.<|im_end|>\nTwenty.<|im_end|>\n"


def test_a_prompt_completion_pair_is_a_user_and_an_assistant_turn(tok):
    r = Renderer(tok, CHATML)
    pair = r.segments(conversation({"prompt": "hi", "completion": "hello"}, "x"), "x")
    assert pair == [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False), ("hello<|im_end|>\n", True)]


@pytest.mark.parametrize("record, said", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "f.jsonl:7: no assistant turn (roles: user)"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "f.jsonl:7: messages[0].role is 'bot', not one of system, "
                                                       "developer, user, assistant, tool"),
    ({"messages": [{"role": "user"}]}, "f.jsonl:7: messages[0] has no 'content' field"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "f.jsonl:7: messages[0].content is ['a'], not a string"),
    ({"messages": []}, "f.jsonl:7: 'messages' is [], not a list of messages"),
    ({"prompt": "hi"}, "f.jsonl:7: no 'completion' field"),
    ({"text": "hi"}, "f.jsonl:7: no 'messages' field"),
    ({"prompt": "hi", "completion": 3}, "f.jsonl:7: 'completion' is 3, not a string or a list of messages"),
])
def test_bad_conversations_name_the_record_and_the_field(record, said):
    with pytest.raises(UserError) as e:
        conversation(record, "f.jsonl:7")
    assert str(e.value).startswith(said)


def test_a_tokenizer_without_a_template_needs_data_chat_template(tok):
    with pytest.raises(UserError, match="^data.chat_template: the tokenizer has no chat template; set"):
        Renderer(tok)


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    # Renders the last turn differently: prefixes are not prefixes of the whole.
    odd = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(UserError, match="renders the conversation up to message 2 as other text"):
        Renderer(tok, odd).encode({"messages": CONVERSATION}, "f.jsonl:1")


def test_a_tool_calling_conversation_renders_its_tools_and_trains_on_the_calls_and_the_answer(tmp_path):
    """A record with `tools` (JSON schemas) and an assistant turn with `tool_calls`, through the vendored
    Qwen2.5 template: the schemas are in the system turn, the call and the answer are targets, the tool's
    result is not; the template's markers are one special token each (template_markers)."""
    from pathlib import Path

    from ds_train.data.tokenizer import template_markers
    from ds_train.ript.environments import tool_schema
    from ds_train.ript.tools import calculator

    template = (Path(__file__).resolve().parents[1] / "recipes" / "templates" / "qwen2_5.jinja").read_text()
    assert template_markers(template) == ["<|im_start|>", "<|im_end|>"]
    call = {"name": "calculator", "arguments": {"expression": "347 * 86"}}
    record = {"tools": [tool_schema(calculator, "tools[0]")],
              "messages": [{"role": "user", "content": "What is 347 times 86?"},
                           {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                           {"role": "tool", "content": "29842"},
                           {"role": "assistant", "content": "29842"}]}
    tok = train_tokenizer([template] * 3, 400, tmp_path, template)
    tokens, mask = Renderer(tok).encode(record, "f.jsonl:2")
    text = tok.decode(tokens.tolist())
    assert '"name": "calculator"' in text.split("<|im_end|>")[0]  # the schema, in the system turn
    targets = tok.decode([t for t, m in zip(tokens.tolist(), mask.tolist()) if m])
    assert targets == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 86"}}\n</tool_call>'
                       '<|im_end|>\n29842<|im_end|>\n'), targets
    assert tokens.tolist().count(tok.convert_tokens_to_ids("<|im_end|>")) == 5  # system, user, call, tool, answer
    with pytest.raises(UserError, match=r"^f.jsonl:2: 'tools' is 'calculator', not a list of JSON schemas"):
        Renderer(tok).encode({**record, "tools": "calculator"}, "f.jsonl:2")
