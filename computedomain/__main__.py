"""Command line: `python -m computedomain <command>` (also the `computedomain` console script).

Commands:
  check-settings {controller,kubelet-plugin}   validate the env/flags as that process would, print them
  controller [flags]                           run the ComputeDomain controller (flags mirror the env vars)
  kubelet-plugin [flags]                       run the node agent (DRA kubelet plugin; flags mirror the env vars)
  status NAME [-n NAMESPACE]                   show a ComputeDomain: status, conditions, daemons per clique
  validate --image IMAGE [-n NS] [--count N]   check the installation end to end on N nodes (a ComputeDomain,
                                               a pod per node, channels, IMEX daemons); a table and a verdict
  validate-channel                             (the validation pods' check of their channel device)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from computedomain.logs import configure_logging
from computedomain.settings import (
    CommonSettings,
    ControllerSettings,
    PluginSettings,
    SettingsError,
    describe,
    help_text,
    load_settings,
)
from computedomain.startup import imports_without_gc

_PROCESSES: dict[str, type[CommonSettings]] = {
    "controller": ControllerSettings,
    "kubelet-plugin": PluginSettings,
}


def _usage() -> str:
    parts = [__doc__ or ""]
    for name, cls in _PROCESSES.items():
        parts.append(f"Settings of {name} (flag, env, meaning):\n{help_text(cls)}\n")
    return "\n".join(parts)


def _status(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="computedomain status", description="Show one ComputeDomain.")
    parser.add_argument("name")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", ""))
    args = parser.parse_args(argv)

    async def show() -> int:
        from computedomain.kube.client import KubeClient
        from computedomain.kube.config import ConfigError
        from computedomain.kube.errors import KubeError, NotFound, explain
        from computedomain.status_view import gather

        try:
            client = await KubeClient.connect(kubeconfig=args.kubeconfig or None)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            print(await gather(client, args.name, args.namespace))
        except NotFound:
            print(f"error: ComputeDomain {args.namespace}/{args.name} not found", file=sys.stderr)
            return 1
        except KubeError as exc:
            print(f"error: {explain(exc)} (apiserver {client.host})", file=sys.stderr)
            return 1
        finally:
            await client.close()
        return 0

    return asyncio.run(show())


def _run(process: Coroutine[Any, Any, int]) -> int:
    """A process's main; credentials it cannot use end it with one line (no traceback), exit status 2."""
    from computedomain.kube.config import ConfigError

    try:
        return asyncio.run(process)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


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
            with imports_without_gc():
                from computedomain.controller.app import main as run_controller

            configure_logging(controller_settings)
            return _run(run_controller(controller_settings))
        if command == "kubelet-plugin":
            plugin_settings = load_settings(PluginSettings, rest)
            with imports_without_gc():
                from computedomain.plugin.nvml_child import ChildNvmlSource

                # The start-up NVML read runs in a child beside the agent's imports, not after them.
                nvml = ChildNvmlSource(Path(plugin_settings.driver_root_mount)).start()
                from computedomain.plugin.app import main as run_plugin

            configure_logging(plugin_settings)
            return _run(run_plugin(plugin_settings, nvml))
        if command == "status":
            return _status(rest)
        if command in ("validate", "validate-channel"):
            from computedomain import validate

            return validate.main(rest) if command == "validate" else validate.channel_main()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"error: unknown command {' '.join(args)!r}; run with --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
