"""The keys and values a decoder's attention layers have computed, kept between the forward passes of generation
(a key/value cache): after the prompt's pass, each new token's pass runs that token alone and attends over what the
cache holds, instead of running the whole context again."""

import torch


class LayerCache:
    """One attention layer's keys and values of the positions seen so far (``length`` of them), in buffers of
    ``capacity`` positions made at the first call, of its values' rows, heads, width, dtype and device."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys`` and ``values`` (batch, heads, new positions, head_dim); every position's so far."""
        start, end = self.length, self.length + keys.shape[2]
        if start and end > start + 1:
            # A causal mask between new and cached positions is not built: a later pass is one token.
            raise ValueError("after the first pass, a key/value cache takes one position a pass")
        if end > self.capacity:
            raise ValueError(f"the key/value cache holds {self.capacity} positions; {end} asked")
        if self.keys is None or self.values is None:
            shape = (*keys.shape[:2], self.capacity, keys.shape[3])
            # Both in the values' dtype: under autocast a normalised key is float32 (Qwen 3's), but the attention
            # casts it to the values' half precision anyway; kept as float32 it would take twice the bytes.
            self.keys, self.values = values.new_empty(shape), values.new_empty(shape)
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KeyValueCache:
    """A ``LayerCache`` for each of ``layers`` blocks, each of ``capacity`` positions (a prompt and what is drawn
    after it); ``length``: the positions seen, where the next pass's first token stands."""

    def __init__(self, layers: int, capacity: int) -> None:
        self.layers = [LayerCache(capacity) for _ in range(layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length
