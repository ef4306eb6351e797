"""Auto-parallel: an execution simulator and Metropolis-Hastings search over SBP plans (FlexFlow's ideas).

- ``rehearsal``: run one rank's share of a step on fake tensors in a fake
  process group through the real dispatcher; record local ops (with
  shapes), the logical graph's global ops (signatures chosen), collectives
  (the ledger) and memory. ``stage_trace``: a pipeline stage's step
  (forward, backward, reduction, update) rehearsed from a ``StageSpec``.
- ``opcost``: a local op's seconds, measured here (CPU time, cached) or by a
  roofline; ``cluster``: topology and speeds; ``costmodel``: a phase's
  seconds (ops, host dispatch, collectives over links).
- ``taskgraph``: one step's actors as the runtime builds them (1F1B from the
  stash quotas); ``simulator``: full and delta simulation (identical).
- ``strategy``, ``space``, ``evaluate`` (prediction and memory), ``mcmc``.

- From a recipe: ``search_model`` (a recipe and its config as stage specs,
  choice points and validity; ``stage_spec``, ``extrapolate``), ``auto``
  (``parallel=auto``: search, or load the plan a search saved), the
  machine's calibration (``kernel_factor``, ``dispatch_cost``,
  ``cluster_file``) and ``report``.

The package sits above the runtime and the core: it reads the core's costs
and op rules and rehearses through its dispatcher, and builds the task
graph from the runtime's pipeline schedule.
"""
