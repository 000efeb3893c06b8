"""The judge's side of an assert test (standard library only; runs inside the sandbox).

The **judge process** (:func:`judge_test`) runs the test with the program's names bound to
plain copies, shared lists, dicts and sets, :class:`Handle` proxies or stand-ins (:mod:`.views`);
the program process answers through :mod:`.program`. Every comparison, helper and prelude runs
here. The judge is forked from the non-dumpable supervisor before any program code runs; its
verdict goes to the supervisor on a pipe the program never had.

A name the program's code binds is the program's, wherever plain Python would see it (it
shadows a builtin); dunders and names its code never mentions are never bound. The audit guard
(:mod:`.guard`) keeps program text from running here. Where the judge would not reproduce
Python (``==`` of an object with its own ``__eq__``), the test fails (:func:`.views.not_python`).
"""

import builtins
import select
import sys

# <parent-only> (removed from the sandbox's source, which starts with wire's, guard's,
# views' and program's)
from posttrain.sandbox.guard import guard_judge
from posttrain.sandbox.program import _EMPTY, _content, _fill
from posttrain.sandbox.views import (
    NOT_PYTHON,
    VIEW_TYPES,
    VIEWS,
    not_python,
    program_attr,
    program_str,
)
from posttrain.sandbox.wire import (
    FrameTooLarge,
    WireError,
    read_frame,
    wire_decode,
    wire_encode,
    write_frame,
)

# </parent-only>

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


# ------------------------------------------------------------------------------- judge side
class Link:
    """The judge's end of the program socket: one request, exactly one answer with its id.
    It also keeps the judge's lists, dicts and sets that were sent to the program in step with
    the program's copies (:class:`_Shared`): all of them go out with every request and come
    back with every answer."""

    def __init__(self, fd, cap, definable=frozenset(), key=None):
        self.fd, self.cap, self.last_id, self.handles = fd, cap, 0, {}
        self.key = key  # the answers' signing key (wire._signed)
        self.shared, self.numbers, self.next_shared = {}, {}, 0
        self.classes, self.class_numbers = {}, {}  # stand-ins of the program's classes
        self.definable, self.namespace, self.bound = definable, {}, {}
        self.shadowing = set()  # handles bound to names that shadow a builtin

    def hello(self):
        frame = self._read()
        if set(frame) != {"names", "back", "threads"} or type(frame["names"]) is not dict or \
                type(frame["back"]) is not list:
            raise ProgramBroke("bad hello")
        self.threads(frame["threads"])
        try:
            self._take_back(frame["back"])
        except (WireError, TypeError, KeyError, IndexError) as exc:
            raise ProgramBroke(f"bad shared object: {exc}") from None
        return frame["names"]

    def _read(self):
        try:
            frame = read_frame(self.fd, self.cap, self.key)
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
        if view:  # (base value, names of the base's methods the program's class redefines)
            if type(view[0]) not in VIEWS or type(view[0]) in (list, dict, set) or number < 0:
                raise WireError("bad view")  # a list, dict or set subclass is shared
            made = VIEWS[type(view[0])](view[0])
            made._program, made._overrides = self.handle(number), view[1]
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
                    return wire_decode(how[1], self.handle, in_order=_disorder)
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
            args = (message,) if arguments is None else wire_decode(arguments, in_order=_disorder)
            exc = kind(*args) if type(args) is tuple else kind(message)
        except Exception:
            return ProgramError(f"{name}: {message}")
        if id(kind) in self.class_numbers and type(number) is int and number >= 0:
            exc._program = self.handle(number)
        return exc

    def ref(self, obj):
        """The wire number of a shared object: the program's, or a judge list, dict or set
        (shared from now on); None for anything else."""
        number = self.numbers.get(id(obj))
        if number is None:
            if type(obj) not in (list, dict, set):
                return None
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
        request["next"] = self.next_shared  # where the program's new shared numbers start
        try:
            write_frame(self.fd, request)
        except OSError:
            raise ProgramGone("the program closed its socket") from None
        answer = self._read()
        if answer.get("id") != self.last_id or type(answer.get("id")) is not int:
            raise ProgramBroke("answer with the wrong id")
        if set(answer) - {"ok", "raise"} != {"id", "names", "back", "threads"} or \
                len(set(answer) & {"ok", "raise"}) != 1 or type(answer["back"]) is not list:
            raise ProgramBroke("answer of the wrong shape")
        self.threads(answer["threads"])
        try:
            self._take_back(answer["back"], request["next"])
            value = wire_decode(answer["ok"], self.handle, in_order=_disorder) \
                if "ok" in answer else None
        except (WireError, TypeError, KeyError, IndexError) as exc:
            raise ProgramBroke(f"bad value: {exc}") from None
        self.bind(answer["names"])
        if "raise" in answer:
            raise self.exception(answer["raise"], request["op"])
        return value

    def threads(self, count):
        """A thread of the program still alive may change its names after this answer, which
        the judge would not see (plain Python would): the test fails."""
        if type(count) is not int:
            raise ProgramBroke("bad thread count")
        if count:
            not_python("a thread of the program is alive: its names may change unseen")

    def _take_back(self, back, first_new=0):
        """The program's state of every shared object, applied in place: every object the
        judge sent, and the program's new ones (numbers from ``first_new``), made here first
        (a subclass instance as a :data:`VIEWS` copy that keeps its handle)."""
        numbers = [item[0] if type(item) is list and len(item) in (2, 4) and
                   type(item[0]) is int else None for item in back]
        old = [n for n in numbers if n in self.shared]
        made = [item for item in back if item[0] not in self.shared]
        if len(set(numbers)) != len(numbers) or None in numbers or \
                sorted(old) != sorted(self.shared) or any(n < first_new for n, *_ in made):
            raise WireError("shared objects out of step")
        for number, content, *view in made:
            if type(content) is not list or not content or content[0] not in _EMPTY:
                raise WireError("bad shared object")
            base = _EMPTY[content[0]]
            if view:
                if type(view[0]) is not int or view[0] < 0 or type(view[1]) is not list or \
                        not all(type(name) is str for name in view[1]):
                    raise WireError("bad shared subclass instance")
                obj = VIEWS[base]()
                obj._program, obj._overrides = self.handle(view[0]), frozenset(view[1])
            else:
                obj = base()
            self.shared[number], self.numbers[id(obj)] = obj, number
            self.next_shared = max(self.next_shared, number + 1)
        new = [wire_decode(item[1], self.handle, in_order=_disorder) for item in back]
        for number, value in zip(numbers, new, strict=True):
            _fill(self.shared[number], value, in_order=_disorder)


_UNSET = object()


def _disorder():
    """A set of the program the judge cannot rebuild in its order: the test would iterate it
    unlike plain Python (docs/sandbox.md, "A set's iteration order")."""
    not_python("a set of the program whose iteration order the judge cannot rebuild")


class Handle:
    # A program object seen from the judge: calls, attributes, items, iteration, truth, ==,
    # `in`, hashing and the other operators go to the program's process (Python's semantics
    # there); the program's lists, dicts and sets are handles too, so they are shared.

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

    def _item(self, op, key, **fields):
        encode = self._link.encode
        if type(key) is slice:
            return self._ask(op, slice=[encode(k) for k in (key.start, key.stop, key.step)],
                             **fields)
        return self._ask(op, key=encode(key), **fields)

    def __getitem__(self, key):
        return self._item("getitem", key)

    def __setitem__(self, key, value):
        self._item("setitem", key, value=self._link.encode(value))

    def __delitem__(self, key):
        self._item("delitem", key)

    def __contains__(self, item):
        return self._ask("operator", operator="contains", other=self._link.encode(item))

    def __hash__(self):
        return self._ask("operator", operator="hash")  # Python itself checks it is an int

    def __format__(self, spec):
        return self._text("operator", operator="format", other=spec)

    def __str__(self):
        return self._text("str")

    def __repr__(self):
        return self._text("repr")

    def _text(self, op, **fields):
        value = self._ask(op, **fields)
        if type(value) is not str:
            raise ProgramBroke(f"{op} is not a str")
        return value

    def __eq__(self, other):
        """An object whose class keeps ``object``'s ``==`` equals only itself; plain data (a
        large top-level constant) is fetched and compared here; any other would need the
        program's ``__eq__``, which may say anything (``AlwaysEqual``): the test fails
        (stricter than Python), whichever way it asks (``==``, ``!=``, ``not ==``, a dedupe)."""
        if self is other:
            return True
        how = self._ask("equality")
        if type(how) is tuple and how and how[0] == "identity":
            return False
        if type(how) is tuple and len(how) == 2 and how[0] == "value":
            return how[1] == other
        raise not_python("== or != of a program object that defines its own __eq__")

    def __ne__(self, other):
        return not self.__eq__(other)


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
        if refused or NOT_PYTHON:  # refused or not reproduced, even if the test caught it
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
