"""Console output. Every titanrl module writes to the console through a `logging` logger of the
"titanrl" hierarchy (`get_logger(__name__)`), whose first call in a process gives that hierarchy
one handler that prints each message's text alone, as `print` did: INFO on stdout; WARNING and
above, and records logged with `extra=STDERR` (progress notices that must keep stdout free, e.g.
for `titanrl eval`'s JSON), on stderr. The streams are looked up at each message, so a
redirected sys.stdout (`contextlib.redirect_stdout`, pytest's capture) redirects it too. Which
rank prints is each caller's choice (rank 0 for everything a job prints once).

Silence or redirect it with the standard library, e.g.
`logging.getLogger("titanrl").setLevel(logging.WARNING)` (errors and warnings only), or
`logging.getLogger("titanrl").handlers.clear()` and `.propagate = True` (the root logger's
handlers, e.g. `logging.basicConfig(filename=...)`)."""

import logging
import sys

STDERR = {"stderr": True}
"""`extra=` of an INFO record that goes to stderr."""


class ConsoleHandler(logging.Handler):
    """Each record's message on stdout (below WARNING) or stderr, flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            to_stderr = record.levelno >= logging.WARNING or getattr(record, "stderr", False)
            stream = sys.stderr if to_stderr else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def get_logger(name: str) -> logging.Logger:
    """The logger `name` (a module's `__name__` under titanrl), the "titanrl" logger configured."""
    configure()
    return logging.getLogger(name)


def configure() -> None:
    """Give the "titanrl" logger its console handler, and level INFO unless a level was set
    before (once per process: later calls change nothing)."""
    logger = logging.getLogger("titanrl")
    if any(type(h).__name__ == ConsoleHandler.__name__ for h in logger.handlers):
        return
    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False  # printed once, by this handler, whatever the root logger has
