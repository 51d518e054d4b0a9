"""The policy-gradient algebra of RIPT, pure and registered by name (verl's core_algos.py pattern):
advantage estimators, the dynamic-sampling filter, the clipped surrogate, loss aggregation, KL
estimators and DAPO's soft overlong penalty. Each is a small function of tensors, tested against
hand-computed values; the loop (ds_train/ript/update.py) supplies the global counts that make
them exact across ranks and micro-batches.

The registries (names, help, properties) are ds_train/config/registry.py's, which the config reads
without importing torch; the functions here attach to their names (`@register_advantage(name)`).

Names follow the anchors: verl `adv_estimator` / `loss_agg_mode` / `kl_loss_type`, TRL
`scale_rewards` / `loss_type` / `mask_truncated_completions`, DAPO's overlong buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ds_train.config.registry import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, ROLLOUT_CORRECTIONS

GRPO_EPS = 1e-6  # verl's compute_grpo_outcome_advantage epsilon (TRL adds 1e-4)

# --- advantage estimators: rewards [groups, K] -> advantages [groups, K] ------------------------
# The names, their help and properties: ds_train/config/registry.py (the config reads them there).

register_advantage = ADVANTAGES.register


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor, batch_std: float | None = None) -> torch.Tensor:
    """A_i = r_i - mean of the other K-1 rewards, per group (rows: contexts, columns: K rollouts).
    Never scaled (RIPT's, and TRL's RLOO default).

    RLOO: Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free"; Ahmadian et al. 2024.
    """
    k = rewards.shape[-1]
    if k < 2:
        raise ValueError("RLOO needs at least 2 rollouts per context")
    others = (rewards.sum(-1, keepdim=True) - rewards) / (k - 1)
    return rewards - others


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, batch_std: float | None = None, scale: str = "group") -> torch.Tensor:
    """A_i = (r_i - group mean) / (std + eps): std of the group (scale 'group', GRPO: Shao et al.
    2024), of the whole batch (`batch_std`, scale 'batch': Liu et al. 2025, "Part I: Tricks or
    Traps?"), or no division (scale 'none': Dr. GRPO, Liu et al. 2025). Stds are unbiased (K-1),
    as torch.std, verl and TRL compute them."""
    centred = rewards - rewards.mean(-1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "batch":
        if batch_std is None:
            raise ValueError("scale 'batch' needs the batch's std")
        return centred / (batch_std + GRPO_EPS)
    if scale != "group":
        raise ValueError(f"unknown scale {scale!r}")
    return centred / (rewards.std(-1, keepdim=True) + GRPO_EPS)


def advantages(name: str, rewards: torch.Tensor, scale: str, batch_std: float | None) -> torch.Tensor:
    """The advantages of the estimator registered as `name`; `scale` (ript.scale_rewards) goes to one
    whose entry says it takes it (Estimator.scaled)."""
    if ADVANTAGES.entry(name).scaled:
        return ADVANTAGES[name](rewards, batch_std, scale)
    return ADVANTAGES[name](rewards, batch_std)


def keep_mask(rewards: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling (DAPO) keeps a context only when its K rewards are not all equal (binary
    rewards: 0 < successes < K)."""
    return (rewards.max(-1).values - rewards.min(-1).values) > 0


# --- the policy loss, token by token -------------------------------------------------------------

def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate with separate low / high clip (DAPO's clip-higher), per token.

    logp, old_logp, mask: [rows, tokens]; advantages: [rows]. Returns the per-token loss (zero where
    mask is 0: padded rows and tokens give exactly zero gradient) and statistics summed over the
    valid tokens; `aggregate` turns the per-token loss into the step's loss.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped) * mask
    with torch.no_grad():
        stats = {"tokens": float(mask.sum()), "clipped_tokens": float(((unclipped > clipped) & (mask > 0)).sum()),
                 "ratio_sum": float((ratio * mask).sum())}
    return per_token, stats


# --- loss aggregation: the step's loss from per-token losses and global counts -------------------

@dataclass(frozen=True)
class Norms:
    """What an optimizer step's loss is normalised by, counted over every rank and micro-batch of
    the step: valid tokens, sequences with at least one valid token, and (Dr. GRPO) the most tokens
    a sequence can have."""

    tokens: float
    sequences: float
    max_tokens: float


register_loss_agg = LOSS_AGGREGATIONS.register


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norms: Norms,
              scale: float = 1.0) -> torch.Tensor:
    """This micro-batch's share of the step's loss, times `scale`, as the loss aggregation registered
    as `mode` computes it. Each is sum(weight x per-token loss) with every valid token's weight from
    the step's global counts (`norms`), so that the shares of all ranks and micro-batches add up to
    the aggregated loss whatever the split. per_token must be zero off the mask
    (clipped_policy_loss's is)."""
    return LOSS_AGGREGATIONS[mode](per_token, mask, norms, scale)


@register_loss_agg("token-mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, norms: Norms, scale: float = 1.0) -> torch.Tensor:
    """DAPO; verl's default; TRL 'dapo': weight 1 / tokens of the step (one division for the whole sum)."""
    return per_token.sum() * (scale / max(norms.tokens, 1.0))


@register_loss_agg("seq-mean-token-mean")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, norms: Norms, scale: float = 1.0) -> torch.Tensor:
    """GRPO; TRL 'grpo': weight 1 / (the sequence's tokens x sequences of the step)."""
    lengths = mask.sum(-1, keepdim=True)
    return (per_token * (mask / (lengths.clamp(min=1.0) * max(norms.sequences, 1.0)))).sum() * scale


@register_loss_agg("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, norms: Norms,
                            scale: float = 1.0) -> torch.Tensor:
    """Dr. GRPO; TRL 'dr_grpo': weight 1 / (sequences x max_tokens), a constant."""
    return (per_token * (mask / (max(norms.sequences, 1.0) * norms.max_tokens))).sum() * scale


LOSS_AGG_MODES = tuple(LOSS_AGGREGATIONS)  # the built-in modes


# --- KL to a reference policy ----------------------------------------------------------------------

register_kl = KL_ESTIMATORS.register


@register_kl("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log pi(a) - log pi_ref(a): unbiased, high variance (verl 'kl'; Schulman 2020, "Approximating KL
    divergence")."""
    return logp - ref_logp


@register_kl("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1: unbiased, non-negative, low variance (verl 'low_var_kl',
    GRPO's KL term), clamped to [-10, 10] as verl does."""
    d = ref_logp - logp
    return torch.clamp(torch.exp(d) - d - 1, min=-10.0, max=10.0)


# --- the rollout engine's log-probs against the trainer's: truncated importance sampling --------------
# pi_old (the trainer's recomputed log-probs of the sampled tokens) over pi_rollout (the engine's, vLLM's):
# the tokens were sampled from pi_rollout, the update assumes pi_old; the ratio, truncated at the cap,
# weighs each token's policy loss (Yao et al. 2025, "Your efficient RL framework secretly brings you
# off-policy RL training"; verl rollout_is, TRL vllm_importance_sampling_cap). No gradient flows through it.

register_correction = ROLLOUT_CORRECTIONS.register


@register_correction("tis")
def token_tis(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """[rows, tokens]: min(exp(old - rollout), cap) per token (0 off the mask)."""
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach() * mask


@register_correction("seq-tis")
def sequence_tis(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """[rows, tokens]: min(exp(sum over the row's tokens of old - rollout), cap), the same for every token
    of a row (0 off the mask)."""
    log_ratio = ((old_logp - rollout_logp) * mask).sum(-1, keepdim=True)
    return torch.exp(log_ratio).clamp(max=cap).detach() * mask


def rollout_correction(name: str, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       cap: float) -> torch.Tensor:
    """The weights of the correction registered as `name` (ript.rollout_correction)."""
    return ROLLOUT_CORRECTIONS[name](old_logp, rollout_logp, mask, cap)


def logp_mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                  over: float = 0.1) -> tuple[float, float, float, float]:
    """(tokens, sum of |old - rollout|, tokens whose difference is above `over`, the largest) on the mask."""
    diff = (old_logp - rollout_logp).abs() * mask
    return float(mask.sum()), float(diff.sum()), float(((diff > over) & (mask > 0)).sum()), \
        float(diff.max()) if diff.numel() else 0.0


# --- DAPO's soft overlong punishment ----------------------------------------------------------------

def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """0 up to max_tokens - buffer generated tokens, then falling linearly to -factor at max_tokens
    (DAPO, Yu et al. 2025, eq. 13; verl's DAPO reward manager)."""
    if buffer <= 0:
        return 0.0
    exceed = length - (max_tokens - buffer)
    return min(-exceed / buffer * factor, 0.0)


# --- what the updates did ------------------------------------------------------------------------------

@dataclass
class PolicyStats:
    """What one or more policy updates did, as sums over their valid tokens: exact across ranks
    (summed over ranks, divided once)."""

    loss: float = 0.0  # the aggregated loss, summed over the optimizer steps
    tokens: float = 0.0  # valid (action) tokens
    clipped: float = 0.0  # tokens whose ratio was clipped
    ratio: float = 0.0  # the importance ratio, summed over tokens
    advantage: float = 0.0  # the advantage, summed over tokens
    kl: float = 0.0  # the KL estimate to the reference, summed over tokens
    steps: float = 0.0  # optimizer steps (the loss is a mean over them)
    # the rollout engine's log-probs against the trainer's (rollouts with log-probs: vLLM's), first epoch
    rollout_tokens: float = 0.0  # tokens compared
    rollout_diff: float = 0.0  # |log pi_old - log pi_rollout|, summed over them
    rollout_over: float = 0.0  # tokens whose difference is above 0.1
    rollout_weight: float = 0.0  # the rollout correction's weight (tis_cap), summed over them
    rollout_diff_max: float = 0.0  # the largest difference (a maximum: MAXED)

    MAXED = ("rollout_diff_max",)  # reduced by their maximum, over updates and ranks; every other field: a sum

    def __add__(self, other: "PolicyStats") -> "PolicyStats":
        return PolicyStats(*(max(a, b) if f.name in self.MAXED else a + b
                             for f, a, b in zip(fields(self), self.vector(), other.vector())))

    def vector(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    def sums(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self) if f.name not in self.MAXED]

    def maxima(self) -> list[float]:
        return [getattr(self, name) for name in self.MAXED]

    @classmethod
    def from_reduced(cls, sums: list[float], maxima: list[float]) -> "PolicyStats":
        """From sums() and maxima() reduced over ranks (summed, maximum)."""
        summed, maxed = iter(sums), iter(maxima)
        return cls(*(next(maxed) if f.name in cls.MAXED else next(summed) for f in fields(cls)))

    def metrics(self, reference: bool = False) -> dict:
        """policy/* means per token (the loss: per optimizer step); only the token count when no
        token was trained on. policy/kl with a reference policy."""
        out = {"policy/tokens": self.tokens}
        if self.tokens == 0:
            return out
        out |= {"policy/loss": self.loss / max(self.steps, 1.0), "policy/clip_frac": self.clipped / self.tokens,
                "policy/ratio": self.ratio / self.tokens, "policy/advantage": self.advantage / self.tokens}
        if reference:
            out["policy/kl"] = self.kl / self.tokens
        if self.rollout_tokens:
            out |= {"rollout/logp_diff_mean": self.rollout_diff / self.rollout_tokens,
                    "rollout/logp_diff_max": self.rollout_diff_max,
                    "rollout/logp_diff_frac_over_0.1": self.rollout_over / self.rollout_tokens,
                    "rollout/tis_weight": self.rollout_weight / self.rollout_tokens}
        return out


def describe_algorithm(cfg) -> str:
    """The update's recipe in one phrase: `rloo, token-mean, clip 0.2/0.28, no KL`."""
    r = cfg.ript
    parts = [r.advantage + (f" (scale {r.scale_rewards})" if ADVANTAGES.entry(r.advantage).scaled else ""),
             r.loss_agg_mode,
             f"clip {r.clip_low:g}/{r.clip_high:g}",
             f"KL {r.kl_estimator} x {r.kl_coef:g} in the {r.kl_in}" if r.kl_coef else "no KL"]
    if r.mask_truncated:
        parts.append("truncated rollouts masked")
    if r.overlong_buffer:
        parts.append(f"overlong penalty over the last {r.overlong_buffer} tokens")
    return ", ".join(parts)
