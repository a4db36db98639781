"""GPU memory as a Ray resource that Ray places by and vramd enforces (docs/ray.md).

Each node's Ray is started with the memory its daemon can guarantee (`vramd ray-resources`
prints the `--resources` JSON). A task or actor asks for memory with `options`; Ray places it on
a node with that much left, and the worker that runs it becomes a tenant of that node's daemon,
with the memory as its guarantee and `limit` as its limit, before the user's code runs:

    import ray, vramd.ray

    @ray.remote(**vramd.ray.options(memory="20GiB", limit="24GiB"))
    def step(batch): ...                     # each call: its own tenant, ended when it returns

    @ray.remote(**vramd.ray.options(memory="8GiB"))
    class Server: ...                        # the actor's tenant lives as long as the actor

    step.options(**vramd.ray.options(memory="30GiB")).remote(b)   # another ask for one call

How: `options` returns Ray's `resources` and a `runtime_env` whose `env_vars` carry the ask in
libvram.so's own variables and name `setup_worker` as the worker's setup hook. Ray starts the
workers of each runtime environment apart from all others, with those variables, and runs the
hook in each before it takes its first task. The hook has every task on that worker run
`task_tenant` (the tenant `ray-task-<task id>`, ended when the call returns, so that a reused
worker carries nothing into its next task) and every actor's constructor run as the tenant
`ray-actor-<actor id>`, which ends with the actor's process (ray.kill, a crash).

`become_tenant` is what the worker runs for each of them; it works in any Python process.
"""

import contextlib
import gc
import os
import sys

from . import VramdError, _tenant_ends, connect, parse_size
from . import _lib

__all__ = [
    "RESOURCE",
    "become_tenant",
    "end_tenant",
    "options",
    "remote",
    "setup_worker",
    "task_tenant",
]

# The custom resource, in whole MiB (see `vramd ray-resources` for why MiB).
RESOURCE = "vramd_memory_mib"
MIB = 1 << 20

# libvram.so's variables (vram_proto::env) that carry the ask to the worker, named here only.
GUARANTEE_VAR = "VRAMD_GUARANTEE"
LIMIT_VAR = "VRAMD_LIMIT"
CLASS_VAR = "VRAMD_CLASS"
GPU_VAR = "VRAMD_GPU"
TORCH_MODE_VAR = "VRAMD_TORCH_MODE"
LIB_VAR = "VRAMD_LIB"

# What Ray's worker imports and calls as its setup hook (`module.function`).
HOOK = f"{__name__}.setup_worker"


def _hook_variable():
    """The variable through which Ray hands a worker its setup hook. Ray sets it from
    `ray.init(runtime_env={"worker_process_setup_hook": ...})` only, for the whole job; its
    worker (default_worker.py) runs whatever it names, so a task's or actor's runtime_env that
    sets it gets the hook in its own workers."""
    from ray._private import ray_constants

    return ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR


def options(memory, limit=None, priority=None, gpu=None, torch_mode="full", preload=True, **ray_options):
    """Ray options (`resources` and `runtime_env`) for a task or actor that asks for `memory`
    (its guarantee, what Ray places by) and may grow to `limit` (default: `memory`), in class
    `priority`, on the daemon's device `gpu` (default 0), for `@ray.remote(**...)` or
    `.options(**...)` on any Ray function or class.

    As under `vramd run`: `torch_mode` ("full", the default, or "pool"; None leaves PyTorch
    alone) installs vramd's allocator into PyTorch when the worker imports torch, and `preload`
    preloads libvram.so into the worker (`LD_PRELOAD`, with `VRAMD_LIB` naming the same file: the
    path this process finds, which must be the same on every node). Pool mode needs the preload.

    Any other Ray option passes through; a `runtime_env` of the caller's is merged with ours
    (its `env_vars` key by key)."""
    guarantee = parse_size(memory)
    if guarantee == 0:
        # Ray places by the guarantee, and only a task Ray gave vramd's resource becomes a tenant:
        # with none, the limit would be asked of no one.
        raise ValueError(
            "vramd: memory=0 asks Ray for none of vramd's resource, so the task would not become a "
            "tenant of its own; ask for the memory it needs (its guarantee), at least 1 MiB"
        )
    cap = guarantee if limit is None else parse_size(limit)
    if cap < guarantee:
        raise ValueError(f"vramd: the limit ({limit}) is below the memory asked for ({memory})")
    if torch_mode not in (None, "full", "pool"):
        raise ValueError(f"vramd: unknown torch mode `{torch_mode}` (full or pool)")
    if torch_mode == "pool" and not preload:
        raise ValueError("vramd: torch_mode='pool' needs preload=True (libvram.so's cudaMalloc)")
    env = {GUARANTEE_VAR: str(guarantee), LIMIT_VAR: str(cap), _hook_variable(): HOOK}
    if priority:
        env[CLASS_VAR] = str(priority)
    if gpu is not None:
        env[GPU_VAR] = str(int(gpu))
    if torch_mode:
        env[TORCH_MODE_VAR] = torch_mode
    if preload:
        path = _lib.path()
        # Ray expands ${VAR} from the node's environment: whatever the node preloads stays.
        env["LD_PRELOAD"] = f"{path}:${{LD_PRELOAD}}"
        env[LIB_VAR] = path
    resources = {RESOURCE: -(-guarantee // MIB)}
    return _merge({"resources": resources, "runtime_env": {"env_vars": env}}, ray_options)


def _merge(ours, theirs):
    """Ray options: the caller's on top of ours, runtime_env and resources merged key by key. A
    runtime_env or resources of None (a wrapper passing on an argument it was not given) leaves
    ours: without them the task would not become a tenant."""
    out = dict(ours)
    for k, v in theirs.items():
        if k in ("resources", "runtime_env") and v is None:
            continue
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


def remote(memory, limit=None, priority=None, gpu=None, torch_mode="full", preload=True, **ray_options):
    """`ray.remote(**options(...))`: a decorator for a function or class that asks for memory."""
    import ray

    return ray.remote(**options(memory, limit, priority, gpu, torch_mode, preload, **ray_options))


def become_tenant(name=None, memory=None, limit=None, priority=None, gpu=None, torch_mode=None, socket=None):
    """Makes this process the tenant `name` of its node's daemon and sets PyTorch up as
    `vramd run` does; returns the `vramd.Tenant`. What Ray's worker runs before each task or
    actor of `options`; in plain Python it is the same:

        VRAMD_TORCH_MODE=full python3 -c 'import vramd.ray; t = vramd.ray.become_tenant(
            "check", memory="2GiB", limit="4GiB"); import torch; ...'

    Each argument left out is read from libvram.so's variables (VRAMD_GUARANTEE, VRAMD_LIMIT,
    VRAMD_GPU, ..., VRAMD_TORCH_MODE), then the defaults. `torch_mode` ("full" or "pool")
    installs vramd's allocator into PyTorch now if torch is imported, else when it is; pool mode
    needs the process started with libvram.so preloaded (LD_PRELOAD) and VRAMD_TORCH_MODE=pool,
    and says so (RuntimeError) before connecting. VramdError with the daemon's reason when
    it does not admit the tenant."""
    mode = torch_mode or os.environ.get(TORCH_MODE_VAR)
    if mode not in (None, "", "full", "pool"):
        raise ValueError(f"vramd: unknown torch mode `{mode}` (full or pool)")
    if mode == "pool" and not _lib.lib().vram_interposing():
        raise RuntimeError(
            f"vramd: pool mode needs the process started with LD_PRELOAD={_lib.path()} and "
            f"{TORCH_MODE_VAR}=pool, so that the CUDA runtime's cudaMalloc is vramd's"
        )
    tenant = connect(name=name, guarantee=memory, limit=limit, priority=priority, gpu=gpu, socket=socket)
    if mode:
        from vramd_torch import _hook

        _hook.install_on_import(mode)
    return tenant


def end_tenant(tenant):
    """Ends a tenant from `become_tenant`: what the program dropped is collected first (and,
    when vramd's allocator is installed, PyTorch's cuBLAS workspaces and idle cache let go of:
    a task's matmul leaves a workspace allocated per stream, which the next task would otherwise
    find held by this tenant), then everything goes back to the daemon. VramdError, the tenant
    left as it is, while memory is still allocated: with libvram.so preloaded that includes what
    libraries took with cudaMalloc for the life of the process (cuBLAS's own buffers, docs/ray.md)."""
    try:
        _let_go()
    finally:
        # Also after a CUDA error (a failed kernel makes synchronize raise): the tenant ends,
        # or says what it still holds.
        tenant.close()


# A task that ended holding memory leaves its tenant connected; no later task on this worker may
# inherit it, so the worker leaves instead of running the next one (Ray runs it on a fresh one).
_leftover = None

# The ask this worker's runtime_env carries (the variables `options` sets), taken out of the
# environment when the worker starts (`setup_worker`). Ray passes a runtime_env on to the tasks
# and actors a task starts, which asked for nothing and had nothing reserved: only a task or
# actor that Ray gave vramd's resource becomes a tenant with the ask, and nothing else in the
# worker (such a child task, a subprocess, libvram.so's first use) finds a guarantee that is not
# its own in the environment.
_ask = {}
_ASK_VARS = (GUARANTEE_VAR, LIMIT_VAR, CLASS_VAR)


def _asked(ray):
    """Whether Ray gave the running task or actor vramd's resource."""
    return ray.get_runtime_context().get_assigned_resources().get(RESOURCE, 0) > 0


def _become_asked(name):
    """`become_tenant(name)` with this worker's ask (see `_ask`)."""
    return become_tenant(
        name,
        memory=_ask.get(GUARANTEE_VAR),
        limit=_ask.get(LIMIT_VAR),
        priority=_ask.get(CLASS_VAR),
    )


def _exit_if_leftover(name):
    if _leftover is not None:
        _exit(f"it still holds memory of tenant `{_leftover}` ({name} cannot start under it)")


def _exit(why):
    print(
        f"vramd: this worker exits so that nothing carries into the next task: {why}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _let_go():
    """What the program dropped is collected, and PyTorch's cuBLAS workspaces and idle cache
    let go of where vramd's allocator is installed (see `end_tenant`)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None:
        import vramd_torch

        if vramd_torch.installed() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            clear = getattr(getattr(torch, "_C", None), "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()


def _end_other_tenant(name):
    """Before `name` starts: a tenant this worker became outside any task's ask (libvram.so's
    first use, in a task or thread that asked for nothing) is ended, or the worker exits."""
    lib = _lib.lib()
    # No tenant (the usual case) ends at once; one still holding memory first lets go of what
    # the program dropped and PyTorch's cache.
    if lib.vram_disconnect() != 0:
        try:
            _let_go()
        except BaseException as e:
            print(f"{e}", file=sys.stderr)
        if lib.vram_disconnect() != 0:
            _exit(f"{_lib.last_error()} ({name} cannot start under it)")
    # A `vramd.Tenant` of the ended tenant speaks for it no more.
    _tenant_ends()


@contextlib.contextmanager
def task_tenant(name):
    """The body of the block runs as the tenant `name`, ended at its end (see `end_tenant`). A
    task that ends holding memory fails with vramd's reason (or, if it failed already, its own
    error stands and vramd's is printed); the tenant stays, and the next `task_tenant` in this
    process exits the process rather than run anything under it."""
    global _leftover
    _exit_if_leftover(name)
    _end_other_tenant(name)
    tenant = _become_asked(name)
    try:
        yield tenant
    except BaseException:
        try:
            end_tenant(tenant)
        except BaseException as e:
            if not tenant._closed:
                _leftover = name
            print(f"{e}", file=sys.stderr)
        raise
    try:
        end_tenant(tenant)
    except BaseException:
        if not tenant._closed:
            _leftover = name
        raise


def _for_task(fn):
    """`fn` run under `task_tenant("ray-task-<task id>")`; a generator function stays one, its
    tenant lasting until the generator is done (Ray's streaming and dynamic returns run it after
    the call returned)."""
    import inspect

    import ray

    name = lambda: f"ray-task-{ray.get_runtime_context().get_task_id()}"
    if inspect.isgeneratorfunction(fn):

        def run(*args, **kwargs):
            if not _asked(ray):
                if _leftover is not None:
                    _exit_if_leftover(name())
                yield from fn(*args, **kwargs)
                return
            with task_tenant(name()):
                yield from fn(*args, **kwargs)

    else:

        def run(*args, **kwargs):
            if not _asked(ray):
                if _leftover is not None:
                    _exit_if_leftover(name())
                return fn(*args, **kwargs)
            with task_tenant(name()):
                return fn(*args, **kwargs)

    return _like(run, fn)


def _for_actor_creation(init):
    """The actor's constructor run as the tenant `ray-actor-<actor id>`, which stays for the
    actor's life: the daemon takes it back when the process ends."""
    import ray

    def run(*args, **kwargs):
        if _asked(ray):
            name = f"ray-actor-{ray.get_runtime_context().get_actor_id()}"
            _exit_if_leftover(name)
            _end_other_tenant(name)
            _become_asked(name)
        return init(*args, **kwargs)

    return _like(run, init)


def _like(wrapper, fn):
    """Ray reads a few attributes off what it runs (an actor method's `name` and `method`, which
    say whether it is async): the wrapper keeps them."""
    for attr in ("__name__", "__qualname__", "__doc__", "__module__", "name", "method"):
        if hasattr(fn, attr):
            setattr(wrapper, attr, getattr(fn, attr))
    return wrapper


def setup_worker():
    """Ray's setup hook in the workers of `options` (named by the runtime_env `options` returns):
    has each task that Ray gave vramd's resource run as a tenant of its own and each such actor's
    constructor as the actor's tenant; takes the ask out of the environment (see `_ask`). Does
    nothing in a worker without an ask (VRAMD_GUARANTEE unset), so it may also be the job's
    `worker_process_setup_hook`.

    Ray has no per-task hook: this wraps what the worker's function manager hands to Ray's task
    loop for each function (FunctionActorManager.get_execution_info, Ray 2.60), so a Ray without
    it fails here, in every such worker, with this message, rather than run tasks unenforced."""
    if not os.environ.get(GUARANTEE_VAR):
        return
    global _ask
    _ask = {var: os.environ.pop(var) for var in _ASK_VARS if var in os.environ}
    import ray

    _run_job_hook(ray)
    manager = ray._private.worker.global_worker.function_actor_manager
    original = getattr(manager, "get_execution_info", None)
    if original is None:
        raise RuntimeError(
            f"vramd: Ray {ray.__version__} has no FunctionActorManager.get_execution_info; "
            "vramd.ray cannot set each task's tenant up in this worker"
        )
    if getattr(original, "vramd", False):
        return

    def get_execution_info(job_id, function_descriptor):
        info = original(job_id, function_descriptor)
        if not function_descriptor.class_name:
            return info._replace(function=_for_task(info.function))
        if info.function_name == "__init__":
            return info._replace(function=_for_actor_creation(info.function))
        return info

    get_execution_info.vramd = True
    manager.get_execution_info = get_execution_info


def _run_job_hook(ray):
    """Runs the job's own setup hook (`ray.init(runtime_env={"worker_process_setup_hook": ...})`),
    which Ray would have run here had the ask's runtime_env not named ours in its place (a task's
    env_vars override the job's key by key)."""
    import json

    from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook

    job = ray._private.worker.global_worker.core_worker.get_job_config()
    env = json.loads(job.runtime_env_info.serialized_runtime_env or "{}").get("env_vars") or {}
    theirs = env.get(_hook_variable())
    if theirs and theirs != HOOK:
        error = load_and_execute_setup_hook(theirs)
        if error is not None:
            raise RuntimeError(error)
