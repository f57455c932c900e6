"""A simulator command writing to a log says how far it is at most once a minute."""

from __future__ import annotations

import io

from sim.log_progress import LogProgress, progress_bar


def test_a_log_gets_a_line_a_minute_with_the_time_left() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = LogProgress(400, out=out, clock=lambda: now[0])
    bar.set_postfix_str("realsize-shapes_K4_cdfl_s0")
    for _ in range(100):  # 100 updates in 50 s: no line yet
        now[0] += 0.5
        bar.update()
    assert out.getvalue() == ""
    for _ in range(100):  # the minute passes at update 120
        now[0] += 0.5
        bar.update()
    lines = out.getvalue().splitlines()
    assert lines == ["progress: 120/400 updates (30 %), 60 s, about 140 s left, realsize-shapes_K4_cdfl_s0"]
    now[0] += 1000
    bar.update(200)  # the end is reported by the caller's own line, not here
    assert len(out.getvalue().splitlines()) == 1


def test_without_a_terminal_the_simulator_gets_lines_not_a_bar(capsys) -> None:
    assert isinstance(progress_bar(10), LogProgress)  # pytest's stderr is not a tty


def test_while_nothing_moves_it_still_says_so_and_stops_when_closed() -> None:
    """The demo's pre-training moves no bar for most of a minute: a line comes anyway."""
    import threading

    class Out(io.StringIO):
        said = threading.Event()

        def write(self, text: str) -> int:
            n = super().write(text)
            if text.strip():
                self.said.set()
            return n

    out = Out()
    bar = LogProgress(10, out=out, every_s=0.2).keep_talking()
    bar.set_postfix_str("cdfl: starting")
    try:
        assert out.said.wait(60), "no line while nothing moved"
    finally:
        bar.close()
    assert out.getvalue().splitlines()[0].startswith("progress: 0/10 updates (0 %), ")
    assert "time left known after the first few, cdfl: starting" in out.getvalue()
