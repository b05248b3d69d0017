"""flowmoe's C kernels (every `*.c` of this folder, with the `*.h` they include), built into one
shared library on first use.

The library is compiled with the host's C compiler (`$CC`, else `cc`) for the host's CPU
(-march=native, OpenMP linked against the libgomp torch has loaded, so both share one pool of
worker threads) into `$FLOWMOE_HOME` (else `$XDG_CACHE_HOME/flowmoe/`, default ~/.cache/flowmoe/),
once per source, compiler and CPU. Without a compiler, on a non-x86 host or with FLOWMOE_CPU_KERNELS=0
there is no library and every caller takes torch's (slower) path; a host where the kernels should
build but cannot (no compiler, a failed compile, an unwritable cache) says so in one warning.
Each wrapper module declares its own functions' argument types on the library it gets from here.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog
import torch
from attrs import define, field

log = structlog.get_logger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")


def cpuinfo_field(name: str) -> str:
    """The first `name` line's value in /proc/cpuinfo ("model name", "flags"), or "" where the system
    does not say (no /proc, another OS): what benchmarks name the CPU by."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(name)), "")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them ("avx2", "fma", "avx512f", ...); empty
    where the system does not say."""
    return frozenset(cpuinfo_field("flags").split())


def chosen_block(wanted: str, needs: Mapping[str, frozenset[str]], default: Sequence[str]) -> str | None:
    """A kernel family's block (a key of `needs`, each block's CPU flags): the one `wanted` names
    (FLOWMOE_CPU_ISA's value) where the CPU has its flags, else the first of `default` it has; None
    where it has none of them."""
    flags = cpu_flags()
    return next((name for name in (wanted, *default) if name in needs and needs[name] <= flags), None)


def _cpu_id() -> str:
    """The CPU's model and flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if line.startswith(("model name", "flags")))


def sources() -> dict[str, bytes]:
    """Every C source and header of flowmoe.kernels, by file name."""
    folder = resources.files("flowmoe.kernels")
    files = sorted((f for f in folder.iterdir() if f.name.endswith((".c", ".h"))), key=lambda f: f.name)
    return {f.name: f.read_bytes() for f in files}


def _build(files: dict[str, bytes], compiler: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then move it in (atomic for concurrent builds)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        paths = []  # the .c files; the headers beside them, where their #include "..." finds them
        for name, text in files.items():
            (Path(tmp) / name).write_bytes(text)
            if name.endswith(".c"):
                paths.append(str(Path(tmp) / name))
        out = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, *paths, "-o", str(out), "-lm"], check=True, capture_output=True)
        os.replace(out, target)


def cache_folder() -> Path:
    """Where the library is kept: `$FLOWMOE_HOME` (as the built-in model), else the XDG cache."""
    home = os.environ.get("FLOWMOE_HOME")  # "" is unset
    if home:
        return Path(home)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flowmoe"


FALLBACK = "the CPU kernels are off and torch's slower path computes CPU experts and attention"


def c_compiler() -> str | None:
    """`$CC` (a name on PATH or a path), else `cc`, else `gcc`."""
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (logged once)."""
    if os.environ.get("FLOWMOE_CPU_KERNELS", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    compiler = c_compiler()
    if compiler is None:
        wanted = f"CC={os.environ['CC']!r}" if os.environ.get("CC") else "cc"
        log.warning(
            "cpu_kernels.unavailable",
            reason=f"no C compiler found ({wanted}, gcc); install one or set CC to use the compiled kernels",
            effect=FALLBACK,
        )
        return None
    files = sources()
    parts = [name.encode() + b"\0" + text for name, text in files.items()]
    parts += [compiler.encode(), " ".join(FLAGS).encode(), _cpu_id().encode()]
    key = hashlib.sha256(b"\0".join(parts))
    target = cache_folder() / f"kernels-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(files, compiler, target)
        return ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        detail = e.stderr.decode(errors="replace").strip()[-500:]
        reason = f"{compiler} failed to build them: {detail}"
        log.warning("cpu_kernels.unavailable", reason=reason, effect=FALLBACK)
    except OSError as e:
        reason = f"cannot build or load them in {target.parent}: {e}"
        log.warning("cpu_kernels.unavailable", reason=reason, effect=FALLBACK)
    return None


@define
class Kernel:
    """The library's function `name` with its argument and result types declared: called, it gives
    that function, or None where there is no library, for the price of one lookup of the cached
    library and one comparison: the function is looked up again only when the library is another
    (forgotten and looked up anew: tests that turn the kernels off, which turns the function off too)."""

    name: str
    argtypes: tuple[Any, ...]
    restype: Any = None
    _lib: ctypes.CDLL | None = field(default=None, init=False, eq=False, repr=False)
    _fn: Callable[..., Any] | None = field(default=None, init=False, eq=False, repr=False)

    def __call__(self) -> Callable[..., Any] | None:
        lib = library()
        if lib is not self._lib:
            self._fn = None if lib is None else _declared(lib, self.name, self.argtypes, self.restype)
            self._lib = lib
        return self._fn


T = TypeVar("T")


class Facts(Generic[T]):
    """What `work_out` finds about a tensor that stays as it is while it lives (a weight, a KV cache:
    shape, dtype, strides, device and address as made), worked out on a tensor's first call and
    remembered while it lives: a kernel wrapper's checks of it then cost one lookup per call. An
    entry is keyed by the tensor's id and dropped by a weak reference's callback as the tensor dies,
    so while it is there no other object has that id: the lookup needs no identity check."""

    def __init__(self, work_out: Callable[[torch.Tensor], T]) -> None:
        self._work_out = work_out
        self._seen: dict[int, T] = {}
        self._watch: dict[int, weakref.ref[torch.Tensor]] = {}

    def __call__(self, tensor: torch.Tensor) -> T:
        key = id(tensor)
        if key in self._seen:
            return self._seen[key]
        facts = self._seen[key] = self._work_out(tensor)
        seen, watch = self._seen, self._watch

        def forget(_: object) -> None:
            seen.pop(key, None)
            watch.pop(key, None)

        watch[key] = weakref.ref(tensor, forget)
        return facts


def pointers(values: Sequence[int | None]) -> ctypes.Array[ctypes.c_void_p]:
    """A C array of pointers (None: NULL), for a kernel's per-expert or per-tensor arguments."""
    return (ctypes.c_void_p * len(values))(*values)


@functools.cache
def _declared(lib: ctypes.CDLL, name: str, argtypes: tuple[Any, ...], restype: Any) -> Callable[..., Any]:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
