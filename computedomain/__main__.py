"""Command line: `python -m computedomain <command>` (also the `computedomain` console script).

Commands:
  check-settings {controller,kubelet-plugin}   validate the env/flags as that process would, print them
  controller [flags]                           run the ComputeDomain controller (flags mirror the env vars)
  kubelet-plugin [flags]                       run the node agent (DRA kubelet plugin; flags mirror the env vars)
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence

from computedomain.settings import (
    CommonSettings,
    ControllerSettings,
    PluginSettings,
    SettingsError,
    describe,
    help_text,
    load_settings,
)

_PROCESSES: dict[str, type[CommonSettings]] = {
    "controller": ControllerSettings,
    "kubelet-plugin": PluginSettings,
}


def _usage() -> str:
    parts = [__doc__ or ""]
    for name, cls in _PROCESSES.items():
        parts.append(f"Settings of {name} (flag, env, meaning):\n{help_text(cls)}\n")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    try:
        if command == "check-settings" and rest and rest[0] in _PROCESSES:
            settings = load_settings(_PROCESSES[rest[0]], rest[1:])
            print(json.dumps(describe(settings), indent=2, default=str))
            return 0
        if command == "controller":
            controller_settings = load_settings(ControllerSettings, rest)
            # Imported here: check-settings must not need the Kubernetes client stack.
            from computedomain.controller.app import configure_logging
            from computedomain.controller.app import main as run_controller

            configure_logging(controller_settings)
            return asyncio.run(run_controller(controller_settings))
        if command == "kubelet-plugin":
            plugin_settings = load_settings(PluginSettings, rest)
            from computedomain.plugin.app import configure_logging as configure_plugin_logging
            from computedomain.plugin.app import main as run_plugin

            configure_plugin_logging(plugin_settings)
            return asyncio.run(run_plugin(plugin_settings))
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"error: unknown command {' '.join(args)!r}; run with --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
