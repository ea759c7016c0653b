"""A training script written the way SageMaker model-parallel v1 scripts were (its MNIST example's shape), on
random MNIST-shaped data. The one line that changed is the import. Run it under torchrun:

    SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 4, "pipeline": "interleaved"}' \\
        python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_v1_mnist.py --checkpoint-dir /tmp/ckpt

With "ddp": true on 4 ranks it trains 2 replicas of the 2 partitions, each on its shard of the data
(--batch-size is then each replica's share of the global batch).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import smp.v1 as smp  # was: import smdistributed.modelparallel.torch as smp


class Net1(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        return torch.flatten(x, 1)


class Net2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), 1)


class GroupedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = Net1()
        self.net2 = Net2()

    def forward(self, x):
        return self.net2(self.net1(x))


def random_mnist(n: int, seed: int) -> TensorDataset:
    """MNIST-shaped data (1x28x28 images, 10 classes) that every rank generates identically."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


# SM Distributed: the forward and backward of one batch; the batch is split into microbatches.
@smp.step
def train_step(model, scaler, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(scaler.scale(loss))
    return output, loss


def train(model, scaler, device, train_loader, optimizer, epoch, losses, first_step_path=None):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        _, loss_mb = train_step(model, scaler, data, target)
        loss = loss_mb.reduce_mean()  # SM Distributed: average the loss across microbatches
        scaler.step(optimizer)
        scaler.update()
        if smp.dp_size() > 1:  # this replica's loss; the global batch's is the mean over the replicas
            dist.all_reduce(loss, group=smp.get_dp_process_group())
            loss /= smp.dp_size()
        losses.append(loss.item())
        if first_step_path and batch_idx == 0:
            state = model.state_dict()  # a collective over the model replica's ranks
            if smp.rank() == 0:
                torch.save(state, first_step_path)
        if smp.rank() == 0:
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                epoch, batch_idx * len(data), len(train_loader.dataset), 100.0 * batch_idx / len(train_loader),
                loss.item()), flush=True)


# SM Distributed: the evaluation step; it returns Python numbers, which come back as lists.
@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1, keepdim=True)
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            loss_batch, correct_batch = test_step(model, data, target)
            test_loss += sum(loss_batch)
            correct += sum(correct_batch)
    test_loss /= len(test_loader.dataset)
    if smp.mp_rank() == 0:
        print("\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n".format(
            test_loss, correct, len(test_loader.dataset), 100.0 * correct / len(test_loader.dataset)), flush=True)
    return test_loss


def write_ranks(model, directory):
    """What the rank helpers say on this rank, and where smp's pipeline put it."""
    helpers = ("rank", "size", "local_rank", "local_size", "pp_rank", "pp_size", "mp_rank", "mp_size", "dp_rank",
               "dp_size", "rdp_rank", "rdp_size", "get_mp_group", "get_dp_group")
    out = {name: getattr(smp, name)() for name in helpers}
    out["dp_process_group"] = dist.get_process_group_ranks(smp.get_dp_process_group())
    out["mp_process_group"] = dist.get_process_group_ranks(smp.get_mp_process_group())
    out["pipe"] = [model.pipe.pp_rank, model.pipe.dp_rank, model.pipe.layout.pp_ranks]
    out["local_parameters"] = [name for name, _ in model.local_named_parameters()]
    with open(os.path.join(directory, f"rank{smp.rank()}.json"), "w") as f:
        json.dump(out, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--train-size", type=int, default=256)
    parser.add_argument("--test-size", type=int, default=64)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--log-json", default=None, help="rank 0 writes its losses here")
    parser.add_argument("--first-step-state", default=None, help="rank 0 saves the model's state after step 1 here")
    parser.add_argument("--ranks-dir", default=None, help="every rank writes its rank helpers' answers here")
    args = parser.parse_args()

    torch.manual_seed(1)
    smp.init()  # the configuration comes from SM_HP_MP_PARAMETERS, as SageMaker passed it

    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")

    # SM Distributed: each data-parallel replica reads its own shard of the training data
    train_set = random_mnist(args.train_size, seed=2)
    sampler = DistributedSampler(train_set, num_replicas=smp.dp_size(), rank=smp.dp_rank(), shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    test_loader = DataLoader(random_mnist(args.test_size, seed=3), batch_size=args.batch_size, shuffle=False)

    model = GroupedNet()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    model = smp.DistributedModel(model)
    scaler = smp.amp.GradScaler()
    optimizer = smp.DistributedOptimizer(optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    train_losses, test_losses = [], []
    for epoch in range(1, args.epochs + 1):
        train(model, scaler, device, train_loader, optimizer, epoch, train_losses,
              args.first_step_state if epoch == 1 else None)
        test_losses.append(test(model, device, test_loader))
        scheduler.step()

    if args.ranks_dir:
        write_ranks(model, args.ranks_dir)

    os.makedirs(args.checkpoint_dir, exist_ok=True)
    partial = os.path.join(args.checkpoint_dir, "pt_mnist_checkpoint.pt")
    if smp.dp_rank() == 0:
        smp.save({"model_state_dict": model.local_state_dict(), "optimizer_state_dict": optimizer.local_state_dict()},
                 partial, partial=True)
        full = model.state_dict()  # a collective: every rank with dp_rank() == 0 calls it
        smp.save(full, os.path.join(args.checkpoint_dir, "full.pt"), partial=False)
    smp.barrier()

    # Train on: the weights move away from the checkpoint; loading it must bring back its test loss.
    train(model, scaler, device, train_loader, optimizer, args.epochs + 1, train_losses)
    moved_test_loss = test(model, device, test_loader)
    checkpoint = smp.load(partial, partial=True)
    model.load_state_dict(checkpoint["model_state_dict"])
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    reloaded_test_loss = test(model, device, test_loader)

    if smp.rank() == 0:
        print(f"reloaded the partial checkpoint: test loss {reloaded_test_loss:.6f} (saved at {test_losses[-1]:.6f}, "
              f"{moved_test_loss:.6f} after one more epoch)", flush=True)
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump({"train_losses": train_losses, "test_losses": test_losses,
                           "moved_test_loss": moved_test_loss, "reloaded_test_loss": reloaded_test_loss,
                           "plan": model.pipe.plan.summary()}, f)


if __name__ == "__main__":
    main()
