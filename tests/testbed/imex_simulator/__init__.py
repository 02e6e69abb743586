"""The IMEX simulator: stand-ins for ``nvidia-imex`` and ``nvidia-imex-ctl`` on machines without MNNVL.

Entry points: ``python -m tests.testbed.imex_simulator.imexd -c <cfg>`` and ``python -m tests.testbed.imex_simulator.ctl``, and the
wrapper scripts ``bin/nvidia-imex`` / ``bin/nvidia-imex-ctl`` (``tests.testbed.imex_simulator.wrappers`` writes copies
with absolute paths for PATH or a fake driver root). Both read the real config keys (``imex.config``).

What it shares with the real daemon: the config files and keys, name resolution of ``nodes.cfg`` through
a hosts file, a peer TCP port and a command service (IP:port and/or unix socket), the ``-q`` state names,
the node ID = own line in ``nodes.cfg``, SIGUSR1 re-resolution honoured at most once per 5 s (repeats
inside the window are dropped, not deferred), SIGTERM = graceful shutdown that tells peers.
Where it differs is in ``docs/design/0003-imex-simulator.md``.
"""
