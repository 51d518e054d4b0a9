"""Leave-one-out advantages, the dynamic-sampling filter, and the clipped policy loss (pure)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean of the other K-1 rewards, per group (rows: contexts, columns: K rollouts).

    RLOO: Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free"; Ahmadian et al. 2024.
    """
    k = rewards.shape[-1]
    if k < 2:
        raise ValueError("RLOO needs at least 2 rollouts per context")
    others = (rewards.sum(-1, keepdim=True) - rewards) / (k - 1)
    return rewards - others


def keep_mask(rewards: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling keeps a context only when its K rewards disagree: 0 < sum < K."""
    total = rewards.sum(-1)
    return (total > 0) & (total < rewards.shape[-1])


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate with separate low / high clip (DAPO-style), token-level.

    logp, old_logp, mask: [rows, tokens]; advantages: [rows]. Padded rows and tokens have mask 0 and
    contribute exactly zero gradient. Returns (loss summed over valid tokens, stats); the caller
    divides by the global token count so the result is exact across ranks.
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped) * mask
    with torch.no_grad():
        valid = mask.sum()
        was_clipped = ((unclipped > clipped) & (mask > 0)).sum()
        stats = {"tokens": float(valid), "clipped_tokens": float(was_clipped),
                 "ratio_sum": float((ratio * mask).sum())}
    return per_token.sum(), stats


@dataclass
class PolicyStats:
    """What one or more policy updates did, as sums over their valid tokens: exact across ranks
    (summed over ranks, divided once)."""

    loss: float = 0.0  # the clipped surrogate, summed over tokens
    tokens: float = 0.0  # valid (action) tokens
    clipped: float = 0.0  # tokens whose ratio was clipped
    ratio: float = 0.0  # the importance ratio, summed over tokens
    advantage: float = 0.0  # the advantage, summed over tokens

    def __add__(self, other: "PolicyStats") -> "PolicyStats":
        return PolicyStats(*(a + b for a, b in zip(self.vector(), other.vector())))

    def vector(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_vector(cls, values: list[float]) -> "PolicyStats":
        return cls(*values)

    def metrics(self) -> dict:
        """policy/* means per token; only the token count when no token was trained on."""
        out = {"policy/tokens": self.tokens}
        if self.tokens == 0:
            return out
        return out | {"policy/loss": self.loss / self.tokens, "policy/clip_frac": self.clipped / self.tokens,
                      "policy/ratio": self.ratio / self.tokens, "policy/advantage": self.advantage / self.tokens}
