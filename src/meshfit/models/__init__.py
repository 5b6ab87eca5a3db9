"""Small reference models for demos, tests and benchmarks."""

from meshfit.models.gpt import GPT, GPTConfig, next_token_loss

__all__ = ["GPT", "GPTConfig", "next_token_loss"]
