"""The program process's side of an assert test (standard library only; runs in the sandbox).

After the program ran, :func:`serve_program` answers the judge (:mod:`.judge`): a hello frame
naming its top-level names, then one answer frame per request (call, attribute, item,
iteration, truth, length, text, ``in``, hashing), with plain data (:mod:`.wire`), an opaque
handle, the shared lists, dicts and sets (:func:`_shared_objects`: kept in step both ways) and the
top-level names whose binding changed (so the test reads the program's current values).
Everything here runs where the program can reach it: an answer is the program's choice.
More: docs/sandbox.md, "The judge process".
"""

import _operator
import _thread
import builtins
import sys

# <parent-only> (removed from the sandbox's source, which starts with wire's)
from posttrain.sandbox.wire import (
    _BASES,
    _MUTABLE,
    SET_ORDER,
    WireError,
    iterates_as,
    overrides,
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
_Namespace = type(sys.implementation)  # types.SimpleNamespace: a C type, its methods fixed
_FunctionType = type(lambda: None)
_ModuleType = type(sys)
_CONTAINERS = (tuple, list, set, frozenset)


_BUILTIN_EXCEPTIONS = {id(kind): name for name, kind in vars(builtins).items()
                       if isinstance(kind, type) and issubclass(kind, BaseException)}


def describe_names(namespace, shared, sent=None):
    """Top-level names -> how the judge binds them: a plain copy, a handle (numbered by
    ``shared``, :func:`_shared_objects`) or an exception class's lineage. Every name is the
    program's, whatever object it holds (a module, ``exec``, ``type``): the judge never binds
    a program name to an object of its own. A name ``sent`` as a handle stays one while it
    holds the same object (it is not encoded again)."""
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
            size = len(repr(wire_encode(value)))  # plain data, copied (lists: shared)
            if size <= min(HELLO_VALUE_BYTES, budget):
                names[name], budget = ["v", shared.encode(value)], budget - size
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
    """Tagged form of a shared list, dict or set (or an instance of a subclass of one), read
    with the base type's own methods, its items encoded with ``encode``."""
    if isinstance(obj, dict):
        flat = ["d"]
        for key, item in dict.items(obj):
            flat += [encode(key), encode(item)]
        return flat
    if isinstance(obj, list):
        return ["l", *[encode(item) for item in list.__iter__(obj)]]
    return ["s", *[encode(item) for item in set.__iter__(obj)]]


def _shared_objects(share=False):
    """The lists, dicts and sets both sides hold (``["h", -1 - n]`` on the wire): the judge's
    that reached the program, and (assert tests, ``share``) every list, dict or set of the
    program that reached the judge, an instance of a subclass of one too. Each is one object
    on each side, kept in step before and after each request, so a mutation on either side
    (in place, by keyword, of a nested list, of a list kept from an earlier call) is seen by
    the other, and ``same(a) is a``, as in one interpreter. ``objects``: number -> the
    program's object; numbers of the program's own start at the request's ``next``.
    A namespace of closures over its state, not a class: a program can rewrite any class's
    methods (``object.__subclasses__()``), never these."""
    s = _Namespace(handles=[], handle_numbers={}, objects={}, numbers={}, next=0, kinds={})

    def register(value):
        """The handle number of a program object (the same object keeps its number)."""
        number = s.handle_numbers.get(id(value))
        if number is None:
            number = s.handle_numbers[id(value)] = len(s.handles)
            s.handles.append(value)
        return number

    def resolve(number, *view):
        return s.objects[-1 - number] if number < 0 else s.handles[number]

    def ref(obj):
        number = s.numbers.get(id(obj))
        if number is None and share and isinstance(obj, _MUTABLE):
            number, s.next = s.next, s.next + 1  # shared from now on
            s.objects[number], s.numbers[id(obj)] = obj, number
        return None if number is None else -1 - number

    def encode(value):
        return wire_encode(value, register, ref=ref)

    def sync(shared, next_number=0):
        """Take the judge's state of every shared object (the request's ``shared`` list); an
        object it no longer holds is dropped. A state equal to the object's is left alone."""
        live = {}
        for number, content in shared:
            obj = s.objects.get(number)
            if obj is None or not isinstance(obj, _EMPTY[content[0]]):
                obj = _EMPTY[content[0]]()
            live[number] = obj
        s.objects, s.numbers = live, {id(obj): n for n, obj in live.items()}
        s.next = max(s.next, next_number)
        for number, content in shared:
            if _content(live[number], encode) != content:
                _fill(live[number], wire_decode(content, resolve))

    def state():
        """``[number, content]`` of every shared object (``[number, content, handle,
        overrides]`` for an instance of a subclass), the ones encoding them shares too."""
        out, done = [], set()
        while len(done) < len(s.objects):
            for number in [n for n in s.objects if n not in done]:
                done.add(number)
                obj = s.objects[number]
                entry = [number, _content(obj, encode)]
                if type(obj) not in _MUTABLE:  # a subclass: its handle and its overrides
                    entry += [register(obj), redefined(obj)]
                out.append(entry)
        return out

    def redefined(obj):
        kind = type(obj)
        if kind not in s.kinds:
            base = next(b for b in _MUTABLE if isinstance(obj, b))
            s.kinds[kind] = overrides(kind, base, obj, dict(_BASES)[base](obj))
        return s.kinds[kind]

    s.register, s.resolve, s.ref, s.encode, s.sync, s.state = \
        register, resolve, ref, encode, sync, state
    return s


def _fill(obj, new, in_order=True):
    """Give ``obj`` the items of ``new`` (its base type), keeping ``obj``'s identity; with the
    base type's own methods (an instance of a subclass of a list, dict or set too). A set
    iterates in ``new``'s order where it can; elsewhere as :func:`.wire.same_order_set` says
    for ``in_order`` (it keeps the nearest order when it does not raise)."""
    if not isinstance(obj, type(new)) or type(new) not in _MUTABLE:
        raise WireError("a shared object changed type")
    if type(new) is list:
        list.__setitem__(obj, slice(None), new)
    elif type(new) is dict:
        dict.clear(obj)
        dict.update(obj, new)
    else:  # a set: merged (``new``'s layout), else one item at a time, in ``new``'s order
        order = list(set.__iter__(new))
        for fill in (new, order):
            set.clear(obj)
            set.update(obj, fill)
            if not in_order or iterates_as(obj, order):
                return
        if in_order is True:
            raise WireError(SET_ORDER)
        in_order()
        set.clear(obj)
        set.update(obj, new)  # the nearest: new's own layout


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
    if op in ("getitem", "setitem", "delitem"):
        key = slice(*[wire_decode(k, shared.resolve) for k in request["slice"]]) \
            if "slice" in request else wire_decode(request["key"], shared.resolve)
        if op == "setitem":
            target[key] = wire_decode(request["value"], shared.resolve)
        elif op == "delitem":
            del target[key]
        return target[key] if op == "getitem" else None
    if op == "equality":  # how == of this object behaves (Handle.__eq__)
        kind = type(target)
        if kind.__eq__ is object.__eq__ and kind.__ne__ is object.__ne__:
            return ("identity",)
        try:
            wire_encode(target)  # plain data: compared in the judge
        except Exception:
            return ("other",)  # its own __eq__: never asked (it may say anything)
        return ("value", target)
    if op == "operator":  # `in`, hash, format of a program object: Python's, asked there
        function = _OPERATORS[request["operator"]]
        if "other" not in request:
            return function(target)
        other = wire_decode(request["other"], shared.resolve)
        return function(target, other)
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


# what a judge may ask of a program object besides calls, items and text: `in`, hashing and
# format (Python's own functions, bound before the program runs)
_OPERATORS = {"contains": _operator.contains, "hash": hash, "format": format}


def serve_program(namespace, fd, cap, describe, key):
    """After the program ran: hello, then one answer frame per request until end of stream.
    With ``describe`` every answer also carries the top-level names whose binding changed
    since the last frame (``names``), so the judge reads the program's current values. Every
    frame is signed with ``key`` (the test's; bytes the program writes itself carry no tag)."""
    shared, sent = _shared_objects(describe), {}

    def changed():
        names = describe_names(namespace, shared, sent)
        diff = {name: how for name, how in names.items() if sent.get(name) != how}
        sent.clear()
        sent.update(names)
        return diff

    hello = {"names": changed() if describe else {}}
    if describe:  # threads of the program alive: its names may change after any answer
        hello["threads"] = _thread._count() - 1  # not the serving thread
    write_frame(fd, {**hello, "back": shared.state()}, key)
    while True:
        request = read_frame(fd, cap)
        if request is None:
            return
        answer = {"id": request["id"]}
        try:
            shared.sync(request.get("shared", []), request.get("next", 0))
            value = _perform(request, shared, namespace)
            answer["ok"] = shared.encode(value)
        except MemoryError:
            answer = {"id": request["id"], "raise": ["MemoryError", "", None, "MemoryError",
                                                     None]}
        except Exception as exc:
            if type(exc) is WireError and exc.args == (SET_ORDER,):
                return  # the program would iterate a set unlike plain Python: the test fails
            answer = {"id": request["id"], "raise": _raised(exc, shared)}
        if describe:
            answer["names"], answer["threads"] = changed(), _thread._count() - 1
        answer["back"] = shared.state()  # last: the value and the names may share objects
        write_frame(fd, answer, key)


def private_world(source):
    """The globals of a private copy of the supervisor (``source``: its globals), made once by
    the supervisor before it forks a program process (held by no global): every function of
    ``source`` copied with these globals, its tables copied, each module it names as a
    snapshot of its attributes, the builtins as they are now, the JSON codec made again from
    the copies. The program can
    still reach ``source`` (a method's ``__globals__`` of any supervisor class) and patch any
    module or builtin; none of those is what the copies look up, and nothing the program can
    reach refers to the copies (docs/sandbox.md, "Wire form")."""
    world, made = {"__builtins__": dict(vars(builtins))}, {}

    def copy(value):
        if id(value) in made:
            return made[id(value)]
        kind = type(value)
        if kind is _FunctionType and value.__globals__ is source:
            new = _FunctionType(value.__code__, world, value.__name__,
                                copy(value.__defaults__), value.__closure__)
            new.__kwdefaults__ = copy(value.__kwdefaults__)
        elif kind in _CONTAINERS:
            new = kind(copy(item) for item in value)
        elif kind is dict:
            new = {copy(key): copy(item) for key, item in value.items()}
        elif kind is _ModuleType:
            new = _Namespace(**vars(value))
        else:
            return value
        made[id(value)] = new
        return new

    for name, value in list(source.items()):
        if name != "__builtins__":
            world[name] = copy(value)
    world["_ENCODE"], world["_SCAN"] = world["json_codec"]()
    return world
