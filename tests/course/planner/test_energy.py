"""minidist_course.planner.energy and the energy line of cost.estimate: units by hand, PUE 1, zero price,
the datasheet figures it states, and refusals."""

import pytest

from minidist_course.planner import calc, cost, energy

H100 = calc.GPUS["H100-80GB"]["peak_flops"]


def test_one_gpu_for_one_hour_at_its_tdp_is_its_watts_in_wh():
    # 700 W for 1 h = 700 Wh = 0.7 kWh; no node, PUE 1
    assert energy.energy_kwh(1.0, 700.0) == pytest.approx(0.7)
    assert energy.energy_kwh(0.0, 700.0, 4600.0, 8, 1.5) == 0.0          # no hours, no energy


def test_node_power_is_shared_by_the_gpus_of_a_node():
    # 16 GPU-hours on 8-GPU nodes = 2 node-hours: 16 · 700 + 2 · 4600 = 20,400 Wh
    assert energy.energy_kwh(16.0, 700.0, 4600.0, 8) == pytest.approx(20.4)
    # a DGX H100 at full load draws its listed 10.2 kW: one node-hour is 10.2 kWh
    assert energy.energy_kwh(8.0, energy.GPU_WATTS["H100-80GB"], energy.DGX_H100_NODE_WATTS, 8) \
        == pytest.approx(10.2)


def test_pue_multiplies_and_pue_one_adds_nothing():
    it = energy.energy_kwh(100.0, 400.0, 1000.0, 4)
    assert energy.energy_kwh(100.0, 400.0, 1000.0, 4, pue=1.0) == it
    assert energy.energy_kwh(100.0, 400.0, 1000.0, 4, pue=1.58) == pytest.approx(1.58 * it)
    assert energy.energy_kwh(100.0, 400.0, 1000.0, 4, utilisation=0.5) == pytest.approx(it / 2)


def test_zero_price_costs_nothing_and_price_is_linear():
    assert energy.energy_cost(1234.0, 0.0) == 0.0
    assert energy.energy_cost(1000.0, 0.10) == pytest.approx(100.0)
    assert energy.energy_cost(1000.0, 0.20) == pytest.approx(2 * energy.energy_cost(1000.0, 0.10))


def test_stated_figures():
    """The docstring's sources, as numbers: SXM TDPs, DGX H100 less its GPUs, typical PUEs."""
    assert energy.GPU_WATTS == {"V100-32GB": 300.0, "A100-80GB": 400.0, "H100-80GB": 700.0}
    assert set(energy.GPU_WATTS) == set(calc.GPUS)           # a power for every GPU the planner knows
    assert energy.DGX_H100_NODE_WATTS == 4600.0
    assert energy.PUE["ideal"] == 1.0 < energy.PUE["hyperscale"] < energy.PUE["average"] < 2
    assert 0 < energy.ELECTRICITY["cheap"] < energy.ELECTRICITY["expensive"]


@pytest.mark.parametrize("kwargs,match", [
    ({"gpu_hours": -1.0}, "gpu_hours must be a number >= 0"),
    ({"gpu_watts": float("inf")}, "gpu_watts must be a number >= 0"),
    ({"node_watts": -5.0}, "node_watts must be"),
    ({"pue": 0.9}, r"pue must be >= 1 \(facility power / IT power\), got 0.9"),
    ({"pue": True}, "pue must be >= 1"),
    ({"utilisation": 0.0}, r"utilisation must be in \(0, 1\]"),
    ({"utilisation": 1.5}, r"utilisation must be in \(0, 1\]"),
    ({"gpus_per_node": 0}, "gpus_per_node must be a whole number >= 1"),
    ({"gpus_per_node": 2.5}, "gpus_per_node must be a whole number >= 1"),
])
def test_bad_input_is_refused_by_name(kwargs, match):
    args = {"gpu_hours": 1.0, "gpu_watts": 700.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        energy.energy_kwh(**args)


def test_negative_price_is_refused():
    with pytest.raises(ValueError, match="price_per_kwh must be a number >= 0"):
        energy.energy_cost(1.0, -0.1)


def test_estimate_energy_line():
    """8 GPUs for exactly one hour (1 node-hour) on a DGX-like node at PUE 1.5 and 0.10/kWh:
    10.2 kWh · 1.5 · 0.10 = 1.53; zero by default (the cloud's GPU-hour price includes power)."""
    flops = 8 * 3600 * H100 * 0.4                     # one hour on 8 GPUs at 40 % MFU
    e = cost.estimate(flops, 8, 4.0, H100, 0.4, gpu_watts=700.0, node_watts=4600.0,
                      gpus_per_node=8, pue=1.5, price_per_kwh=0.10)
    assert e.wall_time == pytest.approx(3600)
    assert e.lines["energy"] == pytest.approx(1.53)
    assert e.total == pytest.approx(8 * 4.0 + 1.53)
    assert cost.estimate(flops, 8, 4.0, H100, 0.4).lines["energy"] == 0.0
    assert cost.estimate(flops, 8, 4.0, H100, 0.4, gpu_watts=700.0, pue=1.5).lines["energy"] == 0.0


def test_estimate_energy_counts_the_whole_wall_time():
    """Interruptions keep the GPUs powered: energy scales with wall time, not with useful work."""
    flops = 8 * 3600 * H100 * 0.4
    kw = dict(gpu_watts=700.0, price_per_kwh=1.0)
    calm = cost.estimate(flops, 8, 4.0, H100, 0.4, **kw)
    spot = cost.estimate(flops, 8, 4.0, H100, 0.4, interruptions_per_hour=1.0,
                         checkpoint_interval=600.0, restart_time=300.0, **kw)
    assert spot.wall_time > calm.wall_time
    assert spot.lines["energy"] / calm.lines["energy"] == pytest.approx(spot.wall_time / calm.wall_time)
