"""GPU memory as a Ray resource that Ray places by and vramd enforces (docs/ray.md).

Each node's Ray is started with the memory its daemon can guarantee (`vramd ray-resources`
prints the `--resources` JSON). A task or actor asks for memory; Ray places it on a node with
that much left, and the worker that runs it becomes a tenant of that node's daemon, with the
memory as its guarantee and `limit` as its limit, before the user's code runs:

    import vramd.ray

    @vramd.ray.remote(memory="20GiB", limit="24GiB")
    def step(batch): ...                     # each call: its own tenant, ended when it returns

    @vramd.ray.remote(memory="8GiB")
    class Server: ...                        # the actor's tenant lives as long as the actor

    step.options(**vramd.ray.options(memory="30GiB")).remote(b)   # another ask for one call

A task's tenant is named `ray-task-<task id>` and ends when the call returns (everything goes back
to the daemon), so a worker Ray reuses for the next task carries nothing of the last one into it.
An actor's tenant, `ray-actor-<actor id>`, ends with the actor's process (ray.kill, a crash):
the daemon takes its memory back when the connection closes.
"""

import functools
import gc
import inspect
import os
import sys

from . import VramdError, connect, parse_size
from . import _lib

__all__ = ["RESOURCE", "options", "remote"]

# The custom resource, in whole MiB (see `vramd ray-resources` for why MiB).
RESOURCE = "vramd_memory_mib"
MIB = 1 << 20

# The ask travels in the variables libvram.so reads for it (include/vram.h), in the worker's
# runtime_env, so that `.options(**options(...))` changes the ask as it changes the resources.
def options(memory, limit=None, priority=None, gpu=None, torch_mode=None, preload=False):
    """Ray options (`resources` and `runtime_env`) for a task or actor that asks for `memory`
    (its guarantee, what Ray places by) and may grow to `limit` (default: `memory`), in class
    `priority`, on the daemon's device `gpu` (default 0). `torch_mode` ("full" or "pool") installs vramd's allocator into PyTorch when the
    worker imports torch, as `vramd run --torch-mode` does; pool mode needs libvram.so preloaded
    (`preload=True`: the path this process finds, which must be the same on every node)."""
    guarantee = parse_size(memory)
    cap = guarantee if limit is None else parse_size(limit)
    if cap < guarantee:
        raise ValueError(f"vramd: the limit ({limit}) is below the memory asked for ({memory})")
    if torch_mode not in (None, "full", "pool"):
        raise ValueError(f"vramd: unknown torch mode `{torch_mode}` (full or pool)")
    if torch_mode == "pool" and not preload:
        raise ValueError("vramd: torch_mode='pool' needs preload=True (libvram.so's cudaMalloc)")
    env = {"VRAMD_GUARANTEE": str(guarantee), "VRAMD_LIMIT": str(cap)}
    if priority:
        env["VRAMD_CLASS"] = str(priority)
    if gpu is not None:
        env["VRAMD_GPU"] = str(int(gpu))
    if torch_mode:
        env["VRAMD_TORCH_MODE"] = torch_mode
    if preload:
        env["LD_PRELOAD"] = _lib.path()
    resources = {RESOURCE: -(-guarantee // MIB)} if guarantee else {}
    return {"resources": resources, "runtime_env": {"env_vars": env}}


def _merge(ours, theirs):
    """Ray options: the caller's on top of ours, runtime_env and resources merged key by key."""
    out = dict(ours)
    for k, v in theirs.items():
        if k in ("resources", "runtime_env") and isinstance(v, dict):
            merged = dict(out.get(k, {}))
            for kk, vv in v.items():
                if kk == "env_vars":
                    merged[kk] = {**merged.get(kk, {}), **vv}
                else:
                    merged[kk] = vv
            out[k] = merged
        else:
            out[k] = v
    return out


def remote(memory, limit=None, priority=None, gpu=None, torch_mode=None, preload=False, **ray_options):
    """`ray.remote` for a function or class that asks for memory (see `options`); any other
    Ray option (num_cpus, max_retries, ...) passes through."""
    import ray

    opts = _merge(options(memory, limit, priority, gpu, torch_mode, preload), ray_options)

    def wrap(obj):
        if inspect.isclass(obj):
            return ray.remote(**opts)(_actor_class(obj))
        return ray.remote(**opts)(_task_function(obj))

    return wrap


# A task that ended holding memory leaves its tenant connected; the next task on this worker
# must not inherit it, so the worker leaves (Ray runs that task again on a fresh worker).
_leftover = None


def _become(kind, ident):
    """Makes this worker the tenant `ray-KIND-IDENT`, as the runtime_env's variables ask."""
    global _leftover
    if _leftover is not None:
        print(
            f"vramd: this worker still holds memory of tenant `{_leftover}` ({kind} start); "
            "it exits so that nothing carries into the next task",
            file=sys.stderr,
        )
        os._exit(1)
    mode = os.environ.get("VRAMD_TORCH_MODE")
    if mode:
        from vramd_torch import _hook

        _hook.install_on_import(mode)
    return connect(name=f"ray-{kind}-{ident}")


def _end(tenant):
    """Ends a task's tenant: whatever the task dropped is collected first (and PyTorch's idle
    cache emptied), then everything goes back to the daemon."""
    global _leftover
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and os.environ.get("VRAMD_TORCH_MODE"):
        torch.cuda.empty_cache()
    try:
        tenant.close()
    except VramdError:
        _leftover = tenant.stats()["tenant"]
        raise


def _task_function(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        import ray

        tenant = _become("task", ray.get_runtime_context().get_task_id())
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            try:
                _end(tenant)
            except VramdError as e:
                print(f"{e}", file=sys.stderr)
            raise
        _end(tenant)
        return result

    return run


def _actor_class(cls):
    def __init__(self, *args, **kwargs):
        import ray

        _become("actor", ray.get_runtime_context().get_actor_id())
        cls.__init__(self, *args, **kwargs)

    return type(
        cls.__name__,
        (cls,),
        {"__init__": __init__, "__doc__": cls.__doc__, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )
