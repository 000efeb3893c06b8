"""Issue 56, the forge through the program process's own Python: a program that reaches the
supervisor's code or state in its own process (a frame's globals, a traceback's or a
generator's frame, the collector's object graph, a class's methods' globals, a function's code,
a tracing hook, a patched module or builtin the encoder looks up) and rewrites what turns its
answer into a wire value, so that a wrong ``f`` (``f(1)`` is 0) scores on ``f(1) == 5``. Each
scores 0 in both sandbox modes, through the value path and the judge; honest programs that use
the standard library's optional frame lookups (namedtuple, typing, enum, logging) and a
top-level doctest keep their score."""

from __future__ import annotations

import os
import random

import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from tests.sandbox.test_adversarial_programs import mode

__all__ = ["mode"]

LIMITS = SandboxLimits(timeout_s=3.0)
TESTS = ["assert f(1) == 5", "assert (f(1) == 5) == True"]  # the value path, then the judge

# rewrite the encoder found in a globals dict `g`: 0 is sent as 5 (plain Python: no encoder,
# the program's f(1) is 0 and the test fails)
_EVIL = ("def _evil(g):\n"
         "    if type(g) is not dict or 'wire_encode' not in g:\n"
         "        return\n"
         "    real = g['wire_encode']\n"
         "    def enc(v, *a, **k):\n"
         "        return real(5 if type(v) is int and v == 0 else v, *a, **k)\n"
         "    g['wire_encode'] = enc\n"
         "def _functions():\n"
         "    seen, todo, found = set(), [object], []\n"
         "    while todo:\n"
         "        kind = todo.pop()\n"
         "        for sub in type.__subclasses__(kind):\n"
         "            if id(sub) not in seen:\n"
         "                seen.add(id(sub))\n"
         "                todo.append(sub)\n"
         "        found += [v for v in vars(kind).values() if type(v) is type(_evil)]\n"
         "    return found\n")


def _forge(body: str, top: str = "") -> str:
    """A program whose f runs ``body`` (indented) and then returns 0."""
    lines = "".join(f"    {line}\n" for line in body.splitlines())
    return f"{_EVIL}{top}def f(x):\n{lines}    return 0\n"


def _walk(start: str) -> str:
    """Lines that rewrite the encoder in the globals of the frame ``start`` and of every frame
    below it (and in a supervisor function's globals found in their locals)."""
    return (f"fr = {start}\nwhile fr is not None:\n    _evil(fr.f_globals)\n"
            "    for v in list(fr.f_locals.values()):\n"
            "        if type(v) is type(_evil):\n            _evil(v.__globals__)\n"
            "    fr = fr.f_back\n")


def _indent(text: str, by: int) -> str:
    return "".join(" " * by + line + "\n" for line in text.splitlines())


FORGES = {
    # issue 56, found after the private copy: a frame no audit event guards
    "signal handler": _forge(
        "import signal\ndef h(sig, frame):\n" + _indent(_walk("frame"), 4)
        + "signal.signal(signal.SIGUSR1, h)\nsignal.raise_signal(signal.SIGUSR1)"),
    "gc.garbage (DEBUG_SAVEALL)": _forge(
        "import gc\ngc.set_debug(gc.DEBUG_SAVEALL)\n"
        "def g():\n    try:\n        raise ValueError\n    except ValueError as e:\n"
        "        keep = e\ng()\ngc.collect()\n"
        "for o in list(gc.garbage):\n    if type(o).__name__ == 'frame':\n"
        + _indent(_walk("o"), 8)),
    "top-level settrace": _forge(
        "", "import sys\nSEEN = []\ndef tr(frame, event, arg):\n    SEEN.append(frame)\n"
        "def g():\n    pass\nsys.settrace(tr)\ng()\nsys.settrace(None)\n" + _walk("SEEN[0]")),
    "getframe": _forge("import sys\n_evil(sys._getframe(1).f_globals)"),
    "inspect": _forge("import inspect\n_evil(inspect.currentframe().f_back.f_globals)"),
    "traceback": _forge("try:\n    raise ValueError\nexcept ValueError as e:\n"
                        "    _evil(e.__traceback__.tb_frame.f_back.f_globals)"),
    "generator": _forge("next(GEN)",
                        "def gen():\n    yield _evil(GEN.gi_frame.f_back.f_back.f_globals)\n"
                        "GEN = gen()\n"),
    "coroutine": _forge("try:\n    CO.send(None)\nexcept StopIteration:\n    pass",
                        "async def co():\n    _evil(CO.cr_frame.f_back.f_back.f_globals)\n"
                        "CO = co()\n"),
    "gc.get_objects": _forge("import gc\nfor o in gc.get_objects():\n    _evil(o)"),
    "gc.get_referrers": _forge("import gc, os\nfor o in gc.get_referrers(os):\n    _evil(o)"),
    "class methods' globals": _forge("for fn in _functions():\n    _evil(fn.__globals__)"),
    "sys.modules": _forge(  # closed before (issue 56): __main__ is the program's module
        "import sys\nfor m in list(sys.modules.values()):\n"
                          "    _evil(getattr(m, '__dict__', None))"),
    "__code__ swap": _forge(
        "for fn in _functions():\n    enc = fn.__globals__.get('wire_encode')\n"
        "    if enc is not None:\n        enc.__code__ = fake.__code__",
        "def fake(value, handle=None, depth=0, ref=None):\n"
        "    if type(value) is int:\n        return 5 if value == 0 else value\n"
        "    if value is None or type(value) in (str, bool):\n        return value\n"
        "    if handle is None:\n        raise TypeError('not plain')\n"
        "    return ['h', handle(value)]\n"),
    "a class's method": _forge(
        "for kind in [c for c in object.__subclasses__() if 'sync' in vars(c)]:\n"
        "    real = kind.encode\n"
        "    kind.encode = lambda self, v, real=real: real(self, 5 if v == 0 else v)"),
    "setprofile": _forge(
        "import sys\ndef prof(frame, event, arg):\n"
        "    if event == 'return' and frame.f_code.co_name == 'f':\n"
        "        sys.setprofile(None)\n        _evil(frame.f_back.f_globals)\n"
        "sys.setprofile(prof)"),
    "settrace": _forge(
        "import sys\ndef trace(frame, event, arg):\n"
        "    _evil(frame.f_globals)\n    return None\n"
        "sys.settrace(trace)"),
    "builtins.memoryview": _forge(
        "", "import builtins\n_mv = builtins.memoryview\n"
        "builtins.memoryview = lambda b: _mv(b.replace(b'\"ok\":0,', b'\"ok\":5,') "
        "if type(b) is bytes else b)\n"),
    "json.dumps": _forge(
        "", "import json\n_d = json.dumps\n"
        "json.dumps = lambda o, **k: _d(o, **k).replace('\"ok\":0,', '\"ok\":5,')\n"),
    "os.write": _forge(
        "", "import os\n_w = os.write\n"
        "os.write = lambda fd, b: _w(fd, bytes(b).replace(b'\"ok\":0,', b'\"ok\":5,'))\n"),
}


def _statuses(program: str, tests: list, mode: str) -> list[str]:
    _, result = code_reward_detailed(program, tests, 3.0, partial=True, mode=mode,
                                     limits=LIMITS)
    return result.test_status


@pytest.mark.parametrize("name", sorted(FORGES))
def test_a_forge_through_the_programs_own_python_scores_0(mode: str, name: str) -> None:
    assert _statuses(FORGES[name], TESTS, mode) == ["failed", "failed"], name


def test_the_forges_program_is_wrong_without_the_forge(mode: str) -> None:
    """The same f without the forge fails too, and with f(1) == 5 the tests pass: the
    programs above differ from a right one only by the forge."""
    assert _statuses(_forge(""), TESTS, mode) == ["failed", "failed"]
    right = _forge("").replace("    return 0\n", "    return 5\n")
    assert _statuses(right, TESTS, mode) == ["passed", "passed"]


_REFUSED = """
import sys, os, gc
def refused(action):
    try:
        action()
    except ValueError:
        return True
    except Exception:
        return False
    return False
def gen():
    yield 1
def hook_added():
    seen = []
    sys.addaudithook(lambda event, args: seen.append(event))  # silently not added
    compile('1', 'x', 'eval')
    return bool(seen)
def ctypes_usable():
    try:
        import ctypes  # the supervisor's own (imported before the program runs)
        ctypes.c_long.from_address(id(1))
        ctypes.memmove(ctypes.c_long(), ctypes.c_long(), 8)
    except (ValueError, ImportError):  # refused
        return False
    return True
def probe(where):
    link = where + '/m'
    return [refused(lambda: sys._getframe()), refused(sys._current_frames),
            refused(gc.get_objects), refused(lambda: gc.get_referrers(os)),
            refused(lambda: gc.get_referents(os)), refused(lambda: gen().gi_frame),
            refused(lambda: sys.settrace(None)), refused(lambda: sys.setprofile(None)),
            not hook_added(), not ctypes_usable(),
            refused(lambda: open('/proc/self/mem', 'rb')),
            refused(lambda: os.open('/proc/%d/mem' % os.getpid(), os.O_RDONLY)),
            refused(lambda: os.symlink('/proc/self/mem', link)),
            refused(lambda: os.symlink('/proc/self', link) or open(link + '/mem', 'rb'))]
def fresh_gc():
    import importlib, importlib.util, _imp
    saved = sys.modules.pop('gc')
    try:
        yield lambda: __import__('gc').set_debug(0)
        yield lambda: importlib.import_module('gc').set_debug(0)
    finally:
        sys.modules['gc'] = saved
    yield lambda: importlib.util.module_from_spec(importlib.util.find_spec('gc')).set_debug(0)
    yield lambda: _imp.create_builtin(importlib.util.find_spec('gc')).set_debug(0)
    yield lambda: importlib.reload(gc).set_debug(0)
def probe_frames():
    import signal, _signal
    return [refused(lambda: signal.signal(signal.SIGUSR1, lambda s, f: None)),
            refused(lambda: _signal.signal(signal.SIGALRM, lambda s, f: None)),
            refused(lambda: gc.set_debug(gc.DEBUG_SAVEALL)), gc.get_debug() == 0,
            *[refused(route) for route in fresh_gc()], gc.get_debug() == 0]
"""


def test_what_reaches_the_supervisor_is_refused_in_the_program(mode: str) -> None:
    where = f"/tmp/reach56_{random.randrange(10**9)}"
    program = _REFUSED + f"os.makedirs({where!r})\n"
    assert _statuses(program, [f"assert probe({where!r}) == [True] * 14"], mode) == ["passed"]
    # what hands a frame over with no audit event: a signal handler (the program never runs
    # on the main thread), the collector's DEBUG_SAVEALL (refused, in every gc module)
    assert _statuses(program, ["assert probe_frames() == [True] * 10"], mode) == ["passed"]


HONEST = """
import collections, enum, logging, typing, warnings, functools
Pair = collections.namedtuple('Pair', 'x y')
class Point(typing.NamedTuple):
    x: int
    y: int
T = typing.TypeVar('T')
Color = enum.Enum('Color', 'RED GREEN')
@functools.lru_cache(maxsize=None)
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
def f(x):
    logging.getLogger('quiet').debug('x=%s', x)
    warnings.warn('careful')
    return Pair(x, 4).y + Point(0, 0).x + Color.GREEN.value - 2 + fib(1)
if __name__ == '__main__':
    import doctest
    doctest.testmod()
"""


def test_honest_programs_keep_their_score(mode: str) -> None:
    assert _statuses(HONEST, TESTS + ["assert fib(30) == 832040"], mode) == ["passed"] * 3


def test_the_forges_reach_the_encoder_without_the_guard() -> None:
    """The forges are real: run in one plain interpreter against a stand-in of the
    supervisor's globals, the frame, traceback, generator, gc and class routes all find the
    encoder (so the sandbox, not the attack, is why they score 0)."""
    import subprocess
    import sys

    for name in ("getframe", "traceback", "generator", "gc.get_objects",
                 "class methods' globals", "signal handler", "gc.garbage (DEBUG_SAVEALL)",
                 "top-level settrace"):
        host = ("class Serve:\n    def encode(self, v):\n        return wire_encode(v)\n"
                "def wire_encode(v):\n    return v\n"
                "def _perform(fn):\n    return Serve().encode(fn(1))\n"
                f"exec({FORGES[name]!r}, ns := {{}})\n"
                "print(_perform(ns['f']))\n")
        out = subprocess.run([sys.executable, "-I", "-c", host], capture_output=True,
                             text=True, timeout=60, env={**os.environ})
        assert out.stdout.strip() == "5", (name, out.stdout, out.stderr[-500:])


_SOCKET = r'''
import os, stat, json, struct
def _frame(obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data
def _sock(n):
    try:
        return stat.S_ISSOCK(os.fstat(n).st_mode)
    except OSError:
        return False
def f(x):
    fd = [n for n in range(3, 64) if _sock(n)][0]
    extra = {"names": {}, "threads": 0} if JUDGE else {}
    os.write(fd, _frame({"id": 1, "ok": 5, "back": [], **extra}))
    if JUDGE:  # answer the judge's last request too, then leave before the real answer
        size = struct.unpack(">I", os.read(fd, 4))[0]
        request = json.loads(os.read(fd, size))
        os.write(fd, _frame({"id": request["id"], "ok": None, "back": [], **extra}))
    os._exit(0)
'''


@pytest.mark.parametrize("test", TESTS)
def test_answers_written_on_the_socket_by_the_program_never_pass(mode: str, test: str) -> None:
    """The program writes its own answer frames (the judge's protocol, served from inside its
    call) and leaves before the real answer: unsigned, they break the protocol (score 0).
    Before answers were signed (issue 56) both scored 1.0."""
    status = _statuses(f"JUDGE = {test != TESTS[0]}\n" + _SOCKET, [test], mode)
    assert status in (["sandbox_error"], ["failed"]), status


_MEMORY = r'''
import os, subprocess, sys
def blocked(action):
    try:
        os.close(action())
    except (ValueError, PermissionError):  # the audit hook, or the kernel
        return True
    except Exception as exc:
        return repr(exc)
    return False
def routes(where):
    os.makedirs(where, exist_ok=True)
    pid = os.getpid()
    subprocess.run(["ln", "-sf", f"/proc/{pid}/mem", where + "/x"], check=True)
    subprocess.run(["ln", "-sf", f"/proc/{pid}", where + "/p"], check=True)
    here = os.open(where, os.O_RDONLY)
    proc = os.open(f"/proc/{pid}", os.O_RDONLY)
    os.chdir("/")  # the hook resolves a relative name from here, not from the descriptor
    return [blocked(lambda: os.open("x", os.O_RDWR, dir_fd=here)),
            blocked(lambda: os.open(where + "/x", os.O_RDWR)),
            blocked(lambda: os.open("mem", os.O_RDWR, dir_fd=proc)),
            blocked(lambda: os.open(where + "/p/mem", os.O_RDWR)),
            blocked(lambda: os.open("/proc/thread-self/mem", os.O_RDWR)),
            blocked(lambda: os.open(f"/proc/self/task/{pid}/mem", os.O_RDONLY)),
            blocked(lambda: os.open(where + "/ok", os.O_CREAT | os.O_WRONLY)) is False]
# the control: a process of the program's own uid that is dumpable (a fresh interpreter)
# opens its memory through the same kind of link and directory descriptor
CONTROL = ("import os, sys; w = sys.argv[1] + f'/c{os.getpid()}'; "
           "os.symlink(f'/proc/{os.getpid()}', w); d = os.open(w, os.O_RDONLY); "
           "os.close(os.open('mem', os.O_RDWR, dir_fd=d)); print('opened')")
def control(where):
    done = subprocess.run([sys.executable, "-I", "-c", CONTROL, where], capture_output=True,
                          text=True)
    return done.stdout.strip()
'''


def test_own_memory_is_out_of_reach_by_every_route(mode: str) -> None:
    """Opening the program process's /proc/<pid>/mem: through a link another process made
    (no audit event names it), a directory descriptor (the hook cannot see it), a link to
    /proc/<pid>, /proc/thread-self, a task's mem. The hook refuses what it can name; the rest
    fails in the kernel: a non-dumpable process's /proc files belong to root, and the program
    never runs as root. The control, a dumpable process of the same uid, opens its own."""
    where = f"/tmp/mem56_{random.randrange(10**9)}"
    program = _MEMORY + f"R = routes({where!r})\nC = control({where!r})\n"
    tests = ["assert R == [True] * 7", "assert C == 'opened'"]
    assert _statuses(program, tests, mode) == ["passed", "passed"]


def test_each_tests_program_process_starts_from_the_supervisor_as_it_was(mode: str) -> None:
    # the supervisor makes its private copy and imports the modules a program names (re here)
    # once, before its first fork: what one test's program process did to them (a counter kept
    # in a module, a patched function) is not in the next one's, as in plain Python
    program = ("import re\nre.RUNS = getattr(re, 'RUNS', 0) + 1\n"
               "if re.RUNS == 1:\n    re.sub = None\n"
               "def f(x):\n    return re.RUNS\n")
    tests = ["assert f(0) == 1", "assert f(0) == 1", "assert (f(0) == 1) == True",
             "assert (f(0) == 1) == True", "assert f(0) == 1"]
    score, result = code_reward_detailed(program, tests, 3.0, mode=mode, partial=True)
    assert result.test_status == ["passed"] * 5, result.test_status
    assert result.test_kinds == ["value", "value", "assert", "assert", "value"]


def test_the_modules_the_supervisor_loads_ahead_keep_no_state_made_per_process() -> None:
    # a module seeded or named per process (random, tempfile, uuid, secrets) loaded once ahead
    # would be the same in every test's program process: none of them comes with the list
    import subprocess
    import sys

    from posttrain.sandbox.harness import _PRELOAD

    code = (f"import sys\nfor name in {sorted(_PRELOAD)!r}:\n    __import__(name)\n"
            "print(sorted({'random', 'tempfile', 'uuid', 'secrets'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
