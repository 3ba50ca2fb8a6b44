"""The scheduling benchmark (``lig bench``): policies compared on a simulated fleet.

Modules, in the order a run uses them:

- ``workloads``: seeded request streams (synthetic chat, trace replay, multi-LoRA, shared
  prefix, mixed criticality);
- ``fleet``: the discrete-event simulation: engines in virtual time behind picker replicas that
  run the real policies on periodically scraped, slightly late metrics;
- ``results``: latency percentiles, throughput, sheds and engine counters of one run;
- ``runner``: runs points (workload, policy, rate) in worker processes;
- ``report``: markdown tables and PNG plots;
- ``default_sweep``: the sweep behind ``docs/benchmarks.md`` and the rewrite of its numbers;
- ``main``: the ``lig bench`` command.
"""
