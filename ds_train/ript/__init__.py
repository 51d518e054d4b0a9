"""RIPT: reinforcement interactive post-training (RLOO with dynamic rollout sampling).

Tan et al. 2025, "Interactive Post-Training for Vision-Language-Action Models". Tasks give contexts,
a policy runs episodes, rewards are binary success; advantages are leave-one-out (RLOO), contexts
whose K rollouts all agree are dropped, and the policy is updated with a PPO-style clipped loss.
"""
