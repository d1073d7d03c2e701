"""The notebooks' kernel start (tests/conftest.py): a kernel that dies before it replies is
started again, twice at most; any other failure is not retried."""

import pytest

from conftest import started_again


def _flaky(failures, message="Kernel died before replying to kernel_info"):
    calls = []

    def start(**kwargs):
        calls.append(kwargs)
        if len(calls) <= failures:
            raise RuntimeError(message)
        return "km", "kc"
    return start, calls


def test_a_kernel_that_died_at_start_is_started_again():
    start, calls = _flaky(2)
    assert started_again(start)(kernel_name="python3") == ("km", "kc") and len(calls) == 3


def test_three_deaths_or_another_error_still_fail():
    start, calls = _flaky(3)
    with pytest.raises(RuntimeError, match="Kernel died"):
        started_again(start)()
    assert len(calls) == 3
    start, calls = _flaky(1, "Kernel didn't respond in 60 seconds")
    with pytest.raises(RuntimeError, match="didn't respond"):
        started_again(start)()
    assert len(calls) == 1
