"""Start a serving stack: a Redis of our own and tritonserver on the project's model repository.

Library:
    from deploy.launch import StackOptions, start_stack
    with start_stack(StackOptions(run_dir=tmp)) as stack:
        client = tritonclient.grpc.InferenceServerClient(stack.grpc_url)

CLI (``make run`` uses it; the Docker image runs it with ``--foreground``):
    python -m deploy.launch [--warmup on|off] [--run-dir .run/main] [--foreground]
                            [--param model.key=value ...] [--model-dir DIR] [--model-repository DIR]
                            [--text-env DIR] [--no-redis --redis-url URL] [--redis-maxmemory SIZE]
                            [--tritonserver BIN] [--backend-dir DIR]
                            [--grpc-port P --http-port P --metrics-port P] [--ready-model NAME ...]
                            [--timeout S] [--log-verbose N] [--no-prime]

The model repository is rendered into ``<run_dir>/model_repository`` with each model's Python-backend
parameters set (``model_dir``, ``redis_url``, ``warmup``, ``--param`` overrides), so the checked-in
``model_repository/`` never holds machine-specific paths. ``<run_dir>/stack.json`` records ports and
pids; ``python -m deploy.stop --run-dir ...`` stops what it lists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cache.response_cache import redact_url
from deploy.arg_types import seconds
from deploy.processes import same_process
from deploy.stack_secret import provide_tenant_secret
from scheduler.tenant_auth import SECRET_ENV
from engine.cache_sizing import host_available_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / ".tools"
DEFAULT_RUN_DIR = REPO_ROOT / ".run" / "main"
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"
TEXT_MODELS = ("slo_scheduler", "detokenizer")  # BYTES-tensor steps: need a numpy<2 env on the GPU image
ENGINE_MODEL = "llm_engine"
PRIME_MODEL = "llm"
STACK_FILE = "stack.json"
DRAIN_FILE = "draining"  # scheduler/drain.py
LOG_TAIL_LINES = 60


class StackError(RuntimeError):
    """The stack could not be started (the message carries the relevant log tail)."""


def log(msg: str) -> None:
    print(f"[launch] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- ports


def find_free_port(host: str = "") -> int:
    """A TCP port that nothing listens on right now (bound on all interfaces, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together so the kernel cannot hand out the same one twice)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


# ------------------------------------------------------------------------------ config.pbtxt editing


def _pbtxt_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _param_block(key: str, value: str) -> str:
    return f"parameters {{ key: {_pbtxt_str(key)} value: {{ string_value: {_pbtxt_str(value)} }} }}"


def _top_level_parameter_blocks(text: str) -> list[tuple[int, int, str | None]]:
    """(start, end, key) of each top-level ``parameters { ... }`` block in a protobuf text file.

    A small scanner that understands strings and ``#`` comments, so braces inside either are ignored.
    """
    blocks: list[tuple[int, int, str | None]] = []
    i, n, depth = 0, len(text), 0
    block_start = -1
    while i < n:
        c = text[i]
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if depth == 0 and text.startswith("parameters", i) and (i == 0 or not _ident(text[i - 1])):
            m = re.compile(r"parameters\s*:?\s*\{").match(text, i)
            if m:
                block_start = i
                depth = 1
                i = m.end()
                continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and block_start >= 0:
                body = text[block_start : i + 1]
                km = re.search(r"\bkey\s*:\s*\"((?:[^\"\\]|\\.)*)\"", body)
                blocks.append((block_start, i + 1, km.group(1) if km else None))
                block_start = -1
        i += 1
    return blocks


def _ident(c: str) -> bool:
    return c.isalnum() or c == "_"


def set_parameters(text: str, params: dict[str, str]) -> str:
    """Set string parameters in config.pbtxt text: replace the block of an existing key, else append."""
    for key, value in params.items():
        block = _param_block(key, str(value))
        found = [b for b in _top_level_parameter_blocks(text) if b[2] == key]
        if found:
            # replace the first, drop any duplicates (Triton rejects duplicate keys anyway)
            for start, end, _ in reversed(found[1:]):
                text = text[:start] + text[end:]
            start, end, _ = found[0]
            text = text[:start] + block + text[end:]
        else:
            text = text.rstrip("\n") + "\n" + block + "\n"
    return text


def get_parameters(text: str) -> dict[str, str]:
    """The top-level string parameters of config.pbtxt text (for tests and diagnostics)."""
    out: dict[str, str] = {}
    for start, end, key in _top_level_parameter_blocks(text):
        if key is None:
            continue
        m = re.search(r"string_value\s*:\s*\"((?:[^\"\\]|\\.)*)\"", text[start:end])
        if m:
            out[key] = re.sub(r"\\(.)", lambda g: {"n": "\n"}.get(g.group(1), g.group(1)), m.group(1))
    return out


def render_repository(
    src: Path | str,
    dst: Path | str,
    overrides: dict[str, dict[str, str]] | None = None,
    text_env: Path | str | None = None,
    strip_model_warmup: bool = False,
) -> Path:
    """Copy the model repository ``src`` to ``dst`` (replacing it) and set model parameters.

    ``strip_model_warmup`` removes every ``model_warmup`` block: with the engine's warmup off too,
    that gives the truly cold baseline the cold-start benchmark compares against.

    ``overrides`` maps a model name (or ``"*"`` for every model) to ``{parameter: value}``; a model's own
    entry wins over ``"*"``. With ``text_env``, ``EXECUTION_ENV_PATH`` is set on the BYTES-tensor models
    (slo_scheduler, detokenizer) so they run in that numpy<2 environment. Returns ``dst``.
    """
    src, dst = Path(src), Path(dst)
    overrides = dict(overrides or {})
    models = sorted(p.parent.name for p in src.glob("*/config.pbtxt"))
    unknown = sorted(set(overrides) - set(models) - {"*"})
    if unknown:
        raise ValueError(f"parameter override for unknown model(s) {unknown}; models in {src}: {models}")
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in models:
        params = {**overrides.get("*", {}), **overrides.get(name, {})}
        if text_env is not None and name in TEXT_MODELS:
            params["EXECUTION_ENV_PATH"] = str(text_env)
        cfg = dst / name / "config.pbtxt"
        text = cfg.read_text()
        cfg.chmod(0o600)  # before the write: its parameters may hold credentials (a redis_url's password)
        if strip_model_warmup:
            text = remove_model_warmup(text)
        if params:
            text = set_parameters(text, {k: str(v) for k, v in params.items()})
        cfg.write_text(text)
    return dst


def remove_model_warmup(config_text: str) -> str:
    """Drop ``model_warmup [ ... ]`` (brackets matched, so nested blocks go with it)."""
    start = config_text.find("model_warmup")
    while start >= 0:
        open_at = config_text.index("[", start)
        depth, index = 0, open_at
        while True:
            depth += {"[": 1, "]": -1}.get(config_text[index], 0)
            if depth == 0:
                break
            index += 1
        config_text = config_text[:start] + config_text[index + 1 :]
        start = config_text.find("model_warmup")
    return config_text


# ------------------------------------------------------------------------------------------- stack


def _default_tritonserver() -> str:
    return os.environ.get("TRITONSERVER") or str(TOOLS / "triton/pytriton/tritonserver/bin/tritonserver")


def _default_backend_dir() -> str:
    return os.environ.get("TRITON_BACKENDS") or str(TOOLS / "triton/backends")


def _default_triton_libs() -> str:
    if os.environ.get("TRITON_LIBS"):
        return os.environ["TRITON_LIBS"]
    parts = []
    venv_python = REPO_ROOT / ".venv/bin/python"
    libdir = None
    if venv_python.exists() and Path(sys.executable).resolve() != venv_python.resolve():
        try:
            libdir = subprocess.run(
                [str(venv_python), "-c", "import sysconfig;print(sysconfig.get_config_var('LIBDIR'))"],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            libdir = None
    libdir = libdir or sysconfig.get_config_var("LIBDIR")
    if libdir:
        parts.append(libdir)
    libs = TOOLS / "triton/nvidia_pytriton.libs"
    if libs.is_dir():
        parts.append(str(libs))
    return ":".join(parts)


REDIS_MEMORY_SHARE = 0.25  # of the host memory available at start: the default bound of a Redis started here
REDIS_POLICY = "volatile-lru"  # every cache value has a TTL; the traffic history, which has none, stays


def default_redis_maxmemory() -> str:
    """A quarter of the host memory available now (its cgroup's limit counted), in bytes; "0"
    (unbounded) when that cannot be read."""
    available = host_available_bytes()
    return str(int(REDIS_MEMORY_SHARE * available)) if available else "0"


@dataclass
class StackOptions:
    repo_root: Path = REPO_ROOT
    run_dir: Path = DEFAULT_RUN_DIR
    model_dir: Path = DEFAULT_MODEL_DIR
    model_repository: Path | None = None  # default: <repo_root>/model_repository
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    text_env: Path | None = None
    warmup: bool | None = None  # None: leave the model config's default
    start_redis: bool = True
    redis_url: str | None = None  # used when start_redis is False
    redis_server: str = "redis-server"
    tritonserver: str | None = None  # default: $TRITONSERVER or .tools/ (scripts/setup.sh)
    backend_dir: str | None = None  # default: $TRITON_BACKENDS or .tools/
    triton_libs: str | None = None  # LD_LIBRARY_PATH additions; default: $TRITON_LIBS or computed
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)  # extra tritonserver flags
    grpc_port: int = 0  # 0: pick a free port
    http_port: int = 0
    metrics_port: int = 0
    redis_port: int = 0
    redis_maxmemory: str | None = None  # of the Redis started here (None: default_redis_maxmemory)
    ready_models: tuple[str, ...] = ("llm",)
    # with warmup not off: requests through the ensemble before the stack counts as up (client/prime.py)
    prime: bool = True
    ready_timeout_s: float = 300.0
    log_verbose: int = 0
    # write a .pth into the stub's python (and text_env) so model.py files import engine/, scheduler/, ...
    repo_pth: bool = True


@dataclass
class Stack:
    grpc_port: int
    http_port: int
    metrics_port: int
    redis_port: int | None
    redis_url: str
    pids: dict[str, int]
    run_dir: Path
    triton_log: Path
    redis_log: Path | None
    create_times: dict[str, float] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict, repr=False)  # what the server got beyond ours
    tenant_secret_file: Path | None = None  # the stack's own tenant secret (deploy/stack_secret.py)
    tenant_secret: str | None = field(default=None, repr=False, compare=False)  # what the server got
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False, compare=False)

    @property
    def grpc_url(self) -> str:
        """tritonclient.grpc form: 'localhost:P'."""
        return f"localhost:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """tritonclient.http form (no scheme): 'localhost:P'."""
        return f"localhost:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def to_json(self) -> dict:
        return {
            "grpc_port": self.grpc_port,
            "http_port": self.http_port,
            "metrics_port": self.metrics_port,
            "redis_port": self.redis_port,
            "grpc_url": self.grpc_url,
            "http_url": self.http_url,
            "metrics_url": self.metrics_url,
            "redis_url": redact_url(self.redis_url),  # readable by others: no credentials
            "pids": self.pids,
            "create_times": self.create_times,
            "run_dir": str(self.run_dir),
            "triton_log": str(self.triton_log),
            "redis_log": str(self.redis_log) if self.redis_log else None,
            "tenant_secret_file": str(self.tenant_secret_file) if self.tenant_secret_file else None,
        }

    @classmethod
    def from_json(cls, data: dict) -> Stack:
        return cls(
            grpc_port=data["grpc_port"],
            http_port=data["http_port"],
            metrics_port=data["metrics_port"],
            redis_port=data.get("redis_port"),
            redis_url=data["redis_url"],
            pids={k: int(v) for k, v in data["pids"].items()},
            run_dir=Path(data["run_dir"]),
            triton_log=Path(data["triton_log"]),
            redis_log=Path(data["redis_log"]) if data.get("redis_log") else None,
            create_times={k: float(v) for k, v in data.get("create_times", {}).items()},
            tenant_secret_file=Path(data["tenant_secret_file"]) if data.get("tenant_secret_file") else None,
        )

    @property
    def drain_file(self) -> Path:
        """The marker that makes the scheduler step refuse new requests (scheduler/drain.py)."""
        return self.run_dir / DRAIN_FILE

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Refuse new requests and wait until the engine holds none; True once idle. SIGTERM with streams
        in flight would cut them off, so `stop` drains first."""
        from client.metrics import holds_requests, scrape_metrics  # tritonclient: imported only when stopping

        self.drain_file.touch()
        deadline = time.monotonic() + timeout_s
        idle_scrapes = 0
        while True:
            try:
                metrics = scrape_metrics(self.metrics_url, timeout=5)
            except (OSError, ValueError):
                return False  # no server to drain
            # idle on 3 scrapes in a row: a stream's last windows pass between the engine and the
            # detokenizer, where for a moment nothing may be counted
            idle_scrapes = 0 if holds_requests(metrics) else idle_scrapes + 1
            if idle_scrapes >= 3:
                return True
            if time.monotonic() >= deadline:
                log(f"drain: requests still in flight after {timeout_s:g} s; stopping anyway")
                return False
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0, drain_timeout_s: float = 30.0) -> None:
        """Drain (see `drain`), then SIGTERM tritonserver (it unloads models), then Redis; SIGKILL
        whatever outlives the timeout."""
        if drain_timeout_s > 0 and self._running("tritonserver"):
            self.drain(drain_timeout_s)  # only our server: another may hold a stale record's port now
        for name in ("tritonserver", "redis"):
            if name in self.pids:
                _terminate(
                    self.pids[name],
                    self.create_times.get(name),
                    self._procs.get(name),
                    timeout_s,
                    name,
                    unloaded=_stubs_gone if name == "tritonserver" else None,
                )
        path = self.run_dir / STACK_FILE
        if path.exists():
            try:
                if json.loads(path.read_text()).get("pids") == self.pids:
                    path.unlink()
            except (OSError, ValueError):
                pass
        self.drain_file.unlink(missing_ok=True)
        if self.tenant_secret_file is not None:
            self.tenant_secret_file.unlink(missing_ok=True)

    def _running(self, name: str) -> bool:
        """Whether the recorded process `name` still runs (and is that process, not a reused pid)."""
        if name not in self.pids:
            return False
        proc = self._procs.get(name)
        if proc is not None:
            return proc.poll() is None
        return same_process(self.pids[name], self.create_times.get(name))

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _create_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def _stubs_gone(pid: int) -> bool | None:
    """Whether tritonserver `pid` has no Python-backend stub left (every Python model unloaded); None
    when that cannot be told (no psutil, or no such process)."""
    try:
        import psutil

        children = psutil.Process(pid).children(recursive=True)
        return not any(_is_live_stub(child) for child in children)
    except Exception:  # ImportError, psutil.NoSuchProcess, AccessDenied
        return None


def _is_live_stub(process) -> bool:
    """A Python-backend stub that has not exited (the kernel's name is cut to 15 characters: the command
    line decides)."""
    try:
        if process.status() == "zombie":
            return False
        command = process.cmdline()
        return bool(command) and Path(command[0]).name == "triton_python_backend_stub"
    except Exception:  # psutil.NoSuchProcess: it exited meanwhile
        return False


def _terminate(
    pid: int,
    create_time: float | None,
    proc: subprocess.Popen | None,
    timeout_s: float,
    name: str,
    unloaded: Callable[[int], bool | None] | None = None,
    unloaded_grace_s: float = 3.0,
):
    """SIGTERM, then SIGKILL to the process group after `timeout_s`, or as soon as `unloaded(pid)` has
    held for `unloaded_grace_s`. The latter is for tritonserver: a client that keeps an idle gRPC stream
    open holds the ensemble (which has no state of its own) live, and the server then waits out its whole
    exit timeout after every Python model, engine included, has unloaded and flushed. The grace is 3 s:
    with no such client the server exits by itself at its next once-a-second check of what is still live
    (a 1 s grace raced that check and killed servers about to exit)."""
    if proc is not None:
        if proc.poll() is not None:
            return
    elif not same_process(pid, create_time):
        return
    log(f"stopping {name} (pid {pid})")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    started = time.monotonic()
    unloaded_since: float | None = None
    while (now := time.monotonic()) < started + timeout_s:
        if proc is not None:
            if proc.poll() is not None:
                return
        elif not same_process(pid, create_time):
            return
        if unloaded is not None and unloaded(pid):
            unloaded_since = now if unloaded_since is None else unloaded_since
            if now - unloaded_since >= unloaded_grace_s:
                log(
                    f"{name} (pid {pid}): every Python model unloaded {now - started:.1f} s after SIGTERM; "
                    "only idle client streams hold it: SIGKILL to its process group"
                )
                break
        else:
            unloaded_since = None
        time.sleep(0.1)
    else:
        log(f"{name} (pid {pid}) still running after {timeout_s:.0f} s; SIGKILL to its process group")
    try:
        os.killpg(pid, signal.SIGKILL)  # started with start_new_session: pgid == pid; takes the stubs too
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: Path | None, n: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=n))


def _listens_on(pid: int, port: int) -> bool | None:
    """Whether process pid holds a listening socket on port (None when it cannot be told)."""
    try:
        import psutil

        conns = psutil.Process(pid).net_connections(kind="inet")
    except ImportError:
        return None
    except Exception:
        return None
    return any(c.status == "LISTEN" and c.laddr and c.laddr.port == port for c in conns)


PTH_NAME = "triton_warm_llm_repo.pth"


def ensure_repo_importable(python: str, repo_root: Path) -> Path | None:
    """Make ``repo_root`` importable by ``python`` through a .pth file in its site-packages.

    The Python backend stub runs an embedded interpreter that ignores PYTHONPATH (seen with Triton
    2.51), but it does process ``.pth`` files of the environment whose ``python3`` it finds on PATH (or of
    EXECUTION_ENV_PATH). Returns the .pth path (None if it could not be written).
    """
    try:
        purelib = subprocess.run(
            [python, "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        log(f"warning: cannot ask {python} for its site-packages ({e}); the models may not import the repo")
        return None
    pth = Path(purelib) / PTH_NAME
    want = f"{repo_root}\n"
    try:
        if not pth.exists() or pth.read_text() != want:
            pth.write_text(want)
            log(f"wrote {pth} -> {repo_root}")
    except OSError as e:
        log(f"warning: cannot write {pth} ({e}); the models may not import the repo")
        return None
    return pth


def stop_run_dir(run_dir: Path | str, timeout_s: float = 30.0) -> bool:
    """Stop the stack recorded in <run_dir>/stack.json; True if there was one."""
    path = Path(run_dir) / STACK_FILE
    if not path.exists():
        return False
    try:
        stack = Stack.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or JSON of another shape
        log(f"ignoring unreadable {path}: {e}")
        path.unlink()
        return False
    stack.stop(timeout_s)
    path.unlink(missing_ok=True)
    return True


def _start_redis(opts: StackOptions, run_dir: Path, port: int) -> tuple[subprocess.Popen, Path]:
    return start_redis_server(opts.redis_server, run_dir, port, opts.redis_maxmemory)


def start_redis_server(
    binary: str, run_dir: Path, port: int, maxmemory: str | None = None
) -> tuple[subprocess.Popen, Path]:
    """A redis-server of our own (no persistence) on `port`, returned once it answers as that process.
    Bounded: at `maxmemory` (Redis units, "0": unbounded; None: `default_redis_maxmemory`) it evicts the
    least recently used cache values (those with a TTL) instead of refusing writes or growing until the
    host runs out."""
    maxmemory = maxmemory or default_redis_maxmemory()
    exe = shutil.which(binary)
    if exe is None:
        raise StackError(f"{binary} not found; run `make setup` (apt-get install redis-server)")
    redis_log = run_dir / "redis.log"
    cmd = [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--dir",
        str(run_dir),
        "--maxmemory",
        maxmemory,
        "--maxmemory-policy",
        REDIS_POLICY,
    ]
    log(f"starting redis-server on port {port} (maxmemory {maxmemory}, {REDIS_POLICY}; log {redis_log})")
    with open(redis_log, "ab") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    import redis

    client = redis.Redis(host="localhost", port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise StackError(
                f"redis-server exited with code {proc.returncode}; last lines of {redis_log}:\n"
                + _tail(redis_log)
            )
        try:
            info = client.info("server")
            if int(info["process_id"]) != proc.pid:
                proc.kill()
                raise StackError(f"port {port} is answered by another redis (pid {info['process_id']})")
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise StackError("redis-server did not answer within 30 s:\n" + _tail(redis_log)) from None
            time.sleep(0.05)
    client.close()
    return proc, redis_log


def start_stack(opts: StackOptions) -> Stack:
    """Start Redis (unless opts.start_redis is False) and tritonserver; return once 'llm' is ready."""
    t0 = time.monotonic()
    repo_root = Path(opts.repo_root).resolve()
    run_dir = Path(opts.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if stop_run_dir(run_dir):
        log(f"stopped the previous stack of {run_dir}")
    model_dir = Path(opts.model_dir).resolve()
    if not (model_dir / "config.json").exists():
        log(f"warning: {model_dir} has no config.json (run `make model`)")
    src_repo = Path(opts.model_repository or repo_root / "model_repository")
    tritonserver = opts.tritonserver or _default_tritonserver()
    backend_dir = opts.backend_dir or _default_backend_dir()
    if not Path(tritonserver).is_file():
        raise StackError(f"tritonserver not found at {tritonserver}; run `make setup`")
    if not os.access(tritonserver, os.X_OK):
        raise StackError(f"tritonserver at {tritonserver} is not executable; run `make setup`")

    ports = _free_ports(4)
    grpc_port = opts.grpc_port or ports[0]
    http_port = opts.http_port or ports[1]
    metrics_port = opts.metrics_port or ports[2]

    redis_proc = None
    redis_log = None
    redis_port = None
    procs: dict[str, subprocess.Popen] = {}
    secret_file: Path | None = None
    try:
        if opts.start_redis:
            redis_port = opts.redis_port or ports[3]
            redis_proc, redis_log = _start_redis(opts, run_dir, redis_port)
            procs["redis"] = redis_proc
            redis_url = f"redis://localhost:{redis_port}/0"
        else:
            redis_url = opts.redis_url or os.environ.get("REDIS_URL", "")
            if not redis_url:
                raise StackError("start_redis is off: give redis_url (--redis-url)")

        overrides: dict[str, dict[str, str]] = {"*": {"model_dir": str(model_dir), "redis_url": redis_url}}
        models = sorted(p.parent.name for p in src_repo.glob("*/config.pbtxt"))
        missing = [m for m in opts.ready_models if m not in models]
        if missing:
            raise StackError(f"model(s) {missing} to wait for are not in {src_repo} (it has {models})")
        if opts.warmup is not None and ENGINE_MODEL in models:
            overrides[ENGINE_MODEL] = {"warmup": "true" if opts.warmup else "false"}
        for model, params in opts.overrides.items():
            overrides.setdefault(model, {}).update({k: str(v) for k, v in params.items()})
        rendered = render_repository(
            src_repo,
            run_dir / "model_repository",
            overrides,
            opts.text_env,
            strip_model_warmup=opts.warmup is False,
        )
        log(f"rendered {len(models)} models {models} into {rendered}")

        env = dict(os.environ)
        libs = opts.triton_libs if opts.triton_libs is not None else _default_triton_libs()
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (libs, env.get("LD_LIBRARY_PATH", "")) if p)
        venv_bin = repo_root / ".venv" / "bin"
        if venv_bin.is_dir():  # the Python backend stub runs `python3` from PATH
            env["PATH"] = f"{venv_bin}:{env.get('PATH', '')}"
        env["PYTHONPATH"] = ":".join(p for p in (str(repo_root), env.get("PYTHONPATH", "")) if p)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["LLM_DRAIN_FILE"] = str(run_dir / DRAIN_FILE)  # per stack: a stop drains this one only
        (run_dir / DRAIN_FILE).unlink(missing_ok=True)  # a stale marker would refuse every request
        env.update(opts.extra_env)
        secret_file = provide_tenant_secret(run_dir, env)  # removed again if the start fails
        if secret_file is not None:
            log(
                f"tenants: no {SECRET_ENV}, so this stack signs with a secret of its own ({secret_file}; the "
                f"client tools read it); give {SECRET_ENV} to share one across replicas"
            )
        if opts.repo_pth:
            stub_python = shutil.which("python3", path=env.get("PATH"))
            for py in [
                stub_python,
                *([str(Path(opts.text_env) / "bin" / "python3")] if opts.text_env else []),
            ]:
                if py:
                    ensure_repo_importable(py, repo_root)

        triton_log = run_dir / "tritonserver.log"
        cmd = [
            tritonserver,
            f"--model-repository={rendered}",
            f"--backend-directory={backend_dir}",
            f"--grpc-port={grpc_port}",
            f"--http-port={http_port}",
            f"--metrics-port={metrics_port}",
            f"--log-verbose={opts.log_verbose}",
            # explicit control so `python -m client warmup --rewarm` can reload (and so re-warm) the engine
            "--model-control-mode=explicit",
            "--load-model=*",
            *opts.extra_args,
        ]
        log(
            f"starting tritonserver (grpc {grpc_port}, http {http_port}, metrics {metrics_port}; "
            f"log {triton_log})"
        )
        with open(triton_log, "ab") as f:
            f.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            f.flush()
            triton = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(run_dir),
                start_new_session=True,
            )
        procs["tritonserver"] = triton
        pids = {name: p.pid for name, p in procs.items()}
        stack = Stack(
            grpc_port,
            http_port,
            metrics_port,
            redis_port,
            redis_url,
            pids,
            run_dir,
            triton_log,
            redis_log,
            {n: t for n, p in pids.items() if (t := _create_time(p)) is not None},
            extra_env=dict(opts.extra_env),
            tenant_secret_file=secret_file,
            tenant_secret=env.get(SECRET_ENV) or None,
            _procs=procs,
        )
        # recorded at once, so `deploy.stop` can clean up even while models are still loading
        (run_dir / STACK_FILE).write_text(json.dumps(stack.to_json(), indent=2) + "\n")
        _wait_ready(stack, triton, opts)
        if opts.prime and opts.warmup is not False and PRIME_MODEL in opts.ready_models:
            _prime(stack)
    except BaseException:
        for name in ("tritonserver", "redis"):
            if name in procs:
                _terminate(procs[name].pid, None, procs[name], 10.0, name)
        (run_dir / STACK_FILE).unlink(missing_ok=True)
        if secret_file is not None:
            secret_file.unlink(missing_ok=True)
        raise
    log(
        f"ready in {time.monotonic() - t0:.1f} s: grpc {stack.grpc_url}, http {stack.http_url}, "
        f"metrics {stack.metrics_url}, redis {redact_url(stack.redis_url)}"
    )
    return stack


def _prime(stack: Stack) -> None:
    """The serving path's first requests, sent here rather than by the first clients; a failure is
    logged, not raised (the replica serves, only its first requests may be slower)."""
    try:
        from client.prime import PRIME_TENANT, PrimeConfig, prime  # tritonclient: imported only when priming
        from scheduler.tenant_auth import token_from_env
    except ImportError as exc:
        log(f"warning: not priming {PRIME_MODEL}: {exc}")
        return
    token = token_from_env(PRIME_TENANT, {SECRET_ENV: stack.tenant_secret or ""})  # the server's, if any
    result = prime(PrimeConfig(url=stack.grpc_url, model=PRIME_MODEL, tenant_token=token))
    if result.ok:
        log(f"primed {PRIME_MODEL}: {result.requests} requests in {result.seconds * 1000:.0f} ms")
    else:
        failed = f"{result.failed}/{result.requests}"
        log(f"warning: priming {PRIME_MODEL} failed for {failed} requests: {result.errors[:3]}")


def http_ready(http_port: int, path: str = "/v2/health/ready", timeout: float = 2.0) -> bool:
    """True if Triton's HTTP health API answers 200 on ``path`` (KServe v2: /v2/health/ready,
    /v2/models/<name>/ready). Plain urllib, so it needs neither tritonclient[http] nor gevent."""
    try:
        with urllib.request.urlopen(f"http://localhost:{http_port}{path}", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):  # HTTPError (400 = not ready) is a URLError
        return False


def _wait_ready(stack: Stack, triton: subprocess.Popen, opts: StackOptions) -> None:
    t0 = time.monotonic()
    next_note = t0 + 10
    paths = ["/v2/health/ready", *(f"/v2/models/{m}/ready" for m in opts.ready_models)]
    while True:
        if triton.poll() is not None:
            raise StackError(
                f"tritonserver exited with code {triton.returncode} before it was ready; "
                f"last {LOG_TAIL_LINES} lines of {stack.triton_log}:\n{_tail(stack.triton_log)}"
            )
        if all(http_ready(stack.http_port, p) for p in paths):
            break
        now = time.monotonic()
        if not now - t0 <= opts.ready_timeout_s:  # NaN: given up on, never waited on for good
            raise StackError(
                f"tritonserver not ready after {opts.ready_timeout_s:.0f} s; last "
                f"{LOG_TAIL_LINES} lines of {stack.triton_log}:\n{_tail(stack.triton_log)}"
            )
        if now >= next_note:
            log(f"waiting for the server and models {list(opts.ready_models)} ({now - t0:.0f} s)")
            next_note = now + 10
        time.sleep(0.2)
    # a busy port would mean another server answered: make sure the listener is our process
    for port in (stack.http_port, stack.grpc_port):
        owned = _listens_on(triton.pid, port)
        if owned is False:
            raise StackError(
                f"port {port} is answered by a process other than our tritonserver "
                f"(pid {triton.pid}); another server holds it"
            )


# --------------------------------------------------------------------------------------------- CLI


def _parse_param(spec: str) -> tuple[str, str, str]:
    model_key, sep, value = spec.partition("=")
    model, dot, key = model_key.partition(".")
    if not sep or not dot or not model or not key:
        raise argparse.ArgumentTypeError(f"--param {spec!r}: expected model.key=value (model may be '*')")
    return model, key, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.launch", description="Start Redis + tritonserver.")
    ap.add_argument(
        "--warmup",
        choices=["on", "off"],
        default=None,
        help="engine warmup in initialize() (default: the model config's); off also skips priming",
    )
    ap.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    ap.add_argument("--foreground", action="store_true", help="stay attached until Ctrl-C / SIGTERM")
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        type=_parse_param,
        metavar="MODEL.KEY=VALUE",
        help="set a model parameter in the rendered config.pbtxt (repeatable; MODEL may be '*')",
    )
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="HF checkpoint directory")
    ap.add_argument("--model-repository", type=Path, default=None, help="default: <repo>/model_repository")
    ap.add_argument(
        "--text-env",
        type=Path,
        default=os.environ.get("TEXT_ENV") or None,
        help="numpy<2 venv for the BYTES models (EXECUTION_ENV_PATH; default $TEXT_ENV)",
    )
    ap.add_argument("--no-redis", action="store_true", help="do not start redis-server; use --redis-url")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument(
        "--redis-maxmemory",
        default=None,
        help=f"memory bound of the Redis started here, e.g. 8gb (default {REDIS_MEMORY_SHARE:.0%}% of the "
        f"host memory available; 0: unbounded); at it the least recently used cache values go "
        f"({REDIS_POLICY})",
    )
    ap.add_argument("--tritonserver", default=None, help="default: $TRITONSERVER or .tools/")
    ap.add_argument("--backend-dir", default=None, help="default: $TRITON_BACKENDS or .tools/")
    ap.add_argument("--grpc-port", type=int, default=0, help="0 = a free port")
    ap.add_argument("--http-port", type=int, default=0)
    ap.add_argument("--metrics-port", type=int, default=0)
    ap.add_argument("--ready-model", action="append", default=None, help="models to wait for (default llm)")
    ap.add_argument("--timeout", type=seconds, default=300.0, help="readiness timeout in seconds")
    ap.add_argument("--log-verbose", type=int, default=0)
    ap.add_argument(
        "--no-prime", action="store_true", help="report the stack up without priming (client/prime.py)"
    )
    a = ap.parse_args(argv)

    overrides: dict[str, dict[str, str]] = {}
    for model, key, value in a.param:
        overrides.setdefault(model, {})[key] = value
    opts = StackOptions(
        run_dir=a.run_dir,
        model_dir=a.model_dir,
        model_repository=a.model_repository,
        overrides=overrides,
        text_env=a.text_env,
        warmup=None if a.warmup is None else a.warmup == "on",
        start_redis=not a.no_redis,
        redis_url=a.redis_url,
        redis_maxmemory=a.redis_maxmemory,
        tritonserver=a.tritonserver,
        backend_dir=a.backend_dir,
        grpc_port=a.grpc_port,
        http_port=a.http_port,
        metrics_port=a.metrics_port,
        ready_models=tuple(a.ready_model or ("llm",)),
        ready_timeout_s=a.timeout,
        log_verbose=a.log_verbose,
        prime=not a.no_prime,
    )
    try:
        stack = start_stack(opts)
    except (StackError, ValueError, OSError) as e:  # OSError: a run dir that cannot be made or written
        print(f"[launch] error: {e}", file=sys.stderr)
        return 1
    if not a.foreground:
        log(f"running detached; stop with: python -m deploy.stop --run-dir {a.run_dir}")
        return 0

    def _on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    log("foreground: Ctrl-C (or SIGTERM) stops the stack")
    rc = 0
    try:
        while True:
            triton = stack._procs["tritonserver"]
            if triton.poll() is not None:
                log(f"tritonserver exited with code {triton.returncode}:\n{_tail(stack.triton_log)}")
                rc = 1
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        log("stopping")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stack.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
