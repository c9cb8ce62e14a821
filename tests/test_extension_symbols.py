"""The built extension exports one dynamic symbol, ``PyInit__native``
(docs/packaging.md): a source build through ``-fvisibility=hidden``, the
release wheel through its version script. Read from the ELF file of whatever
extension is imported (the source tree, or an installed wheel)."""

from __future__ import annotations

import struct
from pathlib import Path

from client_query_cache import _native

SHT_DYNSYM = 11
STB_GLOBAL, STB_WEAK = 1, 2
STV_DEFAULT = 0


def exported_symbols(path: Path) -> set[str]:
    """The names of the defined global or weak symbols of default
    visibility in a 64-bit little-endian ELF file's dynamic symbol table."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not a 64-bit LE ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != SHT_DYNSYM:
            continue
        strtab_offset = sections[link][4]
        for at in range(offset, offset + size, entsize):
            st_name, st_info, st_other, st_shndx = struct.unpack_from("<IBBH", data, at)
            if st_shndx == 0 or st_info >> 4 not in (STB_GLOBAL, STB_WEAK) or st_other & 3 != STV_DEFAULT:
                continue
            end = data.index(b"\0", strtab_offset + st_name)
            names.add(data[strtab_offset + st_name : end].decode())
    return names


def test_the_extension_exports_its_init_function_alone() -> None:
    assert exported_symbols(Path(_native.__file__)) == {"PyInit__native"}
