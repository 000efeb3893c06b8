"""token_logprobs / entropy_from_logits / sequence_logprobs."""

import math

import pytest
import torch

from posttrain.ops import entropy_from_logits, sequence_logprobs, token_logprobs


def _reference_logprobs(logits, tokens, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _reference_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_token_logprobs_golden():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [1/4, 3/4]
    tokens = torch.tensor([[1]])
    # log(3/4) = -0.2877
    assert token_logprobs(logits, tokens).item() == pytest.approx(-0.28768, abs=1e-5)
    # T = 2: logits / 2 = [0, ln(3)/2] -> p1 = sqrt(3) / (1 + sqrt(3)) = 1.73205 / 2.73205 = 0.63397
    # log(0.63397) = -0.45575
    assert token_logprobs(logits, tokens, temperature=2.0).item() == pytest.approx(
        -0.45575, abs=1e-5
    )


def test_entropy_golden():
    # uniform over 4: ln 4 = 1.3863; p = [1/4, 3/4]: 0.25*1.3863 + 0.75*0.2877 = 0.5623
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]])
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[1.38629, 0.56233]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_chunked_matches_reference_value_and_grad(chunk_size, temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17) * 3
    tokens = torch.randint(0, 17, (3, 5))
    weights = torch.randn(3, 5)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = token_logprobs(a, tokens, temperature=temperature, chunk_size=chunk_size)
    want = _reference_logprobs(b, tokens, temperature)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("chunk_size", [2, 10_000])
def test_entropy_chunked_matches_reference_value_and_grad(chunk_size):
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 13) * 2
    weights = torch.randn(2, 6)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = entropy_from_logits(a, chunk_size=chunk_size, temperature=1.3)
    want = _reference_entropy(b, 1.3)
    torch.testing.assert_close(got, want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_gradcheck_fp64():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, 0.8, chunk_size=4),
                                    (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 4, 0.8), (logits,))


def test_bf16_logits_upcast_per_chunk():
    torch.manual_seed(3)
    logits = (torch.randn(2, 4, 33) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 33, (2, 4))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = token_logprobs(a, tokens, temperature=0.9, chunk_size=3)
    want = _reference_logprobs(b, tokens, 0.9)  # fp32 math on the same bf16 values
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad, b.grad, atol=1e-2, rtol=1e-2)
    ent = entropy_from_logits(logits, chunk_size=3)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent, _reference_entropy(logits))


def test_no_full_fp32_copy_saved_for_backward():
    # Every tensor autograd keeps for backward is either the bf16 logits themselves or small.
    b, t, v = 4, 8, 64
    logits = torch.randn(b, t, v).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t))
    saved: list[torch.Tensor] = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        token_logprobs(logits, tokens, chunk_size=5).sum().backward()
        entropy_from_logits(logits, chunk_size=5).sum().backward()
    assert saved, "expected the hooks to see saved tensors"
    for x in saved:
        assert x.dtype == torch.bfloat16 or x.numel() <= b * t, (x.dtype, tuple(x.shape))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(2, 3, 5), chunk_size=0)


def test_sequence_logprobs_golden():
    logprobs = torch.tensor([[-1.0, -2.0, -50.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # sums: -1 - 2 = -3; -1.5. means: -3 / 2 = -1.5; -1.5 / 3 = -0.5
    torch.testing.assert_close(sequence_logprobs(logprobs, mask), torch.tensor([-3.0, -1.5]))
    torch.testing.assert_close(
        sequence_logprobs(logprobs, mask, average=True), torch.tensor([-1.5, -0.5])
    )


@pytest.mark.parametrize("chunk_size", [1, 4, 9, 100])
def test_shifted_noncontiguous_view_and_2d_input(chunk_size):
    torch.manual_seed(4)
    full = torch.randn(3, 6, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6))
    logits, tokens = full[:, :-1], ids[:, 1:]  # the usual shift; a non-contiguous view
    assert not logits.is_contiguous()
    got = token_logprobs(logits, tokens, chunk_size=chunk_size)
    torch.testing.assert_close(got, _reference_logprobs(logits, tokens))
    (grad,) = torch.autograd.grad(got.sum(), full)
    (want,) = torch.autograd.grad(_reference_logprobs(logits, tokens).sum(), full)
    torch.testing.assert_close(grad, want)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk_size),
                               _reference_entropy(logits))
    # [T, V] input works too
    torch.testing.assert_close(token_logprobs(full[0], ids[0], chunk_size=chunk_size),
                               _reference_logprobs(full[0], ids[0]))
    torch.testing.assert_close(entropy_from_logits(full[0], chunk_size=chunk_size),
                               _reference_entropy(full[0]))
