"""The supervisor stops every child, even when a second signal arrives while it stops them."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from mempo_cli.launcher.supervisor import Child, Supervisor


def test_a_signal_while_stopping_leaves_no_child_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with Supervisor(tmp_path) as sup:
        children = [sup.start(f"child-{i}", sleeper) for i in range(3)]
        real_stop = sup.stop

        def stop_with_a_signal(child: Child, timeout_s: float = 15.0) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # the user presses Ctrl-C again, or a second SIGTERM
            real_stop(child, timeout_s)

        monkeypatch.setattr(sup, "stop", stop_with_a_signal)
    assert all(not child.alive() for child in children)
    assert signal.getsignal(signal.SIGTERM) is not sup._while_stopping  # handlers given back
