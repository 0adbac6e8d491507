"""One interpreter that imports torch and Megatron once for the fake-GPU scenarios of a test module, and
runs each scenario in a process forked from it (`tests/test_fake_gpu.py`).

A scenario needs an interpreter where the fake CUDA guard was loaded before torch (`fake_gpu.preload`)
and where torch.cuda answers as a GPU before Megatron is imported (`fake_gpu.patch_torch_cuda`: Megatron
binds some torch.cuda functions at import). Those imports cost ~14 s of a loaded 2-core host per
interpreter, more than most scenarios' own work; the server pays them once. Each scenario still runs in
a process of its own, forked from the server before anything else happens in it: it installs the fake
GPU, its default process group and its patches of Megatron for its own life, and sees nothing of the
other scenarios'.

Protocol, one JSON object a line: the client writes {"id", "scenario", "args", "output"}; the server
forks a child that runs `fake_gpu.run_scenario(scenario, *args)` with stdout and stderr in the file
`output`, and answers {"id", "returncode"} once that child has exited. Requests sent together (the
played ranks of one world) run at once. The server ends when its stdin closes; `FakeGpuServer` kills it
and every child with it on a timeout.

`python tests/fake_gpu_server.py <library.so>` starts a server; `FakeGpuServer` is the client.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent

IMPORTED_ONCE = (
    "torch.distributed", "torch._subclasses.fake_tensor", "torch.testing._internal.distributed.fake_pg",
    "megatron.core", "megatron.core.transformer.transformer_layer", "megatron.core.models.gpt",
    "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
    "megatron_hdp.megatron.core_api.initialize", "megatron_hdp.megatron.core_api.model", "megatron_hdp.megatron.core_api.step",
    "megatron_hdp.harness.model", "megatron_hdp.offload",
)
"""What the server imports after torch.cuda is patched (the heavy part of every scenario's imports)."""


def serve(library: Path) -> None:
    """Import once, then fork a child per request read from stdin (module docstring) until stdin closes."""
    sys.path.insert(0, str(HERE))
    import fake_gpu

    fake_gpu.preload(library)
    fake_gpu.patch_torch_cuda()
    for module in IMPORTED_ONCE:
        importlib.import_module(module)
    answers = os.dup(1)
    children: dict[int, str] = {}
    pending = b""
    open_input = True
    while open_input or children:
        if select.select([0] if open_input else [], [], [], 0.05)[0]:
            chunk = os.read(0, 65536)
            open_input = bool(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in filter(None, lines):
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(fake_gpu, request, answers)
                children[pid] = request["id"]
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            answer = {"id": children.pop(pid), "returncode": os.waitstatus_to_exitcode(status)}
            os.write(answers, (json.dumps(answer) + "\n").encode())


def _child(fake_gpu, request: dict, answers: int) -> None:
    """In the forked child: stdin from /dev/null, stdout and stderr to the request's file, the scenario."""
    os.close(answers)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.dup2(output, 2)
    fake_gpu.run_scenario(request["scenario"], *request["args"])  # ends the process


class FakeGpuServer:
    """The client: starts the server on first use (again after a timeout killed it) and runs scenarios."""

    def __init__(self, library: Path, work: Path) -> None:
        self.library, self.work = library, work
        self.process: subprocess.Popen | None = None
        self.requests = 0

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        log = open(self.work / "server.log", "w")
        with log:
            return subprocess.Popen([sys.executable, str(Path(__file__)), str(self.library)], env=env,
                                    cwd=HERE.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                    start_new_session=True)  # its own process group: killed with its children

    def run(self, runs: list[tuple[str, ...]], *, timeout_s: float) -> list[tuple[int, str]]:
        """(return code, output) of each run, (scenario, *args), all started at once; every child is ended
        by the timeout (TimeoutError naming the runs that had not finished)."""
        if self.process is None or self.process.poll() is not None:
            self.process = self._start()
        ids = {}
        for run in runs:
            self.requests += 1
            output = self.work / f"run{self.requests}.log"
            ids[str(self.requests)] = (run, output)
            request = {"id": str(self.requests), "scenario": run[0], "args": list(run[1:]), "output": str(output)}
            self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        codes: dict[str, int] = {}
        deadline, pending = time.monotonic() + timeout_s, b""
        while len(codes) < len(ids):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                self.close()
                late = [" ".join(ids[i][0]) for i in ids if i not in codes]
                raise TimeoutError(f"fake-GPU scenarios still running after {timeout_s:.0f} s: {late}")
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                self.close()
                log = (self.work / "server.log").read_text()
                raise RuntimeError(f"the fake-GPU server ended before answering:\n{log[-4000:]}")
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for answer in map(json.loads, filter(None, lines)):
                codes[answer["id"]] = answer["returncode"]
        return [(codes[i], ids[i][1].read_text(errors="replace")) for i in ids]

    def close(self) -> None:
        """End the server and every scenario it still runs."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
