"""Environments and tools over chat turns (ds_train/ript/environments.py, chat_turns.py): episodes kept
token-in/token-out with the vendored Qwen2.5 and Llama 3.1 templates and one that rewrites earlier turns;
every fault of an environment or a tool ends its episode with reward 0 and its reason, never the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ROOT
from ript_envs import SPECIALS, chat_tokenizer

TEMPLATES = ROOT / "recipes" / "templates"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("tok"),
                          "What is 12*34? The answer is 408. Count down from 3. next 2 1 0 calculator "
                          "expression arguments name parameters tool_call think let me compute")


def env_task(tokenizer, tmp: Path, template: str, records: list[dict], workers: int = 0, **options):
    from ds_train.ript.datatask import entry_options
    from ds_train.ript.environments import EnvTask

    data = tmp / "records.jsonl"
    filler = [{"prompt": f"What is {i}*2?", "answer": str(2 * i), "n": i} for i in range(20)]  # both splits
    data.write_text("".join(json.dumps(r) + "\n" for r in records + filler))
    opts = entry_options({"name": "t", "data": [str(data)], "heldout_fraction": 0.3, **options}, "ript.tasks[0]")
    text = template if "{%" in template else (TEMPLATES / template).read_text()
    return EnvTask(opts, tokenizer, text, 16, None, "ript.tasks[0]", 0.5 if not workers else 2.0, workers)


def sampled(tokenizer, text: str) -> list[int]:
    """`text` as an engine might sample it: one token a piece of text between special tokens, split where
    the tokenizer would not (every character its own token), so re-tokenising the history changes them."""
    ids: list[int] = []
    for piece in __import__("re").split(r"(<\|[a-z_]+\|>)", text):
        if piece in SPECIALS or piece == tokenizer.eos_token:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        else:
            ids += [i for ch in piece for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    return ids


def first(task):
    """The context of the task's first record (the test's own, whichever split it fell in)."""
    return next(p for split in ("train", "heldout") for p in task.splits[split] if "What is" not in str(p.record)
                or p.record.get("answer") == "408")


def play(task, tokenizer, turns: list[str], contexts=None):
    """Each episode of `contexts` (default: the task's first training context) with the same scripted turns."""
    from ds_train.ript.rollout import rollout

    contexts = contexts or [first(task)]
    script = [sampled(tokenizer, t) for t in turns]

    def act(live):
        return [list(script[e.turns]) if e.turns < len(script) else [tokenizer.eos_token_id] for e in live]

    episodes = rollout(act, tokenizer, [(task, c, 0) for c in contexts], max_new_tokens=16)
    return episodes, script


def test_a_tool_call_with_qwen25s_template_keeps_the_sampled_ids_and_renders_the_conversation(tokenizer, tmp_path):
    """Qwen2.5: the call is run, its result a tool message; the episode's ids are the prompt, the sampled
    turn as sampled, the template's newline after <|im_end|> and the tool turn, the answer as sampled; the
    text is the template's own rendering of the whole conversation; the loss mask is 1 on sampled ids only."""
    from ds_train.ript.chat_turns import tool_style

    template = (TEMPLATES / "qwen2_5.jinja").read_text()
    assert tool_style(template) == "hermes"
    task = env_task(tokenizer, tmp_path, "qwen2_5.jinja", [{"prompt": "What is 12*34?", "answer": "408"}],
                    tools=["ript_envs:calculator"], verifier="numeric")
    (e,), script = play(task, tokenizer, [CALL + "<|im_end|>", "The answer is 408<|im_end|>"])
    assert (e.done, e.success, e.reward, e.tool_calls, e.reason, e.turns) == (True, True, 1.0, 1, "", 2)
    prompt = task.turns.prompt_ids([{"role": "user", "content": "What is 12*34?"}])
    env = task.turns.after_turn_ids([{"role": "tool", "name": "calculator", "content": "408"}], CALL + "<|im_end|>")
    assert e.ids == prompt + script[0] + env + script[1]
    assert e.action_mask == [0] * len(prompt) + [1] * len(script[0]) + [0] * len(env) + [1] * len(script[1])
    assert tokenizer.decode(env) == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                                     "<|im_start|>assistant\n")
    conversation = [{"role": "user", "content": "What is 12*34?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]},
                    {"role": "tool", "name": "calculator", "content": "408"},
                    {"role": "assistant", "content": "The answer is 408"}]
    rendered = task.turns.renderer.render_tools(conversation, False, task.turns.tools, "test")
    assert tokenizer.decode(e.ids) + "\n" == rendered  # the template's newline after the last turn is not sampled
    assert "calculator" in tokenizer.decode(prompt) and '"expression"' in tokenizer.decode(prompt)  # tools=


def test_llama31s_json_calls_and_a_turn_cut_at_max_new_tokens(tokenizer, tmp_path):
    """Llama 3.1: the whole turn is the JSON call, the result an ipython turn. A turn cut without <|eot_id|>
    (max_new_tokens): the environment's ids close it (mask 0), and the rendering is the conversation's."""
    from ds_train.ript.chat_turns import tool_style

    assert tool_style((TEMPLATES / "llama3_1.jinja").read_text()) == "json"
    task = env_task(tokenizer, tmp_path, "llama3_1.jinja", [{"prompt": "What is 12*34?", "answer": "408"}],
                    tools=["ript_envs:calculator"], verifier="numeric")
    call = '{"name": "calculator", "parameters": {"expression": "12*34"}}'
    (e,), script = play(task, tokenizer, [call, "The answer is 408<|eot_id|>"])  # the first turn cut
    assert (e.success, e.tool_calls) == (True, 1)
    env = task.turns.after_turn_ids([{"role": "tool", "name": "calculator", "content": "408"}], call)
    assert tokenizer.decode(env) == ("<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"408\"<|eot_id|>"
                                     "<|start_header_id|>assistant<|end_header_id|>\n\n")
    n = len(e.ids) - len(script[1]) - len(env) - len(script[0])
    assert e.ids[n:] == script[0] + env + script[1]
    assert e.action_mask[n:] == [1] * len(script[0]) + [0] * len(env) + [1] * len(script[1])
    conversation = [{"role": "user", "content": "What is 12*34?"},
                    {"role": "assistant", "tool_calls": [
                        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]},
                    {"role": "tool", "name": "calculator", "content": "408"},
                    {"role": "assistant", "content": "The answer is 408"}]
    assert tokenizer.decode(e.ids) == task.turns.renderer.render_tools(conversation, False, task.turns.tools, "t")


def test_a_template_that_rewrites_earlier_turns_leaves_the_sampled_ids_alone(tokenizer, tmp_path):
    """A template that drops <think> from turns before the last user message (as Qwen3's): the episode keeps
    the think block as sampled; rendering the history again would have trained other ids."""
    task = env_task(tokenizer, tmp_path, "qwen_think_dropped.jinja", [{"n": 1, "answer": 0}],
                    env="ript_envs:Countdown")
    turns = ["<think>let me compute</think>\n1<|im_end|>", "<think>next</think>\n0<|im_end|>"]
    (e,), script = play(task, tokenizer, turns)
    assert (e.success, e.turns, e.reason) == (True, 2, "")
    text = tokenizer.decode(e.ids)
    assert text.count("<think>let me compute</think>") == 1
    assert e.ids[-len(script[1]):] == script[1] and script[0] == e.ids[len(task.turns.prompt_ids(
        [{"role": "user", "content": "Count down from 1."}])):][:len(script[0])]
    history = [{"role": "user", "content": "Count down from 1."},
               {"role": "assistant", "content": "<think>let me compute</think>\n1"},
               {"role": "user", "content": "next"}, {"role": "assistant", "content": "<think>next</think>\n0"}]
    again = task.turns.renderer.render_tools(history, False, None, "t")
    assert "let me compute" not in again and text + "\n" != again


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("env,turns,reason", [
    ("ript_envs:RaisesOnStep", ["3<|im_end|>"], "env_error"),
    ("ript_envs:RaisesOnReset", ["3<|im_end|>"], "env_error"),
    ("ript_envs:HangsOnStep", ["3<|im_end|>"], "env_timeout"),
    ("ript_envs:Malformed", ["3<|im_end|>"], "env_malformed"),
    ("ript_envs:Countdown", ["3<|im_end|>", "2<|im_end|>"], "max_turns"),
])
def test_an_environment_that_fails_ends_its_episode_with_reward_0_and_its_reason(env, turns, reason, workers,
                                                                                  tokenizer, tmp_path):
    """In the rank's process (threads) and in 2 worker processes: the episode ends with its reason; a hung step's
    worker is killed (the next episode gets a new one)."""
    import time

    task = env_task(tokenizer, tmp_path, "qwen2_5.jinja", [{"n": 3, "answer": 0}], workers, env=env, max_turns=2)
    start = time.monotonic()
    (e,), _ = play(task, tokenizer, turns)
    assert (e.done, e.success, e.reward, e.reason) == (True, False, 0.0, reason)
    assert time.monotonic() - start < 120  # a step hung for an hour is left (threads) or killed (workers) at its timeout
    if workers:
        hung = [w for w in task.room.slots if w is not None]
        assert (reason == "env_timeout") == (not hung), hung  # the hung step's worker was killed
        task.room.close()


@pytest.mark.parametrize("turn,reason", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}\n</tool_call>', "malformed_call"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1', "malformed_call"),  # cut inside a call
    ('<tool_call>\n{"name": "abacus", "arguments": {"expression": "12*34"}}\n</tool_call>', "unknown_tool"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"x": "12*34"}}\n</tool_call>', "malformed_call"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "import os"}}\n</tool_call>', "tool_error"),
    ('<tool_call>\n{"name": "slow", "arguments": {"seconds": 60}}\n</tool_call>', "tool_timeout"),
])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_call_that_fails_ends_its_episode_and_the_others_go_on(turn, reason, workers, tokenizer, tmp_path):
    """Two episodes in one batch (in threads, or each on a worker process of its own): the failing call ends its
    own with reward 0 and its reason; the other, whose call is right, goes on to its answer."""
    from ds_train.ript.rollout import rollout

    task = env_task(tokenizer, tmp_path, "qwen2_5.jinja", [{"prompt": "What is 12*34?", "answer": "408"}], workers,
                    tools=["ript_envs:calculator", "ript_envs:slow"], verifier="numeric")
    context = first(task)
    script = {0: [turn + "<|im_end|>"], 1: [CALL + "<|im_end|>", "408<|im_end|>"]}

    def act(live):
        return [sampled(tokenizer, script[e.index][e.turns]) for e in live]

    bad, good = rollout(act, tokenizer, [(task, context, 0), (task, context, 1)], max_new_tokens=16)
    task.room.close()
    assert (bad.done, bad.reward, bad.reason) == (True, 0.0, reason)
    assert (good.success, good.reward, good.reason, good.tool_calls) == (True, 1.0, "", 1)


def test_tools_need_a_template_that_writes_calls_and_a_docstring_and_turns_need_an_environment(tokenizer, tmp_path):
    from ds_train.errors import UserError
    from ds_train.ript.datatask import entry_options

    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    records = [{"prompt": "What is 12*34?", "answer": "408"}]
    with pytest.raises(UserError, match=r"^ript\.tasks\[0\]\.tools: the chat template writes tool calls in no form "
                                        r"ds_train parses \(it parses hermes and json"):
        env_task(tokenizer, tmp_path, plain, records, tools=["ript_envs:calculator"])
    with pytest.raises(UserError, match=r"^ript\.tasks\[0\]\.tools: 'undocumented' cannot be given to the chat "
                                        r"template \(.*\); give it type hints and a docstring"):
        env_task(tokenizer, tmp_path, "qwen2_5.jinja", records, tools=["test_environments:undocumented"])
    with pytest.raises(UserError, match=r"^ript\.tasks\[0\]\.max_turns: 3 turns need an environment \(env\) or "
                                        r"tools"):
        entry_options({"data": ["x.jsonl"], "max_turns": 3}, "ript.tasks[0]")
    with pytest.raises(UserError, match=r"^ript\.tasks\[0\]\.env: 'Countdown' must be module:Class"):
        entry_options({"data": ["x.jsonl"], "env": "Countdown"}, "ript.tasks[0]")


def undocumented(x):
    return x


def test_the_update_takes_no_gradient_from_environment_or_tool_tokens(tokenizer, tmp_path):
    """A multi-turn episode with a tool call through the update's own padding (its mask from the action mask)
    and clipped loss on a tiny Llama: the gradient on the logits is zero at every position that predicts a
    prompt, tool or template token, and non-zero at every sampled one."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import TINY_MODEL
    from ds_train.ript.algorithms import clipped_policy_loss
    from ds_train.ript.update import _padded

    task = env_task(tokenizer, tmp_path, "qwen2_5.jinja", [{"prompt": "What is 12*34?", "answer": "408"}],
                    tools=["ript_envs:calculator"], verifier="numeric")
    (e,), script = play(task, tokenizer, [CALL + "<|im_end|>", "The answer is 408<|im_end|>"])
    assert e.tool_calls == 1
    run = SimpleNamespace(tokenizer=tokenizer, engine=SimpleNamespace(device="cpu"))
    ids, mask, _ = _padded(run, [e], 1, False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_MODEL, "vocab_size": len(tokenizer)}))
    logits = model(input_ids=ids[:, :-1]).logits
    logits.retain_grad()
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss, _ = clipped_policy_loss(logp, logp.detach(), torch.ones(1), mask, 0.2, 0.28)
    loss.sum().backward()
    moved = logits.grad[0].abs().sum(-1) > 0
    # which ids were sampled, from the rendered pieces (the prompt, each turn as sampled, the environment's ids as
    # the rollout appended them), never from the mask under test
    prompt = task.turns.prompt_ids([{"role": "user", "content": "What is 12*34?"}])
    env = task.turns.after_turn_ids([{"role": "tool", "name": "calculator", "content": "408"}], CALL + "<|im_end|>")
    pieces = [(prompt, False), (script[0], True), (env, False), (script[1], True)]
    assert e.ids == [i for ids, _ in pieces for i in ids]
    sampled_at = [s for ids, s in pieces for _ in ids]
    assert moved.tolist() == sampled_at[1:]


def tool_records(path: Path, n: int = 40) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {a}*{a + 7}?", "expression": f"{a}*{a + 7}",
                                        "answer": str(a * (a + 7))}) + "\n" for a in range(10, 10 + n)))
    return path


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tool_calls_and_a_failing_environment_through_two_ranks_under_zero3_with_lora(chat_policy, tmp_path):
    """`ds-train ript` on 2 processes, ZeRO-3, LoRA, environments in 2 worker processes a rank, a scripted policy
    (tests/ript_envs.py ToolScript): a
    calculator task whose rollouts 0-1 call the tool and answer with its result, 2 writes a malformed call, 3
    calls a tool past ript.env_step_timeout_s; and an environment that raises at every step. The run ends
    normally; each fault is counted by its reason over both ranks; completions.jsonl keeps each turn's ids, the
    tool's masked; the update ran on the accepted groups; the doctor does not call the run's episodes all failed."""
    from conftest import TESTS_ON_PATH, node_launch, pids_with, ript_config, run_cmd

    records = tool_records(tmp_path / "calc.jsonl")
    sim = tmp_path / "sim.jsonl"
    sim.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(40)))
    cfg = ript_config(tmp_path, chat_policy, train={"micro_batch_size": 4, "global_batch_size": 16, "seq_len": 256},
                      tasks=[{"name": "calc", "data": str(records), "tools": ["ript_envs:calculator", "ript_envs:slow"],
                              "verifier": "exact", "max_turns": 3},
                             {"name": "sim", "data": str(sim), "env": "ript_envs:RaisesOnStep"}],
                      policy="ript_envs:ToolScript", env_step_timeout_s=1.0, env_workers=2, contexts_per_rank=2,
                      max_contexts_checked=4, eval_every=2, eval_contexts=4, log_completions=16, max_new_tokens=48)
    out = tmp_path / "run"
    res = run_cmd([*node_launch(2), "--module", "ds_train", "ript", "--config", str(cfg), "--ds-config",
                   str(ROOT / "ds_configs" / "zero3.json"), "model.lora.rank=4",
                   "model.lora.target_modules=[q_proj,v_proj]"], timeout=400, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-5000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "ript/checked" in r]
    total = {k: sum(r.get(k, 0) for r in synced) for k in ("ript/env_failed/malformed_call", "ript/env_failed/"
                                                             "tool_timeout", "ript/env_failed/env_error")}
    checked = sum(r["ript/checked"] for r in synced)
    assert total["ript/env_failed/malformed_call"] == total["ript/env_failed/tool_timeout"] > 0, total
    assert total["ript/env_failed/env_error"] > 0 and 0 < synced[-1]["ript/env_failed_frac"] < 1, str(sorted((k, v) for k, v in synced[-1].items() if "env_failed/" in k))
    assert synced[-1]["ript/tool_calls_mean"] > 0 and synced[-1]["ript/turns_mean"] > 1 and checked > 0
    results = json.loads((out / "ript_results.json").read_text())
    assert results["eval"]["per_task"]["calc"]["success_rate"] == 1.0  # rollout 0: the call, then its result
    assert results["eval"]["per_task"]["sim"]["success_rate"] == 0.0
    done = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    called = next(c for c in done if c["task"].startswith("calc") and c["tool_calls"] == 1 and c["success"])
    assert called["turns"] == 2 and called["reason"] == ""
    text = "".join(__import__("transformers").AutoTokenizer.from_pretrained(chat_policy).decode([i])
                   for i, m in zip(called["ids"], called["action_mask"]) if not m)
    assert "<tool_response>" in text and "<|im_start|>assistant" in text  # the tool's and the template's, masked
    assert {c["reason"] for c in done if c["task"].startswith("sim")} == {"env_error"}
    assert all(r["policy/tokens"] > 0 and r["ript/accepted"] > 0 for r in synced)  # the groups that disagree train
    assert all(0 < r["perf/env_frac"] < 1 for r in synced)  # the time the rollouts waited on environments
    assert not pids_with("ds_train.ript.env_room")  # every worker process ended with its rank
    from ds_train.observe.doctor import diagnose

    assert "rl_env_failing" not in {f.cls for f in diagnose(str(out))}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_whose_every_episode_fails_goes_on_and_the_doctor_names_it(chat_policy, tmp_path):
    """One process, an environment that raises at every step: the run ends normally (exit 0), each episode
    failed with its reason, and `ds-train doctor` names the run with the reasons counted."""
    from conftest import TESTS_ON_PATH, ds_train, ript_config
    from ds_train.observe.doctor import diagnose

    sim = tmp_path / "sim.jsonl"
    sim.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(40)))
    cfg = ript_config(tmp_path, chat_policy, train={"micro_batch_size": 4, "global_batch_size": 8, "seq_len": 128},
                      tasks=[{"name": "sim", "data": str(sim), "env": "ript_envs:RaisesOnStep"}],
                      policy="ript_envs:ToolScript", contexts_per_rank=2, max_contexts_checked=2, eval_every=0)
    res = ds_train("ript", "--config", str(cfg), "--ds-config", str(ROOT / "ds_configs" / "zero2.json"),
                   timeout=240, env={**__import__("os").environ, **TESTS_ON_PATH})
    assert res.returncode == 0, res.out[-4000:]
    finding = next(f for f in diagnose(str(tmp_path / "run")) if f.cls == "rl_env_failing")
    assert finding.evidence == ["metrics.jsonl: iterations 1-2: every episode ended by a fault: env_error 16"]
    assert finding.title == "post-training episodes all ended by a fault of their environment or tool calls"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_turn_sampled_through_vllm_has_the_trainers_logprobs(chat_policy, tmp_path):
    """vLLM rollouts (ript.rollout_engine=vllm, an engine on each of 2 ranks, ZeRO-3) of a three-turn environment,
    turns often cut at max_new_tokens: the engine's log-prob of every sampled token of every turn is the trainer's
    within 1e-4 (rollout/logp_diff_max, over the tokens of the updates), and the environment's tokens carry none."""
    from conftest import TESTS_ON_PATH, node_launch, ript_config, run_cmd

    sim = tmp_path / "chat.jsonl"
    sim.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(40)))
    cfg = ript_config(tmp_path, chat_policy, train={"micro_batch_size": 4, "global_batch_size": 16, "seq_len": 256},
                      tasks=[{"name": "chat", "data": str(sim), "env": "ript_envs:Chatter", "max_turns": 3}],
                      policy="", rollout_engine="vllm", contexts_per_rank=2, rollout_contexts=2,
                      max_contexts_checked=4, eval_every=0, log_completions=8, max_new_tokens=8, temperature=1.0)
    res = run_cmd([*node_launch(2), "--module", "ds_train", "ript", "--config", str(cfg), "--ds-config",
                   str(ROOT / "ds_configs" / "zero3.json")], timeout=500, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out[-5000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    updated = [r for r in rows if "rollout/logp_diff_max" in r]
    assert updated and all(r["rollout/logp_diff_max"] < 1e-4 for r in updated), updated
    assert all(r["ript/turns_mean"] == 3 for r in rows if "ript/checked" in r)
    done = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert done and all(c["turns"] == 3 and c["logprobs"] is not None for c in done)
    for c in done:  # the engine's log-probs on its own tokens, none on the prompt's, the template's or the user's
        assert all(lp == 0.0 for lp, m in zip(c["logprobs"], c["action_mask"]) if not m), c
        assert sum(c["action_mask"]) <= 3 * 8 and any(lp != 0 for lp in c["logprobs"])


def test_the_code_tool_runs_a_models_program_on_a_worker_process(tokenizer, tmp_path):
    """ds_train.ript.tools:run_python as a model calls it, on a worker process (ript.env_workers=1): the program's
    output is the tool message, and the answer that reads it succeeds."""
    task = env_task(tokenizer, tmp_path, "qwen2_5.jinja", [{"prompt": "What is 12*34?", "answer": "408"}], 1,
                    tools=["ds_train.ript.tools:run_python"], verifier="numeric")
    call = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(12 * 34)"}}\n</tool_call><|im_end|>'
    (e,), _ = play(task, tokenizer, [call, "408<|im_end|>"])
    task.room.close()
    assert (e.success, e.tool_calls, e.reason) == (True, 1, "")
    assert "<tool_response>\n408\n\n</tool_response>" in tokenizer.decode(e.ids)


def test_tool_calls_are_parsed_as_each_template_writes_them():
    from ds_train.ript.chat_turns import ToolCall, parse_turn

    two = ('Let me see.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>')
    got = parse_turn(two, "hermes")
    assert (got.content, got.calls, got.malformed) == ("Let me see.", (ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})), "")
    assert got.message["tool_calls"][1] == {"type": "function", "function": {"name": "b", "arguments": {"y": 2}}}
    assert parse_turn('{"name": "a", "arguments": {"x": 1}}', "json").calls == (ToolCall("a", {"x": 1}),)
    assert parse_turn("The answer is {42}.", "json").calls == () and parse_turn(two, None).calls == ()
    for text, why in (('<tool_call>{"arguments": {}}</tool_call>', 'a call is not an object with a "name"'),
                      ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "the arguments of 'a' are not an object"),
                      ('<tool_call>{"name": "a", "arguments": "{x"}</tool_call>', "the arguments of 'a' are not JSON"),
                      ('{"name": "a", "parameters": {"x": }', "the turn starts a JSON call that does not parse")):
        assert parse_turn(text, "json" if text.startswith("{") else "hermes").malformed == why, text


def room_task(tokenizer, tmp: Path, records: list[dict], workers: int, timeout_s: float, limits=None, **options):
    """An EnvTask over exactly `records` (every one a context, whichever split it fell in), with the room's limits."""
    from ds_train.ript.datatask import entry_options
    from ds_train.ript.env_room import Limits
    from ds_train.ript.environments import EnvTask

    data = tmp / f"records_{len(list(tmp.iterdir()))}.jsonl"
    filler = [{**records[0], "filler": i} for i in range(8)]  # so that neither split is empty
    data.write_text("".join(json.dumps(r) + "\n" for r in records + filler))
    opts = entry_options({"name": "t", "data": [str(data)], "heldout_fraction": 0.5, **options}, "ript.tasks[0]")
    task = EnvTask(opts, tokenizer, (TEMPLATES / "qwen2_5.jinja").read_text(), 16, None, "ript.tasks[0]", timeout_s,
                   workers, limits or Limits())
    contexts = sorted((p for split in ("train", "heldout") for p in task.splits[split] if "filler" not in p.record),
                      key=lambda p: records.index(p.record))
    return task, contexts


def roll(tokenizer, jobs, turn: str = "3<|im_end|>"):
    from ds_train.ript.rollout import rollout

    ids = sampled(tokenizer, turn)
    return rollout(lambda live: [list(ids) for _ in live], tokenizer, jobs, batch_size=len(jobs), max_new_tokens=16)


def running(tag: str) -> list[str]:
    import subprocess

    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if tag in line and "ps -eo" not in line]


ENV_FAULTS = {"reset_raises": "env_error", "reset_exits": "env_lost", "reset_hangs": "env_timeout",
              "step_raises": "env_error", "step_exits": "env_lost", "step_sysexit": "env_error",
              "step_hangs": "env_timeout", "nan": "env_nonfinite", "inf": "env_nonfinite", "np_float32": "",
              "np_int": "", "np_bool_done": "", "done_str": "env_malformed", "many_messages": "env_overlong",
              "floods": "", "daemon": "", "prints": "", "fine": ""}
VERIFIER_FAULTS = {"v_raises": "verifier_error", "v_hangs": "verifier_timeout", "v_nan": "verifier_nonfinite",
                   "v_inf": "verifier_nonfinite", "v_np": "", "v_np_bool": "", "v_str": "verifier_error", "v_fine": ""}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, "each"])
def test_a_batch_that_misbehaves_in_every_way_ends_each_episode_with_its_reason(workers, tokenizer, tmp_path, capfd,
                                                                                 monkeypatch):
    """One batch over an environment that raises, hangs, exits, floods, returns NaN / inf / numpy values, spawns a
    daemon that leaves its process group and prints a lot, and a verifier of the user's that raises, hangs or
    returns NaN: the batch finishes; each episode has its reason (reward 0) or its reward; the counts name each
    reason; every environment was closed; what was printed reached the log capped; nothing is left running. In
    worker processes (one an episode), and on threads (where exiting is not covered: trusted code only)."""
    import os
    import time
    from collections import Counter

    from ds_train.ript.env_room import Limits
    from ds_train.ript.sampler import Tally

    closed = tmp_path / "closed.txt"
    monkeypatch.setenv("DS_TRAIN_TEST_CLOSED", str(closed))
    tag = f"ds_train_test_daemon_{os.getpid()}_{tmp_path.name}"
    env_faults = {k: v for k, v in ENV_FAULTS.items() if workers or "exits" not in k}
    limits = Limits(log_chars=20_000)
    env, env_ctx = room_task(tokenizer, tmp_path, [{"kind": k, "tag": tag, "ready": str(tmp_path / "left")}
                                                  for k in env_faults],
                             len(env_faults) if workers else 0, 3.0, limits, env="ript_envs:Misbehaves", max_turns=2)
    ver, ver_ctx = room_task(tokenizer, tmp_path, [{"prompt": f"Say {k}.", "answer": "3", "kind": k}
                                                   for k in VERIFIER_FAULTS],
                             len(VERIFIER_FAULTS) if workers else 0, 3.0, limits, verifier="ript_envs:picky")
    assert ver.max_turns == 1 and ver.env_class is None
    try:
        episodes = roll(tokenizer, [(env, c, 0) for c in env_ctx] + [(ver, c, 0) for c in ver_ctx])
    finally:
        env.room.close()
        ver.room.close()
    got = {e.context.record["kind"]: (e.reason, e.reward) for e in episodes}
    want = {k: (reason, 0.0 if reason else 1.0) for k, reason in {**env_faults, **VERIFIER_FAULTS}.items()}
    if not workers:  # a hung step's thread is left behind, its environment closed once it returns
        want["reset_hangs"] = want["step_hangs"] = ("env_timeout", 0.0)
    assert got == want
    flood = next(e for e in episodes if e.context.record["kind"] == "floods")
    assert len(flood.ids) < 4096 + 200  # a 2,000,000-character message cut to its tokens
    tally = Tally(["t"])
    tally.add("t", rollouts=len(episodes), **Counter(f"failed_{e.reason}" for e in episodes if e.reason))
    metrics = tally.metrics()
    assert {k.split("/")[-1]: v for k, v in metrics.items() if "/env_failed/" in k} == dict(
        Counter(r for r, _ in want.values() if r))
    ended = {k for k, (reason, _) in want.items() if k in env_faults and not reason.endswith(("timeout", "lost"))}
    assert set(closed.read_text().split()) >= ended  # close() however the episode ended, its worker alive
    out, err = capfd.readouterr()
    printed = out + err
    assert "x" * 1000 in printed and printed.count("x") + printed.count("y") <= 20_000 and "dropped" in printed
    time.sleep(0.2)
    if workers:
        assert not running(tag), running(tag)  # the daemon that left its worker's group was found and killed
        assert not running("ds_train.ript.env_room")
    for line in running(tag):  # threads: the rank's own child, which no room kills (trusted code only)
        os.kill(int(line.split()[0]), 9)


@pytest.mark.timeout(60)
def test_deadlines_measure_the_step_not_the_queue(tokenizer, tmp_path):
    """Five episodes on one worker, each step 0.8 s, timeout 2 s: each step is in time, though the last waits 3.2 s
    behind the others (a deadline from the moment a request was queued lost 4 of 5)."""
    task, contexts = room_task(tokenizer, tmp_path, [{"n": i} for i in range(5)], 1, 2.0, env="ript_envs:Slowish")
    try:
        episodes = roll(tokenizer, [(task, c, 0) for c in contexts])
    finally:
        task.room.close()
    assert [(e.reason, e.reward) for e in episodes] == [("", 1.0)] * 5


@pytest.mark.timeout(60)
def test_many_records_of_a_few_kb_never_block_the_pipes_and_workers_are_recycled_and_limited(tokenizer, tmp_path):
    """40 episodes of 20 KB records on one worker whose replies are 16 KB each: nothing blocks (the pipes filled up
    and the rank waited for good). The worker is recycled every 8 episodes and runs under its limits; a message past
    its characters keeps its end (truncation side left), where Echo says them."""
    from ds_train.ript.env_room import Limits

    limits = Limits(episodes_per_worker=8, memory_mb=3000, file_mb=7, message_chars=16_000, truncation_side="left")
    records = [{"n": i, "text": f"{i} " + "k" * 20_000} for i in range(40)]
    task, contexts = room_task(tokenizer, tmp_path, records, 1, 10.0, limits, env="ript_envs:Echo")
    try:
        episodes = roll(tokenizer, [(task, c, 0) for c in contexts])
    finally:
        task.room.close()
    assert [(e.reason, e.reward) for e in episodes] == [("", 1.0)] * 40
    said = [tokenizer.decode(e.ids).rsplit("pid=", 1)[1].split("<|im_end|>")[0].split() for e in episodes]
    assert {s[1] for s in said} == {f"as={3000 << 20}"} and {s[2] for s in said} == {f"fsize={7 << 20}"}
    assert len({s[0] for s in said}) == 5  # a fresh worker every 8 episodes


@pytest.mark.timeout(60)
def test_an_episode_past_the_models_positions_ends_overlong(tokenizer, tmp_path):
    """The episode's tokens, with the next turn at max_new_tokens, against its limit (the model's positions): a
    first message that does not fit ends at its first turn, one that grows past it ends when it would."""
    records = [{"n": n, "text": "word " * n} for n in (3, 300)]
    task, contexts = room_task(tokenizer, tmp_path, records, 0, 5.0, env="ript_envs:Echo")
    whole = roll(tokenizer, [(task, c, 0) for c in contexts])
    assert [e.reason for e in whole] == ["", ""]
    action = len(sampled(tokenizer, "3<|im_end|>"))
    task.max_episode_tokens = len(whole[0].ids) - action + 16  # the short prompt and a turn at its most: no more
    short, long = roll(tokenizer, [(task, c, 0) for c in contexts])
    assert (short.reason, short.reward, long.reason, long.reward) == ("", 1.0, "env_overlong", 0.0)
    assert len(long.ids) < task.max_episode_tokens  # the policy never saw the prompt that does not fit
    chatter, (context,) = room_task(tokenizer, tmp_path, [{"n": 1}], 0, 5.0, env="ript_envs:Chatter", max_turns=3)
    (whole,) = roll(tokenizer, [(chatter, context, 0)])  # three turns, "go on" after the first two
    prompt = len(chatter.turns.prompt_ids([{"role": "user", "content": "Say something (1)."}]))
    turn = sampled(tokenizer, "3<|im_end|>")
    obs = len(chatter.turns.after_turn_ids([{"role": "user", "content": "go on"}], "3<|im_end|>"))
    said = len(chatter.turns.encode("3<|im_end|>"))  # the turn's tokens as the session counts them (its text's)
    assert whole.ids[prompt + len(turn) + obs:][:len(turn)] == turn
    chatter.max_episode_tokens = prompt + said + obs + 16 - 1  # the second turn, at its most, does not fit
    (cut,) = roll(tokenizer, [(chatter, context, 0)])
    assert (whole.reason, whole.turns, cut.reason, cut.turns, cut.reward) == ("", 3, "env_overlong", 1, 0.0)


@pytest.mark.parametrize("spec,kind,error", [
    ({"env": "ript_envs:calculator"}, "env", r"'ript_envs:calculator' is a function, not a class; name a class"),
    ({"env": "ript_envs:CALL"}, "env", r"'ript_envs:CALL' is an instance of str, not a class"),
    ({"env": "ript_envs:NotBuildable"}, "env", r"cannot be built with no arguments \(Class\(\)\)"),
    ({"env": "ript_envs:ToolScript"}, "env", r"has no reset or step method"),
    ({"tools": ["ript_envs:Countdown"]}, "tools", r"'ript_envs:Countdown' is a class; name a function"),
    ({"verifier": "ript_envs:make_tool"}, "verifier", r"'ript_envs:make_tool' does not take \(completion, answer, "
                                                      r"record\)"),
    ({"verifier": "ript_envs:Countdown"}, "verifier", r"'ript_envs:Countdown' is a class; a verifier is function"),
])
def test_a_user_object_of_the_wrong_kind_is_one_line_at_task_load(spec, kind, error, tokenizer, tmp_path):
    from ds_train.errors import UserError

    with pytest.raises(UserError, match=r"^ript\.tasks\[0\]\." + kind + r"(\[0\])?: .*" + error):
        room_task(tokenizer, tmp_path, [{"prompt": "q", "answer": "1", "n": 1}], 0, 1.0, **spec)


def test_every_room_knob_that_reaches_the_os_is_checked(tmp_path):
    """Absurd but positive values (a timeout past what select and threads take, 100000 workers, a limit above the
    hard one) are one line each, never a traceback at the first step."""
    import resource

    from ds_train.config.file import load_config
    from ds_train.errors import UserError
    from ds_train.ript.env_room import Limits, limit_problems

    for key, value, said in (("env_step_timeout_s", "1e30", "must be within (0, 86400]"),
                             ("env_workers", "100000", "must be within [0, 256]"),
                             ("env_max_message_chars", "0", "must be within [1, ")):
        said = f"ript.{key}={value}: {said}"
        with pytest.raises(UserError, match=__import__("re").escape(said)):
            load_config(None, [f"ript.{key}={value}"], command="ript")
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    if hard != resource.RLIM_INFINITY:
        assert "ript.env_worker_file_mb" in " ".join(limit_problems(Limits(file_mb=(hard >> 20) + 1), 4))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert "ulimit -n" in " ".join(limit_problems(Limits(), soft))
    assert limit_problems(Limits(), 4) == []
