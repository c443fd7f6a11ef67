"""The one domain error of horizon-ray's own code: a deliberate refusal of bad input.

``BadInput`` is raised where the code decides that what it was given cannot work (a spec value, a model
directory, a data file, a node declaration) and says how to fix it. Anything else that escapes is a crash:
a bug or a failure of the machine, reported with its traceback. One place on each edge maps it: the CLI
(``horizon_ray.cli``: exit code 2, one ``error:`` line) and the HTTP API (``api.errors``: 422).

It subclasses ValueError, so code that catches ValueError (and the engine's own ValueErrors for bad input)
keeps working.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from horizon_ray.exit_codes import BAD_INPUT


class BadInput(ValueError):
    """Input that cannot work; the message names the fix. ``field``: the dotted spec key to blame, if any."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


def refusing_bad_input(run: Callable[[], int]) -> int:
    """`run`'s exit code; a BadInput it raises is exit 2 with its one-line message (the one place that maps
    it, for the CLI and the node agent's child alike). Any other exception is a crash: it propagates, and
    Python prints its traceback and exits 1."""
    try:
        return run()
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
