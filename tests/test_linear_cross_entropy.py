"""The fused output layer and loss (``project/models/linear_cross_entropy.py``, ``model.fused_loss``) against torch's
own: ``F.cross_entropy`` of ``F.linear``'s logits, its loss and both gradients, in float64 to rounding, under bf16
autocast to bf16's precision; and the language model's head and loss with it against the head and loss without."""

import pytest
import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from project.models.gpt import GPT
from project.models.linear_cross_entropy import IGNORE_INDEX, LOGITS_PER_CHUNK, chunk_rows, linear_cross_entropy
from project.tasks.language_model import TokenCrossEntropy

pytestmark = pytest.mark.torch_internals


def problem(dtype: torch.dtype, rows: int = 21, dim: int = 16, vocab: int = 50):
    """Hidden states (3, rows / 3, dim), an output weight (vocab, dim), targets with a prompt's worth ignored."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, rows // 3, dim, dtype=dtype, generator=generator).requires_grad_()
    weight = torch.randn(vocab, dim, dtype=dtype, generator=generator).requires_grad_()
    target = torch.randint(0, vocab, (3, rows // 3), generator=generator)
    target[0, :3] = IGNORE_INDEX
    return hidden, weight, target


def torchs(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), target.flatten(), reduction="sum")


@pytest.mark.parametrize("rows", [1, 4, 64], ids=["1", "4", "whole"])
def test_loss_and_both_gradients_equal_torchs_in_float64(rows):
    """Chunks of 1, 4 and all 21 tokens (of a 50-token vocabulary), the targets' ignored rows included, and a
    gradient scale from backward (1.7) applied."""
    hidden, weight, target = problem(torch.float64)
    expected = torch.autograd.grad(torchs(hidden, weight, target) * 1.7, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, target, logits_per_chunk=rows * 50)
    assert loss.item() == pytest.approx(torchs(hidden, weight, target).item(), rel=1e-13)
    for got, want in zip(torch.autograd.grad(loss * 1.7, (hidden, weight)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_under_bf16_autocast_it_is_torchs_to_bf16_precision():
    """The logits in bf16 (autocast's Linear), their softmax in float32 (autocast's cross_entropy): the loss to
    float32 rounding, the gradients to bf16's (the weight's summed chunk by chunk, each chunk's rounded)."""
    hidden, weight, target = problem(torch.float32, rows=96, vocab=200)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss = torchs(hidden, weight, target)
        loss = linear_cross_entropy(hidden, weight, target, logits_per_chunk=32 * 200)
    assert loss.dtype == expected_loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    expected = torch.autograd.grad(expected_loss, (hidden, weight))
    for got, want in zip(torch.autograd.grad(loss, (hidden, weight)), expected):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


def test_a_frozen_weight_gets_no_gradient_and_evaluation_none_at_all():
    """Frozen (LoRA's base): the hidden states' gradient alone. In evaluation (no grad mode, inputs that would
    want gradients): the loss's own FLOPs alone, 2 x tokens x dim x vocab for the logits, as the plain loss's
    forward, where the gradients of both would add twice that."""
    hidden, weight, target = problem(torch.float64)
    frozen = weight.detach()
    loss = linear_cross_entropy(hidden, frozen, target)
    (grad,) = torch.autograd.grad(loss, hidden)
    torch.testing.assert_close(grad, torch.autograd.grad(torchs(hidden, frozen, target), hidden)[0])
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        loss = linear_cross_entropy(hidden, weight, target)
    assert not loss.requires_grad and flops.get_total_flops() == 2 * 21 * 16 * 50


def test_chunks_hold_at_most_a_gib_of_float32_logits_in_a_power_of_two_of_tokens():
    assert chunk_rows(rows=16384, vocab=50304) == 4096  # GPT-2's vocabulary: 2^28 / 50304 = 5336 -> 4096, 4 chunks
    assert chunk_rows(rows=8192, vocab=128256) == 2048  # Llama 3's: 2093 -> 2048
    assert chunk_rows(rows=512, vocab=96) == 512  # they fit: one chunk
    assert chunk_rows(rows=256, vocab=96, logits_per_chunk=8192) == 64  # the tests' runs: 85 -> 64, 4 chunks
    assert chunk_rows(rows=10, vocab=2**29) == 1  # a token's logits over the budget: a token at a time
    for rows, vocab in ((16384, 50304), (8192, 128256), (100000, 5000), (3000, 151936)):
        chunk = chunk_rows(rows, vocab)
        assert chunk & (chunk - 1) == 0 and chunk * vocab <= LOGITS_PER_CHUNK < 2 * chunk * vocab


def test_the_gpts_head_gives_the_token_loss_of_its_logits():
    """``net(tokens, target)`` (a tied output layer) against ``TokenCrossEntropy`` of ``net(tokens)``."""
    torch.manual_seed(0)
    net = GPT(vocab_size=96, max_length=16, num_layers=2, dim=32, num_heads=2, tie_weights=True).double()
    tokens = torch.randint(0, 96, (4, 16))
    target = torch.randint(0, 96, (4, 16))
    fused = net(tokens, target) / target.numel()
    plain = TokenCrossEntropy()(net(tokens), target)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-13)
    for got, want in zip(
        torch.autograd.grad(fused, list(net.parameters())), torch.autograd.grad(plain, list(net.parameters()))
    ):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)


def test_the_compiled_token_loss_is_the_eager_one():
    """model.compile's loss (``TokenCrossEntropy.compile_summed``: inductor's kernels) against eager's: the loss and
    the logits' gradient, ignored targets included, to float32 rounding."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, 300, generator=generator).requires_grad_()
    target = torch.randint(0, 300, (4, 16), generator=generator)
    target[0, :5] = IGNORE_INDEX
    eager, compiled = TokenCrossEntropy(), TokenCrossEntropy()
    compiled.compile_summed()
    expected = eager(logits, target)
    loss = compiled(logits, target)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(expected, logits)[0])


def test_the_compiled_chunks_are_the_eager_ones():
    """The fused loss under model.compile (each chunk's work by inductor's kernels) against its eager self: the loss
    and both gradients to float32 rounding, over 6 chunks of 4 tokens (the last of 1), ignored targets included."""
    hidden, weight, target = problem(torch.float32)
    eager = linear_cross_entropy(hidden, weight, target, logits_per_chunk=4 * 50)
    compiled = linear_cross_entropy(hidden, weight, target, logits_per_chunk=4 * 50, compiled=True)
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-6)
    for got, want in zip(torch.autograd.grad(compiled, (hidden, weight)), torch.autograd.grad(eager, (hidden, weight))):
        torch.testing.assert_close(got, want)
