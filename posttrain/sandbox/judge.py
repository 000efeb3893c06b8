"""The two sides of an assert test (standard library only; runs inside the sandbox).

* The **program process** runs the program, then :func:`serve_program`: a hello frame naming
  its top-level names, then one answer frame per request (call, attribute, item, iteration,
  truth, length, text), with plain data (:mod:`.wire`), an opaque handle, and the top-level
  names whose binding changed (so the test reads the program's current values).
* The **judge process** (:func:`judge_test`) runs the test with the program's names bound to
  plain copies, :class:`Handle` proxies or stand-ins (:mod:`.views`). Every comparison, helper
  and prelude runs here. The judge is forked from the non-dumpable supervisor before any
  program code runs; its verdict goes to the supervisor on a pipe the program never had.

A name the program's code binds is the program's, wherever plain Python would see it (it
shadows a builtin); dunders and names its code never mentions are never bound. The audit guard
(:mod:`.guard`) keeps program text from running here.
"""

import builtins
import select
import sys

# <parent-only> (removed from the sandbox's source, which starts with wire's, guard's
# and views')
from posttrain.sandbox.guard import guard_judge
from posttrain.sandbox.views import VIEW_TYPES, VIEWS, program_attr, program_str
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
_EMPTY = {"l": list, "d": dict, "s": set}
# attributes of the form __x__ a test may read from a program object (the rest are refused)
_DUNDERS = frozenset(("__doc__", "__name__", "__qualname__", "__module__", "__defaults__",
                      "__kwdefaults__", "__annotations__", "__wrapped__", "__dict__"))


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


class NoFallback(BaseException):
    """A callback or test-made object sent to a program name that shadows a builtin: the test
    fails (the in-process fallback would be the program's choice, not the test's shape)."""


class ProgramMemory(BaseException):
    """The program ran out of memory in a call."""


# ----------------------------------------------------------------------------- program side
_BUILTIN_EXCEPTIONS = {id(kind): name for name, kind in vars(builtins).items()
                       if isinstance(kind, type) and issubclass(kind, BaseException)}


def describe_names(namespace, shared, sent=None):
    """Top-level names -> how the judge binds them: a plain copy, a handle (numbered by the
    :class:`_Shared` ``shared``) or an exception class's lineage. Every name is the program's,
    whatever object it holds (a module, ``exec``, ``type``): the judge never binds a program
    name to an object of its own. A name ``sent`` as a handle stays one while it holds the
    same object (it is not encoded again)."""
    names, budget, sent = {}, HELLO_BUDGET, sent or {}
    for name, value in list(namespace.items())[:MAX_NAMES]:
        if type(name) is not str or name.startswith("__"):
            continue
        known = sent.get(name)
        if known is not None and known[0] == "h" and shared.handles[known[1]] is value:
            names[name] = known
            continue
        try:
            if isinstance(value, type) and issubclass(value, BaseException):
                names[name] = ["e", _lineage(value, shared)]
                continue
            encoded = wire_encode(value)
            size = len(repr(encoded))
            if size <= min(HELLO_VALUE_BYTES, budget):
                names[name], budget = ["v", encoded], budget - size
                continue
        except Exception:  # not plain data (or a class whose lineage cannot be sent)
            pass
        names[name] = ["h", shared.register(value)]
    return names


def _lineage(kind, shared, depth=0):
    """How the judge rebuilds a class: a builtin exception's name, or ``[handle, name,
    [lineage of each base]]`` for a class of the program (its real bases, ``object`` left out)."""
    name = _BUILTIN_EXCEPTIONS.get(id(kind))
    if name is not None:
        return name
    if depth > 50:
        raise ValueError("class hierarchy too deep")
    return [shared.register(kind), str(kind.__name__)[:200],
            [_lineage(base, shared, depth + 1) for base in kind.__bases__ if base is not object]]


def _content(obj, encode):
    """Tagged form of a shared list, dict or set, its items encoded with ``encode``."""
    if type(obj) is dict:
        flat = ["d"]
        for key, item in obj.items():
            flat += [encode(key), encode(item)]
        return flat
    return ["l" if type(obj) is list else "s", *[encode(item) for item in obj]]


class _Shared:
    """The program's copies of the judge's lists, dicts and sets (``["h", -1 - n]`` on the
    wire): the same object for the same judge object in every request, kept in step with the
    judge's before and after each request, so a mutation by keyword, of a nested list or of a
    list the program kept from an earlier call is seen by the test, and ``same(a) is a``."""

    def __init__(self):
        self.handles, self.handle_numbers, self.objects, self.numbers = [], {}, {}, {}

    def register(self, value):
        """The handle number of a program object (the same object keeps its number)."""
        number = self.handle_numbers.get(id(value))
        if number is None:
            number = self.handle_numbers[id(value)] = len(self.handles)
            self.handles.append(value)
        return number

    def resolve(self, number, *view):
        if number < 0:
            return self.objects[-1 - number]
        return self.handles[number]

    def ref(self, obj):
        number = self.numbers.get(id(obj))
        return None if number is None else -1 - number

    def encode(self, value):
        return wire_encode(value, self.register, ref=self.ref)

    def sync(self, shared):
        """Take the judge's state of every shared object (the request's ``shared`` list)."""
        live = {}
        for number, content in shared:
            obj = self.objects.get(number)
            if obj is None or _EMPTY[content[0]] is not type(obj):
                obj = _EMPTY[content[0]]()
            live[number] = obj
        self.objects, self.numbers = live, {id(obj): n for n, obj in live.items()}
        for number, content in shared:
            _fill(live[number], wire_decode(content, self.resolve))

    def state(self):
        return [[n, _content(obj, self.encode)] for n, obj in self.objects.items()]


def _fill(obj, new):
    """Give ``obj`` the items of ``new`` (same type), keeping ``obj``'s identity."""
    if type(new) is not type(obj):
        raise WireError("a shared object changed type")
    if type(obj) is list:
        obj[:] = new
    else:
        obj.clear()
        obj.update(new)


def _perform(request, shared, namespace):
    """The value one request asks for; raises what the program raises."""
    op = request["op"]
    if op == "end":
        return None
    if "name" in request:  # a value test: the supervisor names the function
        exec(request.get("prelude", ""), namespace)
        target = namespace[request["name"]] if request["name"] in namespace else \
            getattr(builtins, request["name"])
    else:
        target = shared.handles[request["target"]]
    if op == "call":
        args = [wire_decode(item, shared.resolve) for item in request["args"]]
        kwargs = {key: wire_decode(item, shared.resolve) for key, item in request["kwargs"]}
        return target(*args, **kwargs)
    if op == "getattr":
        return getattr(target, request["attr"])
    if op == "setattr":
        setattr(target, request["attr"], wire_decode(request["value"], shared.resolve))
        return None
    if op == "getitem":
        if "slice" in request:
            return target[slice(*[wire_decode(k, shared.resolve) for k in request["slice"]])]
        return target[wire_decode(request["key"], shared.resolve)]
    operations = {"iter": iter, "next": next, "bool": bool, "len": len, "str": str, "repr": repr}
    if op in operations:
        return operations[op](target)
    raise ValueError(f"unknown request {op!r}")


def _raised(exc, shared):
    """``[type name, message, arguments, class lineage, handle]`` of an exception (arguments:
    plain data or None; lineage: :func:`_lineage`, None when it cannot be sent)."""
    try:
        arguments = wire_encode(exc.args)
        if len(repr(arguments)) > 4096:
            arguments = None
    except Exception:
        arguments = None
    try:
        lineage = _lineage(type(exc), shared)
    except Exception:
        lineage = None
    return [type(exc).__name__, str(exc)[:200], arguments, lineage, shared.register(exc)]


def serve_program(namespace, fd, cap, describe):
    """After the program ran: hello, then one answer frame per request until end of stream.
    With ``describe`` every answer also carries the top-level names whose binding changed
    since the last frame (``names``), so the judge reads the program's current values."""
    shared, sent = _Shared(), {}

    def changed():
        names = describe_names(namespace, shared, sent)
        diff = {name: how for name, how in names.items() if sent.get(name) != how}
        sent.clear()
        sent.update(names)
        return diff

    write_frame(fd, {"names": changed() if describe else {}})
    while True:
        request = read_frame(fd, cap)
        if request is None:
            return
        answer = {"id": request["id"]}
        try:
            shared.sync(request.get("shared", []))
            value = _perform(request, shared, namespace)
            answer["ok"] = shared.encode(value)
            answer["back"] = shared.state()
        except MemoryError:
            answer = {"id": request["id"], "raise": ["MemoryError", "", None, "MemoryError",
                                                     None]}
        except Exception as exc:
            answer = {"id": request["id"], "raise": _raised(exc, shared)}
        if describe:
            answer["names"] = changed()
        write_frame(fd, answer)


# ------------------------------------------------------------------------------- judge side
class Link:
    """The judge's end of the program socket: one request, exactly one answer with its id.
    It also keeps the judge's lists, dicts and sets that were sent to the program in step with
    the program's copies (:class:`_Shared`): all of them go out with every request and come
    back with every answer."""

    def __init__(self, fd, cap, definable=frozenset()):
        self.fd, self.cap, self.last_id, self.handles = fd, cap, 0, {}
        self.shared, self.numbers, self.next_shared = {}, {}, 0
        self.classes, self.class_numbers = {}, {}  # stand-ins of the program's classes
        self.definable, self.namespace, self.bound = definable, {}, {}
        self.shadowing = set()  # handles bound to names that shadow a builtin

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

    def handle(self, number, *view):
        """The judge's object for handle ``number``; with ``view`` (the object's value as its
        plain base type, ``["x", n, base]``), a :data:`VIEWS` copy that keeps the handle."""
        if view:
            if type(view[0]) not in VIEWS or number < 0:
                raise WireError("bad view")
            made = VIEWS[type(view[0])](view[0])
            made._program = self.handle(number)
            return made
        if type(number) is not int:
            raise WireError("bad handle")
        if number < 0:
            if -1 - number not in self.shared:
                raise WireError("unknown shared object")
            return self.shared[-1 - number]
        if number in self.classes:
            return self.classes[number]
        if number not in self.handles:
            self.handles[number] = Handle(self, number)
        return self.handles[number]

    def bind(self, names):
        """Bind the program's names (a hello, or the changes an answer reports) in the test's
        namespace: only names the program's code binds (``definable``, never a dunder), and
        never over a name the test has bound itself since."""
        if type(names) is not dict:
            raise ProgramBroke("bad names")
        for name, how in names.items():
            if name in self.definable and \
                    self.namespace.get(name, _UNSET) is self.bound.get(name, _UNSET):
                value = self.namespace[name] = self.bound[name] = self._value(name, how)
                if type(value) is Handle and hasattr(builtins, name):
                    self.shadowing.add(value._number)

    def _value(self, name, how):
        if type(how) is list and len(how) == 2:
            if how[0] == "v":
                try:
                    return wire_decode(how[1])
                except WireError:
                    raise ProgramBroke("bad value in hello") from None
            if how[0] == "h" and type(how[1]) is int and how[1] >= 0:
                return self.handle(how[1])
            if how[0] == "e":
                return self.exception_class(how[1])
        raise ProgramBroke(f"bad name description for {name!r}")

    def exception_class(self, lineage, depth=0):
        """The judge's class for a program class of exceptions: a builtin one itself, or a
        stand-in made here with the stand-ins of its real bases (no program code in it)."""
        if type(lineage) is str:
            kind = getattr(builtins, lineage, None)
            if isinstance(kind, type) and issubclass(kind, BaseException):
                return kind
        elif type(lineage) is list and len(lineage) == 3 and type(lineage[0]) is int and \
                lineage[0] >= 0 and type(lineage[1]) is str and type(lineage[2]) is list and \
                depth < 60:
            number, name, bases = lineage
            if number not in self.classes:
                bases = tuple(self.exception_class(base, depth + 1) for base in bases)
                try:
                    made = type(name, bases, {"_program": None, "__getattr__": program_attr,
                                              "__str__": program_str})
                except TypeError:
                    made = type(name, (ProgramError,), {})
                self.classes[number], self.class_numbers[id(made)] = made, number
            return self.classes[number]
        raise ProgramBroke("bad class lineage")

    def exception(self, raised, op):
        """The judge's exception for one the program raised: an instance of the judge's class
        for the program's real class (:meth:`exception_class`), never matched by name."""
        if type(raised) is not list or len(raised) != 5 or \
                not all(type(x) is str for x in raised[:2]):
            raise ProgramBroke("bad exception answer")
        name, message, arguments, lineage, number = raised
        kind = ProgramError if lineage is None else self.exception_class(lineage)
        if not issubclass(kind, BaseException):  # a lineage without an exception base
            kind = ProgramError
        if issubclass(kind, MemoryError):
            return ProgramMemory(message)
        if issubclass(kind, (StopIteration, StopAsyncIteration)) and op != "next":
            return RuntimeError(f"program raised {name}")  # PEP 479: it never ends a test's loop
        try:
            args = (message,) if arguments is None else wire_decode(arguments)
            exc = kind(*args) if type(args) is tuple else kind(message)
        except Exception:
            return ProgramError(f"{name}: {message}")
        if id(kind) in self.class_numbers and type(number) is int and number >= 0:
            exc._program = self.handle(number)
        return exc

    def ref(self, obj):
        """The wire number of a judge list, dict or set (shared from now on)."""
        number = self.numbers.get(id(obj))
        if number is None:
            number, self.next_shared = self.next_shared, self.next_shared + 1
            self.shared[number], self.numbers[id(obj)] = obj, number
        return -1 - number

    def encode(self, value):
        def handle(obj):
            if type(obj) is Handle and obj._link is self:
                return obj._number
            if id(obj) in self.class_numbers and self.classes[self.class_numbers[id(obj)]] is obj:
                return self.class_numbers[id(obj)]
            if type(obj) in VIEW_TYPES and type(obj._program) is Handle:
                return obj._program._number
            raise Unsupported(f"a {type(obj).__name__} cannot be sent to the program")

        try:
            return wire_encode(value, handle, ref=self.ref)
        except (RecursionError, ValueError) as exc:
            raise Unsupported(repr(exc)) from None

    def _shared_state(self):
        """Drop shared objects only the link still holds, then encode all the others."""
        while True:
            dead = [n for n in list(self.shared) if sys.getrefcount(self.shared[n]) <= 2]
            if not dead:
                break
            for number in dead:
                del self.numbers[id(self.shared.pop(number))]
        state, done = [], set()
        while len(done) < len(self.shared):  # encoding may share nested objects too
            for number in [n for n in self.shared if n not in done]:
                done.add(number)
                state.append([number, _content(self.shared[number], self.encode)])
        return state

    def ask(self, request):
        """Send a request; the decoded value of its one answer (or the program's exception)."""
        if select.select([self.fd], [], [], 0)[0]:
            raise ProgramBroke("bytes before a request (an answer nobody asked for)")
        self.last_id += 1
        request["id"] = self.last_id
        request["shared"] = self._shared_state()
        try:
            write_frame(self.fd, request)
        except OSError:
            raise ProgramGone("the program closed its socket") from None
        answer = self._read()
        if answer.get("id") != self.last_id or type(answer.get("id")) is not int:
            raise ProgramBroke("answer with the wrong id")
        if set(answer) == {"id", "raise", "names"}:
            self.bind(answer["names"])
            raise self.exception(answer["raise"], request["op"])
        if set(answer) != {"id", "ok", "back", "names"} or type(answer["back"]) is not list:
            raise ProgramBroke("answer of the wrong shape")
        try:
            self._take_back(answer["back"])
            value = wire_decode(answer["ok"], self.handle)
        except (WireError, TypeError, KeyError, IndexError) as exc:
            raise ProgramBroke(f"bad value: {exc}") from None
        self.bind(answer["names"])
        return value

    def _take_back(self, back):
        """The program's state of every shared object, applied in place."""
        numbers = [item[0] if type(item) is list and len(item) == 2 else None for item in back]
        if sorted(n for n in numbers if type(n) is int) != sorted(self.shared) or \
                len(numbers) != len(self.shared):
            raise WireError("shared objects out of step")
        new = [wire_decode(content, self.handle) for _, content in back]
        for number, value in zip(numbers, new, strict=True):
            _fill(self.shared[number], value)


_UNSET = object()


class Handle:
    # A program object seen from the judge: calls, attributes, iteration and truth go to the
    # program's process; it equals only itself and has no other behaviour.

    __slots__ = ("_link", "_number")

    def __init__(self, link, number):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_number", number)

    def _ask(self, op, **fields):
        return self._link.ask({"op": op, "target": self._number, **fields})

    def __call__(self, *args, **kwargs):
        link = self._link
        try:
            sent = [link.encode(a) for a in args], [[k, link.encode(v)] for k, v in kwargs.items()]
        except Unsupported:
            if self._number in link.shadowing:
                raise NoFallback() from None
            raise
        return self._ask("call", args=sent[0], kwargs=sent[1])

    def __getattr__(self, attr):
        if attr.startswith("__") and attr not in _DUNDERS:
            raise AttributeError(attr)
        return self._ask("getattr", attr=attr)

    @property
    def __doc__(self):
        return self._ask("getattr", attr="__doc__")

    def __setattr__(self, attr, value):
        self._ask("setattr", attr=attr, value=self._link.encode(value))

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __bool__(self):
        value = self._ask("bool")
        if type(value) is not bool:
            raise ProgramBroke("truth value is not a bool")
        return value

    def __len__(self):
        return self._ask("len")  # Python itself checks it is an int >= 0

    def __getitem__(self, key):
        encode = self._link.encode
        if type(key) is slice:
            return self._ask("getitem", slice=[encode(k) for k in (key.start, key.stop, key.step)])
        return self._ask("getitem", key=encode(key))

    def __str__(self):
        return self._text("str")

    def __repr__(self):
        return self._text("repr")

    def _text(self, op):
        value = self._ask(op)
        if type(value) is not str:
            raise ProgramBroke(f"{op} is not a str")
        return value

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__


def program_names(code):
    """The names the program's code mentions (every code object in it), dunders left out: the
    only names of a hello or an answer that the judge binds (a forged hello adds nothing)."""
    names, todo = set(), [code]
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo.extend(const for const in current.co_consts if type(const) is type(code))
    return frozenset(name for name in names if not name.startswith("__"))


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
    refused = []
    try:
        namespace = link.namespace = {"__name__": "__main__", "__builtins__": builtins}
        link.bind(names)  # a name the program binds shadows a builtin, as in plain Python
        disarm, refused = guard_judge(check)
        try:
            exec(check, namespace)
        finally:
            disarm()
        if refused:
            return "failed", True
        # one last request: an answer nobody asked for, still in the stream, shows up here
        # (streams keep order), so every request has had exactly one answer
        if link.ask({"op": "end", "target": 0}) is not None:
            raise ProgramBroke("bad answer to the last request")
    except Unsupported:
        return ("failed" if refused else "unsupported"), True
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
