"""The GGUF header's encoding: a cursor reading its scalars and strings and walking past its
arrays (a 50k-250k-string vocabulary is skipped by sizes alone, not decoded)."""

from __future__ import annotations

import mmap
import struct

from gguf import GGUFValueType

SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class HeaderCursor:
    """A cursor over the header: scalars and strings read, arrays walked past."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def read(self, fmt: str):
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        size = self.read("<Q")
        self.pos += size
        return self.data[self.pos - size : self.pos].decode("utf-8", "replace")

    def value(self, vtype: int):
        """A scalar or string; an array is skipped (None): only its items' sizes are read."""
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            return self.read(SCALARS[GGUFValueType(vtype)])
        item, count = self.read("<IQ")
        if item == GGUFValueType.STRING:  # a vocabulary: 50k-250k strings
            for _ in range(count):
                self.pos += 8 + struct.unpack_from("<Q", self.data, self.pos)[0]
        elif item == GGUFValueType.ARRAY:
            for _ in range(count):
                self.value(item)
        else:
            self.pos += count * struct.calcsize(SCALARS[GGUFValueType(item)])
        return None
