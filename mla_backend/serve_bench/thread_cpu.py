"""CPU time of each thread of an engine process between two reads, from ``/proc`` (Linux).

A host-bound decode step runs at the speed of the engine's main thread. When one engine's step code runs slower than
another's on the same machine, this says whether that thread was starved (involuntary context switches: the kernel
took the CPU away) or shared its process with a busy thread, rather than leaving it to guesswork; and where it ran at
the interval's end (:func:`cpu_facts`: the CPU, its clock, NUMA node and SMT siblings), so that two ranks' main threads
on one physical core, or a core at a lower clock, show in the report. Two more reads say where a thread's time off the
CPU went: how long it was runnable but waited in the run queue (``/proc/.../schedstat``: another thread had its CPU),
the rest being sleep (waiting on another process, a rank or the GPU); and, on a virtual machine, the share of all CPUs'
time the hypervisor gave to other guests (``/proc/stat``'s steal), which slows every thread without showing in its own
counters. Read by serve-bench's vLLM worker extension and SGLang scheduler timers with the host timers (one interval per
workload).
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
    else the kernel's ``comm``), ``cpu_s`` (user + system seconds since it started), ``involuntary`` (context
    switches the kernel forced on it), ``runqueue_s`` (seconds it was runnable but waited for a CPU; None where the
    kernel keeps no schedstat) and ``last_cpu``. Empty where ``/proc`` is absent."""
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
        schedstat = (_read(f"{task_dir}/{tid_text}/schedstat") or "").split()  # ns on CPU, ns in the run queue, runs
        tid = int(tid_text)
        threads[tid] = {"name": python_names.get(tid, comm),
                        "cpu_s": (int(fields[11]) + int(fields[12])) / _TICKS_PER_S,
                        "involuntary": int(involuntary),
                        "runqueue_s": int(schedstat[1]) / 1e9 if len(schedstat) > 1 else None,
                        "last_cpu": int(fields[36]) if len(fields) > 36 else None}  # field 39, "processor"
    return threads


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_cpu_ticks() -> dict | None:
    """All CPUs' time since boot in ``/proc/stat`` ticks: ``{"total", "steal"}`` (steal: time the hypervisor ran
    other guests on this machine's virtual CPUs); None without ``/proc/stat``."""
    first = (_read("/proc/stat") or "").split("\n", 1)[0].split()
    if len(first) < 5 or first[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already inside user and nice
    values = [int(v) for v in first[1:9]]
    return {"total": sum(values), "steal": values[7] if len(values) > 7 else 0}


def steal_share(before: dict | None, after: dict | None) -> float | None:
    """The share of all CPUs' time between two :func:`read_cpu_ticks` that the hypervisor stole (None where unknown)."""
    if not before or not after or after["total"] <= before["total"]:
        return None
    return round((after["steal"] - before["steal"]) / (after["total"] - before["total"]), 4)


def cpu_mhz(cpu: int) -> float | None:
    """CPU ``cpu``'s clock now, in MHz: cpufreq's current frequency, else ``/proc/cpuinfo``'s "cpu MHz" (None where
    neither says; a virtual machine may report a constant)."""
    khz = _read(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
    if khz and khz.isdigit():
        return int(khz) / 1000
    info = _read("/proc/cpuinfo") or ""
    for block in info.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        if fields.get("processor") == str(cpu) and "cpu MHz" in fields:
            return float(fields["cpu MHz"])
    return None


def cpu_facts(cpu: int | None) -> dict:
    """Where a thread ran: ``{"cpu", "mhz", "numa_node", "smt_siblings"}`` (the CPU ids sharing its physical core, as
    the kernel lists them, e.g. "3,35"); what Linux does not say is None."""
    if cpu is None:
        return {"cpu": None, "mhz": None, "numa_node": None, "smt_siblings": None}
    base = f"/sys/devices/system/cpu/cpu{cpu}"
    try:
        nodes = [name for name in os.listdir(base) if name.startswith("node") and name[4:].isdigit()]
    except OSError:
        nodes = []
    mhz = cpu_mhz(cpu)
    return {"cpu": cpu, "mhz": None if mhz is None else round(mhz), "numa_node": int(nodes[0][4:]) if nodes else None,
            "smt_siblings": _read(f"{base}/topology/thread_siblings_list")}


class ThreadCpu:
    """Intervals of this process's per-thread CPU time: :meth:`interval` gives each thread's CPU seconds, share of the
    wall time and forced context switches since the previous call (or since construction)."""

    def __init__(self):
        self._start = time.monotonic()
        self._last = read_threads()
        self._ticks = read_cpu_ticks()

    def interval(self, reset: bool = True) -> dict:
        """``{"wall_s", "threads": [...], "main_cpu", "allowed_cpus", "steal"}``: the main thread first, then the
        others at or above MIN_SHARE of the wall time, busiest first, each ``{"tid", "name", "main", "cpu_s", "share",
        "involuntary", "runqueue_share"}`` (runqueue_share: of the wall time, runnable but waiting for a CPU; None
        where unknown); ``main_cpu`` is :func:`cpu_facts` of the CPU the main thread last ran on, ``allowed_cpus``
        how many CPUs the process may run on, ``steal`` the share of all CPUs' time the hypervisor stole."""
        now, current, ticks = time.monotonic(), read_threads(), read_cpu_ticks()
        wall_s = max(now - self._start, 1e-9)
        rows = []
        for tid, t in current.items():
            before = self._last.get(tid, {"cpu_s": 0.0, "involuntary": 0, "runqueue_s": 0.0})
            cpu_s = t["cpu_s"] - before["cpu_s"]
            main = tid == os.getpid()
            if main or cpu_s >= MIN_SHARE * wall_s:
                queued = (None if t.get("runqueue_s") is None or before.get("runqueue_s") is None
                          else round((t["runqueue_s"] - before["runqueue_s"]) / wall_s, 4))
                rows.append({"tid": tid, "name": t["name"], "main": main, "cpu_s": round(cpu_s, 2),
                             "share": round(cpu_s / wall_s, 3),
                             "involuntary": t["involuntary"] - before["involuntary"], "runqueue_share": queued})
        rows.sort(key=lambda r: (not r["main"], -r["cpu_s"]))
        steal = steal_share(self._ticks, ticks)
        if reset:
            self._start, self._last, self._ticks = now, current, ticks
        main_cpu = cpu_facts(current.get(os.getpid(), {}).get("last_cpu"))
        allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return {"wall_s": round(wall_s, 2), "threads": rows, "main_cpu": main_cpu, "allowed_cpus": allowed,
                "steal": steal}


def process_timings(rank, threads: ThreadCpu | None, reset: bool = True) -> dict | None:
    """One engine process's report for serve-bench: its host timers (host_trace.host_timings) and its threads' CPU
    time since the last reset, None while the timers are off; ``reset`` starts the next interval."""
    from ..host_trace import host_timings

    ranges = host_timings(reset=reset)
    if ranges is None:
        return None
    return {"rank": rank, "pid": os.getpid(), "ranges": ranges, "threads": threads.interval(reset)}


__all__ = ["MIN_SHARE", "ThreadCpu", "cpu_facts", "cpu_mhz", "process_timings", "read_cpu_ticks", "read_threads",
           "steal_share"]
