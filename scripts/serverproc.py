"""Start `specd serve` (or any server with /ready) for a benchmark and wait until it is ready."""
import subprocess
import time

import httpx


def start(cmd, port, log=None, env=None, timeout_s=300):
    """Popen cmd (output to the file log, else discarded) and return the process once
    http://127.0.0.1:port/ready answers 200; raise if it exits or is not ready in time."""
    out = open(log, "w") if log else subprocess.DEVNULL
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            tail = open(log).read()[-2000:] if log else ""
            raise RuntimeError(f"server exited: {tail}")
        time.sleep(0.25)
    p.kill()
    raise RuntimeError("server not ready")
