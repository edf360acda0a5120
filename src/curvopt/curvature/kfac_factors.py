"""Kronecker factors of K-FAC's layer blocks (Martens & Grosse 2015; KFC, Grosse & Martens 2016).

A layer ``s = W ā`` (``ā``: its input with a homogeneous 1 appended when it has a bias) has the Fisher
block ``F ≈ A ⊗ G`` with ``A = E[ā āᵀ]`` over its **activation rows** and ``G = E[g gᵀ]`` over its
**output rows** ``g = ∂L/∂s``:

* ``nn.Linear``: one row per example (inputs with extra leading dims, e.g. sequences, count every
  row as an example);
* ``nn.Conv2d`` (groups 1, zero padding): KFC, one row per output position; the activation rows
  are the im2col patches ``(C, kh, kw)`` (``F.unfold``'s order);
* ``nn.ConvTranspose2d`` (groups 1, dilation 1): the equivalent stride-1 convolution of the
  zero-dilated, padded input (:func:`convT_as_conv_input`) with the flipped, transposed kernel
  (:func:`convT_equivalent_weight`; how XLA implements it), then KFC.

:func:`activation_rows` builds the rows (the reference); :func:`input_factor` gives ``āᵀā / M``
without building them (:func:`patch_gram`), which is what :class:`curvopt.optim.kfac.KFAC` uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def block_kind(m: nn.Module) -> str | None:
    """The Kronecker block a layer gets: ``"linear"``, ``"conv"``, ``"convT"`` or ``None`` (none).

    Args:
        m: A module with a trainable weight.

    Returns:
        The kind, or ``None`` for a layer without a Kronecker block (e.g. a grouped convolution).
    """
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, nn.ConvTranspose2d) and _conv_supported(m):
        return "convT"
    if isinstance(m, nn.Conv2d) and _conv_supported(m):
        return "conv"
    return None


def _conv_supported(m: nn.Module) -> bool:
    if isinstance(m, nn.ConvTranspose2d):
        return m.groups == 1 and tuple(m.dilation) == (1, 1) and m.padding_mode == "zeros"
    if isinstance(m, nn.Conv2d):
        return m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)
    return False


def activation_rows(kind: str, m: nn.Module, x: Tensor, has_bias: bool) -> Tensor:
    """Activation rows ā ``(M, d_in [+1])`` of a layer's input (the reference of :func:`input_factor`).

    Args:
        kind: The layer's :func:`block_kind`.
        m: The layer.
        x: Its input.
        has_bias: Append the homogeneous column of ones.

    Returns:
        The rows.
    """
    if kind == "linear":
        rows = x.reshape(-1, x.shape[-1])
    else:
        if kind == "convT":
            x = convT_as_conv_input(x, m)
            patches = F.unfold(x, m.kernel_size, stride=1)
        else:
            patches = F.unfold(x, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    if has_bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def output_rows(kind: str, ds: Tensor) -> Tensor:
    """Output rows g ``(M, d_out)`` of the derivatives ``ds`` of a layer's output.

    Args:
        kind: The layer's :func:`block_kind`.
        ds: ``∂L/∂s``, the layer output's shape.

    Returns:
        The rows (for a convolution, one per example and output position).
    """
    if kind == "linear":
        return ds.reshape(-1, ds.shape[-1])
    return ds.flatten(2).transpose(1, 2).reshape(-1, ds.shape[1])  # (B, C, H, W) -> (B·H·W, C)


def input_factor(kind: str, m: nn.Module, x: Tensor, has_bias: bool) -> Tensor:
    """``Ā = āᵀā / M`` over the M activation rows of :func:`activation_rows`, without building them.

    Equal to ``rows.t() @ rows / M`` (tested against it), but cheaper: the bias's homogeneous
    column enters through the rows' column sums instead of a concatenated copy, convolution
    patches are gathered once from a channels-last view, and a strided transposed convolution
    only multiplies the taps that meet input pixels (see :func:`patch_gram`).

    Args:
        kind: The layer's :func:`block_kind`.
        m: The layer.
        x: Its input.
        has_bias: Whether the rows carry the homogeneous 1.

    Returns:
        The ``(d_in [+1])``-square factor.
    """
    if kind == "linear":
        rows = x.reshape(-1, x.shape[-1])
        gram, colsum, count = rows.t() @ rows, rows.sum(0), rows.shape[0]
    elif kind == "convT":
        gram, colsum, count = patch_gram(
            convT_as_conv_input(x, m), m.kernel_size, (1, 1), (1, 1), m.stride, _convT_first_row(m)
        )
    else:
        xp = F.pad(x, (m.padding[1], m.padding[1], m.padding[0], m.padding[0]))
        gram, colsum, count = patch_gram(xp, m.kernel_size, m.stride, m.dilation, (1, 1), (0, 0))
    if has_bias:
        d = gram.shape[0]
        full = gram.new_empty(d + 1, d + 1)
        full[:d, :d] = gram
        full[:d, d] = colsum
        full[d, :d] = colsum
        full[d, d] = count
        gram = full
    return gram / count


def convT_as_conv_input(x: Tensor, m: nn.ConvTranspose2d) -> Tensor:
    """Zero-dilate and pad the input of a transposed convolution.

    A stride-1 convolution of the result with :func:`convT_equivalent_weight` gives the same
    output as the transposed convolution.

    Args:
        x: ``(B, C_in, H, W)`` input of the transposed convolution.
        m: The transposed convolution (groups 1, dilation 1).

    Returns:
        The dilated and padded input.

    Raises:
        ValueError: If the layer's padding exceeds ``kernel_size − 1``.
    """
    b, c, h, w = x.shape
    sh, sw = m.stride
    kh, kw = m.kernel_size
    ph, pw = m.padding
    oh, ow = m.output_padding
    dil = x.new_zeros(b, c, (h - 1) * sh + 1, (w - 1) * sw + 1)
    dil[:, :, ::sh, ::sw] = x
    top, left = kh - 1 - ph, kw - 1 - pw
    bottom, right = top + oh, left + ow
    if min(top, left, bottom, right) < 0:
        raise ValueError("padding larger than kernel_size - 1 is not supported for ConvTranspose2d K-FAC")
    return F.pad(dil, (left, right, top, bottom))


def convT_equivalent_weight(weight: Tensor) -> Tensor:
    """Kernel of the stride-1 convolution equivalent to a transposed convolution.

    Args:
        weight: ``(in, out, kh, kw)`` transposed-convolution kernel.

    Returns:
        The flipped, transposed ``(out, in, kh, kw)`` kernel.
    """
    return weight.flip(2, 3).transpose(0, 1)


def _convT_first_row(m: nn.ConvTranspose2d) -> tuple[int, int]:
    """Where the input's first pixel lies in :func:`convT_as_conv_input`'s output (top, left)."""
    return m.kernel_size[0] - 1 - m.padding[0], m.kernel_size[1] - 1 - m.padding[1]


def mirror_upper(m: Tensor) -> Tensor:
    """``m`` with its strict lower triangle replaced by the upper one's mirror.

    A Gram matrix from a GEMM can differ from its transpose in the last bits; making the factors
    exactly symmetric lets a checkpoint keep only their upper triangles (K-FAC's ``state_dict``).
    """
    return m.triu() + m.triu(1).t()


def _even_slice(ks: list[int]) -> slice:
    """The slice selecting the evenly spaced indices ``ks``."""
    step = ks[1] - ks[0] if len(ks) > 1 else 1
    if ks != list(range(ks[0], ks[-1] + 1, step)):
        raise AssertionError(f"taps {ks} are not evenly spaced")
    return slice(ks[0], ks[-1] + 1, step)


def patch_gram(
    xp: Tensor,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    lattice: tuple[int, int],
    offset: tuple[int, int],
) -> tuple[Tensor, Tensor, int]:
    """Gram matrix and column sums of the im2col rows of a padded input, in ``F.unfold``'s order.

    The rows are the ``(C, kh, kw)`` patches of ``xp`` (already padded) at every output position
    of a convolution with ``kernel``, ``stride`` and ``dilation``. When only the pixels on a
    lattice are nonzero (``xp[..., i, j] = 0`` unless ``i ≡ offset₀ (mod lattice₀)`` and
    ``j ≡ offset₁ (mod lattice₁)``: the zero-dilated input of a strided transposed convolution),
    the output positions fall into ``lattice₀·lattice₁`` classes by their residue, each seeing one
    fixed subset of taps; each class's patches are multiplied only over its taps, and the cross
    terms between taps of different classes are exactly zero. For a stride-2 3×3 transposed
    convolution this takes 6.25/81 of the products. Patches are gathered channels-last (one copy
    of C contiguous values per tap) and the result is permuted to the ``(C, kh, kw)`` order.

    Args:
        xp: ``(B, C, H, W)`` padded input.
        kernel: ``(kh, kw)``.
        stride: Convolution stride.
        dilation: Convolution dilation.
        lattice: Spacing of the nonzero pixels of ``xp`` (``(1, 1)``: dense).
        offset: Position of the first nonzero pixel (row, column) when ``lattice`` is not dense.

    Returns:
        ``(gram, colsum, count)``: ``rowsᵀ rows`` (``C·kh·kw`` square), the rows' sums and their number.
    """
    bsz, c, h, w = xp.shape
    kh, kw = kernel
    (sh, sw), (dh, dw), (lh, lw) = stride, dilation, lattice
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    xl = xp.permute(0, 2, 3, 1).contiguous()  # (B, H, W, C)
    s_b, s_h, s_w, s_c = xl.stride()
    view = xl.as_strided(
        (bsz, ho, wo, kh, kw, c), (s_b, s_h * sh, s_w * sw, s_h * dh, s_w * dw, s_c)
    )  # patches, tap-major (kh, kw, C)
    d = c * kh * kw
    gram = xp.new_zeros(d, d)
    colsum = xp.new_zeros(d)
    ch = torch.arange(c, device=xp.device)
    for ry in range(lh):
        for rx in range(lw):
            # output row oy ≡ ry reads tap ky at oy·sh + ky·dh, nonzero only on the lattice
            kys = [k for k in range(kh) if (ry * sh + k * dh - offset[0]) % lh == 0]
            kxs = [k for k in range(kw) if (rx * sw + k * dw - offset[1]) % lw == 0]
            if not kys or not kxs or ry >= ho or rx >= wo:
                continue
            # the taps of a class are evenly spaced: slice them (a view), then copy once
            sub = view[:, ry::lh, rx::lw, _even_slice(kys), _even_slice(kxs)]
            rows = sub.reshape(-1, len(kys) * len(kxs) * c)
            # (ky, kx, c) of the class -> index in unfold's (c, ky, kx) order
            ky_t = torch.tensor(kys, device=xp.device)
            kx_t = torch.tensor(kxs, device=xp.device)
            idx = (ky_t[:, None, None] * kw + kx_t[None, :, None] + ch[None, None, :] * kh * kw).reshape(-1)
            gram[idx[:, None], idx[None, :]] = rows.t() @ rows
            colsum[idx] = rows.sum(0)
    return gram, colsum, bsz * ho * wo
