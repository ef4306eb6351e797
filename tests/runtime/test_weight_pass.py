"""The two-pass backward (``runtime.pipeline.weight_pass``) equals one ``backward``."""
import pytest
import torch
from torch import nn

from runtime.pipeline.weight_pass import input_first


class Block(nn.Module):
    """Two linears, a LayerNorm, one weight used twice (two paths into one parameter group), a frozen and an unused one."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.ln = nn.Linear(6, 8), nn.Linear(8, 6), nn.LayerNorm(8)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        h = torch.tanh(self.ln(self.a(x)))
        return self.b(h) + self.frozen(x) @ self.b.weight @ self.a.weight


def _run(split: bool, scalar: bool):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 6, requires_grad=True)
    out = block(x)
    grad = None if scalar else torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out = out.square().mean() if scalar else out
    if not split:
        out.backward(grad)
        return x.grad, {n: p.grad for n, p in block.named_parameters()}
    weight_pass = input_first([out], None if grad is None else [grad], [x], block.parameters())
    assert x.grad is not None
    assert all(p.grad is None for p in block.parameters()), "weights' gradients wait for the weight pass"
    weight_pass()
    return x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("scalar", [False, True], ids=["output_grad", "loss"])
def test_input_first_then_weights_equals_one_backward(scalar):
    dx, grads = _run(False, scalar)
    dx2, grads2 = _run(True, scalar)
    torch.testing.assert_close(dx2, dx, rtol=1e-6, atol=0)
    assert grads.keys() == grads2.keys()
    for name in grads:
        if grads[name] is None:
            assert grads2[name] is None, name
        else:
            torch.testing.assert_close(grads2[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)
