"""Toy reward functions for the GRPO examples (`--reward_funcs grpo_rewards.<name>` from the examples folder)."""


def distinct_characters(completions, **kwargs):
    """More distinct characters in the completion, more reward (in [0, 1]); any completion can be scored."""
    return [len(set(c)) / max(1, len(c)) if c else 0.0 for c in completions]


def letter_fraction(completions, **kwargs):
    """Share of letters in the completion (in [0, 1])."""
    return [sum(ch.isalpha() for ch in c) / len(c) if c else 0.0 for c in completions]
