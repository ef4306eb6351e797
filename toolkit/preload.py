"""What the fork server of ``toolkit.child.host_rank_context`` imports once, before it forks any rank.

torch and the packages nearly every rank imports. A module that fails to import here is left out: each
rank then imports it itself and reports the error with its traceback, as a spawned rank would (an error
raised out of this module would end the fork server, and every rank start with it).
"""
import importlib

# torch._dynamo: every rank imports it at its first optimizer step (torch's optimizers disable dynamo around
# step), over a second each; the project's own modules import it only where they compile or split a backward.
MODULES = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.pipelining", "sbp_core",
           "runtime.executor", "toolkit.trainer", "recipes.registry")

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001  (see the module docstring)
        pass
