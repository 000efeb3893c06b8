"""Golden and property tests of the fused chunked LM head + log-softmax (ops/fused_head.py)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.ops import entropy_from_logits, head_logprobs, token_logprobs
from posttrain.ops.fused_head import block_rows


def test_golden_two_token_vocab():
    # h = [1, 0], W = [[1, 0], [0, 0]] -> logits [1, 0]; token 0:
    # log p = 1 - log(e^1 + e^0) = 1 - 1.31326 = -0.31326
    # entropy = lse - sum p z = 1.31326 - 0.73106 * 1 = 0.58220
    h = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    lp, ent = head_logprobs(h, w, torch.tensor([0]), with_entropy=True)
    assert lp.item() == pytest.approx(1 - math.log(math.e + 1), abs=1e-6)
    assert lp.item() == pytest.approx(-0.31326, abs=1e-5)
    assert ent.item() == pytest.approx(0.58220, abs=1e-5)


@pytest.mark.parametrize("block_elements", [7, 64, 1 << 20])  # 1 row, a few rows, all rows
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_unfused_values_and_gradients(block_elements, temperature, bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    tok = torch.randint(0, 7, (3, 5), generator=g)
    go = torch.randn(3, 5, dtype=torch.float64, generator=g)

    logits = torch.nn.functional.linear(h, w, b)
    want = token_logprobs(logits, tok, temperature=temperature)
    want_ent = entropy_from_logits(logits.detach(), temperature=temperature)
    params = [h, w] + ([b] if bias else [])
    want_grads = torch.autograd.grad((want * go).sum(), params)

    got, ent = head_logprobs(h, w.float(), tok, bias=None if b is None else b.float(),
                             temperature=temperature, with_entropy=True,
                             block_elements=block_elements)
    assert got.dtype == torch.float32 and ent.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert torch.allclose(ent.double(), want_ent, atol=1e-5)
    assert not ent.requires_grad
    got2, _ = head_logprobs(h, w, tok, bias=b, temperature=temperature,
                            block_elements=block_elements)
    got_grads = torch.autograd.grad((got2 * go).sum(), params)
    for a, e in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(a.double(), e, atol=1e-5)


def test_logprobs_are_normalised_over_the_vocab():
    """Property: sum over every token v of exp(logp(v)) = 1 for each row."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(4, 6, generator=g), torch.randn(11, 6, generator=g)
    total = sum(head_logprobs(h, w, torch.full((4,), v), block_elements=22)[0].exp()
                for v in range(11))
    assert torch.allclose(total, torch.ones(4), atol=1e-5)


def test_block_rows_bounds_the_block():
    assert block_rows(1024, 151_936, 1 << 23) == 55  # 8,388,608 // 151,936
    assert block_rows(10, 100, 1 << 23) == 10
    assert block_rows(10, 10**9, 1) == 1


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="hidden"):
        head_logprobs(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="weight"):
        head_logprobs(torch.zeros(2, 3), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        head_logprobs(torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long),
                      temperature=0.0)


def test_grad_in_place_adds_into_the_weights_grad_across_micro_batches():
    """grad_in_place=True: grad_W is added into weight.grad (created on the first call), equal
    to the autograd-returned gradient summed over two backward passes; hidden and bias
    gradients are unchanged."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(11, 5, generator=gen)
    b0 = torch.randn(11, generator=gen)
    batches = [(torch.randn(7, 5, generator=gen), torch.randint(0, 11, (7,), generator=gen))
               for _ in range(2)]
    out = []
    for in_place in (False, True):
        w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
        grads_h = []
        for h, tok in batches:
            h = h.clone().requires_grad_(True)
            lp, _ = head_logprobs(h, w, tok, bias=b, temperature=0.7, block_elements=22,
                                  grad_in_place=in_place)
            (lp * torch.arange(1.0, 8.0)).sum().backward()
            grads_h.append(h.grad)
        out.append((w.grad.clone(), b.grad.clone(), grads_h))
    (w_ref, b_ref, h_ref), (w_got, b_got, h_got) = out
    assert w_ref.abs().sum() > 0
    assert torch.allclose(w_got, w_ref, atol=1e-5)
    assert torch.allclose(b_got, b_ref, atol=1e-6)
    assert all(torch.allclose(a, c, atol=1e-6) for a, c in zip(h_got, h_ref, strict=True))


@pytest.mark.parametrize("block_elements", [7, 64, 1 << 20])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_gradient_matches_autograd_of_the_full_logits(block_elements, temperature):
    """entropy_grad=True: d(sum go*logp + ge*H) by column blocks equals autograd through the
    full [M, V] logits (the loop form against the vectorised one); the head runs in fp32."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    tok = torch.randint(0, 11, (4, 3), generator=g)
    go, ge = (torch.randn(4, 3, dtype=torch.float64, generator=g) for _ in range(2))
    logits = torch.nn.functional.linear(h, w, b)
    want = (token_logprobs(logits, tok, temperature=temperature) * go
            + entropy_from_logits(logits, temperature=temperature) * ge).sum()
    want_grads = torch.autograd.grad(want, [h, w, b])
    lp, ent = head_logprobs(h, w, tok, bias=b, temperature=temperature, with_entropy=True,
                            block_elements=block_elements, entropy_grad=True)
    assert ent.requires_grad
    got_grads = torch.autograd.grad((lp * go + ent * ge).sum(), [h, w, b])
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a.double(), e, atol=5e-5, rtol=1e-4)  # fp32 logits


def test_entropy_gradient_golden_two_token_vocab():
    # logits z = [1, 0]: p = [0.73106, 0.26894], H = 0.58220
    # dH/dz_j = -p_j (log p_j + H): z_0: -0.73106 * (-0.31326 + 0.58220) = -0.19661
    #                               z_1: -0.26894 * (-1.31326 + 0.58220) = +0.19661
    # h = [1, 0] and W = [[1, 0], [0, 0]]: dH/dW[v, 0] = dH/dz_v * h_0, dH/dW[v, 1] = 0
    h = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)
    _, ent = head_logprobs(h, w, torch.tensor([0]), with_entropy=True, entropy_grad=True)
    ent.sum().backward()
    assert w.grad[:, 0].tolist() == pytest.approx([-0.19661, 0.19661], abs=1e-5)
    assert w.grad[:, 1].tolist() == [0.0, 0.0]


def test_block_size_by_device():
    """CPU: 8M fp32 elements (32 MB) as before; a GPU: 128M (512 MB), at most 1/64 of its
    memory: 24 GB / 256 bytes = 93,750,000 elements; never below the CPU's block."""
    from posttrain.ops.head_blocks import device_block_elements

    assert device_block_elements("cpu") == 1 << 23
    assert device_block_elements("cuda", 141 * 10**9) == 1 << 27
    assert device_block_elements("cuda", 24 * 10**9) == 93_750_000
    assert device_block_elements("cuda", 10**9) == 1 << 23
    assert device_block_elements("cuda") == 1 << 27  # memory unknown
    h, w = torch.randn(4, 6), torch.randn(11, 6)  # the default (None) is the CPU's block
    tok = torch.arange(4)
    assert torch.equal(head_logprobs(h, w, tok)[0], head_logprobs(h, w, tok,
                                                                  block_elements=1 << 23)[0])


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(13, 16, generator=g, requires_grad=True)
    b = torch.randn(13, generator=g, requires_grad=True)
    return h, w, b, torch.randint(0, 13, (6,), generator=g), torch.randn(6, generator=g)


@pytest.mark.parametrize("block_elements", [13, 40, 1 << 20])
def test_bf16_precision_is_bf16_inputs_with_fp32_arithmetic(block_elements):
    """precision=bf16: the log-probs are those of the head on bf16-ROUNDED hidden states and
    weights computed in float64 (to fp32 rounding), not the fp32 head's (they differ by the
    input rounding, ~1e-2 here); gradients match float64 autograd of that rounded head up to
    the bf16 rounding of the logits' gradient (cosine > 0.999)."""
    from posttrain.ops import token_logprobs

    h, w, b, tok, go = _case()
    hr, wr = (x.detach().bfloat16().double().requires_grad_(True) for x in (h, w))
    br = b.detach().double().requires_grad_(True)
    want = token_logprobs(torch.nn.functional.linear(hr, wr, br), tok, temperature=0.7)
    got, _ = head_logprobs(h, w, tok, bias=b, temperature=0.7, precision="bf16",
                           block_elements=block_elements)
    fp32, _ = head_logprobs(h, w, tok, bias=b, temperature=0.7)
    torch.testing.assert_close(got.double(), want, rtol=0.0, atol=1e-5)
    assert (fp32.double() - want).abs().max() > 1e-3  # the rounding is really applied
    want_g = torch.autograd.grad((want * go.double()).sum(), [hr, wr, br])
    got_g = torch.autograd.grad((got * go).sum(), [h, w, b])
    for a, e in zip(got_g, want_g, strict=True):
        assert a.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(a.double().flatten(), e.flatten(), dim=0)
        assert cos > 0.999, float(cos)


def test_precision_context_and_tf32_on_cpu():
    """`head_precision` sets the precision of the calls inside it (an explicit `precision`
    wins); tf32 only changes CUDA matmuls, so on the CPU it equals fp32 bit for bit."""
    from posttrain.ops.head_blocks import current_head_precision, head_precision

    h, w, b, tok, _ = _case(1)
    fp32 = head_logprobs(h, w, tok, bias=b)[0]
    bf16 = head_logprobs(h, w, tok, bias=b, precision="bf16")[0]
    with head_precision("bf16"):
        assert current_head_precision() == "bf16"
        assert torch.equal(head_logprobs(h, w, tok, bias=b)[0], bf16)
        assert torch.equal(head_logprobs(h, w, tok, bias=b, precision="fp32")[0], fp32)
        with head_precision("tf32"):
            assert torch.equal(head_logprobs(h, w, tok, bias=b)[0], fp32)
    assert current_head_precision() == "fp32"
    with pytest.raises(ValueError, match="precision 'fp16'"):
        head_logprobs(h, w, tok, precision="fp16")
    with pytest.raises(ValueError, match="expected one of"), head_precision("half"):
        pass
