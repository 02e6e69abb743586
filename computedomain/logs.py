"""Process logging: one stderr handler, text or JSON lines (`LOG_FORMAT`), at `LOG_LEVEL`.

Every process (controller, node agent, IMEX daemon) calls `configure_logging` once with its settings.
Log lines carry the object they are about as `key=value` pairs in the message (`cd=ns/name uid=...`), so
text logs stay greppable and JSON logs keep them in `msg`.
"""

from __future__ import annotations

import json
import logging
import sys

from computedomain.settings import CommonSettings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(settings: CommonSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    # The HTTP/2 header decoder logs each header it decodes at DEBUG: at debug level a peer of the health port
    # could make the agent write two lines per header it sends (thousands a connection).
    logging.getLogger("hpack").setLevel(max(logging.INFO, root.level))
