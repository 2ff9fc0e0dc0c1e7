"""What can fail at start-up, checked before anything heavy is imported or started.

``medha-runtime serve`` calls these first, so a port in use or a missing GPU
is one line within a second, not an error after the engine's start-up.
"""

from __future__ import annotations

import glob
import os
import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; OSError (one line) if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "the port is in use" if exc.errno in (98, 48) else exc.strerror or str(exc)
        raise OSError(f"cannot listen on {host}:{port}: {why}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_device(device: str | None) -> None:
    """Refuse ``cuda`` on a machine without an NVIDIA device (without importing torch)."""
    if device != "cuda":
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        raise ValueError("--device cuda: CUDA_VISIBLE_DEVICES hides every GPU")
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/proc/driver/nvidia/version"):
        raise ValueError("--device cuda: this machine has no NVIDIA GPU (no /dev/nvidia*)")


def check_model_file(model: str) -> None:
    """Refuse a ``.gguf`` path that is missing or is not a GGUF file (reads 4 bytes).

    Only what is cheap and certain is checked here; everything else about the
    model (other names, directories, a damaged file past its magic) is the
    engine's to report at load.
    """
    path = os.path.expanduser(model)
    if not path.lower().endswith(".gguf") or os.path.isdir(path):
        return
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {model} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":  # medha_runtime.model.gguf.GGUF_MAGIC, without importing NumPy
        raise ValueError(f"{model}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
