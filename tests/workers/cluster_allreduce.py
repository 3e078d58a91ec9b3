"""One task of a cross-node gloo all_reduce, placed by SLURM's variables alone.

Started by tests/test_cluster.py as ``srun -N2 --ntasks-per-node=2 python cluster_allreduce.py``
with MASTER_PORT set; the rendezvous host is the first node of the step, reached by its name.
Prints one JSON line: hostname, rank, world size and the reduced sum.
"""

import datetime
import json
import os
import socket

import hostlist
import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    master = hostlist.expand_hostlist(os.environ["SLURM_STEP_NODELIST"])[0]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    # Every rank also learns where the others ran: proof the group spans nodes.
    hosts = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "hostname": socket.gethostname(),
                "node": os.environ["SLURMD_NODENAME"],
                "rank": rank,
                "world_size": world_size,
                "sum": value.item(),
                "hosts": hosts,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
