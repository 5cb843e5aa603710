"""CPU time of each thread of an engine process between two reads, from ``/proc`` (Linux).

A host-bound decode step runs at the speed of the engine's main thread. When one engine's step code runs slower than
another's on the same machine, this says whether that thread was starved (involuntary context switches: the kernel
took the CPU away) or shared its process with a busy thread, rather than leaving it to guesswork. Read by serve-bench's
vLLM worker extension and SGLang scheduler timers with the host timers (one interval per workload).
"""

from __future__ import annotations

import os
import threading
import time

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: Threads below this share of the interval's wall time are left out of a report (idle helper threads).
MIN_SHARE = 0.05


def read_threads(pid: int | None = None) -> dict[int, dict]:
    """Per thread id of process ``pid`` (this one by default): ``name`` (the Python thread's name where it is one,
    else the kernel's ``comm``), ``cpu_s`` (user + system seconds since it started) and ``involuntary`` (context
    switches the kernel forced on it). Empty where ``/proc`` is absent."""
    pid = os.getpid() if pid is None else pid
    python_names = {t.native_id: t.name for t in threading.enumerate()} if pid == os.getpid() else {}
    task_dir = f"/proc/{pid}/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return {}
    threads = {}
    for tid_text in tids:
        try:
            with open(f"{task_dir}/{tid_text}/stat") as f:
                stat = f.read()
            with open(f"{task_dir}/{tid_text}/status") as f:
                status = f.read()
        except OSError:  # the thread ended between listdir and open
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state): utime and stime are fields 14 and 15
        involuntary = status.split("nonvoluntary_ctxt_switches:")[1].split()[0] if "nonvoluntary" in status else 0
        tid = int(tid_text)
        threads[tid] = {"name": python_names.get(tid, comm),
                        "cpu_s": (int(fields[11]) + int(fields[12])) / _TICKS_PER_S,
                        "involuntary": int(involuntary)}
    return threads


class ThreadCpu:
    """Intervals of this process's per-thread CPU time: :meth:`interval` gives each thread's CPU seconds, share of the
    wall time and forced context switches since the previous call (or since construction)."""

    def __init__(self):
        self._start = time.monotonic()
        self._last = read_threads()

    def interval(self, reset: bool = True) -> dict:
        """``{"wall_s", "threads": [...]}``: the main thread first, then the others at or above MIN_SHARE of the wall
        time, busiest first; each ``{"tid", "name", "main", "cpu_s", "share", "involuntary"}``."""
        now, current = time.monotonic(), read_threads()
        wall_s = max(now - self._start, 1e-9)
        rows = []
        for tid, t in current.items():
            before = self._last.get(tid, {"cpu_s": 0.0, "involuntary": 0})
            cpu_s = t["cpu_s"] - before["cpu_s"]
            main = tid == os.getpid()
            if main or cpu_s >= MIN_SHARE * wall_s:
                rows.append({"tid": tid, "name": t["name"], "main": main, "cpu_s": round(cpu_s, 2),
                             "share": round(cpu_s / wall_s, 3),
                             "involuntary": t["involuntary"] - before["involuntary"]})
        rows.sort(key=lambda r: (not r["main"], -r["cpu_s"]))
        if reset:
            self._start, self._last = now, current
        return {"wall_s": round(wall_s, 2), "threads": rows}


def process_timings(rank, threads: ThreadCpu | None, reset: bool = True) -> dict | None:
    """One engine process's report for serve-bench: its host timers (host_trace.host_timings) and its threads' CPU
    time since the last reset, None while the timers are off; ``reset`` starts the next interval."""
    from ..host_trace import host_timings

    ranges = host_timings(reset=reset)
    if ranges is None:
        return None
    return {"rank": rank, "pid": os.getpid(), "ranges": ranges, "threads": threads.interval(reset)}


__all__ = ["MIN_SHARE", "ThreadCpu", "process_timings", "read_threads"]
