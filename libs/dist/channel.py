"""One-to-all messages inside a tensor-parallel group: how rank 0 tells the others what to do.

A TP instance has one scheduler, on rank 0; the other ranks only execute. Before each
piece of device work (a forward pass, a block import, export or copy) rank 0 sends a
``ChannelMessage`` (an op name, msgpack-able arguments and named tensors) and every rank
then runs the same work, so their collectives pair up. There is no pickle: the header is
msgpack, tensors travel as raw bytes (host tensors) or by a broadcast of their device
memory over the data backend (device tensors, grouped by dtype: one NCCL broadcast per
dtype, no host copy and no stream sync on the sender).

Framing: every message costs one broadcast of a fixed ``FRAME_BYTES`` frame on the gloo
control handle (lengths, header, host tensors); a message larger than a frame sends its
remainder in a second broadcast of exactly that size. Small messages (every decode step)
are therefore a single host collective.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from libs.dist.groups import Group

FRAME_BYTES = 16384
_LENGTHS = struct.Struct("<QQ")  # header bytes, host-tensor bytes

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
)}


class ChannelError(RuntimeError):
    """A malformed message (a bug, or a peer of another version)."""


@dataclass
class ChannelMessage:
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Channel:
    """Member 0 of ``group`` sends, the others receive, in the same order.

    ``device``: where received device tensors are put (the members' own device).
    Not thread-safe: the caller serialises sends (and what each message makes ranks run,
    since that runs collectives on the same groups)."""

    def __init__(self, group: Group, device: torch.device):
        self.group = group
        self.device = device
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self.messages = 0

    @property
    def is_sender(self) -> bool:
        return self.group.rank == 0

    def send(self, op: str, args: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor | None] | None = None) -> None:
        if not self.is_sender:
            raise ChannelError("only member 0 of the group sends")
        specs, host_parts, device_groups = [], [], {}
        offset = 0
        for name, t in (tensors or {}).items():
            if t is None:
                specs.append([name, None, None, None, 0])
                continue
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ChannelError(f"tensor {name!r} has dtype {t.dtype}, which the channel does not carry")
            if t.device.type == "cpu":
                raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                specs.append([name, dtype, list(t.shape), "h", offset])
                host_parts.append(raw)
                offset += len(raw)
            else:
                specs.append([name, dtype, list(t.shape), "d", 0])
                device_groups.setdefault(dtype, []).append(t.detach().reshape(-1))
        header = msgpack.packb({"op": op, "args": args or {}, "t": specs}, use_bin_type=True)
        body = header + b"".join(host_parts)
        self._broadcast_host(_LENGTHS.pack(len(header), offset) + body)
        for dtype in sorted(device_groups):
            flat = torch.cat(device_groups[dtype]) if len(device_groups[dtype]) > 1 else device_groups[dtype][0].contiguous()
            self.group.broadcast_(flat)
        self.messages += 1

    def recv(self) -> ChannelMessage:
        if self.is_sender:
            raise ChannelError("member 0 sends; the others receive")
        data = self._receive_host()
        header_len, host_len = _LENGTHS.unpack_from(data, 0)
        start = _LENGTHS.size
        try:
            header = msgpack.unpackb(data[start : start + header_len], raw=False)
            op, args, specs = header["op"], header["args"], header["t"]
        except Exception as e:  # noqa: BLE001 - malformed: say so
            raise ChannelError(f"malformed channel header: {e}") from e
        host = data[start + header_len : start + header_len + host_len]
        tensors: dict[str, torch.Tensor] = {}
        device_specs: dict[str, list[tuple[str, list[int]]]] = {}
        for name, dtype, shape, where, off in specs:
            if dtype is None:
                tensors[name] = None  # type: ignore[assignment]
            elif where == "h":
                dt = _DTYPES[dtype]
                n = _numel(shape) * dt.itemsize
                raw = bytearray(host[off : off + n])
                tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt)
            else:
                device_specs.setdefault(dtype, []).append((name, shape))
        for dtype in sorted(device_specs):
            parts = device_specs[dtype]
            flat = torch.empty(sum(_numel(s) for _, s in parts), dtype=_DTYPES[dtype], device=self.device)
            self.group.broadcast_(flat)
            pos = 0
            for name, shape in parts:
                n = _numel(shape)
                tensors[name] = flat[pos : pos + n].view(shape)
                pos += n
        self.messages += 1
        return ChannelMessage(op, args, tensors)

    # -- framing ------------------------------------------------------------------------

    def _broadcast_host(self, data: bytes) -> None:
        n = len(data)
        head = min(n, FRAME_BYTES)
        self._frame[:head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        self.group.broadcast_(self._frame, control=True)
        if n > FRAME_BYTES:
            rest = torch.frombuffer(bytearray(data[FRAME_BYTES:]), dtype=torch.uint8)
            self.group.broadcast_(rest, control=True)

    def _receive_host(self) -> bytes:
        self.group.broadcast_(self._frame, control=True)
        frame = self._frame.numpy().tobytes()
        header_len, host_len = _LENGTHS.unpack_from(frame, 0)
        n = _LENGTHS.size + header_len + host_len
        if n <= FRAME_BYTES:
            return frame[:n]
        rest = torch.empty(n - FRAME_BYTES, dtype=torch.uint8)
        self.group.broadcast_(rest, control=True)
        return frame + rest.numpy().tobytes()


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
