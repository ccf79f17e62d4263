"""What a run cost: device-hours, and dollars at a price per device-hour.

Where ``train.price_per_hour`` is not set, a GPU the peak table knows is priced at an assumed
on-demand rate (the one ``gpt2 plan`` uses); a CPU or an unknown device has no cost unless a price
is set. Device-hours count every device of the run for the whole of its wall time, over all its
sessions: the machine is paid for while it builds, compiles and evaluates too.
"""

from __future__ import annotations

from gpt2.run.flops import device_key

# Assumed on-demand USD per GPU-hour, by the peak table's device name (gpt2/run/flops.py).
ASSUMED_PRICE_PER_HOUR = {"H100": 2.50, "H100 PCIe": 2.20, "H100 NVL": 2.50, "H200": 3.50, "H200 NVL": 3.50,
                          "B200": 5.00, "L40S": 1.00, "A100": 1.50, "L4": 0.80, "V100": 0.60}


def price_per_hour(given: float | None, device_type: str, device_name: str) -> tuple[float | None, str]:
    """The price a run's cost is counted at, and where it comes from."""
    if given is not None:
        return given, "train.price_per_hour"
    key = device_key(device_name) if device_type == "cuda" else None
    if key in ASSUMED_PRICE_PER_HOUR:
        return ASSUMED_PRICE_PER_HOUR[key], f"assumed on-demand price of an {key}"
    return None, "no price (set train.price_per_hour)"


def cost_figures(wall_s: float, devices: int, price: float | None) -> dict[str, float | None]:
    """``device_hours`` and ``usd`` (None without a price)."""
    hours = wall_s * devices / 3600
    return {"device_hours": round(hours, 9), "usd": round(hours * price, 6) if price is not None else None}
