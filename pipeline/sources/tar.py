"""Walk a tar shard's member headers from byte ranges, never its whole content.

A tar file is a chain of 512-byte headers, each followed by its member's data padded to 512
bytes: the header at offset ``o`` declares a size ``s``, the data is at ``o + 512`` and the next
header at ``o + 512 + ceil(s / 512) * 512``. :class:`TarWalk` is fed byte ranges of the shard
(``feed(start, data)``) and parses every header they hold, so one read of a few KiB covers a run
of small members (a caption ``.txt``, a ``.json``) and the first bytes of the next image, and a
large member costs one read at its header. It says where to read next (``next_offset``,
``wanted``) and keeps, per member, the bytes of its data it has seen (``head``).

Handled: POSIX ustar (``prefix`` + ``name``), GNU long names (``././@LongLink``, typeflag ``L``),
pax extended headers (typeflag ``x``: ``path``, ``linkpath`` and ``size``; GNU ``K`` long link names),
GNU base-256 sizes. A header whose checksum fails, or a member running past the end of the shard,
stops the walk with a ``problem`` (members before it stay usable). Hard and symbolic links are kept
apart in ``links`` (:class:`TarLink`: the scan resolves them to a member of the same shard);
directories and other non-file entries (devices, FIFOs) are counted in ``skipped``. Pure: no I/O,
so every transport (a local ``pread``, an S3 ranged GET) drives the same parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BLOCK", "SHARD_WINDOW", "TarLink", "TarMember", "TarWalk", "walk_tar"]

BLOCK = 512
SHARD_WINDOW = 4 * 1024  # bytes the scan reads at a header: it, the small members after it, an image's header
_REGULAR = (b"0", b"\0", b"7")  # a file, an old-style file, a contiguous file
_LONG_NAME, _LONG_LINK, _PAX, _GLOBAL_PAX = b"L", b"K", b"x", b"g"
_HARDLINK, _SYMLINK, _DIRECTORY = b"1", b"2", b"5"
_MAX_META = 1 << 20  # most bytes a long name or pax record may take: larger means a corrupt header


@dataclass
class TarMember:
    """One regular file in a shard: its path, the offset of its data in the shard and its size, in bytes."""

    name: str
    offset: int
    size: int
    head: bytes = b""  # the first bytes of its data that the walk has read (possibly none)

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class TarLink:
    """A link entry of a shard: its path, the path it names (``target``, as stored) and whether it is
    a hard link (whose target is an archive path) or a symbolic one (relative to the link's folder)."""

    name: str
    target: str
    hard: bool


def _octal(field_bytes: bytes) -> int:
    if field_bytes[:1] and field_bytes[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        return int.from_bytes(field_bytes[1:], "big")
    text = field_bytes.split(b"\0", 1)[0].strip(b" ")
    return int(text, 8) if text else 0


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _octal(block[148:156])
    except ValueError:
        return False
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32  # the checksum field counts as spaces
    if stored == unsigned:
        return True
    rest = block[:148] + block[156:]  # some old tars sum signed bytes
    return stored == unsigned - 2 * sum(b for b in rest if b > 127)


def _text(raw: bytes) -> str | None:
    try:
        return raw.split(b"\0", 1)[0].decode("utf-8")
    except UnicodeDecodeError:
        return None


def _pax_records(data: bytes) -> dict[str, str]:
    """``"%d %s=%s\\n"`` records of a pax header; unparseable ones are skipped."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(data[pos:space])
        except ValueError:
            break
        if length <= 0:
            break
        record = data[space + 1 : pos + length].rstrip(b"\n")
        key, eq, value = record.partition(b"=")
        if eq:
            try:
                out[key.decode("utf-8")] = value.decode("utf-8")
            except UnicodeDecodeError:
                pass
        pos += length
    return out


@dataclass
class TarWalk:
    """The state of a walk over one shard of ``shard_size`` bytes (see the module docstring).

    ``keep`` bytes of each member's data are kept in ``head`` when the walk has read them.
    """

    shard_size: int
    keep: int = SHARD_WINDOW
    members: list[TarMember] = field(default_factory=list)
    links: list[TarLink] = field(default_factory=list)  # hard and symbolic links, in archive order
    skipped: int = 0  # directories and other entries that are neither regular files nor links
    special: int = 0  # of those, the ones that are not directories (devices, FIFOs): counted as ignored
    not_utf8: int = 0  # members whose name is not UTF-8 (no manifest row can name them)
    problem: str | None = None  # why the walk stopped before the end of the archive
    cut_member: TarMember | None = None  # the member whose data runs past the end of the shard
    suspect_member: TarMember | None = None  # the member before a broken header: its declared size misleads
    next_offset: int | None = 0  # where the next header is; None when the walk is over
    wanted: int = BLOCK  # bytes needed from next_offset (a long name or pax header needs its data too)
    _long_name: str | None = None
    _long_link: str | None = None
    _pax: dict[str, str] = field(default_factory=dict)

    def feed(self, start: int, data: bytes) -> None:
        """Parse every header held by ``data`` (the shard's bytes from offset ``start``) from ``next_offset`` on.

        Bytes before ``next_offset`` or after the last full header are ignored: call again with a
        read at ``next_offset`` of at least ``wanted`` bytes until ``next_offset`` is None.
        """
        end = start + len(data)
        o = self.next_offset
        while o is not None:
            if o + BLOCK > self.shard_size:
                if o < self.shard_size:
                    self._stop(f"the shard ends {self.shard_size - o} bytes into the header at byte {o:,}: truncated")
                o = None  # an archive without its closing zero blocks ends here too
                break
            if not (start <= o and o + BLOCK <= end):
                self.wanted = BLOCK
                break
            block = data[o - start : o - start + BLOCK]
            if block == bytes(BLOCK):
                o = None  # the end-of-archive marker
                break
            if not _checksum_ok(block):
                self.suspect_member = self.members[-1] if self.members else None
                self._stop(f"no tar header at byte {o:,} (checksum mismatch): the member before it declares a wrong "
                           "size, or the shard is corrupt")  # fmt: skip
                o = None
                break
            try:
                size = _octal(block[124:136])
            except ValueError:
                self._stop(f"the header at byte {o:,} has an unreadable size field")
                o = None
                break
            kind = block[156:157]
            data_at = o + BLOCK
            if kind in (_LONG_NAME, _LONG_LINK, _PAX, _GLOBAL_PAX):
                if size > _MAX_META:
                    self._stop(f"the header at byte {o:,} declares {size:,} bytes of metadata: corrupt")
                    o = None
                    break
                if data_at + size > self.shard_size:
                    self._stop(f"the shard ends inside the metadata of the header at byte {o:,}: truncated")
                    o = None
                    break
                if data_at + size > end:  # its data is needed whole: read it with the header it applies to
                    self.wanted = 2 * BLOCK + -(-size // BLOCK) * BLOCK
                    break
                meta = data[data_at - start : data_at - start + size]
                if kind == _LONG_NAME:
                    self._long_name = _text(meta) or ""
                elif kind == _LONG_LINK:
                    self._long_link = _text(meta) or ""
                elif kind == _PAX:
                    self._pax = _pax_records(meta)
                o = data_at + -(-size // BLOCK) * BLOCK
                continue
            name, link, pax = self._long_name, self._long_link, self._pax
            self._long_name, self._long_link, self._pax = None, None, {}
            if "path" in pax:
                name = pax["path"]
            if "size" in pax:
                try:
                    size = int(pax["size"])
                except ValueError:
                    self._stop(f"the pax header before byte {o:,} has an unreadable size")
                    o = None
                    break
            if name is None:
                name = _text(block[0:100])
                if name is not None and block[257:265] == b"ustar\x0000":
                    prefix = _text(block[345:500])
                    name = f"{prefix}/{name}" if prefix else name
            if kind in _REGULAR:
                if name is None:
                    self.not_utf8 += 1
                else:
                    member = TarMember(name, data_at, size)
                    if data_at < end:
                        stop = min(end, data_at + size, data_at + self.keep)
                        member.head = bytes(data[data_at - start : stop - start])
                    if member.end > self.shard_size:
                        self.members.append(member)
                        self.cut_member = member
                        self._stop(f"member {name} declares {size:,} bytes at byte {data_at:,}, but the shard "
                                   f"ends at byte {self.shard_size:,}: truncated")  # fmt: skip
                        o = None
                        break
                    self.members.append(member)
            elif kind in (_HARDLINK, _SYMLINK) and name is not None:
                target = pax.get("linkpath", link if link is not None else _text(block[157:257]))
                self.links.append(TarLink(name, target or "", kind == _HARDLINK))
                size = 0  # a link has no data, whatever its size field says
            else:
                self.skipped += 1
                self.special += kind != _DIRECTORY
            o = data_at + -(-size // BLOCK) * BLOCK
        self.next_offset = o
        if o is not None and self.wanted < BLOCK:
            self.wanted = BLOCK

    def _stop(self, problem: str) -> None:
        self.problem = problem


def walk_tar(read_range, shard_size: int, *, window: int = SHARD_WINDOW, keep: int = SHARD_WINDOW) -> TarWalk:
    """Walk the headers of a shard of ``shard_size`` bytes through ``read_range(start, end)`` (end exclusive).

    Each read is ``max(window, wanted)`` bytes at the next header. Returns the finished
    :class:`TarWalk`. Exceptions of ``read_range`` propagate.
    """
    walk = TarWalk(shard_size, keep=keep)
    while walk.next_offset is not None:
        start = walk.next_offset
        before = (start, walk.wanted)
        stop = min(walk.shard_size, start + max(window, walk.wanted))
        data = read_range(start, stop)
        if len(data) < stop - start:  # the object is shorter than listed: it changed under us
            walk.shard_size = start + len(data)
        walk.feed(start, data)
        if walk.next_offset is not None and (walk.next_offset, walk.wanted) == before:
            walk.problem = walk.problem or f"the shard ends at byte {start + len(data):,}: truncated"
            walk.next_offset = None  # no progress: fewer bytes came back than asked
    return walk
