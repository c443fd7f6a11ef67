"""`kubectl port-forward` for simulated pods: listen on 127.0.0.1 of this machine, connect in the pods' network.

    python podsim_forward.py NETNS TARGET_IP TARGET_PORT     # prints the local port, then forwards until killed

The listening socket is made first, in this machine's network namespace; then the process moves to NETNS
(a /proc/PID/ns/net of the simulated cluster's network), where every connection to the target is made.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(netns: str, ip: str, port: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    fd = os.open(netns, os.O_RDONLY)
    if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns({netns})")
    os.close(fd)
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection((ip, port), timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
