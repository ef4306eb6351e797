"""``trainer.compile``'s forward wrapper: plain tensors go to the compiled module, global ones run eager."""
from __future__ import annotations

import pytest
import torch

import sbp_core as sc
from sbp_core import sbp
from toolkit.trainer import compiled_forward


# torch.compile's first use in this process imports torch._dynamo, which imports deprecated torch.jit helpers.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_forward_on_global_tensors_anywhere_in_its_inputs_runs_eager():
    """A batch dict, a stage's boundary tuple, or labels: any global tensor in them keeps the call eager."""
    module = torch.nn.Identity()
    ran = []

    def forward(mod, x, labels=None):
        ran.append(mod is module)
        return x

    run = compiled_forward(forward, [module])
    g = sc.distribute(torch.ones(2), sc.placement("cpu", [0]), (sbp.broadcast,))
    for x, labels in [({"ids": g}, None), ((torch.ones(2), g), None), (torch.ones(2), {"label": g})]:
        run(module, x, labels)
    assert ran == [True] * 3  # eager: the module itself, not its compiled wrapper
    run(module, (torch.ones(2), torch.ones(2)), None)
    assert ran[-1] is False  # plain tensors: the compiled module
