# agents/jail_init.py — the first process of every jail: pid 1 of its PID namespace, inside the user and network
# namespaces bubblewrap made (agents/sandbox.py runs it with `bwrap --as-pid-1`, copied into the jail's read-only
# root as a file, never bound from the checkout; the standard library only, `python -I -S`).
#
# Owns, in this order, what must be in place before the jailed program's first instruction:
#   1. the process cap: RLIMIT_NPROC. In a user namespace of its own the kernel counts this uid's processes and
#      threads in that namespace alone (per-namespace ucounts, Linux 5.14+), so the cap is the call's own even where
#      no cgroup is (an ordinary user), and the jailed uid is never host uid 0, whom the kernel exempts from it;
#   2. (a process agent) the session relay: the jail's network namespace has only its own loopback, so the program
#      reaches its loopback session through a listener on 127.0.0.1:<the session's port> here that forwards each
#      connection to a Unix socket bound in from the host (agents/process.py's SessionRelay, which forwards to the
#      session's server). Nothing else on the host, and no outside address, is reachable;
#   3. the program, as this process's child; then it reaps every orphan until the program ends and exits the way
#      the program did (128 + N for a signal N, as bwrap reports one). When pid 1 exits the kernel kills whatever is
#      left in the namespace. A program that is not pid 1 keeps the ordinary signal semantics (pid 1 ignores
#      signals it has no handler for), and bwrap's own reaper, which is not this file, is never in the jail: its
#      /proc/1 would name the host path of the bwrap binary.
# Never: runs as anything but the jail's uid, opens any other route out, or outlives the program.
import json
import os
import resource
import selectors
import socket
import sys
import threading


def relay(listener: socket.socket, target: str) -> None:
    """Forward every connection accepted on `listener` to the Unix socket `target`, bytes both ways, one thread
    (a thread per connection would spend the process cap)."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    peers: dict[socket.socket, socket.socket] = {}

    def close(sock: socket.socket) -> None:
        other = peers.pop(sock, None)
        if other is not None:
            peers.pop(other, None)
        for end in (sock, other):
            if end is not None:
                selector.unregister(end)
                end.close()

    while True:
        for key, _ in selector.select():
            sock = key.fileobj
            if sock is listener:
                client, _ = listener.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    upstream.connect(target)
                except OSError:
                    client.close()
                    upstream.close()
                    continue
                peers[client], peers[upstream] = upstream, client
                selector.register(client, selectors.EVENT_READ)
                selector.register(upstream, selectors.EVENT_READ)
                continue
            if sock not in peers:                       # its pair was closed earlier in this round
                continue
            try:
                data = sock.recv(65536)
                if data:
                    peers[sock].sendall(data)
                    continue
            except OSError:
                pass
            close(sock)


def main(spec: dict) -> None:
    # the program's processes and this one's own tasks (itself, and the relay's thread where there is one)
    cap = spec["processes"] + 1 + (spec["relay"] is not None)
    resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    if spec["relay"] is not None:
        # bound before the program starts, so its first request never races the listener
        listener = socket.create_server(("127.0.0.1", spec["relay"]["port"]), backlog=64)
        threading.Thread(target=relay, args=(listener, spec["relay"]["socket"]), daemon=True).start()
    argv = spec["argv"]
    program = os.fork()
    if program == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as error:
            sys.stderr.write(f"jail: cannot run {argv[0]!r}: {error.strerror}\n")
        os._exit(127)
    while True:                                         # pid 1 reaps every orphan of the namespace
        pid, status = os.wait()
        if pid == program:
            break
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
