"""A Ray cluster of two nodes on loopback for tests: a head and a worker raylet, each started
through deploy/ray/ray-node.sh (`ray start` with the resources its daemon reports) in a session
of its own, with the environment given for it (its own daemon's socket), and stopped by killing
every process of those sessions. Also the helpers the Ray checks share (tests/ray/two_nodes.py and
scripts/h200/ray_gpu.py): a daemon's tenants and held memory, waiting for a condition, the
processes of a session."""

import os
import signal
import socket
import subprocess
import sys
import time


NODE_SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "deploy", "ray", "ray-node.sh"
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, tmp):
        self.tmp = tmp
        self.nodes = []
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def _start(self, name, args, env):
        log = open(os.path.join(self.tmp, f"ray-{name}.log"), "w")
        cmd = [
            NODE_SCRIPT, "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2", "--num-gpus=0",
            "--object-store-memory=100000000",
        ] + args
        p = subprocess.Popen(
            cmd, env={**os.environ, **env, "RAY_USAGE_STATS_ENABLED": "0"},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.nodes.append((name, p))
        return p

    def start_head(self, env):
        self._start("head", [
            "--head", f"--port={self.port}", "--include-dashboard=false",
            f"--temp-dir={os.path.join(self.tmp, 'ray')}",
        ], env)

    def start_worker(self, env):
        self._start("worker", [f"--address={self.address}"], env)

    def wait_nodes(self, ray, n, limit_s=120):
        deadline = time.time() + limit_s
        while time.time() < deadline:
            alive = [x for x in ray.nodes() if x["Alive"]]
            if len(alive) >= n:
                return alive
            for name, p in self.nodes:
                if p.poll() is not None:
                    raise RuntimeError(f"ray start of the {name} exited: {self.log(name)}")
            time.sleep(0.5)
        raise RuntimeError(f"{n} nodes did not come up in {limit_s} s")

    def log(self, name):
        with open(os.path.join(self.tmp, f"ray-{name}.log")) as f:
            return f.read()[-4000:]

    def stop(self):
        """Kills every process of the nodes' sessions (raylets, GCS, workers), by process id."""
        sessions = {p.pid for _, p in self.nodes}
        for _ in range(20):
            pids = pids_in_sessions(sessions)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for _, p in self.nodes:
                if p.poll() is None:
                    try:
                        p.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
            time.sleep(0.2)
        print("warning: Ray processes left running", file=sys.stderr)


def pids_in_sessions(sessions):
    """The processes whose session id is one of `sessions`."""
    return [pid for pid in _pids() if _sid(pid) in sessions]


def _pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _sid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The fields after the command name (which may hold spaces) start after its ')'.
            return int(f.read().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def tenants(sock):
    """The tenants the daemon at `sock` lists, by name."""
    import vramd

    return {t["name"]: t for t in vramd.status(sock)["tenants"]}


def held(sock):
    """What the daemon at `sock` holds for tenants, over its devices."""
    import vramd

    return sum(d["held"] for d in vramd.status(sock)["devices"])


def wait_for(cond, limit_s, step=0.005):
    """Seconds until `cond()` held, or None after `limit_s`."""
    start = time.time()
    while time.time() - start < limit_s:
        if cond():
            return time.time() - start
        time.sleep(step)
    return None
