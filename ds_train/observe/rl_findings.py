"""What a post-training run's own statistics (metrics.jsonl) tell the doctor (ds_train/observe/doctor.py): a run
that learns nothing (every episode a fault of its environment, groups of equal rewards, rollouts cut off at their
limit), a rollout engine drifting from the policy, and, with rollout ranks (asynchronous RL), episodes dropped as
stale and trainers starved by slow rollouts. Each finding is (class, evidence lines, context lines)."""

from __future__ import annotations

RL_TITLES = {
    "rl_no_signal": "post-training without a learning signal: every group's rewards were equal",
    "rl_truncated": "post-training rollouts cut off at their token limit",
    "rl_env_failing": "post-training episodes all ended by a fault of their environment or tool calls",
    "rl_stale_dropped": "post-training episodes dropped as stale: generated from weights older than "
                        "ript.max_staleness allows",
    "rl_trainer_starved": "the trainers wait for the rollout ranks most of each iteration: generation is the "
                          "bottleneck",
    "rollout_mismatch": "the rollout engine's log-probs drift from the trainer's: vLLM samples from another policy"}
RL_RECENT = 5  # the syncs a post-training finding looks at
RL_NO_SIGNAL = 0.95  # the share of groups with equal rewards above which nothing is learned
RL_TRUNCATED = 0.5  # the share of truncated rollouts above which the limit decides the reward
# vLLM's log-prob of a sampled token against the trainer's, |difference| averaged over tokens (fp32 on a CPU:
# 1e-6; bf16 on GPUs: about 1e-2): drift once it reaches this and twice the run's first
ROLLOUT_DRIFT = 0.05
STARVED = 0.5  # the share of an iteration the trainers waited for rollouts, on every recent sync, that is starving

Found = tuple[str, list[str], list[str]]


def rl_statistics(metrics: list[dict]) -> str:
    """A post-training run's statistics at its last sync, one line (empty before one)."""
    synced = [r for r in metrics if "ript/checked" in r]
    if not synced:
        return ""
    last = synced[-1]
    keys = (("reward mean", "ript/reward_mean"), ("reward std", "ript/reward_std"),
            ("groups with equal rewards", "ript/frac_reward_zero_std"), ("truncated", "ript/truncated_frac"),
            ("KL", "policy/kl"), ("held-out success", "eval/success"))
    held = next((r["eval/success"] for r in reversed(metrics) if "eval/success" in r), None)
    parts = [f"{label} {(held if key == 'eval/success' else last[key]):.3g}" for label, key in keys
             if key in last or key == "eval/success" and held is not None]
    return f"post-training statistics at iteration {last['step']}: " + ", ".join(parts)


def rl_findings(metrics: list[dict]) -> list[Found]:
    return _learns_nothing(metrics) + _rollout_mismatch(metrics) + _asynchronous(metrics)


def _learns_nothing(metrics: list[dict]) -> list[Found]:
    """Every episode of the last syncs ended by a fault of its environment or tool calls, its groups all had equal
    rewards (all solved or all failed), or most rollouts hit their token limit."""
    recent = [r for r in metrics if "ript/checked" in r][-RL_RECENT:]
    if not recent:
        return []
    found = []
    span = f"metrics.jsonl: iterations {recent[0]['step']}-{recent[-1]['step']}"
    for cls, key, limit, what in (("rl_env_failing", "ript/env_failed_frac", 1.0, ""),
                                  ("rl_no_signal", "ript/frac_reward_zero_std", RL_NO_SIGNAL,
                                   "of the groups had K equal rewards"),
                                  ("rl_truncated", "ript/truncated_frac", RL_TRUNCATED,
                                   "of the rollouts were truncated")):
        values = [r.get(key) for r in recent]
        if not all(isinstance(v, (int, float)) and v >= limit for v in values):
            continue
        if cls == "rl_env_failing":
            reasons: dict[str, float] = {}
            for r in recent:
                for k, n in r.items():
                    if k.startswith("ript/env_failed/"):
                        reasons[k.rsplit("/", 1)[1]] = reasons.get(k.rsplit("/", 1)[1], 0) + n
            found.append((cls, [f"{span}: every episode ended by a fault: " + ", ".join(
                f"{k} {n:g}" for k, n in sorted(reasons.items(), key=lambda x: -x[1]))],
                          ["completions.jsonl (ript.log_completions) holds each episode's turns and its reason"]))
            continue
        success = [r.get("ript/success_rate") for r in recent]
        context = [f"success rate {min(success):.2f}-{max(success):.2f}"] if cls == "rl_no_signal" and all(
            isinstance(x, (int, float)) for x in success) else []
        found.append((cls, [f"{span}: {min(values):.0%}-{max(values):.0%} {what}"], context))
    return found


def _rollout_mismatch(metrics: list[dict]) -> list[Found]:
    """Rollouts whose engine's log-probs (vLLM's) moved away from the trainer's over the run: the last sync's mean
    difference at least ROLLOUT_DRIFT and twice the first's. Not where the episodes are older than the policy by
    design (rollout ranks with ript.max_staleness above 0): their drift is the staleness's."""
    synced = [r for r in metrics if "rollout/logp_diff_mean" in r]
    if len(synced) < 2 or any(r.get("async/staleness_max", 0) > 0 for r in metrics):
        return []
    first, last = synced[0], synced[-1]
    if last["rollout/logp_diff_mean"] < max(ROLLOUT_DRIFT, 2 * first["rollout/logp_diff_mean"]):
        return []
    return [("rollout_mismatch", [
        f"metrics.jsonl: rollout/logp_diff_mean {first['rollout/logp_diff_mean']:.2g} at iteration {first['step']} -> "
        f"{last['rollout/logp_diff_mean']:.2g} at iteration {last['step']} "
        f"({last.get('rollout/logp_diff_frac_over_0.1', 0):.0%} of the tokens off by more than 0.1)"], [])]


def _asynchronous(metrics: list[dict]) -> list[Found]:
    """With rollout ranks: episodes dropped as stale anywhere in the run; trainers that waited for rollouts at least
    STARVED of each of the last syncs' iterations."""
    found = []
    dropped = [r for r in metrics if r.get("async/stale_dropped", 0) > 0]
    if dropped:
        found.append(("rl_stale_dropped", [
            f"metrics.jsonl: iteration {r['step']}: {r['async/stale_dropped']:g} episodes dropped as stale (older "
            f"than ript.max_staleness), none of them trained" for r in dropped[:3]],
            [f"{len(dropped)} iteration(s) dropped episodes"] if len(dropped) > 3 else []))
    recent = [r for r in metrics if "async/trainer_wait_s" in r and r.get("perf/iteration_s")][-RL_RECENT:]
    shares = [r["async/trainer_wait_s"] / r["perf/iteration_s"] for r in recent]
    if len(recent) >= 2 and min(shares) >= STARVED:
        last = recent[-1]
        found.append(("rl_trainer_starved", [
            f"metrics.jsonl: iterations {recent[0]['step']}-{last['step']}: the trainers waited for rollouts "
            f"{min(shares):.0%}-{max(shares):.0%} of each iteration (async/trainer_wait_s "
            f"{last['async/trainer_wait_s']:.3g} of perf/iteration_s {last['perf/iteration_s']:.3g})"],
            [f"the rollout ranks waited {last.get('async/rollout_wait_s', 0):.3g} s an iteration for weights; "
             f"ript.max_staleness is {int(last.get('async/staleness_max', 0))} at most"]))
    return found
