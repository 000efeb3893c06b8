"""The judge's audit guard (standard library only; runs inside the sandbox, in the judge).

While a test runs, :func:`guard_judge`'s audit hook (``sys.addaudithook``: it cannot be removed)
refuses code made at run time and starting or signalling processes, so nothing built from the
program's output runs where a verdict is decided (docs/sandbox.md, "The judge process").
"""

import _imp
import gc
import os
import sys

# events that run code made at run time, or start or signal processes: refused in the judge
# while the test runs, so nothing built from the program's output (``eval(f(1))``, ``exec``,
# ``pickle.loads``, a docstring run by ``doctest``, a string annotation evaluated by ``typing``)
# ever runs where the verdict is decided. Code may run only when it is the test itself, a
# module the import system loads from the standard library, or made by one of the standard
# library's generators that paste validated identifiers into fixed templates (``namedtuple``,
# ``dataclass``): no caller is exempt because of the file it lives in.
_CODE_EVENTS = frozenset(("exec", "marshal.loads", "marshal.load", "import"))
_REFUSED_EVENTS = frozenset((
    "pickle.find_class", "os.system", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.cdata", "ctypes.call_function", "sys.settrace", "sys.setprofile",
    "code.__new__", "function.__new__"))
# code that may run code: the import system's own functions and the two generators, named by
# module and function and compared by identity (a code object's file name is program data)
_IMPORTS = (("_frozen_importlib", "_call_with_frames_removed"),
            ("_frozen_importlib_external", "_compile_bytecode"))
_GENERATORS = (("collections", "namedtuple"), ("dataclasses", "_create_fn"),  # Python <= 3.12
               ("dataclasses", "add_fns_to_class"))  # 3.13


def _code_of(module, *names):
    obj = sys.modules.get(module)
    for name in names:
        obj = getattr(obj, name, None)
    return getattr(obj, "__code__", None)


def _read_only(path):
    """Can no process of the program change ``path``? (a read-only mount, or not ours and not
    writable by us); a path that does not exist is left to its directory."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return True
        return os.stat(path).st_uid != os.geteuid() and not os.access(path, os.W_OK)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _trusted_file(path, roots, cache):
    """Is ``path`` (its real path: no ``..``, no links) inside one of ``roots`` (the judge's own
    ``sys.path`` when the test started), with it and every directory up to the root's parent
    read-only to the program? Only such a file's code may run in the judge."""
    if type(path) is not str:
        return False
    if path not in cache:
        real, ok = os.path.realpath(path), False
        for root in roots:
            if real == root or real.startswith(root + os.sep):
                top, ok = os.path.dirname(root), True
                while ok and real != top and real != os.path.dirname(real):
                    ok, real = _read_only(real), os.path.dirname(real)
                ok = ok and _read_only(top)
                break
        cache[path] = ok
    return cache[path]


def _allowed(event, args, frame, roots, cache):
    """May this code event run in the judge (see above)? ``frame``: the calling frame."""
    caller = frame.f_code
    if event == "import":  # an extension module (native code) is a file the import loads
        return len(args) < 2 or args[1] is None or _trusted_file(args[1], roots, cache)
    if any(caller is _code_of(module, name) for module, name in _GENERATORS):
        return True
    if event != "exec":  # marshal: a module's cached bytecode, from a trusted file only
        return caller is _code_of(*_IMPORTS[1]) and \
            _trusted_file(frame.f_locals.get("bytecode_path"), roots, cache)
    if caller is _code_of("_frozen_importlib", "FrozenImporter", "exec_module"):
        return True  # a frozen module: its code is in the interpreter itself
    if caller is not _code_of(*_IMPORTS[0]):
        return False
    called = frame.f_locals.get("args")
    namespace = called[1] if type(called) is tuple and len(called) == 2 else None
    spec = namespace.get("__spec__") if type(namespace) is dict else None
    return _trusted_file(getattr(spec, "origin", None), roots, cache)


class RefusedInJudge(BaseException):
    """The test tried to run code made at run time (``eval``, ``exec``, ``pickle``...)."""


def guard_judge(check):
    """Install the judge's audit hook (it cannot be removed). Returns ``(disarm, refused)``:
    ``disarm()`` ends the guard once the test is over; ``refused`` is non-empty when the test
    tried something the guard refused (the test then fails, even if it caught the error)."""
    getframe, armed, refused, cache = sys._getframe, [True], [], {}
    roots = tuple(os.path.realpath(entry) for entry in sys.path if entry)

    def hook(event, args):
        if not armed[0]:
            return
        if event in _CODE_EVENTS:
            if (event == "exec" and args and args[0] is check) or \
                    _allowed(event, args, getframe(1), roots, cache):
                return
        elif event not in _REFUSED_EVENTS and not event.startswith("os.exec"):
            return
        refused.append(event)
        raise RefusedInJudge(event)

    sys.addaudithook(hook)
    return (lambda: armed.__setitem__(0, False)), refused


# what reaches the supervisor's code and state from inside the program process (a frame: its
# globals and locals; the collector's object graph; tracing hooks; native code; the process's
# own memory): refused there from before the program runs, so the program cannot rewrite what
# turns its answers into wire values (issue 56; docs/sandbox.md, "Wire form")
_PROGRAM_EVENTS = frozenset((
    "sys._getframe", "sys._current_frames", "sys._current_exceptions", "sys.addaudithook",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "cpython.PyInterpreterState_Clear"))
_FRAME_ATTRIBUTES = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame"))
_TRACE_EVENTS = frozenset(("sys.settrace", "sys.setprofile"))


class RefusedInProgram(ValueError):
    """The program asked for something that reaches the supervisor (a frame, the collector's
    object graph, a tracing hook in the serving phase, native code, its own memory). A
    ``ValueError``, as the standard library expects of ``sys._getframe`` where it is optional
    (``namedtuple``, ``typing``, ``enum``, ``logging`` carry on without a caller's frame)."""


def guard_program(serving):
    """Install the program process's audit hook (it cannot be removed). ``serving``: a list
    whose first item is true once the supervisor answers requests; from then on tracing hooks
    are refused too (during the top level, ``doctest``'s own ``sys.settrace`` still works; the
    supervisor clears both hooks before it serves). Every name the hook uses is bound here,
    before the program runs: it looks nothing up in globals or builtins, and it runs no code
    of the program (``sys.audit`` may pass anything: only exact ``str`` are compared; Python
    also runs no trace function inside a hook)."""
    refusal, events, frames, tracing = RefusedInProgram, _PROGRAM_EVENTS, _FRAME_ATTRIBUTES, \
        _TRACE_EVENTS
    is_proc_memory, kind_of = _proc_memory_check(), type
    create_builtin, spec = _seal_collector()

    def hook(event, args):
        if kind_of(event) is not str or kind_of(args) is not tuple:
            raise refusal("an audit event that is not a str")
        if event in events or event[:7] == "ctypes.":
            raise refusal(event)
        if event[:7] == "object." and (len(args) < 2 or kind_of(args[1]) is not str):
            raise refusal(event)
        if event == "object.__getattr__":
            if args[1] in frames:
                raise refusal(f"{event} {args[1]}")
        elif event == "object.__setattr__":
            if args[1] == "__code__":
                raise refusal(f"{event} __code__")
        elif event in tracing:
            if serving[0]:
                raise refusal(event)
        elif (event == "open" or event == "os.symlink") and is_proc_memory(args[0]):
            raise refusal(f"{event} of a process's memory")
        elif event == "posttrain.create_builtin":
            name, made = args
            if kind_of(name) is not str or name in ("gc", "_imp") or kind_of(made) is not list:
                raise refusal(event)
            made.append(create_builtin(spec(name, None, origin="built-in")))

    sys.addaudithook(hook)


def _seal_collector():
    """``gc.set_debug`` refused in the program process: with ``DEBUG_SAVEALL`` the collector
    keeps every frame of a cycle in ``gc.garbage``, and a frame leads to its callers' (the
    serving code's). No fresh ``gc`` module brings it back (``del sys.modules['gc']``,
    ``importlib``, a loader's ``create_module``): ``_imp.create_builtin`` becomes a function
    that asks the audit hook, which alone holds the real one and refuses ``gc`` and ``_imp``
    (:func:`guard_program`); ``importlib.reload`` adds no functions. Returns the real
    ``create_builtin`` and the spec class it is called with."""
    create, spec = _imp.create_builtin, type(sys.__spec__)

    def refuse_debug(*args, **kwargs):
        raise RefusedInProgram("gc.set_debug")

    def create_builtin(given):
        name, made = given.name, []
        sys.audit("posttrain.create_builtin", name, made)
        return made[0]

    gc.set_debug, _imp.create_builtin = refuse_debug, create_builtin
    return create, spec


# the device of /proc, read once when the supervisor starts (its program processes share its
# mount namespace, so its /proc); None without one
try:
    _PROC_DEVICE = os.stat("/proc/self/mem").st_dev
except OSError:
    _PROC_DEVICE = None


def _proc_memory_check():
    """``check(path) -> bool``: does opening ``path`` (or linking to it) reach a process's
    memory (``/proc/<pid>/mem``, ``/proc/self/task/<tid>/mem``)? A path named ``mem``, or one
    that resolves (from the working directory) to a mode-0600 file of the ``/proc`` file
    system; a path that is neither a ``str``, ``bytes`` nor a descriptor is refused too (its
    ``__fspath__`` could answer differently the second time)."""
    kinds, kind_of, stat, regular, errors = (int, str, bytes), type, os.stat, 0o100600, \
        (OSError, ValueError)
    proc = _PROC_DEVICE

    def check(path):
        kind = kind_of(path)
        if kind is kinds[0]:
            return False
        if kind is not kinds[1] and kind is not kinds[2]:
            return True
        text = path.decode("latin-1") if kind is kinds[2] else path
        parts = [part for part in text.split("/") if part not in ("", ".")]
        if parts and parts[-1] == "mem":
            return True
        try:
            info = stat(path)
        except errors:
            return False
        return info.st_dev == proc and info.st_mode == regular

    return check
