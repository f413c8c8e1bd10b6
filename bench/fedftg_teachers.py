"""FedFTG teacher forward passes: Python loop vs ``vmap(functional_call)``, and one full fine-tuning.

For K client models of one architecture (10 by default) and a batch of 64
pseudo images, prints the median time of:

* the teachers' forward pass alone (no grad: the global-model phase), loop vs vmap;
* forward + backward to the input (the generator phase needs gradients
  through the teachers to the pseudo images), loop vs vmap;

for a 2-conv CNN on 32x32x3 (the FedAvg CNN) and, unless ``--no-resnet``, the
official FedFTG ResNet-18 (torchvision layout, 7x7 stem + max-pool, BatchNorm)
on 32x32x3; then the time of one full ``FedFTGHook.finetune``
(``teacher_forward="loop"``, the default, unless ``--finetune-modes`` says otherwise) (I=10, I_g=1,
I_d=5, batch 64, the paper's generator) with the CNN teachers in each mode.
It prints figures and asserts nothing (the equality of both forms is a test
in tests/fl/test_fedftg.py; the largest difference seen here is printed too).

On a small machine shared with other work, compare with ``--threads 1``:
several intra-op threads competing with another process for 2 cores made
every figure 2-6x worse and noisy (the loop's many small ops suffer most).

    python bench/fedftg_teachers.py [--clients 10] [--batch 64] [--reps 3] [--threads N]
                                    [--device cpu|cuda] [--no-resnet] [--no-finetune]
                                    [--finetune-modes loop|vmap|loop,vmap]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fedreid.fl.server_hooks.fedftg import FedFTGConfig, FedFTGHook, TeacherEnsemble  # noqa: E402


def small_cnn(num_classes: int = 10) -> nn.Module:
    """The FedAvg CIFAR CNN: two 5x5 convs with max-pool, two FC layers."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 5 * 5, 512), nn.ReLU(), nn.Linear(512, num_classes),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.down(x))


def resnet18(num_classes: int = 10) -> nn.Module:
    """ResNet-18 as in the official FedFTG code (torchvision layout) for 32x32 inputs."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def make_clients(factory: Callable[[], nn.Module], k: int, device: torch.device) -> list[nn.Module]:
    models = []
    with torch.random.fork_rng():
        for i in range(k):
            torch.manual_seed(i)
            m = factory().to(device)
            m.train()
            with torch.no_grad():  # different BN statistics per client
                m(torch.randn(8, 3, 32, 32, device=device))
            models.append(m.eval())
    return models


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_teachers(name: str, factory: Callable[[], nn.Module], args: argparse.Namespace,
                   device: torch.device) -> None:
    clients = make_clients(factory, args.clients, device)
    template = factory().to(device)
    x = torch.randn(args.batch, 3, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    loop = TeacherEnsemble(template, clients, "loop", device)
    vm = TeacherEnsemble(template, clients, "vmap", device)
    with torch.no_grad():
        diff = (loop(x) - vm(x)).abs().max().item()

    def fwd(ens: TeacherEnsemble) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return ens(x)
        return run

    def fwd_bwd(ens: TeacherEnsemble) -> Callable[[], object]:
        def run() -> object:
            xi = x.detach().requires_grad_(True)
            out = ens(xi)
            (grad,) = torch.autograd.grad(out.square().mean(), xi)
            return grad
        return run

    rows = []
    for label, make in (("forward (no grad)", fwd), ("forward+backward to x", fwd_bwd)):
        t_loop = median_time(make(loop), args.reps, device)
        t_vmap = median_time(make(vm), args.reps, device)
        rows.append((label, t_loop, t_vmap))
    loop.close()
    params = sum(p.numel() for p in template.parameters())
    print(f"\n{name}: K={args.clients} teachers, {params / 1e6:.2f} M parameters each, batch {args.batch}, "
          f"max |loop - vmap| = {diff:.2e}")
    for label, t_loop, t_vmap in rows:
        print(f"  {label:24s} loop {t_loop * 1e3:9.1f} ms   vmap {t_vmap * 1e3:9.1f} ms   "
              f"vmap/loop {t_vmap / t_loop:5.2f}")


def bench_finetune(args: argparse.Namespace, device: torch.device) -> None:
    clients = make_clients(small_cnn, args.clients, device)
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (args.clients, 10), generator=gen).float()
    print(f"\nfull finetune, 2-conv CNN teachers, K={args.clients}, I=10, I_g=1, I_d=5, batch {args.batch}, "
          "generator ngf=64, z=100:")
    for mode in args.finetune_modes.split(","):
        cfg = FedFTGConfig(batch_size=args.batch, teacher_forward=mode, eval_batches=0)
        hook = FedFTGHook(cfg, seed=0)
        with torch.random.fork_rng():
            torch.manual_seed(100)  # the same global model for every mode
            glob = small_cnn().to(device)
        t0 = time.perf_counter()
        metrics = hook.finetune(glob, clients, counts, torch.Generator().manual_seed(1))
        sync(device)
        total = time.perf_counter() - t0
        used = metrics["fedftg_teacher_forward"]
        print(f"  {mode}->{used:5s} {total:7.2f} s   (L_md first {metrics['fedftg_md_first']:.4f} -> "
              f"last {metrics['fedftg_md_last']:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-resnet", action="store_true")
    parser.add_argument("--no-finetune", action="store_true")
    parser.add_argument("--finetune-modes", default="loop", help="comma-separated teacher_forward values to time")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, device {name}, {torch.get_num_threads()} intra-op threads, "
          f"median of {args.reps}")
    bench_teachers("2-conv CNN 32x32x3", small_cnn, args, device)
    if not args.no_resnet:
        bench_teachers("ResNet-18 (official layout) 32x32x3", resnet18, args, device)
    if not args.no_finetune:
        bench_finetune(args, device)


if __name__ == "__main__":
    main()
