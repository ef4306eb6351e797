"""What the benchmarks and verifiers in ``scripts/`` share, so that each script is its entry point and its report.

- ``paired``: paired ratios with a bootstrap interval, and balanced run orders;
- ``heap``: heap bytes in use and their sampled peak;
- ``parity``: one device training on its own beside a distributed run (MLP and
  GPT-2 layouts), and the relative-difference measure;
- ``pipeline_parity``: the pipelined GPT-2 of ``verify_pipeline`` and its
  one-device reference, the stash and bubble report;
- ``dtensor_gpt``: the peers' GPT-2 under DTensor tensor parallelism, and the
  op set the dispatch benchmarks time;
- ``pipeline_peers``: our pipeline and ``torch.distributed.pipelining``'s on the
  same GPT-2 split, with the benchmark's options;
- ``calibration``, ``sync_probe``, ``layout_timing``: this machine's measured
  capacity, contention, link, collective sync and op costs, for the
  simulator's cluster file, and the layouts' measured step times;
- ``token_file``: a raw token file as a data-pipeline source.

It sits above every layer (it imports recipes and the peers); nothing in the
library imports it.
"""
