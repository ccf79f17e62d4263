"""What a run cost: the price it is counted at, and its device-hours."""

from __future__ import annotations

from gpt2.run.cost import cost_figures, price_per_hour


def test_a_known_gpu_has_an_assumed_price_a_cpu_none_unless_set():
    assert price_per_hour(None, "cuda", "NVIDIA H100 80GB HBM3") == (2.50, "assumed on-demand price of an H100")
    assert (price_per_hour(None, "cuda", "NVIDIA H100 NVL")[0] == 2.50
            and price_per_hour(None, "cuda", "NVIDIA L4")[0] == 0.80)
    assert price_per_hour(None, "cpu", "x86_64") == (None, "no price (set train.price_per_hour)")
    assert price_per_hour(None, "cuda", "Some Future GPU")[0] is None
    assert price_per_hour(0.5, "cpu", "x86_64") == (0.5, "train.price_per_hour")


def test_device_hours_count_every_device_for_the_whole_wall_time():
    assert cost_figures(1800.0, 8, 2.5) == {"device_hours": 4.0, "usd": 10.0}
    assert cost_figures(36.0, 1, None) == {"device_hours": 0.01, "usd": None}
