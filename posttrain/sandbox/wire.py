"""Wire format of the sandbox: frames and plain-data values (standard library only).

Used on both sides: inside the sandbox (its source is prepended to the supervisor's) and in
the parent, so it never imports posttrain and uses no ``from __future__`` import.

* A **frame**: a 4-byte big-endian length and one UTF-8 JSON object (signed: then a
  keyed BLAKE2b tag, :func:`_signed`); :func:`read_frame`
  refuses an oversized or truncated frame, JSON floats, ``NaN``, duplicate keys, non-objects.
* A **value**: plain data of exact types in a tagged JSON form (:func:`wire_encode`,
  :func:`wire_decode`): exact ints and floats (hex), containers, bytes, complex, ``["h", n]``
  an opaque handle, ``["x", n, base]`` a subclass of a plain type (its handle and base value).
More: docs/sandbox.md, "Module notes", posttrain.sandbox.wire.
"""

import _blake2
import _json
import _operator
import os
import struct
import sys

WIRE_MAX_DEPTH = 100
TAG_BYTES = 16  # a signed frame's keyed BLAKE2b tag
_SAFE_INT = 1 << 53
_HEADER = struct.Struct(">I")
_SEQUENCES = {"l": list, "t": tuple, "s": set, "z": frozenset}
# plain base types of a subclass instance sent as ["x", n, base, overrides], with their exact
# copy read by the base type's own methods (never the subclass's overrides)
_BASES = ((dict, lambda v: dict(dict.items(v))), (list, lambda v: list(list.__iter__(v))),
          (tuple, lambda v: tuple(tuple.__iter__(v))), (set, lambda v: set(set.__iter__(v))),
          (frozenset, lambda v: frozenset(frozenset.__iter__(v))), (str, str.__str__),
          (int, int.__int__), (float, float.__float__))
_MUTABLE = (list, dict, set)
# methods of a base type a subclass may redefine without changing what its value is
_NOT_SEMANTIC = frozenset(("__new__", "__init__", "__getattribute__", "__init_subclass__",
                           "__subclasshook__", "__class_getitem__", "__reduce__",
                           "__reduce_ex__", "__getnewargs__", "__getstate__", "__sizeof__",
                           "__dir__", "__setattr__", "__delattr__", "__str__", "__repr__"))


class WireError(ValueError):
    """A frame or value that breaks the wire format."""


SET_ORDER = "a set whose order cannot be rebuilt here"


class FrameTooLarge(WireError):
    """A well-formed frame header announcing more than the reader's cap."""


def overrides(kind, base, value, copy):
    """Names of ``base``'s methods that ``kind`` (a subclass) redefines, so that reading its
    value as ``base`` would not be what Python does with it; an ``__eq__`` / ``__ne__`` that
    answers ``NotImplemented`` to its own value as ``base`` (``Counter``'s) leaves ``==`` to
    the base type and is not counted."""
    names = set()
    for klass in kind.__mro__:
        if klass is base:
            break
        names.update(name for name in vars(klass) if name not in _NOT_SEMANTIC
                     and callable(getattr(base, name, None)))
    for name in ("__eq__", "__ne__"):
        if name in names:
            try:
                if getattr(kind, name)(value, copy) is NotImplemented:
                    names.discard(name)
            except Exception:
                pass
    return sorted(names)


def wire_encode(value, handle=None, depth=0, ref=None):
    """Tagged JSON form of ``value``; ``handle(obj) -> int`` names anything that is not plain
    data (without it such a value is a :class:`WireError`); ``ref(obj) -> int | None``, when
    given, may name a list, dict or set (or an instance of a subclass of one) as ``["h", n]``
    instead of copying it (shared objects, :mod:`.judge`)."""
    kind = type(value)
    if ref is not None and issubclass(kind, _MUTABLE):
        number = ref(value)
        if number is not None:
            return ["h", number]
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -_SAFE_INT < value < _SAFE_INT else ["I", format(value, "x")]
    if kind is float:
        return ["f", value.hex()]
    if depth < WIRE_MAX_DEPTH:
        for tag, container in _SEQUENCES.items():
            if kind is container:
                return [tag, *[wire_encode(item, handle, depth + 1, ref) for item in value]]
        if kind is dict:
            flat = ["d"]
            for key, item in value.items():
                flat += [wire_encode(key, handle, depth + 1, ref),
                         wire_encode(item, handle, depth + 1, ref)]
            return flat
        if kind is bytes:
            return ["b", value.hex()]
        if kind is complex:
            return ["c", value.real.hex(), value.imag.hex()]
    if handle is None:
        raise WireError(f"not plain data: {kind.__name__}")
    for base, copy in _BASES if depth < WIRE_MAX_DEPTH else ():
        if issubclass(kind, base):
            plain = copy(value)
            return ["x", handle(value), wire_encode(plain, handle, depth + 1, ref),
                    overrides(kind, base, value, plain)]
    return ["h", handle(value)]


def _text(item):
    if type(item) is not str:
        raise WireError("expected a string in a tagged value")
    return item


def iterates_as(made, items):
    """Whether the set ``made`` (read with its base type's iterator) yields ``items`` in order."""
    return all(a is b for a, b in zip(set.__iter__(made) if isinstance(made, set) else made,
                                      items, strict=True))


def same_order_set(items, kind=set, in_order=True):
    """A ``kind`` (set or frozenset) of ``items`` that iterates in their order (the sender's):
    filled as CPython fills one from a dict (presized, in order: a set display's layout), else
    one item at a time. Neither gives it: ``in_order`` True raises WireError(SET_ORDER) (the
    receiver would iterate it unlike plain Python: docs/sandbox.md); a callable is called,
    then the first of the two is returned; False (order unused) skips the search."""
    first = kind(items) if in_order is False else kind(dict.fromkeys(items))
    if len(first) != len(items):  # a set with duplicates was never a set
        raise WireError("duplicate set items")
    if in_order is False or iterates_as(first, items):
        return first
    made = kind(items)
    if iterates_as(made, items):
        return made
    if in_order is True:
        raise WireError(SET_ORDER)
    in_order()
    return first


def _decode_tagged(tag, rest, handle, depth, in_order):
    if tag == "I" and len(rest) == 1:
        return int(_text(rest[0]), 16)
    if tag == "f" and len(rest) == 1:
        return float.fromhex(_text(rest[0]))
    if tag == "b" and len(rest) == 1:
        return bytes.fromhex(_text(rest[0]))
    if tag == "c" and len(rest) == 2:
        return complex(float.fromhex(_text(rest[0])), float.fromhex(_text(rest[1])))
    if tag == "h" and len(rest) == 1 and handle is not None and type(rest[0]) is int:
        return handle(rest[0])
    if tag == "x" and len(rest) == 3 and handle is not None and type(rest[0]) is int and \
            type(rest[2]) is list and all(type(name) is str for name in rest[2]):
        return handle(rest[0], wire_decode(rest[1], handle, depth + 1, in_order),
                      frozenset(rest[2]))
    if tag in _SEQUENCES:
        items = [wire_decode(item, handle, depth + 1, in_order) for item in rest]
        if tag in "sz":
            return same_order_set(items, _SEQUENCES[tag], in_order)
        made = _SEQUENCES[tag](items)
        if len(made) != len(items):  # a set with duplicates was never a set
            raise WireError("duplicate set items")
        return made
    if tag == "d" and len(rest) % 2 == 0:
        pairs = [(wire_decode(rest[i], handle, depth + 1, in_order),
                  wire_decode(rest[i + 1], handle, depth + 1, in_order))
                 for i in range(0, len(rest), 2)]
        made = dict(pairs)
        if len(made) != len(pairs):
            raise WireError("duplicate dict keys")
        return made
    raise WireError(f"bad tagged value {tag!r}")


def wire_decode(data, handle=None, depth=0, in_order=True):
    """Inverse of :func:`wire_encode`; ``handle(n)`` resolves ``["h", n]`` (without it a handle
    is a :class:`WireError`). Raises :class:`WireError` on anything malformed. A set iterates in
    the order it was sent where it can; elsewhere ``in_order`` says what happens
    (:func:`same_order_set`: the program's side refuses, the judge fails the test, the parent,
    which only compares values, takes the nearest set)."""
    kind = type(data)
    if data is None or kind is bool or kind is str:
        return data
    if kind is int:
        if -_SAFE_INT < data < _SAFE_INT:
            return data
        raise WireError("a large int must be tagged")
    if kind is not list or not data or type(data[0]) is not str or depth >= WIRE_MAX_DEPTH:
        raise WireError("malformed value")
    try:
        return _decode_tagged(data[0], data[1:], handle, depth, in_order)
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"malformed value: {exc!r}") from None


def _refuse(token):
    raise WireError(f"JSON number or constant {token[:20]!r} is not allowed on the wire")


def _pairs(pairs):
    made = dict(pairs)
    if len(made) != len(pairs):
        raise WireError("duplicate keys in a frame")
    return made


def _not_json(obj):
    raise TypeError(f"not JSON: {type(obj).__name__}")


def json_codec(parse_float=_refuse):
    """``(encode, scan)``: the C encoder and scanner of ``_json``, made once with their options
    (compact separators, ASCII, no NaN; no floats, no NaN, no duplicate keys), so writing and
    reading a frame looks nothing up in ``json``'s module globals at run time (the program
    process makes its own with :mod:`.program`'s private copies). ``parse_float=float``: the
    supervisor's reader of the parent's commands (trusted; ``timeout_s`` is a float)."""
    encode = _json.make_encoder(None, _not_json, _json.encode_basestring_ascii, None, ":", ",",
                                False, False, False)
    context = _Options(strict=True, object_hook=None, object_pairs_hook=_pairs,
                       parse_float=parse_float, parse_int=int, parse_constant=_refuse, memo={})
    return encode, _json.make_scanner(context)


_Options = type(sys.implementation)  # types.SimpleNamespace, without importing types
_ENCODE, _SCAN = json_codec()
_BLANK = " \t\n\r"


def loads_strict(data, top_object=True):
    """One JSON object (``top_object=False``: any JSON value) from bytes: no floats, no
    NaN/Infinity, no duplicate keys."""
    try:
        text = data.decode("utf-8") if type(data) is bytes else data
        start = len(text) - len(text.lstrip(_BLANK))
        obj, end = _SCAN(text, start)
        if text[end:].strip(_BLANK):
            raise ValueError("extra data after the JSON value")
    except WireError:
        raise
    except StopIteration:
        raise WireError("not JSON") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise WireError(f"not JSON: {exc!r}") from None
    if top_object and type(obj) is not dict:
        raise WireError("a frame must hold a JSON object")
    return obj


def dumps_frame(obj, key=None):
    """Bytes of one frame holding ``obj``; with ``key``, signed (:func:`_signed`)."""
    data = "".join(_ENCODE(obj, 0)).encode()
    if key is not None:
        data += _tag(data, key)
    return _HEADER.pack(len(data)) + data


def _tag(data, key):
    return _blake2.blake2b(data, key=key, digest_size=TAG_BYTES).digest()


def _signed(data, key):
    """The JSON bytes of a signed frame's body (JSON then a keyed BLAKE2b tag of it). The
    program process's answers are signed with a key made for each test that only the copy of
    the supervisor serving them holds (issue 56): bytes the program writes on its socket
    itself never pass as an answer."""
    if key is None:
        return data
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if len(data) < TAG_BYTES or not _operator._compare_digest(_tag(body, key), tag):
        raise WireError("a frame without the answer key's tag")
    return body


def write_frame(fd, obj, key=None):
    view = memoryview(dumps_frame(obj, key))
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd, size):
    data = b""
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            return data
        data += chunk
    return data


def read_frame(fd, cap, key=None):
    """The next frame's object (a signed one with ``key``); None on a clean end of stream;
    WireError otherwise."""
    header = _read_exact(fd, _HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise WireError("truncated frame header")
    (size,) = _HEADER.unpack(header)
    if size > cap:
        raise FrameTooLarge(f"frame of {size} bytes is over the cap of {cap}")
    data = _read_exact(fd, size)
    if len(data) < size:
        raise WireError("truncated frame")
    return loads_strict(_signed(data, key))


def split_frames(data, cap, key=None):
    """Every frame in ``data`` (a whole stream already read; signed ones with ``key``);
    WireError on any leftover."""
    frames, offset = [], 0
    while offset < len(data):
        if len(data) - offset < _HEADER.size:
            raise WireError("truncated frame header")
        (size,) = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        if size > cap or offset + size > len(data):
            raise WireError("oversized or truncated frame")
        frames.append(loads_strict(_signed(data[offset:offset + size], key)))
        offset += size
    return frames
