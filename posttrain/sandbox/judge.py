"""The two sides of an assert test (standard library only; runs inside the sandbox).

An assert test runs in two processes forked by the supervisor (:mod:`.harness`):

* the **program process** runs the program, then :func:`serve_program`: it sends a hello frame
  naming its top-level names and answers requests (call, attribute get/set, iterate) on a
  socket, one answer frame per request, with plain data (:mod:`.wire`) or an opaque handle;
* the **judge process** (:func:`judge_test`) runs the test's source with the program's
  top-level names bound to :class:`Handle` proxies. Every comparison, ``abs``, ``math.isclose``,
  helper and prelude runs here, on plain data of exact types rebuilt by the judge's own decoder;
  a handle equals nothing and is not true. The judge is forked from the non-dumpable
  supervisor before any program code runs, so the program cannot read, write or trace it; the
  judge's verdict goes to the supervisor on a pipe the program never had.

Names the judge resolves itself, never through the program: builtins (a program's ``abs``
does not replace the test's), the test's own definitions and imports, and standard-library
modules or their attributes the program bound at top level (``import math``, ``from math
import isclose``): the judge imports its own copy.
"""

import builtins
import select
import sys

# <parent-only> (removed from the sandbox's source, which starts with wire's)
from posttrain.sandbox.wire import (
    FrameTooLarge,
    WireError,
    read_frame,
    wire_decode,
    wire_encode,
    write_frame,
)

# </parent-only>

HELLO_VALUE_BYTES = 1024  # a top-level plain value larger than this is sent as a handle,
HELLO_BUDGET = 65536  # and so is every plain value once the hello's values reach this size
MAX_NAMES = 4096
# standard-library modules without side channels to the judge's process (no os, sys, io,
# ctypes, signal...): a program name bound to one of these, or to an attribute of one, is
# resolved by the judge's own import; any other module or object is a handle
_PURE_MODULES = frozenset((
    "array", "base64", "binascii", "bisect", "builtins", "calendar", "cmath", "collections",
    "collections.abc", "copy", "dataclasses", "datetime", "decimal", "difflib", "enum",
    "fractions", "functools", "hashlib", "heapq", "itertools", "json", "math", "numbers",
    "operator", "random", "re", "statistics", "string", "struct", "textwrap", "typing",
    "unicodedata", "zlib"))
_MUTABLE = (list, dict, set)


class ProgramError(Exception):
    """An exception of the program whose type is not a builtin exception."""


class ProgramGone(BaseException):
    """The program process ended or broke the protocol (a test cannot catch this)."""


class ProgramBroke(ProgramGone):
    """The program process broke the protocol (a sandbox error, never a pass)."""


class Unsupported(BaseException):
    """The test needs a value the proxy cannot carry (a callback, a test-defined object)."""


class AnswerTooLarge(BaseException):
    """An answer over the frame cap (``4 x max_value_bytes + 1 KiB``): the test fails."""


class ProgramMemory(BaseException):
    """The program ran out of memory in a call."""


# ----------------------------------------------------------------------------- program side
def _stdlib_origin(value):
    """``["m", module]`` / ``["a", module, qualname]`` for a standard-library object, else None."""
    try:
        if type(value) is type(sys):
            name = value.__name__
            return ["m", name] if name in _PURE_MODULES else None
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if module in _PURE_MODULES and type(qualname) is str and "<" not in qualname \
                and not any(p.startswith("_") for p in qualname.split(".")) \
                and sys.modules.get(module) is not None:
            found = sys.modules[module]
            for part in qualname.split("."):
                found = getattr(found, part)
            return ["a", module, qualname] if found is value else None
    except Exception:
        return None
    return None


def describe_names(namespace, handles):
    """Top-level names -> how the judge binds them (plain copy, stdlib object or handle)."""
    names, budget = {}, HELLO_BUDGET
    for name, value in list(namespace.items())[:MAX_NAMES]:
        if type(name) is not str or name.startswith("__"):
            continue
        origin = _stdlib_origin(value)
        if origin is not None:
            names[name] = origin
            continue
        try:
            encoded = wire_encode(value)
            size = len(repr(encoded))
            if size <= min(HELLO_VALUE_BYTES, budget):
                names[name], budget = ["v", encoded], budget - size
                continue
        except (WireError, RecursionError, ValueError):
            pass
        names[name] = ["h", _register(handles, value)]
    return names


def _register(handles, value):
    handles.append(value)
    return len(handles) - 1


def _perform(request, handles, namespace):
    """The value (and copied-back arguments) one request asks for; raises what the program
    raises."""
    def resolve(number):
        return handles[number]

    op = request["op"]
    if op == "end":
        return None, []
    if "name" in request:  # a value test: the supervisor names the function
        exec(request.get("prelude", ""), namespace)
        target = namespace[request["name"]] if request["name"] in namespace else \
            getattr(builtins, request["name"])
    else:
        target = handles[request["target"]]
    back = []
    if op == "call":
        args = [wire_decode(item, resolve) for item in request["args"]]
        kwargs = {key: wire_decode(item, resolve) for key, item in request["kwargs"]}
        value = target(*args, **kwargs)
        back = [wire_encode(a, lambda v: _register(handles, v)) if type(a) in _MUTABLE else None
                for a in args]
    elif op == "getattr":
        value = getattr(target, request["attr"])
    elif op == "setattr":
        setattr(target, request["attr"], wire_decode(request["value"], resolve))
        value = None
    elif op == "iter":
        value = list(target)
    else:
        raise ValueError(f"unknown request {op!r}")
    return value, back


def serve_program(namespace, fd, cap, describe):
    """After the program ran: hello, then one answer frame per request until end of stream."""
    handles = []
    names = describe_names(namespace, handles) if describe else {}
    write_frame(fd, {"names": names})
    while True:
        request = read_frame(fd, cap)
        if request is None:
            return
        answer = {"id": request["id"]}
        try:
            value, back = _perform(request, handles, namespace)
            answer["ok"] = wire_encode(value, lambda v: _register(handles, v))
            answer["back"] = back
        except MemoryError:
            answer = {"id": request["id"], "raise": ["MemoryError", ""]}
        except Exception as exc:
            answer = {"id": request["id"], "raise": [type(exc).__name__, str(exc)[:200]]}
        write_frame(fd, answer)


# ------------------------------------------------------------------------------- judge side
class Link:
    """The judge's end of the program socket: one request, exactly one answer with its id."""

    def __init__(self, fd, cap):
        self.fd, self.cap, self.last_id, self.handles = fd, cap, 0, {}

    def hello(self):
        frame = self._read()
        if set(frame) != {"names"} or type(frame["names"]) is not dict:
            raise ProgramBroke("bad hello")
        return frame["names"]

    def _read(self):
        try:
            frame = read_frame(self.fd, self.cap)
        except FrameTooLarge:
            raise AnswerTooLarge() from None
        except (WireError, OSError) as exc:
            raise ProgramBroke(f"broken frame: {exc}") from None
        if frame is None:
            raise ProgramGone("the program ended")
        return frame

    def handle(self, number):
        if type(number) is not int:
            raise WireError("bad handle")
        if number not in self.handles:
            self.handles[number] = Handle(self, number)
        return self.handles[number]

    def ask(self, request):
        """Send a request; the decoded value of its one answer (or the program's exception)."""
        if select.select([self.fd], [], [], 0)[0]:
            raise ProgramBroke("bytes before a request (an answer nobody asked for)")
        self.last_id += 1
        request["id"] = self.last_id
        try:
            write_frame(self.fd, request)
        except OSError:
            raise ProgramGone("the program closed its socket") from None
        answer = self._read()
        if answer.get("id") != self.last_id or type(answer.get("id")) is not int:
            raise ProgramBroke("answer with the wrong id")
        if set(answer) == {"id", "raise"}:
            raise _program_exception(answer["raise"])
        if set(answer) != {"id", "ok", "back"} or type(answer["back"]) is not list:
            raise ProgramBroke("answer of the wrong shape")
        try:
            value = wire_decode(answer["ok"], self.handle)
            back = [None if item is None else wire_decode(item, self.handle)
                    for item in answer["back"]]
        except WireError as exc:
            raise ProgramBroke(f"bad value: {exc}") from None
        return value, back


def _program_exception(raised):
    if type(raised) is not list or len(raised) != 2 or not all(type(x) is str for x in raised):
        raise ProgramBroke("bad exception answer")
    name, message = raised
    if name == "MemoryError":
        return ProgramMemory(message)
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not MemoryError:
        try:
            return kind(message)
        except Exception:
            pass
    return ProgramError(f"{name}: {message}")


def _encode_argument(value, link):
    def handle(obj):
        if type(obj) is Handle and obj._link is link:
            return obj._number
        raise Unsupported(f"a {type(obj).__name__} cannot be sent to the program")

    try:
        return wire_encode(value, handle)
    except (RecursionError, ValueError) as exc:
        raise Unsupported(repr(exc)) from None


def _copy_back(argument, new):
    """Apply the program's mutation of a list/dict/set argument to the judge's object."""
    if type(new) is not type(argument):
        raise ProgramBroke("a mutated argument came back as another type")
    if type(argument) is list:
        argument[:] = new
    else:
        argument.clear()
        argument.update(new)


class Handle:
    """A program object seen from the judge: calls and attributes go to the program; it equals
    nothing, is not true, and has no other behaviour."""

    __slots__ = ("_link", "_number")

    def __init__(self, link, number):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_number", number)

    def __call__(self, *args, **kwargs):
        link = self._link
        request = {"op": "call", "target": self._number,
                   "args": [_encode_argument(a, link) for a in args],
                   "kwargs": [[k, _encode_argument(v, link)] for k, v in kwargs.items()]}
        value, back = link.ask(request)
        if len(back) != len(args):
            raise ProgramBroke("copied-back arguments do not match the call")
        for argument, new in zip(args, back, strict=True):
            if new is not None and type(argument) in _MUTABLE:
                _copy_back(argument, new)
        return value

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._link.ask({"op": "getattr", "target": self._number, "attr": attr})[0]

    def __setattr__(self, attr, value):
        self._link.ask({"op": "setattr", "target": self._number, "attr": attr,
                        "value": _encode_argument(value, self._link)})

    def __iter__(self):
        items = self._link.ask({"op": "iter", "target": self._number})[0]
        if type(items) is not list:
            raise ProgramBroke("iteration did not give a list")
        return iter(items)

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    def __bool__(self):
        return False

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<program object {self._number}>"


def _bind(link, name, how):
    """The judge's value for one of the program's top-level names."""
    if type(how) is not list or not how or how[0] not in ("m", "a", "v", "h"):
        raise ProgramBroke(f"bad name description for {name!r}")
    tag = how[0]
    if tag == "v" and len(how) == 2:
        try:
            return wire_decode(how[1])
        except WireError:
            raise ProgramBroke("bad value in hello") from None
    if tag == "h" and len(how) == 2:
        return link.handle(how[1])
    if tag in ("m", "a") and all(type(x) is str for x in how[1:]) and \
            how[1] in _PURE_MODULES and len(how) == (2 if tag == "m" else 3):
        try:
            __import__(how[1])
            found = sys.modules[how[1]]
            for part in (how[2].split(".") if tag == "a" else []):
                if part.startswith("_"):
                    raise ProgramBroke(f"private attribute in {how!r}")
                found = getattr(found, part)
            return found
        except Exception:
            raise ProgramBroke(f"cannot resolve {how!r}") from None
    raise ProgramBroke(f"bad name description for {name!r}")


def judge_test(check, link, reached_top):
    """Run the compiled test against the program. ``(verdict, top)``: verdict is ``passed``,
    ``failed``, ``memory``, ``gone`` (the program ended), ``sandbox_error`` (it broke the
    protocol) or ``unsupported`` (the test needs what the proxy cannot carry).
    ``reached_top()`` is called once the program's top level has run (its hello came)."""
    try:
        names = link.hello()
    except ProgramBroke:
        return "sandbox_error", False
    except ProgramGone:
        return "gone", False
    reached_top()
    try:
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        for name, how in names.items():
            if not hasattr(builtins, name):
                namespace[name] = _bind(link, name, how)
        exec(check, namespace)
        # one last request: an answer nobody asked for, still in the stream, shows up here
        # (streams keep order), so every request has had exactly one answer
        if link.ask({"op": "end", "target": 0}) != (None, []):
            raise ProgramBroke("bad answer to the last request")
    except Unsupported:
        return "unsupported", True
    except ProgramBroke:
        return "sandbox_error", True
    except ProgramGone:
        return "gone", True
    except ProgramMemory:
        return "memory", True
    except AnswerTooLarge:
        return "failed", True
    except BaseException:
        return "failed", True
    return "passed", True
