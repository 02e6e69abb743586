"""Command line of the ``imex`` package: ``python -m imex <group> <command>`` (also the ``imex`` script).

Commands:
  daemon run     run the compute-domain daemon of this pod (register, render the IMEX config, supervise
                 nvidia-imex, mirror readiness) until SIGTERM
  daemon check   probe: exit 0 only when nvidia-imex-ctl -q prints exactly READY (or the node has no clique)

Settings come from the environment the DaemonSet and CDI give (NODE_NAME, POD_IP, CLIQUE_ID,
COMPUTE_DOMAIN_UUID, ...) or from flags named after them (``--pod-ip``); ``daemon --help`` lists them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence


def _daemon(command: str, rest: list[str]) -> int:
    from computedomain.settings import SettingsError, help_text, load_settings
    from computedomain.startup import imports_without_gc
    from imex.daemon.settings import DaemonSettings

    if command in ("-h", "--help", "help"):
        print(__doc__)
        print(f"Settings (flag, env, meaning):\n{help_text(DaemonSettings)}")
        return 0
    try:
        settings = load_settings(DaemonSettings, rest)
        if command == "run":
            settings.validate_for_run()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if command == "check":
        with imports_without_gc():
            from imex.daemon.check import check, report

        return report(asyncio.run(check(settings)))
    if command == "run":
        with imports_without_gc():
            from computedomain.kube.config import ConfigError
            from computedomain.logs import configure_logging
            from imex.daemon.run import run_daemon

        configure_logging(settings)
        try:
            return asyncio.run(run_daemon(settings))
        except ConfigError as exc:  # credentials it cannot use: one line, no traceback
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"error: unknown daemon command {command!r}; use run or check", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if args else 2
    if args[0] == "daemon":
        if len(args) < 2:
            print("error: daemon needs a command: run or check", file=sys.stderr)
            return 2
        return _daemon(args[1], args[2:])
    print(f"error: unknown command {' '.join(args)!r}; run with --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
