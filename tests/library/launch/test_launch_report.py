"""What a learner sees after a first wrong attempt: clear point-to-point errors and a timeout report
that starts with their own code.

* Point-to-point to one's own rank (world size 1 included) or to a rank outside the group is
  refused at once, naming the rank, the call and what to do instead (gloo would otherwise fail
  with "Pair is not connected" or hang).
* In a notebook the launcher's own frames are hidden (``__tracebackhide__``), so the report is the
  first thing on screen; each rank's block leads with the learner's line, shown as the notebook
  cell (``Cell In[n]``), names the call the learner made (``send``, not ``isend``), and every
  rank is shown. No absolute path of this machine appears.
"""

import re
from pathlib import Path

import pytest
import torch

import minidist
from minidist.comm import p2p
from minidist.launch.errors import short_path

ROOT = Path(__file__).resolve().parents[3]


def _send_to_self(rank, world):
    p2p.send(torch.ones(4), rank)


def _recv_from_self(rank, world):
    p2p.recv(torch.ones(4), rank)


def _send_outside(rank, world):
    p2p.isend(torch.ones(4), world + 3)


def test_send_to_self_at_world_size_1_says_what_to_do():
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_send_to_self, 1, timeout=60)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 0 failed: ValueError: send on rank 0: dst=0 is this rank itself")
    assert "world size 1 there is no other rank" in first


def test_recv_from_self_names_the_rank_and_the_call():
    with pytest.raises(minidist.RankError) as info:
        minidist.run(_recv_from_self, 2, timeout=60)
    first = str(info.value).splitlines()[0]
    assert re.match(r"rank [01] failed: ValueError: recv on rank [01]: src=[01] is this rank itself",
                    first), first
    assert "(rank + 1) % world_size" in first


def test_a_peer_outside_the_group_is_refused():
    with pytest.raises(minidist.RankError, match=r"isend on rank \d: dst=5 is not a rank of the group "
                                                 r"\(ranks 0\.\.1, world size 2\)"):
        minidist.run(_send_outside, 2, timeout=60)


def test_paths_are_shown_relative_to_the_project():
    assert short_path(str(ROOT / "minidist" / "comm" / "p2p.py")) == "minidist/comm/p2p.py"
    assert short_path("/tmp/ipykernel_123/456.py") == "<notebook cell>"  # no IPython here
    assert not short_path("/usr/lib/python3.11/threading.py").startswith("/")


_CELLS = [
    "import torch, minidist\nfrom minidist.comm import p2p",
    "def shift_right(rank, world):\n    t = torch.ones(4)\n"
    "    p2p.send(t, (rank + 1) % world)  # blocking send first: every rank waits\n"
    "    p2p.recv(t, (rank - 1) % world)",
    "minidist.run(shift_right, 3, timeout=12)",  # start-up included: room for a loaded machine
]


@pytest.mark.timeout(300)
def test_notebook_timeout_report_leads_with_the_learners_cell():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in _CELLS])
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=True).execute()
    error = next(o for o in nb.cells[2].outputs if o.output_type == "error")
    assert error.ename == "RankTimeoutError"
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error.traceback))
    for frame in ("in _supervise", "in _launch", "in _timeout", "q.get("):
        assert frame not in shown, f"launcher frame {frame!r} shown to the learner:\n{shown}"
    library_frames = re.findall(r"\.py:\d+, in \w+\(", shown)
    assert len(library_frames) <= 1, shown  # the learner's cell, then the one line of run()
    report = error.evalue
    for r in range(3):
        block = report.split(f"rank {r}: ", 1)[1]
        assert block.startswith(f"p2p: send to rank {(r + 1) % 3}, 16 bytes, seq 1 (waiting)")
        assert re.match(r"[^\n]*\n    your code: Cell In\[\d+\], line 3, in shift_right\n"
                        r"        p2p\.send\(t, \(rank \+ 1\) % world\)", block), block[:400]
    assert "isend to rank" not in report and "/tmp/ipykernel" not in report
    assert str(ROOT) not in report


def test_stack_of_cuts_the_frames_below_the_rank_entry_point(tmp_path):
    """The launcher's own frames (the rank's entry point and below) are not the learner's."""
    from minidist.launch import errors, rank_process
    entry = rank_process.__file__
    dump = tmp_path / "dump"
    dump.write_text("main thread 0x00000000000000ab\n"
                    "Current thread 0x00000000000000ab (most recent call first):\n"
                    '  File "/home/me/train.py", line 7 in step\n'
                    '  File "/home/me/train.py", line 3 in fn\n'
                    f'  File "{entry}", line 120 in main\n'
                    '  File "/usr/lib/python3/multiprocessing/process.py", line 108 in run\n')
    assert errors.stack_of(str(dump)) == [("/home/me/train.py", 7, "step"),
                                          ("/home/me/train.py", 3, "fn")]
