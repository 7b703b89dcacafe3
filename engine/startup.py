"""Where start-up goes: the engine's construction as consecutive named phases (Laps), on the clock of the
process's own age (process_age_s), so that the phases and what came before them add up to the time from the
process's start to its first step (jobs/processor.py's startup columns)."""
import os
import time


class Laps:
    """Consecutive phases: lap(name) closes the phase that began at the previous lap (or at creation), so
    the phases add up to the time from creation to the last lap. Invariant: phases' values are >= 0."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


def process_age_s() -> float | None:
    """Seconds since this process started: Linux's start time of it (/proc/self/stat, field 22, in clock
    ticks since boot) against the boot clock, to the tick (10 ms); None where there is no /proc."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME (not Linux)
        return None
