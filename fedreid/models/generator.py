"""Conditional generator ``G(z, y)`` of FedFTG (Zhang et al., CVPR 2022, Table 7(a)).

FedFTG's server trains a conditional generator that maps a noise vector
``z ~ N(0, I)`` and a class label ``y`` to a pseudo image ``x~ = G(z, y; theta)``
(the input of every loss of the paper, Eq. 3-8). Table 7(a) of the paper's
appendix (the DFAD generator with a label branch), for 32x32x3 images::

    FC(z) -> 4096, FC(onehot(y)) -> 4096, concat -> 8192
    reshape, BN                      -> 128 x 8 x 8
    Conv2D, BN, LeakyReLU            -> 128 x 8 x 8
    upsample                         -> 128 x 16 x 16
    Conv2D, BN, LeakyReLU            -> 64 x 16 x 16
    upsample                         -> 64 x 32 x 32
    Conv2D, Tanh                     -> 3 x 32 x 32

with ``4096 = ngf * 8 * 8``, ``ngf = 64``, LeakyReLU slope 0.2 and 3x3
convolutions. ``layer_order="paper"`` (default) is that order: each
convolution block runs *before* the upsampling that follows it. The official
code's ``CGeneratorA`` (``models/gan_models.py`` of
github.com/ZhangLin-PKU/FedFTG) upsamples first and convolves after, so its
two blocks run at 16x16 and 32x32 (``layer_order="official"``)::

    reshape, BN -> upsample -> Conv, BN, LeakyReLU (16x16) -> upsample
    -> Conv, BN, LeakyReLU (32x32) -> Conv, Tanh [-> BatchNorm2d(C, affine=False)]

Same parameters, about 4x the convolution cost. ``z_dim`` is 100, 256 for
CIFAR-100 (appendix Sec. 7.4), see :func:`default_z_dim`.

Sizes. Table 7 starts from ``img_size / 4`` and doubles twice, which only
works for sizes divisible by 4. Here the start is ``ceil(H / 4) x ceil(W / 4)``,
the first upsampling goes to ``ceil(H / 2) x ceil(W / 2)`` and the second to
exactly ``H x W`` (nearest interpolation to a given size; for sizes divisible
by 4 this is the same as ``scale_factor=2``). So 32x32x3 (CIFAR), 28x28x1
(Fashion-MNIST: 7 -> 14 -> 28), 8x8x1 (scikit-learn digits: 2 -> 4 -> 8) and
non-square sizes all work.

Output normalisation. The official generator ends with a non-affine
``BatchNorm2d`` *after* the Tanh, so its images are standardised per channel
over the batch rather than bounded in ``[-1, 1]``; ``output_norm=True``
reproduces it. The default (``False``) ends at the Tanh, as Table 7 does.

Initialisation draws from a ``torch.Generator`` (or a seed) only: the layers
are built on the ``meta`` device, so constructing a generator never touches
torch's global random state, and the same seed gives the same weights.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedreid.errors import FedReIDError

ImageSize = Union[int, Sequence[int]]
#: ``paper``: Table 7(a), convolution then upsampling; ``official``: ``CGeneratorA``, upsampling then convolution.
LAYER_ORDERS: tuple[str, ...] = ("paper", "official")


class GeneratorConfigError(FedReIDError, ValueError):
    """Bad generator sizes (classes, noise dimension, image size, channels)."""


def default_z_dim(num_classes: int) -> int:
    """The paper's noise dimension: 100, or 256 for (at least) 100 classes (CIFAR-100)."""
    return 256 if num_classes >= 100 else 100


def _pair(size: ImageSize) -> tuple[int, int]:
    if isinstance(size, int):
        return int(size), int(size)
    values = tuple(int(s) for s in size)
    if len(values) != 2:
        raise GeneratorConfigError(f"generator: image_size must be an int or (height, width), got {size!r}")
    return values  # type: ignore[return-value]


def sample_noise(
    batch_size: int, z_dim: int, generator: torch.Generator, *, device: torch.device | str = "cpu"
) -> Tensor:
    """``z ~ N(0, I)``, ``[batch_size, z_dim]``, drawn on the CPU from ``generator`` then moved.

    Drawing on the CPU makes the noise (and so the whole fine-tuning) the same
    on every device for the same generator state.
    """
    return torch.randn(batch_size, z_dim, generator=generator).to(device)


class ConditionalGenerator(nn.Module):
    """``G(z, y)``: noise ``[B, z_dim]`` and labels -> images ``[B, C, H, W]``.

    ``y`` is either integer class labels ``[B]`` or (soft) one-hot rows
    ``[B, num_classes]``. See the module docstring for the layers.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        z_dim: Optional[int] = None,
        image_size: ImageSize = 32,
        channels: int = 3,
        base_channels: int = 64,
        output_norm: bool = False,
        layer_order: str = "paper",
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        if num_classes < 1:
            raise GeneratorConfigError(f"generator: num_classes must be >= 1, got {num_classes}")
        z_dim = default_z_dim(num_classes) if z_dim is None else int(z_dim)
        height, width = _pair(image_size)
        if z_dim < 1 or channels < 1 or base_channels < 1 or height < 1 or width < 1:
            raise GeneratorConfigError(
                f"generator: z_dim, channels, base_channels and image size must be positive, got "
                f"z_dim={z_dim}, channels={channels}, base_channels={base_channels}, image_size={(height, width)}"
            )
        if layer_order not in LAYER_ORDERS:
            raise GeneratorConfigError(
                f"generator: layer_order must be one of {', '.join(LAYER_ORDERS)}, got {layer_order!r}"
            )
        self.layer_order = layer_order
        self.num_classes = int(num_classes)
        self.z_dim = z_dim
        self.image_size = (height, width)
        self.channels = int(channels)
        self.base_channels = int(base_channels)
        # Start small enough that two doublings reach (at least) the target,
        # then interpolate to the exact sizes (see the module docstring).
        self.init_size = (math.ceil(height / 4), math.ceil(width / 4))
        self.mid_size = (math.ceil(height / 2), math.ceil(width / 2))
        ngf = self.base_channels
        cells = ngf * self.init_size[0] * self.init_size[1]
        # Built on the meta device: no global-RNG draws; real init below.
        with torch.device("meta"):
            self.noise_fc = nn.Linear(z_dim, cells)
            self.label_fc = nn.Linear(self.num_classes, cells)
            self.bn0 = nn.BatchNorm2d(2 * ngf)
            self.block1 = nn.Sequential(
                nn.Conv2d(2 * ngf, 2 * ngf, 3, stride=1, padding=1),
                nn.BatchNorm2d(2 * ngf),
                nn.LeakyReLU(0.2, inplace=True),
            )
            self.block2 = nn.Sequential(
                nn.Conv2d(2 * ngf, ngf, 3, stride=1, padding=1),
                nn.BatchNorm2d(ngf),
                nn.LeakyReLU(0.2, inplace=True),
            )
            self.to_image = nn.Conv2d(ngf, self.channels, 3, stride=1, padding=1)
            self.output_bn: Optional[nn.BatchNorm2d] = (
                nn.BatchNorm2d(self.channels, affine=False) if output_norm else None
            )
        self.to_empty(device="cpu")
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(0 if seed is None else int(seed))
        elif seed is not None:
            raise GeneratorConfigError("generator: pass either a torch.Generator or a seed, not both")
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """PyTorch's default initialisation, drawn from ``generator`` in module order.

        Linear/Conv: ``kaiming_uniform_(a=sqrt(5))`` weights and
        ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` biases (what ``reset_parameters``
        of those layers does with the global RNG); BatchNorm: weight 1, bias 0,
        fresh running statistics.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                weight = module.weight
                nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
                if module.bias is not None:
                    fan_in = weight[0].numel()
                    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
                    nn.init.uniform_(module.bias, -bound, bound, generator=generator)
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_running_stats()
                if module.affine:
                    nn.init.ones_(module.weight)
                    nn.init.zeros_(module.bias)

    def _labels(self, y: Tensor, batch: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        if y.dim() == 1:
            if y.shape[0] != batch:
                raise ValueError(f"generator: {y.shape[0]} labels for {batch} noise vectors")
            return F.one_hot(y.long().to(device), self.num_classes).to(dtype)
        if y.dim() == 2 and y.shape == (batch, self.num_classes):
            return y.to(device, dtype)
        raise ValueError(
            f"generator: labels must be [B] class indices or [B, {self.num_classes}] one-hot rows, "
            f"got shape {tuple(y.shape)}"
        )

    def forward(self, z: Tensor, y: Tensor) -> Tensor:
        batch = z.shape[0]
        z = z.reshape(batch, -1)
        if z.shape[1] != self.z_dim:
            raise ValueError(f"generator: noise has {z.shape[1]} dimensions, expected {self.z_dim}")
        onehot = self._labels(y, batch, z.device, z.dtype)  # in the noise's dtype
        h0, w0 = self.init_size
        # Noise and label embeddings side by side as channels (official CGeneratorA).
        out = torch.cat([self.noise_fc(z), self.label_fc(onehot)], dim=1)
        out = out.view(batch, 2 * self.base_channels, h0, w0)
        out = self.bn0(out)
        if self.layer_order == "paper":  # Table 7(a): convolve, then upsample
            out = F.interpolate(self.block1(out), size=self.mid_size, mode="nearest")
            out = F.interpolate(self.block2(out), size=self.image_size, mode="nearest")
        else:  # official CGeneratorA: upsample, then convolve
            out = self.block1(F.interpolate(out, size=self.mid_size, mode="nearest"))
            out = self.block2(F.interpolate(out, size=self.image_size, mode="nearest"))
        img = torch.tanh(self.to_image(out))
        if self.output_bn is not None:
            img = self.output_bn(img)
        return img

    def extra_repr(self) -> str:
        h, w = self.image_size
        return (f"num_classes={self.num_classes}, z_dim={self.z_dim}, image={self.channels}x{h}x{w}, "
                f"layer_order={self.layer_order}")


__all__ = [
    "LAYER_ORDERS",
    "ConditionalGenerator",
    "GeneratorConfigError",
    "default_z_dim",
    "sample_noise",
]
