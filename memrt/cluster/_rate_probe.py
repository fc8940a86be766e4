"""Measure TCP throughput between two addresses (used by EmulatedCluster.measure_rate)."""

import socket
import sys
import time


def serve(addr: str, port: int) -> None:
    with socket.create_server((addr, port)) as srv:
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 20):
                pass


def send(addr: str, port: int, seconds: float) -> float:
    payload = b"\0" * (1 << 20)
    for _ in range(100):  # the server may still be starting
        try:
            sock = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise SystemExit(f"cannot connect to {addr}:{port}")
    with sock:
        # Warm up past tbf's burst, then time a steady stream.
        sock.sendall(payload)
        sent, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            sock.sendall(payload)
            sent += len(payload)
        elapsed = time.perf_counter() - start
    return sent * 8 / elapsed


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        print(send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
