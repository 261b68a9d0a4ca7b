"""Container launcher: enter the pod's namespaces, mount volumes, exec the command.

Run by the node agent as `python -I launch.py SPEC.json`, in a new session, with stdout
and stderr already pointing at the container's log file. Standard library only (it
runs before the container's own environment exists) and it replaces itself with the
container's program, so the container's pid is this process's pid.

SPEC: {"netns", "utsns": paths under /proc/<pause>/ns or null for hostNetwork,
       "hostname", "mounts": [{"source", "target", "readOnly"}], "cwd", "env", "argv"}
"""

import ctypes
import json
import os
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter(path: str, nstype: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        check(libc.setns(fd, nstype), f"setns {path}")
    finally:
        os.close(fd)


def bind(source: str, fd: int, target: str, read_only: bool) -> None:
    if not os.path.exists(target):
        # A target inside an earlier mount (a volume at /data, another at /data/x) is
        # created inside that volume, as container runtimes do.
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
    check(libc.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, MS_BIND | MS_REC, None),
          f"bind {source} -> {target}")
    if read_only:
        check(libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None),
              f"remount {target} read-only")


def _same_folder(path: str, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    if spec.get("netns"):
        enter(spec["netns"], CLONE_NEWNET)
    if spec.get("utsns"):
        enter(spec["utsns"], CLONE_NEWUTS)
        socket.sethostname(spec["hostname"])
    # A mount namespace of our own, private, so no bind below shows on the host.
    check(libc.unshare(CLONE_NEWNS), "unshare mount namespace")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    # Open every source before mounting anything: a volume mounted at /data must not
    # hide the source of a later mount that lives under /data on the host.
    fds = [os.open(m["source"], os.O_PATH) for m in spec["mounts"]]
    keep = [(path, os.open(path, os.O_PATH)) for path in spec.get("keep", []) if os.path.isdir(path)]
    for m, fd in zip(spec["mounts"], fds):
        bind(m["source"], fd, m["target"], m["readOnly"])
    # A volume over a parent of the repository or of Python hid them: bind them back.
    for path, fd in keep:
        if not _same_folder(path, fd):
            bind(path, fd, path, False)
    for fd in fds + [fd for _, fd in keep]:
        os.close(fd)
    os.chdir(spec["cwd"])
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as e:
        print(f"kubeshard launcher: exec {argv[0]!r}: {e.strerror}", file=sys.stderr, flush=True)
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    try:
        main()
    except OSError as e:
        print(f"kubeshard launcher: {e}", file=sys.stderr, flush=True)
        os._exit(128)
