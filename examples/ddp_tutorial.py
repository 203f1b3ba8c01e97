"""The PyTorch DDP tutorial's basic example, run with ringtree: only the DDP import line differs.

    torchrun --nproc_per_node=4 examples/ddp_tutorial.py

With torch's own DDP instead, swap the marked import for
`from torch.nn.parallel import DistributedDataParallel as DDP`; the run ends with the same
parameters (up to float rounding). On CPU the backend is gloo; on GPUs, NCCL.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

from ringtree.parallel import DistributedDataParallel as DDP  # the only ringtree line


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(steps, save_path):
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    torch.manual_seed(1234 + rank)  # every rank starts different: DDP broadcasts rank 0's weights

    # create model and move it to GPU with id rank
    if torch.cuda.is_available():
        device_id = rank % torch.cuda.device_count()
        model = ToyModel().to(device_id)
        ddp_model = DDP(model, device_ids=[device_id])
    else:
        device_id = "cpu"
        model = ToyModel()
        ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10).to(device_id))
        labels = torch.randn(20, 5).to(device_id)
        loss_fn(outputs, labels).backward()
        optimizer.step()

    if rank == 0 and save_path:
        torch.save(ddp_model.state_dict(), save_path)
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 5)))
    parser.add_argument("--save", default="", help="write rank 0's final state_dict here")
    args = parser.parse_args()
    demo_basic(args.steps, args.save)
