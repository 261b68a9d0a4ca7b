"""The local node's "images": a small, explicit map from image reference to local command.

There is no container engine here, so an image stands for a program already on this
machine. Each entry gives what the image would: an ENTRYPOINT, a default CMD and a PATH.
Kubernetes' rules then apply unchanged: `command` replaces the entrypoint, `args`
replace the default arguments. Anything not in the map fails like a pull that found
nothing (ErrImagePull).

| image (any registry prefix, any tag)  | runs                                              |
|---------------------------------------|---------------------------------------------------|
| */kubeshard/shard-server              | .venv/bin/kubeshard serve-shard                   |
| */kubeshard/router                    | .venv/bin/kubeshard-router                        |
| */kubeshard/operator                  | .venv/bin/kubeshard-operator                      |
| */kubeshard/llamacpp-server           | llama.cpp's server from its engine environment    |
| */kubeshard/vllm-cpu                  | vLLM's CPU build from its engine environment      |
| redis, */redis                        | redis-server, as the official image's entrypoint  |
| python:3*                             | the command, with the repo's .venv python first   |
| busybox                               | the command, with busybox applets first in PATH   |
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from ..config import REPO_ROOT

VENV_BIN = REPO_ROOT / ".venv" / "bin"
SYSTEM_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]


class ImageNotFound(Exception):
    """No local command stands for this image (reported as ErrImagePull)."""


@dataclasses.dataclass(frozen=True)
class Image:
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    path: tuple[str, ...]
    # Rewrites the final argv the way the image's entrypoint script would (redis).
    entrypoint_script: Callable[[list[str]], list[str]] | None = None

    def argv(self, command: list[str] | None, args: list[str] | None) -> list[str]:
        """Kubernetes' command/args rules against this image's ENTRYPOINT and CMD."""
        if command:
            argv = list(command) + list(args or [])
        else:
            argv = list(self.entrypoint) + list(args if args else self.cmd)
            if self.entrypoint_script is not None:
                argv = self.entrypoint_script(argv)
        if not argv:
            raise ValueError("the container has no command and its image has no default")
        return argv

    @property
    def path_env(self) -> str:
        return ":".join(self.path)


def _redis_entrypoint(argv: list[str]) -> list[str]:
    """What the official image's docker-entrypoint.sh does before exec'ing its CMD."""
    argv = argv[1:]  # drop the stand-in for docker-entrypoint.sh
    if not argv or argv[0].startswith("-") or argv[0].endswith(".conf"):
        argv = ["redis-server", *argv]
    if argv[0] == "redis-server" and not (len(argv) > 1 and argv[1].endswith(".conf")):
        # Without a config file, the image turns protected mode off so that other pods
        # may connect (redis would otherwise refuse every non-loopback client).
        argv = [*argv, "--protected-mode", "no"]
    return argv


def _busybox_dir(cache: Path) -> Path:
    """A folder of busybox applet links: the busybox image's /bin."""
    bindir = cache / "busybox-bin"
    if not (bindir / "sh").exists():
        busybox = shutil.which("busybox")
        if busybox is None:
            raise ImageNotFound("busybox is not installed on this machine (hack/ensure-system-deps.sh)")
        bindir.mkdir(parents=True, exist_ok=True)
        subprocess.run([busybox, "--install", "-s", str(bindir)], check=True, timeout=30)
    return bindir


def _parse(image: str) -> tuple[list[str], str]:
    """'reg:5000/a/b:tag@sha256:..' -> (['reg:5000', 'a', 'b'], 'tag')."""
    ref = image.split("@", 1)[0]
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    return name.split("/"), tag


def resolve(image: str, state_dir: Path) -> Image:
    parts, tag = _parse(image)
    venv_path = (str(VENV_BIN), *SYSTEM_PATH)
    last_two = "/".join(parts[-2:])
    kubeshard = {
        "kubeshard/shard-server": ((str(VENV_BIN / "kubeshard"),), ("serve-shard",)),
        "kubeshard/router": ((str(VENV_BIN / "kubeshard-router"),), ()),
        "kubeshard/operator": ((str(VENV_BIN / "kubeshard-operator"),), ()),
    }
    if last_two in kubeshard:
        entrypoint, cmd = kubeshard[last_two]
        return Image(entrypoint, cmd, venv_path)
    engines = {"kubeshard/llamacpp-server": ("llamacpp", ("python3", "-m", "llama_cpp.server")),
               "kubeshard/vllm-cpu": ("vllm", ("vllm", "serve"))}
    if last_two in engines:
        # a peer engine's environment (hack/engines.sh NAME, under $KUBESHARD_CACHE/engines)
        from kubeshard_shard.runtimes.peers import PEERS

        name, entrypoint = engines[last_two]
        python = PEERS[name].python()
        if not python.is_file():
            raise ImageNotFound(f'image "{image}" stands for the {name} engine, which is not built '
                                f"here ({python}): run hack/engines.sh {name}")
        return Image(entrypoint, (), (str(python.parent), *SYSTEM_PATH))
    if parts[-1] == "redis":
        return Image(("docker-entrypoint.sh",), ("redis-server",), tuple(SYSTEM_PATH),
                     entrypoint_script=_redis_entrypoint)
    if parts[-1] == "python" and (tag.startswith("3") or tag == "latest"):
        return Image((), ("python3",), venv_path)
    if parts[-1] == "busybox":
        return Image((), ("sh",), (str(_busybox_dir(state_dir)), *SYSTEM_PATH))
    raise ImageNotFound(
        f'image "{image}" has no local stand-in on the kubeshard local node '
        "(known: */kubeshard/shard-server, */kubeshard/router, */kubeshard/operator, "
        "*/kubeshard/llamacpp-server, */kubeshard/vllm-cpu, redis, python:3*, busybox; see "
        "e2e/cluster/node/images.py)"
    )


def which(argv0: str, path: str) -> str | None:
    """Where argv[0] resolves inside a container with this PATH (None: not found)."""
    return shutil.which(argv0, path=path)
