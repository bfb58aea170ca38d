"""What transformers' own generate() did with the target: the tokens each target call committed.

The comparison times transformers' greedy decoding, assisted generation and prompt lookup beside treespec
(train/compare/peers.py's ``hf_peer``). Spec-Bench reports every method's mean accepted tokens per target pass,
so the peers need their accept lengths too, and transformers does not return them. ``TargetCalls`` reads them
off the target's forward calls: a forward pre-hook notes how many tokens the target's cache holds before each
call. In both of transformers' loops (plain decoding and ``_assisted_decoding``) the cache holds every committed
token but the last one when a call starts (assisted generation crops the rejected candidates' entries after
each call), so consecutive calls differ by the tokens the earlier one committed, and the last call committed
what is left of the final sequence.

Each call counts, the prefill included: transformers' assisted generation verifies the assistant's first
candidates in its prefill, so there the prefill is a verification pass like any other. Plain decoding's calls
each commit one token (τ = 1). treespec's own results leave the prefill out (it commits one token before
any pass); both conventions give accept lengths that sum to the tokens generated, once the prefill's token is
added to treespec's.
"""

from __future__ import annotations


def cached_length(kwargs: dict) -> int | None:
    """Tokens the target's cache holds when a forward call starts, read from the call's keyword arguments: its
    cache (``past_key_values``; ``cache`` in newer transformers releases), else the position of its first token
    (``cache_position``, ``position_ids``: one unpadded row, so position = tokens before it); None when the call
    says none of these."""
    for key in ("past_key_values", "cache"):
        cache = kwargs.get(key)
        if cache is not None and hasattr(cache, "get_seq_length"):
            return int(cache.get_seq_length())
    for key in ("cache_position", "position_ids"):
        position = kwargs.get(key)
        if position is not None and position.numel():
            return int(position.reshape(-1)[0])
    return None


class TargetCalls:
    """Within ``with TargetCalls(target, prompt_length) as calls: target.generate(...)``, the committed length
    before each target forward call; ``accept_lengths(final_length)`` then gives the tokens each call committed
    ([] when a call's cache length could not be read: the generation is then reported without them)."""

    def __init__(self, target, prompt_length: int):
        self.target, self.prompt_length = target, int(prompt_length)
        self.committed: list[int | None] = []  # committed tokens before each call
        self.handle = None

    def _hook(self, module, args, kwargs):
        if not self.committed:  # the prefill: the prompt is committed, nothing is cached yet
            self.committed.append(self.prompt_length)
            return
        cached = cached_length(kwargs)
        self.committed.append(None if cached is None else cached + 1)  # the last committed token is not cached

    def __enter__(self) -> TargetCalls:
        self.handle = self.target.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def accept_lengths(self, final_length: int) -> list[int]:
        """Tokens committed by each call, given the final sequence's length (prompt included)."""
        marks = [*self.committed, int(final_length)]
        if any(m is None for m in marks):
            return []
        lengths = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
        return lengths if all(n >= 1 for n in lengths) else []  # a loop this reading does not know: say nothing
