"""The judge's own stand-ins for program objects (standard library only; runs in the judge).

No program code is in them: a raised program exception is an instance of a class the judge
made with the program class's real bases (:meth:`.judge.Link.exception_class`), and a program's
instance of a subclass of a plain type is a copy of its base value (:data:`VIEWS`); both read
attributes and text from the program's object through its handle (``_program``).
"""


def program_attr(self, attr):
    """Attributes of a raised program exception: read from the program's own instance."""
    if self._program is None or attr.startswith("__"):
        raise AttributeError(attr)
    return getattr(self._program, attr)


def program_str(self):
    return BaseException.__str__(self) if self._program is None else str(self._program)


def view_method(name):
    def forward(self, *args):
        return getattr(self._program, name)(*args)
    return forward


# what a view never guards: construction, and what reads no value (text is the program's)
_UNGUARDED = frozenset(("__new__", "__init__", "__getattribute__", "__getattr__", "__class__",
                        "__init_subclass__", "__subclasshook__", "__class_getitem__",
                        "__reduce__", "__reduce_ex__", "__getnewargs__", "__getstate__",
                        "__sizeof__", "__dir__", "__setattr__", "__delattr__", "__str__",
                        "__repr__"))


class NotPython(BaseException):
    """A program object's operation the judge does not reproduce (``==`` of a handle with
    another value, a redefined method the proxy lacks): the test fails, even if it catches it
    (:data:`NOT_PYTHON` records it)."""


NOT_PYTHON = []


def not_python(why):
    NOT_PYTHON.append(why)
    return NotPython(why)


def _guarded(name, method):
    """``method`` of the base type, unless the program's class redefines ``name``: then the
    program's own, asked of its object (Python would run the override, never the base's)."""
    def call(self, *args, **kwargs):
        if name not in self._overrides:
            return method(self, *args, **kwargs)
        program = self._program
        if not name.startswith("__"):
            return getattr(program, name)(*args, **kwargs)
        forward = getattr(type(program), name, None)
        if forward is None:
            raise not_python(f"the program's class redefines {name}")
        return forward(program, *args, **kwargs)
    return call


def _view(base):
    methods = {name: _guarded(name, getattr(base, name)) for name in dir(base)
               if name not in _UNGUARDED and callable(getattr(base, name))}
    return type(f"program_{base.__name__}", (base,), {
        **methods, "_program": None, "_overrides": frozenset(), "__getattr__": program_attr,
        "__str__": view_method("__str__"), "__repr__": view_method("__repr__"),
        **({"__missing__": view_method("__getitem__")} if base is dict else {})})


# A program's instance of a subclass of a plain type (namedtuple, IntEnum, Counter, a str
# subclass, ``class Stack(list)``) in the judge: a copy of its value as the base type, read by
# the base type's own methods in the program (``tuple.__iter__(obj)``), so ==, hashing, len, []
# and arithmetic are the base type's, computed here, except the methods the program's class
# redefines, which are asked of the program's object; attributes, text and missing keys are
# read from it (``p.x``, ``str(p)``, ``c.most_common()``, ``counts['z']``). A subclass of a
# list, dict or set is shared (kept in step both ways, :class:`.judge._Shared`).
VIEWS = {base: _view(base) for base in (tuple, frozenset, str, int, float, list, dict, set)}
VIEW_TYPES = frozenset(VIEWS.values())
