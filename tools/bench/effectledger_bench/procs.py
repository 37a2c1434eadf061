"""Per-process CPU seconds and peak RSS, read from /proc (Linux).

- CPU: `/proc/<pid>/stat` utime + stime (clock ticks); for a process tree (PostgreSQL), the live
  descendants' times plus the `cutime`/`cstime` that exited children left in their parent
  (the postmaster reaps its backends), so a backend that ended during a phase still counts.
- memory: `/proc/<pid>/status` VmRSS (now) and VmHWM (the peak resident set).
- wake-ups: the voluntary context switches of every thread (`/proc/<pid>/task/*/status`), i.e.
  how often the process went to sleep waiting for something and had to be woken again. On a
  virtual machine each wake-up of an idle process costs CPU of its own (`wakeprobe`), which is
  why a process that handles messages one at a time pays more per message than a busy one.
- preemptions: the involuntary context switches, read the same way: how often a thread that
  could have run on lost its CPU to another. On two cores shared by six busy processes, work
  that is cut up and interleaved more finely costs more CPU for the same instructions.
- writes: the write syscalls of the whole process (`/proc/<pid>/io` `syscw`, threads that ended
  included): every socket write to NATS, PostgreSQL or a provider is one, unless the process
  gathered several messages into it. On loopback the sender's write also does the receiver's
  side of TCP and wakes it, so a write costs far more than the bytes it copies. The counter
  covers write(2) and writev(2) (uvloop, Go), not send(2): PostgreSQL's answers go by send(2),
  so its figure is its WAL and data file writes.
- run-queue wait: the seconds the process's threads were ready to run but waited for a CPU
  (`/proc/<pid>/task/*/schedstat`, second field). Where the processes of one call are busy
  on two cores, this is the time an operation's messages wait for the CPU rather than for
  the database or the network; threads that ended take theirs with them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    cpu_s: float
    rss_bytes: int
    hwm_bytes: int
    sys_s: float = 0.0  # the kernel's share of cpu_s (syscalls: sockets, fsync, ...)
    wakeups: int = 0  # voluntary context switches, all threads (and, for a tree, live processes)
    writes: int = 0  # write syscalls (and, for a tree, its live processes'), see `_writes`
    preemptions: int = 0  # involuntary context switches, counted like the wake-ups
    runq_wait_s: float = 0.0  # ready to run, waiting for a CPU (all threads), see `_runq_wait`


def _stat(pid: int) -> tuple[int, list[str]] | None:
    """(ppid, fields after the command name) of /proc/<pid>/stat, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()  # the command may contain spaces
    return int(rest[1]), rest


def _times(rest: list[str], *, children: bool) -> tuple[float, float]:
    # fields 14..17 of stat: utime stime cutime cstime (rest starts at field 3)
    user, system = int(rest[11]), int(rest[12])
    if children:
        user += int(rest[13])
        system += int(rest[14])
    return (user + system) / _TICK, system / _TICK


def _status(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    rss = hwm = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


def _switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches summed over the process's threads (0, 0 if it
    is gone). A voluntary one is a wake-up (the thread slept and was woken); an involuntary one
    a preemption (the thread could have run on but the scheduler gave its CPU to another).

    A thread that exited takes its count with it; the services' threads live as long as they do.
    """
    woken = preempted = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        woken += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        preempted += int(line.split()[1])
                        break  # the status file's last line of interest
    return woken, preempted


def schedstat_kept() -> bool:
    """Whether this kernel keeps the scheduler statistics `_runq_wait` reads: without them
    every wait reads 0, which a report must not show as a measurement."""
    return os.path.exists("/proc/self/schedstat")


def _runq_wait(pid: int) -> float:
    """Seconds the process's live threads spent ready to run but waiting for a CPU (the
    second field of each thread's schedstat, in ns); 0.0 if it is gone or the kernel does not
    keep scheduler statistics."""
    waited = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError), \
                    open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                waited += int(f.read().split()[1])
    return waited / 1e9


def _writes(pid: int) -> int:
    """The write syscalls the process made (`syscw` of `/proc/<pid>/io`, which counts every
    thread, ended ones too); 0 if it is gone or its io file cannot be read (another user's)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("syscw:"):
                return int(line.split()[1])
    return 0


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[0], []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def sample(pid: int, *, tree: bool = False) -> CpuSample | None:
    st = _stat(pid)
    if st is None:
        return None
    cpu, sys_s = _times(st[1], children=tree)
    rss, hwm = _status(pid)
    (wakeups, preemptions), writes, runq = _switches(pid), _writes(pid), _runq_wait(pid)
    if tree:
        for child in _descendants(pid):
            cst = _stat(child)
            if cst is not None:
                c_cpu, c_sys = _times(cst[1], children=False)
                cpu += c_cpu
                sys_s += c_sys
                rss += _status(child)[0]
                woken, preempted = _switches(child)
                wakeups += woken
                preemptions += preempted
                writes += _writes(child)
                runq += _runq_wait(child)
    return CpuSample(cpu, rss, hwm, sys_s, wakeups, writes, preemptions, runq)


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def self_wakeups() -> int:
    """This process's wake-ups (the load generator's, counted like the services')."""
    return _switches(os.getpid())[0]


def self_writes() -> int:
    """This process's write syscalls (the load generator's, counted like the services')."""
    return _writes(os.getpid())


def machine() -> dict[str, object]:
    import platform

    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    ram = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
                break
    return {"nproc": os.cpu_count(), "cpu_model": model, "ram_gib": round(ram / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}


# /proc/stat's first line: the machine's CPU time by kind, in ticks since boot.
_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_ticks() -> dict[str, int] | None:
    """The machine's CPU ticks by kind (None where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return None
    return {k: int(v) for k, v in zip(_STAT_FIELDS, first[1:], strict=False)}


def machine_shares(before: dict[str, int] | None, after: dict[str, int] | None
                   ) -> dict[str, float] | None:
    """Each kind's share of the machine's CPU time between two readings. `steal` is time the
    hypervisor ran someone else on our virtual CPUs: a phase's tail that coincides with it
    is the host's, not the code's; `iowait`, time idle while waiting for the disk (fsync)."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before.get(k, 0) for k in after}
    total = sum(d.values())
    if total <= 0:
        return None
    return {k: round(d[k] / total, 3) for k in ("idle", "iowait", "steal") if k in d}
