"""The ComputeDomain controller (SPEC section 4).

Layout: one module per thing the controller owns. ``observed`` (projections of foreign objects and the
per-domain snapshot), ``claim_templates`` and ``daemonset`` (the child objects, as pure builders),
``status`` (the aggregated status and its ``Ready`` condition), ``nodes`` and ``cleanup`` (node labels and
orphans), ``guard`` (the mode-switch guard), ``reconcile`` (``desired(observed, settings) -> Plan``, pure),
``executor`` (applies plans through the Kubernetes I/O layer) and ``app`` (the process: caches, queue,
workers, sweeps, leader election, HTTP, signals). Design note: ``docs/design/0002-controller.md``.
"""
