"""A `jaxengine serve` of the embedded default model in a subprocess on 127.0.0.1, shared
by the server tests of a module, and an in-process `LLM` of the same settings as their
reference."""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import openai
import pytest

from jaxengine.run_config import DEFAULT_MODEL

API_KEY = "test-key"
# The server's engine arguments, and the reference LLM's: equal settings give equal tokens.
ENGINE = {"max_num_seqs": 16, "max_model_len": 512}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process: its base URL, its output so far, and how to stop it."""

    def __init__(self, *flags: str, api_key: str | None = API_KEY):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "jaxengine", "serve", "default", "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--max-num-seqs", str(ENGINE["max_num_seqs"]), "--max-model-len", str(ENGINE["max_model_len"])]
        if api_key is not None:
            args += ["--api-key", api_key]
        env = {k: v for k, v in os.environ.items() if k != "JAXENGINE_API_KEY"}
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([*args, *flags], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not answer within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM, then the exit code (SIGKILL after 60 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    srv = Server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    from jaxengine import LLM

    with LLM(DEFAULT_MODEL, warm_up=False, **ENGINE) as llm:
        yield llm
