"""The post-training sections of the run config: RIPT (`ript.*`) and preference training (`dpo.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ds_train.config.fields import NON_NEGATIVE, POSITIVE, Range, Section, _f
from ds_train.config.registry import (ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, PREFERENCE_LOSSES,
                                      ROLLOUT_CORRECTIONS)


@dataclass(frozen=True)
class RiptConfig(Section):
    """RIPT post-training: the tasks, RLOO with dynamic sampling, PPO's clipped update, evaluation."""

    tasks: list[str | dict[str, Any]] = _f(
        ["add", "rev", "copy", "sort", "parity", "max", "guess"],
        "Tasks to post-train on: built-in names, module:Class (ds_train/ript/tasks.py), or datasets of prompts "
        "and answers: a path (JSONL, parquet, .csv, .arrow, a `datasets` directory) or a mapping {data, "
        "verifier: exact|numeric|regex|boxed|module:function, prompt_key, answer_key, system, tolerance, "
        "pattern, heldout_fraction, stop, max_new_tokens, name, env: module:Class, tools: [module:function], "
        "max_turns} (ds_train/ript/datatask.py; env and tools: ds_train/ript/environments.py).")
    env_step_timeout_s: float = _f(30.0, "An environment's reset, step or close, a tool call or a verifier of your "
                                         "own (module:function) longer than this, from the moment it starts running, "
                                         "ends its episode with reward 0 (env_timeout, tool_timeout, "
                                         "verifier_timeout).",
                                   Range(0, 86400, low_open=True, note="a day at most"))
    env_workers: int = _f(4, "Worker processes per rank that environments, tools and verifiers of your own run in "
                             "(each episode on one, one request at a time a worker; a step past env_step_timeout_s "
                             "kills its worker's whole process tree). 4: a batch's steps overlap 4 ways per rank "
                             "without oversubscribing a node of 8 ranks (each a fresh interpreter, started when "
                             "first used). 0: threads of each rank's own process, for trusted code only: a step past "
                             "its time is abandoned, not killed, and an os._exit, a crash or a step holding the GIL "
                             "in C stops or stalls the rank (the kill, exit and limit guarantees hold for workers).",
                       Range(0, 256, note="0: threads, trusted code only"))
    env_worker_episodes: int = _f(256, "A worker process is recycled (a fresh one started) after this many episodes.",
                                  Range(1, 2**31 - 1))
    env_worker_memory_mb: int = _f(16384, "A worker's address space, MiB (RLIMIT_AS: its environment, tools and what "
                                          "they start). 0: no limit.", Range(0, 2**40))
    env_worker_file_mb: int = _f(1024, "The largest file a worker's process tree writes, MiB (RLIMIT_FSIZE). 0: no "
                                       "limit.", Range(0, 2**40))
    env_worker_processes: int = _f(0, "RLIMIT_NPROC of a worker: fork fails past this many processes, counted over "
                                      "every process of your user on the machine (Linux), so set it above those. "
                                      "0: no limit.", Range(0, 2**22))
    env_max_message_chars: int = _f(16384, "Each message an environment or tool gives (its content) is cut to this "
                                           "many characters (env_truncation_side).", Range(1, 2**26))
    env_max_message_tokens: int = _f(4096, "... and to this many tokens, before the chat template renders it.",
                                     Range(1, 2**24))
    env_max_episode_chars: int = _f(262144, "The characters of all of an episode's environment and tool messages "
                                            "together; past it the episode ends (env_overlong).", Range(1, 2**28))
    env_max_episode_tokens: int = _f(0, "An episode's tokens (prompt, turns at max_new_tokens each, messages); one "
                                        "whose next turn would not fit ends (env_overlong). 0: the model's positions "
                                        "(max_position_embeddings; vLLM's max_model_len); above them: refused.",
                                     Range(0, 2**24))
    env_truncation_side: Literal["right", "left"] = _f(
        "right", "Which end of a message past env_max_message_chars / tokens is cut: right, its end; left, its "
                 "start (a program's output: its last lines).")
    env_log_chars: int = _f(65536, "What a worker's user code prints (stdout, stderr) reaches the rank's log up to "
                                   "this many bytes a worker (threads: a rank); the rest is dropped, said once.",
                            Range(0, 2**31 - 1))
    policy: str = _f("", "Empty: the model acts. module:Class: a scripted policy with "
                         "act(task, context, transcript, index) -> str (tests and debugging).")
    iterations: int = _f(50, "RIPT iterations (sample, then update).", POSITIVE)
    rloo_batch_size: int = _f(8, "K: rollouts per context; the RLOO baseline is the mean of the other K-1.",
                              Range(2, note="RLOO leaves one out"))
    contexts_per_rank: int = _f(8, "Quota of accepted contexts (0 < successes < K) per rank per iteration.", POSITIVE)
    early_stop_fraction: float = _f(1.0, "Stop sampling once the accepted contexts of all ranks reach "
                                         "this fraction of the total quota.", Range(0, 1, low_open=True))
    max_contexts_checked: int = _f(64, "Cap on contexts a rank rolls out per iteration (never a hang "
                                       "when its tasks are all solved or all failed).", POSITIVE)
    rollout_contexts: int = _f(8, "Contexts rolled out together (x K episodes in one batched generate).", POSITIVE)
    train_contexts: int = _f(1000, "Training contexts drawn per task (cycled in a seeded order).",
                             Range(1, 2**24, note="drawn into a list on every rank"))
    eval_contexts: int = _f(64, "Held-out contexts per task for evaluation (greedy decoding).",
                            Range(1, 2**24, note="drawn into a list on every rank"))
    eval_every: int = _f(10, "Evaluate every N iterations (also before the first and after the last).", NON_NEGATIVE)
    skip_solved: bool = _f(False, "Per-context statistics: skip a context whose last K rollouts all "
                                  "succeeded, and re-test it after retest_after skips.")
    retest_after: int = _f(5, "Skips before a solved context is rolled out again.", POSITIVE)
    task_weighting: Literal["uniform", "accepted"] = _f(
        "uniform", "How a rank shares its rollouts among its tasks: in turn (uniform), or in proportion "
                   "to each task's recent rate of accepted contexts (accepted; at least 0.1 each).")
    advantage: ADVANTAGES.choices = _f("rloo", ADVANTAGES.help("Advantage estimator (verl adv_estimator)"))
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "grpo's std (TRL scale_rewards): group, each group's own (GRPO, DAPO); batch, the std of every "
                 "accepted rollout of all ranks; none, centred only (Dr. GRPO). rloo is never scaled.")
    loss_agg_mode: LOSS_AGGREGATIONS.choices = _f(
        "token-mean", LOSS_AGGREGATIONS.help("How token losses make the step's loss, over all ranks and micro-batches "
                                             "(verl loss_agg_mode, TRL loss_type)"))
    kl_coef: float = _f(0.0, "KL to the reference policy (the starting model, frozen; with LoRA the base with the "
                             "adapters off). 0: no reference model is built (DAPO, Dr. GRPO); GRPO used 0.04.",
                        NON_NEGATIVE)
    kl_estimator: KL_ESTIMATORS.choices = _f("k3", KL_ESTIMATORS.help("KL estimator (Schulman 2020)"))
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
    ppo_epochs: int = _f(1, "Passes over the accepted rollouts per iteration.",
                         Range(1, 2**10, note="each epoch's order of the rollouts is drawn before the first"))
    clip_low: float = _f(0.2, "PPO ratio clip below 1 (ratio >= 1 - clip_low).", Range(0, 1, high_open=True))
    clip_high: float = _f(0.28, "PPO ratio clip above 1 (ratio <= 1 + clip_high).", NON_NEGATIVE)
    temperature: float = _f(1.0, "Sampling temperature of training rollouts.", NON_NEGATIVE)
    max_new_tokens: int = _f(12, "Tokens per action at most (an action ends at a newline).",
                             Range(1, 2**24, note="no model has more positions"))
    sync_every: int = _f(1, "All-reduce and log the per-task statistics every N iterations.", POSITIVE)
    sharding: Literal["balanced", "round_robin"] = _f(
        "balanced", "Task to rank assignment: balanced by estimated cost (contexts x turns), or round_robin.")
    allow_idle_ranks: bool = _f(False, "Allow more ranks than tasks (idle ranks still join every collective).")
    rollout_engine: Literal["hf", "vllm"] = _f(
        "hf", "What generates the rollouts: hf, the policy's own generate (batched); vllm, a vLLM engine in each "
              "rank's process, its weights synced from the policy after every update (docs/post_training.md).")
    vllm_mode: Literal["colocate"] = _f("colocate", "Where vLLM runs (TRL vllm_mode): colocate, one engine in each "
                                                    "rank's own process, on its GPU.")
    vllm_gpu_memory_utilization: float = _f(
        0.3, "The fraction of each GPU vLLM takes for its weights and KV cache (TRL's default); it sleeps while "
             "the policy trains. On a CPU the KV cache is sized to one rollout batch instead.",
        Range(0, 1, low_open=True, note="the fraction of each GPU vLLM takes, TRL's default 0.3"))
    vllm_tensor_parallel_size: int = _f(1, "Ranks (GPUs of one node) one vLLM engine spans (TRL "
                                           "vllm_tensor_parallel_size): consecutive ranks, each holding its shard; "
                                           "a divisor of the ranks a node runs.", POSITIVE)
    tis_cap: float = _f(0.0, "Truncated importance sampling (verl, TRL): each token's policy loss times min(pi_old / "
                             "pi_rollout, tis_cap), the trainer's probability over the rollout engine's. 0: off. "
                             "Needs rollout_engine=vllm or rollout ranks (their log-probs).",
                      NON_NEGATIVE)
    rollout_correction: ROLLOUT_CORRECTIONS.choices = _f(
        "tis", ROLLOUT_CORRECTIONS.help("The correction tis_cap turns on"))
    debug_stale_engine: bool = _f(False, "Fault injection: vLLM keeps the policy's first weights (no sync after "
                                         "an update), what `ds-train doctor` names rollout_mismatch.")
    rollout_ranks_per_node: int = _f(
        0, "Asynchronous RL: the last N local ranks of every node generate rollouts (rollout ranks: the policy's "
           "generate, the environments, the sampler; no DeepSpeed engine) while the others train; weights go to them "
           "after every update (docs/post_training.md). 0: every rank generates, then every rank trains.",
        NON_NEGATIVE)
    max_staleness: int = _f(0, "With rollout ranks: the episodes update i trains on come from the weights of update "
                               "i - 1 - k (0: the current weights, synchronous; 1: one-step-off, generation "
                               "overlaps the update). Older episodes are dropped and counted. Above 0 it needs "
                               "tis_cap (the off-policy correction, NeMo-RL: required for convergence).",
                            NON_NEGATIVE)
    debug_stale_iteration: int = _f(0, "Fault injection (with rollout ranks): this iteration's batch is generated "
                                       "from weights one update older than max_staleness allows (the rollout "
                                       "ranks skip one weight load); the trainers drop it as stale. 0: none.",
                                    NON_NEGATIVE)
    log_completions: int = _f(0, "Rank 0's rollouts written to completions.jsonl per iteration (and per held-out "
                                 "evaluation): text, token ids, log-probs, reward. 0: none.", NON_NEGATIVE)

    def check(self) -> list[str]:
        errs = []
        if 0 < self.max_contexts_checked < self.contexts_per_rank:  # 0: its range says it
            errs.append(f"ript.max_contexts_checked: {self.max_contexts_checked} is below "
                        f"ript.contexts_per_rank={self.contexts_per_rank}")
        if not self.tasks or len(set(map(str, self.tasks))) != len(self.tasks):
            errs.append(f"ript.tasks: {self.tasks} must be a non-empty list without repeats")
        if self.advantage in ADVANTAGES.where(scaled=False) and self.scale_rewards != "group":
            scaled = " / ".join(ADVANTAGES.where(scaled=True))
            errs.append(f"ript.scale_rewards: {self.scale_rewards} scales {scaled}'s advantages, and ript.advantage "
                        f"is {self.advantage} (never scaled); set ript.advantage={ADVANTAGES.where(scaled=True)[0]}, "
                        f"or leave scale_rewards out")
        if self.kl_coef == 0 and (self.kl_in, self.kl_estimator) != (RiptConfig.kl_in, RiptConfig.kl_estimator):
            errs.append("ript.kl_in / kl_estimator: set, but ript.kl_coef is 0 (no KL term); set kl_coef")
        if self.env_max_message_chars > self.env_max_episode_chars:
            errs.append(f"ript.env_max_message_chars: {self.env_max_message_chars} is above ript.env_max_episode_chars="
                        f"{self.env_max_episode_chars} (an episode's messages together); lower it or raise that")
        # Sizes the machinery takes (issue 72; one key's limit is its field's bound): past them a rank's lists of
        # episodes outgrow any node's memory, a MemoryError deep in the sampler far from the keys.
        k = self.rloo_batch_size
        for key, value, said, what in (
                ("max_contexts_checked x rloo_batch_size", self.max_contexts_checked * k,
                 f"{self.max_contexts_checked} x {k}", "the episodes a rank may roll out in an iteration, each held in "
                                                       "its memory"),
                ("rollout_contexts x rloo_batch_size", self.rollout_contexts * k, f"{self.rollout_contexts} x {k}",
                 "the episodes of one batched generate")):
            if value > 2**24:
                errs.append(f"ript.{key}: {said} = {value} is above {2**24} ({what}); lower them")
        if 0 < self.temperature < 1e-30:  # HF's sampler divides float32 logits by it: inf, then NaN probabilities
            errs.append(f"ript.temperature: {self.temperature:g} is below 1e-30, where logits / temperature overflow "
                        f"float32 (3.4e38); use 0 (greedy) or 1e-30 and above")
        if self.clip_high > 1e38:  # torch.clamp takes 1 + clip_high as a float32 bound of the ratio
            errs.append(f"ript.clip_high: {self.clip_high:g} is above 1e38: the ratio is clipped at 1 + clip_high in "
                        f"float32 (3.4e38 at most); lower it")
        if self.tis_cap > 1e38:  # the importance weights are clamped at it in float32, as the ratio is
            errs.append(f"ript.tis_cap: {self.tis_cap:g} is above 1e38: the importance weights are capped in float32 "
                        f"(3.4e38 at most); lower it (verl and TRL use 2)")
        return errs + self._check_engine()

    def _check_engine(self) -> list[str]:
        errs = []
        if self.tis_cap > 0 and self.rollout_engine != "vllm" and not self.rollout_ranks_per_node:
            errs.append(f"ript.tis_cap: {self.tis_cap:g} corrects for the rollout engine's log-probs, and "
                        f"ript.rollout_engine={self.rollout_engine} samples from the policy itself; set "
                        f"ript.rollout_engine=vllm or ript.rollout_ranks_per_node, or leave tis_cap out")
        if self.tis_cap == 0 and self.rollout_correction != RiptConfig.rollout_correction:
            errs.append(f"ript.rollout_correction: {self.rollout_correction}, but ript.tis_cap is 0 (no correction); "
                        f"set tis_cap (verl and TRL use 2)")
        if self.debug_stale_engine and self.rollout_engine != "vllm":
            errs.append("ript.debug_stale_engine: a fault of the vLLM engine, and ript.rollout_engine is hf; set "
                        "rollout_engine=vllm or leave it out")
        if self.rollout_engine == "vllm" and self.policy:
            errs.append(f"ript.rollout_engine=vllm with ript.policy={self.policy!r}: a scripted policy generates "
                        f"nothing; set rollout_engine=hf or leave policy out")
        return errs + self._check_async()

    def _check_async(self) -> list[str]:
        errs = []
        if not self.rollout_ranks_per_node:
            for key in ("max_staleness", "debug_stale_iteration"):
                if getattr(self, key) > 0:  # a negative one: its range says it
                    errs.append(f"ript.{key}: {getattr(self, key)} needs rollout ranks (ript.rollout_ranks_per_node); "
                                f"set them, or leave {key} out")
        elif 0 < self.debug_stale_iteration < self.max_staleness + 2:
            errs.append(f"ript.debug_stale_iteration: {self.debug_stale_iteration} cannot be generated from weights older "
                        f"than ript.max_staleness={self.max_staleness} allows (there are none before update 0); "
                        f"set it to {self.max_staleness + 2} or more")
        elif self.max_staleness > 0 and self.tis_cap == 0:
            errs.append(f"ript.max_staleness: {self.max_staleness} trains on episodes of older weights, and "
                        f"ript.tis_cap is 0 (no off-policy correction); set tis_cap (verl and TRL use 2), or "
                        f"max_staleness=0")
        elif self.rollout_engine == "vllm":
            errs.append("ript.rollout_ranks_per_node with ript.rollout_engine=vllm: rollout ranks generate with the "
                        "policy's own generate for now; set rollout_engine=hf, or rollout_ranks_per_node=0 for vLLM")
        return errs


@dataclass(frozen=True)
class DpoConfig(Section):
    """Preference training (data.format preference): a loss on chosen / rejected pairs against a
    frozen reference model (ds_train/train/preference.py)."""

    loss: PREFERENCE_LOSSES.choices = _f("sigmoid", PREFERENCE_LOSSES.help("The loss of a pair"))
    beta: float = _f(0.1, "The strength of the pull to the reference (DPO's beta; IPO's tau).", POSITIVE)
    label_smoothing: float = _f(0.0, "Conservative DPO (cDPO): the assumed chance that a pair's label is wrong, "
                                     "in [0, 0.5). sigmoid losses only.",
                                Range(0, 0.5, high_open=True, note="0.5 would make chosen and rejected alike"))
    reference: Literal["precomputed", "live"] = _f(
        "precomputed", "precomputed: the reference's log-probs of every pair, computed in one pass before the first "
                       "step and stored in data.dir/reference/ (keyed by the model, the data, seq_len and the "
                       "precision); no reference model while training. live: a frozen copy of the starting model "
                       "beside the policy (ZeRO-3: partitioned), run on every batch. Under LoRA the reference is "
                       "the base with the adapters off, either way.")

    def check(self) -> list[str]:
        errs = []
        if self.label_smoothing and self.loss in PREFERENCE_LOSSES.where(smoothed=False):
            smoothed = PREFERENCE_LOSSES.where(smoothed=True)
            errs.append(f"dpo.label_smoothing: applies to the losses {', '.join(smoothed)}; {self.loss} has none: "
                        f"set dpo.loss={smoothed[0]} or drop label_smoothing")
        return errs
