"""Text from a language model: sampling with temperature and top-k, one token at a time."""

import torch
from torch import nn


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
        if temperature == 0:
            token = logits.argmax()
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[0]
        tokens = torch.cat([tokens, token.view(1, 1).to(device)], dim=1)
        if stop is not None and int(token) == stop:
            break
    return tokens[0, len(prompt) :].tolist()
