"""The tasks of an RL run (load_tasks), and the data-driven kind: a dataset of prompts and
checkable answers, rendered with the model's chat template, scored by a verifier
(ds_train/ript/verifiers.py). An entry of ript.tasks:

    ript:
      tasks:
        - add                                   # a built-in task
        - recipes/data/arith_rl.jsonl           # a dataset, every option at its default
        - name: gsm                             # a dataset with options
          data: [data/gsm8k_train.parquet]      # files, directories, `datasets` directories (data.sources' kinds)
          prompt_key: question                  # a string (a user turn) or a list of messages
          answer_key: answer                    # a value, or a list of right answers
          system: "Think step by step."         # a system turn before the prompt (optional)
          verifier: numeric                     # exact | numeric | regex | boxed | module:function
          tolerance: 1.0e-6                     # numeric, boxed
          pattern: ""                           # regex
          heldout_fraction: 0.1                 # prompts held out for evaluation, by a hash of the prompt
          stop: []                              # strings that end a completion; empty: the template's
                                                #   end of turn and the EOS token
          max_new_tokens: 0                     # 0: ript.max_new_tokens

The train / held-out split is by a hash of the rendered prompt, so it is the same on every rank and
seed, and a prompt that appears twice is on one side only. Every record is read and checked when
the run starts, before anything is written: a bad one is one line naming the file, its line or row,
and the field.
"""

from __future__ import annotations

import difflib
import json
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_train.data.chat import ROLES, Renderer
from ds_train.data.sources import chunks
from ds_train.errors import UserError
from ds_train.ript.tasks import Step, load_task
from ds_train.ript.verifiers import NAMES, build_verifier

OPTIONS = {"name": "", "data": [], "prompt_key": "prompt", "answer_key": "answer", "system": "",
           "verifier": "exact", "tolerance": 1e-6, "pattern": "", "heldout_fraction": 0.1, "stop": [],
           "max_new_tokens": 0, "env": "", "tools": [], "max_turns": 0}
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".csv", ".arrow")


def is_dataset_entry(entry: Any) -> bool:
    """A ript.tasks entry that names a dataset: a mapping, or a path to records."""
    if isinstance(entry, dict):
        return True
    return isinstance(entry, str) and (entry.lower().endswith(RECORD_SUFFIXES) or "/" in entry
                                       or Path(entry).is_dir())


def entry_options(entry: Any, where: str) -> dict:
    """The options of a dataset entry, its defaults filled in; the problems a config check can see
    (no file read) as one UserError."""
    raw = {"data": [entry]} if isinstance(entry, str) else dict(entry)
    problems = []
    for key in raw:
        if key not in OPTIONS:
            close = difflib.get_close_matches(str(key), list(OPTIONS), n=1)
            problems.append(f"{where}.{key}: unknown key" + (f" (did you mean {close[0]!r}?)" if close else
                                                             f"; the keys are {', '.join(OPTIONS)}"))
    opts = {**OPTIONS, **{k: v for k, v in raw.items() if k in OPTIONS}}
    if isinstance(opts["data"], str):
        opts["data"] = [opts["data"]]
    if not opts["data"] or not all(isinstance(d, str) and d for d in opts["data"]):
        problems.append(f"{where}.data: {opts['data']!r} must name one or more files or directories of records")
    for key in ("prompt_key", "answer_key", "verifier"):
        if not isinstance(opts[key], str) or not opts[key]:
            problems.append(f"{where}.{key}: {opts[key]!r} must be a non-empty string")
    for key in ("name", "system", "pattern"):
        if not isinstance(opts[key], str):
            problems.append(f"{where}.{key}: {opts[key]!r} must be a string")
    if not isinstance(opts["stop"], list) or not all(isinstance(s, str) and s for s in opts["stop"]):
        problems.append(f"{where}.stop: {opts['stop']!r} must be a list of non-empty strings")
    fraction = opts["heldout_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        problems.append(f"{where}.heldout_fraction: {fraction!r} must be a number between 0 and 1")
    tolerance = opts["tolerance"]
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or tolerance < 0:
        problems.append(f"{where}.tolerance: {tolerance!r} must be a number >= 0")
    for key, zero in (("max_new_tokens", "ript.max_new_tokens"), ("max_turns", "1, or 4 with env or tools")):
        value = opts[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"{where}.{key}: {value!r} must be an integer >= 0 (0: {zero})")
    if not isinstance(opts["env"], str) or opts["env"] and ":" not in opts["env"]:
        problems.append(f"{where}.env: {opts['env']!r} must be module:Class (an environment: reset(sample) -> "
                        f"messages, step(turn) -> (messages, reward, done, info))")
    if not isinstance(opts["tools"], list) or not all(isinstance(t, str) and ":" in t for t in opts["tools"]):
        problems.append(f"{where}.tools: {opts['tools']!r} must be a list of module:function")
    if opts["max_turns"] and opts["max_turns"] > 1 and not (opts["env"] or opts["tools"]):
        problems.append(f"{where}.max_turns: {opts['max_turns']} turns need an environment (env) or tools; a "
                        f"dataset task without them is one prompt and one answer")
    if not problems:
        build_verifier(opts["verifier"], float(tolerance), opts["pattern"], f"{where}.verifier")
    if problems:
        raise UserError("; ".join(problems))
    if not opts["name"]:
        opts["name"] = _stem(opts["data"][0])
    return opts


def _stem(path: str) -> str:
    name = Path(path.rstrip("/")).name
    for suffix in RECORD_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[:-len(suffix)]
    return name


def heldout(key: str, fraction: float) -> bool:
    """Held out by a hash of the prompt: the same side on every rank, seed and run."""
    return zlib.crc32(key.encode()) / 2**32 < fraction


@dataclass(frozen=True)
class Prompt:
    """A context of a data-driven task: the rendered prompt's token ids, the answer, where it is from."""

    ids: tuple[int, ...]
    answer: Any
    where: str  # file:line or file row N
    record: dict


def _plain(answer: Any) -> bool:
    """An answer a built-in verifier can compare with text: a string or a number (not a bool)."""
    return isinstance(answer, str) or isinstance(answer, (int, float)) and not isinstance(answer, bool)


class DatasetTask:
    """A single-turn task read from records: prompt -> completion -> verifier."""

    max_turns = 1

    def __init__(self, options: dict, tokenizer, chat_template: str, max_new_tokens: int, max_positions: int | None,
                 where: str):
        self.name = options["name"]
        self.options = options
        self.where = where
        self.tokenizer = tokenizer
        self.renderer = Renderer(tokenizer, chat_template)
        self.verify = build_verifier(options["verifier"], float(options["tolerance"]), options["pattern"],
                                     f"{where}.verifier")
        self.max_new_tokens = options["max_new_tokens"] or max_new_tokens
        self.stop = tuple(options["stop"]) or default_stops(tokenizer, self.renderer)
        self.specials = tuple(sorted(set(tokenizer.all_special_tokens), key=len, reverse=True))
        self.splits: dict[str, list[Prompt]] = {"train": [], "heldout": []}
        for prompt in self._read(max_positions):
            side = heldout(self.split_key(prompt), options["heldout_fraction"])
            self.splits["heldout" if side else "train"].append(prompt)
        for split, prompts in self.splits.items():
            if not prompts:
                n = sum(len(p) for p in self.splits.values())
                raise UserError(f"{where} ({self.name}): {', '.join(options['data'])}: no {split} prompts ({n} "
                                f"record(s), heldout_fraction {options['heldout_fraction']:g}); add records or "
                                f"change heldout_fraction")

    def split_key(self, prompt: Prompt) -> str:
        """What the train / held-out split hashes: the rendered prompt."""
        return self.tokenizer.decode(prompt.ids)

    def _read(self, max_positions: int | None):
        o = self.options
        prompt_key, answer_key = o["prompt_key"], o["answer_key"]
        for chunk in chunks(o["data"], (prompt_key, answer_key), f"{self.where}.data"):
            if chunk.kind == "text":
                raise UserError(f"{chunk.file}: a text file; a data-driven task reads records (JSONL, parquet, "
                                f".csv, .arrow, a `datasets` directory) with {prompt_key!r} and {answer_key!r} "
                                f"fields ({self.where}.data)")
            for offset, item in enumerate(chunk.items):
                if chunk.kind == "jsonl":
                    where = f"{chunk.file}:{chunk.first + offset}"
                    if not item.strip():
                        continue
                    try:
                        item = json.loads(item)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        raise UserError(f"{where}: not a JSON object; each line holds one record with "
                                        f"{prompt_key!r} and {answer_key!r}") from None
                else:
                    where = f"{chunk.file} row {chunk.first + offset}"
                yield self._prompt(item, where, max_positions)

    def _prompt(self, record: Any, where: str, max_positions: int | None) -> Prompt:
        o = self.options
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object with {o['prompt_key']!r} and {o['answer_key']!r}")
        for key in (o["prompt_key"], o["answer_key"]):
            if record.get(key) is None:
                kind = "prompt" if key == o["prompt_key"] else "answer"
                raise UserError(f"{where}: no {key!r} field ({self.where}: {kind}_key); add it or set the key to "
                                f"the field that holds it")
        answer = record[o["answer_key"]]
        if o["verifier"] in NAMES and not all(_plain(a) for a in (answer if isinstance(answer, list) else [answer])):
            raise UserError(f"{where}: {o['answer_key']!r} must be a string, a number or a list of them (the "
                            f"{o['verifier']} verifier compares it with the completion's text); got "
                            f"{repr(answer)[:60]}")
        text = self.renderer.render_prompt(self.messages_of(record, where), where)
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if max_positions and len(ids) + self.max_new_tokens > max_positions:
            raise UserError(f"{where}: the prompt is {len(ids)} tokens, and with max_new_tokens "
                            f"{self.max_new_tokens} exceeds the model's {max_positions} positions; shorten it or "
                            f"lower max_new_tokens")
        return Prompt(ids, record[o["answer_key"]], where, record)

    def messages_of(self, record: dict, where: str) -> list[dict]:
        """A record's prompt as messages: its prompt_key (a user turn, or messages), after `system`."""
        o = self.options
        value = record[o["prompt_key"]]
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, list) and value and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value):
            messages = list(value)
        else:
            raise UserError(f"{where}: {o['prompt_key']!r} must be a string or a list of messages ({{role, "
                            f"content}}); got {repr(value)[:60]}")
        return [{"role": "system", "content": o["system"]}, *messages] if o["system"] else messages

    def contexts(self, split: str, n: int, seed: int) -> list[Prompt]:
        """Up to n prompts of the split, in a seeded order."""
        prompts = list(self.splits[split])
        random.Random(f"{self.name}:{seed}").shuffle(prompts)
        return prompts[:n]

    def prompt_ids(self, context: Prompt) -> list[int]:
        return list(context.ids)

    def reset(self, context: Prompt) -> str:
        return self.tokenizer.decode(context.ids)

    def completion(self, action: str) -> str:
        """The completion up to its first stop string, without special tokens."""
        cut = min((action.find(s) for s in self.stop if s in action), default=len(action))
        text = action[:cut]
        for special in self.specials:
            text = text.replace(special, "")
        return text

    def step(self, context: Prompt, turn: int, action: str) -> Step:
        """The built-in verifiers' reward (a verifier of the user's runs in a room: environments.py EnvTask)."""
        reward = float(self.verify(self.completion(action), context.answer, context.record))
        reward = reward if math.isfinite(reward) else 0.0  # never a non-finite reward into the advantages
        return Step("", True, reward >= 1.0, reward)


class DatasetPart:
    """Part i of n of a dataset task: every n-th prompt of each split (in the task's seeded order),
    so that one dataset keeps every data-parallel rank busy. Named `name#i`; metrics and results add
    the parts of a task up under its name."""

    def __init__(self, task: DatasetTask, index: int, parts: int):
        self.task, self.index, self.parts = task, index, parts
        self.name = f"{task.name}#{index}"
        self.max_turns, self.stop, self.max_new_tokens = task.max_turns, task.stop, task.max_new_tokens
        if hasattr(task, "open"):  # an environment task: each episode a session
            self.open = task.open

    def contexts(self, split: str, n: int, seed: int) -> list[Prompt]:
        mine = self.task.contexts(split, len(self.task.splits[split]), seed)[self.index::self.parts]
        return mine[:-(-n // self.parts)]  # this part's share of n, rounded up

    def prompt_ids(self, context: Prompt) -> list[int]:
        return self.task.prompt_ids(context)

    def reset(self, context: Prompt) -> str:
        return self.task.reset(context)

    def step(self, context: Prompt, turn: int, action: str) -> Step:
        return self.task.step(context, turn, action)


def split_for_ranks(task, ranks: int) -> list:
    """A dataset task as `ranks` parts (one per data-parallel rank); any other task whole."""
    if isinstance(task, DatasetTask) and ranks > 1:
        return [DatasetPart(task, i, ranks) for i in range(ranks)]
    return [task]


def default_stops(tokenizer, renderer: Renderer) -> tuple[str, ...]:
    """What ends a completion when the task names no stop: the text the chat template writes after
    an assistant's reply (its end of turn, e.g. <|im_end|>), and the EOS token."""
    stops = []
    probe = "\x00reply\x00"
    try:
        text = renderer.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}])
        after = text.split(probe, 1)[1].strip() if probe in text else ""
    except UserError:
        after = ""
    if after:
        first = tokenizer.convert_ids_to_tokens(tokenizer(after, add_special_tokens=False)["input_ids"][:1])
        stops += [tokenizer.convert_tokens_to_string(first)] if first else []
    if tokenizer.eos_token:
        stops.append(tokenizer.eos_token)
    return tuple(dict.fromkeys(s for s in stops if s.strip()))


def check_task_entries(cfg) -> dict[int, dict]:
    """ript.tasks read without the model: built-in names and module:Class load, dataset entries'
    options are valid. Returns the options of the dataset entries by index."""
    for entry in cfg.ript.tasks:
        if not is_dataset_entry(entry):
            load_task(str(entry))
    return {i: entry_options(e, f"ript.tasks[{i}]") for i, e in enumerate(cfg.ript.tasks) if is_dataset_entry(e)}
