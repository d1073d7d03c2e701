"""``python -m minidist`` runs the same CLI as the ``minidist`` console script (a learner trial
found "No module named minidist.__main__")."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args,expected", [
    (["--help"], "usage: minidist {demo,bench,doctor,plan,matrix,bisect,site}"),
    (["bisect", "--help"], "usage: minidist bisect"),
    (["plan", "--help"], "usage: minidist plan"),
])
def test_python_m_minidist_help_exits_0(args, expected):
    res = subprocess.run([sys.executable, "-m", "minidist", *args], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert expected in res.stdout, res.stdout


def test_python_m_minidist_unknown_command_exits_2():
    res = subprocess.run([sys.executable, "-m", "minidist", "no-such-command"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "usage: minidist" in res.stderr, (res.returncode, res.stderr)
