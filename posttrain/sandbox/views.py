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


# A program's instance of a subclass of a plain type (namedtuple, Counter, IntEnum...) in the
# judge: a copy of its value as the base type, so ==, hashing, len, [] and arithmetic are the
# base type's, computed here; attributes, text and missing keys are read from the program's
# object (``p.x``, ``c.most_common()``, ``str(p)``, ``counts['absent']``).
VIEWS = {base: type(f"program_{base.__name__}", (base,), {
    "_program": None, "__getattr__": program_attr, "__str__": view_method("__str__"),
    "__repr__": view_method("__repr__"),
    **({"__missing__": view_method("__getitem__")} if base is dict else {})})
    for base in (dict, list, tuple, set, frozenset, str, int, float)}
VIEW_TYPES = frozenset(VIEWS.values())
