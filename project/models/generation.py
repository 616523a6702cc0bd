"""Text from a language model: sampling with temperature, top-k and top-p, one token at a time; and a group of
completions of one prompt drawn together (GRPO's)."""

import torch
from torch import nn

from project.models.kv_cache import KeyValueCache
from project.models.sequence import BlockSequence


def check_settings(max_new_tokens: int, temperature: float, top_k: int | None) -> str | None:
    """What is wrong with these sampling settings (the setting's name first), or None."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        return f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}"
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        return f"temperature: must be a number of at least 0 (0: the most likely token), got {temperature!r}"
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        return f"top_k: must be a positive integer, or null for every token, got {top_k!r}"
    return None


@torch.no_grad()
def generate(
    net: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    max_length: int | None = None,
    stop: int | None = None,
) -> list[int]:
    """``max_new_tokens`` tokens continuing ``prompt``, each drawn from the model's next-token distribution divided
    by ``temperature`` (0: the most likely token) and cut to the ``top_k`` most likely (None: all).

    Every rank of a sharded model must call this together (the forward gathers shards); the draws come from a
    generator seeded with ``seed`` on the CPU, so every rank draws the same tokens. Each step runs the whole
    context again (no key/value cache: short samples of small models), cut to ``max_length`` tokens (a learned
    position table's size); ``stop``: a token after which to stop (a chat model's end of turn), kept."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token to continue")
    device = next(net.parameters()).device
    tokens = torch.tensor([prompt], device=device)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        context = tokens if max_length is None else tokens[:, -max_length:]
        logits = net(context)[0, -1].float().cpu()
        token = logits.argmax() if temperature == 0 else draw(logits[None], generator, temperature, top_k or 0)[0]
        tokens = torch.cat([tokens, token.view(1, 1).to(device)], dim=1)
        if stop is not None and int(token) == stop:
            break
    return tokens[0, len(prompt) :].tolist()


def draw(
    logits: torch.Tensor, generator: torch.Generator, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """One token per row of (rows, vocab) CPU logits, drawn as transformers' sampling draws it: divided by
    ``temperature``, cut to the ``top_k`` most likely (0: all), then to the fewest most likely whose probability
    reaches ``top_p`` (1: all; transformers' ``TopPLogitsWarper``: at least one kept)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[:, -1:], float("-inf"))
    if top_p < 1.0:
        ascending, order = logits.sort(-1)
        cut = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        cut[:, -1] = False
        logits = logits.scatter(-1, order, ascending.masked_fill(cut, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample_group(
    net: BlockSequence,
    prompt: torch.Tensor,
    count: int,
    max_new_tokens: int,
    generator: torch.Generator,
    stop: set[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` completions of ``prompt`` (its token ids, on the net's device), drawn together (``draw``) from
    ``generator``, each up to ``max_new_tokens`` tokens and ending at the first token of ``stop`` (kept): their
    tokens (count, max_new_tokens), the positions after each one's end 0, and each one's length. The prompt's pass
    runs once for the group's rows, each later pass one token a row, over the keys and values a ``KeyValueCache``
    keeps. A sharded net's units must be gathered around it (``gathered_throughout``): its ranks stop apart."""
    device = prompt.device
    cache = KeyValueCache(len(net.blocks), len(prompt) + max_new_tokens)
    tokens = prompt.expand(count, -1)
    drawn = torch.zeros(count, max_new_tokens, dtype=torch.long)
    lengths = torch.full((count,), max_new_tokens)
    ended = torch.zeros(count, dtype=torch.bool)
    stops = torch.tensor(sorted(stop), dtype=torch.long)
    for step in range(max_new_tokens):
        logits = net(tokens, cache=cache)[:, -1].float().cpu()
        token = draw(logits, generator, temperature, top_k, top_p)
        drawn[:, step] = token
        ending = ~ended & torch.isin(token, stops)
        lengths[ending] = step + 1
        ended |= ending
        if ended.all():
            break
        tokens = token[:, None].to(device)
    after = torch.arange(max_new_tokens)[None] >= lengths[:, None]
    return drawn.masked_fill(after, 0), lengths
