"""Small seeded synthetic datasets for tests, smoke runs and mechanism checks.

Every bundle says ``synthetic=True`` in its meta so figures and records label it as such.
"""

from __future__ import annotations

import torch

from curvopt.api import DataBundle


def gaussian_classification(
    num_train: int = 512,
    num_val: int = 128,
    num_test: int = 128,
    dim: int = 20,
    num_classes: int = 5,
    noise: float = 1.0,
    seed: int = 0,
    name: str = "gaussian_classification",
) -> DataBundle:
    """Gaussian class clusters around random means: a learnable multiclass problem.

    Args:
        num_train: Training examples.
        num_val: Validation examples.
        num_test: Test examples.
        dim: Input dimension.
        num_classes: Number of classes (means drawn from ``N(0, 4I)``).
        noise: Standard deviation of the points around their class mean.
        seed: Seed of every draw.
        name: ``meta["name"]`` of the bundle.

    Returns:
        A :class:`~curvopt.api.DataBundle` with integer labels, ``meta["synthetic"] = True``.
    """
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(num_classes, dim, generator=g) * 2.0

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, num_classes, (n,), generator=g)
        return means[y] + noise * torch.randn(n, dim, generator=g), y

    return DataBundle(
        train=draw(num_train),
        val=draw(num_val),
        test=draw(num_test),
        meta={"name": name, "synthetic": True, "num_classes": num_classes},
    )


def low_rank_images(
    num_train: int = 512,
    num_val: int = 128,
    num_test: int = 128,
    dim: int = 64,
    rank: int = 4,
    seed: int = 0,
    name: str = "low_rank_images",
) -> DataBundle:
    """Vectors in [0, 1] lying near a low-dimensional manifold: an autoencoder can learn them.

    Each example is ``sigmoid(z B)`` with ``z ~ N(0, I_rank)`` and a fixed random ``B``; targets
    equal inputs.

    Args:
        num_train: Training examples.
        num_val: Validation examples.
        num_test: Test examples.
        dim: Vector dimension.
        rank: Dimension of the latent ``z``.
        seed: Seed of every draw.
        name: ``meta["name"]`` of the bundle.

    Returns:
        A :class:`~curvopt.api.DataBundle` of ``(x, x)`` pairs, ``meta["synthetic"] = True``.
    """
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, dim, generator=g)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.sigmoid(torch.randn(n, rank, generator=g) @ basis)
        return x, x

    return DataBundle(
        train=draw(num_train), val=draw(num_val), test=draw(num_test), meta={"name": name, "synthetic": True}
    )
