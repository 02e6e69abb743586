"""The pod host's per-container routing of log records and stderr lines."""

from __future__ import annotations

import contextvars
import io
import sys

from tests.testbed.sim.podhost import _RoutedStderr, _Router, current


def test_a_containers_stderr_lines_go_to_its_log() -> None:
    fallback, mine = io.StringIO(), io.StringIO()
    router = _Router(fallback)
    router.files["agent-1"] = mine
    stream = _RoutedStderr(router)

    def in_container() -> None:
        current.set("agent-1")
        print("error: checkpoint is corrupt", file=stream)

    contextvars.copy_context().run(in_container)
    print("podhost itself", file=stream)
    assert mine.getvalue() == "error: checkpoint is corrupt\n"
    assert fallback.getvalue() == "podhost itself\n"
    assert stream is not sys.stderr
