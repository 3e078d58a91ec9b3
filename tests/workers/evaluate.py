"""Score saved weights with common/mnist.py's evaluate() as one rank of a gloo group; print one
JSON line (rank, loss, accuracy).

Started by tests/test_evaluate.py, one process per rank (tests/helpers.py's run_ranks):
    python tests/workers/evaluate.py WEIGHTS IMAGES   # the first IMAGES test images
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common.env import resolve_launch_env  # noqa: E402
from common.launch import check_launch, dist_timeout  # noqa: E402
from common.mnist import build_model, evaluate, load_mnist, normalize  # noqa: E402


def main() -> None:
    weights, images = sys.argv[1], int(sys.argv[2])
    env = resolve_launch_env()
    check_launch(env)
    # One thread in every process, whatever the world size: the same kernels, the same bits.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size,
                            timeout=dist_timeout())  # fmt: skip
    try:
        model = build_model()
        model.load_state_dict(torch.load(weights, weights_only=True))
        x, y = load_mnist(train=False)
        loss, accuracy = evaluate(model, normalize(x[:images]), y[:images])
        # One write per line: the ranks share the pipe.
        sys.stdout.write(json.dumps({"rank": env.rank, "loss": loss, "acc": accuracy}) + "\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
