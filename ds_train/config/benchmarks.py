"""The benchmarks section: lm-evaluation-harness tasks scored on the model of a run (ds_train/benchmarks.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_train.config.fields import NON_NEGATIVE, POSITIVE, Range, Section, _f


@dataclass(frozen=True)
class BenchmarksConfig(Section):
    """lm-evaluation-harness tasks scored on the run's model, under each task's own metric names (bench/<task>/...).
    Beside train.eval_every (held-out loss) and ript.eval_every (RL task success), which are ds_train's own
    measures: these are lm-eval's, the numbers `lm_eval` itself gives on the exported model. `ds-train eval` scores
    a run directory or an export with the same keys."""

    tasks: list[str] = _f([], "lm-evaluation-harness tasks: names lm_eval knows (its own, and those in "
                              "recipes/lm_eval/) or paths of task YAML files. Empty: none. Needs lm_eval "
                              "(pip install -e '.[eval]').")
    every: int | None = _f(None, "Score the tasks every N optimizer steps (train) or iterations (ript), N a "
                                 "positive integer; null: only at_start and at_end.", POSITIVE)
    at_start: bool = _f(False, "Also before the first step: the starting model's scores.")
    at_end: bool = _f(True, "Also after the last step.")
    limit: int = _f(0, "Documents per task (lm_eval's --limit: the first N); 0: every document.", NON_NEGATIVE)
    batch_size: int = _f(8, "lm_eval's batch size.", POSITIVE)
    num_fewshot: int = _f(-1, "Few-shot examples per document (lm_eval's --num_fewshot); -1: each task's own.",
                          Range(-1, note="-1: each task's own"))
    apply_chat_template: bool | str = _f(False, "Render each document through the tokenizer's chat template "
                                                "(lm_eval's --apply_chat_template): true: its default template, a "
                                                "name: that one of its templates; false: plain text. A tokenizer "
                                                "without that template is refused before the first step.")
    gen_kwargs: dict[str, Any] = _f({}, "Generation arguments of generate_until tasks (lm_eval's --gen_kwargs), "
                                        "e.g. {max_gen_toks: 64, temperature: 0}: keys of transformers' "
                                        "GenerationConfig or lm_eval's until / max_gen_toks; each value a number, "
                                        "a string, true/false or (until) a list of strings. Checked before launch.")
    log_samples: bool = _f(False, "Also keep each document's prompt, target and score (lm_eval's --log_samples): "
                                  "benchmarks/samples_<step>_<task>.jsonl in the run directory (rank 0's); "
                                  "`ds-train eval`: lm_eval's samples files beside its results file.")
    confirm_run_unsafe_code: bool = _f(False, "Let tasks flagged unsafe_code run the model's code (lm_eval's "
                                              "--confirm_run_unsafe_code: humaneval, mbpp); such a task is refused "
                                              "before launch without it.")
    wait_s: float = _f(7200.0, "Seconds the other ranks wait for rank 0's scoring (outside any collective: not "
                               "dist.timeout_s); past it they end the run in one line naming the scoring.",
                       POSITIVE)
    debug_fault: int = _f(-1, "Fault injection: the scoring of this step (ript: iteration) raises in rank 0's "
                              "first forward, to rehearse a scoring that fails; -1: none.",
                          Range(-1, note="-1: none"))

    def check(self) -> list[str]:
        errs = []
        for key, value in self.gen_kwargs.items():
            listed = isinstance(value, list) and all(isinstance(x, str) for x in value)  # until: [stop strings]
            if not (isinstance(value, (int, float, str, bool)) or listed):
                errs.append(f"benchmarks.gen_kwargs.{key}: {value!r} must be a number, a string, true/false or a "
                            f"list of strings (what lm_eval's gen_kwargs take)")
        if isinstance(self.apply_chat_template, str) and not self.apply_chat_template:
            errs.append("benchmarks.apply_chat_template: '' names no template; give true (the tokenizer's default), "
                        "a template's name, or false")
        return errs
