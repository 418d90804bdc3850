"""From logits to the distributions that drafting and verification sample from.

``logits_to_probs`` applies temperature, then top-k, then top-p (nucleus), the order Hugging Face's
``generate`` uses. The same function gives the draft distribution ``q`` (what a draft token was really
sampled from) and the target distribution ``p`` (what the output must follow); :mod:`.verify` holds the rule
that accepts a draft drawn from ``q`` against ``p``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_sampling_args(temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise ``ValueError`` with a clear message for nonsense sampling settings."""
    if not isinstance(temperature, (int, float)) or temperature < 0 or temperature != temperature:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}.")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}.")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}.")


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``[..., V]`` logits -> ``[..., V]`` float32 probabilities after temperature, top-k and top-p.

    ``temperature`` must be > 0 here: greedy decoding (temperature 0) takes an argmax instead.
    Entries of ``-inf`` stay at probability 0.
    """
    if temperature <= 0:
        raise ValueError("logits_to_probs needs temperature > 0; greedy decoding uses argmax.")
    logits = logits.float() / temperature  # [..., V]
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [..., V]
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def uniform(shape, generator: torch.Generator | None, dtype: torch.dtype, device: torch.device) -> Tensor:
    """U[0, 1) draws from ``generator``'s own device (the engine seeds a CPU generator), moved to ``device``:
    the same seed gives the same draws on a CPU and on a GPU."""
    where = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, dtype=dtype, device=where).to(device)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``probs [..., V]`` -> ``[...]`` int64, by inverting the CDF (in float64).

    Several times faster than ``torch.multinomial`` on a 49k vocabulary, and it never returns a token of
    probability 0: it takes the first token whose CDF exceeds ``u * total``."""
    flat = probs.reshape(-1, probs.shape[-1]).double()  # [n, V]
    cdf = flat.cumsum(-1)  # [n, V]
    u = uniform((flat.shape[0], 1), generator, torch.float64, flat.device)  # [n, 1]
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(flat.shape[-1] - 1)  # [n, 1]
    return idx.reshape(probs.shape[:-1])
