"""K8's quantizers, in torch: the definition that the CuTe quantizer kernels must reproduce.

Two ingredients on top of K7's per-tensor e4m3 (``k7.quantize_fp8``):

* Block quantization: one scale per block of rows of one (batch, head), the block being the
  kernel's tile (tile_m query rows, tile_n keys), so an outlier only coarsens its own tile.
* Incoherent processing: Q and K are rotated by M = diag(s) H_d / sqrt(d) (s a seeded +-1 vector,
  H_d the Sylvester Hadamard matrix) before they are quantized. M M^T = I, so Q' K'^T = Q K^T;
  an outlier coordinate is spread over all d coordinates, and the block amax drops.

Arithmetic, fixed so that a kernel can match it bit for bit: everything in float32; the rotation
is sign flip, then the fast Walsh-Hadamard butterflies with stride h = 1, 2, 4, ..., d/2 (each
stage maps (x[i], x[i+h]) to (x[i] + x[i+h], x[i] - x[i+h]) for i with bit h clear), then one
multiply by the float32 constant 1/sqrt(d); scale = 448 / amax (1 when amax is 0), x8 =
e4m3(x * scale) rounded to nearest even and saturated to +-448, descale = 1 / scale.
"""

from __future__ import annotations

import math

E4M3_MAX = 448.0


def hadamard_signs(head_dim: int, seed: int = 0, device=None):
    """The +-1 diagonal s of the rotation (float32, (head_dim,)), the same for every head: Q and K
    must share it, and a fixed seed makes runs repeatable."""
    import torch

    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 2, (head_dim,), generator=g).float() * 2 - 1
    return s.to(device)


def fwht(x):
    """Unnormalized Walsh-Hadamard transform along the last dim (a power of 2), float32 in and out,
    butterflies in the order the module docstring fixes (equals x @ H_d in exact arithmetic)."""
    import torch

    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"fwht: the last dim must be a power of 2, got {d}")
    h = 1
    while h < d:
        y = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], d)
        h *= 2
    return x


def rotate(x, signs):
    """x M = fwht(x * s) / sqrt(d), in float32."""
    import torch

    d = x.shape[-1]
    inv_sqrt_d = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    return fwht(x.float() * signs.to(x.device)) * inv_sqrt_d.to(x.device)


def hadamard_matrix(head_dim: int):
    """H_d (Sylvester), float64: for tests of the transform, not for the timed path."""
    import torch

    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _scales(amax):
    import torch

    amax = amax.float()
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    return scale, 1.0 / scale


def _cast(y):
    import torch

    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_blocks(x, block_rows: int, signs=None):
    """(x8, descale) with x (batch, heads, seqlen, d) in 16 or 32 bits: x8 e4m3 of the same shape,
    descale float32 (batch, heads, ceil(seqlen / block_rows)); row r of a head is ~ x8[r] *
    descale[r // block_rows]. With ``signs``, the rows are rotated first (``rotate``): Q and K only,
    and with the same signs."""
    import torch

    b, h, n, d = x.shape
    y = rotate(x, signs) if signs is not None else x.float()
    nblocks = -(-n // block_rows)
    pad = nblocks * block_rows - n
    yp = torch.nn.functional.pad(y, (0, 0, 0, pad)) if pad else y
    amax = yp.abs().reshape(b, h, nblocks, block_rows * d).amax(dim=-1)
    scale, descale = _scales(amax)
    x8 = _cast(y * scale.repeat_interleave(block_rows, dim=-1)[..., :n, None])
    return x8, descale


def quantize_v_fp8_blocks(v, block_keys: int):
    """(vt8, descale) for K8's V: e4m3 per block of ``block_keys`` keys, stored as K7's V^T
    (batch, heads, d, keys padded to 16, keys of every 16 in ``sm90.FP8_KEY_ORDER``, pad 0), and
    descale float32 (batch, heads, ceil(seqlen / block_keys))."""
    from .k7 import transpose_v_fp8_torch

    v8, descale = quantize_fp8_blocks(v, block_keys)
    return transpose_v_fp8_torch(v8), descale
