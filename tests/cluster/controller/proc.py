"""Run the controller as a process for cluster tests: ``python -m tests.cluster.controller.proc [flags]``.

The same as ``python -m computedomain controller``, except that ``TEST_CD_NAMESPACE`` limits the domains it
handles to one namespace, so tests sharing a cluster never touch each other's ComputeDomains.
"""

from __future__ import annotations

import asyncio
import os
import sys

from computedomain.controller.app import main
from computedomain.logs import configure_logging
from computedomain.settings import ControllerSettings, SettingsError, load_settings


def run() -> int:
    try:
        settings = load_settings(ControllerSettings, sys.argv[1:])
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    return asyncio.run(main(settings, cd_namespace=os.environ.get("TEST_CD_NAMESPACE") or None))


if __name__ == "__main__":
    sys.exit(run())
