"""A stage's backward in two passes: its input's gradient first, its weights' gradients after.

Zero-bubble pipelines' B/W split. Under ``zb``/``zbv`` every micro-batch's
backward on every stage but the first is split, the weight pass an actor
of its own that fills bubbles (``runtime.pipeline.schedule``). Under the
other schedules it is applied where it shortens a step without changing the
schedule: the last micro-batch's backward on every plain stage but the
first. There the stage before waits, idle, for that input gradient (its
own last backward), so sending it before computing the weights' gradients
takes the weight pass off the step's critical path: it runs on this stage
while the stage before runs its last backward. Other micro-batches keep
the one-pass backward, which does less work (the weight pass walks the
graph again from the saved gradients).

The passes are ``torch.distributed.pipelining``'s own
(``stage_backward_input`` keeps each parameter group's incoming gradients
at the nodes where its path leaves the input's; ``stage_backward_weight``
finishes from there): the same kernels on the same values as one
``backward``. They write ``.grad`` directly instead of through the
leaves' accumulate nodes, so no post-accumulate hook sees the weight
pass: a stage on global tensors gets its weights' gradients in the layout
they arrive in (partial sums, no bucketed boxing during backward), which
``reduce`` boxes once (``sc.box_grads``); a plain stage hands them to the
parameters there.
"""
from __future__ import annotations

from typing import Callable


def input_first(outputs: list, grads, stage_inputs: list, weights) -> Callable[[], None]:
    """Backward of ``outputs`` (seeded with ``grads``; ``None`` for a scalar loss) into the ``stage_inputs``' ``.grad`` alone.

    Returns the weight pass: calling it (once) accumulates every weight's
    gradient into its ``.grad`` as ``torch.autograd.backward(outputs,
    grads)`` would have, and frees the graph. Until then the graph and each
    parameter group's incoming gradients stay alive.
    """
    # Imported here: torch.distributed.pipelining imports torch._dynamo, over a second of start-up for every
    # process that reads a config (toolkit.config) and never runs a split backward.
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    weights = [w for w in weights if w.requires_grad]
    _, groups = stage_backward_input(list(outputs), None if grads is None else list(grads), list(stage_inputs),
                                     iter(weights))

    def weight_pass() -> None:
        stage_backward_weight(iter(weights), groups)

    return weight_pass
