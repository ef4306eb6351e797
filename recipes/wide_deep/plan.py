"""Wide&Deep's parallel plan as data: tables split over every rank, the MLP data-parallel.

On a stage's ``(dp, tp)`` mesh (OneFlow's Wide&Deep layout, which both mesh
axes serve alike):

- ``wide.weight`` ``[V, 1]``: ``S(0)`` on both axes, each rank holds
  ``V / (dp*tp)`` vocabulary rows; a lookup with ``B`` ids is ``P(sum)``
  (each rank's ids outside its rows read 0), kept partial through the sum
  over the fields and the logits' sum, reduce-scattered to the batch split
  at the loss;
- ``deep.weight`` ``[V, d]``: ``S(1)`` on both axes, each rank holds
  ``d / (dp*tp)`` columns of every row; a lookup with ``B`` ids is ``S(2)``
  (the embedding's columns), pinned to the batch split ``S(0)`` at the
  table's output (an all-to-all) for the MLP;
- MLP weights ``B`` (unmatched names default to ``B``): data parallel, one
  gradient all-reduce per weight per step;
- data ``(S(0), S(0))``: the batch is split over every rank; the ids reach
  the tables ``B`` (an all-gather of ``8 * 26`` bytes per sample) because the
  cost model finds that cheaper than gathering a table (with a table smaller
  than the batch's ids it gathers the table instead, also exact).

Table gradients are sparse (``sbp_core.sparse``): the deep table's is
``S(1)`` like the table (no communication), the wide table's ``B`` (the
step's looked-up rows on every rank; the optimizer takes its own rows).
"""
from __future__ import annotations

from sbp_core.sbp import Split

S0, S1 = Split(0), Split(1)

MESH_PLAN = {"wide.weight": (S0, S0), "deep.weight": (S1, S1), "deep:output": (S0, S0)}
DATA_SBP = (S0, S0)
TABLES = ("wide.weight", "deep.weight")


def mesh_plan(cfg=None) -> dict:
    return dict(MESH_PLAN)
