"""The compute-domain daemon that runs in each per-CD DaemonSet pod (driverManaged mode, SPEC section 5).

One module per owned thing: ``settings`` (env of the pod), ``registration`` (our entry and its stable index),
``peers`` (entries -> hosts file / nodes.cfg -> SIGUSR1 or restart), ``process`` (supervision of
``nvidia-imex``), ``readiness`` (pod Ready -> our entry), ``run`` (the ``run`` sequence) and ``check`` (the
probe). Design notes: ``docs/design/0005-imex-daemon.md``. Nothing is imported here, so ``check`` (a fresh
process every probe period) stays light.
"""
