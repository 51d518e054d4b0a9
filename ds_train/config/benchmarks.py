"""The benchmarks section: lm-evaluation-harness tasks scored on the model of a run (ds_train/benchmarks.py)."""

from __future__ import annotations

from dataclasses import dataclass

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
