"""``LocalParameters``: a one-device module run on plain tensors gives the dispatched path's gradients, in global tensors."""
from __future__ import annotations

import torch
from torch import nn

import sbp_core as sc
from sbp_core import sbp


class Net(nn.Module):
    """A sparse embedding, a buffer, and one weight tied under two names (``lin`` and ``lin2``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin, self.lin2, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
        self.lin2.weight = self.lin.weight
        self.register_buffer("scale", torch.tensor([2.0, 1.0, 0.5, 1.0]))

    def forward(self, ids):
        h = torch.tanh(self.lin2(self.lin(self.emb(ids) * self.scale)))
        return torch.log_softmax(self.head(h), -1).square().mean()


def _dense(g):
    return (g.to_dense() if g.is_sparse else g).full_tensor()


def test_local_run_gives_the_dispatched_gradients_in_the_parameters_layouts():
    p = sc.placement("cpu", [0])
    torch.manual_seed(0)
    model = sc.distribute_module(Net(), p)
    params = dict(model.named_parameters())
    batches = [torch.tensor([[1, 2, 3], [3, 4, 5]]), torch.tensor([[0, 9, 3], [7, 7, 2]])]
    want_loss = []
    with sc.defer_grad_boxing():  # as a pipeline accumulates micro-batches
        for b in batches:
            loss = model(sc.distribute(b, p, (sbp.broadcast,)))
            loss.backward()
            want_loss.append(float(loss.detach().full_tensor()))
    want = {n: _dense(q.grad) for n, q in params.items()}
    model.zero_grad(set_to_none=True)

    shards = sc.LocalParameters(model)
    assert sc.runs_local(p)
    shards.swap()
    assert not any(isinstance(q, sc.GlobalTensor) for q in model.parameters())
    assert model.lin.weight is model.lin2.weight and not isinstance(model.scale, sc.GlobalTensor)
    got_loss = []
    for b in batches:
        loss = model(b)
        loss.backward()
        got_loss.append(float(loss.detach()))
    shards.restore()
    assert dict(model.named_parameters()) == params  # the same parameter objects are back
    assert isinstance(model.scale, sc.GlobalTensor)
    assert got_loss == want_loss
    for n, q in params.items():
        assert isinstance(q.grad, sc.SparseGlobalTensor if n == "emb.weight" else sc.GlobalTensor), n
        assert q.grad.layout.placement == p and q.grad.sbp == q.sbp, n
        assert torch.equal(_dense(q.grad), want[n]), n

    # The optimizer steps the global parameters in place: the next swap's leaves see the new values.
    # The reference is torch's own SGD step on a plain copy: ``before - 0.1 * grad`` written out
    # rounds twice where the kernel may fuse the multiply-add (it does on some CPUs and releases).
    ref = torch.nn.Parameter(model.head.weight.full_tensor().clone())
    ref.grad = want["head.weight"].clone()
    torch.optim.SGD([ref], lr=0.1).step()
    torch.optim.SGD([model.head.weight], lr=0.1).step()
    shards.swap()
    assert torch.equal(model.head.weight, ref)
    shards.restore()


def test_explain_keeps_the_dispatched_path():
    p = sc.placement("cpu", [0])
    with sc.explain():
        assert not sc.runs_local(p)
    assert sc.runs_local(p)


def test_a_module_under_two_names_is_distributed_once():
    """``m.block2 = m.block``: the second visit must not wrap the already-global parameters or buffers again."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.tensor([2.0, 1.0, 0.5, 1.0]))

        def forward(self, x):
            return torch.tanh(self.lin(x) * self.scale)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Scaled()
            self.block2 = self.block

        def forward(self, x):
            return self.block2(self.block(x)).sum()

    p = sc.placement("cpu", [0])
    torch.manual_seed(0)
    plain = Twice()
    torch.manual_seed(0)
    model = sc.distribute_module(Twice(), p)
    x = torch.randn(6, 4)
    for t in list(model.parameters()) + list(model.buffers()):
        assert isinstance(t, sc.GlobalTensor) and not isinstance(t._local, sc.GlobalTensor)
    assert model.block.lin.weight is model.block2.lin.weight
    loss = model(sc.distribute(x, p, (sbp.broadcast,)))
    loss.backward()
    want = plain(x)
    want.backward()
    assert float(loss.detach().full_tensor()) == float(want.detach())
    torch.testing.assert_close(model.block.lin.weight.grad.full_tensor(), plain.block.lin.weight.grad)


def test_a_swap_sees_a_parameter_replaced_since_the_last_one():
    """The swap reuses its table and leaves while they hold; a parameter replaced under its name gets its own."""
    p = sc.placement("cpu", [0])
    torch.manual_seed(0)
    model = sc.distribute_module(Net(), p)
    shards = sc.LocalParameters(model)
    shards.swap()
    first = model.head.weight
    model(torch.tensor([[1, 2, 3]])).backward()
    shards.restore()
    assert first.grad is None  # the leaf's gradient went to the parameter
    shards.swap()
    assert model.head.weight is first  # the same leaf again
    shards.restore()

    new = torch.nn.Parameter(sc.distribute(torch.full((10, 4), 0.5), p, (sbp.broadcast,)))
    model.head.weight = new
    shards.swap()
    assert not isinstance(model.head.weight, sc.GlobalTensor) and model.head.weight is not first
    assert torch.equal(model.head.weight, torch.full((10, 4), 0.5))
    model(torch.tensor([[1, 2, 3]])).backward()
    shards.restore()
    assert model.head.weight is new and isinstance(new.grad, sc.GlobalTensor)

    with torch.no_grad():  # a parameter whose local was replaced (not written in place) gets a new leaf too
        model.lin.weight._local = torch.zeros(4, 4)
    shards.swap()
    assert torch.equal(model.lin.weight, torch.zeros(4, 4)) and model.lin2.weight is model.lin.weight
    shards.restore()


def test_gradients_held_on_the_leaves_are_the_handed_over_ones():
    """``restore(hand_grads=False)`` keeps dense gradients on the leaves (``grads``: the same values, no global
    gradient); a sparse one makes it hand every gradient over, as ``restore()`` does, unless ``hold_sparse``."""
    p = sc.placement("cpu", [0])
    torch.manual_seed(0)
    model = sc.distribute_module(Net(), p)
    params = dict(model.named_parameters())
    shards = sc.LocalParameters(model)
    batch = torch.tensor([[1, 2, 3], [3, 4, 5]])

    model.emb.sparse = False
    shards.swap()
    model(batch).backward()
    shards.restore()
    want = {n: q.grad.full_tensor() for n, q in params.items()}
    model.zero_grad(set_to_none=True)
    shards.swap()
    model(batch).backward()
    assert shards.restore(hand_grads=False)
    held = shards.grads()
    assert all(q.grad is None for q in params.values())
    assert all(torch.equal(held[id(q)], want[n]) for n, q in params.items())
    shards.drop_grads()
    assert shards.grads() == {}

    model.emb.sparse = True
    shards.swap()
    model(batch).backward()
    assert not shards.restore(hand_grads=False)
    assert isinstance(params["emb.weight"].grad, sc.SparseGlobalTensor) and shards.grads() == {}
    sparse_want = params["emb.weight"].grad._local.coalesce()
    model.zero_grad(set_to_none=True)
    shards.swap()
    model(batch).backward()
    assert shards.restore(hand_grads=False, hold_sparse=True)  # for an update that takes row gradients
    held = shards.grads()[id(params["emb.weight"])]
    assert held.is_sparse and torch.equal(held.coalesce().to_dense(), sparse_want.to_dense())
    assert all(q.grad is None for q in params.values())
    shards.drop_grads()


def test_distribute_module_keeps_a_whole_parameters_storage():
    """A parameter this rank holds whole on its device becomes its global tensor's local tensor without a copy
    (``adopt``), the tied one once; ``distribute`` still copies, since its caller keeps the tensor."""
    p = sc.placement("cpu", [0])
    model = Net()
    storage = {n: t.untyped_storage().data_ptr() for n, t in model.named_parameters(remove_duplicate=False)}
    sc.distribute_module(model, p, {"head.weight": (sbp.split(0),)})
    got = {n: t.to_local().untyped_storage().data_ptr() for n, t in model.named_parameters(remove_duplicate=False)}
    assert got == storage and model.lin2.weight is model.lin.weight
    x = torch.ones(3)
    assert sc.distribute(x, p, (sbp.broadcast,)).to_local().untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
