"""Energy: the electricity a training run draws, and what it costs.

``kWh = (GPU-hours · GPU watts + node-hours · other node watts) / 1000 · PUE``, and money =
kWh · price per kWh. Units: watts (W) in, kilowatt-hours (kWh) out, prices per kWh in the currency
of your prices. Hours are wall-clock hours the hardware is powered (the GPUs draw power while they
wait, restart or write checkpoints too).

* **GPU power**: the board's maximum (thermal design power, TDP): NVIDIA H100 SXM5 700 W (H100
  Tensor Core GPU datasheet), A100 SXM4 80GB 400 W (A100 datasheet), V100 SXM2 300 W (V100
  datasheet). A busy training GPU draws close to its TDP; the default assumes it draws all of it
  (``utilisation=1``), an upper bound.
* **The rest of the node**: CPUs, memory, NICs, switches, fans. An 8-GPU NVIDIA DGX H100 lists
  10.2 kW maximum (DGX H100 user guide, "system power"): 10.2 − 8 · 0.7 = 4.6 kW besides the GPUs.
* **PUE** (power usage effectiveness, The Green Grid 2007): facility power / IT power, so cooling
  and power conversion multiply the IT energy. Uptime Institute's annual surveys put the average
  data centre near 1.55–1.6 (2020–2023); hyperscalers report about 1.1 (Google's fleet: 1.10,
  2023 environmental report). PUE 1 is a facility that spends nothing but the IT load.
* **Prices**: electricity for industry ranges from a few cents per kWh (hydro-powered regions) to
  over 0.20 (parts of Europe in 2022–2023): :data:`ELECTRICITY` holds two ILLUSTRATIVE round
  numbers, not fetched, not a quote.

On a rented cloud GPU the electricity is inside the price per GPU-hour: this line is what that
price pays for power (or what an owned cluster pays on top of its hardware).
"""

from __future__ import annotations

import math

__all__ = ["GPU_WATTS", "DGX_H100_NODE_WATTS", "PUE", "ELECTRICITY", "energy_kwh", "energy_cost"]

GPU_WATTS = {"V100-32GB": 300.0, "A100-80GB": 400.0, "H100-80GB": 700.0}   # SXM TDP, datasheets
DGX_H100_NODE_WATTS = 10_200.0 - 8 * 700.0    # a DGX H100's 10.2 kW maximum less its 8 GPUs: 4.6 kW
PUE = {"ideal": 1.0, "hyperscale": 1.1, "average": 1.58}   # Green Grid metric; Google 2023; Uptime 2023
ELECTRICITY = {"as_of": "2026-11", "currency": "USD",        # per kWh, ILLUSTRATIVE: edit these
               "cheap": 0.05, "expensive": 0.20}


def _non_negative(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
            or math.isinf(value):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def energy_kwh(gpu_hours: float, gpu_watts: float, node_watts: float = 0.0,
               gpus_per_node: int = 8, pue: float = 1.0, utilisation: float = 1.0) -> float:
    """Kilowatt-hours drawn from the grid by ``gpu_hours`` GPU-hours of a job.

    Args:
        gpu_hours: GPU-hours powered (GPUs × wall-clock hours), >= 0.
        gpu_watts: one GPU's power at full load, W (e.g. :data:`GPU_WATTS`).
        node_watts: the rest of one node (CPUs, memory, network, fans), W; a node holds
            ``gpus_per_node`` GPUs, so the job runs ``gpu_hours / gpus_per_node`` node-hours.
        pue: facility power / IT power, >= 1 (:data:`PUE`).
        utilisation: the fraction of ``gpu_watts`` and ``node_watts`` drawn on average, in (0, 1].

    Returns ``(gpu_hours · gpu_watts + gpu_hours / gpus_per_node · node_watts) · utilisation
    · pue / 1000``. Raises ``ValueError`` for negative numbers, ``pue < 1``, a utilisation outside
    (0, 1] or ``gpus_per_node`` that is not a whole number >= 1.
    """
    _non_negative("gpu_hours", gpu_hours)
    _non_negative("gpu_watts", gpu_watts)
    _non_negative("node_watts", node_watts)
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a whole number >= 1, got {gpus_per_node!r}")
    if isinstance(pue, bool) or not isinstance(pue, (int, float)) or not 1 <= pue < math.inf:
        raise ValueError(f"pue must be >= 1 (facility power / IT power), got {pue!r}")
    if isinstance(utilisation, bool) or not isinstance(utilisation, (int, float)) \
            or not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be in (0, 1], got {utilisation!r}")
    watt_hours = gpu_hours * gpu_watts + gpu_hours / gpus_per_node * node_watts
    return watt_hours * utilisation * pue / 1000


def energy_cost(kwh: float, price_per_kwh: float) -> float:
    """Money for ``kwh`` kilowatt-hours at ``price_per_kwh`` (e.g. :data:`ELECTRICITY`)."""
    _non_negative("kwh", kwh)
    _non_negative("price_per_kwh", price_per_kwh)
    return kwh * price_per_kwh
