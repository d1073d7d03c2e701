"""``python -m minidist ...``: the same as the ``minidist`` command, for when the console script is
not on ``PATH``. The command belongs to the course kit (:func:`minidist_course.cli.main`); this file
is its door from the library's name, run as a script and never imported by the library, the one
place ``minidist`` names ``minidist_course`` (``tests/library/test_layering.py`` allows it alone)."""

import sys

from minidist_course.cli import main

if __name__ == "__main__":
    sys.exit(main())
