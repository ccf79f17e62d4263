"""What this machine's CPU is, as Linux's /proc/cpuinfo says: its vendor picks a matmul library, its model
names the machine in a run's records and keys its measured peak."""

from __future__ import annotations

import platform


def cpu_info(field: str) -> str:
    """A field of /proc/cpuinfo's first CPU (``vendor_id``, ``model name``), '' where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.split(":")[0].strip() == field), "")
    except OSError:
        return ""


def cpu_vendor() -> str:
    """The x86 vendor string (``GenuineIntel``, ``AuthenticAMD``) where /proc/cpuinfo says it, else ''."""
    return cpu_info("vendor_id")


def cpu_name() -> str:
    """The CPU's model name (``AMD EPYC 9B45``); the architecture where the kernel does not say
    (``platform.processor()`` is often just that too)."""
    return cpu_info("model name") or platform.processor() or platform.machine()
