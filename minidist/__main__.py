"""``python -m minidist ...``: the same as the ``minidist`` command, for when the console script
is not on ``PATH`` (pyproject.toml's ``[project.scripts]`` points both at :func:`minidist.cli.main`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
