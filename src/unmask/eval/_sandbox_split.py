"""The two halves of a split sandbox run (see :func:`unmask.eval.sandbox.run_program` with ``tests``).

Not a module to import: :mod:`unmask.eval._sandbox_boot` executes this text in both processes.
``serve`` runs in the solution's process (unprivileged, the untrusted code); ``judge`` runs in the
tests' process, which never executes a line of the solution. The tests see the solution's
top-level names as :class:`Remote` proxies: a call crosses a pipe, runs in the solution's process,
and its result comes back as plain data (numbers, strings, bytes, the built-in containers and
``collections``' ones, exact types only), which the tests compare with their own code. Anything
else comes back as another proxy, which can be called, indexed, iterated, printed and given back,
but never compared or tested for truth in the tests' process: its answer would be the solution's
claim, not a value.
"""
import builtins, os, pickle, struct, sys

_PLAIN = (int, float, complex, str, bytes, bool, type(None), range, bytearray)
_FACTORIES = (list, dict, set, int, float, str, tuple, frozenset, bytes, bool, type(None))
_SAFE_CLASSES = {("builtins", c.__name__) for c in (complex, set, frozenset, bytearray, range, list, dict,
                                                   int, float, str, tuple, bytes, bool)} | {
    ("collections", n) for n in ("OrderedDict", "Counter", "defaultdict", "deque")}
_MAX_MESSAGE = 1 << 30


def _send(fd, payload):
    data = struct.pack(">Q", len(payload)) + payload
    while data:
        data = data[os.write(fd, data):]


def _recv(fd):
    """One message, or None at end of file (the other process is gone)."""
    def exactly(n):
        parts = []
        while n:
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)
    head = exactly(8)
    if head is None:
        return None
    size = struct.unpack(">Q", head)[0]
    if size > _MAX_MESSAGE:
        raise ValueError("the solution's process sent a message too large to read")
    return exactly(size)


# --- the solution's process -------------------------------------------------------------------

class _Handle:
    __slots__ = ("id",)

    def __init__(self, id):
        self.id = id


def serve(ns, rfd, wfd):
    """Answer the tests' requests on ``ns`` (the solution's globals) until the tests say ``exit``."""
    import collections, operator
    objects = {}

    def handle(obj):
        objects[id(obj)] = obj
        return _Handle(id(obj))

    def plain(x, depth=0):
        t = type(x)
        if t in _PLAIN:
            return x
        if depth > 200:
            return handle(x)
        if t in (list, tuple, set, frozenset):
            return t(plain(v, depth + 1) for v in x)
        if t in (dict, collections.OrderedDict, collections.Counter):
            return t({plain(k, depth + 1): plain(v, depth + 1) for k, v in x.items()})  # Counter(pairs) counts pairs
        if t is collections.defaultdict:
            items = ((plain(k, depth + 1), plain(v, depth + 1)) for k, v in x.items())
            if x.default_factory is None or x.default_factory in _FACTORIES:
                return collections.defaultdict(x.default_factory, items)
            return dict(items)
        if t is collections.deque:
            return collections.deque((plain(v, depth + 1) for v in x), x.maxlen)
        # Subclasses of the plain types (numpy scalars among them) become the plain value they
        # stand for: what the tests compare is then a value, whatever the subclass' __eq__ says.
        try:
            for base, convert in ((int, int.__index__), (float, float.__float__), (str, str.__str__),
                                  (bytes, bytes), (complex, complex), (list, list), (tuple, tuple),
                                  (dict, dict), (set, set), (frozenset, frozenset)):
                if issubclass(t, base):
                    return plain(convert(x), depth + 1)
            if t.__module__ == "numpy" and callable(getattr(x, "tolist", None)):
                return plain(x.tolist(), depth + 1)
        except Exception:  # a conversion that fails leaves the object where it is
            pass
        return handle(x)

    class Out(pickle.Pickler):
        def persistent_id(self, obj):
            return ("h", obj.id) if type(obj) is _Handle else None

    class In(pickle.Unpickler):
        def persistent_load(self, pid):
            return objects[pid[1]]

    def reply(value):
        import io
        buf = io.BytesIO()
        Out(buf, protocol=4).dump(value)
        _send(wfd, buf.getvalue())

    unary = {"len": len, "iter": iter, "repr": repr, "str": str, "index": operator.index, "float": float,
             "abs": abs, "neg": operator.neg, "pos": operator.pos, "invert": operator.invert}
    reply(("ready", {k: plain(v) for k, v in ns.items() if not k.startswith("__")}))
    while True:
        _flush()
        msg = _recv(rfd)
        if msg is None:
            os._exit(0)
        import io
        op, target, args, kwargs = In(io.BytesIO(msg)).load()
        if op == "exit":
            os._exit(0)
        try:
            if op == "call":
                value = target(*args, **kwargs)
            elif op == "getattr":
                value = getattr(target, args[0])
            elif op == "setattr":
                value = setattr(target, *args)
            elif op == "delattr":
                value = delattr(target, args[0])
            elif op == "getitem":
                value = target[args[0]]
            elif op == "setitem":
                target[args[0]] = args[1]
                value = None
            elif op == "delitem":
                del target[args[0]]
                value = None
            elif op == "next":
                try:
                    value = next(target)
                except StopIteration:
                    reply(("stop",))
                    continue
            elif op in unary:
                value = unary[op](target)
            else:  # a binary operator, reflected when args[1]
                f = getattr(operator, op)
                value = f(args[0], target) if args[1] else f(target, args[0])
        except Exception as e:
            reply(("raise", type(e).__name__, str(e)[:2000]))
            continue
        reply(("value", plain(value)))


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


# --- the tests' process -----------------------------------------------------------------------

class SolutionGone(Exception):
    """The solution's process ended while the tests were waiting on it."""


def judge(tests, wpid, rfd, wfd):
    """Run ``tests`` against the solution in process ``wpid``; return normally only when the
    tests' last statement returned. The solution's process ending first raises SolutionGone."""
    import io

    def ask(op, target, *args, **kwargs):
        buf = io.BytesIO()
        Out(buf, protocol=4).dump((op, target, args, kwargs))
        try:
            _send(wfd, buf.getvalue())
        except BrokenPipeError:
            raise SolutionGone from None
        return answer()

    def answer():
        msg = _recv(rfd)
        if msg is None:
            raise SolutionGone
        reply = In(io.BytesIO(msg)).load()
        kind = reply[0] if type(reply) is tuple and reply else None
        if kind == "value":
            return reply[1]
        if kind == "stop":
            raise StopIteration
        if kind == "raise":
            name, message = str(reply[1]), str(reply[2])
            if name in ("StopIteration", "StopAsyncIteration"):
                # as PEP 479 does for generators: raised by a call, it would silently end the tests'
                # map() or filter() (all(map(...)) over nothing passes); an iterator's end is "stop"
                raise RuntimeError(f"the solution raised {name}: {message}")
            cls = getattr(builtins, name, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = type(name, (Exception,), {})
            try:
                exc = cls(message)
            except Exception:
                exc = type(name, (Exception,), {})(message)
            raise exc
        if kind == "ready":
            return reply[1]
        raise ValueError("the solution's process sent an answer the tests cannot read")

    def refuse(self, *args):
        raise TypeError("an object of the solution's own type cannot be compared or tested for truth by "
                        "the tests; return plain values (numbers, strings, lists, dicts, ...)")

    class Remote:
        """An object that lives in the solution's process."""
        __slots__ = ("_id",)
        __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __contains__ = refuse
        __hash__ = object.__hash__

        def __init__(self, id):
            object.__setattr__(self, "_id", id)

        def __call__(self, *args, **kwargs):
            return ask("call", self, *args, **kwargs)

        def __getattr__(self, name):
            return ask("getattr", self, name)

        def __setattr__(self, name, value):
            ask("setattr", self, name, value)

        def __delattr__(self, name):
            ask("delattr", self, name)

        def __getitem__(self, key):
            return ask("getitem", self, key)

        def __setitem__(self, key, value):
            ask("setitem", self, key, value)

        def __delitem__(self, key):
            ask("delitem", self, key)

        def __next__(self):
            return ask("next", self)

        def __iter__(self):
            it = ask("iter", self)
            return it if type(it) is Remote else iter(it)

        def __len__(self):
            return typed(ask("len", self), int)

        def __index__(self):
            return typed(ask("index", self), int)

        def __float__(self):
            return typed(ask("float", self), float)

        def __repr__(self):
            return typed(ask("repr", self), str)

        def __str__(self):
            return typed(ask("str", self), str)

    def typed(value, t):
        if type(value) is not t:
            raise TypeError(f"the solution's object gave a {type(value).__name__} where {t.__name__} is needed")
        return value

    for name in ("abs", "neg", "pos", "invert"):
        setattr(Remote, f"__{name}__", (lambda op: lambda self: ask(op, self))(name))
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
                 "lshift", "rshift"):
        op = name + "_" if name in ("and", "or") else name
        setattr(Remote, f"__{name}__", (lambda op: lambda self, other: ask(op, self, other, False))(op))
        setattr(Remote, f"__r{name}__", (lambda op: lambda self, other: ask(op, self, other, True))(op))

    class Out(pickle.Pickler):
        def persistent_id(self, obj):
            return ("h", obj._id) if type(obj) is Remote else None

    class In(pickle.Unpickler):
        """Reads only plain data and handles: the solution's process cannot make the tests'
        process build any other object (no code runs on loading)."""
        def find_class(self, module, name):
            if (module, name) in _SAFE_CLASSES:
                return getattr(__import__(module), name)
            raise pickle.UnpicklingError(f"the solution's process sent a {module}.{name}")

        def persistent_load(self, pid):
            if type(pid) is tuple and len(pid) == 2 and pid[0] == "h" and type(pid[1]) is int:
                return Remote(pid[1])
            raise pickle.UnpicklingError("bad handle")

    names = answer()
    if type(names) is not dict or not all(type(k) is str for k in names):
        raise ValueError("the solution's process sent an answer the tests cannot read")
    ns = {"__name__": "__main__", "__builtins__": builtins}
    ns.update(names)
    import linecache
    linecache.cache["tests.py"] = (len(tests), None, tests.splitlines(True), "tests.py")  # tracebacks quote it
    exec(compile(tests, "tests.py", "exec"), ns)
    _flush()
