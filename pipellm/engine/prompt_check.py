"""The rules every prompt meets, offline (EngineCore.add_request) and served (the OpenAI server
checks them before a request reaches the engine, so a bad prompt is a 400, not a failed stream)."""

from __future__ import annotations


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raises ValueError naming the broken rule and its fix."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty; give at least one token")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"prompt token id {bad} is out of range: ids must lie in [0, {vocab_size})"
        )
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{len(prompt_token_ids)} tokens; shorten it so that at least one new token fits "
            "(or raise max_model_len)."
        )
