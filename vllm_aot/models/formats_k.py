"""GGUF's K-quant layouts (`q4_k`, `q5_k`, `q6_k`): one stored tensor `blocks`, uint8
[out, in / 256 * block bytes], each row its super-blocks of 256 inputs exactly as a GGUF file
stores them (registered in `formats.py`; the kernels in `kernels/quant_k.h`):

- `q4_k`, 144 bytes: d fp16, dmin fp16, scales[12] (eight 6-bit sub-block scales sc and mins m),
  qs[128]. Sub-block s (32 inputs) holds qs[32 (s / 2) + j] >> 4 (s % 2) & 15 at input j;
  w = d sc_s q - dmin m_s.
- `q5_k`, 176 bytes: d, dmin, scales[12] as q4_k's, qh[32], qs[128]; q4_k's nibble plus bit s of
  qh[j] as 16; w = d sc_s q - dmin m_s.
- `q6_k`, 210 bytes: ql[128], qh[64], scales[16] int8, d fp16. Sub-blocks of 16; input i of half
  h (128 inputs), group g = i / 32, j = i % 32: ql[64 h + 32 (g % 2) + j] >> 4 (g / 2) & 15 plus
  (qh[32 h + j] >> 2 g & 3) << 4; w = d sc_(i / 16) (q - 32).

`dequantize_<fmt>` is the pure-torch reference (float32, the `gguf` package's rounding);
`quantize_<fmt>` a simple quantiser for tests (not llama.cpp's search).
"""

from __future__ import annotations

import torch

SUPER = 256  # inputs per super-block
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


def _rows(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """[out, in / 256 * bytes] -> uint8 [out, in / 256, bytes]."""
    return blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[fmt])


def _half(b: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at bytes [start, start + 2) of every block, as float32 [..., 1]."""
    return b[..., start : start + 2].contiguous().view(torch.float16).float()


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scales uint8 [..., 12] -> the 6-bit sub-block scales and mins, float32 [..., 8]."""
    q = scales.to(torch.int32)
    d, m, md = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q4_k and q5_k: codes [out, n, 8, 32] -> float32 [out, n * 256] as d sc q - dmin m."""
    sc, mn = _scale_min(b[..., 4:16])
    d, dm = _half(b, 0) * sc, _half(b, 2) * mn
    return (d[..., None] * q - dm[..., None]).reshape(b.shape[0], -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [..., 128] -> [..., 8, 32]: sub-block s = chunk s / 2's low (s even) or high
    nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([chunks & 15, chunks >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    b = _rows(blocks, "q4_k")
    return _affine(b, _nibbles(b[..., 16:144]).float())


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    b = _rows(blocks, "q5_k")
    bits = torch.arange(8, dtype=torch.uint8).reshape(8, 1)
    high = (b[..., 16:48].unsqueeze(-2) >> bits) & 1  # [..., 8, 32]: bit s of qh[j]
    return _affine(b, (_nibbles(b[..., 48:176]) | (high << 4)).float())


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    b = _rows(blocks, "q6_k")
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(*b.shape[:-1], 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    high = (b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32) >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int32) - 32).float().reshape(*b.shape[:-1], 16, 16)
    d = _half(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()
    return (d[..., None] * q).reshape(b.shape[0], -1)


def _super_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> float32 [out, in / 256, 256], refusing rows that are not whole super-blocks."""
    out_features, in_features = weight.shape
    if in_features % SUPER:
        raise ValueError(
            f"GGUF K-quant formats need in_features divisible by {SUPER}, got {in_features}"
        )
    return weight.float().reshape(out_features, in_features // SUPER, SUPER)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> its fp16 bytes uint8 [..., 2]."""
    return v.half().unsqueeze(-1).view(torch.uint8)


def _inverse(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v != 0, 1 / torch.where(v != 0, v, 1.0), 0.0)


def _quantize_affine(weight: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """q4_k (top 15) and q5_k (31): per sub-block of 32, w ~ scale q - min with min >= 0; the
    scales and mins as 6-bit multiples of the fp16 d and dmin. Returns the codes [out, n, 8, 32]
    and the header bytes [out, n, 16] (d, dmin, scales)."""
    x = _super_blocks(weight).reshape(weight.shape[0], -1, 8, 32)
    low = x.amin(dim=-1).clamp(max=0)
    scale, minimum = (x.amax(dim=-1) - low) / top, -low
    d = (scale.amax(dim=-1) / 63).half().float()
    dmin = (minimum.amax(dim=-1) / 63).half().float()
    sc = (scale * _inverse(d)[..., None]).round().clamp(0, 63)
    mn = (minimum * _inverse(dmin)[..., None]).round().clamp(0, 63)
    step, offset = d[..., None] * sc, dmin[..., None] * mn
    q = ((x + offset[..., None]) * _inverse(step)[..., None]).round().clamp(0, top)
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    scales = torch.cat(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
        ],
        dim=-1,
    )
    return q.to(torch.uint8), torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales], dim=-1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes < 16 [..., 8, 32] -> qs [..., 128]: chunk c = sub-block 2c low, 2c + 1 high."""
    pairs = q.reshape(*q.shape[:-2], 4, 2, 32)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:-2], 128)


def quantize_q4_k(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, head = _quantize_affine(weight, 15)
    return (torch.cat([head, _pack_nibbles(q)], dim=-1).reshape(weight.shape[0], -1),)


def quantize_q5_k(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, head = _quantize_affine(weight, 31)
    bits = (((q >> 4) & 1).to(torch.int32) << torch.arange(8).reshape(8, 1)).sum(dim=-2)
    blocks = torch.cat([head, bits.to(torch.uint8), _pack_nibbles(q & 15)], dim=-1)
    return (blocks.reshape(weight.shape[0], -1),)


def quantize_q6_k(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per sub-block of 16, w ~ d sc (q - 32): sc an int8 multiple of the fp16 d."""
    x = _super_blocks(weight).reshape(weight.shape[0], -1, 16, 16)
    scale = x.abs().amax(dim=-1) / 31
    d = (scale.amax(dim=-1) / 127).half().float()
    sc = (scale * _inverse(d)[..., None]).round().clamp(-128, 127)
    step = d[..., None] * sc
    q = ((x * _inverse(step)[..., None]).round().clamp(-32, 31) + 32).to(torch.uint8)
    q = q.reshape(*q.shape[:2], 2, 4, 32)  # half, group, j
    ql = torch.cat(
        [
            q[..., 0, :] & 15 | ((q[..., 2, :] & 15) << 4),
            q[..., 1, :] & 15 | ((q[..., 3, :] & 15) << 4),
        ],
        dim=-1,
    )  # [out, n, 2, 64]
    shifts = torch.tensor([0, 2, 4, 6]).reshape(4, 1)
    qh = (((q >> 4) & 3).to(torch.int32) << shifts).sum(dim=-2).to(torch.uint8)  # [out, n, 2, 32]
    blocks = torch.cat(
        [
            ql.reshape(*q.shape[:2], 128),
            qh.reshape(*q.shape[:2], 64),
            sc.to(torch.int8).view(torch.uint8),
            _fp16_bytes(d),
        ],
        dim=-1,
    )
    return (blocks.reshape(weight.shape[0], -1),)
