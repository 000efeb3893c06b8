"""The judge's audit guard (standard library only; runs inside the sandbox, in the judge).

While a test runs, :func:`guard_judge`'s audit hook (``sys.addaudithook``: it cannot be removed)
refuses code made at run time and starting or signalling processes, so nothing built from the
program's output runs where a verdict is decided (docs/sandbox.md, "The judge process").
"""

import os
import sys

# events that run code made at run time, or start or signal processes: refused in the judge
# while the test runs, so nothing built from the program's output (``eval(f(1))``, ``exec``,
# ``pickle.loads``, a docstring run by ``doctest``, a string annotation evaluated by ``typing``)
# ever runs where the verdict is decided. Code may run only when it is the test itself, a
# module the import system loads from the standard library, or made by one of the standard
# library's generators that paste validated identifiers into fixed templates (``namedtuple``,
# ``dataclass``): no caller is exempt because of the file it lives in.
_CODE_EVENTS = frozenset(("exec", "marshal.loads", "marshal.load"))
_REFUSED_EVENTS = frozenset((
    "pickle.find_class", "os.system", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.cdata", "ctypes.call_function", "sys.settrace", "sys.setprofile",
    "code.__new__", "function.__new__"))
_STDLIB = os.path.dirname(os.__file__) + os.sep
_IMPORTS = frozenset((("<frozen importlib._bootstrap>", "_call_with_frames_removed"),
                      ("<frozen importlib._bootstrap>", "exec_module"),
                      ("<frozen importlib._bootstrap_external>", "_compile_bytecode")))
_GENERATORS = frozenset(((_STDLIB + "collections/__init__.py", "namedtuple"),
                         (_STDLIB + "dataclasses.py", "_create_fn"),  # Python <= 3.12
                         (_STDLIB + "dataclasses.py", "add_fns_to_class")))  # 3.13


def _allowed(event, args, caller):
    """May this code event run in the judge (see above)? ``caller``: the calling code object."""
    where = (caller.co_filename, caller.co_name)
    if where in _GENERATORS:
        return True
    if where not in _IMPORTS:
        return False
    if event != "exec":  # marshal: a module's cached bytecode, checked again when it runs
        return True
    origin = getattr(args[0], "co_filename", "") if args else ""
    return origin.startswith(_STDLIB) or origin.startswith("<frozen ")


class RefusedInJudge(BaseException):
    """The test tried to run code made at run time (``eval``, ``exec``, ``pickle``...)."""


def guard_judge(check):
    """Install the judge's audit hook (it cannot be removed). Returns ``(disarm, refused)``:
    ``disarm()`` ends the guard once the test is over; ``refused`` is non-empty when the test
    tried something the guard refused (the test then fails, even if it caught the error)."""
    getframe, armed, refused = sys._getframe, [True], []

    def hook(event, args):
        if not armed[0]:
            return
        if event in _CODE_EVENTS:
            if (event == "exec" and args and args[0] is check) or \
                    _allowed(event, args, getframe(1).f_code):
                return
        elif event not in _REFUSED_EVENTS and not event.startswith("os.exec"):
            return
        refused.append(event)
        raise RefusedInJudge(event)

    sys.addaudithook(hook)
    return (lambda: armed.__setitem__(0, False)), refused
