"""The post-training sections of the run config: RIPT (`ript.*`) and preference training (`dpo.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ds_train.config.fields import NON_NEGATIVE, POSITIVE, Section, _f


@dataclass(frozen=True)
class RiptConfig(Section):
    """RIPT post-training: the tasks, RLOO with dynamic sampling, PPO's clipped update, evaluation."""

    tasks: list[str | dict[str, Any]] = _f(
        ["add", "rev", "copy", "sort", "parity", "max", "guess"],
        "Tasks to post-train on: built-in names, module:Class (ds_train/ript/tasks.py), or datasets of prompts "
        "and answers: a path (JSONL, parquet, .csv, .arrow, a `datasets` directory) or a mapping {data, "
        "verifier: exact|numeric|regex|boxed|module:function, prompt_key, answer_key, system, tolerance, "
        "pattern, heldout_fraction, stop, max_new_tokens, name} (ds_train/ript/datatask.py).")
    policy: str = _f("", "Empty: the model acts. module:Class: a scripted policy with "
                         "act(task, context, transcript, index) -> str (tests and debugging).")
    iterations: int = _f(50, "RIPT iterations (sample, then update).", POSITIVE)
    rloo_batch_size: int = _f(8, "K: rollouts per context; the RLOO baseline is the mean of the other K-1.")
    contexts_per_rank: int = _f(8, "Quota of accepted contexts (0 < successes < K) per rank per iteration.", POSITIVE)
    early_stop_fraction: float = _f(1.0, "Stop sampling once the accepted contexts of all ranks reach "
                                         "this fraction of the total quota.")
    max_contexts_checked: int = _f(64, "Cap on contexts a rank rolls out per iteration (never a hang "
                                       "when its tasks are all solved or all failed).", POSITIVE)
    rollout_contexts: int = _f(8, "Contexts rolled out together (x K episodes in one batched generate).", POSITIVE)
    train_contexts: int = _f(1000, "Training contexts drawn per task (cycled in a seeded order).", POSITIVE)
    eval_contexts: int = _f(64, "Held-out contexts per task for evaluation (greedy decoding).", POSITIVE)
    eval_every: int = _f(10, "Evaluate every N iterations (also before the first and after the last).", NON_NEGATIVE)
    skip_solved: bool = _f(False, "Per-context statistics: skip a context whose last K rollouts all "
                                  "succeeded, and re-test it after retest_after skips.")
    retest_after: int = _f(5, "Skips before a solved context is rolled out again.", POSITIVE)
    task_weighting: Literal["uniform", "accepted"] = _f(
        "uniform", "How a rank shares its rollouts among its tasks: in turn (uniform), or in proportion "
                   "to each task's recent rate of accepted contexts (accepted; at least 0.1 each).")
    advantage: Literal["rloo", "grpo"] = _f(
        "rloo", "Advantage estimator (verl adv_estimator): rloo, leave-one-out (RIPT; Ahmadian et al. 2024); grpo, "
                "group mean and std (Shao et al. 2024; DAPO), scaled as scale_rewards says.")
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "grpo's std (TRL scale_rewards): group, each group's own (GRPO, DAPO); batch, the std of every "
                 "accepted rollout of all ranks; none, centred only (Dr. GRPO). rloo is never scaled.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = _f(
        "token-mean", "How token losses make the step's loss, over all ranks and micro-batches (verl loss_agg_mode, "
                      "TRL loss_type): token-mean, over every valid token (DAPO, TRL dapo); seq-mean-token-mean, "
                      "each rollout's token mean, then the mean over rollouts (GRPO, TRL grpo); "
                      "seq-mean-token-sum-norm, token sums over rollouts x the most tokens a rollout can have "
                      "(Dr. GRPO, TRL dr_grpo).")
    kl_coef: float = _f(0.0, "KL to the reference policy (the starting model, frozen; with LoRA the base with the "
                             "adapters off). 0: no reference model is built (DAPO, Dr. GRPO); GRPO used 0.04.",
                        NON_NEGATIVE)
    kl_estimator: Literal["k1", "k3"] = _f(
        "k3", "KL estimator (Schulman 2020): k1, log pi - log pi_ref (verl kl); k3, the low-variance "
              "exp(d) - d - 1 (verl low_var_kl, GRPO's).")
    kl_in: Literal["loss", "reward"] = _f(
        "loss", "Where the KL goes: loss, a per-token term aggregated as the policy loss (verl use_kl_loss, "
                "GRPO); reward, kl_coef x the rollout's summed KL subtracted from its reward before the "
                "advantages (verl use_kl_in_reward, RLOO's original).")
    mask_truncated: bool = _f(False, "Rollouts cut off at max_new_tokens train on no token (TRL "
                                     "mask_truncated_completions, DAPO's overlong filtering); they still count "
                                     "in their group's advantages.")
    overlong_buffer: int = _f(0, "DAPO's soft overlong punishment: a rollout within this many tokens of the most "
                                 "it may generate loses up to overlong_penalty of reward, linearly. 0: off (DAPO: "
                                 "4096 of 20480).", NON_NEGATIVE)
    overlong_penalty: float = _f(1.0, "The reward lost at the length limit under overlong_buffer (DAPO: 1.0).",
                                 NON_NEGATIVE)
    max_sampling_rounds: int = _f(0, "Cap on the rounds of dynamic sampling in an iteration (verl "
                                     "max_num_gen_batches); the update takes what was accepted by then. 0: no "
                                     "cap but max_contexts_checked.", NON_NEGATIVE)
    ppo_epochs: int = _f(1, "Passes over the accepted rollouts per iteration.", POSITIVE)
    clip_low: float = _f(0.2, "PPO ratio clip below 1 (ratio >= 1 - clip_low).")
    clip_high: float = _f(0.28, "PPO ratio clip above 1 (ratio <= 1 + clip_high).")
    temperature: float = _f(1.0, "Sampling temperature of training rollouts.", NON_NEGATIVE)
    max_new_tokens: int = _f(12, "Tokens per action at most (an action ends at a newline).", POSITIVE)
    sync_every: int = _f(1, "All-reduce and log the per-task statistics every N iterations.", POSITIVE)
    sharding: Literal["balanced", "round_robin"] = _f(
        "balanced", "Task to rank assignment: balanced by estimated cost (contexts x turns), or round_robin.")
    allow_idle_ranks: bool = _f(False, "Allow more ranks than tasks (idle ranks still join every collective).")

    def check(self) -> list[str]:
        errs = []
        if self.rloo_batch_size < 2:
            errs.append(f"ript.rloo_batch_size: {self.rloo_batch_size} must be at least 2 (RLOO "
                        f"leaves one out)")
        if not 0 < self.early_stop_fraction <= 1:
            errs.append(f"ript.early_stop_fraction: {self.early_stop_fraction} must be in (0, 1]")
        if self.max_contexts_checked < self.contexts_per_rank:
            errs.append(f"ript.max_contexts_checked: {self.max_contexts_checked} is below "
                        f"ript.contexts_per_rank={self.contexts_per_rank}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            errs.append(f"ript.clip_low / clip_high: {self.clip_low} / {self.clip_high}: need "
                        f"0 <= clip_low < 1 and clip_high >= 0")
        if not self.tasks or len(set(map(str, self.tasks))) != len(self.tasks):
            errs.append(f"ript.tasks: {self.tasks} must be a non-empty list without repeats")
        if self.advantage == "rloo" and self.scale_rewards != "group":
            errs.append(f"ript.scale_rewards: {self.scale_rewards} scales grpo's advantages, and ript.advantage is "
                        f"rloo (never scaled); set ript.advantage=grpo, or leave scale_rewards out")
        if self.kl_coef == 0 and (self.kl_in != "loss" or self.kl_estimator != "k3"):
            errs.append("ript.kl_in / kl_estimator: set, but ript.kl_coef is 0 (no KL term); set kl_coef")
        return errs


@dataclass(frozen=True)
class DpoConfig(Section):
    """Preference training (data.format preference): a loss on chosen / rejected pairs against a
    frozen reference model (ds_train/train/preference.py)."""

    loss: Literal["sigmoid", "ipo", "sigmoid_norm"] = _f(
        "sigmoid", "sigmoid: DPO (Rafailov et al. 2023), -log sigmoid(beta x margin) of the summed log-prob "
                   "ratios; ipo: IPO (Azar et al. 2023), (margin - 1 / (2 beta))^2 on per-token mean log-probs "
                   "(as TRL); sigmoid_norm: DPO on per-token mean log-probs (length-normalised: a longer "
                   "completion is not favoured for its length).")
    beta: float = _f(0.1, "The strength of the pull to the reference (DPO's beta; IPO's tau).", POSITIVE)
    label_smoothing: float = _f(0.0, "Conservative DPO (cDPO): the assumed chance that a pair's label is wrong, "
                                     "in [0, 0.5). sigmoid losses only.", NON_NEGATIVE)
    reference: Literal["precomputed", "live"] = _f(
        "precomputed", "precomputed: the reference's log-probs of every pair, computed in one pass before the first "
                       "step and stored in data.dir/reference/ (keyed by the model, the data, seq_len and the "
                       "precision); no reference model while training. live: a frozen copy of the starting model "
                       "beside the policy (ZeRO-3: partitioned), run on every batch. Under LoRA the reference is "
                       "the base with the adapters off, either way.")

    def check(self) -> list[str]:
        errs = []
        if self.label_smoothing >= 0.5:
            errs.append(f"dpo.label_smoothing: {self.label_smoothing:g} must be below 0.5 (0.5 would make "
                        f"chosen and rejected alike)")
        if self.label_smoothing and self.loss == "ipo":
            errs.append("dpo.label_smoothing: applies to the sigmoid losses; IPO has none: set dpo.loss=sigmoid "
                        "or drop label_smoothing")
        return errs
