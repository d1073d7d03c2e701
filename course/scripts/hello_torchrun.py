"""Chapter 01: the same rank code as a script, started by torchrun (or srun).

    python -m torch.distributed.run --standalone --nproc_per_node=2 course/scripts/hello_torchrun.py

torchrun starts the processes and sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
``minidist.init()`` reads them, picks the backend (nccl with one GPU per rank, else gloo) and the
device (cuda:LOCAL_RANK), and initialises the process group (init method env://).
"""

import torch
import torch.distributed as dist

import minidist
from minidist import collectives


def main() -> None:
    info = minidist.init(timeout=60)
    device = minidist.env.device()
    x = torch.full((4,), float(info.rank + 1), device=device)
    collectives.all_reduce(x)  # minidist's ring; every rank gets 1 + 2 + ... + W
    expected = info.world_size * (info.world_size + 1) / 2
    assert torch.all(x == expected), (info.rank, x.tolist())
    print(f"RESULT rank {info.rank} of {info.world_size} (local rank {info.local_rank}, "
          f"launcher {info.launcher}, backend {dist.get_backend()}): all_reduce -> {x[0].item():g}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
