"""The typer app: wiring only. Each command parses options into a stage's request (an option not given: the
--recipe's value), calls the stage's library function and prints. Domain errors are mapped to one line and an
exit code here, once (traceback with EECTL_DEBUG=1).

One module per command (cmd_*.py); app.py holds the app, the shared options and the error mapping. Importing this
package registers every command, in the order --help lists them.
"""

from __future__ import annotations

import sys

# The order of these imports is the order --help lists the commands in.
# isort: off
from eectl.cli import cmd_profile  # noqa: F401
from eectl.cli import cmd_calibrate  # noqa: F401
from eectl.cli import cmd_train_heads  # noqa: F401
from eectl.cli import cmd_export  # noqa: F401
from eectl.cli import cmd_run  # noqa: F401
from eectl.cli import cmd_serve  # noqa: F401
from eectl.cli import cmd_bench  # noqa: F401
from eectl.cli import cmd_pipeline  # noqa: F401
from eectl.cli import cmd_eval  # noqa: F401

# isort: on
from eectl.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
