"""Start ``medha-runtime serve tiny`` on a free port, send one chat request, shut it down.

Run: ``python examples/server_client.py`` (needs the ``runtime`` extra and ``openai``).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy in time")


def main() -> int:
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "medha_runtime", "serve", "tiny", "--port", str(port)]
    cmd += ["--max-model-len", "256", "--kv-cache-tokens", "2048", "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30, max_retries=0)
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=16,
            temperature=0,
        )
        # the tiny model has random weights: the text is gibberish, the plumbing is real
        print("reply:", repr(reply.choices[0].message.content))
        print("usage:", reply.usage.model_dump())
        # two samples with their own seed streams; vLLM's extensions go in extra_body
        both = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            n=2,
            seed=1,
            max_tokens=8,
            logit_bias={"72": 5.0},  # token 72 is "H" in the tiny byte-level vocabulary
            extra_body={"repetition_penalty": 1.3, "min_p": 0.05},
        )
        print("n=2:", [c.text for c in both.choices], both.usage.model_dump())
    finally:
        proc.send_signal(signal.SIGTERM)  # in-flight requests end, exit code 0
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print("server exit code:", proc.returncode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
