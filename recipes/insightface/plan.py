"""InsightFace's parallel plan as data, on a stage's ``(dp, tp)`` mesh.

- The batch (images and labels) is ``S(0)`` over *every* rank: ``(S(0), S(0))``.
  The backbone's parameters and buffers are ``B`` (unlisted), so the backbone
  runs data parallel over the whole mesh (batch norm statistics over the
  global batch); its gradients arrive ``P`` and are all-reduced once per step.
- ``head:inputs``: the embeddings and labels are boxed to ``B`` before the
  FC (an all-gather of ``[N, E]`` and of ``N`` labels; backward: a
  reduce-scatter of the embeddings' gradient).
- The FC weight (class centres) and its class ids are ``S(0)`` over the class
  axis on every mesh axis (a balanced split, ``torch.tensor_split`` sizes when
  the classes do not divide), so the logits are ``S(1)`` and the
  margin-softmax loss reduces only ``[N, 1]`` row statistics; the FC's
  gradient stays ``S(0)`` with no communication.
- ``head.margin:input``: each row's target cosine (a masked row sum, ``P``
  over the class shards) is all-reduced to ``B`` before the margin (``N``
  values), so its gradient is ``B`` and spreads onto the split logits for free
  (left to the cost model, the cheaper reduce-scatter to ``S(0)`` would make
  that gradient ``S(0)`` and box the whole logits' gradient back to ``S(1)``).
"""
from __future__ import annotations

from sbp_core.sbp import Broadcast, Split

B, S0 = Broadcast(), Split(0)

DATA_SBP = (S0, S0)
CLASS_SPLIT = (S0, S0)
PLAN = {"head.weight": CLASS_SPLIT, "head.class_ids": CLASS_SPLIT, "head:inputs": (B, B), "head.margin:input": (B, B)}


def mesh_plan(cfg=None) -> dict:
    return dict(PLAN)
